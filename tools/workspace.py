"""A repository workspace per episode: a copy-on-write view of a cached base, commands run
in it under isolation and limits (the coding-agent env, :mod:`agentgym.envs.swe`).

What a command runs under, as root on the host (no cgroups on these machines)::

    setpriv --pdeathsig=KILL unshare --mount --propagation private --fork --kill-child
      sh -c 'mount -t overlay -o lowerdir=BASE,upperdir=UPPER,workdir=WORK MERGED; exec …'
        bwrap --unshare-{ipc,pid,net,uts} --die-with-parent --new-session --ro-bind /usr …
              --tmpfs /tmp --ro-bind <python prefixes> --bind MERGED /testbed --chdir /testbed
          prlimit --cpu --as --nproc --fsize --nofile --core=0
            setpriv --reuid=U --regid=U --clear-groups --inh-caps=-all --no-new-privs
              bash -c COMMAND

* **Copy-on-write.** The base (:class:`RepoCache`) is read-only and shared; an episode's
  writes land in its own ``UPPER`` on disk, so they persist from command to command and
  the base is never changed (a test hashes it). The overlay is mounted inside the
  command's private mount namespace: nothing is mounted on the host, so a killed trainer
  leaves no entry in ``/proc/mounts``. A hard-linked tree was not an option (a write
  through a link changes the base); ext4 has no reflinks (docs/decisions/envs-swe.md,
  issue 76).
  Where no overlay mounts (a root that is itself on an overlay, as in some containers:
  :func:`overlay_works`), each workspace is a plain copy of the base instead, with a warning.
* **One identity per episode.** ``U`` is drawn from the code sandbox's uid range and held
  by the workspace until :meth:`Workspace.close`, so RLIMIT_NPROC counts the episode's
  processes and the agent's own files stay its own from turn to turn.
* **No network, no host.** bwrap's namespaces: no interface but loopback, its own PIDs,
  only ``/usr``, the interpreter's folders (read-only) and the workspace visible.
* **Per-command limits** (:class:`CommandLimits`): wall time (the launcher's process group
  is SIGKILLed, and the PID namespace takes every daemon with it), CPU seconds, address
  space, processes, file size, output bytes (head and tail kept, the rest counted).
* **A disk quota per episode** (``disk_mb``): the upper folder's blocks are summed while a
  command runs (every 0.25 s) and after it; a command that passes the quota is killed and
  :attr:`CommandResult.quota_exceeded` says so. RLIMIT_FSIZE bounds any one file between
  two looks.

The workspace root holds one folder per live workspace, named by the process that made it
(``<pid>-<n>``); :func:`clean_stale` removes those of dead processes (a SIGKILLed trainer's)
when the next one starts.

Not protected against: the host kernel's bugs (a namespace is not a VM), and reading what
``/usr`` and the interpreter's installation hold.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import itertools
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from agentgym.supervision.daemon_pool import killable_process_group
from agentgym.tools.sandbox_local import ENV, _bwrap_args, _give_uid, _python_paths, _take_uid

logger = logging.getLogger(__name__)

#: the repository's path inside the sandbox (SWE-bench's images use it too)
REPO = "/testbed"
#: a fixed identity for the base's one commit: the same tree makes the same commit id
_GIT_IDENTITY = {"GIT_AUTHOR_NAME": "agentgym", "GIT_AUTHOR_EMAIL": "swe@agentgym.invalid",
                 "GIT_COMMITTER_NAME": "agentgym", "GIT_COMMITTER_EMAIL": "swe@agentgym.invalid",
                 "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
                 "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z"}
_MOUNT = ('mount -t overlay overlay -o "lowerdir=$1,upperdir=$2,workdir=$3" "$4" || exit 125; '
          'shift 4; exec "$@"')
_NO_MOUNT = 'shift 4; exec "$@"'  # a copied workspace: the same chain, nothing to mount
MOUNT_FAILED = 125
_OVERLAY: dict[str, bool] = {}  # workspace root -> whether an overlay mounts there
POLL_S = 0.25
_counter = itertools.count()


@dataclass(frozen=True)
class CommandLimits:
    """Limits of one command in a workspace, and the episode's disk quota.

    Attributes:
        wall_s: wall-clock seconds per command.
        cpu_s: CPU seconds per process (RLIMIT_CPU).
        memory_mb: address space per process, MiB (RLIMIT_AS); also the private /tmp's size.
        max_procs: processes and threads of the episode's uid (RLIMIT_NPROC).
        file_size_mb: largest file a command may write, MiB (RLIMIT_FSIZE).
        max_output_bytes: output read per command; past it the command is killed.
        keep_output_bytes: of that, how much is kept (head and tail halves).
        disk_mb: the episode's writes to its workspace, MiB.
    """

    wall_s: float = 60.0
    cpu_s: float = 60.0
    memory_mb: int = 2048
    max_procs: int = 64
    file_size_mb: int = 64
    max_output_bytes: int = 8 << 20
    keep_output_bytes: int = 64 << 10
    disk_mb: int = 256

    def __post_init__(self) -> None:
        bad = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if not getattr(self, f.name) > 0}
        if bad:
            raise ValueError(f"workspace limits must be > 0, got {bad}")


@dataclass
class CommandResult:
    """What one command printed (stdout and stderr together, as a terminal shows them).

    Attributes:
        output: the kept output, decoded (invalid UTF-8 replaced); when more was printed,
            its head and tail with ``[... N bytes cut ...]`` between.
        exit_code: the command's status; ``-N`` for a signal; None when it was stopped.
        timed_out: stopped at ``wall_s``.
        output_limited: stopped at ``max_output_bytes``.
        quota_exceeded: stopped (or finished) past the episode's ``disk_mb``.
        cut_bytes: output bytes not kept.
        duration_s: wall seconds, launcher included.
        error: the workspace could not run the command (not the command's doing).
    """

    output: str
    exit_code: int | None
    timed_out: bool = False
    output_limited: bool = False
    quota_exceeded: bool = False
    cut_bytes: int = 0
    duration_s: float = 0.0
    error: str = ""


class _Kept:
    """Head and tail of a stream, the middle counted."""

    def __init__(self, keep: int) -> None:
        self.half, self.head, self.tail, self.total = keep // 2, bytearray(), bytearray(), 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        self.tail = (self.tail + chunk)[-self.half:]

    def text(self) -> tuple[str, int]:
        cut = self.total - len(self.head) - len(self.tail)
        head = bytes(self.head).decode("utf-8", "replace")
        if cut <= 0:
            return head + bytes(self.tail).decode("utf-8", "replace"), 0
        tail = bytes(self.tail).decode("utf-8", "replace")
        return f"{head}\n[... {cut} bytes cut ...]\n{tail}", cut


def tree_bytes(path: Path, stop_at: int | None = None) -> int:
    """Bytes on disk under ``path`` (allocated blocks, links not followed); counting stops
    once past ``stop_at``."""
    total = 0
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                continue  # removed while we looked
        if stop_at is not None and total > stop_at:
            break
    return total


def git(args: list[str], cwd: Path | str, **kw) -> subprocess.CompletedProcess:
    """``git ARGS`` on the host (the cache's own work, never an agent's), failing loudly."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent",
           "GIT_CONFIG_NOSYSTEM": "1", **_GIT_IDENTITY}
    r = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, **kw)
    if r.returncode != 0:
        err = r.stderr.decode("utf-8", "replace") if isinstance(r.stderr, bytes) else r.stderr
        raise RuntimeError(f"git {' '.join(args[:3])} in {cwd} failed: {err.strip()[-500:]}")
    return r


