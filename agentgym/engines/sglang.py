"""Rollouts through SGLang servers: a client of SGLang's native HTTP API.

Token-in/token-out, the way verl and SkyRL drive SGLang: every request is ``POST
/generate`` with ``input_ids`` and ``return_logprob``, and the answer's ``output_ids``
and ``meta_info.output_token_logprobs`` are used as they are (nothing is decoded and
re-encoded). The same client talks to ``agentgym serve`` (the HF engine behind the same
API subset), so it runs and is tested on CPU.

Shapes, checked against SGLang's source (``python/sglang/srt/managers/io_struct.py``:
``GenerateReqInput``, ``UpdateWeightFromDiskReqInput``, ``InitWeightsUpdateGroupReqInput``,
``UpdateWeightsFromDistributedReqInput``, ``UpdateWeightsFromTensorReqInput``;
``python/sglang/srt/entrypoints/http_server.py`` for the routes;
``python/sglang/srt/managers/tokenizer_manager.py`` for the response;
``python/sglang/srt/sampling/sampling_params.py`` for ``sampling_params``) and its docs
(``docs/basic_usage/native_api``, ``docs/basic_usage/sampling_params.md``,
``docs/advanced_features/sglang_for_rl.md``):

- request: ``{"input_ids": [...], "sampling_params": {"max_new_tokens", "temperature",
  "top_p", "top_k" (-1 = off; 0 is refused), "sampling_seed" (honoured by servers run
  with --enable-deterministic-inference), "no_stop_trim": true, "skip_special_tokens":
  false, "stop"?}, "return_logprob": true, "rid"}``. We always send temperature, top-p
  and top-k, since a server's ``--sampling-defaults model`` would otherwise fill them from
  the model's generation config.
- response: ``{"output_ids": [...], "meta_info": {"id", "finish_reason", "prompt_tokens",
  "completion_tokens", "cached_tokens", "weight_version", "output_token_logprobs":
  [[logprob, token_id, null], ...]}}``; ``finish_reason`` is ``{"type": "stop", "matched":
  int | str}``, ``{"type": "length", "length": n}`` or ``{"type": "abort", "message"}``.
  ``no_stop_trim: true`` keeps a matched stop token (EOS) in ``output_ids``: it was
  sampled, so it belongs to the trajectory with mask 1.
- SGLang's sampled-token logprob is ``log_softmax(logits / temperature)`` before top-k /
  top-p (its sampler; greedy: temperature 1), our engine contract
  (:class:`agentgym.types.SamplingParams`).
- stop strings: a server with a tokenizer stops on them itself. Run with
  ``--skip-tokenizer-init`` (as verl does), SGLang refuses ``stop``, so the client cuts
  the output at the first token whose decoded tail holds a stop string, the rule the HF
  engine applies while decoding. The ids and logprobs up to that token are what the
  server sampled; tokens after it were wasted work and are dropped.
- errors: a bad request is a 400 ``{"error": {"message"}}`` (not retried, raised with the
  server's message); connection failures, timeouts, 429/502/503/504 and aborted
  requests are retried with exponential backoff, on another server when the first is down.

Routing over several servers (``engine.urls``): a trajectory's turns go to the server
that served its first turn (sticky by ``session_id``, so its prefix stays in that server's
radix cache); a new trajectory goes to the server with the fewest requests in flight.

Weight sync after each step (``engine.weight_sync``):

- ``disk`` (default): the state dict is written once as safetensors into
  ``engine.sync_dir`` (a temporary folder by default; servers on other machines need a
  shared path) and every server loads it (``/update_weights_from_disk``).
- ``distributed``: the trainer joins a process group with every server
  (``/init_weights_update_group``: rank 0 the trainer, servers from 1; NCCL on GPU, gloo
  against ``agentgym serve``) and broadcasts each tensor while the servers receive it
  (``/update_weights_from_distributed`` with ``names``/``dtypes``/``shapes``): split
  placement without a shared disk.
- ``tensor``: ``/update_weights_from_tensor`` with ``serialized_named_tensors``
  (SGLang's ``MultiprocessingSerializer``, CUDA IPC handles): colocated GPU placement
  only; needs ``sglang`` installed in the trainer's environment.

Every update carries ``weight_version``; answers from a server whose ``weight_version``
is not the one last pushed fail loudly rather than mixing policies.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import random
import shutil
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

import httpx

from agentgym.engines.base import Engine
from agentgym.types import GenerateOutput, SamplingParams

logger = logging.getLogger(__name__)

#: Decoded tail examined for stop strings (as in the HF engine).
_STOP_WINDOW = 32
#: HTTP statuses worth retrying: overloaded or restarting servers, gateways.
RETRY_STATUSES = frozenset({429, 502, 503, 504})
WEIGHT_SYNC_MODES = ("disk", "distributed", "tensor")


class EngineRequestError(RuntimeError):
    """A server refused a request (4xx/5xx that retrying would not fix)."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url} answered {status}: {message}")
        self.url, self.status, self.message = url, status, message


