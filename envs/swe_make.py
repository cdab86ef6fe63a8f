"""SWE tasks made offline from real packages, in SWE-smith's way: ``agentgym swe make-tasks``.

    agentgym swe make-tasks out=data/swe limit=60      # up to 60 tasks a repository

For each pinned source (:data:`SOURCES`: a pure-Python package whose sdist carries its
tests), the maker:

1. downloads the sdist from PyPI (``pip download --no-binary :all:``; only the maker does:
   a training run reads the repositories it wrote) and commits its tree as a repository;
2. runs the test suite once in a workspace (:mod:`agentgym.tools.workspace`): the tests
   that pass are the baseline;
3. for candidate bugs (:func:`agentgym.envs.swe_mutate.mutations`, drawn in a seeded
   order, one a function), runs the suite with the bug: a bug is kept when at least one
   baseline test fails (FAIL_TO_PASS, at most :data:`MAX_F2P`) and every other baseline
   test still passes (PASS_TO_PASS);
4. writes the task: the base commit holds the bug, with the failing tests taken out of
   their files (``test_patch`` puts them back), ``patch`` the fix; the problem statement is
   what a user would report, from the failing test's own traceback (the check that
   fails and its error), never from the diff;
5. keeps the task only when the harness (:func:`agentgym.envs.swe_grade.grade`) resolves
   it with the gold patch and not with an empty diff.

The repositories are written as git bundles (``out/repos/pypi__NAME.bundle``) and the rows
as ``out/<split>.jsonl.gz``, split by repository (:attr:`Source.split`).
"""

from __future__ import annotations

import ast
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from agentgym.core.paths import write_jsonl
from agentgym.envs.swe_grade import grade, repo_cache, repo_python, workspace_root
from agentgym.envs.swe_mutate import Mutation, mutations
from agentgym.tools.workspace import CommandLimits, git
from agentgym.envs.swe_rows import is_test_path

MAX_F2P = 10  # failing tests a kept bug may have (more: it breaks the module, not a function)
_SECTION = re.compile(r"^_{3,} (\S.*?) _{3,}$", re.M)


@dataclass(frozen=True)
class Source:
    """A pinned package: its sdist, where its tests and its import root are."""

    name: str
    version: str
    tests: str  # the test path inside the sdist's tree
    root: str = ""  # the folder the package imports from ('' the tree's top, 'src')
    split: str = "train"  # train | test (held out: whole repositories)
    needs: tuple[str, ...] = ()  # its runtime dependencies (installed distributions)
    args: str = ""  # pytest arguments its suite needs here (a file that needs an installed copy left out)
    sdist: str = ""  # a local sdist to use instead of PyPI's (tests; a user's own package)

    @property
    def repo(self) -> str:
        return f"pypi/{self.name}"

    def test_cmd(self, paths: str = "") -> str:
        env = f"PYTHONPATH=/testbed/{self.root} " if self.root else ""
        return (f"{env}python -m pytest -rA -p no:cacheprovider --tb=short -q "
                f"{self.args + ' ' if self.args else ''}{paths or self.tests}")


#: the pinned sources: sdists carrying their tests, pure Python, no runtime dependencies,
#: every baseline test passing and the suite under 5 s on a 2-core CPU (surveyed over 46
#: sdists: docs/decisions/envs-swe.md), each test a function the maker can take out of its
#: file (isodate's are made in loops: it gave no task); the held-out split is whole
#: repositories
SOURCES: list[Source] = [
    Source("boltons", "26.2.0", "tests"),
    Source("sqlparse", "0.6.1", "tests"),
    Source("cachetools", "8.0.2", "tests", root="src"),
    Source("toolz", "1.2.0", "toolz"),
    Source("six", "1.17.0", "test_six.py"),
    Source("inflection", "0.5.1", "test_inflection.py"),
    Source("voluptuous", "0.16.0", "voluptuous/tests", split="test"),
    Source("tabulate", "0.10.0", "test", split="test"),
    Source("semver", "3.1.2", "tests", root="src", args="-o addopts=", split="test"),
    Source("schema", "0.7.8", "test_schema.py", split="test"),
    Source("texttable", "1.7.2", "tests.py", split="test"),
]


