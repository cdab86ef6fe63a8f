"""``env=swe``'s demonstrations for the cold start (:attr:`EnvManifest.demonstrate`): a
training task solved with the env's tools, the way the instructions ask, from its gold
patch and nothing the agent could not have read:

1. list the files that use a name of the problem statement (one the patched file defines,
   from the statement's code first; else a word of it that few source files use):
   ``grep -rlw NAME --include=*.py . | head -n 20``, whose output is paths that exist,
   source files and tests;
2. open the file around the line to change (``nl -ba FILE | sed -n A,Bp``; the editor's
   ``view`` with a ``view_range`` under ``swe.protocol=tools``);
3. make the edit: the gold patch's lines in place of the file's (a short Python script that
   replaces numbered lines under ``bash``; ``str_replace`` of text that occurs once under
   ``tools``);
4. run the tests: those files of the failing checks (their other tests; else of the row's
   passing ones) that the listing showed, else the visible suite with no file named, so
   the demonstration types no name it has not read;
5. submit.

Why so (DECISIONS, "the second reading"): a model trained on demonstrations that searched
for ``def NAME`` and ran test files named from the row looped on paths it made up when, on
a held-out repository, the search came back empty or the file was not there.

A demonstration is kept only when the env grades it resolved. A task whose statement shows
nothing that leads to the patched file, or whose patch touches more than one file, gives
none.
"""

from __future__ import annotations

import json
import re
import shlex

from agentgym.envs.swe_rows import SUBMIT, find_repo, split_patch, test_command

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{2,}")
_DEFINED = re.compile(r"^[ \t]*(?:async[ \t]+)?(?:def|class)[ \t]+([A-Za-z_]\w*)", re.M)
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", re.M)
_CODE = re.compile(r"```python\n(.*?)```", re.S)
_CONTEXT = 10  # lines shown each side of the edit
_FAILING = re.compile(r"\b\d+ (?:failed|errors?)\b")  # pytest's summary ("2 xfailed" passes)


def hunks(part: str) -> list[tuple[int, list[str]]]:
    """The hunks of one file's diff: ``(first old line, the hunk's lines with their +/-/space
    marks)``."""
    out = []
    starts = list(_HUNK.finditer(part))
    for i, m in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(part)
        body = part[m.end():end].split("\n")[1:]
        lines = [ln for ln in body if ln[:1] in ("+", "-", " ")]
        out.append((int(m.group(1)), lines))
    return out


def span(lines: list[str]) -> tuple[int, int]:
    """The hunk's changed lines, ``[lo, hi)`` in ``lines``; a pure insertion takes a line
    of context with it (the edit replaces that line by itself and the inserted ones)."""
    changed = [i for i, ln in enumerate(lines) if ln[:1] in "+-"]
    lo, hi = changed[0], changed[-1] + 1
    if not any(lines[i][:1] == "-" for i in changed):
        lo, hi = (lo - 1, hi) if lo > 0 else (lo, hi + 1)
    return lo, hi


def _sides(start: int, lines: list[str], lo: int, hi: int) -> tuple[str, str, int]:
    part = lines[lo:hi]
    old = "".join(ln[1:] + "\n" for ln in part if ln[:1] in "- ")
    new = "".join(ln[1:] + "\n" for ln in part if ln[:1] in "+ ")
    return old, new, start + sum(1 for ln in lines[:lo] if ln[:1] in "- ")


def replacement(text: str, start: int, lines: list[str]) -> tuple[str, str, int] | None:
    """``(old, new, the old text's first line)`` for one hunk: its :func:`span`, widened by
    context until ``old`` occurs exactly once in ``text`` (as ``str_replace`` needs); None
    when no width makes it unique."""
    lo, hi = span(lines)
    while True:
        old, new, first = _sides(start, lines, lo, hi)
        if old and text.count(old) == 1:
            return old, new, first
        if lo == 0 and hi == len(lines):
            return None
        lo, hi = max(0, lo - 1), min(len(lines), hi + 1)