def make_base(source: Path, commit: str, dest: Path) -> None:
    """The tree of ``source`` (a git folder or bundle) at ``commit``, as a repository of one
    commit at ``dest``: no history after (or before) it, so ``git log --all`` cannot show
    the fix. Files are world-writable (the sandbox's uid differs per episode; the overlay
    copies a file up before it is written, so the base itself never changes) and git
    ignores their modes."""
    with tempfile.TemporaryDirectory(prefix="swe-clone-", dir=dest.parent) as tmp:
        clone = Path(tmp) / "clone"
        git(["clone", "--quiet", "--no-checkout", "--no-hardlinks", str(source), str(clone)],
            cwd=tmp)
        made = Path(tmp) / "base"
        made.mkdir()
        try:  # a checkout, not `git archive`: that leaves out export-ignore'd files (tests)
            git(["--work-tree", str(made), "checkout", "--quiet", commit, "--", "."],
                cwd=clone)
        except RuntimeError as e:
            raise ValueError(f"commit {commit!r} is not in {source}: {e}") from None
        git(["init", "--quiet", "--initial-branch=main"], cwd=made)
        git(["config", "core.fileMode", "false"], cwd=made)
        git(["add", "--all", "--force"], cwd=made)
        git(["commit", "--quiet", "--allow-empty", "--no-verify", "-m",
             f"base {commit[:12]}"], cwd=made)
        for root, dirs, files in os.walk(made):
            for name in dirs:
                os.chmod(os.path.join(root, name), 0o777)
            for name in files:
                p = os.path.join(root, name)
                if not os.path.islink(p):
                    os.chmod(p, 0o777 if os.stat(p).st_mode & 0o111 else 0o666)
        os.rename(made, dest)