def fetch(source: Source, dest: Path) -> Path:
    """The sdist of ``source``, downloaded into ``dest`` (or its local ``sdist``)."""
    if source.sdist:
        return Path(source.sdist)
    dest = dest / source.name  # its own folder: the file is the one found there
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--no-binary", ":all:", "--dest", str(dest),
                    f"{source.name}=={source.version}"], check=True, capture_output=True)
    found = sorted(dest.glob("*.tar.gz")) + sorted(dest.glob("*.zip"))
    if not found:
        raise RuntimeError(f"no sdist of {source.name}=={source.version} in {dest}")
    return found[0]


def commit_tree(sdist: Path, repo: Path) -> str:
    """``sdist``'s tree committed as the first commit of a new repository ``repo``."""
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        (top,) = Path(tmp).iterdir()
        repo.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(top), repo)
    git(["init", "--quiet", "--initial-branch=main"], cwd=repo)
    git(["add", "--all", "--force"], cwd=repo)
    git(["commit", "--quiet", "-m", f"{sdist.name}"], cwd=repo)
    return git(["rev-parse", "HEAD"], cwd=repo, text=True).stdout.strip()


def remove_tests(source: str, names: set[tuple[str, str]]) -> str:
    """``source`` (a test module) without the test functions ``names`` (``(class or '',
    function)``), decorators included; a class left empty keeps a ``pass``."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    cut: list[tuple[int, int, str]] = []  # (first line, last line, indentation), 1-based

    def visit(body, owner: str, parent_len: int) -> None:
        gone = [n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                and (owner, n.name) in names]
        for n in gone:
            first = min([n.lineno, *(d.lineno for d in n.decorator_list)])
            indent = lines[first - 1][:len(lines[first - 1]) - len(lines[first - 1].lstrip())]
            cut.append((first, n.end_lineno, indent if len(gone) == parent_len else ""))
        for n in body:
            if isinstance(n, ast.ClassDef):
                visit(n.body, n.name, len(n.body))

    visit(tree.body, "", -1)
    for first, last, empty_indent in sorted(cut, reverse=True):
        lines[first - 1:last] = [f"{empty_indent}pass\n"] if empty_indent else []
    return "".join(lines)


def _ids(test_id: str) -> tuple[str, str, str]:
    """``path::Class::name[param]`` -> (path, class or '', name)."""
    path, *rest = test_id.split("::")
    name = rest[-1].split("[", 1)[0]
    return path, (rest[0] if len(rest) > 1 else ""), name


#: the problem statement's own words around the failing test's traceback
HEAD = "Something in {name} {version} is broken. This check fails:"
END = "It should pass."
MORE = "{n} other check(s) of the package fail the same way."
#: pytest's own words in a traceback it prints (``Captured stdout call``)
PYTEST_WORDS = frozenset({"Captured", "stdout", "stderr", "call", "setup", "teardown", "log"})
#: those words, which say nothing of the bug: a search for one lists comments that happen
#: to use it (docs/decisions/envs-swe.md, "the eighth design")
STATEMENT_WORDS = frozenset(re.findall(r"[A-Za-z]{3,}", re.sub(
    r"\{\w+\}", "", " ".join((HEAD, END, MORE))))) | PYTEST_WORDS
#: the most lines of a traceback a statement quotes (its frames' last, what the test
#: printed first) and of one line's characters
FRAME_LINES, PRINTED_LINES, LINE_CHARS = 16, 8, 160


def report(name: str, version: str, traceback: str, more: int) -> str:
    """The problem statement of a bug as a user would file it: the failing test's traceback
    as pytest showed it (its frames with their files and lines, the error, what the test
    printed), bounded (the frames' last :data:`FRAME_LINES` lines, what was printed first
    :data:`PRINTED_LINES`, each line :data:`LINE_CHARS` characters), between the
    template's words (docs/decisions/envs-swe.md, "the ninth design")."""
    lines = [ln for ln in traceback.strip("\n").splitlines() if not _SECTION.match(ln)]
    cut = next((i for i, ln in enumerate(lines) if ln.startswith("-----")), len(lines))
    frames, printed = lines[:cut], lines[cut:]
    kept = frames[-FRAME_LINES:] + printed[:PRINTED_LINES + 1]
    kept = [ln if len(ln) <= LINE_CHARS else ln[:LINE_CHARS] + " ..." for ln in kept]
    while kept and not kept[-1].strip():
        kept.pop()
    tail = "\n\n" + MORE.format(n=more) if more else ""
    return (HEAD.format(name=name, version=version) + "\n\n```\n" + "\n".join(kept) +
            "\n```\n\n" + END + tail)


