"""SWE-bench's task rows, as SWE-bench, SWE-Gym and SWE-smith publish them, for ``env=swe``.

A row: ``instance_id``, ``repo`` (``owner/name``), ``base_commit``, ``problem_statement``,
``patch`` (the gold fix; only ``agentgym swe validate`` needs it), ``test_patch``,
``FAIL_TO_PASS`` and ``PASS_TO_PASS`` (test ids, as lists or as the JSON strings of
SWE-bench's Hugging Face copies), with ``version``, ``environment_setup_commit`` and a test
command (``test_cmd``) where given. ``data=`` loads such rows unchanged:
:func:`adapt_row` adds verl's fields (``prompt``, ``reward_model``) the trainer reads.

The repository is the user's, on disk: the row's ``repo_path`` (a git folder or bundle),
else ``swe.repos/<owner>__<name>`` (or ``<name>``; a folder, or the same with
``.bundle``), else the shipped tasks' (``data/swe/repos``). A row that names a Docker image (``image_name``: SWE-smith's, SWE-Gym's) is
refused by name: no container runs here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath
from agentgym.core.paths import data_dir

SWE_FIELDS = ("instance_id", "repo", "base_commit", "problem_statement", "test_patch",
              "FAIL_TO_PASS", "PASS_TO_PASS")
#: files whose names say they are tests or test configuration: an agent's edits to them are
#: dropped before grading (SWE-bench resets the test files; this also keeps conftest.py and
#: the runner's settings the task's)
TEST_DIRS = {"test", "tests", "testing"}
TEST_CONFIG = {"conftest.py", "pytest.ini", "tox.ini", "noxfile.py", ".coveragerc"}
_DIFF = re.compile(r"^diff --git a/(.+?) b/(.+?)$", re.M)


#: what a command prints first to submit (mini-swe-agent's sentinel; env=swe's bash protocol)
SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def is_swe_row(row: dict) -> bool:
    """Whether ``row`` is in SWE-bench's schema (has its fields)."""
    return all(k in row for k in SWE_FIELDS)


def test_ids(value, where: str) -> list[str]:
    """A row's ``FAIL_TO_PASS`` / ``PASS_TO_PASS``: a list, or a JSON string of one."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except ValueError:
            raise ValueError(f"{where}: {value[:80]!r} is neither a list of test ids nor "
                             f"a JSON string of one") from None
    if hasattr(value, "tolist"):  # a parquet column's array
        value = value.tolist()
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise ValueError(f"{where}: expected a list of test ids, got {str(value)[:80]!r}")
    return value


def adapt_row(row: dict, where: str) -> dict:
    """``row`` in SWE-bench's schema with verl's fields added (a row already carrying them is
    returned as it is): ``prompt`` the problem statement, ``reward_model.ground_truth`` the
    tests. Raises ValueError naming the row and the field for a row that cannot run here."""
    if "prompt" in row and "reward_model" in row and not is_swe_row(row):
        return row
    missing = [k for k in SWE_FIELDS if k not in row]
    name = row.get("instance_id", "?")
    if missing:
        raise ValueError(f"{where}: row {name!r} lacks {missing}; SWE-bench rows need "
                         f"{list(SWE_FIELDS)} (and 'patch' to validate)")
    if row.get("image_name"):
        raise ValueError(f"{where}: row {name!r} needs the Docker image "
                         f"{row['image_name']!r}, and no container runs here; give its "
                         f"repository as a local git folder or bundle (the row's 'repo_path' "
                         f"or swe.repos=FOLDER) and drop 'image_name'")
    f2p = test_ids(row["FAIL_TO_PASS"], f"{where}: {name}: FAIL_TO_PASS")
    p2p = test_ids(row["PASS_TO_PASS"], f"{where}: {name}: PASS_TO_PASS")
    if not f2p:
        raise ValueError(f"{where}: row {name!r} has no FAIL_TO_PASS test: nothing would "
                         f"tell a fix from no change")
    return {**row, "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p,
            "data_source": row.get("data_source") or "swe-bench",
            "prompt": [{"role": "user", "content": str(row["problem_statement"])}],
            "reward_model": {"style": "swebench",
                             "ground_truth": {"FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p}},
            # the instance id is the episode's uid (rollout.manager.row_uid): evaluations pair by it
            "extra_info": {"id": name, **(row.get("extra_info") or {}), "instance_id": name}}


def find_repo(row: dict, repos: str) -> Path:
    """The repository of ``row`` on disk (see the module docstring)."""
    if row.get("repo_path"):
        path = Path(str(row["repo_path"])).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"row {row['instance_id']!r}: repo_path {path} does not "
                                    f"exist")
        return path
    owner_name = str(row["repo"])
    tried = []
    for root in [Path(repos).expanduser()] * bool(repos) + [data_dir() / "swe" / "repos"]:
        for stem in (owner_name.replace("/", "__"), owner_name.rsplit("/", 1)[-1], owner_name):
            for candidate in (root / stem, root / f"{stem}.bundle"):
                tried.append(str(candidate))
                if candidate.exists():
                    return candidate
    where = f"tried {', '.join(tried)}"
    raise FileNotFoundError(f"row {row['instance_id']!r}: no local copy of {owner_name!r} "
                            f"({where}); set swe.repos=FOLDER holding "
                            f"{owner_name.replace('/', '__')} (a git folder or .bundle), or "
                            f"give the row a repo_path")


def split_patch(patch: str) -> list[tuple[str, str]]:
    """A git diff as ``(path, that file's part)`` pairs, in order (the new path; the old one
    for a deletion)."""
    starts = list(_DIFF.finditer(patch))
    parts = []
    for i, m in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(patch)
        parts.append((m.group(2), patch[m.start():end]))
    return parts


def patch_files(patch: str) -> list[str]:
    """The paths a git diff touches."""
    return [path for path, _ in split_patch(patch)]


def is_test_path(path: str) -> bool:
    """Whether ``path`` names a test file or the test runner's configuration."""
    p = PurePosixPath(path)
    return (p.name in TEST_CONFIG or p.name.startswith("test_") and p.suffix == ".py"
            or p.name.endswith("_test.py") or any(part in TEST_DIRS for part in p.parts[:-1]))


def without_test_edits(patch: str, test_patch: str) -> tuple[str, list[str]]:
    """``patch`` without its changes to test files and test configuration (those
    :func:`is_test_path` names and every file ``test_patch`` touches), and the dropped paths."""
    theirs = set(patch_files(test_patch))
    kept, dropped = [], []
    for path, part in split_patch(patch):
        (dropped if path in theirs or is_test_path(path) else kept).append((path, part))
    return "".join(part for _, part in kept), [path for path, _ in dropped]


def test_command(row: dict) -> str:
    """The command that runs the row's tests: its ``test_cmd``, else pytest over the files
    of ``test_patch`` with every result reported (``-rA``, as SWE-bench's harness runs
    it), which SWE-bench's log parser reads."""
    if row.get("test_cmd"):
        return str(row["test_cmd"])
    files = " ".join(f"'{f}'" for f in patch_files(str(row["test_patch"])) if f.endswith(".py"))
    return f"python -m pytest -rA -p no:cacheprovider --tb=short -q {files}".rstrip()