def _edit_script(path: str, first: int, old: str, new: str) -> str:
    """A script that replaces lines ``first`` .. of ``path`` (as many as ``old`` has, numbered
    from 1 as ``nl`` shows them) by ``new``'s lines."""
    last = first + old.count("\n") - 1
    return ("python - <<'EOF'\nfrom pathlib import Path\n"
            f"p = Path({path!r})\nlines = p.read_text().splitlines(keepends=True)\n"
            f"lines[{first} - 1:{last}] = {new.splitlines(keepends=True)!r}\n"
            "p.write_text(''.join(lines))\nprint('edited', p)\nEOF")


def _bash(thought: str, command: str) -> str:
    return f"THOUGHT: {thought}\n\n```mswea_bash_command\n{command}\n```"


def _call(thought: str, name: str, arguments: dict) -> str:
    return (f"{thought}\n<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n"
            "</tool_call>")


def _name(statement: str, text: str, line: int) -> str | None:
    """The name the statement shows that the file defines, nearest above ``line``: from the
    statement's code first, else from anywhere in it (its error lines)."""
    found = []
    for source in ("\n".join(_CODE.findall(statement)), statement):
        wanted = set(_NAME.findall(source))
        found = [(text.count("\n", 0, m.start()) + 1, m.group(1))
                 for m in _DEFINED.finditer(text) if m.group(1) in wanted]
        if found:
            break
    if not found:
        return None
    above = [f for f in found if f[0] <= line]
    return (above[-1] if above else found[0])[1]


def _word(statement: str, base, path: str) -> str | None:
    """A word of the statement that ``path`` uses and the fewest other source files do (at
    most five files in all), for a search when no name of the statement is defined there."""
    from agentgym.envs.swe_rows import is_test_path
    sources = {p.relative_to(base).as_posix(): p.read_text(errors="replace")
               for p in base.rglob("*.py") if not is_test_path(p.relative_to(base).as_posix())}
    best = None
    for word in sorted(set(_NAME.findall(statement))):
        if len(word) < 4 or not re.search(rf"\b{word}\b", sources.get(path, "")):
            continue
        n = sum(1 for t in sources.values() if re.search(rf"\b{word}\b", t))
        if n <= 5 and (best is None or n < best[0]):
            best = (n, word)
    return best and best[1]


def _test_files(row: dict, base) -> list[str]:
    """The test files that held the failing checks and still hold tests (the others
    passing), else every file of the row's passing tests."""
    kept = {t.split("::", 1)[0] for t in row["PASS_TO_PASS"]}
    files = sorted({t.split("::", 1)[0] for t in row["FAIL_TO_PASS"]} & kept)
    return [f for f in files if (base / f).is_file()] or \
        sorted(f for f in kept if (base / f).is_file())


def _test_run(row: dict, seen: str, files: list[str]) -> str:
    """The command running those of ``files`` an observation so far named (``seen``), so
    that every name the demonstration types is one it read; with none named, the visible
    test suite (pytest finds it: nothing to name)."""
    cmd = test_command(row)
    head = cmd.split("python -m pytest", 1)[0] if "python -m pytest" in cmd else ""
    named = [f for f in files if f in seen]
    return (f"{head}python -m pytest -q -p no:cacheprovider "
            f"{' '.join(shlex.quote(f) for f in named)}".rstrip() + " 2>&1 | tail -n 3")


