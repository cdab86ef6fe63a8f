"""``env=swe``'s demonstrations for the cold start (:attr:`EnvManifest.demonstrate`): a
training task solved with the env's tools, the way the instructions ask, from its gold
patch and nothing the agent could not have read:

1. where the statement's traceback goes through a source file (its last frame outside the
   tests: ``voluptuous/validators.py:472: in __init__``), open it there as the traceback
   says (:func:`view_at`: ``nl -ba FILE | grep -B 20 -A 9 -E "^ *472\\s"``, the path and
   number typed as read); where that is the patched file and the edit is at most
   :data:`AROUND` lines above the frame's line, go on at step 3;
   else, where the traceback shows only tests, find where a word of the failing check's own
   name is used (``test_floatfmt_multi``: ``grep -rnw "floatfmt" ...``; its first word whose
   listing leads to the edit), or else where a name of the problem statement lives in the
   source files (one the patched file defines, from the statement's code first:
   ``grep -rnE "(def|class) NAME\b" --include=*.py EXCLUDES . | head -n 20``, test files
   left out; else a word of it that few source files use: ``grep -rnw WORD ...``; never a
   builtin such as ``isinstance``, a word of the statement's own template (``should``,
   ``check``) or a code fence's language), whose output is ``./PATH:LINE:TEXT`` lines of
   files that exist;
2. open the file from the nearest line the search showed above the edit to past it
   (``nl -ba FILE | sed -n A,Bp``; the editor's ``view`` with a ``view_range`` under
   ``swe.protocol=tools``), at most :data:`VIEW_LINES` lines a view;
3. say what is wrong in the code's own text (``in `if a < b:`, `<` should be `<=```), then
   make the edit: the gold patch's lines in place of the file's (under ``bash``, :data:`SPLICE`
   replaces the numbered lines the view showed by the lines that follow it, verbatim;
   ``str_replace`` of text that occurs once under ``tools``);
4. run the tests: those files of the failing checks (their other tests; else of the row's
   passing ones) that the statement or an observation showed, else the visible suite with
   no file named, so the demonstration types no name it has not read;
5. submit.

Half the tasks that search for a name of the statement (:func:`recovery`, fixed by the
instance id) first search for one that no file defines, come back empty, and go on to
another name.

Why so (docs/decisions/envs-swe.md, "the second reading" to "the tenth design"): a model
trained on demonstrations that searched for ``def NAME`` and ran test files named from the
row looped on paths it made up when, on a held-out repository, the search came back empty or
the file was not there; one trained to open a file at a line the patch gave (no observation showed
it) opened the wrong lines; one that wrote the new line as a Python string literal failed
to parse it wherever the code held a quote or a backslash (so the lines are typed verbatim);
one whose search listed only a test helper opened a path made up from the package's name
(so the search leaves test files out); one that searched, on a held-out repository, for
names that lead nowhere while the traceback named the file and line. Demonstrations that
also recovered from a made-up path, an unchanged edit, an empty ``git diff`` or a broken
edit (the seventh to ninth designs) lowered the held-out format validity each time: the
model learned to go back and repeat.

A demonstration is kept only when the env grades it resolved. A task whose statement shows
nothing that leads to the patched file, or whose patch touches more than one file, gives
none (logged with the reason).
"""

from __future__ import annotations

import builtins
import json
import logging
import re
import shlex

from agentgym.envs.swe_rows import (SUBMIT, TEST_CONFIG, TEST_DIRS, adapt_row, find_repo,
                                    is_swe_row, is_test_path, split_patch, test_command)
from agentgym.envs.swe_make import STATEMENT_WORDS
from agentgym.envs.swe_grade import repo_cache

