"""Rollouts through SGLang servers: a client of SGLang's native HTTP API.

Token-in/token-out, the way verl and SkyRL drive SGLang: every request is ``POST
/generate`` with ``input_ids`` and ``return_logprob``, and the answer's ``output_ids``
and ``meta_info.output_token_logprobs`` are used as they are (nothing is decoded and
re-encoded). The same client talks to ``agentgym serve`` (the HF engine behind the same
API subset), so it runs and is tested on CPU.

Wire format, SGLang source references and error types:
:mod:`agentgym.rollout.engines.sglang_api`. In short: ``output_ids`` and
``meta_info.output_token_logprobs`` are taken as they are (a matched EOS is sampled and
kept with mask 1); against a server run with ``--skip-tokenizer-init`` (as verl runs
it), which refuses ``stop``, the client cuts the output at the first token whose decoded
tail holds a stop string, the HF engine's rule, and counts the tokens thrown away
(``stats["wasted_tokens"]``).

Errors: a 4xx/500 is raised at once as :class:`EngineRequestError` with the server's
message; connection failures, timeouts, 429/502/503/504 and aborted requests are retried
with exponential backoff, on another server when the first is down, and raise
:class:`ServerUnavailableError` once the retries run out. Both are
:class:`SGLangServerError`, whose ``urls`` name the servers.

Auth: a server run with ``--api-key`` wants ``Authorization: Bearer KEY``;
:meth:`SGLangEngine.from_config` reads the key from the environment variable
``SGLANG_API_KEY``, not from the run config, so it never lands in the saved
``config.json``.

Routing over several servers (``engine.urls``): a trajectory's turns go to the server
that served its first turn (sticky by ``session_id``, so its prefix stays in that server's
radix cache); a new trajectory goes to the server with the fewest requests in flight.

Weight sync (``engine.weight_sync``: ``disk``, ``distributed``, ``tensor``) lives in
:mod:`agentgym.rollout.engines.sglang_weights`. Every update carries ``weight_version``; answers
from a server whose ``weight_version`` is not the one last pushed fail loudly rather than
mixing policies. :meth:`SGLangEngine.pause` holds new requests here and pauses every
server; :meth:`SGLangEngine.resume` continues them and always reopens this client, even
when a server does not answer.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import os
import random
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

import httpx

from agentgym.rollout.engines.base import Engine
from agentgym.rollout.engines.sglang_api import (RETRY_STATUSES, EngineRequestError,
                                         SGLangServerError, ServerUnavailableError,
                                         _Transient, client_stop, combined_error,
                                         error_message, parse_generate, sglang_sampling)
from agentgym.rollout.engines.sglang_weights import WeightSyncMixin, weight_group_ranks
from agentgym.core.choices import WEIGHT_SYNC_MODES
from agentgym.supervision.supervisor import ServiceFailed, Supervisor, recovering
from agentgym.core.types import GenerateOutput, SamplingParams
from agentgym.models.zoo import resolve_model
from agentgym.rollout.engines.launcher import launch_sglang

MAX_BACKOFF_S = 8.0  # the longest wait between two attempts of one request

__all__ = ["EngineRequestError", "SGLangEngine", "SGLangServerError",
           "ServerUnavailableError", "WEIGHT_SYNC_MODES", "sglang_sampling",
           "weight_group_ranks"]

logger = logging.getLogger(__name__)

#: Environment variable holding the servers' ``--api-key``.
API_KEY_ENV = "SGLANG_API_KEY"


@dataclass
class _Server:
    url: str
    in_flight: int = 0
    assigned: int = 0  # trajectories routed here
    requests: int = 0
    down_until: float = 0.0  # after a connection failure: avoided for new trajectories
    info: dict | None = None  # /server_info; None = not asked yet

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until


class SGLangEngine(WeightSyncMixin, Engine):
    """Client of one or more SGLang (or ``agentgym serve``) servers.

    Args:
        urls: server base URLs (``http://host:port``).
        tokenizer: the policy's tokenizer (stop strings, EOS names).
        timeout_s: per-request read timeout (a long generation is not an error).
        retries: extra attempts after a transient failure, at least.
        retry_window_s: and more attempts while this many seconds have not passed since
            the first (a server that drops connections for a while is waited out).
        backoff_s: first retry delay; doubles each attempt (with jitter), up to
            ``MAX_BACKOFF_S``.
        weight_sync: ``disk`` | ``distributed`` | ``tensor``
            (:mod:`agentgym.rollout.engines.sglang_weights`).
        sync_dir: where ``disk`` sync writes weights (default: a temporary folder).
        sync_address: address of this process the servers reach for ``distributed``
            sync (default: 127.0.0.1 when every server is on loopback, else this host's).
        max_connections: HTTP connection pool size.
        api_key: sent as ``Authorization: Bearer`` (servers run with ``--api-key``);
            :meth:`from_config` takes it from ``$SGLANG_API_KEY``.
        owned: server processes this engine started and stops on :meth:`close`.
        supervise: watch the ``owned`` servers and restart one that dies or hangs
            (:class:`agentgym.supervision.supervisor.Supervisor`), then load the weights last
            pushed into it (``weight_sync=disk``: the folder they were pushed from);
            requests to it wait while it comes back.
    """

    needs_model = False

    def __init__(self, urls: list[str], tokenizer, *, timeout_s: float = 600.0,
                 retries: int = 3, retry_window_s: float = 60.0, backoff_s: float = 0.5,
                 weight_sync: str = "disk",
                 sync_dir: str | Path | None = None, sync_address: str = "",
                 max_connections: int = 256, api_key: str = "",
                 owned: list | None = None, supervise: bool = False) -> None:
        if not urls:
            raise ValueError("the sglang engine needs at least one server URL (engine.urls="
                             "[http://127.0.0.1:30000]); start one with `agentgym serve` or "
                             "`python -m sglang.launch_server`")
        for u in urls:
            parsed = urlparse(u)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise ValueError(f"engine.urls holds {u!r}; each must look like "
                                 f"http://host:port")
        if weight_sync not in WEIGHT_SYNC_MODES:
            raise ValueError(f"engine.weight_sync={weight_sync!r}; valid: "
                             f"{', '.join(WEIGHT_SYNC_MODES)}")
        self.servers = [_Server(u.rstrip("/")) for u in urls]
        self.tokenizer = tokenizer
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.retry_window_s = retry_window_s
        self.weight_sync = weight_sync
        self._own_sync_dir = sync_dir is None or str(sync_dir) == ""
        self.sync_dir = Path(tempfile.mkdtemp(prefix="agentgym-weights-")) \
            if self._own_sync_dir else Path(sync_dir)
        self.sync_address = sync_address
        self.owned = list(owned or [])
        self.policy_version = 0
        self.weight_version: str | None = None  # what we last pushed; None: not yet
        self.sessions: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.max_sessions = 1 << 16
        self.stats = {"requests": 0, "retries": 0, "rerouted": 0, "client_stops": 0,
                      "generated_tokens": 0, "wasted_tokens": 0}
        #: (session_id, server url) of the latest answered requests, newest last
        self.routes: collections.deque = collections.deque(maxlen=100_000)
        self._group = None  # the distributed-sync process group (rank 0 here)
        self._group_name = f"agentgym_{uuid.uuid4().hex[:8]}"
        self._failed_update: BaseException | None = None  # the last update_weights error
        self._in_flight = 0
        self._closed = False
        # one event loop thread owns the HTTP client, so callers on any loop (each
        # asyncio.run of a rollout) share one connection pool
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-client",
                                        daemon=True)
        self._thread.start()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_connections,
                              max_keepalive_connections=max_connections)
        timeout = httpx.Timeout(timeout_s, connect=10.0)

        async def make_client():
            self._open = asyncio.Event()  # cleared while paused for a weight update
            self._open.set()
            self._idle = asyncio.Event()  # set when no request is in flight
            self._idle.set()
            return httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers)
        self._http: httpx.AsyncClient = self._call(make_client())
        self.supervisors = [Supervisor(s, max_restarts=3, on_restart=functools.partial(
            self._restore_weights, s.url)) for s in self.owned] if supervise else []

    @property
    def weight_group(self):
        """The process group the distributed weight sync broadcasts over (None: none
        joined, or left on close)."""
        return self._group

    @property
    def headers(self) -> dict[str, str]:
        """The headers every request to the servers carries."""
        return dict(self._http.headers)

    @classmethod
    def from_config(cls, cfg, model, tokenizer) -> "SGLangEngine":
        e = cfg.engine
        urls, owned = list(e.urls), []
        if not urls:
            server = launch_sglang(str(resolve_model(cfg.model.path or cfg.model.name)),
                                   dtype=cfg.engine.dtype or cfg.model.dtype,
                                   seed=cfg.trainer.seed)
            urls, owned = [server.url], [server]
        return cls(urls, tokenizer, timeout_s=e.timeout_s, retries=e.retries,
                   retry_window_s=e.retry_window_s,
                   weight_sync=e.weight_sync, sync_dir=e.sync_dir or None,
                   sync_address=e.sync_address, api_key=os.environ.get(API_KEY_ENV, ""),
                   owned=owned, supervise=bool(owned))

    # -- plumbing -----------------------------------------------------------------------
    def _call(self, coro, timeout: float | None = None):
        """Run ``coro`` on the client's loop from a plain thread; return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _on_loop(self, coro):
        """Await ``coro`` on the client's loop from another event loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def _post(self, server: _Server, path: str, body: dict | None = None,
                    method: str = "POST") -> Any:
        """One request; 4xx/500 raise :class:`EngineRequestError`, the retryable ones
        :class:`_Transient` (a refused connection also marks the server down for 5 s)."""
        where = server.url + path
        try:
            resp = await self._http.request(method, where, json=body)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            server.down_until = time.monotonic() + 5.0
            raise _Transient(f"{where}: {type(e).__name__}: {e}", server.url) from e
        except httpx.TransportError as e:  # read timeout, reset, protocol error
            raise _Transient(f"{where}: {type(e).__name__}: {e}", server.url) from e
        if resp.status_code in RETRY_STATUSES:
            raise _Transient(f"{where} answered {resp.status_code}: {error_message(resp)}",
                             server.url)
        if resp.status_code >= 400:
            raise EngineRequestError(where, resp.status_code, error_message(resp))
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError:
            return resp.text

    async def _post_once(self, server: _Server, path: str, body: dict | None = None) -> Any:
        """:meth:`_post` for requests not worth repeating: a transient failure raises
        :class:`ServerUnavailableError` at once."""
        try:
            return await self._post(server, path, body)
        except _Transient as e:
            raise ServerUnavailableError(str(e), [server.url]) from None

    async def _with_retries(self, fn: Callable[[int], Any], what: str):
        """``await fn(attempt)`` until it does not raise :class:`_Transient`: at least
        ``retries`` more attempts, and more while ``retry_window_s`` has not passed since
        the first (a server that drops connections for a while is waited out; delays
        double up to ``MAX_BACKOFF_S``); then :class:`ServerUnavailableError`."""
        t0 = time.monotonic()
        for attempt in itertools.count():
            try:
                return await fn(attempt)
            except _Transient as e:
                delay = min(self.backoff_s * 2 ** attempt, MAX_BACKOFF_S) * (0.5 + random.random())
                if attempt >= self.retries and not recovering(e.url) and \
                        time.monotonic() + delay - t0 > self.retry_window_s:
                    raise ServerUnavailableError(
                        f"{what} failed after {attempt + 1} attempts over "
                        f"{time.monotonic() - t0:.1f} s; last: {e}", [e.url]) from None
                self.stats["retries"] += 1
                logger.warning("%s: %s; retrying in %.2fs", what, e, delay)
                await asyncio.sleep(delay)

    async def _each(self, path: str, body: dict | Callable[[_Server], dict] | None = None,
                    *, retry: bool = True) -> list:
        """The same request (or ``body(server)``) to every server, concurrently; their
        answers in order. Raises one :class:`SGLangServerError` naming every server that
        failed, after all have answered."""
        async def one(s: _Server):
            b = body(s) if callable(body) else body
            if retry:
                return await self._with_retries(lambda k: self._post(s, path, b),
                                                 f"{s.url}{path}")
            return await self._post_once(s, path, b)
        answers = await asyncio.gather(*(one(s) for s in self.servers), return_exceptions=True)
        failures = [a for a in answers if isinstance(a, BaseException)]
        if failures:
            raise combined_error(path, failures)
        return answers

    def _pick(self, session_id: str | None, avoid: _Server | None = None) -> _Server:
        """The session's server, or the least loaded one that is up."""
        if session_id is not None and session_id in self.sessions:
            s = self.servers[self.sessions[session_id]]
            if s.up and s is not avoid:
                self.sessions.move_to_end(session_id)
                return s
            self.stats["rerouted"] += 1
        candidates = [s for s in self.servers if s.up and s is not avoid] or \
            [s for s in self.servers if s is not avoid] or self.servers
        best = min(candidates, key=lambda s: (s.in_flight, s.assigned))
        best.assigned += 1
        if session_id is not None:
            self.sessions[session_id] = self.servers.index(best)
            if len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        return best

    async def _server_info(self, server: _Server) -> dict:
        """The server's ``/server_info`` (``/get_server_info`` on older SGLang; ``{}``
        when it has neither), asked once."""
        if server.info is None:
            info: Any = {}
            for path in ("/server_info", "/get_server_info"):
                try:
                    info = await self._post(server, path, method="GET")
                    break
                except EngineRequestError as e:
                    if e.status != 404:
                        raise
            server.info = info if isinstance(info, dict) else {}
        return server.info

    async def _server_stops(self, server: _Server) -> bool:
        """Whether the server applies stop strings itself (it has a tokenizer)."""
        info = await self._server_info(server)
        return not info.get("skip_tokenizer_init", False)

    # -- generation ---------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling: SamplingParams,
                       images: list[Any] | None = None,
                       session_id: str | None = None) -> GenerateOutput:
        if images:
            raise ValueError("the sglang engine here sends token ids only; images are not "
                             "supported yet")
        if not prompt_ids:
            raise ValueError("prompt_ids is empty: a request needs at least one token")
        if self._closed:
            raise RuntimeError("engine is closed")
        return await self._on_loop(self._generate(list(prompt_ids), sampling, session_id))

    async def _generate(self, ids: list[int], sampling: SamplingParams,
                        session_id: str | None) -> GenerateOutput:
        await self._open.wait()  # held while paused for a weight update
        self._idle.clear()
        self._in_flight += 1
        tried: list[_Server] = []
        try:
            async def attempt(k: int) -> GenerateOutput:
                avoid = tried[-1] if tried and not tried[-1].up else None
                server = self._pick(session_id, avoid)
                tried.append(server)
                server.in_flight += 1
                server.requests += 1
                try:
                    out = await self._generate_on(server, ids, sampling)
                    self.routes.append((session_id, server.url))
                    return out
                finally:
                    server.in_flight -= 1
            return await self._with_retries(attempt, "generate")
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def _generate_on(self, server: _Server, ids: list[int],
                           sampling: SamplingParams) -> GenerateOutput:
        if recovering(server.url):  # restarted, its weights not yet restored: wait
            raise _Transient(f"{server.url} is being restarted by its supervisor", server.url)
        server_stops = await self._server_stops(server)
        body = {"input_ids": ids, "sampling_params": sglang_sampling(sampling, server_stops),
                "return_logprob": True, "rid": uuid.uuid4().hex}
        if sampling.top_logprobs:
            body["top_logprobs_num"] = sampling.top_logprobs
        self.stats["requests"] += 1
        out = await self._post(server, "/generate", body)
        return self._parse(server, out, sampling, server_stops)

    def _parse(self, server: _Server, out: Any, sampling: SamplingParams,
               server_stops: bool) -> GenerateOutput:
        try:
            result = parse_generate(out, server.url, self.tokenizer, self.weight_version)
        except SGLangServerError as e:
            if recovering(server.url):  # answered while the supervisor restores its weights
                raise _Transient(f"{server.url} answered during its restart: {e}",
                                 server.url) from None
            raise
        if sampling.stop and not server_stops:
            cut = client_stop(self.tokenizer, result.ids, sampling.stop)
            if cut is not None:
                n, stop = cut
                self.stats["client_stops"] += 1
                self.stats["wasted_tokens"] += len(result.ids) - n
                tops = result.top_logprobs
                result = GenerateOutput(result.ids[:n], result.logprobs[:n], "stop", stop,
                                        top_logprobs=None if tops is None else tops[:n])
        self.stats["generated_tokens"] += len(result.ids)
        return result

    # -- pause / resume -----------------------------------------------------------------
    async def pause(self, partial: bool = False) -> None:
        """Hold new requests here, let in-flight ones finish, pause every server.

        Raises:
            SGLangServerError: a server did not pause. Nothing stays paused then: the
                servers that did pause are continued and this client is open again.
        """
        await self._on_loop(self._pause())

    async def _pause(self) -> None:
        self._open.clear()
        self._failed_update = None  # from an earlier, unrelated update
        try:
            await self._idle.wait()
            await self._each("/pause_generation", {"mode": "in_place"})
        except BaseException:
            try:
                await self._each("/continue_generation", {}, retry=False)
            except SGLangServerError as e:
                logger.warning("after a failed pause: %s", e)
            finally:
                self._open.set()
            raise

    def resume(self) -> None:
        """Continue every server (``/continue_generation``, retried) and reopen this
        client, always, so later requests never wait forever; a server that is down is
        avoided by routing.

        Raises:
            ServerUnavailableError: a server did not continue (named in the message).
                When the :meth:`update_weights` before this failed, that error is the one
                the caller is handling, so this one is logged instead of raised.
        """
        if self._closed:
            return
        failed_update, self._failed_update = self._failed_update, None
        try:
            self._call(self._resume())
        except SGLangServerError as e:
            error = ServerUnavailableError(
                f"resume: {', '.join(e.urls)} did not continue generation; this client "
                f"sends requests again (a server still paused holds them until it "
                f"continues): {e}", e.urls)
            if failed_update is None:
                raise error from e
            logger.error("%s (after the failed weight update: %s)", error, failed_update)

    async def _resume(self) -> None:
        try:
            await self._each("/continue_generation", {})
        finally:
            self._open.set()

    # -- lifecycle ----------------------------------------------------------------------
    def health(self) -> list[bool]:
        """``GET /health`` of every server (True when it answers 200)."""
        async def one(s):
            try:
                await self._post(s, "/health", method="GET")
                return True
            except (EngineRequestError, _Transient):
                return False

        async def every():
            return await asyncio.gather(*(one(s) for s in self.servers))
        return self._call(every())

    def flush_cache(self) -> None:
        """Empty every server's prefix (radix) cache. SGLang refuses (400) while
        requests are running: raises :class:`EngineRequestError` then."""
        self._call(self._each("/flush_cache"))

    def _restore_weights(self, url: str) -> None:
        """The supervisor restarted the owned server at ``url``: load the weights last
        pushed, so it answers as the others do (its ``weight_version`` is checked).

        Raises:
            ServiceFailed: with ``weight_sync`` other than ``disk`` no copy of them is
                kept to load (the supervisor then gives the server up, and the run stops
                at the step's end with a checkpoint).
        """
        server = next(s for s in self.servers if s.url == url.rstrip("/"))
        if self.weight_version is not None:
            if self.weight_sync != "disk":
                raise ServiceFailed(f"it holds the initial weights, and weight_sync="
                                    f"{self.weight_sync} keeps no copy of version "
                                    f"{self.weight_version} to load into it (disk does)")
            folder = self.sync_dir / f"weights_v{self.policy_version}"
            body = {"model_path": str(folder.resolve()), "weight_version": self.weight_version,
                    "flush_cache": True}
            answer = self._call(self._post(server, "/update_weights_from_disk", body))
            self._check_one(server, answer, "update_weights_from_disk after a restart")
        server.down_until = 0.0
        logger.warning("%s restarted with weights v%s", url, self.weight_version or "0")

    def close(self) -> None:
        """Leave the weight-update group, close connections, stop owned servers.
        Idempotent; never raises for a server that is gone (it logs)."""
        if self._closed:
            return
        self._closed = True
        for sup in self.supervisors:  # before the servers stop, or they would be restarted
            sup.stop()
        self._drop_group()
        try:
            self._call(self._http.aclose(), timeout=10)
        except Exception as e:  # noqa: BLE001 - closing must go on
            logger.warning("closing the HTTP client: %s", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if self._own_sync_dir:
            shutil.rmtree(self.sync_dir, ignore_errors=True)
        for server in self.owned:
            try:
                server.stop()
            except Exception as e:  # noqa: BLE001 - stop the others anyway
                logger.warning("stopping %s: %s", getattr(server, "url", server), e)
