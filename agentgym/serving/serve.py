"""``agentgym serve``: the in-process HF engine behind a subset of SGLang's native HTTP API.

The point is that remote rollout works without a GPU: the SGLang client
(:mod:`agentgym.rollout.engines.sglang`) talks to this server exactly as it talks to
``python -m sglang.launch_server``, so the client, its routing, retries and weight
updates are exercised against a real server on loopback.

Each route mirrors the SGLang route of the same name (``sglang/srt/entrypoints/
http_server.py``; request and response types in ``sglang/srt/managers/io_struct.py``):

- ``POST /generate``: ``input_ids`` (one list, or a batch of lists), ``sampling_params``
  (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k`` (-1 = off), ``stop``,
  ``sampling_seed``, ``n``, ``no_stop_trim``, ``ignore_eos`` (false only),
  ``skip_special_tokens``), ``return_logprob`` (with ``top_logprobs_num``), ``rid``;
  SGLang's prompt scoring (:mod:`agentgym.serving.scoring`). Answers what SGLang
  answers: ``{"output_ids": [...], "meta_info": {"id", "finish_reason", "prompt_tokens",
  "completion_tokens", "cached_tokens", "weight_version", "output_token_logprobs":
  [[logprob, token_id, null], ...]}}``, plus ``"text"`` unless run with
  ``--skip-tokenizer-init``; a batch answers a list. ``finish_reason`` is ``{"type":
  "stop", "matched": EOS_ID | "stop string"}`` or ``{"type": "length", "length": N}``.
  As in SGLang, ``output_ids`` (and the logprobs) always run through the matched EOS or
  the token completing the stop string; ``no_stop_trim`` only decides whether ``text``
  keeps the stop: the scheduler sends ``req.output_ids_through_stop``
  (``sglang/srt/managers/scheduler_output_processor_mixin.py``,
  ``stream_output_generation``) and ``DetokenizerManager.trim_matched_stop``
  (``detokenizer_manager.py``) trims the text only. ``text`` input is refused: this
  server is token-in/token-out.
- OpenAI's API (:mod:`agentgym.serving.openai_api`): ``GET /v1/models``,
  ``POST /v1/chat/completions`` (``n``, sampling, ``logprobs``, ``stream``, ``tools``) and
  ``POST /v1/completions``, as the official ``openai`` SDK calls them; a judge reward
  (:mod:`agentgym.envs.judge`) grades with it and agents run against it. ``/v1/models`` lists the
  model by the name ``serve`` was given.
- ``GET /health``, ``GET /health_generate`` (one greedy token through the engine),
  ``GET /get_model_info`` (``/model_info``), ``GET /get_server_info`` (``/server_info``;
  like SGLang's, it holds the server arguments: ``tp_size``, ``dp_size`` and ``pp_size``
  are 1 here, ``skip_tokenizer_init``), ``GET /get_weight_version``,
  ``GET|POST /flush_cache``.
- ``POST /pause_generation``, ``POST /continue_generation``: hold new batches / release
  them (SGLang's ``in_place`` mode: running requests finish, nothing is aborted).
- ``POST /update_weights_from_disk`` ``{"model_path", "weight_version"?}``: safetensors
  from a folder (what ``save_pretrained`` writes). With tied embeddings a tied copy
  (``lm_head.weight``) that is sent anyway is ignored, as SGLang's model loaders skip
  ``lm_head.weight`` when ``tie_word_embeddings`` is set: the embedding's value counts.
- ``POST /init_weights_update_group`` ``{"master_address", "master_port", "rank_offset",
  "world_size", "group_name", "backend"}`` and ``POST /update_weights_from_distributed``
  ``{"names", "dtypes", "shapes", "group_name", "flush_cache", "weight_version"}``: the
  trainer (rank 0) broadcasts every tensor, in ``names`` order, over a process group it
  shares with the servers (gloo only here). The server is one rank, ``rank_offset``
  (SGLang's workers take ``rank_offset + tp_rank``; ``tp_size`` is 1 here). ``POST
  /destroy_weights_update_group`` ``{"group_name"}``.
- ``POST /update_weights_from_tensor``: refused with a 400 saying why. SGLang's payload
  holds handles to tensors of a process on the same machine (CUDA IPC for GPU tensors),
  one entry per TP rank; this server does not take them.

Errors are a 400 with ``{"error": {"message", "type", "param", "code"}}`` (SGLang's
``error.message``, in OpenAI's shape) naming the bad field and what is valid. The server binds 127.0.0.1 unless told otherwise (no authentication).
"""