logger = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{2,}")
_DEFINED = re.compile(r"^[ \t]*(?:async[ \t]+)?(?:def|class)[ \t]+([A-Za-z_]\w*)", re.M)
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", re.M)
_CODE = re.compile(r"```python\n(.*?)```", re.S)
_FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)
# a traceback's frame as pytest prints it: ``voluptuous/validators.py:472: in __init__``
_FRAME = re.compile(r"^(\S+\.py):(\d+): in (\S+)$", re.M)  # path, line, function
_FAILING = re.compile(r"\b\d+ (?:failed|errors?)\b")  # pytest's summary ("2 xfailed" passes)
# names no search is for: Python's builtins (``isinstance``, ``ValueError``, ``list``) and
# the words every method has, and the statement template's own (``should``, ``check``); a
# search for them lists lines that are not the bug, and a model shown one learns to search
# for any word (docs/decisions/envs-swe.md, "the seventh design" and "the eighth design")
_GENERIC = frozenset(dir(builtins)) | {"self", "cls", "args", "kwargs"} | STATEMENT_WORDS
VIEW_LINES = 30  # a view's most lines: a longer one ran the thought after it on
AROUND = 20  # a view at a traceback's line starts this many lines above it


def _code(statement: str) -> str:
    """The code a statement quotes: its ``python`` blocks, and the frames' own lines of a
    traceback it quotes (indented; not pytest's ``E`` lines)."""
    frames = [ln[4:] for block in _FENCE.findall(statement) if _FRAME.search(block)
              for ln in block.split("\n") if ln.startswith("    ")]
    return "\n".join([*_CODE.findall(statement), *frames])


def _prose(statement: str) -> str:
    """The rest of a statement: its words outside code blocks, and of a traceback it quotes
    the error and what the test printed (not the frames' files, names or code)."""
    def keep(m: re.Match) -> str:
        block = m.group(1)
        if not _FRAME.search(block):
            return "" if m.group(0).startswith("```python") else block
        return "\n".join(ln for ln in block.split("\n")
                         if not ln.startswith("    ") and not _FRAME.match(ln))
    return _FENCE.sub(keep, statement)


def frame(statement: str, base) -> tuple[str, int] | None:
    """The last frame of the statement's traceback in a source file of ``base`` (no test
    file): ``(path, line)``, where the error was raised nearest; None when the traceback
    goes through none."""
    frames = [(f, int(n)) for f, n, _ in _FRAME.findall("\n".join(_FENCE.findall(statement)))
              if not is_test_path(f) and (base / f).is_file()]
    return frames[-1] if frames else None


def view_at(path: str, line: int) -> str:
    """The view of ``path`` around ``line``, typed as read from a traceback: :data:`AROUND`
    lines above it to :data:`VIEW_LINES` in all, numbered by ``nl -ba`` (grep picks them,
    so the command holds the traceback's number as it is and no arithmetic)."""
    return (f"nl -ba {shlex.quote(path)} | grep -B {AROUND} -A {VIEW_LINES - AROUND - 1} "
            f'-E "^ *{line}\\s"')


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


# replaces lines A..B of FILE (numbered from 1, as nl shows them) by the lines of its
# standard input: the same text in every edit, with the new lines after it as they are, so
# that no quote or backslash of the code needs escaping (docs/decisions/envs-swe.md, "the
# fifth design")
SPLICE = """python -c "
import sys, pathlib
p, a, b = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
lines = p.read_text().splitlines(keepends=True)
new = sys.stdin.readlines()
print('unchanged: the new lines are the old ones' if lines[a - 1:b] == new else 'edited', p)
lines[a - 1:b] = new
p.write_text(''.join(lines))
\""""


def _edit_script(path: str, first: int, old: str, new: str) -> str | None:
    """The command that replaces lines ``first`` .. of ``path`` (as many as ``old`` has) by
    ``new``'s lines, given verbatim in a quoted here-document; None when a line of ``new``
    would end it."""
    if any(line.strip() == "EOF" for line in new.split("\n")):
        return None
    last = first + old.count("\n") - 1
    return f"{SPLICE} {shlex.quote(path)} {first} {last} <<'EOF'\n{new}EOF"


_TOKEN = re.compile(r"\w+|\s+|[<>=!]=|//|\*\*|->|.", re.S)


