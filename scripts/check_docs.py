"""Every shell command the docs show, checked against the code, so that a command cannot go
stale without a test failing (tests/test_docs.py runs this in the default tier).

    python scripts/check_docs.py                  # README.md, docs/ENVS.md, docs/ECOSYSTEM.md,
                                                  #  docs/decisions/*.md, recipes/*.yaml's headers
    python scripts/check_docs.py --run            # ... and run the cheap ones for real
    python scripts/check_docs.py --docs FILE.md   # other files

What counts as a command: each line of a ```bash block (``\\`` continues it, ``#`` starts a
comment, ``&&``, ``;``, ``|`` and ``&`` separate commands), each inline code span that
starts with ``agentgym``, ``python``, ``pytest``, ``make`` or ``pip`` (outside the README's
table of old names), and each indented ``#   agentgym …`` line of a recipe's header. A
block (a fenced block, a span, a recipe header) is one session: a path a command writes
(``out=``, ``run_dir=``, ``--out``, an index ``serve-retriever --corpus`` builds, ``> FILE``)
may be read by a later command of the same block.

What is checked:

* ``agentgym SUB``: SUB exists; a ``key=value`` command's keys resolve under the defaults of
  that command (``agentgym.cli.COMMAND_DEFAULTS``: ``train`` samples 5, ``sft`` has its
  learning rate) and the env names resolve; a flag command's flags parse with its parser;
  every path it reads (``data=``, ``model=``, ``trainer.cold_start=``, ``--corpus``, …)
  exists, matches a glob, or was written earlier in the block; every ``module:attr`` imports.
* ``python FILE …`` / ``python -m MODULE …``: the file or module exists and each ``--flag``
  is in its ``--help``. ``pytest …``: its paths exist, its ``-m`` markers are registered.
  ``make T``: the Makefile has T. ``pip install``: the extras exist in pyproject.toml, a
  pinned ``pkg==version`` is the one the Makefile or requirements/ pin.

What the docs leave to the reader (:data:`PLACEHOLDER`: ``/path/to/…``, ``HOST``, ``~/…``,
``/models/…``, ``my_…`` names, ``RUN_DIR``-style capitals, ``…``) is not checked as a path
or a module, and a command holding one is not run. Files the docs give whole are written
first into the folder the commands run in: ``my_pkg/echo.py`` and ``echo.jsonl`` (docs/ENVS.md
sections 1 and 3), and docs/ENVS.md's ``envs/echo.py`` joins ``agentgym.envs`` as the page
says (``env=echo``).

``--run`` runs for real, in that folder (every other repository entry linked into it): every
``agentgym config`` and ``agentgym plan``, ``agentgym check-env`` (when it names no
placeholder), ``agentgym index build --method bm25``, ``agentgym sandbox exec`` with its
piped input, and each ``agentgym train`` with ``model=tiny``, ``trainer.cold_start=off`` and
at most 2 steps. Exit status 1 with one line per problem (``file:line: command: what``).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/ENVS.md", "docs/ECOSYSTEM.md")
#: the decision records (docs/DECISIONS.md's areas): their commands are checked like the
#: pages', but not their figures (:func:`figure_problems`), which record what each session
#: measured, in BENCHMARKS' sections or not, as history
DECISIONS = "docs/decisions/*.md"
RECIPES = "recipes/*.yaml"
#: README sections whose spans name what no longer exists, on purpose
SKIP_SECTIONS = ("what moved",)
#: the reader's own files, hosts and packages (never checked as paths, never run)
PLACEHOLDER = re.compile(r"…|\.\.\.|/path/to/|\bHOST\b|^~/|^/models/|(^|[/.=:\s])my_\w"
                         r"|^[A-Z][A-Z0-9_]*(\.\w+)?$")
#: what the docs give whole (:func:`prepare_workdir`): not the reader's, though named so
DOCS_GIVE = ("my_pkg.echo:", "echo.jsonl")
#: keys whose value is a path the command reads (when it looks like one), or writes
READS = ("data", "data.name", "trainer.eval_data", "model", "model.path", "trainer.cold_start",
         "retriever.index", "verifiers.path")
WRITES = ("out", "run_dir")
#: keys whose value is ``module:attr``
MODULES = ("agent", "reward", "openenv.app")
SEPARATORS = {"&&", "||", ";", "|", "&"}
WORDS = ("agentgym", "python", "pytest", "make", "pip")
OTHER_WORDS = {"echo", "source", "cd", "export", "git", "tensorboard"}


@dataclass
class Command:
    where: str  # file:line
    argv: list[str]
    stdin: str | None = None  # what ``echo X |`` pipes in
    redirect: str | None = None  # ``> FILE``

    @property
    def text(self) -> str:
        return shlex.join(self.argv)


@dataclass
class Block:
    where: str
    commands: list[Command] = field(default_factory=list)
    #: an inline span of prose: a mention (``agentgym serve``) may leave out required
    #: arguments, and a bare file name in it (``agentgym inspect traj.jsonl``) is the reader's
    span: bool = False


# ------------------------------------------------------------------------- extraction


def _strip_comment(line: str) -> str:
    """The line without its ``#`` comment: a ``#`` that starts a word outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def split_line(text: str, where: str) -> list[Command]:
    """One logical shell line's commands (``a && b``, ``echo x | c``, ``c &``)."""
    lex = shlex.shlex(text, posix=True, punctuation_chars=True)
    lex.whitespace_split, lex.commenters = True, ""
    tokens, commands, current = list(lex), [], []
    piped = None
    i = 0
    while i <= len(tokens):
        tok = tokens[i] if i < len(tokens) else ";"
        if tok in SEPARATORS:
            if current:
                cmd = Command(where, current, stdin=piped)
                piped = None
                if tok == "|" and current[0] == "echo":
                    piped = " ".join(current[1:]) + "\n"
                else:
                    commands.append(cmd)
            current = []
        elif tok == ">" and i + 1 < len(tokens):
            current_redirect = tokens[i + 1]
            commands.append(Command(where, current, stdin=piped, redirect=current_redirect))
            current, piped = [], None
            i += 1
        else:
            current.append(tok)
        i += 1
    return commands