class RepoCache:
    """Bases of repositories at a commit (:func:`make_base`), each made once per cache and
    shared by every episode of every process (a lock file orders the makers).

    Args:
        root: the cache's folder (``<AGENTGYM_CACHE>/swe/bases``); made 0700: only the
            sandbox's view of a base is the agent's.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        self._lock = threading.Lock()

    def base(self, name: str, source: Path, commit: str) -> Path:
        """The base of repository ``name`` (``owner/repo``) at ``commit``, from ``source``."""
        dest = self.root / f"{name.replace('/', '__')}@{commit}"
        if dest.is_dir():
            return dest
        if not Path(source).exists():
            raise FileNotFoundError(f"repository {name!r}: {source} does not exist")
        with self._lock, open(self.root / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not dest.is_dir():
                t0 = time.perf_counter()
                make_base(Path(source), commit, dest)
                logger.info("made the base of %s@%s in %.1f s", name, commit[:12],
                            time.perf_counter() - t0)
        return dest


def _closure(names: list[str]) -> list:
    """The installed distributions ``names`` need, dependencies included (markers
    evaluated here, extras not taken), each once."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement
    seen, todo, out = set(), list(names), []
    while todo:
        req = Requirement(todo.pop())
        key = req.name.lower().replace("_", "-")
        if key in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(key)
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            raise ValueError(f"the repository's environment needs {req.name!r}, which this "
                             f"interpreter ({sys.executable}) does not have; install it, or "
                             f"name an interpreter that has the repository's dependencies "
                             f"(swe.python=/path/to/bin/python)") from None
        out.append(dist)
        todo += dist.requires or []
    return out


def python_env(root: Path, name: str, packages: list[str]) -> str:
    """The interpreter of repository ``name``'s environment: a venv made once under
    ``root`` (no pip, no site-packages of this interpreter's) holding a copy of the installed
    distributions ``packages`` need, and nothing else: so the tests' runner loads only its
    own plugins, not every one this environment has. Read-only in the sandbox, as every
    interpreter is. Raises ValueError naming a package this interpreter lacks."""
    dists = _closure(packages)
    stamp = ",".join(sorted(f"{d.metadata['Name']}=={d.version}" for d in dists))
    key = hashlib.sha256(f"{sys.version}|{stamp}".encode()).hexdigest()[:12]
    dest = Path(root) / f"{name.replace('/', '__')}-{key}"
    exe = dest / "bin" / "python"
    if exe.exists():
        return str(exe)
    Path(root).mkdir(parents=True, exist_ok=True)
    with open(Path(root) / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if exe.exists():
            return str(exe)
        with tempfile.TemporaryDirectory(prefix="env-", dir=root) as tmp:
            made = Path(tmp) / "env"
            subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv",
                            "--without-pip", str(made)], check=True, capture_output=True)
            site = next(made.glob("lib/python*/site-packages"))
            for dist in dists:
                for f in dist.files or []:
                    if f.parts[0] == ".." or "__pycache__" in f.parts:
                        continue  # its scripts (bin/) and caches
                    target = site / f
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(dist.locate_file(f), target)
            subprocess.run([str(made / "bin" / "python"), "-m", "compileall", "-q", str(site)],
                           check=True, capture_output=True)  # the sandbox cannot write them
            (made / "agentgym-packages.txt").write_text(stamp + "\n")
            os.rename(made, dest)
    logger.info("made the Python environment of %s (%s) at %s", name, stamp, dest)
    return str(exe)