def swe_demo(row: dict, env) -> dict | None:
    """One demonstration of training task ``row``, played through the live SWE env ``env``."""
    from agentgym.envs.swe_grade import repo_cache
    from agentgym.envs.swe_rows import adapt_row, is_swe_row
    if is_swe_row(row):
        row = adapt_row(row, "demonstration")
    parts = split_patch(str(row["patch"]))
    if len(parts) != 1:
        return None
    path, part = parts[0]
    base = repo_cache().base(row["repo"], find_repo(row, env.repos), row["base_commit"])
    if not (base / path).is_file():
        return None
    text = (base / path).read_text()
    found = hunks(part)
    tools = env.protocol == "tools"
    edits = [replacement(text, start, lines) if tools else
             _sides(start, lines, *span(lines)) for start, lines in found]
    if not edits or None in edits:
        return None
    first = edits[0][2]
    statement = str(row["problem_statement"])
    files = _test_files(row, base)
    # the search lists the files that use a name of the statement (one the patched file
    # defines, else a word few files use): its output is paths that exist, source and tests
    token = _name(statement, text, first) or _word(statement, base, path)
    if token is None or not files:
        return None
    find = f'grep -rlw "{token}" --include=*.py . | head -n 20'
    look = f"The failure mentions {token}; I list the files that use it."
    lo, hi = max(1, first - _CONTEXT), min(text.count("\n") + 1, first + _CONTEXT)
    prompt, _ = env.reset(seed=0, options={"row": row})
    actions, observations = [], []

    def play(action: str, k: int, last: bool) -> bool:
        """Play turn ``k``; False when it fails (the demonstration is dropped)."""
        actions.append(action)
        obs, reward, terminated, truncated, _ = env.step(action)
        if last:
            return terminated and reward >= 1.0
        if terminated or truncated or _failed(obs, k, len(edits), path):
            return False
        observations.append(obs)
        return True

    run_tests = "I run the tests of that behaviour."
    done = "I made the change and ran the tests: I submit."
    if tools:
        if not play(_call(look, "bash", {"command": find}), 0, False):
            return None
        steps = [
            _call(f"The code is in {path}; I open it around line {first}.", "str_replace_editor",
                  {"command": "view", "path": f"/testbed/{path}", "view_range": [lo, hi]}),
            *(_call("This is the bug: I fix it.", "str_replace_editor",
                    {"command": "str_replace", "path": f"/testbed/{path}", "old_str": old,
                     "new_str": new}) for old, new, _ in edits)]
    else:
        if not play(_bash(look, find), 0, False):
            return None
        steps = [
            _bash(f"The code is in {path}; I open it around line {first}.",
                  f"nl -ba {shlex.quote(path)} | sed -n '{lo},{hi}p'"),
            *(_bash(f"This is the bug: I replace line {at}" + (
                f"-{at + old.count(chr(10)) - 1}" if old.count("\n") > 1 else "") + ".",
                _edit_script(path, at, old, new)) for old, new, at in reversed(edits))]
    for k, action in enumerate(steps, start=1):
        if not play(action, k, False):
            return None
    seen = "".join(str(m.get("content", "")) for o in observations for m in o)
    tests = _test_run(row, seen, files)
    test_action = _call(run_tests, "bash", {"command": tests}) if tools else _bash(run_tests, tests)
    if not play(test_action, len(steps) + 1, False):
        return None
    if not play(_call(done, "submit", {}) if tools else _bash(done, f"echo {SUBMIT}"),
                len(steps) + 2, True):
        return None
    return {"type": "demonstration", "env": "swe", "builder": "gold-patch-tools",
            "prompt": prompt, "actions": actions, "observations": observations,
            "reward": 1.0, "row": row}


def _failed(obs: list[dict], k: int, n_edits: int, path: str) -> bool:
    """Whether turn ``k``'s observation shows its command failing (the search finds nothing,
    an edit does not apply, the tests do not pass)."""
    text = "".join(str(m.get("content", "")) for m in obs)
    if k == 0:  # the search must find the file
        return path not in text
    if 2 <= k < 2 + n_edits:
        return "edited" not in text or "ERROR" in text or "Traceback" in text
    if k == 2 + n_edits:
        return bool(_FAILING.search(text)) or "passed" not in text
    return False