def _lines_to_commands(lines: list[tuple[int, str]], path: str) -> list[Command]:
    out, pending, start = [], "", 0
    for lineno, raw in lines:
        line = _strip_comment(raw).rstrip()
        if not pending:
            start = lineno
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        pending += line
        if pending.strip():
            out.extend(split_line(pending, f"{path}:{start}"))
        pending = ""
    return out


def blocks_in_markdown(path: str, text: str) -> list[Block]:
    blocks, lines = [], text.splitlines()
    fence, body, section = None, [], ""
    prose: list[tuple[int, str]] = []  # (line, text) outside fences, for the spans
    for n, line in enumerate(lines, 1):
        m = re.match(r"^\s*```(\w*)", line)
        if fence is None and m:
            fence, body = (m.group(1), n), []
            continue
        if fence is not None and line.strip().startswith("```"):
            if fence[0] in ("bash", "sh", "shell"):
                blocks.append(Block(f"{path}:{fence[1]}", _lines_to_commands(body, path)))
            fence = None
            continue
        if fence is not None:
            body.append((n, line))
            continue
        if line.startswith("#"):
            section = line.lower()
        if not any(s in section for s in SKIP_SECTIONS):
            prose.append((n, line))
    # inline spans may wrap lines: search the prose joined, and map offsets back to lines
    joined, starts = "", []
    for n, line in prose:
        starts.append((len(joined), n))
        joined += line + "\n"
    # one backtick each side: a span of several (four, quoting a fence's ```python) is no command
    for m in re.finditer(r"(?<!`)`((?:%s) [^`]*)`(?!`)" % "|".join(WORDS), joined):
        lineno = max(n for off, n in starts if off <= m.start())
        text_ = " ".join(m.group(1).split())
        blocks.append(Block(f"{path}:{lineno}", split_line(text_, f"{path}:{lineno}"),
                            span=True))
    return blocks


def blocks_in_recipe(path: str, text: str) -> list[Block]:
    """The indented command lines of a recipe's header (``#   agentgym train …``)."""
    blocks, lines, i = [], text.splitlines(), 0
    header = [(n, ln) for n, ln in enumerate(lines, 1) if ln.startswith("#")]
    while i < len(header):
        n, line = header[i]
        if re.match(r"^#\s{2,}(%s)\b" % "|".join(WORDS), line):
            body = [(n, line[1:])]
            while body[-1][1].rstrip().endswith("\\") and i + 1 < len(header):
                i += 1
                body.append((header[i][0], header[i][1][1:]))
            blocks.append(Block(f"{path}:{n}", _lines_to_commands(body, path)))
        i += 1
    return blocks