def restate(row: dict) -> dict:
    """``row`` with its problem statement made again from its failing traceback by
    :func:`report` (the shipped rows follow the maker's template without running it)."""
    return dict(row, problem_statement=report(
        row["repo"].split("/")[-1], row["version"], row["failing_traceback"],
        len(row["FAIL_TO_PASS"]) - 1))


def statement(source: Source, log: str, f2p: list[str]) -> tuple[str, str]:
    """The problem statement of a bug, from its run's log (:func:`report` of the first
    failing test's traceback that shows an error), and that traceback as the log had it."""
    sections = {m.group(1): m.end() for m in _SECTION.finditer(log)}
    starts = sorted(sections.values())
    for test_id in f2p:
        _, cls, name = _ids(test_id)
        head = f"{cls}.{name}" if cls else name
        key = next((k for k in sections if k.split("[", 1)[0] == head), None)
        if key is None:
            continue
        end = next((s for s in starts if s > sections[key]), len(log))
        text = log[sections[key]:end]
        text = text.split("\n=====", 1)[0].strip("\n")
        if not any(ln.startswith("E ") for ln in text.splitlines()):
            continue
        return report(source.name, source.version, text, len(f2p) - 1), text
    raise ValueError("no failing test's traceback in the log")


def _run(source: Source, base: Path, diff: str, python: str, wall_s: float):
    row = {"test_patch": "", "test_cmd": source.test_cmd(), "FAIL_TO_PASS": [],
           "PASS_TO_PASS": []}
    return grade(row, base, diff, workspace_root(), CommandLimits(wall_s=wall_s, cpu_s=wall_s),
                 wall_s, python)


def make_repo_tasks(source: Source, work: Path, limit: int, seed: int, wall_s: float = 120):
    """Yield progress lines; return ``(rows, the repository's folder)`` of ``source``."""
    sdist = fetch(source, work / "sdists")
    repo = work / "repos" / source.repo.replace("/", "__")
    original = commit_tree(sdist, repo)
    python = repo_python({"repo": source.repo, "requirements": list(source.needs)}, "",
                         ["pytest"])
    base0 = repo_cache().base(source.repo, repo, original)
    first = _run(source, base0, "", python, wall_s)
    passing = {t for t, s in first.statuses.items() if s == "PASSED"}
    # a bug that makes the suite loop is dropped at three times its baseline, not at wall_s
    wall_s = min(wall_s, max(10.0, 3 * first.test_s))
    yield (f"{source.name} {source.version}: {len(passing)} tests pass at baseline "
           f"({first.test_s:.1f} s)")
    if not passing:
        raise RuntimeError(f"{source.name}: no test passes at baseline: {first.log[-500:]}")
    files = sorted(p for p in repo.rglob("*.py") if not _is_test(p.relative_to(repo)))
    candidates: list[tuple[str, Mutation]] = []
    for path in files:
        rel = path.relative_to(repo).as_posix()
        try:
            found = mutations(path.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        candidates += [(rel, m) for m in found]
    rng = random.Random(f"{seed}:{source.name}")
    rng.shuffle(candidates)
    rows, used = [], set()
    for rel, m in candidates:
        if len(rows) >= limit:
            break
        if (rel, m.function) in used:
            continue
        row = _task(source, repo, original, base0, rel, m, passing, python, wall_s)
        if row is not None:
            used.add((rel, m.function))
            rows.append(row)
            yield f"  {row['instance_id']}: {m.kind} in {m.function}, {len(row['FAIL_TO_PASS'])} F2P"
    git(["checkout", "--quiet", "main"], cwd=repo)
    return rows, repo


def _is_test(rel: Path) -> bool:
    return is_test_path(rel.as_posix()) or rel.name in ("setup.py", "conftest.py", "tests.py") \
        or rel.parts[0] in ("docs", "doc", "documentation", "examples", "benchmark",
                            "benchmarks", "bin", "tools", "scripts")


def _task(source, repo, original, base0, rel, m, passing, python, wall_s):
    """The task of bug ``m`` in file ``rel``, or None when it is not kept."""
    git(["checkout", "--quiet", "-B", "task", original], cwd=repo)  # the untouched tree
    path = repo / rel
    text = path.read_text()
    bug = _diff(rel, text, m.apply(text))
    r = _run(source, base0, bug, python, wall_s)
    if r.infra:
        return None
    failing = sorted(t for t in passing if r.statuses.get(t) != "PASSED")
    if not 1 <= len(failing) <= MAX_F2P or len(failing) == len(passing):
        return None
    if any(not _ids(t)[0].endswith(".py") for t in failing):
        return None  # a doctest in a text file: no function to take out of it
    try:
        problem, traceback = statement(source, r.log, failing)
    except ValueError:
        return None
    # the base: the bug, and the failing tests out of their files
    path.write_text(m.apply(text))
    by_file: dict[str, set] = {}
    for test_id in failing:
        file, cls, name = _ids(test_id)
        by_file.setdefault(file, set()).add((cls, name))
    for file, names in by_file.items():
        (repo / file).write_text(remove_tests((repo / file).read_text(), names))
    git(["add", "--all"], cwd=repo)
    git(["commit", "--quiet", "-m", f"{rel}: {m.function}"], cwd=repo)
    base_commit = git(["rev-parse", "HEAD"], cwd=repo, text=True).stdout.strip()
    gold = git(["diff", base_commit, original, "--", rel], cwd=repo, text=True).stdout
    test_patch = git(["diff", base_commit, original, "--", *by_file], cwd=repo,
                     text=True).stdout
    git(["tag", f"task-{base_commit[:12]}"], cwd=repo)  # kept in the bundle
    p2p = sorted(passing - set(failing))
    row = {"instance_id": f"pypi__{source.name}-{base_commit[:8]}", "repo": source.repo,
           "base_commit": base_commit, "problem_statement": problem, "patch": gold,
           "test_patch": test_patch, "FAIL_TO_PASS": failing, "PASS_TO_PASS": p2p,
           "version": source.version, "environment_setup_commit": original,
           "test_cmd": source.test_cmd(" ".join(sorted({*by_file, *{_ids(t)[0] for t in p2p}}))),
           "requirements": list(source.needs),
           "mutation": {"file": rel, "function": m.function, "line": m.line, "kind": m.kind},
           "failing_traceback": traceback, "repo_path": str(repo)}
    base = repo_cache().base(source.repo, repo, base_commit)
    fixed = grade(row, base, gold, workspace_root(), CommandLimits(wall_s=wall_s, cpu_s=wall_s),
                  wall_s, python)
    empty = grade(row, base, "", workspace_root(), CommandLimits(wall_s=wall_s, cpu_s=wall_s),
                  wall_s, python)
    if not fixed.resolved or empty.resolved or empty.infra:
        return None
    return row


def _diff(rel: str, before: str, after: str) -> str:
    import difflib
    lines = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                 f"a/{rel}", f"b/{rel}")
    return f"diff --git a/{rel} b/{rel}\n" + "".join(lines)


