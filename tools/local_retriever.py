"""Start and stop a local retrieval server (``python -m retriever_server``) as a subprocess.

Used when no ``retriever.url`` is configured: the laptop default and the tests. The
server runs in its own process group on a free loopback port; its output goes to a log
file whose tail is quoted if it fails to start. The BM25 index is cached on disk under
``$AGENTGYM_CACHE`` (default ``~/.cache/agentgym``) as ``retriever/<corpus-sha256[:16]>/bm25``,
so only the first start for a given corpus builds it (~2 s for the shipped 21k passages).

Example::

    with LocalRetriever(Path("data/corpus/wiki_passages.jsonl.gz")) as r:
        client = RetrieverClient(r.url)

    url = ensure_local_retriever("data/corpus/wiki_passages.jsonl.gz")  # one per corpus
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from agentgym.paths import cache_dir  # import-light: no torch

logger = logging.getLogger(__name__)

_REPO_ROOT = Path(__file__).resolve().parents[1]  # so the child finds retriever_server


def default_index_dir(corpus: Path) -> Path:
    """Where the BM25 index of ``corpus`` is cached (keyed by the corpus's content hash)."""
    h = hashlib.sha256()
    with open(corpus, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return cache_dir() / "retriever" / h.hexdigest()[:16] / "bm25"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 30) -> str:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:]) or "(empty log)"


class LocalRetriever:
    """A ``retriever_server`` subprocess on 127.0.0.1.

    Args:
        corpus: passages file (JSONL or JSONL.gz with ``id`` and ``contents``), indexed
            with BM25 if ``index_dir`` holds no index. May be None when ``index_dir`` holds
            a saved index (BM25 or dense, from ``agentgym index build``).
        index_dir: saved-index directory (loaded if present, else built and saved there);
            None uses the on-disk cache (:func:`default_index_dir`).
        startup_timeout: seconds to wait for ``/health`` before giving up.
        extra_args: more ``python -m retriever_server`` flags (e.g. ``["--batching", "off"]``).

    Attributes:
        url: ``http://127.0.0.1:PORT`` once started, else None.
        log_path: the server's combined stdout/stderr.
    """

    def __init__(self, corpus: Path | str | None = None, index_dir: Path | str | None = None,
                 startup_timeout: float = 120.0, extra_args: list[str] | tuple = ()) -> None:
        self.corpus = Path(corpus).resolve() if corpus is not None else None
        self.index_dir = Path(index_dir) if index_dir is not None else None
        if self.corpus is None and self.index_dir is None:
            raise ValueError("LocalRetriever needs a corpus file, a saved index directory, "
                             "or both")
        if self.corpus is not None and not self.corpus.is_file():
            raise FileNotFoundError(f"retrieval corpus {self.corpus} does not exist; build the "
                                    f"shipped one with `python scripts/build_search_data.py`")
        # retriever_server.index.is_index, restated: tools/ shares only the schema with the
        # server package (DESIGN.md), so it does not import the server's index code.
        if self.corpus is None and not (self.index_dir / "meta.json").is_file() \
                and not (self.index_dir / "docs.jsonl").is_file():
            raise FileNotFoundError(f"{self.index_dir} holds no saved index; build one with "
                                    f"`agentgym index build --corpus FILE --method bm25|dense "
                                    f"--out {self.index_dir}`")
        self.extra_args = list(extra_args)
        self.startup_timeout = startup_timeout
        self.url: str | None = None
        self.log_path = Path(tempfile.mkdtemp(prefix="agentgym-retriever-")) / "server.log"
        self._proc: subprocess.Popen | None = None

    @property
    def alive(self) -> bool:
        """True while the server process is running."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> str:
        """Start the server (no-op if running) and wait until it is healthy.

        Returns:
            The base URL (``http://127.0.0.1:PORT``).

        Raises:
            RuntimeError: the server exited during startup (message holds its log tail).
            TimeoutError: it was not healthy within ``startup_timeout`` seconds.
        """
        if self.alive:
            return self.url
        index_dir = self.index_dir or default_index_dir(self.corpus)
        port = _free_port()
        cmd = [sys.executable, "-m", "retriever_server", "--index", str(index_dir),
               "--port", str(port), "--log-level", "info", *self.extra_args]
        if self.corpus is not None:
            cmd += ["--corpus", str(self.corpus)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO_ROOT), env.get("PYTHONPATH"))
                                            if p)
        t0 = time.perf_counter()
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env,
                                          start_new_session=True)
        atexit.register(self.stop)
        self.url = f"http://127.0.0.1:{port}"
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        logger.info("local retriever at %s (pid %d, index %s) ready in %.1f s; log %s",
                    self.url, self._proc.pid, index_dir, time.perf_counter() - t0, self.log_path)
        return self.url

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        with httpx.Client(timeout=1.0) as http:
            while True:
                if self._proc.poll() is not None:
                    raise RuntimeError(
                        f"retriever server exited with code {self._proc.returncode} during "
                        f"startup; last lines of {self.log_path}:\n{_tail(self.log_path)}")
                try:
                    if http.get(self.url + "/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"retriever server not healthy after {self.startup_timeout:.0f} s; "
                        f"last lines of {self.log_path}:\n{_tail(self.log_path)}")
                time.sleep(0.1)

    def stop(self) -> None:
        """Terminate the server's process group (SIGTERM, then SIGKILL after 5 s). Idempotent."""
        proc, self._proc = self._proc, None
        atexit.unregister(self.stop)
        if proc is None:
            return
        if proc.poll() is None:
            self._signal(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                logger.warning("retriever pid %d ignored SIGTERM; killing it", proc.pid)
                self._signal(proc, signal.SIGKILL)
                proc.wait()
        self.url = None

    @staticmethod
    def _signal(proc: subprocess.Popen, sig: int) -> None:
        try:  # the server leads its own process group (start_new_session), so pgid == pid
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    def __enter__(self) -> LocalRetriever:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


_servers: dict[tuple, LocalRetriever] = {}
_servers_lock = threading.Lock()


def ensure_local_retriever(corpus: Path | str | None = None,
                           index_dir: Path | str | None = None) -> str:
    """URL of this process's local server for ``corpus`` and/or a saved ``index_dir``,
    starting it on first use (arguments as for :class:`LocalRetriever`).

    One server per (corpus, index) per process, restarted if it died; stopped at exit.
    """
    key = tuple(Path(p).resolve() if p is not None else None for p in (corpus, index_dir))
    with _servers_lock:
        server = _servers.get(key)
        if server is None:
            server = _servers[key] = LocalRetriever(*key)
        return server.start()


def stop_local_retrievers() -> None:
    """Stop every server started by :func:`ensure_local_retriever` in this process."""
    with _servers_lock:
        servers = list(_servers.values())
        _servers.clear()
    for server in servers:
        server.stop()