def change(old: str, new: str) -> tuple[str, str]:
    """The part of ``old`` that ``new`` changes, and what it becomes: the tokens between
    their common start and their common end, whitespace collapsed (``("<", "<=")``,
    ``("a, b", "b, a")``, ``("", "x += 1")`` for a line the fix adds)."""
    a, b = _TOKEN.findall(old), _TOKEN.findall(new)
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    j = 0
    while j < min(len(a), len(b)) - i and a[-1 - j] == b[-1 - j]:
        j += 1
    return (" ".join("".join(a[i:len(a) - j]).split()),
            " ".join("".join(b[i:len(b) - j]).split()))


def _bug(old: str, new: str) -> str:
    """The edit's thought: what is wrong, in the code's own text, before the edit types it."""
    was, fix = change(old, new)
    if not was:
        return f"This is the bug: `{fix}` is missing."
    # the line it is in, when the change is a part of it
    line = next((ln.strip() for ln, nw in zip(old.split("\n"), new.split("\n")) if ln != nw),
                "")
    where = f"in `{line}`, " if line and line != was else ""
    if not fix:
        return f"This is the bug: {where}`{was}` should not be there."
    return f"This is the bug: {where}`{was}` should be `{fix}`."


def _bash(thought: str, command: str) -> str:
    return f"THOUGHT: {thought}\n\n```mswea_bash_command\n{command}\n```"


def _call(thought: str, name: str, arguments: dict) -> str:
    return (f"{thought}\n<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n"
            "</tool_call>")


def _locate(statement: str, base, path: str, text: str, line: int) -> tuple[str, bool, int] | None:
    """What to search for to land near ``line`` of ``path``: ``(token, defined, at)``, a
    name of the statement (its code first) that the file defines (``defined``: the search
    lists its ``def``/``class`` lines) or uses while at most five source files do (the
    search lists every use), whose listed line ``at`` is the nearest above ``line``, and
    whose listing is whole (at most 20 lines: the search's ``head``); None when no name of
    the statement leads above it."""
    import keyword
    files = _sources(base)
    names = dict.fromkeys([*_NAME.findall(_code(statement)),
                           *_NAME.findall(_prose(statement))])
    best = None
    for order, name in enumerate(names):
        if len(name) < 3 or keyword.iskeyword(name) or name.startswith("__") or \
                name in _GENERIC:
            continue
        word = re.compile(rf"\b{re.escape(name)}\b")
        define = re.compile(rf"(def|class) {re.escape(name)}\b")
        uses = sum(1 for lines in files.values() if any(word.search(ln) for ln in lines))
        ways = [(True, define)] + ([(False, word)] if len(name) >= 4 and uses <= 5 else [])
        for defined, pattern in ways:
            listed = sum(1 for lines in files.values() for ln in lines if pattern.search(ln))
            above = [i + 1 for i, ln in enumerate(text.split("\n")[:line]) if pattern.search(ln)]
            if above and listed <= 20 and \
                    (best is None or (line - above[-1], not defined, order) < best[0]):
                best = ((line - above[-1], not defined, order), (name, defined, above[-1]))
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


def _hits(text: str, path: str) -> list[int]:
    """The line numbers a ``grep -rn`` listing shows for ``path`` (``./PATH:N:...``)."""
    return [int(m.group(1)) for m in
            re.finditer(rf"^(?:\./)?{re.escape(path)}:(\d+):", text, re.M)]


# what the search leaves out: the files :func:`is_test_path` names (the agent fixes the
# source, and a listing of test helpers only led the model to open paths it made up)
_NOT_TESTS = " ".join([*(f"--exclude-dir={d}" for d in sorted(TEST_DIRS, key=len)),
                       "--exclude='test_*.py'", "--exclude='*_test.py'",
                       *(f"--exclude={n}" for n in sorted(TEST_CONFIG) if n.endswith(".py"))])


def _sources(base) -> dict[str, list[str]]:
    """The Python files of ``base`` that :func:`_search` lists (no test file), by path: their
    lines."""
    paths = (p.relative_to(base).as_posix() for p in base.rglob("*.py"))
    return {f: (base / f).read_text(errors="replace").split("\n")
            for f in paths if not is_test_path(f)}