def overlay_works(root: Path) -> bool:
    """Whether an overlay with its upper folder under ``root`` mounts (in a namespace of its
    own, as a command's does); not where ``root`` is itself on an overlay, as in some
    containers. Probed once per root."""
    key = str(root)
    if key not in _OVERLAY:
        with tempfile.TemporaryDirectory(prefix="probe-", dir=root) as tmp:
            for sub in ("lower", "upper", "work", "merged"):
                Path(tmp, sub).mkdir()
            r = subprocess.run(["unshare", "--mount", "--propagation", "private", "--",
                                "/bin/sh", "-c", _MOUNT, "sh", *(f"{tmp}/{d}" for d in (
                                    "lower", "upper", "work", "merged")), "true"],
                               capture_output=True, text=True)
            _OVERLAY[key] = r.returncode == 0
        if not _OVERLAY[key]:
            logger.warning("an overlay does not mount under %s (%s): each workspace is a copy "
                           "of its base instead (slower for large repositories)", root,
                           r.stderr.strip()[-200:])
    return _OVERLAY[key]


def clean_stale(root: Path) -> int:
    """Remove the workspaces under ``root`` whose process is gone; how many."""
    removed = 0
    for entry in Path(root).glob("*-*"):
        pid = entry.name.split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(entry, ignore_errors=True)
            removed += 1
    return removed