def collect(docs: list[str]) -> list[Block]:
    blocks = []
    for rel in docs:
        text = (ROOT / rel).read_text(encoding="utf-8")
        if rel.endswith((".yaml", ".yml")):
            blocks += blocks_in_recipe(rel, text)
        else:
            blocks += blocks_in_markdown(rel, text)
    return blocks


# ------------------------------------------------------------------ the docs' own files


def _block_after(text: str, marker: str, lang: str) -> str:
    section = text[text.index(marker):]
    return re.search(r"```%s\n(.*?)```" % lang, section, re.S).group(1)


def prepare_workdir(work: Path) -> None:
    """Link the repository's entries into ``work`` and write the files the docs give."""
    for entry in ROOT.iterdir():
        if entry.name.startswith(".") or entry.name in ("runs", "indexes", "idx"):
            continue
        (work / entry.name).symlink_to(entry)
    envs_md = (ROOT / "docs" / "ENVS.md").read_text(encoding="utf-8")
    (work / "my_pkg").mkdir()
    (work / "my_pkg" / "__init__.py").write_text("")
    (work / "my_pkg" / "echo.py").write_text(_block_after(envs_md, "`my_pkg/echo.py`", "python"))
    (work / "echo.jsonl").write_text(_block_after(envs_md, "## 3. Data", "json"))
    (work / "envs_added").mkdir()
    (work / "envs_added" / "echo.py").write_text(
        _block_after(envs_md, "`envs/echo.py`, the whole of it", "python"))


def add_docs_envs(work: Path) -> None:
    """docs/ENVS.md's ``envs/echo.py`` as a module of ``agentgym.envs`` (section 6), and
    ``my_pkg`` importable (section 1)."""
    import agentgym.envs as envs
    from agentgym.envs.registration import discover_envs
    sys.path.insert(0, str(work))
    envs.__path__.append(str(work / "envs_added"))
    discover_envs()


# --------------------------------------------------------------------------- checking


