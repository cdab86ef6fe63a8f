"""Each env owns itself: no module outside ``envs/`` names a concrete env, and an env added
as one file under ``envs/`` (docs/ENVS.md's example) trains with no edit anywhere else."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agentgym.envs.manifest import manifest_of
from agentgym.envs.registration import discovered

ROOT = Path(__file__).resolve().parents[1]
#: the library outside envs/ (bench/, scripts/ and tests/ choose envs; they may name them)
OUTSIDE = ("agentgym", "trainers", "tools", "retriever_server")
#: modules of envs/ that serve every env (any other is one env's)
SHARED = {"base", "checker", "manifest", "registration", "plugins", "function_calling",
          "judge", "rewards", "math_reward"}
#: the one module outside envs/ that may import the shipped envs' sections by name: the
#: typed config lists them as fields (tests/test_config_sections.py keeps them equal to
#: the manifests'); it still names no env by its short name, id or class
TYPED_CONFIG = "agentgym/config.py"
#: words that are an env's short name but mean something else where they stand
NOT_AN_ENV = {
    ("agentgym/serving/openai_common.py", "code"),  # the "code" field of OpenAI's errors
    ("agentgym/serving/agents.py", "agent"),  # the agent= key and a thread-name prefix
    ("tools/verifiers_worker.py", "agent"),  # verifiers' own config key for its agent seat
    ("tools/_sandbox_worker.py", "code"),  # the sandbox protocol's "code" field
    ("tools/sandbox_local.py", "code"),  # the same field, sent
    ("retriever_server/batcher.py", "search"),  # a thread-name prefix
}
_CONFIG_NAMES = {"cfg", "sub", "config", "c"}


def _is_config(node: ast.expr) -> bool:
    """``cfg``, ``sub``, ``self.cfg`` …: an expression that names the run's config."""
    if isinstance(node, ast.Name):
        return node.id in _CONFIG_NAMES
    return isinstance(node, ast.Attribute) and node.attr in _CONFIG_NAMES


def env_names_outside_envs(root: Path = ROOT, folders: tuple[str, ...] = OUTSIDE) -> list[str]:
    """Every place outside envs/ that names a concrete env: its short name or id (a
    string), its class or one of its config sections' classes (a name), its config section
    (``cfg.search``), or a module of envs/ that is one env's (an import)."""
    classes = discovered()
    words = {c.env_short for c in classes} | {c.env_id for c in classes}
    declared = [manifest_of(c).sections for c in classes]
    own = {s for d in declared for s in d.values() if s.__module__.startswith("agentgym.envs.")}
    section_classes = {s.__name__ for d in declared for s in d.values()}
    names = {c.__name__ for c in classes} | {s.__name__ for s in own}
    sections = {n for d in declared for n, s in d.items() if s in own}
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                hit = None
                if isinstance(node, ast.Constant) and node.value in words \
                        and (rel, node.value) not in NOT_AN_ENV:
                    hit = f"the string {node.value!r}"
                elif isinstance(node, (ast.Import, ast.ImportFrom)) and not (
                        rel == TYPED_CONFIG and isinstance(node, ast.ImportFrom)
                        and {a.name for a in node.names} <= section_classes):
                    mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                        [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                    for m in mods:
                        parts = m.split(".")
                        if parts[:2] == ["agentgym", "envs"] and len(parts) > 2 and \
                                parts[2] not in SHARED and \
                                (ROOT / "envs" / f"{parts[2]}.py").is_file():
                            hit = f"an import of {m}"
                elif isinstance(node, ast.Name) and node.id in names and not (
                        rel == TYPED_CONFIG and node.id in section_classes):
                    hit = f"the name {node.id}"
                elif isinstance(node, ast.Attribute) and node.attr in sections \
                        and _is_config(node.value):
                    hit = f"the config section .{node.attr}"
                if hit:
                    found.append(f"{rel}:{node.lineno}: {hit}")
    return found


def test_no_module_outside_envs_names_a_concrete_env():
    assert len(discovered()) >= 4  # it knows the envs it looks for
    assert env_names_outside_envs() == []


def test_the_check_finds_what_it_is_for(tmp_path):
    (tmp_path / "trainers").mkdir()
    (tmp_path / "trainers" / "leak.py").write_text(
        'import agentgym.envs.search_demos\nimport agentgym.envs.base\n'
        'def f(cfg, e):\n    return cfg.search.reward == "em" and "code" and SearchEnv '
        'and e.code and cfg.sandbox\n')
    found = [f.split(": ", 1)[1] for f in env_names_outside_envs(tmp_path, ("trainers",))]
    assert sorted(found) == sorted(["an import of agentgym.envs.search_demos",
                                    "the config section .search", "the string 'code'",
                                    "the name SearchEnv"])


def _example() -> str:
    """docs/ENVS.md's ``envs/echo.py``: the code block after that heading's file line."""
    text = (ROOT / "docs" / "ENVS.md").read_text(encoding="utf-8")
    section = text[text.index("`envs/echo.py`, the whole of it"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def checkout_with_echo(tmp_path) -> Path:
    """The repository's packages copied as they are, plus envs/echo.py: nothing else."""
    tracked = subprocess.run(["git", "ls-files", "agentgym", "envs", "tools", "trainers",
                              "retriever_server"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    repo = tmp_path / "repo"
    for rel in tracked:
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, repo / rel)
    (repo / "envs" / "echo.py").write_text(_example(), encoding="utf-8")
    return repo


def _agentgym(repo: Path, *argv: str) -> subprocess.CompletedProcess:
    # the copy, before the installed one; the checkout's data: without it the copy's tiny
    # model would train its tokenizer on other text and rebuild the shared cache's `tiny`
    # under every other process that uses it (a server of tests/test_sglang_client.py
    # decoded with the other tokenizer when this test ran beside the tier)
    env = {**os.environ, "PYTHONPATH": str(repo), "AGENTGYM_DATA": str(ROOT / "data")}
    return subprocess.run([sys.executable, "-m", "agentgym.cli", *argv], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=900)


def test_a_new_env_is_one_file_under_envs(checkout_with_echo, tmp_path):
    repo = checkout_with_echo
    shown = _agentgym(repo, "config", "env=echo", "echo.word=red")
    assert shown.returncode == 0, shown.stderr[-3000:]
    printed = json.loads(shown.stdout)
    assert printed["echo"] == {"word": "red"}  # its own config section
    assert printed["rollout"]["max_turns"] == 2 and printed["trainer"]["eval_data"] == "test"
    checked = _agentgym(repo, "check-env", "echo")
    assert checked.returncode == 0 and "ok    agentgym/Echo-v0" in checked.stdout, \
        checked.stdout + checked.stderr[-3000:]
    run = tmp_path / "run"
    done = _agentgym(repo, "train", "env=echo", "model=tiny", f"run_dir={run}",
                     "trainer.total_steps=1", "trainer.prompts_per_step=2", "n=2",
                     "trainer.eval_limit=2", "rollout.max_tokens_per_turn=8")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in steps if "rollout/reward" in m]
    assert [m["step"] for m in trained] == [1] and trained[0]["rollout/count"] == 4
    assert "rollout/said_word" in trained[0]  # the env's own episode metric
    assert "no demonstration builder" in done.stdout + done.stderr  # RL from the model as is