def _search(token: str, defined: bool) -> str:
    """The search for ``token`` in the source files: where it is defined (``def``/``class``)
    when the patched file defines it, else every line that uses it; each hit as
    ``./PATH:LINE:TEXT``."""
    pattern = f'-rnE "(def|class) {token}\\b"' if defined else f'-rnw "{token}"'
    return f"grep {pattern} --include=*.py {_NOT_TESTS} . | head -n 20"


def _missing(statement: str, base) -> str | None:
    """A name of the statement's code (else of the statement) that no source file of the
    repository defines: the search a model may well try first, and come back empty from."""
    import keyword
    defined = set()
    for lines in _sources(base).values():
        defined.update(_DEFINED.findall("\n".join(lines)))
    code, prose = _code(statement), _prose(statement)
    # from the code, any name; from the prose, a call or a snake_case name
    names = [*_NAME.findall(code), *(m.group(0) for m in _NAME.finditer(prose)
                                     if "_" in m.group(0) or prose[m.end():m.end() + 1] == "(")]
    return next((n for n in dict.fromkeys(names) if len(n) >= 4 and n not in defined
                 and not keyword.iskeyword(n) and n not in _GENERIC), None)


#: what a demonstration recovers from, by a hash of the instance id (half each): a search for a
#: name of the statement that nothing defines, then another name (docs/decisions/envs-swe.md,
#: "the tenth design": the recoveries of the seventh to ninth designs went, each having
#: lowered the held-out format validity)
RECOVERIES = ("none", "empty_search")


def recovery(row: dict) -> str:
    """What ``row``'s demonstration recovers from, fixed by its instance id: ``none``, or
    ``empty_search`` (a search for a name nothing defines, then another name; ``none``
    where the traceback leads to the edit and there is no search)."""
    import hashlib
    digest = hashlib.sha256(str(row["instance_id"]).encode()).digest()
    return RECOVERIES[int.from_bytes(digest[:8], "big") % len(RECOVERIES)]


def _gold(row: dict, env, tools: bool):
    """``(base, path, text, edits)`` of the row's one-file gold patch (each edit
    ``(old, new, first line)``, as the protocol applies it), or why there is none."""
    parts = split_patch(str(row["patch"]))
    if len(parts) != 1:
        return "the patch touches more than one file"
    path, part = parts[0]
    base = repo_cache().base(row["repo"], find_repo(row, env.repos), row["base_commit"])
    if not (base / path).is_file():
        return f"{path} is not in the base"
    text = (base / path).read_text()
    edits = [replacement(text, start, lines) if tools else
             _sides(start, lines, *span(lines)) for start, lines in hunks(part)]
    if not edits or None in edits:
        return "no hunk gives an edit"
    return base, path, text, edits