class Checker:
    def __init__(self, work: Path, run: bool) -> None:
        self.work, self.run = work, run
        self.problems: list[str] = []
        self.ran: dict[str, int] = {}
        self.checked = 0
        self._help: dict[str, str] = {}
        self._written: set[str] = set()
        self.span = False

    def problem(self, cmd: Command, what: str) -> None:
        self.problems.append(f"{cmd.where}: {cmd.text}: {what}")

    # -- paths
    def _exists(self, value: str) -> bool:
        p = os.path.expanduser(value)
        if any(p == w or p.startswith(w.rstrip("/") + "/") for w in self._written):
            return True
        full = p if os.path.isabs(p) else str(self.work / p)
        return os.path.exists(full) or bool(glob.glob(full))

    def reads(self, cmd: Command, value: str, what: str) -> None:
        for v in _items(str(value)):
            if self.span and "/" not in v:
                continue  # prose names the reader's file (agentgym inspect traj.jsonl)
            if not self._exists(v) and not PLACEHOLDER.search(v):
                self.problem(cmd, f"{what} {v!r} does not exist and no earlier command of "
                                  f"the block writes it")

    def writes(self, value: str, folder: bool = False) -> None:
        path = os.path.expanduser(str(value)).rstrip("/")
        self._written.add(path)
        if folder and not PLACEHOLDER.search(path):  # what a later model= sees on disk
            (self.work / path).mkdir(parents=True, exist_ok=True)

    def module(self, cmd: Command, key: str, spec: str) -> None:
        import importlib
        mod, _, attr = spec.partition(":")
        try:
            obj = importlib.import_module(mod)
            if attr:
                getattr(obj, attr)
        except (ImportError, AttributeError) as e:
            if not PLACEHOLDER.search(spec):
                self.problem(cmd, f"{key}={spec}: {type(e).__name__}: {e}")

    # -- commands
    def block(self, block: Block) -> None:
        self._written, self.span = set(), block.span
        for cmd in block.commands:
            self.checked += 1
            word = cmd.argv[0]
            if word == "agentgym":
                self.agentgym(cmd)
            elif word in ("python", "python3"):
                self.python(cmd)
            elif word == "pytest":
                self.pytest(cmd)
            elif word == "make":
                self.make(cmd)
            elif word == "pip":
                self.pip(cmd)
            elif word not in OTHER_WORDS:
                self.problem(cmd, f"{word!r} is no command the docs' check knows "
                                  f"({', '.join(WORDS + tuple(sorted(OTHER_WORDS)))})")
            if cmd.redirect:
                self.writes(cmd.redirect)

    def agentgym(self, cmd: Command) -> None:
        from agentgym import cli
        if len(cmd.argv) < 2:
            return
        sub, args = cmd.argv[1], cmd.argv[2:]
        if sub in cli.FLAG_PARSERS:  # "--model …": the placeholder is the flag's value
            return self.flags(cmd, sub, [a for i, a in enumerate(args) if a != "…" or
                                         (i and args[i - 1].startswith("--"))])
        args = [a for a in args if a != "…"]
        from agentgym import envs
        if sub in envs.env_commands():  # a command an env's manifest brings: agentgym swe ...
            return self.env_command(cmd, sub, args)
        if sub not in cli.COMMANDS:
            names = sorted({**cli.COMMANDS, **cli.FLAG_PARSERS})
            return self.problem(cmd, f"no subcommand {sub!r}; valid: {', '.join(names)}")
        pairs = [a for a in args if "=" in a]
        positional = [a for a in args if "=" not in a]
        own = cli.COMMAND_KEYS.get(sub, ())
        pairs = [a for a in pairs if a.partition("=")[0] not in own]
        if sub in ("inspect", "status", "compare"):
            for p in positional:
                self.reads(cmd, p, "the path")
        elif sub == "check-env":
            from agentgym import envs
            for name in positional:
                try:
                    envs.resolve_env_id(name)
                except (KeyError, ValueError, ImportError) as e:
                    if not PLACEHOLDER.search(name):
                        self.problem(cmd, f"env {name!r}: {e}")
        elif positional:
            return self.problem(cmd, f"{sub} takes key=value overrides, not {positional}")
        if sub not in ("inspect", "status"):
            self.resolve(cmd, sub, pairs)
        if self.run and self.cheap(cmd, sub):
            self.execute(cmd, sub)

    def env_command(self, cmd: Command, name: str, args: list[str]) -> None:
        """``agentgym NAME SUBCOMMAND key=value ...`` of an env's manifest: the subcommand
        exists, its keys resolve with ``env=`` that env, its paths exist."""
        from agentgym import envs
        env = envs.env_commands()[name]
        subs = envs.env_manifest(env).commands[name]
        if not args or args[0] not in subs:
            got = args[0] if args else "(none)"
            return self.problem(cmd, f"agentgym {name}: no subcommand {got!r}; valid: "
                                     f"{', '.join(subs)}")
        if positional := [a for a in args[1:] if "=" not in a]:
            return self.problem(cmd, f"{name} {args[0]} takes key=value overrides, not "
                                     f"{positional}")
        self.resolve(cmd, name, [*args[1:], f"env={env}"])

    def resolve(self, cmd: Command, sub: str, pairs: list[str]) -> None:
        from agentgym import cli
        from agentgym.config import ALIASES, all_keys, build_config
        from agentgym.core.overrides import parse_overrides
        given = parse_overrides(pairs)
        defaults = cli.COMMAND_DEFAULTS.get(sub)
        plain = {k: v for k, v in given.items() if not PLACEHOLDER.search(str(v))}
        try:
            cfg = cli._config([f"{k}={_raw(pairs, k)}" for k in plain], defaults)
        except (KeyError, ValueError, ImportError) as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else e
            return self.problem(cmd, f"does not resolve: {msg}")
        keys = set(all_keys(cfg)) | set(ALIASES) | {"env", "model", "data", "recipe", "algo",
                                                     "engine", "reward"}
        for k in given:
            if k not in plain and ALIASES.get(k, k) not in keys:
                try:  # a placeholder's key must exist all the same
                    build_config({**plain, k: given[k]}, defaults)
                except KeyError as e:
                    self.problem(cmd, f"does not resolve: {e.args[0]}")
                except ValueError:
                    pass  # the reader's value, not the key, is what the config refused
        for k, v in given.items():
            v = str(v)
            if k in READS and _looks_like_path(k, v):
                if not (k == "trainer.cold_start" and v in ("auto", "off")):
                    self.reads(cmd, v, f"{k}=")
            elif k in MODULES and ":" in v:
                self.module(cmd, k, v)
            elif k in WRITES:
                self.writes(v, folder=k == "run_dir")

    def flags(self, cmd: Command, sub: str, args: list[str]) -> None:
        from agentgym import cli
        parser = cli.FLAG_PARSERS[sub]()
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parse = parser.parse_intermixed_args if sub == "sandbox" else parser.parse_args
                ns = parse(args)
        except SystemExit:
            said = err.getvalue().strip().splitlines()[-1]
            if not (self.span and "arguments are required" in said):
                self.problem(cmd, f"does not parse: {said}")
            return
        corpus = getattr(ns, "corpus", None)
        if corpus:
            self.reads(cmd, corpus, "--corpus")
        if sub == "index":
            if self.run and ns.method == "bm25" and not PLACEHOLDER.search(str(ns.out)):
                self.execute(cmd, "index")
            self.writes(ns.out)
        elif sub == "serve-retriever" and ns.index:
            (self.writes if corpus else lambda v: self.reads(cmd, v, "--index"))(ns.index)
        elif sub == "sandbox":
            if ns.file != "-":
                self.reads(cmd, ns.file, "--file")
            if self.run:
                self.execute(cmd, "sandbox")
        elif sub == "serve" and _looks_like_path("model", str(ns.model)):
            self.reads(cmd, ns.model, "--model")

    def python(self, cmd: Command) -> None:
        argv = cmd.argv[1:]
        if not argv or argv == ["-m"]:
            return self.problem(cmd, "names no file or module to run")
        if argv[:1] == ["-m"]:
            import importlib.util
            target = argv[1]
            try:
                found = importlib.util.find_spec(target) is not None
            except (ImportError, ValueError):  # a dotted name whose package is missing
                found = False
            if not found:
                return self.problem(cmd, f"no module {target!r}")
            run, rest = [sys.executable, "-m", target], argv[2:]
        else:
            target = argv[0]
            if not (ROOT / target).is_file():
                return self.problem(cmd, f"no file {target}")
            run, rest = [sys.executable, str(ROOT / target)], argv[1:]
        flags = [a.split("=")[0] for a in rest if a.startswith("--")]
        if not flags:
            return
        if target not in self._help:
            done = subprocess.run(run + ["--help"], cwd=self.work, capture_output=True,
                                  text=True, timeout=300)
            self._help[target] = done.stdout if done.returncode == 0 else ""
            if done.returncode != 0:
                return self.problem(cmd, f"--help failed ({done.returncode}): "
                                         f"{done.stderr.strip()[-300:]}")
        for flag in flags:
            if not re.search(r"(^|[\s,\[])%s\b" % re.escape(flag), self._help[target]):
                self.problem(cmd, f"{target} has no flag {flag} (its --help)")

    def pytest(self, cmd: Command) -> None:
        argv = cmd.argv[1:]
        registered = _markers()
        for i, a in enumerate(argv):
            if a == "-m" and i + 1 < len(argv):
                used = set(re.findall(r"\w+", argv[i + 1])) - {"not", "and", "or"}
                for m in used - registered:
                    self.problem(cmd, f"marker {m!r} is not registered in pyproject.toml "
                                      f"({', '.join(sorted(registered))})")
            elif not a.startswith("-") and (i == 0 or argv[i - 1] != "-m"):
                self.reads(cmd, a.split("::")[0], "the test path")

    def make(self, cmd: Command) -> None:
        targets = _make_targets()
        for t in cmd.argv[1:]:
            if "=" not in t and not t.startswith("-") and t not in targets:
                self.problem(cmd, f"the Makefile has no target {t!r}")

    def pip(self, cmd: Command) -> None:
        args = cmd.argv[2:] if cmd.argv[1:2] == ["install"] else []
        extras = _extras()
        pins = _pins()
        for a in args:
            if m := re.fullmatch(r"\.\[([\w,-]+)\]", a):
                for extra in m.group(1).split(","):
                    if extra not in extras and not PLACEHOLDER.search(extra):
                        self.problem(cmd, f"pyproject.toml has no extra {extra!r}; it has "
                                          f"{', '.join(sorted(extras))}")
            elif m := re.fullmatch(r"([\w.-]+)==([\w.]+)", a):
                if pins.get(m.group(1).lower()) != m.group(2):
                    self.problem(cmd, f"{a}: the Makefile and requirements/ pin "
                                      f"{m.group(1)}=={pins.get(m.group(1).lower())}")
            elif not a.startswith("-") and a != "." and not PLACEHOLDER.search(a):
                self.problem(cmd, f"pip install {a}: the docs install this checkout "
                                  f"(-e '.[extra]') or a pinned package (name==version)")

    # -- running the cheap ones
    def cheap(self, cmd: Command, sub: str) -> bool:
        if any(PLACEHOLDER.search(a) and not any(g in a for g in DOCS_GIVE) for a in cmd.argv):
            return False
        if sub in ("config", "plan", "check-env"):
            return True
        if sub != "train":
            return False
        from agentgym.core.overrides import parse_overrides
        given = parse_overrides([a for a in cmd.argv[2:] if "=" in a])
        steps = given.get("trainer.total_steps")
        return (given.get("model") == "tiny" and given.get("trainer.cold_start") == "off"
                and steps is not None and int(steps) <= 2
                and not any(k.split(".")[0] in ("recipe", "ray", "backend", "engine")
                            for k in given))

    def execute(self, cmd: Command, kind: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(self.work), str(ROOT), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, __file__, "--exec", str(self.work), "--",
                               *cmd.argv[1:]],
                              cwd=self.work, input=cmd.stdin, capture_output=True, text=True,
                              env=env, timeout=900)
        self.ran[kind] = self.ran.get(kind, 0) + 1
        if done.returncode != 0:
            self.problem(cmd, f"exit status {done.returncode}: "
                              f"{(done.stderr or done.stdout).strip()[-600:]}")
        elif kind == "config":
            try:
                json.loads(done.stdout)
            except ValueError:
                self.problem(cmd, "printed no JSON config")


