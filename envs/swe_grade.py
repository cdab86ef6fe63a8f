"""SWE-bench's grading of a diff, without Docker: the harness of ``env=swe``.

For one row and one diff (the agent's, the gold ``patch``, or none), in a fresh workspace of
the row's base (:class:`agentgym.tools.workspace.Workspace`):

1. the diff, without its edits to test files and test configuration
   (:func:`agentgym.envs.swe_rows.without_test_edits`), is applied as SWE-bench's harness
   applies it: ``git apply``, else ``patch --batch --fuzz=5 -p1``;
2. ``test_patch`` is applied;
3. the row's test command runs (:func:`agentgym.envs.swe_rows.test_command`) between
   SWE-bench's output markers, under its own wall limit;
4. swebench's own log parser and grading (``parse_log_pytest``, ``get_eval_tests_report``,
   ``get_resolution_status``, imported from the ``swebench`` package) read the log:
   resolved when every FAIL_TO_PASS and PASS_TO_PASS test passes.

A harness that cannot do its part (the sandbox does not start, ``test_patch`` does not
apply, the tests pass their wall limit, the runner reports no test at all) is an
infrastructure failure (:attr:`Grade.infra`), which the env reports as the other envs
report theirs: the episode is kept out of the gradient (``rollout.on_infra_error``).

``agentgym swe validate data=FILE [swe.repos=FOLDER] [limit=N] [swe.validate_workers=2]``
(:func:`validate`) runs every row's gold ``patch`` and an empty diff through the harness and
reports, per row and in total, which resolve; its exit status is 1 when a gold patch does
not resolve or an empty diff does (a row whose tests cannot tell a fix from no change).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import shlex
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from agentgym.core.paths import cache_dir
from agentgym.envs.swe_rows import find_repo, test_command, without_test_edits
from agentgym.tools.workspace import (CommandLimits, RepoCache, Workspace, clean_stale,
                                     python_env)

logger = logging.getLogger(__name__)

APPLY_FAILED = ">>>>> Patch Apply Failed"
TEST_PATCH_FAILED = ">>>>> Test Patch Apply Failed"
START, END = ">>>>> Start Test Output", ">>>>> End Test Output"  # swebench's markers
_INSIDE = "/agentgym-grade"
_CLEANED: set[str] = set()  # workspace roots cleaned of dead processes' folders, this process


@dataclass
class Grade:
    """One diff graded.

    Attributes:
        resolved: every FAIL_TO_PASS and PASS_TO_PASS test passes (SWE-bench's RESOLVED_FULL).
        applied: the diff applied (an empty diff applies).
        f2p, p2p: the shares of FAIL_TO_PASS / PASS_TO_PASS tests that pass (1.0 when there
            are none, as swebench computes them).
        test_s: wall seconds of the test command.
        infra: why the harness could not grade ('' when it could).
        dropped: paths whose edits were dropped (tests, test configuration).
        statuses: the parsed log, test id -> PASSED / FAILED / ERROR / SKIPPED / XFAIL.
        log: the test command's output (its head and tail when long).
    """

    resolved: bool
    applied: bool
    f2p: float = 0.0
    p2p: float = 0.0
    test_s: float = 0.0
    infra: str = ""
    dropped: list[str] = field(default_factory=list)
    statuses: dict = field(default_factory=dict)
    log: str = ""


def _script(command: str) -> str:
    patch = f"{_INSIDE}/model.patch"
    return "\n".join([
        f"if [ -s {patch} ]; then",
        f"  git apply --verbose {patch} >/dev/null 2>&1 || "
        f"patch --batch --fuzz=5 -p1 -i {patch} >/dev/null 2>&1 || "
        f"{{ echo {shlex.quote(APPLY_FAILED)}; exit 0; }}",
        "fi",
        f"if [ -s {_INSIDE}/test.patch ]; then git apply {_INSIDE}/test.patch 2>&1 || "
        f"{{ echo {shlex.quote(TEST_PATCH_FAILED)}; exit 0; }}; fi",
        f"echo {shlex.quote(START)}",
        command,
        "rc=$?",
        f"echo {shlex.quote(END)}",
        'echo "TEST_EXIT_CODE: $rc"'])


def grade(row: dict, base: Path, diff: str, root: Path, limits: CommandLimits,
          test_s: float, python: str | None = None) -> Grade:
    """Grade ``diff`` for ``row`` over its ``base`` (see the module docstring)."""
    from swebench.harness.constants import FAIL_TO_PASS, PASS_TO_PASS
    from swebench.harness.grading import (compute_fail_to_pass, compute_pass_to_pass,
                                          get_eval_tests_report, get_resolution_status)
    from swebench.harness.log_parsers.python import parse_log_pytest

    kept, dropped = without_test_edits(diff, str(row["test_patch"]))
    with tempfile.TemporaryDirectory(prefix="swe-grade-") as tmp:
        Path(tmp, "model.patch").write_text(kept)
        Path(tmp, "test.patch").write_text(str(row["test_patch"]))
        Path(tmp).chmod(0o755)
        with Workspace(base, root, limits, python, binds={tmp: _INSIDE}) as ws:
            t0 = time.perf_counter()
            r = ws.run(_script(test_command(row)), wall_s=test_s)
            took = time.perf_counter() - t0
    out = r.output
    if r.error:
        return Grade(False, False, infra=f"the harness's sandbox: {r.error}", dropped=dropped)
    if APPLY_FAILED in out:
        return Grade(False, False, dropped=dropped, log=out)
    if TEST_PATCH_FAILED in out:
        return Grade(False, True, infra="the row's test_patch does not apply to its base "
                     f"commit: {out.split(TEST_PATCH_FAILED)[0].strip()[-300:]}",
                     dropped=dropped, log=out)
    if r.timed_out:
        return Grade(False, True, test_s=took, infra=f"the tests passed their wall limit "
                     f"({test_s:.0f} s, swe.test_s)", dropped=dropped, log=out)
    log = out.split(START, 1)[-1].split(END, 1)[0]
    statuses = parse_log_pytest(log, None)
    if not statuses:
        return Grade(False, True, test_s=took, infra="the test runner reported no test: "
                     + (log.strip()[-300:] or "no output"), dropped=dropped, log=out)
    report = get_eval_tests_report(statuses, {FAIL_TO_PASS: list(row["FAIL_TO_PASS"]),
                                              PASS_TO_PASS: list(row["PASS_TO_PASS"])})
    return Grade(get_resolution_status(report) == "RESOLVED_FULL", True,
                 compute_fail_to_pass(report), compute_pass_to_pass(report), took, "",
                 dropped, statuses, out)


def swe_root() -> Path:
    """Where the bases, the workspaces and the built-in repository live."""
    return cache_dir() / "swe"


@functools.lru_cache(maxsize=None)
def repo_cache() -> RepoCache:
    return RepoCache(swe_root() / "bases")


def repo_python(row: dict, python: str, packages: list[str]) -> str:
    """The interpreter ``row``'s commands and tests get as ``python``: ``python`` when the
    user names one (``swe.python``), else the repository's own environment, made once
    (:func:`agentgym.tools.workspace.python_env`): ``packages`` (``swe.packages``) and the
    row's ``requirements``, copied from this interpreter."""
    if python:
        return python
    wanted = [*packages, *[str(r) for r in row.get("requirements") or []]]
    return python_env(swe_root() / "envs", str(row["repo"]), wanted)


def workspace_root() -> Path:
    """The workspace root; the first call in a process removes dead processes' folders."""
    root = swe_root() / "workspaces"
    root.mkdir(parents=True, exist_ok=True)
    if str(root) not in _CLEANED:
        _CLEANED.add(str(root))
        if removed := clean_stale(root):
            logger.info("removed %d workspaces of processes that are gone from %s", removed,
                        root)
    return root


# -- agentgym swe validate data=FILE (the manifest's commands) -----------------------------
def _validate_row(swe, row: dict) -> tuple[dict, object, object]:
    base = repo_cache().base(row["repo"], find_repo(row, swe.repos), row["base_commit"])
    limits = CommandLimits(wall_s=swe.test_s, cpu_s=swe.test_s, memory_mb=swe.memory_mb,
                           max_procs=swe.max_procs, disk_mb=swe.disk_mb)
    python = repo_python(row, swe.python, swe.packages)
    run = lambda diff: grade(row, base, diff, workspace_root(), limits,  # noqa: E731
                             swe.test_s, python)
    return row, run(str(row.get("patch") or "")), run("")


def _verdict(g) -> str:
    if g.infra:
        return f"harness failed ({g.infra[:120]})"
    return (f"{'resolved' if g.resolved else 'not resolved'} (F2P {g.f2p:.2f}, P2P {g.p2p:.2f}"
            f"{'' if g.applied else ', did not apply'})")


def validate(rows: list[dict], swe):
    """Yield a line per row (its gold patch's and an empty diff's verdicts) and a total;
    return 1 when a row is not as it should be, else 0."""
    bad, t0 = 0, time.perf_counter()
    yield f"validating {len(rows)} rows: the gold patch and an empty diff each"
    with concurrent.futures.ThreadPoolExecutor(swe.validate_workers) as pool:
        for row, gold, empty in pool.map(lambda r: _validate_row(swe, r), rows):
            ok = gold.resolved and not empty.resolved and not empty.infra
            bad += not ok
            yield (f"{'ok  ' if ok else 'FAIL'} {row['instance_id']}: gold {_verdict(gold)}; "
                   f"empty diff {_verdict(empty)}; tests {gold.test_s:.1f} s")
    yield (f"{len(rows) - bad} of {len(rows)} rows valid (the gold patch resolves, an empty "
           f"diff does not) in {time.perf_counter() - t0:.1f} s")
    return 1 if bad else 0
