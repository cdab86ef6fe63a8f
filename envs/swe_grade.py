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
"""

from __future__ import annotations

import logging
import shlex
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from agentgym.envs.swe_rows import test_command, without_test_edits
from agentgym.tools.workspace import CommandLimits, Workspace

logger = logging.getLogger(__name__)

APPLY_FAILED = ">>>>> Patch Apply Failed"
TEST_PATCH_FAILED = ">>>>> Test Patch Apply Failed"
START, END = ">>>>> Start Test Output", ">>>>> End Test Output"  # swebench's markers
_INSIDE = "/agentgym-grade"


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
        f"git apply {_INSIDE}/test.patch 2>&1 || {{ echo {shlex.quote(TEST_PATCH_FAILED)}; "
        "exit 0; }",
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
