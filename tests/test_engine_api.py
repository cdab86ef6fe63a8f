"""The engine is tested through its public face: no test reads an engine's private
attribute (its lock, queue, flags or the parts under it), and one class steps the
scheduler (the core, :mod:`agentgym.rollout.engines.core`), which one loop drives."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: names the tests give an engine or its parts
ENGINE_NAMES = {"engine", "eng", "runner", "scheduler", "sched", "core", "decoder", "pool"}


def _private_reads(source: str) -> list[tuple[int, str]]:
    """``(line, "name._attr")`` for each private attribute read off an engine-like name
    (``engine._queue``, ``engine.scheduler._decoder``, ``self.engine._cv``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else \
            owner.attr if isinstance(owner, ast.Attribute) else None
        if name in ENGINE_NAMES:
            found.append((node.lineno, f"{name}.{node.attr}"))
    return found


def test_the_check_sees_a_private_read():
    assert _private_reads("engine._queue\nx = engine.scheduler._decoder\nengine.idle()\n") \
        == [(1, "engine._queue"), (2, "scheduler._decoder")]


def test_no_test_reads_an_engines_private_attributes():
    bad = [f"{p.name}:{line}: {what}" for p in sorted((ROOT / "tests").glob("*.py"))
           if p.name != Path(__file__).name
           for line, what in _private_reads(p.read_text())]
    assert not bad, "tests reaching into an engine (use idle(), waiting(), " \
                    "stepping_thread() or a public attribute):\n" + "\n".join(bad)


def test_one_class_steps_the_scheduler():
    """``scheduler.step()`` is called in the core only; the front calls ``core.step``."""
    calls = re.compile(r"\b(sched|scheduler)\.step\(\)")
    where = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "agentgym").rglob("*.py")
                   if calls.search(p.read_text()))
    assert where == ["agentgym/rollout/engines/core.py"]