def _items(value: str) -> list[str]:
    v = value.strip()
    if v.startswith("[") and v.endswith("]"):
        return [x.strip() for x in v[1:-1].split(",") if x.strip()]
    return [v]


def _raw(pairs: list[str], key: str) -> str:
    return next(p.partition("=")[2] for p in pairs if p.partition("=")[0] == key)


def _looks_like_path(key: str, value: str) -> bool:
    if key == "trainer.eval_data" or key.startswith("data"):
        return any("/" in v or v.endswith((".jsonl", ".json", ".parquet", ".gz"))
                   for v in _items(value))
    return "/" in value or value.startswith((".", "~"))


def _toml_table(name: str) -> str:
    """The text of pyproject.toml's ``[name]`` table (read by pattern: tomllib is 3.11+)."""
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r"^\[%s\]\n(.*?)(?=^\[|\Z)" % re.escape(name), text, re.M | re.S)
    return m.group(1) if m else ""


def _extras() -> set[str]:
    return set(re.findall(r"^([\w-]+)\s*=\s*\[", _toml_table("project.optional-dependencies"),
                          re.M))


def _markers() -> set[str]:
    table = _toml_table("tool.pytest.ini_options")
    listed = re.search(r"^markers\s*=\s*\[(.*?)\]", table, re.M | re.S)
    return set(re.findall(r"[\"']([\w-]+):", listed.group(1))) if listed else set()


