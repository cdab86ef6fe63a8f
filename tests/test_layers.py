"""The house stays as drawn: every import between packages goes down the layers of
scripts/architecture.py (docs/ARCHITECTURE.md), no module imports itself round a circle,
and the old import paths of the pre-layout package still work, with a warning."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import architecture as arch  # noqa: E402


def test_every_import_goes_down_the_layers():
    deps = arch.imports()
    assert len(deps) > 80 and {"agentgym.trainers.grpo", "agentgym.envs.search"} <= set(deps)
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


def test_old_import_paths_work_for_one_release_with_a_warning():
    code = textwrap.dedent("""
        import warnings
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as w:
            import agentgym.types as old
            import agentgym.core.types as new
            assert old is new and old.Trajectory is new.Trajectory
            from agentgym.engines.hf import HFEngine
            from agentgym.rollout.engines.hf import HFEngine as H2
            assert HFEngine is H2
            from agentgym.manager import GenerationManager
            from agentgym.models import resolve_model
            from agentgym.data import load_rows
            from agentgym.models.zoo import resolve_model as r2
            assert resolve_model is r2
            from agentgym.trainers.run import Hooks
            from agentgym.trainers.grpo import collect
            from agentgym.trainers import local_rollout, sampling
            assert Hooks is local_rollout.Hooks and collect is sampling.collect
        texts = [str(x.message) for x in w if x.category is DeprecationWarning]
        for old, new in [("agentgym.types", "agentgym.core.types"),
                         ("agentgym.engines", "agentgym.rollout.engines"),
                         ("agentgym.manager", "agentgym.rollout.manager"),
                         ("agentgym.models.resolve_model", "agentgym.models.zoo.resolve_model"),
                         ("agentgym.data.load_rows", "agentgym.data.rows.load_rows"),
                         ("agentgym.trainers.run.Hooks", "agentgym.trainers.hooks.Hooks"),
                         ("agentgym.trainers.grpo.collect", "agentgym.trainers.steps.collect")]:
            assert any(t.startswith(f"{old} moved to {new}") for t in texts), (old, texts)
        try:
            from agentgym.models import no_such_name
        except ImportError as e:
            assert "no_such_name" in str(e)
        else:
            raise AssertionError("an unknown name imported")
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_the_second_passs_old_names_work_for_one_release_with_a_warning():
    """Issue 38's renames and moves: each old name still gives the new object, and says
    where it went."""
    code = textwrap.dedent("""
        import asyncio, warnings
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            from agentgym.trainers.local_rollout import LocalRollout, Hooks as H0
            from agentgym.trainers.async_rollout import AsyncRollout
            from agentgym.trainers.sampling import SyncSteps as S0
            from agentgym.trainers.samples import write_samples as ws0
            from agentgym.trainers.grpo import score, open_session, Session
            from agentgym.config import SearchConfig, SandboxConfig
            from agentgym.presets import ENV_PRESETS
            from agentgym.data.demo_builders import search_demo, code_demo
            from agentgym.data.arith import train_rows
            from agentgym.data.answerable import answerable
        from agentgym.trainers.workers import LocalWorkers
        from agentgym.trainers.hooks import Hooks
        from agentgym.trainers.async_steps import AsyncSteps
        from agentgym.trainers.steps import SyncSteps
        from agentgym.trainers.sample_log import write_samples
        from agentgym.trainers import phases, session
        from agentgym.envs.search import SearchConfig as SC
        from agentgym.tools.sandbox import SandboxConfig as SB
        from agentgym.envs import search_demos, code_demos, arith, answerable as ans
        assert LocalRollout is LocalWorkers and H0 is Hooks and AsyncRollout is AsyncSteps
        assert S0 is SyncSteps and ws0 is write_samples
        assert score is phases.score and open_session is session.open_session
        # agentgym.config names the env sections again (Config's typed fields): no warning
        assert Session is session.Session and SearchConfig is SC and SandboxConfig is SB
        assert ENV_PRESETS["code"]["rollout.max_turns"] == 4
        assert search_demo is search_demos.search_demo and code_demo is code_demos.code_demo
        assert train_rows is arith.train_rows and answerable is ans.answerable
        moved = [str(x.message) for x in w if x.category is DeprecationWarning]
        for old in ("agentgym.trainers.local_rollout moved to agentgym.trainers.workers",
                    "LocalRollout moved to agentgym.trainers.workers.LocalWorkers",
                    "AsyncRollout moved to agentgym.trainers.async_steps.AsyncSteps",
                    "agentgym.trainers.sampling moved to agentgym.trainers.steps",
                    "agentgym.trainers.grpo.score moved to agentgym.trainers.phases.score",
                    "ENV_PRESETS moved", "search_demo moved to agentgym.envs.search_demos",
                    "agentgym.data.arith moved to agentgym.envs.arith"):
            assert any(old in m for m in moved), (old, moved)
        print("old names ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "old names ok" in out.stdout


def test_batch_extra_and_manager_rollout_still_answer_with_a_warning():
    import warnings

    import torch

    from agentgym.trainers.batch import Batch
    z = torch.zeros(1, 2)
    b = Batch(z.long(), z.long(), z, z, torch.zeros(1), ["u"], z, torch.zeros(1).bool())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        b.extra["adv"] = torch.ones(1, 2)
        assert b.adv is not None and float(b.adv.sum()) == 2.0
        assert list(b.extra) == ["adv"] and "old_logp" not in b.extra
        del b.extra["adv"]
        assert b.adv is None
    assert any("Batch.extra" in str(x.message) for x in w)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            b.extra["advantage"] = z
        except KeyError as e:
            assert "adv" in str(e)  # names the valid fields
        else:
            raise AssertionError("an unknown field was accepted")