def make_tasks(swe, out: str, limit: int, seed: int):
    """``agentgym swe make-tasks out=FOLDER [limit=N] [swe.sources=[a,b]]``: every
    :data:`SOURCES` repository's (or those named) tasks (up to ``limit`` each, 50 without),
    written as ``FOLDER/{train,test}.jsonl.gz`` and
    ``FOLDER/repos/*.bundle``; yields progress lines."""
    if not out:
        raise ValueError("make-tasks needs out=FOLDER (the rows and repositories go there)")
    names = {s.name for s in SOURCES}
    if unknown := [n for n in swe.sources if n not in names]:
        raise ValueError(f"swe.sources names {unknown}; the pinned sources are {sorted(names)}")
    chosen = [s for s in SOURCES if not swe.sources or s.name in swe.sources]
    folder = Path(out).expanduser()
    (folder / "repos").mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[dict]] = {"train": [], "test": []}
    with tempfile.TemporaryDirectory(prefix="swe-make-") as tmp:
        for source in chosen:
            try:
                rows, repo = yield from make_repo_tasks(source, Path(tmp), limit or 50, seed)
            except (RuntimeError, subprocess.CalledProcessError) as e:
                yield f"{source.name}: skipped ({str(e)[:300]})"
                continue
            bundle = folder / "repos" / f"{repo.name}.bundle"
            git(["bundle", "create", "--quiet", str(bundle), "--all"], cwd=repo)
            for row in rows:
                row.pop("repo_path")
            splits[source.split] += rows
            yield f"{source.name}: {len(rows)} tasks, {bundle} ({bundle.stat().st_size >> 10} KiB)"
    for split, rows in splits.items():
        write_jsonl(folder / f"{split}.jsonl.gz", rows)
    yield f"{len(splits['train'])} train and {len(splits['test'])} held-out tasks in {folder}"
    return 0