def swe_demo(row: dict, env) -> dict | None:
    """One demonstration of training task ``row``, played through the live SWE env ``env``."""
    if is_swe_row(row):
        row = adapt_row(row, "demonstration")
    tools = env.protocol == "tools"
    gold = _gold(row, env, tools)
    if isinstance(gold, str):
        return _drop(row, gold)
    base, path, text, edits = gold
    if not tools and any(_edit_script(path, n, old, new) is None for old, new, n in edits):
        return _drop(row, "a new line reads EOF, which would end the edit's here-document")
    first = edits[0][2]
    last = max(n + old.count("\n") - 1 for old, _, n in edits)
    statement = str(row["problem_statement"])
    files = _test_files(row, base)
    if not files:
        return _drop(row, "no test file")
    shown = frame(statement, base)
    lead = _lead(statement, base, path, text, first, last, shown)
    if isinstance(lead, str):
        return _drop(row, lead)
    token, defined, at, check = lead
    kind = "none" if token is None or check else recovery(row)  # the check: no empty search
    missing = _missing(statement, base) if kind == "empty_search" else None
    prompt, _ = env.reset(seed=0, options={"row": row})
    actions, observations = [], []

    def act(thought: str, command: str) -> str:
        return _call(thought, "bash", {"command": command}) if tools else _bash(thought, command)

    def play(action: str, ok) -> str | None:
        """Play one turn; its observation's text, or None when ``ok`` of it is false (the
        demonstration is dropped) or the episode ended."""
        actions.append(action)
        obs, _, terminated, truncated, _ = env.step(action)
        seen = "".join(str(m.get("content", "")) for m in obs)
        if terminated or truncated or not ok(seen):
            return None
        observations.append(obs)
        return seen

    traced = shown and f"The traceback goes through line {shown[1]} of {shown[0]}; I open " \
        "it there."
    if token is None:  # the view at the traceback's line is the first look, then the edit
        where = traced
    else:
        where = _find(play, act, shown, traced, path, lead, missing)
        if where.startswith("no: "):
            return _drop(row, where[4:])
    hi = min(text.count("\n") + 1, max(last + 3, at + 12))
    views, edit_steps = _open_and_edit(tools, path, at, hi, edits, where)
    if token is None:  # the first view at the traceback's line, as read
        views[0] = (at, act(where, view_at(path, shown[1])))
    for lo, action in views:
        if play(action, lambda seen, lo=lo: f"{lo}" in seen) is None:
            return _drop(row, "the view fails")
    for action in edit_steps:
        if play(action, _edited) is None:
            return _drop(row, "an edit fails")
    seen = statement + "".join(str(m.get("content", "")) for o in observations for m in o)
    if play(act("I run the tests of that behaviour.", _test_run(row, seen, files)),
            _passed) is None:
        return _drop(row, "the tests do not pass")
    done = f"The tests pass with my edit of {path}: I submit."
    actions.append(_call(done, "submit", {}) if tools else _bash(done, f"echo {SUBMIT}"))
    _, reward, terminated, _, _ = env.step(actions[-1])
    if not (terminated and reward >= 1.0):
        return _drop(row, "not graded resolved")
    return {"type": "demonstration", "env": "swe", "builder": "gold-patch-tools",
            "prompt": prompt, "actions": actions, "observations": observations,
            "reward": 1.0, "row": row, "recovery": kind}


def _find(play, act, shown, traced: str, path: str, lead: tuple, missing: str | None) -> str:
    """The steps to the line the search lists, played through ``play``: the view at the
    traceback's line ``shown`` (where there is one), the empty search for ``missing`` (where
    given), then the search of ``lead`` (:func:`_lead`); the thought of the view that
    follows, or ``"no: "`` and why the demonstration is dropped."""
    token, defined, at, check = lead
    if shown and play(act(traced, view_at(*shown)),  # the traceback first, as read
                      lambda seen: f"{shown[1]}\t" in seen) is None:
        return f"no: the view of {shown[0]} at line {shown[1]} fails"
    look = (f"The failing check is {check}; I look for where {token} is " if check else
            f"The failure mentions {token}; I look for where it is ") + (
        "defined." if defined else "used.")
    if missing is not None:  # an empty search first, then another name
        if play(act(f"The failure mentions {missing}; I look for where it is defined.",
                    _search(missing, True)), lambda seen: not _hits(seen, path)
                and ".py:" not in seen) is None:
            return f"no: the search for {missing} is not empty"
        look = f"Nothing defines {missing}; I look for {token}, which the failure names too."
    listing = play(act(look, _search(token, defined)), lambda seen: bool(_hits(seen, path)))
    if listing is None:
        return f"no: the search for {token} does not show {path}"
    # the view starts at the line of the listing nearest above the edit and ends past it:
    # every number the demonstration types next is one it has read
    if at not in _hits(listing, path):
        return f"no: the listing does not show line {at} of {path}"
    return f"{token} is at line {at} of {path}; I open it from there."


def _lead(statement: str, base, path: str, text: str, first: int, last: int,
          shown: tuple[str, int] | None) -> tuple[str | None, bool, int, str | None] | str:
    """How the demonstration reaches the edit at lines ``first``..``last`` of ``path``:
    ``(None, False, at, None)`` when the traceback's frame ``shown`` is in that file and the
    edit near its line (the view at it starts at line ``at``), else the search's ``(token,
    defined, at, check)``: where the traceback shows only tests, a word of the failing
    check's name (``check``; :func:`_by_check`) when one leads there, else a name of the
    statement (:func:`_locate`, ``check`` None); or why none leads there."""
    if shown and shown[0] == path and first >= shown[1] - AROUND and \
            last + 3 - (shown[1] - AROUND) <= 3 * VIEW_LINES:
        return None, False, max(1, shown[1] - AROUND), None
    located = (None if shown else _by_check(statement, base, path, text, first, last)) or \
        _locate(statement, base, path, text, first)
    if located is None:
        return "the statement names nothing that leads to the edit"
    if last + 3 - located[2] > 3 * VIEW_LINES:
        return f"the edit is {first - located[2]} lines below what the search shows"
    return located if len(located) == 4 else (*located, None)