class _Transient(Exception):
    """A failure worth retrying (connection, timeout, overload, abort)."""

    def __init__(self, message: str, server_down: bool = False) -> None:
        super().__init__(message)
        self.server_down = server_down


@dataclass
class _Server:
    url: str
    in_flight: int = 0
    assigned: int = 0  # trajectories routed here
    requests: int = 0
    down_until: float = 0.0  # after a connection failure: avoided for new trajectories
    skip_tokenizer_init: bool | None = None  # from /get_server_info; None = not asked yet
    info: dict = field(default_factory=dict)

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return str(body["detail"])
    return str(body)[:500]


def sglang_sampling(sampling: SamplingParams, server_stops: bool) -> dict:
    """Our :class:`SamplingParams` as SGLang's ``sampling_params``."""
    p: dict[str, Any] = {"max_new_tokens": sampling.max_new_tokens,
                         "temperature": sampling.temperature, "top_p": sampling.top_p,
                         "top_k": sampling.top_k if sampling.top_k > 0 else -1,
                         "no_stop_trim": True, "skip_special_tokens": False}
    if sampling.seed is not None:
        p["sampling_seed"] = int(sampling.seed)
    if sampling.stop and server_stops:
        p["stop"] = list(sampling.stop)
    return p


class SGLangEngine(Engine):
    """Client of one or more SGLang (or ``agentgym serve``) servers.

    Args:
        urls: server base URLs (``http://host:port``).
        tokenizer: the policy's tokenizer (stop strings, EOS names).
        timeout_s: per-request read timeout (a long generation is not an error).
        retries: extra attempts after a transient failure.
        backoff_s: first retry delay; doubles each attempt (with jitter).
        weight_sync: ``disk`` | ``distributed`` | ``tensor`` (see the module doc).
        sync_dir: where ``disk`` sync writes weights (default: a temporary folder).
        sync_address: address of this process the servers reach for ``distributed``
            sync (default: 127.0.0.1 when every server is on loopback, else this host's).
        max_connections: HTTP connection pool size.
        api_key: sent as ``Authorization: Bearer`` (servers run with ``--api-key``).
        owned: server processes this engine started and stops on :meth:`close`.
    """

    needs_model = False

    def __init__(self, urls: list[str], tokenizer, *, timeout_s: float = 600.0,
                 retries: int = 3, backoff_s: float = 0.5, weight_sync: str = "disk",
                 sync_dir: str | Path | None = None, sync_address: str = "",
                 max_connections: int = 256, api_key: str = "",
                 owned: list | None = None) -> None:
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
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._group = None  # the distributed-sync process group (rank 0 here)
        self._group_name = f"agentgym_{uuid.uuid4().hex[:8]}"
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
            self._open = asyncio.Event()
            self._open.set()
            self._idle = asyncio.Event()
            self._idle.set()
            return httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers)
        self._http: httpx.AsyncClient = self._call(make_client())

    @classmethod
    def from_config(cls, cfg, model, tokenizer) -> "SGLangEngine":
        e = cfg.engine
        urls, owned = list(e.urls), []
        if not urls:
            from agentgym.engines.launcher import launch_sglang
            from agentgym.models import resolve_model
            server = launch_sglang(str(resolve_model(cfg.model.path or cfg.model.name)),
                                   dtype=cfg.engine.dtype or cfg.model.dtype,
                                   seed=cfg.trainer.seed)
            urls, owned = [server.url], [server]
        return cls(urls, tokenizer, timeout_s=e.timeout_s, retries=e.retries,
                   weight_sync=e.weight_sync, sync_dir=e.sync_dir or None,
                   sync_address=e.sync_address, owned=owned)

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
        :class:`_Transient`."""
        try:
            resp = await self._http.request(method, server.url + path, json=body)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise _Transient(f"{server.url}{path}: {type(e).__name__}: {e}", True) from e
        except httpx.TransportError as e:  # read timeout, reset, protocol error
            raise _Transient(f"{server.url}{path}: {type(e).__name__}: {e}") from e
        if resp.status_code in RETRY_STATUSES:
            raise _Transient(f"{server.url}{path} answered {resp.status_code}: "
                             f"{_error_message(resp)}")
        if resp.status_code >= 400:
            raise EngineRequestError(server.url + path, resp.status_code, _error_message(resp))
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError:
            return resp.text

    async def _each(self, path: str, body: dict | None = None) -> list:
        """The same request to every server, concurrently; their answers in order."""
        return await asyncio.gather(*(self._post(s, path, body) for s in self.servers))

    async def _with_retries(self, fn: Callable[[int], Any], what: str):
        """``await fn(attempt)`` until it does not raise :class:`_Transient`."""
        for attempt in range(self.retries + 1):
            try:
                return await fn(attempt)
            except _Transient as e:
                if attempt == self.retries:
                    raise RuntimeError(f"{what} failed after {attempt + 1} attempts; last: "
                                       f"{e}") from None
                self.stats["retries"] += 1
                delay = self.backoff_s * 2 ** attempt * (0.5 + random.random())
                logger.warning("%s: %s; retrying in %.2fs", what, e, delay)
                await asyncio.sleep(delay)

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

    async def _server_stops(self, server: _Server) -> bool:
        """Whether the server applies stop strings itself (it has a tokenizer)."""
        if server.skip_tokenizer_init is None:
            try:
                info = await self._post(server, "/get_server_info", method="GET")
            except EngineRequestError:  # an older server without the route
                info = {}
            server.info = info if isinstance(info, dict) else {}
            server.skip_tokenizer_init = bool(server.info.get("skip_tokenizer_init", False))
        return not server.skip_tokenizer_init

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
        self._in_flight = getattr(self, "_in_flight", 0) + 1
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
                except _Transient as e:
                    if e.server_down:
                        server.down_until = time.monotonic() + 5.0
                    raise
                finally:
                    server.in_flight -= 1
            return await self._with_retries(attempt, "generate")
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def _generate_on(self, server: _Server, ids: list[int],
                           sampling: SamplingParams) -> GenerateOutput:
        server_stops = await self._server_stops(server)
        body = {"input_ids": ids, "sampling_params": sglang_sampling(sampling, server_stops),
                "return_logprob": True, "rid": uuid.uuid4().hex}
        self.stats["requests"] += 1
        out = await self._post(server, "/generate", body)
        return self._parse(server, out, sampling, server_stops)

    def _parse(self, server: _Server, out: Any, sampling: SamplingParams,
               server_stops: bool) -> GenerateOutput:
        where = f"{server.url}/generate"
        if isinstance(out, list) and len(out) == 1:
            out = out[0]
        if not isinstance(out, dict) or "meta_info" not in out or "output_ids" not in out:
            raise EngineRequestError(where, 200, f"expected an object with output_ids and "
                                     f"meta_info (is the server SGLang's native API?); got "
                                     f"{str(out)[:200]}")
        meta = out["meta_info"]
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type")
        if kind == "abort":
            raise _Transient(f"{where}: request aborted: {finish.get('message', '')}")
        version = meta.get("weight_version")
        if self.weight_version is not None and version is not None \
                and str(version) != self.weight_version:
            raise RuntimeError(f"{where} answered with weight_version {version!r}, but "
                               f"{self.weight_version!r} was pushed last: another trainer is "
                               f"updating this server, or an update did not reach it")
        ids = [int(t) for t in out["output_ids"]]
        lps = meta.get("output_token_logprobs")
        if not isinstance(lps, list) or len(lps) != len(ids):
            raise EngineRequestError(where, 200, f"output_token_logprobs has "
                                     f"{len(lps) if isinstance(lps, list) else lps!r} entries "
                                     f"for {len(ids)} output_ids (is return_logprob on?)")
        logprobs = []
        for j, (entry, tok) in enumerate(zip(lps, ids)):
            if int(entry[1]) != tok:
                raise EngineRequestError(where, 200, f"output_token_logprobs[{j}] is for "
                                         f"token {entry[1]}, output_ids[{j}] is {tok}")
            logprobs.append(float(entry[0]))
        reason, stop_reason = "stop", None
        if kind == "length":
            reason = "length"
        elif kind == "stop":
            matched = finish.get("matched")
            stop_reason = (self.tokenizer.convert_ids_to_tokens(int(matched))
                           if isinstance(matched, int) else matched)
        else:
            raise EngineRequestError(where, 200, f"finish_reason {finish!r}; expected type "
                                     "stop, length or abort")
        if sampling.stop and not server_stops:
            cut = self._client_stop(ids, sampling.stop)
            if cut is not None:
                n, stop_reason = cut
                self.stats["client_stops"] += 1
                self.stats["wasted_tokens"] += len(ids) - n
                ids, logprobs, reason = ids[:n], logprobs[:n], "stop"
        self.stats["generated_tokens"] += len(ids)
        return GenerateOutput(ids, logprobs, reason, stop_reason)  # type: ignore[arg-type]

    def _client_stop(self, ids: list[int], stops: tuple[str, ...]) -> tuple[int, str] | None:
        """(tokens to keep, stop string) for the first token whose decoded tail holds a
        stop string, or None."""
        decode = (functools.partial(self._backend.decode, skip_special_tokens=False)
                  if self._backend is not None else
                  functools.partial(self.tokenizer.decode, skip_special_tokens=False))
        for i in range(1, len(ids) + 1):
            tail = decode(ids[max(0, i - _STOP_WINDOW):i])
            for s in stops:
                if s in tail:
                    return i, s
        return None

    # -- weight sync --------------------------------------------------------------------
    async def pause(self) -> None:
        await self._on_loop(self._pause())

    async def _pause(self) -> None:
        self._open.clear()
        await self._idle.wait()
        await self._each("/pause_generation", {"mode": "in_place"})

    def resume(self) -> None:
        async def go():
            await self._each("/continue_generation", {})
            self._open.set()
        self._call(go())

    def update_weights(self, state_dict: dict, version: int) -> None:
        """Push ``state_dict`` to every server as ``weight_version`` ``str(version)``."""
        t0 = time.perf_counter()
        tensors = _unique_tensors(state_dict)
        if self.weight_sync == "disk":
            self._sync_disk(tensors, version)
        elif self.weight_sync == "distributed":
            self._sync_distributed(tensors, version)
        else:
            self._sync_tensor(tensors, version)
        self.policy_version = version
        self.weight_version = str(version)
        logger.info("weights v%d (%d tensors) pushed to %d server(s) by %s in %.2fs", version,
                    len(tensors), len(self.servers), self.weight_sync, time.perf_counter() - t0)

    def _check_all(self, answers: list, what: str) -> None:
        for server, ans in zip(self.servers, answers):
            if isinstance(ans, dict) and ans.get("success") is False:
                raise RuntimeError(f"{server.url} refused {what}: {ans.get('message')}")

    def _sync_disk(self, tensors: dict, version: int) -> None:
        from safetensors.torch import save_file
        final = self.sync_dir / f"weights_v{version}"
        tmp = self.sync_dir / f".weights_v{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        body = {"model_path": str(final.resolve()), "weight_version": str(version),
                "flush_cache": True}
        answers = self._call(self._each("/update_weights_from_disk", body))
        self._check_all(answers, "update_weights_from_disk")
        for old in self.sync_dir.glob("weights_v*"):  # servers hold the new version now
            if old != final:
                shutil.rmtree(old, ignore_errors=True)

    def _address(self) -> str:
        if self.sync_address:
            return self.sync_address
        hosts = {urlparse(s.url).hostname for s in self.servers}
        if hosts <= {"127.0.0.1", "localhost", "::1"}:
            return "127.0.0.1"
        return socket.gethostbyname(socket.gethostname())

    def _sync_distributed(self, tensors: dict, version: int) -> None:
        import torch

        from agentgym.engines.weight_group import broadcast, init_weight_group
        if self._group is None:
            from agentgym.server_process import free_port
            backend = "nccl" if any(v.is_cuda for v in tensors.values()) else "gloo"
            host, port = self._address(), free_port()
            world = len(self.servers) + 1  # this process is rank 0; one rank per server
            futs = [asyncio.run_coroutine_threadsafe(self._post(
                s, "/init_weights_update_group",
                {"master_address": host, "master_port": port, "rank_offset": i + 1,
                 "world_size": world, "group_name": self._group_name, "backend": backend}),
                self._loop) for i, s in enumerate(self.servers)]
            self._group = init_weight_group(backend, host, port, world, 0, self._group_name)
            self._check_all([f.result() for f in futs], "init_weights_update_group")
        names = list(tensors)
        body = {"names": names, "dtypes": [str(tensors[n].dtype).removeprefix("torch.")
                                           for n in names],
                "shapes": [list(tensors[n].shape) for n in names],
                "group_name": self._group_name, "flush_cache": True,
                "weight_version": str(version)}
        futs = [asyncio.run_coroutine_threadsafe(
            self._post(s, "/update_weights_from_distributed", body), self._loop)
            for s in self.servers]
        with torch.no_grad():  # the servers receive in `names` order
            for n in names:
                broadcast(self._group, tensors[n].detach().contiguous())
        self._check_all([f.result() for f in futs], "update_weights_from_distributed")

    def _sync_tensor(self, tensors: dict, version: int) -> None:
        try:
            from sglang.srt.utils import MultiprocessingSerializer
        except ImportError as e:
            raise RuntimeError("engine.weight_sync=tensor sends CUDA IPC handles with "
                               "SGLang's MultiprocessingSerializer, so sglang must be "
                               "installed here and the servers colocated on this machine's "
                               "GPUs; use engine.weight_sync=disk or distributed "
                               "otherwise") from e
        payload = MultiprocessingSerializer.serialize(list(tensors.items()), output_str=True)
        body = {"serialized_named_tensors": [payload], "flush_cache": True,
                "weight_version": str(version)}
        answers = self._call(self._each("/update_weights_from_tensor", body))
        self._check_all(answers, "update_weights_from_tensor")

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
        self._call(self._each("/flush_cache"))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._group is not None and self.weight_sync == "distributed":
            try:
                self._call(self._each("/destroy_weights_update_group",
                                      {"group_name": self._group_name}), timeout=10)
            except (concurrent.futures.TimeoutError, RuntimeError):
                pass
            from agentgym.engines.weight_group import destroy_weight_group
            destroy_weight_group(self._group)
            self._group = None
        try:
            self._call(self._http.aclose(), timeout=10)
        except concurrent.futures.TimeoutError:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if self._own_sync_dir:
            shutil.rmtree(self.sync_dir, ignore_errors=True)
        for server in self.owned:
            server.stop()


def _unique_tensors(state_dict: dict) -> dict:
    """The state dict without tied copies (a name sharing storage with an earlier one),
    as ``save_pretrained`` writes it; servers re-tie them."""
    seen, out = set(), {}
    for k, v in state_dict.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape)) \
            if v.device.type != "meta" else id(v)
        if key in seen:
            continue
        seen.add(key)
        out[k] = v
    return out
