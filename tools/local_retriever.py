"""Start and stop a local retrieval server (``python -m agentgym.retriever_server``) as a
subprocess.

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

import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

from agentgym.core.paths import cache_dir  # import-light: no torch
from agentgym.supervision.server_process import ServerProcess, free_port
from agentgym.supervision.supervisor import Supervisor

logger = logging.getLogger(__name__)

_REPO_ROOT = Path(__file__).resolve().parents[1]  # so the child finds retriever_server


def default_index_dir(corpus: Path) -> Path:
    """Where the BM25 index of ``corpus`` is cached (keyed by the corpus's content hash)."""
    h = hashlib.sha256()
    with open(corpus, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return cache_dir() / "retriever" / h.hexdigest()[:16] / "bm25"


_free_port = free_port  # kept for callers of the old name


class LocalRetriever:
    """A ``retriever_server`` subprocess on 127.0.0.1.

    Args:
        corpus: passages file (JSONL or JSONL.gz with ``id`` and ``contents``), indexed
            with BM25 if ``index_dir`` holds no index. May be None when ``index_dir`` holds
            a saved index (BM25 or dense, from ``agentgym index build``).
        index_dir: saved-index directory (loaded if present, else built and saved there);
            None uses the on-disk cache (:func:`default_index_dir`).
        startup_timeout: seconds to wait for ``/health`` before giving up.
        extra_args: more ``python -m agentgym.retriever_server`` flags (e.g.
            ``["--batching", "off"]``).
        supervise: watch the server and restart it on the same port when it dies or stops
            answering (:class:`agentgym.supervision.supervisor.Supervisor`); False leaves a dead
            server dead.
        max_restarts: the supervisor's restart budget over the server's life.

    Attributes:
        url: ``http://127.0.0.1:PORT`` once started, else None.
        log_path: the server's combined stdout/stderr while it runs (its temporary
            folder is removed by ``stop``).
    """

    def __init__(self, corpus: Path | str | None = None, index_dir: Path | str | None = None,
                 startup_timeout: float = 120.0, extra_args: list[str] | tuple = (),
                 supervise: bool = True, max_restarts: int = 5) -> None:
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
        self.supervise, self.max_restarts = supervise, max_restarts
        self._server: ServerProcess | None = None
        self.supervisor: Supervisor | None = None

    @property
    def alive(self) -> bool:
        """True while the server process is running."""
        return self._server is not None and self._server.alive

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._server.pid if self._server is not None else None

    @property
    def log_path(self) -> Path | None:
        """The server's combined stdout/stderr (None before the first start)."""
        return self._server.log_path if self._server is not None else None

    def start(self) -> str:
        """Start the server (no-op if running) and wait until it is healthy.

        Returns:
            The base URL (``http://127.0.0.1:PORT``).

        Raises:
            RuntimeError: the server exited during startup (message holds its log tail).
            TimeoutError: it was not healthy within ``startup_timeout`` seconds.
        """
        if self.alive or self.supervisor is not None:
            return self.url  # running, or its supervisor is bringing it back (same port)
        index_dir = self.index_dir or default_index_dir(self.corpus)
        port = free_port()
        cmd = [sys.executable, "-m", "agentgym.retriever_server", "--index", str(index_dir),
               "--port", str(port), "--log-level", "info", *self.extra_args]
        if self.corpus is not None:
            cmd += ["--corpus", str(self.corpus)]
        pythonpath = os.pathsep.join(p for p in (str(_REPO_ROOT), os.environ.get("PYTHONPATH"))
                                     if p)
        self._server = ServerProcess(cmd, f"http://127.0.0.1:{port}", name="retriever server",
                                     startup_timeout=self.startup_timeout,
                                     env={"PYTHONPATH": pythonpath})
        self.url = self._server.start()
        if self.supervise:
            self.supervisor = Supervisor(self._server, max_restarts=self.max_restarts)
        logger.info("local retriever at %s uses index %s", self.url, index_dir)
        return self.url

    def stop(self) -> None:
        """Stop watching it, then terminate the server's process group (SIGTERM, then
        SIGKILL after 5 s). Idempotent."""
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None
        if self._server is not None:
            self._server.stop()
        self.url = None

    def __enter__(self) -> LocalRetriever:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


_servers: dict[tuple, LocalRetriever] = {}
_servers_lock = threading.Lock()


def ensure_local_retriever(corpus: Path | str | None = None,
                           index_dir: Path | str | None = None, max_restarts: int = 5) -> str:
    """URL of this process's local server for ``corpus`` and/or a saved ``index_dir``,
    starting it on first use (arguments as for :class:`LocalRetriever`; ``max_restarts``
    applies to the server this call starts).

    One server per (corpus, index) per process, supervised (restarted on the same port
    when it dies); stopped at exit.
    """
    key = tuple(Path(p).resolve() if p is not None else None for p in (corpus, index_dir))
    with _servers_lock:
        server = _servers.get(key)
        if server is None:
            server = _servers[key] = LocalRetriever(*key, max_restarts=max_restarts)
        return server.start()


def stop_local_retrievers() -> None:
    """Stop every server started by :func:`ensure_local_retriever` in this process."""
    with _servers_lock:
        servers = list(_servers.values())
        _servers.clear()
    for server in servers:
        server.stop()