# No `from __future__ import annotations`: FastAPI reads the route annotations at runtime.
import asyncio
import dataclasses
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from agentgym.rollout.engines.sglang_weights import tied_copies
from agentgym.rollout.engines.weight_group import broadcast, destroy_weight_group, init_weight_group
from agentgym.core.types import GenerateOutput, SamplingParams
from agentgym.serving import scoring
from agentgym.serving.native_params import BadRequest, check_ids, parse_sampling
from agentgym.serving.openai_api import OpenAIFrontend, openai_routes
from agentgym.serving.openai_common import OpenAIError, error_body
from agentgym.core.device import engine_dtype, resolve_device
from agentgym.models.zoo import load_model, load_tokenizer, resolve_model
from agentgym.supervision.server_process import watch_parent

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(message))


class ServeState:
    """The engine, its weight version and the process groups for weight updates."""

    def __init__(self, engine, model_path: str, skip_tokenizer_init: bool = False,
                 weight_version: str = "default", max_context: int | None = None,
                 model_name: str = "") -> None:
        self.engine = engine
        self.model_path = model_path
        self.model_name = model_name or model_path  # what /v1/models lists
        self.skip_tokenizer_init = skip_tokenizer_init
        self.weight_version = weight_version
        self.vocab = int(engine.model.get_input_embeddings().weight.shape[0])
        cfg = engine.model.config
        self.max_context = max_context or int(getattr(cfg, "max_position_embeddings", 1 << 20))
        self.groups: dict[str, Any] = {}
        self.paused = False
        self.lock = asyncio.Lock()  # one weight update at a time
        self.counters = {"requests": 0, "generated_tokens": 0, "weight_updates": 0,
                         "cache_flushes": 0}

    # -- generation ---------------------------------------------------------------------
    async def generate_one(self, ids: list[int], sampling: SamplingParams, no_stop_trim: bool,
                           return_logprob: bool, rid: str,
                           skip_special_tokens: bool = True) -> dict:
        if len(ids) + sampling.max_new_tokens > self.max_context:
            raise BadRequest(f"input of {len(ids)} tokens plus max_new_tokens="
                             f"{sampling.max_new_tokens} exceeds the context length "
                             f"{self.max_context}")
        t0 = time.perf_counter()
        version = self.weight_version
        out: GenerateOutput = await self.engine.generate(ids, sampling)
        self.counters["requests"] += 1
        self.counters["generated_tokens"] += len(out.ids)
        if out.finish_reason == "length":
            finish = {"type": "length", "length": len(out.ids)}
        elif out.ids and out.ids[-1] in self.engine.eos_ids:
            finish = {"type": "stop", "matched": int(out.ids[-1])}
        else:
            finish = {"type": "stop", "matched": out.stop_reason}
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(ids),
                "completion_tokens": len(out.ids), "cached_tokens": 0,
                "weight_version": version, "e2e_latency": time.perf_counter() - t0}
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(out.logprobs, out.ids)]
            if out.top_logprobs is not None:
                meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in row]
                                               for row in out.top_logprobs]
        answer: dict[str, Any] = {"output_ids": list(out.ids), "meta_info": meta}
        if not self.skip_tokenizer_init:
            answer["text"] = self.text(out.ids, finish, no_stop_trim, skip_special_tokens)
        return answer

    def text(self, ids: list[int], finish: dict, no_stop_trim: bool,
             skip_special_tokens: bool) -> str:
        """``ids`` decoded, the stop trimmed unless ``no_stop_trim``: SGLang's
        ``DetokenizerManager.trim_matched_stop`` (drop the matched token before decoding;
        cut the text at a matched stop string). ``output_ids`` are never trimmed."""
        matched = finish.get("matched")
        if not no_stop_trim and isinstance(matched, int) and ids:
            ids = ids[:-1]
        text = self.engine.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        if not no_stop_trim and isinstance(matched, str) and matched in text:
            text = text[:text.find(matched)]
        return text

    async def generate(self, body: dict) -> Any:
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object like {\"input_ids\": [1, 2, 3], "
                             "\"sampling_params\": {\"max_new_tokens\": 16}}")
        if body.get("text") is not None or body.get("input_embeds") is not None:
            raise BadRequest("agentgym serve is token-in/token-out (like SGLang with "
                             "--skip-tokenizer-init): send input_ids, not text")
        if body.get("stream"):
            raise BadRequest("stream=true is not supported by agentgym serve")
        if body.get("image_data") is not None:
            raise BadRequest("image_data: this server's model is text-only")
        ids = body.get("input_ids")
        batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        prompts = [check_ids(p, self.vocab, f"input_ids[{i}]" if batch else "input_ids")
                   for i, p in enumerate(prompts)]
        params = body.get("sampling_params")
        start = scoring.start_of(body, BadRequest)
        if scoring.is_scoring(body, start):  # the prompt's logprobs only (a teacher's)
            return await self.score(prompts, params, start, batch)
        if isinstance(params, list):
            if not batch or len(params) != len(prompts):
                raise BadRequest(f"sampling_params is a list of {len(params)}, so input_ids "
                                 f"must be a batch of as many prompts")
        else:
            params = [params] * len(prompts)
        parsed = [parse_sampling(p, allow_stop=not self.skip_tokenizer_init) for p in params]
        rid = body.get("rid") or uuid.uuid4().hex
        logprob = bool(body.get("return_logprob", False))
        top = body.get("top_logprobs_num") or 0
        if not isinstance(top, int) or not 0 <= top <= 20:
            raise BadRequest(f"top_logprobs_num={top!r}: must be an integer in [0, 20]")
        if top:
            parsed = [(dataclasses.replace(p[0], top_logprobs=top), *p[1:]) for p in parsed]
        jobs = []
        for prompt, (sampling, n, keep_stop, skip_special) in zip(prompts, parsed):
            for k in range(n):
                one = rid if not batch and n == 1 else f"{rid}_{len(jobs)}"
                if n > 1 and sampling.seed is not None:  # n samples, not n copies
                    sampling = SamplingParams(**{**sampling.__dict__, "seed": sampling.seed + k})
                jobs.append(self.generate_one(prompt, sampling, keep_stop, logprob, one,
                                              skip_special))
        outs = await asyncio.gather(*jobs)
        return outs if batch or len(outs) > 1 else outs[0]

    async def score(self, prompts: list[list[int]], params: Any, start: int,
                    batch: bool) -> Any:
        """The prompt-scoring request (:mod:`agentgym.serving.scoring`), generation paused
        meanwhile as for a weight update: one forward of the served model a prompt."""
        temps = scoring.temperatures(prompts, params, start, BadRequest)
        async with self.lock:
            await self.engine.pause()
            try:
                rows = await asyncio.to_thread(scoring.prompt_logprobs, self.engine.model,
                                               prompts, temps)
            finally:
                if not self.paused:
                    self.engine.resume()
        outs = scoring.answers(prompts, rows, start, self.weight_version,
                               not self.skip_tokenizer_init)
        return outs if batch else outs[0]

    # -- weights ------------------------------------------------------------------------
    async def _swap(self, load) -> int:
        """Run ``load()`` (returns a full state dict) with generation drained; load it."""
        async with self.lock:
            was_paused = self.paused
            await self.engine.pause()
            try:
                state = await asyncio.to_thread(load)
                self.engine.update_weights(state, self.engine.policy_version + 1)
                self.counters["weight_updates"] += 1
            finally:
                if not was_paused:
                    self.engine.resume()
        return len(state)

    def _merge(self, loaded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's state dict with ``loaded`` in; refuse unknown names and shapes."""
        current = self.engine.model.state_dict()
        unknown = sorted(set(loaded) - set(current))
        if unknown:
            raise BadRequest(f"weights {unknown[:5]} are not in the served model "
                             f"({len(current)} tensors, e.g. {next(iter(current))})")
        for k, v in loaded.items():
            if tuple(v.shape) != tuple(current[k].shape):
                raise BadRequest(f"weight {k} has shape {tuple(v.shape)}; the served model's "
                                 f"is {tuple(current[k].shape)}")
        tied = tied_copies(current)
        # SGLang's loaders skip lm_head.weight under tie_word_embeddings (e.g.
        # Qwen2ForCausalLM.load_weights): a tied copy sent anyway does not count
        loaded = {k: v for k, v in loaded.items() if k not in tied}
        missing = sorted(set(current) - set(loaded) - set(tied))
        if missing:
            raise BadRequest(f"{len(missing)} weights missing, e.g. {missing[:5]}")
        merged = {**current, **loaded}
        for name, source in tied.items():  # a tied copy follows its source
            merged[name] = merged[source]
        return merged

    async def update_from_disk(self, body: dict) -> dict:
        path = Path(str(body.get("model_path") or ""))
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            raise BadRequest(f"model_path={str(path)!r} holds no *.safetensors files (send "
                             "a folder written by save_pretrained)")

        def load():
            from safetensors.torch import load_file
            loaded: dict[str, torch.Tensor] = {}
            for f in files:
                loaded.update(load_file(str(f)))
            return self._merge(loaded)

        n = await self._swap(load)
        return self._updated(body, f"loaded {n} tensors from {path}")

    async def init_group(self, body: dict) -> dict:
        need = ("master_address", "master_port", "rank_offset", "world_size")
        missing = [k for k in need if body.get(k) is None]
        if missing:
            raise BadRequest(f"init_weights_update_group needs {', '.join(missing)}")
        backend = body.get("backend", "nccl")
        if backend != "gloo":
            raise BadRequest(f"backend={backend!r}: agentgym serve runs on CPU and joins "
                             "weight-update groups with backend 'gloo'")
        name = body.get("group_name", "weight_update_group")
        if name in self.groups:
            raise BadRequest(f"weight-update group {name!r} exists; destroy it first")
        rank = int(body["rank_offset"])  # SGLang: rank_offset + tp_rank; tp_size is 1 here
        self.groups[name] = await asyncio.to_thread(
            init_weight_group, "gloo", body["master_address"], int(body["master_port"]),
            int(body["world_size"]), rank, name)
        return {"success": True, "message": f"joined {name} as rank {rank}"}

    async def update_from_distributed(self, body: dict) -> dict:
        names, dtypes = body.get("names"), body.get("dtypes")
        shapes = body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes)):
            raise BadRequest("update_weights_from_distributed needs lists names, dtypes and "
                             "shapes of one length")
        bad = [d for d in dtypes if d not in _DTYPES]
        if bad:
            raise BadRequest(f"dtypes {sorted(set(bad))}; valid: {', '.join(_DTYPES)}")
        name = body.get("group_name", "weight_update_group")
        if name not in self.groups:
            raise BadRequest(f"no weight-update group {name!r}; call /init_weights_update_group "
                             f"first (groups: {sorted(self.groups) or 'none'})")
        group = self.groups[name]
        current = self.engine.model.state_dict()
        unknown = [n for n in names if n not in current]
        if unknown:
            raise BadRequest(f"weights {unknown[:5]} are not in the served model")

        def receive():
            loaded = {}
            for n, d, s in zip(names, dtypes, shapes):
                buf = torch.empty(tuple(s), dtype=_DTYPES[d])
                broadcast(group, buf)
                loaded[n] = buf
            return self._merge(loaded)

        n = await self._swap(receive)
        return self._updated(body, f"received {n} tensors over {name}")

    def _updated(self, body: dict, what: str) -> dict:
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
            try:
                self.engine.policy_version = int(self.weight_version)
            except ValueError:
                pass
        msg = f"Succeeded to update model weights ({what})."
        if body.get("weight_version") is not None:
            msg += f" Weight version updated to {self.weight_version}."
        return {"success": True, "message": msg, "num_paused_requests": 0}


