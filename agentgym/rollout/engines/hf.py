"""In-process transformers engine (CPU or GPU): continuous batching over a prefix cache.

The engine is four small parts, as nano-vllm splits its own:

* this file, the front: callers post commands (submit, pause, resume, update_weights,
  flush) to an inbox (close moves the state at once), and one thread at a time runs the loop that applies them
  and steps the core (:mod:`~agentgym.rollout.engines.core`: ``add_request``, ``step``,
  ``is_finished``, as nano-vllm's engine; each step a batched prefill of waiting prompts
  and one decode step of every running request, :mod:`~agentgym.rollout.engines.scheduler`),
  then delivers what finished; a :class:`~agentgym.rollout.engines.core.State` says
  whether it admits, pauses or is closed;
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
forward (:class:`~agentgym.rollout.engines.static_batch.StaticCore`, the same core
interface, stepped by the same loop); so does ``continuous_batching=False``.

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
from collections import deque
from concurrent.futures import Future
from typing import Any

from agentgym.core.device import bind_thread, free_memory_bytes, is_accelerator
from agentgym.core.types import GenerateOutput, SamplingParams
from agentgym.rollout.engines.base import Engine
from agentgym.rollout.engines.core import ContinuousCore, State
from agentgym.rollout.engines.hf_request import StopCheck, _Request
from agentgym.rollout.engines.kv_pool import KVPool
from agentgym.rollout.engines.model_runner import ModelRunner, why_not_supported
from agentgym.rollout.engines.prefix_cache import PrefixCache
from agentgym.rollout.engines.scheduler import Scheduler
from agentgym.rollout.engines.static_batch import StaticCore
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
        self.core: ContinuousCore | StaticCore
        if self.continuous:
            self.scheduler = self._scheduler(cuda_graphs, max_len, kv_fraction, packed_weights,
                                             graph_standin)
            self.scheduler.runner.capture_all()  # before serving: no row is live yet
            self.core = ContinuousCore(self.scheduler)
        else:
            self.core = StaticCore(self.model, self.device, self.pad_id, self.stops,
                                   self.stats, self.vision, self.never, max_batch_size,
                                   batch_wait_s, self.max_batch_wait_s)
        # the front: commands in, one thread stepping the core (see "The loop" below)
        self.state = State.RUNNING
        self._cv = threading.Condition()
        self._inbox: deque[tuple] = deque()
        self._pausers: list[Future] = []  # pause() calls waiting for nothing to run
        self._idle = True
        self._busy = False  # a step in progress, or requests in the core's batch
        self._driver: threading.Thread | None = None  # a run()/drive() asking to step
        #: run() steps on its caller's thread (the CPU only: see run)
        self._drive_here = not is_accelerator(self.device)
        self._thread = threading.Thread(target=self._own_loop, name="hf-engine", daemon=True)
        self._stepper: threading.Thread | None = self._thread  # who steps the core now
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
            if self.state is State.CLOSED:
                raise RuntimeError("engine is closed")
            seed = sampling.seed
            if seed is None:
                self._arrivals += 1
                seed = (self.seed * _SEED_STRIDE + self._arrivals) & (2**63 - 1)
            req = _Request(list(prompt_ids), sampling, loop.create_future(), loop, seed,
                           images, pieces=pieces)
            self._post("submit", req)
        return req

    def update_weights(self, state_dict: dict, version: int) -> None:
        """Load new weights (copied into the parameters' own storage: captured graphs stay
        valid) and empty the prefix cache; raises while requests run (pause() first)."""
        with self._cv:
            if self._busy:  # as a command it would wait behind a static batch to refuse
                raise RuntimeError("update_weights() while a batch is running; pause() first")
        self._command("update", state_dict, version)

    def flush_cache(self) -> bool:
        """Empty the prefix cache; False (nothing done) while requests run or wait."""
        return self._command("flush")

    async def pause(self, partial: bool = False) -> None:
        """Hold new requests and wait until nothing runs. With ``partial`` (continuous
        batching only), requests being prefilled or decoded stop at the next step and go
        back to the head of the queue with the tokens they have; after :meth:`resume` they
        are prefilled again (prompt and tokens so far, under the new weights) and go on
        sampling, each token stamped with the version that sampled it."""
        done: Future = Future()
        with self._cv:
            if self.state is State.CLOSED:
                return
            self._post("pause", partial, done)
        await asyncio.wrap_future(done)

    def resume(self) -> None:
        with self._cv:
            if self.state is not State.CLOSED:
                self._post("resume")

    def close(self) -> None:
        with self._cv:  # at once: nothing is submitted after this returns; the stepping
            self.state = State.CLOSED  # thread fails what is left and stops
            self._cv.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    def idle(self) -> bool:
        """Nothing waits, nothing runs and no command is pending."""
        with self._cv:
            return self._idle

    def waiting(self) -> int:
        """Requests submitted and not admitted yet (held while paused)."""
        with self._cv:
            return sum(c[0] == "submit" for c in self._inbox) + len(self.core.waiting)

    def stepping_thread(self) -> threading.Thread | None:
        """The thread that steps the engine now: its own, or a :meth:`run` / :meth:`drive`
        caller's (None once closed)."""
        with self._cv:
            return self._stepper

    # -- the loop -----------------------------------------------------------------------
    # Callers post commands (submit, pause, resume, update, flush) to the inbox, and close
    # moves the state to CLOSED; one thread at a time runs the loop, which applies them and
    # steps the core. That thread
    # is the engine's own unless a caller steps it: :meth:`run` (a rollout's event loop
    # moves to a helper thread) or :meth:`drive` (a server's loop runs elsewhere). On the
    # CPU that caller is the trainer's or the server's main thread, which then is the one
    # thread that computes: one OpenMP team, not two (docs/decisions/engine.md, "Two
    # OpenMP teams").
    def _post(self, *command) -> None:
        """(Lock held) Queue a command for the stepping thread."""
        self._inbox.append(command)
        self._idle = False
        self._cv.notify_all()

    def _command(self, *command):
        """Post ``command`` and return its result, once the stepping thread has run it."""
        done: Future = Future()
        inline = False
        with self._cv:
            if self.state is State.CLOSED:
                _closed(done, command)
            elif threading.current_thread() is self._stepper:
                inline = True  # the stepping thread itself (from a callback)
            else:
                self._post(*command, done)
        if inline:
            return self._run(command)
        return done.result()

    def _run(self, command: tuple):
        """Run an update or a flush (on the stepping thread)."""
        name, *args = command
        if name == "flush":
            if not self.core.is_finished():
                return False
            if self.prefix is not None:
                self.prefix.clear()
            return True
        state_dict, version = args[:2]
        if self.core.running():
            raise RuntimeError("update_weights() while a batch is running; pause() first")
        self.model.load_state_dict(state_dict, strict=True)
        self.policy_version = version
        self.core.update_weights(version)
        if self.prefix is not None:  # keys/values of the old weights are wrong now
            self.prefix.clear()
        return None

    def _answer(self, command: tuple) -> None:
        """Run a posted update or flush; its result (or its error) to its caller."""
        *command, done = command
        try:
            _resolve(done, self._run(tuple(command)))
        except BaseException as e:  # noqa: BLE001 - raised again in the caller
            done.set_exception(e)

    def _apply(self, commands: list[tuple]) -> list[tuple]:
        """(Lock held) Apply the light commands; return the updates and flushes."""
        heavy = []
        for c in commands:
            if c[0] == "submit":
                self.core.add_request(c[1])
            elif c[0] == "pause":
                _, partial, done = c
                if self.state is not State.CLOSED:
                    partial = partial and self.continuous
                    self.state = State.PREEMPTING if partial else State.PAUSING
                self._pausers.append(done)
            elif c[0] == "resume":
                if self.state is not State.CLOSED:
                    self.state = State.RUNNING
            elif c[0] in ("update", "flush"):
                heavy.append(c)
        return heavy

    def _loop(self, until) -> None:
        """Apply commands and step the core, until ``until()`` (read with the lock held) or
        the engine closes (every request left then fails)."""
        while True:
            with self._cv:
                while True:
                    if self.state is State.CLOSED or until():
                        break
                    if self._inbox:
                        break
                    wait = self.core.wait_s(self.state is State.RUNNING, time.monotonic())
                    if wait == 0.0:
                        break
                    self._cv.wait(wait)
                if self.state is State.CLOSED:
                    break
                if until():
                    return
                commands, self._inbox = list(self._inbox), deque()
                heavy = self._apply(commands)
                admit = self.state is State.RUNNING
                preempt = self.state is State.PREEMPTING
                step = not preempt and self.core.wait_s(admit, time.monotonic()) == 0.0
                # until _settle: update_weights refuses (as a command it would wait behind
                # a static batch only to refuse after it)
                self._busy = preempt or step or self.core.running()
            for c in heavy:  # updates and flushes (the core idle for an update)
                self._answer(c)
            ready = self.core.preempt() if preempt else \
                self.core.step(admit=admit) if step else []
            self._settle(ready)
        self._shut()

    def _settle(self, ready) -> None:
        """After a step: pausing ends once nothing runs; the idle flag is published; then
        what finished is delivered (its caller sees the engine's state settled)."""
        with self._cv:
            pausers = []
            self._busy = self.core.running()
            if not self._busy:
                if self.state in (State.PAUSING, State.PREEMPTING):
                    self.state = State.PAUSED
                pausers, self._pausers = self._pausers, []
            self._idle = self.core.is_finished() and not self._inbox
            self._cv.notify_all()
        for r, done in ready:
            r.finish(*done, self.policy_version)
        for done in pausers:
            _resolve(done, None)

    def _shut(self) -> None:
        """Closed: every request fails, every command ends; the engine is idle."""
        error = RuntimeError("engine closed")
        with self._cv:
            commands, self._inbox = list(self._inbox), deque()
            pausers, self._pausers = self._pausers, []
        for c in commands:
            if c[0] == "submit":
                c[1].fail(error)
            elif c[0] == "pause":
                pausers.append(c[-1])
            elif c[0] in ("update", "flush"):
                _closed(c[-1], c[:-1])
        self.core.abort(error)
        with self._cv:
            self._idle, self._busy = True, False
            self._stepper = None
            self._cv.notify_all()
        for done in pausers:
            _resolve(done, None)

    def run(self, coro):
        """Run ``coro`` (a rollout awaiting this engine) from outside any event loop and
        return its result. On the CPU, this thread runs the engine's steps while the event
        loop runs in a helper thread. Requests from elsewhere are served meanwhile by the
        same steps; after ``coro`` ends, the engine's own thread takes over again."""
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
        try:
            helper.start()
            self._loop(lambda: "done" in out)
        finally:
            self._release()
        helper.join()  # closed: every request failed, so the rollout ends too
        if "error" in out:
            raise out["error"]
        return out["value"]

    def drive(self, done=None) -> None:
        """Step the engine on this thread until :meth:`close`, or until ``done`` (a
        ``concurrent.futures.Future``, say a coroutine's on another thread's event loop)
        completes: a server whose event loop runs on another thread (``agentgym serve``
        on the CPU). Returns at once where another caller already steps it."""
        if not self._claim():
            return
        if done is not None:
            done.add_done_callback(lambda _: self._wake())
        try:
            bind_thread(self.device)
            self._loop(lambda: done is not None and done.done())
        finally:
            self._release()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _claim(self) -> bool:
        """Make this thread the one that steps (False: another caller already does, or
        the engine is closed). The engine's own thread hands over between two steps."""
        me = threading.current_thread()
        with self._cv:
            if self._driver is not None or self.state is State.CLOSED:
                return False
            self._driver = me
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._stepper is me or self.state is State.CLOSED)
            if self._stepper is not me:
                self._driver = None
                self._cv.notify_all()
                return False
            return True

    def _release(self) -> None:
        """Hand the steps back to the engine's own thread (which hands them on at once to a
        caller already waiting in :meth:`_claim`)."""
        with self._cv:
            self._driver = None
            if self.state is not State.CLOSED:
                self._stepper = self._thread
            self._cv.notify_all()

    def _own_loop(self) -> None:
        """The engine's own thread: it steps while no caller does."""
        bind_thread(self.device)
        me = threading.current_thread()
        try:
            while True:
                self._loop(lambda: self._driver is not None)
                with self._cv:
                    if self.state is State.CLOSED:
                        return
                    self._stepper = self._driver  # between two steps: the caller's turn
                    self._cv.notify_all()
                    self._cv.wait_for(lambda: self._stepper is me or self.state is State.CLOSED)
                    if self.state is State.CLOSED:
                        return
        finally:  # closed, or this thread failed: closed, and nothing is left waiting
            with self._cv:
                self.state = State.CLOSED
            self._shut()  # (a second _shut does nothing)


def _closed(done: Future, command: tuple) -> None:
    """End a command the closed engine will not run: a flush did nothing, an update fails."""
    if command[0] == "flush":
        _resolve(done, False)
    elif not done.done():
        done.set_exception(RuntimeError("engine is closed"))


def _resolve(done: Future, value) -> None:
    if not done.done():
        done.set_result(value)


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