def _by_check(statement: str, base, path: str, text: str, first: int,
              last: int) -> tuple[str, bool, int, str] | None:
    """The search a failing check's own name leads to (``test_floatfmt_multi``: where
    ``floatfmt`` is used): ``(word, defined, at, check)`` for the first word of the
    traceback's first test function's name, in order, whose search lists at most 20 lines
    (:func:`_search`'s ``head``), one of them at line ``at`` of ``path`` at most
    :data:`VIEW_LINES` lines a view, three views, above the edit; None when no word does.
    A rule the statement alone gives, unlike :func:`_locate`'s nearest name
    (docs/decisions/envs-swe.md, "the tenth design")."""
    import keyword
    check = next((name for _, _, name in _FRAME.findall(
        "\n".join(_FENCE.findall(statement))) if name.startswith("test")), None)
    if check is None:
        return None
    files = _sources(base)
    for word in check.split("_")[1:]:
        if len(word) < 3 or keyword.iskeyword(word) or word in _GENERIC:
            continue
        define = re.compile(rf"(def|class) {re.escape(word)}\b")
        defined = any(define.search(ln) for ln in text.split("\n"))
        pattern = define if defined else re.compile(rf"\b{re.escape(word)}\b")
        listed = sum(1 for lines in files.values() for ln in lines if pattern.search(ln))
        above = [i + 1 for i, ln in enumerate(text.split("\n")[:first]) if pattern.search(ln)]
        if above and listed <= 20 and last + 3 - above[-1] <= 3 * VIEW_LINES:
            return word, defined, above[-1], check
    return None


def _open_and_edit(tools: bool, path: str, lo: int, hi: int, edits: list,
                   where: str) -> tuple[list[tuple[int, str]], list[str]]:
    """The views of ``path``'s lines ``lo``..``hi``, at most :data:`VIEW_LINES` each (as
    ``(first line, action)``), and then each edit, as the protocol types them (the
    editor's ``view`` and ``str_replace``, or ``nl`` and :data:`SPLICE` with the new
    lines)."""
    views = []
    for a in range(lo, hi + 1, VIEW_LINES):
        b = min(hi, a + VIEW_LINES - 1)
        thought = where if a == lo else f"The lines I need go on past line {a - 1}; I view " \
            "the next ones."
        views.append((a, _call(thought, "str_replace_editor",
                               {"command": "view", "path": f"/testbed/{path}",
                                "view_range": [a, b]}) if tools else
                      _bash(thought, f"nl -ba {shlex.quote(path)} | sed -n '{a},{b}p'")))
    if tools:
        return views, [_call(f"{_bug(old, new)} I fix it.", "str_replace_editor",
                             {"command": "str_replace", "path": f"/testbed/{path}",
                              "old_str": old, "new_str": new}) for old, new, _ in edits]
    return views, [_bash(f"{_bug(old, new)} I replace line {n}" + (
        f"-{n + old.count(chr(10)) - 1}" if old.count("\n") > 1 else "") + ".",
        _edit_script(path, n, old, new)) for old, new, n in reversed(edits)]


def _edited(text: str) -> bool:
    """Whether an edit's observation shows it applied."""
    return "edited" in text and "ERROR" not in text and "Traceback" not in text


def _passed(text: str) -> bool:
    """Whether a test run's observation shows pytest passing (``2 xfailed`` passes)."""
    return not _FAILING.search(text) and "passed" in text


def _drop(row: dict, why: str) -> None:
    logger.info("%s: no demonstration (%s)", row.get("instance_id"), why)