async def _body_of(request: Request) -> dict:
    """The request's JSON object (``{}`` when empty); anything else is a 400."""
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise BadRequest(f"body: not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise BadRequest("body: must be a JSON object")
    return body


def create_app(state: ServeState) -> FastAPI:
    """The FastAPI app serving ``state`` (routes in the module docstring)."""
    app = FastAPI(title="agentgym serve", description=__doc__)
    app.state.serve = state

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest) -> JSONResponse:
        logger.info("400 %s: %s", request.url.path, exc)
        return _error(400, str(exc))

    if state.skip_tokenizer_init:
        @app.api_route("/v1/{rest:path}", methods=["GET", "POST"])
        async def no_openai(rest: str):
            raise OpenAIError("OpenAI's API needs the server's tokenizer, and this server runs "
                              "with --skip-tokenizer-init")
    else:
        openai_routes(app, OpenAIFrontend(state.engine, state.engine.tokenizer,
                                          state.model_name, state.max_context))
    _generation_routes(app, state)
    _info_routes(app, state)
    _weight_routes(app, state)
    return app


def _generation_routes(app: FastAPI, state: ServeState) -> None:
    """``/generate``, health, cache, pause and continue."""
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        return await state.generate(await _body_of(request))

    @app.get("/health")
    async def health():
        return PlainTextResponse("")

    @app.get("/health_generate")
    async def health_generate():
        await state.engine.generate([0], SamplingParams(max_new_tokens=1, temperature=0.0))
        return PlainTextResponse("")

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():  # the engine's prefix cache; refused while requests run (SGLang)
        if not state.engine.flush_cache():
            return PlainTextResponse("Cache not flushed: requests are running or waiting.\n",
                                     status_code=400)
        state.counters["cache_flushes"] += 1
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/pause_generation")
    async def pause(request: Request):
        body = await _body_of(request)
        mode = body.get("mode", "in_place")
        if mode not in ("in_place", "retract", "abort"):
            raise BadRequest(f"mode={mode!r}; valid: abort, retract, in_place")
        state.paused = True
        await state.engine.pause()
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def resume(request: Request):
        await _body_of(request)
        state.paused = False
        state.engine.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}