class Workspace:
    """One episode's writable view of a base, and the commands run in it.

    Args:
        base: the read-only base (:meth:`RepoCache.base`).
        root: the workspace root; this workspace's folder is made under it.
        limits: per-command limits and the disk quota.
        python: the interpreter commands get as ``python`` (None: this one); its
            installation is bound read-only (:func:`agentgym.tools.sandbox_local._python_paths`).
        binds: ``{host path: sandbox path}`` bound read-only (the harness's patches).
    """

    def __init__(self, base: Path, root: Path, limits: CommandLimits = CommandLimits(),
                 python: str | None = None, binds: dict[str, str] | None = None,
                 overlay: bool | None = None) -> None:
        if shutil.which("bwrap") is None:
            raise ValueError("the workspace needs bubblewrap (apt-get install bubblewrap)")
        if os.geteuid() != 0:
            raise ValueError("the workspace must run as root (it drops every command to the "
                             "episode's own uid and mounts its overlay in a namespace)")
        self.base, self.limits = Path(base), limits
        self.dir = Path(root) / f"{os.getpid()}-{next(_counter)}"
        self.upper = self.dir / "upper"
        self.overlay = overlay_works(Path(root)) if overlay is None else overlay
        for sub in ("upper", "work", "merged") if self.overlay else ():
            (self.dir / sub).mkdir(parents=True)
        if not self.overlay:  # where no overlay mounts: a copy, whose growth is the quota's
            shutil.copytree(self.base, self.dir / "merged", symlinks=True)
            self.upper = self.dir / "merged"
        os.chmod(self.upper, 0o777)  # the merged root takes the upper's mode
        self._start = 0 if self.overlay else tree_bytes(self.upper)
        self.uid = _take_uid()
        exe, prefixes = _python_paths(python)
        args = _bwrap_args(shutil.which("bwrap"), prefixes, limits.memory_mb)
        assert args[-2] == "--chdir"  # the code sandbox's; the workspace's is the repository
        args = args[:-2]
        for host, inside in (binds or {}).items():
            args += ["--ro-bind", host, inside]
        self._bwrap = [*args, "--bind", str(self.dir / "merged"), REPO, "--chdir", REPO]
        bin_dir = os.path.dirname(exe)
        self._env = {**ENV, "PATH": f"{bin_dir}:{ENV['PATH']}", "PYTHONPATH": REPO,
                     "GIT_CONFIG_COUNT": "2", "GIT_CONFIG_KEY_0": "safe.directory",
                     "GIT_CONFIG_VALUE_0": "*", "GIT_CONFIG_KEY_1": "core.fileMode",
                     "GIT_CONFIG_VALUE_1": "false", "TERM": "dumb", "PAGER": "cat",
                     "GIT_PAGER": "cat", **_GIT_IDENTITY}
        self.closed = False

    def _argv(self, command: str) -> list[str]:
        lim = self.limits
        mount = ["setpriv", "--pdeathsig=KILL", "--", "unshare", "--mount", "--propagation",
                 "private", "--fork", "--kill-child", "--", "/bin/sh", "-c",
                 _MOUNT if self.overlay else _NO_MOUNT, "sh",
                 str(self.base), str(self.upper), str(self.dir / "work"),
                 str(self.dir / "merged")]
        limits = ["prlimit", f"--cpu={int(lim.cpu_s)}", f"--as={lim.memory_mb << 20}",
                  f"--nproc={lim.max_procs}", f"--fsize={lim.file_size_mb << 20}",
                  "--nofile=1024", "--core=0", "--"]
        drop = ["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups",
                "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
        return [*mount, *self._bwrap, *limits, *drop, "/bin/bash", "-c", command]

    def run(self, command: str, wall_s: float | None = None, stdin: bytes = b"") -> CommandResult:
        """Run ``command`` with bash in the repository (``/testbed``), ``stdin`` its input;
        never raises for the command's doing."""
        if self.closed:
            raise RuntimeError(f"workspace {self.dir} is closed")
        lim, t0 = self.limits, time.perf_counter()
        deadline = t0 + (wall_s or lim.wall_s)
        kept, quota = _Kept(lim.keep_output_bytes), lim.disk_mb << 20
        proc = subprocess.Popen(self._argv(command),
                                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=self._env, cwd="/", start_new_session=True)
        if stdin:  # from a thread: a command that prints before it reads must not block us
            threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True).start()
        stop, next_look = "", t0 + POLL_S
        with killable_process_group(proc.pid):  # an env call given up on kills it
            try:
                fd = proc.stdout.fileno()
                while True:
                    now = time.perf_counter()
                    ready, _, _ = select.select([fd], [], [], max(0.0, min(deadline, next_look)
                                                                  - now))
                    if ready:
                        chunk = os.read(fd, 1 << 16)
                        if not chunk:
                            break
                        kept.add(chunk)
                        if kept.total > lim.max_output_bytes:
                            stop = "output"
                            break
                    now = time.perf_counter()
                    if now >= deadline:
                        stop = "wall"
                        break
                    if now >= next_look:
                        next_look = now + POLL_S
                        if tree_bytes(self.upper, quota + self._start) - self._start > quota:
                            stop = "disk"
                            break
            finally:
                if stop or proc.poll() is None:
                    _kill(proc)
                proc.wait()
                proc.stdout.close()
        over = stop == "disk" or tree_bytes(self.upper, quota + self._start) - self._start > quota
        output, cut = kept.text()
        code = None if stop else _status(proc.returncode)
        error = ""
        if code == MOUNT_FAILED and ("mount" in output or not output):
            error, code = "the workspace's overlay could not be mounted", None
        elif proc.returncode == 1 and output.startswith("bwrap:"):
            error, code = f"the sandbox failed to start: {output.strip()[:300]}", None
        return CommandResult(output, code, stop == "wall", stop == "output", over, cut,
                             time.perf_counter() - t0, error)

    def disk_bytes(self) -> int:
        """Bytes the episode has written to its workspace."""
        return tree_bytes(self.upper) - self._start

    def diff(self) -> str:
        """The episode's changes as a patch against the base (new files included, binary
        as git's binary patches); '' when nothing changed."""
        r = self.run("git add --all --force >/dev/null 2>&1; "
                     "git diff --cached --binary --no-color --no-ext-diff HEAD")
        if r.error or r.exit_code != 0 or r.cut_bytes:
            raise RuntimeError(f"could not read the workspace's diff: {r.error or r.output[-300:]}"
                               + (" (the diff is over the output limit)" if r.cut_bytes else ""))
        return r.output

    def close(self) -> None:
        """Remove the workspace (idempotent): its folder, and its uid back to the pool."""
        if self.closed:
            return
        self.closed = True
        _give_uid(self.uid)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except (BrokenPipeError, OSError):
        pass  # the command exited (or was killed) before reading all of it


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _status(rc: int) -> int:
    """bwrap reports a child killed by signal N as 128 + N; the shell does the same."""
    return -(rc - 128) if 128 < rc < 128 + 65 else rc
