"""In-process transformers engine (CPU or GPU): continuous batching over a prefix cache.

The engine is four small parts, as nano-vllm splits its own:

* this file, the loop: requests queue up; a worker thread admits them, runs a step
  (:mod:`~agentgym.rollout.engines.scheduler`: a batched prefill of waiting prompts, one
  decode step of every running request) and delivers what finished;
* :mod:`~agentgym.rollout.engines.kv_pool`: one slot of keys/values per running request,
  allocated once on a GPU (``engine.max_len`` positions, ``engine.kv_fraction`` of free
  memory at most), grown on demand on the CPU; :mod:`~agentgym.rollout.engines.prefix_cache`,
  the radix tree of token-id prefixes whose keys/values are not computed again (a
  trajectory's next turn extends its previous turn's ids; the n samples of a group share
  one prompt), emptied on every weight update;
* :mod:`~agentgym.rollout.engines.model_runner`: the model's forward over the pool, its
  decode step captured as CUDA graphs per batch bucket on a GPU (``engine.cuda_graphs``),
  its projections over oneDNN-blocked weight copies on the CPU
  (:mod:`~agentgym.rollout.engines.packed`, ``engine.packed_weights``);
* :mod:`~agentgym.rollout.engines.sampler`: one batched draw on the device per step,
  counter-based per-request seeds, one copy to the host.

Models outside the Llama family (and vision-language models, whose image tokens are not
keyed by their ids and whose positions are 3-D) run static batches through their own
forward (:mod:`~agentgym.rollout.engines.static_batch`); so does
``continuous_batching=False``.

Logprobs are ``log_softmax(logits / temperature)`` of the sampled token (temperature 1 for
greedy), before top-p/top-k, computed in fp32 from the raw logits: exactly what a trainer
recomputes with a forward pass over the finished trajectory.

A request with ``sampling.seed`` draws from (seed, position): its sample does not depend on
which other requests shared its batch. One without a seed gets one from the engine's seed
and its arrival order.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import torch

from agentgym.core.device import bind_thread, free_memory_bytes, is_accelerator
from agentgym.core.types import GenerateOutput, SamplingParams
from agentgym.rollout.engines.base import Engine
from agentgym.rollout.engines.hf_request import StopCheck, _Request
from agentgym.rollout.engines.kv_pool import KVPool
from agentgym.rollout.engines.model_runner import ModelRunner, why_not_supported
from agentgym.rollout.engines.prefix_cache import PrefixCache
from agentgym.rollout.engines.scheduler import Scheduler
from agentgym.rollout.engines.static_batch import run_static
from agentgym.models.vision import is_vl_model, vision_token_ids

logger = logging.getLogger(__name__)

#: the seeds of requests without one: (engine seed, arrival number) hashed apart
_SEED_STRIDE = 0x9E3779B97F4A7C15 >> 2


class HFEngine(Engine):
    """Token-in/token-out engine over a ``transformers`` causal LM.

    Args:
        model: a causal LM (its dtype and device are used as they are).
        tokenizer: used for the pad/EOS ids and to find stop strings.
        max_batch_size: most requests decoded (or prefilled) together.
        batch_wait_s: static batching: once a request is waiting, a batch starts when no
            new request has arrived for this long ...
        max_batch_wait_s: ... or this long after the first, whichever comes first.
        seed: the seed requests without their own are given seeds from.
        continuous_batching: requests join the running batch (False: static batches).
        prefix_cache: reuse cached keys/values of prompt prefixes (needs
            continuous_batching).
        cache_tokens: the prefix cache's budget, in positions.
        prefill_chunk: prompt tokens (padded) prefilled together between two decode
            steps; 0: 512 on the CPU, 8192 on a GPU.
        cuda_graphs: on a GPU, capture the decode step as CUDA graphs.
        packed_weights: on the CPU, run the projections and the head over copies of their
            weights in oneDNN's blocked layout (the copies follow weight updates).
        max_len: on a GPU with graphs, positions per request the KV pool holds
            (0: the model's context, within ``kv_fraction``).
        kv_fraction: on a GPU with graphs, the most of the free memory the pool takes.
        graph_standin: on the CPU, run the GPU's path (captured graphs through the CPU
            stand-in :class:`~agentgym.core.recorded_graph.RecordedGraph`, CUDA's
            attention layout) so that tests execute it; slower than the CPU's own path.
    """

    def __init__(self, model, tokenizer, max_batch_size: int = 32, batch_wait_s: float = 0.005,
                 seed: int = 0, max_batch_wait_s: float = 0.05,
                 continuous_batching: bool = True, prefix_cache: bool = True,
                 cache_tokens: int = 65536, prefill_chunk: int = 0, cuda_graphs: bool = True,
                 max_len: int = 0, kv_fraction: float = 0.5,
                 packed_weights: bool = True, graph_standin: bool = False) -> None:
        if prefill_chunk < 0:
            raise ValueError(f"engine.prefill_chunk={prefill_chunk}; must be >= 1 (0: auto)")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.max_batch_wait_s = max(max_batch_wait_s, batch_wait_s)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
            else tokenizer.eos_token_id
        self.eos_ids = _eos_ids(model, tokenizer)
        self.stops = StopCheck(tokenizer, self.eos_ids)
        self.vision = is_vl_model(model)  # images in, 3-D (M-RoPE) positions
        self.never = vision_token_ids(model) if self.vision else []  # never sampled
        self.policy_version = 0
        self.seed, self._arrivals = seed, 0
        self._queue: list[_Request] = []
        self._cv = threading.Condition()
        self._paused = self._preempt = False
        self._busy = False
        self._closed = False
        self._driver: threading.Thread | None = None  # a run() stepping on its own thread
        self._stepping = False
        self.stats = {"batches": 0, "requests": 0, "generated_tokens": 0, "decode_steps": 0,
                      "prefilled_tokens": 0, "prefill_passes": 0, "cached_tokens": 0,
                      "max_rows": 0, "preempted": 0, "rows_rebuilt": 0,
                      "forward_s": 0.0, "host_s": 0.0}
        self.prefill_chunk = prefill_chunk or (8192 if is_accelerator(self.device) else 512)
        why_static = _why_static(model, self.vision) if continuous_batching else None
        if why_static:
            logger.info("continuous batching and the prefix cache are off: %s", why_static)
        self.continuous = continuous_batching and why_static is None
        self.prefix: PrefixCache | None = None
        if prefix_cache and self.continuous:
            self.prefix = PrefixCache(cache_tokens)
        elif prefix_cache and not continuous_batching:
            logger.info("the prefix cache is off: it needs continuous batching")
        self.scheduler: Scheduler | None = None
        if self.continuous:
            self.scheduler = self._scheduler(cuda_graphs, max_len, kv_fraction, packed_weights,
                                             graph_standin)
            self.scheduler.runner.capture_all()  # before serving: no row is live yet
        #: run() steps on its caller's thread (the CPU only: see run)
        self._drive_here = self.continuous and not is_accelerator(self.device)
        worker = self._cb_worker if self.continuous else self._worker
        self._thread = threading.Thread(target=worker, name="hf-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, cfg, model, tokenizer) -> "HFEngine":
        e = cfg.engine
        return cls(model, tokenizer, max_batch_size=e.max_batch_size,
                   batch_wait_s=e.batch_wait_s, seed=cfg.trainer.seed,
                   max_batch_wait_s=e.max_batch_wait_s,
                   continuous_batching=e.continuous_batching, prefix_cache=e.prefix_cache,
                   cache_tokens=e.cache_tokens, prefill_chunk=e.prefill_chunk,
                   cuda_graphs=e.cuda_graphs, max_len=e.max_len, kv_fraction=e.kv_fraction,
                   packed_weights=e.packed_weights)

    def _scheduler(self, cuda_graphs: bool, max_len: int, kv_fraction: float,
                   packed: bool, standin: bool) -> Scheduler:
        config = self.model.config.get_text_config()
        heads = config.num_attention_heads
        kv_heads = config.num_key_value_heads or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        dtype = next(self.model.parameters()).dtype
        graphs = cuda_graphs and (is_accelerator(self.device) or standin)

        def pool(slots: int, capacity: int, growable: bool) -> KVPool:
            return KVPool(config.num_hidden_layers, kv_heads, head_dim, dtype, self.device,
                          slots, capacity, growable)
        if graphs:  # allocated once: the graphs keep its addresses
            per_position = 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize
            fits = int(free_memory_bytes(self.device) * kv_fraction) // (per_position * (self.max_batch_size + 1))
            capacity = min(max_len or config.max_position_embeddings, fits)
            decode = pool(self.max_batch_size, capacity, growable=False)
            logger.info("KV pool: %d requests x %d positions (%.2f GiB)", self.max_batch_size,
                        capacity, decode.bytes() / 2**30)
        else:
            decode = pool(0, 0, growable=True)
        runner = ModelRunner(self.model, decode, graphs=graphs, packed=packed,
                             standin=standin)
        return Scheduler(runner, pool(0, 0, growable=True), decode, self.prefix, self.stops,
                         self.stats, self.max_batch_size, self.prefill_chunk,
                         vocab=self.model.get_output_embeddings().out_features)

    # -- public API ---------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling: SamplingParams,
                       images: list[Any] | None = None,
                       session_id: str | None = None) -> GenerateOutput:
        return await self._submit(prompt_ids, sampling, images).future

    async def stream(self, prompt_ids: list[int], sampling: SamplingParams,
                     images: list[Any] | None = None, session_id: str | None = None):
        """Each token as the worker samples it (``([id], [logprob], [top] | None)``),
        then the whole :class:`GenerateOutput`; closing the iterator abandons the request."""
        req = self._submit(prompt_ids, sampling, images, asyncio.Queue())
        try:
            while (piece := await req.pieces.get()) is not None:
                token, logprob, top = piece
                yield [token], [logprob], None if top is None else [top]
            yield await req.future
        finally:
            req.future.cancel()  # no-op when done; else the worker drops the row

    def _submit(self, prompt_ids, sampling, images, pieces: asyncio.Queue | None = None):
        if images is not None and not self.vision:
            raise ValueError("this model is text-only and got images; use a vision-language "
                             "model (model=tiny-vl or a Qwen2.5-VL folder)")
        if not prompt_ids:
            raise ValueError("prompt_ids is empty: a request needs at least one token")
        if self.scheduler is not None and not self.scheduler.decode.growable:
            # +1: a finished row computes one token more before its end is seen
            need = len(prompt_ids) + sampling.max_new_tokens + 1
            if need > self.scheduler.decode.capacity:
                raise ValueError(f"a prompt of {len(prompt_ids)} tokens + max_new_tokens="
                                 f"{sampling.max_new_tokens} needs {need} positions; the KV "
                                 f"pool holds {self.scheduler.decode.capacity} per request "
                                 "(engine.max_len, engine.kv_fraction)")
        loop = asyncio.get_running_loop()
        with self._cv:
            if self._closed:
                raise RuntimeError("engine is closed")
            seed = sampling.seed
            if seed is None:
                self._arrivals += 1
                seed = (self.seed * _SEED_STRIDE + self._arrivals) & (2**63 - 1)
            req = _Request(list(prompt_ids), sampling, loop.create_future(), loop, seed,
                           images, pieces=pieces)
            self._queue.append(req)
            self._cv.notify_all()
        return req

    def update_weights(self, state_dict: dict, version: int) -> None:
        with self._cv:
            if self._busy:
                raise RuntimeError("update_weights() while a batch is running; pause() first")
            # copied into the parameters' own storage: captured graphs stay valid
            self.model.load_state_dict(state_dict, strict=True)
            self.policy_version = version
            if self.scheduler is not None:
                self.scheduler.version = version
                self.scheduler.clear()  # idle: a growable pool gives its memory back
            if self.prefix is not None:  # keys/values of the old weights are wrong now
                self.prefix.clear()

    def flush_cache(self) -> bool:
        """Empty the prefix cache; False (nothing done) while requests run or wait."""
        with self._cv:
            if self._busy or self._queue:
                return False
            if self.prefix is not None:
                self.prefix.clear()
            return True

    async def pause(self, partial: bool = False) -> None:
        """Hold new requests and wait until nothing runs. With ``partial`` (continuous
        batching only), requests being prefilled or decoded stop at the next step and go
        back to the head of the queue with the tokens they have; after :meth:`resume` they
        are prefilled again (prompt and tokens so far, under the new weights) and go on
        sampling, each token stamped with the version that sampled it."""
        with self._cv:
            self._paused = True
            self._preempt = partial and self.continuous
            self._cv.notify_all()
        await asyncio.to_thread(self._wait_idle)

    def resume(self) -> None:
        with self._cv:
            self._paused = self._preempt = False
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            pending, self._queue = self._queue, []
            self._cv.notify_all()
        for r in pending:
            r.fail(RuntimeError("engine closed"))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    # -- static batches -----------------------------------------------------------------
    def _wait_idle(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: not self._busy)

    def _take_batch(self) -> list[_Request] | None:
        with self._cv:
            while True:
                self._cv.wait_for(lambda: self._closed or (self._queue and not self._paused))
                if self._closed:
                    return None
                self._busy = True  # pause() now waits for this batch
                # let concurrent callers join: wait for a quiet gap, within a cap
                first = time.monotonic()
                deadline, seen = first + self.batch_wait_s, len(self._queue)
                while len(self._queue) < self.max_batch_size and not self._closed:
                    left = min(deadline, first + self.max_batch_wait_s) - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(timeout=left)
                    if len(self._queue) > seen:
                        deadline, seen = time.monotonic() + self.batch_wait_s, len(self._queue)
                if not self._paused:
                    break
                self._busy = False  # paused while forming: hold the requests
                self._cv.notify_all()
            batch = [r for r in self._queue[:self.max_batch_size] if not r.abandoned]
            self._queue = self._queue[self.max_batch_size:]
            return batch

    def _worker(self) -> None:
        bind_thread(self.device)
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            try:
                if batch:
                    with torch.inference_mode():
                        run_static(self, batch)
            except BaseException as e:  # noqa: BLE001 - surface every failure to the caller
                logger.exception("generation batch of %d failed", len(batch))
                for r in batch:
                    r.fail(e)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    # -- continuous batching ------------------------------------------------------------
    # One loop steps the scheduler (:meth:`_drive`): admit what waits, run one step,
    # deliver. Callers only submit and await. The loop runs on the engine's own thread
    # unless a caller drives it on its own: :meth:`run` (a rollout's event loop moves to a
    # helper thread) or :meth:`drive` (a server's loop runs elsewhere). On the CPU that
    # caller is the trainer's or the server's main thread, which then is the one thread
    # that computes: one OpenMP team, not two (docs/decisions/engine.md, "Two OpenMP
    # teams").
    def run(self, coro):
        """Run ``coro`` (a rollout awaiting this engine) from outside any event loop and
        return its result. On the CPU with continuous batching, this thread runs the
        engine's steps while the event loop runs in a helper thread. Requests from
        elsewhere are served meanwhile by the same steps; after ``coro`` ends, the
        engine's own thread takes over again."""
        if not (self._drive_here and self._claim()):
            return asyncio.run(coro)
        out: dict = {}

        def loop() -> None:
            try:
                out["value"] = asyncio.run(coro)
            except BaseException as e:  # noqa: BLE001 - raised again by the driver
                out["error"] = e
            finally:
                with self._cv:
                    out["done"] = True
                    self._cv.notify_all()
        helper = threading.Thread(target=loop, name="hf-engine-loop", daemon=True)
        helper.start()
        try:
            self._drive(lambda: "done" in out)
        finally:
            self._release()
        helper.join()  # closed: close() failed the requests, so the rollout ends too
        if "error" in out:
            raise out["error"]
        return out["value"]

    def drive(self, done=None) -> None:
        """Step the engine on this thread until :meth:`close`, or until ``done`` (a
        ``concurrent.futures.Future``, say a coroutine's on another thread's event loop)
        completes: a server whose event loop runs on another thread (``agentgym serve``
        on the CPU). Returns at once, leaving the engine's own thread to step, where it
        cannot drive (static batches, or a caller already driving)."""
        if not (self.continuous and self._claim()):
            return
        if done is not None:
            done.add_done_callback(lambda _: self._wake())
        try:
            bind_thread(self.device)
            self._drive(lambda: done is not None and done.done())
        finally:
            self._release()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _claim(self) -> bool:
        """Make this thread the one that steps (False: another caller already does)."""
        with self._cv:
            if self._driver is not None or self._closed:
                return False
            self._driver = threading.current_thread()
            self._cv.notify_all()
            self._cv.wait_for(lambda: not self._stepping)  # the worker's step ends
            return True

    def _release(self) -> None:
        with self._cv:
            self._driver = None
            self._cv.notify_all()

    def _drive(self, until) -> None:
        """The loop: admit waiting requests, run one step, deliver; until ``until()``
        (read with the lock held) or the engine closes."""
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or until() or self._has_work())
                if self._closed or until():
                    return
                try:
                    taken = self._take()
                except BaseException as e:  # noqa: BLE001 - the callers hear of it, the loop goes on
                    # (a dead loop would leave the engine busy: a weight push waits forever)
                    logger.exception("admitting requests failed")
                    self._fail_running(e)
                    continue
            self._step(taken)

    def _has_work(self) -> bool:
        return self.scheduler.busy or bool(self._queue and not self._paused)

    def _take(self) -> list[_Request] | None:
        """(Lock held) The requests to admit before the next step, or None when
        :meth:`_preempt_all` stopped the running ones (partial rollouts)."""
        sched = self.scheduler
        if self._paused and self._preempt and sched.busy:
            self._preempt_all()
            return None
        taken = []
        if not self._paused:
            room = sched.room()
            while self._queue and room > 0:
                r = self._queue.pop(0)
                if not r.abandoned:
                    taken.append(r)
                    room -= 1
        self._busy = self._stepping = True
        return taken

    def _step(self, taken: list[_Request] | None) -> None:
        """Admit ``taken``, run one step (prefill, decode), deliver what finished."""
        if taken is None:
            return
        sched = self.scheduler
        try:
            for r in taken:
                sched.admit(r)
            with torch.inference_mode():
                sched.step()
        except BaseException as e:  # noqa: BLE001 - surface every failure to the caller
            logger.exception("generation step failed")
            for r in sched.running():
                if not r.closed:
                    r.fail(e)
            sched.clear()
        with self._cv:  # taken with the lock: the next step may run on another thread
            ready, sched.ready = sched.ready, []
            self._stepping = False
            if not sched.busy:
                self._busy = False
            self._cv.notify_all()
        # delivered after the engine's state is settled: a caller whose request was
        # the last sees the engine idle (flush_cache, update_weights) when it resumes
        for r, done in ready:
            r.finish(*done, self.policy_version)

    def _cb_worker(self) -> None:
        """The engine's own thread: it drives the loop while no caller does."""
        bind_thread(self.device)
        while True:
            self._drive(lambda: self._driver is not None)
            with self._cv:  # a caller drives now (or the engine closed): wait for it
                self._cv.wait_for(lambda: self._driver is None)
                if self._closed:
                    break
        for r in self.scheduler.running():
            if not r.closed:
                r.fail(RuntimeError("engine closed"))

    def _fail_running(self, error: BaseException) -> None:
        """(Lock held) Every running request fails with ``error``; the engine is idle
        after, so what waits on it (:meth:`pause`) goes on."""
        sched = self.scheduler
        for r in sched.running():
            if not r.closed:
                r.fail(error)
        sched.clear()
        self._busy = self._stepping = False
        self._cv.notify_all()

    def _preempt_all(self) -> None:
        """Partial rollouts (lock held): every running request back to the head of the
        queue, in order, with its tokens so far; its keys/values are dropped (recomputed
        under the new weights). The engine is idle after."""
        sched = self.scheduler
        with torch.inference_mode():  # a row it finishes moves another's keys/values
            sched.drain()  # the tokens of the step in flight are kept
        for r, done in sched.ready:  # finished by that step: delivered now
            r.finish(*done, self.policy_version)
        sched.ready.clear()
        back = [r for r in sched.running() if not r.closed]
        self._queue[:0] = [r for r in back if not r.abandoned]
        self.stats["preempted"] += len(back)
        sched.clear()
        self._busy = False
        self._cv.notify_all()


def _why_static(model, vision: bool) -> str | None:
    """Why this model runs static batches (None: continuous batching over the pool)."""
    if vision:
        return ("a vision-language model: image tokens share one id whatever the image, "
                "and its positions are 3-D (M-RoPE)")
    return why_not_supported(model)


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif gen_eos:
        ids.update(int(i) for i in gen_eos)
    return ids