def _info_routes(app: FastAPI, state: ServeState) -> None:
    """Model, server and weight information."""
    def model_info():
        return {"model_path": state.model_path, "tokenizer_path": state.model_path,
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": state.weight_version, "has_image_understanding": False,
                "has_audio_understanding": False}

    def server_info():  # SGLang's holds dataclasses.asdict(ServerArgs) and more
        return {"model_path": state.model_path, "skip_tokenizer_init": state.skip_tokenizer_init,
                "tp_size": 1, "dp_size": 1, "pp_size": 1,
                "engine": "agentgym-hf", "version": "agentgym",
                "max_batch_size": state.engine.max_batch_size,
                "context_length": state.max_context, "paused": state.paused,
                "weight_version": state.weight_version,
                "internal_states": [{**state.counters, **state.engine.stats}]}

    app.get("/get_model_info")(model_info)
    app.get("/model_info")(model_info)
    app.get("/get_server_info")(server_info)
    app.get("/server_info")(server_info)

    @app.get("/get_weight_version")
    async def weight_version():
        return {"weight_version": state.weight_version}

    @app.get("/get_weights_by_name")
    async def weights_by_name(request: Request):
        query = dict(request.query_params)
        name = query.get("name", "")
        params = state.engine.model.state_dict()
        if name not in params:
            raise BadRequest(f"no weight named {name!r} (e.g. {next(iter(params))})")
        size = int(query.get("truncate_size", 100))
        return params[name].flatten()[:size].float().tolist()


