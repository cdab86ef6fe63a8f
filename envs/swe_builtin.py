"""``env=swe``'s built-in tasks: a small repository made here, on the fly, with one bug per
task, in SWE-bench's row format (what ``reset()`` without a row plays, and what the tests
grade). Each task's base commit holds the bug and not the test that shows it; the gold
``patch`` fixes it; ``test_patch`` adds that test (FAIL_TO_PASS) beside the tests that
already pass (PASS_TO_PASS).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from agentgym.tools.workspace import git

REPO = "agentgym/minicalc"
_INIT = '"""minicalc: small numeric helpers."""\n\nfrom minicalc.ops import clamp, mean\n'
_OPS = '''"""Numeric helpers."""


def clamp(x, lo, hi):
    """x limited to [lo, hi]."""
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x


def mean(values):
    """The arithmetic mean of a non-empty sequence."""
    values = list(values)
    if not values:
        raise ValueError("mean() of an empty sequence")
    return sum(values) / len(values)
'''
_TESTS = '''from minicalc import clamp, mean


def test_clamp_inside():
    assert clamp(5, 0, 10) == 5


def test_mean_one():
    assert mean([4]) == 4
'''
#: (instance suffix, the bug (old, new) in ops.py, the hidden test, the shipped tests the
#: bug also fails, the statement)
_TASKS = [
    ("clamp-high", ("    if x > hi:\n", "    if x < hi:\n"),
     "\n\ndef test_clamp_high():\n    assert clamp(15, 0, 10) == 10\n", ["test_clamp_inside"],
     "clamp() returns the upper bound for values inside the range: `clamp(5, 0, 10)` gives "
     "10, and `clamp(15, 0, 10)` gives 15 instead of 10."),
    ("mean-len", ("    return sum(values) / len(values)\n",
                  "    return sum(values) / (len(values) + 1)\n"),
     "\n\ndef test_mean_two():\n    assert mean([2, 4]) == 3\n", ["test_mean_one"],
     "mean() is wrong for every input: `mean([2, 4])` returns 2.0, but the mean of 2 and 4 "
     "is 3. `mean([4])` also returns 2.0."),
]


def _commit(repo: Path, files: dict[str, str], message: str) -> str:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git(["add", "--all"], cwd=repo)
    git(["commit", "--quiet", "-m", message], cwd=repo)
    return git(["rev-parse", "HEAD"], cwd=repo, text=True).stdout.strip()


def make_repo(dest: Path) -> list[dict]:
    """Write the repository at ``dest`` (a git folder) and return its tasks' rows."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="minicalc-", dir=dest.parent) as tmp:
        repo = Path(tmp) / "repo"
        repo.mkdir()
        git(["init", "--quiet", "--initial-branch=main"], cwd=repo)
        good = _commit(repo, {"minicalc/__init__.py": _INIT, "minicalc/ops.py": _OPS,
                              "tests/test_ops.py": _TESTS}, "minicalc")
        for suffix, (old, new), test, also_fail, statement in _TASKS:
            git(["checkout", "--quiet", "-B", suffix, good], cwd=repo)
            base = _commit(repo, {"minicalc/ops.py": _OPS.replace(old, new, 1)}, suffix)
            fix = _commit(repo, {"minicalc/ops.py": _OPS}, f"fix {suffix}")
            patch = git(["diff", base, fix], cwd=repo, text=True).stdout
            test_fix = _commit(repo, {"tests/test_ops.py": _TESTS + test}, f"test {suffix}")
            test_patch = git(["diff", fix, test_fix], cwd=repo, text=True).stdout
            name = test.split("def ", 1)[1].split("(", 1)[0]
            shipped = ("test_clamp_inside", "test_mean_one")
            rows.append({"instance_id": f"agentgym__minicalc-{suffix}", "repo": REPO,
                         "base_commit": base, "problem_statement": statement,
                         "patch": patch, "test_patch": test_patch,
                         "FAIL_TO_PASS": [f"tests/test_ops.py::{t}" for t in [name, *also_fail]],
                         "PASS_TO_PASS": [f"tests/test_ops.py::{t}" for t in shipped
                                          if t not in also_fail],
                         "version": "0.1", "environment_setup_commit": good})
        git(["checkout", "--quiet", "main"], cwd=repo)
        repo.rename(dest)
    return rows


def builtin_rows(root: Path) -> list[dict]:
    """The built-in tasks' rows, their repository made under ``root`` once (the same
    commits on every machine: git's identity and dates are fixed)."""
    dest, listed = Path(root) / "minicalc", Path(root) / "minicalc.json"
    Path(root).mkdir(parents=True, exist_ok=True)
    if not listed.is_file():
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            rows = make_repo(Path(tmp) / "minicalc")
            try:
                (Path(tmp) / "minicalc").rename(dest)
            except OSError:
                if not dest.is_dir():
                    raise
            Path(tmp, "rows.json").write_text(json.dumps(rows))
            Path(tmp, "rows.json").rename(listed)  # last: a listing means a whole repository
    return [{**row, "repo_path": str(dest)} for row in json.loads(listed.read_text())]