def _make_targets() -> set[str]:
    db = subprocess.run(["make", "-pRrq", "-f", "Makefile", ":"], cwd=ROOT,
                        capture_output=True, text=True).stdout
    return {m.group(1) for m in re.finditer(r"^([^\s:#=%][^:=]*?):(?!=)", db, re.M)}


def _pins() -> dict[str, str]:
    text = (ROOT / "Makefile").read_text() + "".join(
        p.read_text() for p in (ROOT / "requirements").glob("*.txt"))
    return {m.group(1).lower(): m.group(2)
            for m in re.finditer(r"(?<![\w.-])([A-Za-z][\w.-]*)==([\w.]+)", text)}


# ----------------------------------------------------------------------------- figures

#: a measured figure: a decimal (0.140, 9.8, 1.5x) or a power of ten (1.6e-11); not a
#: version (2.13.0) and not what a code span holds (a key's value)
FIGURE = re.compile(r"(?<![\w.])(\d+\.\d+(?:e-?\d+)?|\d+e-\d+)(?![\d.]|\.\d)")


def benchmark_sections(text: str) -> dict[str, str]:
    """docs/BENCHMARKS.md's ``## `` sections by heading."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _paragraphs(path: str, text: str) -> list[tuple[int, str]]:
    """(first line, text) of each prose paragraph (a recipe: its header, whole)."""
    if path.endswith((".yaml", ".yml")):
        head = [ln[1:] for ln in text.splitlines() if ln.startswith("#")]
        return [(1, "\n".join(head))]
    out, current, start, fence = [], [], 0, False
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            fence = not fence
            continue
        if fence or not line.strip() or line.startswith(("#", "|")):
            if current:
                out.append((start, "\n".join(current)))
            current = []
            continue
        if not current:
            start = n
        current.append(line)
    if current:
        out.append((start, "\n".join(current)))
    return out


def _rounds_to(shown: str, measured: str) -> bool:
    """``shown`` is ``measured`` rounded (0.008 from 0.00794; 9.8 from 9.8)."""
    from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
    try:
        x, y = Decimal(shown), Decimal(measured)
        return y.quantize(Decimal(1).scaleb(x.as_tuple().exponent), ROUND_HALF_UP) == x
    except InvalidOperation:
        return False


def figure_problems(path: str, text: str, benchmarks: str) -> list[str]:
    """Each figure of a paragraph that cites docs/BENCHMARKS.md must be in the section it
    names (by heading, in quotes: ``BENCHMARKS, "make demo"``), as measured or rounded, so
    a run that rewrites the section cannot leave the page behind."""
    sections = benchmark_sections(benchmarks)
    problems = []
    for line, para in _paragraphs(path, text):
        if "BENCHMARKS" not in para:
            continue
        quoted = [" ".join(q.split()) for q in re.findall(r'"([^"]+)"', para)]
        cited = [h for q in quoted for h in sections if h.startswith(q)]
        prose = re.sub(r"`[^`]*`", " ", para)
        shown = dict.fromkeys(FIGURE.findall(prose))
        if shown and not cited:
            problems.append(f"{path}:{line}: figures {', '.join(shown)} beside "
                            f"docs/BENCHMARKS.md, but no section of it named (\"HEADING\")")
            continue
        measured = [m for h in cited for m in FIGURE.findall(sections[h])]
        missing = [x for x in shown if not any(_rounds_to(x, y) for y in measured)]
        if missing:
            problems.append(f"{path}:{line}: {', '.join(missing)}: not in docs/BENCHMARKS.md's "
                            f"{' or '.join(repr(h) for h in cited)} (as measured or rounded)")
    return problems


def check(docs: list[str], run: bool, work: Path) -> Checker:
    prepare_workdir(work)
    add_docs_envs(work)
    cwd = os.getcwd()
    os.chdir(work)  # the commands' relative paths, and what cli._config imports
    try:
        checker = Checker(work, run)
        for block in collect(docs):
            checker.block(block)
        benchmarks = (ROOT / "docs" / "BENCHMARKS.md").read_text(encoding="utf-8")
        for rel in docs:
            if (ROOT / rel).resolve().match(str(ROOT / DECISIONS)):
                continue
            checker.problems += figure_problems(rel, (ROOT / rel).read_text(encoding="utf-8"),
                                                benchmarks)
    finally:
        os.chdir(cwd)
    return checker


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--exec"]:  # one command run for real: the CLI with the docs' envs added
        from agentgym import cli
        add_docs_envs(Path(argv[1]))
        return cli.main(argv[3:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", nargs="+", default=None,
                   help="files to check (default: the README, docs/ENVS.md, docs/ECOSYSTEM.md, "
                        "docs/decisions/*.md, the recipes)")
    p.add_argument("--run", action="store_true", help="also run the cheap commands for real")
    p.add_argument("--report", default=None, help="write the result as JSON here")
    ns = p.parse_args(argv)
    docs = ns.docs or [*DOCS, *(str(r.relative_to(ROOT)) for g in (DECISIONS, RECIPES)
                                for r in sorted(ROOT.glob(g)))]
    with tempfile.TemporaryDirectory(prefix="agentgym-docs-") as work:
        checker = check(docs, ns.run, Path(work))
    for line in checker.problems:
        print(line)
    ran = ", ".join(f"{k} {v}" for k, v in sorted(checker.ran.items())) or "nothing"
    print(f"{checker.checked} commands in {len(docs)} files: {len(checker.problems)} "
          f"problems; ran {ran}", file=sys.stderr)
    if ns.report:
        Path(ns.report).write_text(json.dumps({"commands": checker.checked, "ran": checker.ran,
                                               "problems": checker.problems}, indent=2))
    return 1 if checker.problems else 0


if __name__ == "__main__":
    sys.exit(main())