def _weight_routes(app: FastAPI, state: ServeState) -> None:
    """The weight-update routes."""
    @app.post("/update_weights_from_disk")
    async def from_disk(request: Request):
        return await state.update_from_disk(await _body_of(request))

    @app.post("/init_weights_update_group")
    async def init_group(request: Request):
        return await state.init_group(await _body_of(request))

    @app.post("/update_weights_from_distributed")
    async def from_distributed(request: Request):
        return await state.update_from_distributed(await _body_of(request))

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request):
        body = await _body_of(request)
        name = body.get("group_name", "weight_update_group")
        group = state.groups.pop(name, None)
        if group is None:
            raise BadRequest(f"no weight-update group {name!r}")
        destroy_weight_group(group)
        return {"success": True, "message": f"left {name}"}

    @app.post("/update_weights_from_tensor")
    async def from_tensor(request: Request):
        raise BadRequest("update_weights_from_tensor carries tensor handles (CUDA IPC for GPU "
                         "tensors) from a process on the same machine; agentgym serve does "
                         "not take them: use /update_weights_from_disk or "
                         "/update_weights_from_distributed")


def serve(model: str, host: str = "127.0.0.1", port: int = 30000, dtype: str = "",
          device: str = "auto", max_batch_size: int = 32, seed: int = 0, skip_tokenizer_init: bool = False,
          weight_version: str = "default", log_level: str = "info") -> None:
    """Load ``model`` (zoo name or HF folder) into an HF engine and serve it until SIGTERM."""
    import uvicorn

    from agentgym.rollout.engines.hf import HFEngine  # lazy: loads transformers

    path = resolve_model(model)
    where = resolve_device(device)
    dtype = engine_dtype(dtype, "float32", where)
    engine = HFEngine(load_model(path, dtype=dtype, device=where), load_tokenizer(path),
                      max_batch_size=max_batch_size, seed=seed)
    state = ServeState(engine, str(path), skip_tokenizer_init, weight_version, model_name=model)
    logger.info("serving %s (%s, %s) on http://%s:%d", path, dtype, where, host, port)
    try:
        watch_parent()  # ends with the process that started it, if one did
        server = uvicorn.Server(uvicorn.Config(create_app(state), host=host, port=port,
                                               log_level=log_level,
                                               timeout_graceful_shutdown=10))
        _serve_beside(server, engine)
    finally:
        engine.close()


def _serve_beside(server, engine) -> None:
    """The HTTP server's event loop on a helper thread, the engine's steps on this (the
    main) thread: on the CPU the thread that loaded the model is then the one thread that
    computes (docs/decisions/engine.md, "Two OpenMP teams"). SIGTERM and SIGINT end the server
    gracefully, as ``uvicorn.run`` would, and the engine with it."""
    import signal
    import threading

    def stop(signum, frame) -> None:
        server.should_exit = True

    def http() -> None:
        try:
            server.run()
        finally:
            engine.close()  # ends drive() below
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    thread = threading.Thread(target=http, name="serve-http")
    thread.start()
    try:
        engine.drive()  # until the engine closes (the HTTP thread closes it when it stops)
        thread.join()
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
