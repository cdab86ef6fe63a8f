"""The house stays as drawn: every import between packages goes down the layers of
scripts/architecture.py (docs/ARCHITECTURE.md), and no module imports itself round a
circle."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import architecture as arch  # noqa: E402


def test_every_import_goes_down_the_layers():
    deps = arch.imports()
    assert len(deps) > 80 and {"agentgym.trainers.loop", "agentgym.envs.search"} <= set(deps)
    assert arch.violations(deps) == []


def test_docs_architecture_table_is_the_codes():
    """docs/ARCHITECTURE.md's table of floors is written from LAYERS (scripts/architecture.py
    rewrites it); a changed table without the doc, or the reverse, fails here."""
    assert arch.documented_table() == arch.floors_table()


def test_relative_imports_and_registry_strings_count(tmp_path, monkeypatch):
    pkg = tmp_path / "agentgym" / "envs"
    pkg.mkdir(parents=True)
    (tmp_path / "agentgym" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from . import base\n")
    (pkg / "base.py").write_text("from ..trainers import grpo\n")
    (pkg / "reg.py").write_text('SPEC = "agentgym.trainers.grpo:train"\n')
    (tmp_path / "agentgym" / "trainers").mkdir()
    (tmp_path / "agentgym" / "trainers" / "__init__.py").write_text("")
    (tmp_path / "agentgym" / "trainers" / "grpo.py").write_text("")
    monkeypatch.setattr(arch, "ROOT", tmp_path)
    monkeypatch.setattr(arch, "PACKAGES", ("agentgym",))
    deps = arch.imports()
    assert deps["agentgym.envs"] == {"agentgym.envs.base"}
    assert deps["agentgym.envs.base"] == {"agentgym.trainers.grpo"}  # relative, two up
    assert deps["agentgym.envs.reg"] == {"agentgym.trainers.grpo"}  # a registry string
    assert arch.imports(registry=False)["agentgym.envs.reg"] == set()
    assert len(arch.violations(deps)) == 2


def test_no_import_circles():
    assert arch.module_cycles(arch.imports(registry=False)) == []


def test_the_trajectory_path_names_functions_that_exist():
    assert arch.check_path() == []


def test_every_module_belongs_to_a_unit_and_the_table_has_no_circle():
    for module in arch.imports():
        assert arch.unit_of(module) in arch.LAYERS
    levels = arch.levels({u: set(allowed) for u, allowed in arch.LAYERS.items()})
    for unit, allowed in arch.LAYERS.items():  # the table itself is a stack of floors
        assert all(levels[a] < levels[unit] for a in allowed), unit


def test_the_checks_catch_what_they_are_for():
    up = {"agentgym.envs.search": {"agentgym.trainers.grpo"}, "agentgym.trainers.grpo": set()}
    assert arch.violations(up) == ["agentgym.envs.search -> agentgym.trainers.grpo "
                                   "(agentgym.envs may not import agentgym.trainers)"]
    sideways = {"agentgym.serving.serve": {"agentgym.data.rows"}}
    assert len(arch.violations(sideways)) == 1
    ring = {"tools.a": {"tools.b"}, "tools.b": {"tools.c"}, "tools.c": {"tools.a"}, "tools.d": set()}
    assert arch.module_cycles(ring) == [["tools.a", "tools.b", "tools.c"]]



def lazy_imports_without_reason(path: Path) -> list[int]:
    """Lines of ``path`` where a function imports a project module with no comment saying
    why (on the import's lines or the line above it)."""
    lines = path.read_text().splitlines()
    out = []
    for fn in ast.walk(ast.parse("\n".join(lines))):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            module = (node.module if isinstance(node, ast.ImportFrom) and not node.level else
                      node.names[0].name if isinstance(node, ast.Import) else "")
            if not (module or "").startswith("agentgym"):
                continue
            said = lines[node.lineno - 2:node.end_lineno]
            if not any("#" in line for line in said):
                out.append(node.lineno)
    return out


def test_an_import_inside_a_function_says_why(tmp_path):
    """Imports stand at the head of the file; one left inside a function (its module is
    heavy or optional) carries its reason (``# lazy: loads torch``)."""
    missing = {}
    for package in arch.PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if lines := lazy_imports_without_reason(path):
                missing[str(path.relative_to(ROOT))] = lines
    assert not missing, f"function-level imports with no reason: {missing}"
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from agentgym.core import paths\n\n\n"
                      "def g():\n    from agentgym.core import paths  # lazy: a reason\n")
    assert lazy_imports_without_reason(sample) == [2]
