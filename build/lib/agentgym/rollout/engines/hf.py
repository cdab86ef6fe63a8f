"""In-process transformers engine (CPU or GPU): continuous batching over a prefix cache.

Requests from many trajectories queue up; a worker thread runs them. By default
(``continuous_batching``) a request joins the running decode batch at the next step: its
prompt is prefilled first, in chunks of ``prefill_chunk`` tokens between decode steps so a
long prompt does not stall the rows already decoding, and every row leaves the batch (its
caller resumes) the moment it hits EOS, a stop string or its own ``max_new_tokens``
(:mod:`agentgym.rollout.engines.kv_slots`). With ``prefix_cache``, a prompt's longest cached prefix
is not prefilled again: a trajectory's next turn extends its previous turn's ids, the n
samples of a group share one prompt, and both find their keys/values in a radix tree of
token ids (:mod:`agentgym.rollout.engines.prefix_cache`), emptied on every weight update.

With ``continuous_batching=False`` (and for vision-language models, whose image tokens
are not keyed by their ids and whose positions are 3-D) the engine forms static batches:
whatever is waiting is left-padded into one batch and decoded until its last row is done.

Logprobs are ``log_softmax(logits / temperature)`` of the sampled token (temperature 1 for
greedy), before top-p/top-k, computed in fp32 from the raw logits: exactly what a trainer
recomputes with a forward pass over the finished trajectory (positions are explicit, so
padding and alignment never move them).

Each request with ``sampling.seed`` gets its own ``torch.Generator``, so its sample does
not depend on which other requests shared its batch.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from agentgym.rollout.engines.base import Engine
from agentgym.rollout.engines.hf_request import _Request
from agentgym.rollout.engines.kv_slots import Slots, buffered_cache
from agentgym.rollout.engines.prefix_cache import PrefixCache
from agentgym.core.types import GenerateOutput, SamplingParams

logger = logging.getLogger(__name__)

#: Tokens decoded at the end of a row to look for stop strings (each token is >= 1 char).
_STOP_WINDOW = 32


class HFEngine(Engine):
    """Token-in/token-out engine over a ``transformers`` causal LM.

    Args:
        model: a causal LM (its dtype and device are used as they are).
        tokenizer: used for the pad/EOS ids and to find stop strings.
        max_batch_size: most requests decoded (or prefilled) together.
        batch_wait_s: static batching: once a request is waiting, a batch starts when no
            new request has arrived for this long ...
        max_batch_wait_s: ... or this long after the first, whichever comes first.
        seed: seed of the generator used by requests without their own seed.
        continuous_batching: requests join the running batch (False: static batches).
        prefix_cache: reuse cached keys/values of prompt prefixes (needs
            continuous_batching).
        cache_tokens: the prefix cache's budget, in positions.
        prefill_chunk: prompt tokens prefilled between two decode steps.
    """

    def __init__(self, model, tokenizer, max_batch_size: int = 32, batch_wait_s: float = 0.005,
                 seed: int = 0, max_batch_wait_s: float = 0.05,
                 continuous_batching: bool = True, prefix_cache: bool = True,
                 cache_tokens: int = 65536, prefill_chunk: int = 256) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"engine.prefill_chunk={prefill_chunk}; must be >= 1")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.max_batch_wait_s = max(max_batch_wait_s, batch_wait_s)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
            else tokenizer.eos_token_id
        self.eos_ids = _eos_ids(model, tokenizer)
        from agentgym.models.vision import is_vl_model, vision_token_ids
        self.vision = is_vl_model(model)  # images in, 3-D (M-RoPE) positions
        self._never = vision_token_ids(model) if self.vision else []  # never sampled
        # stop strings are checked after every token: the Rust tokenizer decodes a window
        # without the Python wrapper's per-call overhead (about 16 us -> 2 us)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode = (functools.partial(backend.decode, skip_special_tokens=False)
                        if backend is not None else
                        functools.partial(tokenizer.decode, skip_special_tokens=False))
        self.policy_version = 0
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._queue: list[_Request] = []
        self._cv = threading.Condition()
        self._paused = self._preempt = False
        self._busy = False
        self._closed = False
        self.stats = {"batches": 0, "requests": 0, "generated_tokens": 0, "decode_steps": 0,
                      "prefilled_tokens": 0, "cached_tokens": 0, "max_rows": 0, "preempted": 0}
        self.prefill_chunk = prefill_chunk
        why_static = _why_static(model, self.vision) if continuous_batching else None
        if why_static:
            logger.info("continuous batching and the prefix cache are off: %s", why_static)
        self.continuous = continuous_batching and why_static is None
        self.prefix: PrefixCache | None = None
        if prefix_cache and self.continuous:
            self.prefix = PrefixCache(cache_tokens)
        elif prefix_cache and not continuous_batching:
            logger.info("the prefix cache is off: it needs continuous batching")
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
                   cache_tokens=e.cache_tokens, prefill_chunk=e.prefill_chunk)

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
        loop = asyncio.get_running_loop()
        gen = None
        if sampling.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(sampling.seed)
        req = _Request(list(prompt_ids), sampling, loop.create_future(), loop, gen, images,
                       pieces=pieces)
        with self._cv:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._queue.append(req)
            self._cv.notify_all()
        return req

    def update_weights(self, state_dict: dict, version: int) -> None:
        with self._cv:
            if self._busy:
                raise RuntimeError("update_weights() while a batch is running; pause() first")
            self.model.load_state_dict(state_dict, strict=True)
            self.policy_version = version
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

    # -- worker -------------------------------------------------------------------------
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
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            if not batch:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
                continue
            try:
                with torch.inference_mode():
                    self._run_batch(batch)
            except BaseException as e:  # noqa: BLE001 - surface every failure to the caller
                logger.exception("generation batch of %d failed", len(batch))
                for r in batch:
                    r.fail(e)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _run_batch(self, reqs: list[_Request]) -> None:
        t0 = time.perf_counter()
        version = self.policy_version  # constant while a batch runs (updates wait for idle)
        self.stats["batches"] += 1
        self.stats["requests"] += len(reqs)
        self.stats["max_rows"] = max(self.stats["max_rows"], len(reqs))
        self.stats["prefilled_tokens"] += sum(len(r.prompt_ids) for r in reqs)
        width = max(len(r.prompt_ids) for r in reqs)
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            attn[i, width - len(r.prompt_ids):] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        cache = buffered_cache(self.model, width + max(r.sampling.max_new_tokens for r in reqs))
        if self.vision:  # pixel values of the rows' images and 3-D positions
            from agentgym.models.vision import vl_forward_kwargs
            kw = vl_forward_kwargs(self.model, ids, attn, [r.images for r in reqs])
            last_pos = kw["position_ids"][0, :, -1]  # text from here on: 3 equal components
        else:
            kw = {"position_ids": (attn.cumsum(-1) - 1).clamp(min=0)}
            last_pos = kw["position_ids"][:, -1]
        out = self.model(input_ids=ids, attention_mask=attn, past_key_values=cache,
                         use_cache=True, logits_to_keep=1, **kw)
        cache, logits = out.past_key_values, out.logits[:, -1, :].float()
        active = list(reqs)
        while active:
            self.stats["decode_steps"] += 1
            tokens, logps, tops = self._sample(logits, active)
            keep = []
            for j, r in enumerate(active):
                r.push(int(tokens[j]), float(logps[j]), tops[j], self.policy_version)
                done = ("stop", None) if r.abandoned else self._finished(r)
                if done is None:
                    keep.append(j)
                else:
                    self.stats["generated_tokens"] += len(r.ids)
                    r.finish(*done, version)
            if not keep:
                break
            if len(keep) < len(active):
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                attn, last_pos, tokens = attn[index], last_pos[index], tokens[index]
                active = [active[j] for j in keep]
            attn = torch.cat([attn, attn.new_ones((len(active), 1))], dim=1)
            last_pos = last_pos + 1
            step_pos = last_pos[:, None]
            if self.vision:
                step_pos = step_pos[None].expand(3, -1, -1)
            out = self.model(input_ids=tokens[:, None], attention_mask=attn,
                             position_ids=step_pos, past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1, :].float()
        logger.debug("batch of %d done in %.3fs", len(reqs), time.perf_counter() - t0)

    # -- continuous batching ------------------------------------------------------------
    def _cb_worker(self) -> None:
        """Admit waiting requests, run one prefill budget and one decode step, repeat."""
        jobs: list[_Prefill] = []
        self._ready: list[tuple[_Request, tuple]] = []  # finished this step, not yet delivered
        config = self.model.config.get_text_config()
        n_layers = len(DynamicCache(config=config).layers)
        slots = Slots(n_layers, config, self.max_batch_size)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or jobs or slots.live
                                  or (self._queue and not self._paused))
                if self._closed:
                    break
                if self._paused and self._preempt and (jobs or slots.live):
                    slots = self._preempt_all(jobs, slots, n_layers, config)
                    continue
                taken = []
                if not self._paused:
                    room = self.max_batch_size - slots.live - sum(len(j.reqs) for j in jobs)
                    while self._queue and room > 0:
                        r = self._queue.pop(0)
                        if not r.abandoned:
                            taken.append(r)
                            room -= 1
                self._busy = True
            self.stats["requests"] += len(taken)
            for r in taken:
                _join_prefill(jobs, r)
            try:
                with torch.inference_mode():
                    if jobs:
                        self._prefill_step(jobs, slots)
                    if slots.live:
                        self._decode_step(slots)
            except BaseException as e:  # noqa: BLE001 - surface every failure to the caller
                logger.exception("generation step failed")
                for r in [r for j in jobs for r in j.reqs] + [r for r in slots.rows if r]:
                    r.fail(e)
                jobs.clear()
                slots = Slots(n_layers, config, self.max_batch_size)
            with self._cv:
                if not jobs and not slots.live:
                    self._busy = False
                    self._cv.notify_all()
            # delivered after the engine's state is settled: a caller whose request was
            # the last sees the engine idle (flush_cache, update_weights) when it resumes
            for r, done in self._ready:
                r.finish(*done, self.policy_version)
            self._ready.clear()
        for r in [r for j in jobs for r in j.reqs] + [r for r in slots.rows if r]:
            r.fail(RuntimeError("engine closed"))

    def _preempt_all(self, jobs: list["_Prefill"], slots: Slots, n_layers: int,
                     config) -> Slots:
        """Partial rollouts (lock held): every running request back to the head of the
        queue, in order, with its tokens so far; its keys/values are dropped (recomputed
        under the new weights). Returns empty slots; the engine is idle."""
        back = [r for j in jobs for r in j.reqs] + [r for r in slots.rows[:slots.used] if r]
        self._queue[:0] = [r for r in back if not r.abandoned]
        self.stats["preempted"] += len(back)
        jobs.clear()
        self._busy = False
        self._cv.notify_all()
        return Slots(n_layers, config, self.max_batch_size)

    def _prefill_step(self, jobs: list["_Prefill"], slots: Slots) -> None:
        """Up to ``prefill_chunk`` prompt tokens of the oldest jobs; a job whose prompt is
        done samples its rows' first tokens and moves them into the decode batch."""
        budget = self.prefill_chunk
        while jobs and budget > 0:
            job = jobs[0]
            job.reqs = [r for r in job.reqs if not r.abandoned]
            if not job.reqs:
                jobs.pop(0)
                continue
            if job.cache is None:
                self._start_prefill(job)
            n = min(budget, len(job.ids) - job.pos)
            chunk = torch.tensor([job.ids[job.pos:job.pos + n]], device=self.device)
            pos = torch.arange(job.pos, job.pos + n, device=self.device)[None]
            out = self.model(input_ids=chunk, position_ids=pos, past_key_values=job.cache,
                             use_cache=True, logits_to_keep=1)
            job.pos += n
            budget -= n
            self.stats["prefilled_tokens"] += n
            if job.pos < len(job.ids):
                continue
            jobs.pop(0)
            self.stats["cached_tokens"] += (len(job.reqs) - 1) * len(job.ids)  # shared it
            layers = job.cache.layers
            if self.prefix is not None:
                self.prefix.insert(job.ids, lambda a, b: torch.stack(
                    [torch.stack((la.keys[0, :, a:b], la.values[0, :, a:b])) for la in layers]))
            kv = [(la.keys[0], la.values[0]) for la in layers]
            self._first_tokens(job.reqs, out.logits[:, -1, :].float(), kv, slots)

    def _start_prefill(self, job: "_Prefill") -> None:
        """A buffer for the job's keys/values, holding its longest cached prefix."""
        job.cache = buffered_cache(self.model, len(job.ids))
        if self.prefix is None:
            return
        path = self.prefix.match(job.ids, limit=len(job.ids) - 1)  # the last one gives logits
        kv = PrefixCache.gather(path)
        if kv is None:
            return
        for i, layer in enumerate(job.cache.layers):
            layer.update(kv[i, 0][None], kv[i, 1][None])
        job.pos = kv.shape[3]
        self.stats["cached_tokens"] += job.pos

    def _first_tokens(self, reqs: list[_Request], logits: torch.Tensor, kv, slots: Slots) -> None:
        """Each request's first token from its prompt's logits; the unfinished ones join
        the decode batch with a copy of the prompt's keys/values."""
        tokens, logps, tops = self._sample(logits.expand(len(reqs), -1), reqs)
        for j, r in enumerate(reqs):
            r.push(int(tokens[j]), float(logps[j]), tops[j], self.policy_version)
            done = self._finished(r)
            if done is not None:
                self._finish(r, done, slots, None)
            else:
                slots.add(kv, r, r.sampling.max_new_tokens - len(r.ids))

    def _decode_step(self, slots: Slots) -> None:
        """One token for every row of the decode batch."""
        self.stats["decode_steps"] += 1
        room = max(r.sampling.max_new_tokens - len(r.ids) for r in slots.rows if r)
        mask, pos = slots.step_inputs(room)
        rows = slots.rows[:slots.used]
        last = torch.tensor([r.ids[-1] if r else self.pad_id for r in rows], device=self.device)
        out = self.model(input_ids=last[:, None], attention_mask=mask, position_ids=pos,
                         past_key_values=slots.cache, use_cache=True)
        slots.advance()
        live = [i for i, r in enumerate(rows) if r is not None]
        reqs = [rows[i] for i in live]
        self.stats["max_rows"] = max(self.stats["max_rows"], len(live))
        index = torch.tensor(live, device=self.device)
        tokens, logps, tops = self._sample(out.logits[index, -1, :].float(), reqs)
        for j, (i, r) in enumerate(zip(live, reqs)):
            r.push(int(tokens[j]), float(logps[j]), tops[j], self.policy_version)
            done = ("stop", None) if r.abandoned else self._finished(r)
            if done is not None:
                self._finish(r, done, slots, i)

    def _finish(self, r: _Request, done, slots: Slots, slot: int | None) -> None:
        """``r`` is done (delivered at the end of the step); cache its keys/values
        (prompt and all but the last sampled token) and free its slot."""
        self.stats["generated_tokens"] += len(r.ids)
        if slot is not None:
            if self.prefix is not None and not r.abandoned:
                ids = r.prompt_ids + r.ids[:-1]
                self.prefix.insert(ids, lambda a, b: slots.kv_of(slot, a, b))
            slots.free(slot)
        self._ready.append((r, done))

    def _sample(self, logits: torch.Tensor, reqs: list[_Request]):
        """Sample one token per row; return (tokens (B,), logprobs (B,), tops): a row's
        ``sampling.top_logprobs`` likeliest ``(id, logprob)`` (None when it asks for none)."""
        if self._never:
            from agentgym.models.vision import suppress_vision_tokens
            suppress_vision_tokens(logits, self._never)
        temps = torch.tensor([r.sampling.temperature or 1.0 for r in reqs],
                             device=logits.device)[:, None]
        logp = torch.log_softmax(logits / temps, dim=-1)
        # Inverse-CDF sampling, vectorized over rows: each row draws one uniform from its
        # own generator (so a seeded row's tokens do not depend on its batch companions)
        # and takes the first token whose cumulative probability exceeds it.
        probs = logp.exp()
        for j, r in enumerate(reqs):
            if r.sampling.temperature != 0 and (r.sampling.top_p < 1.0 or r.sampling.top_k):
                probs[j] = _truncate(probs[j], r.sampling.top_p, r.sampling.top_k)
        u = torch.stack([torch.rand((), generator=r.generator or self._generator,
                                    device=logits.device) for r in reqs])
        cdf = probs.cumsum(-1)
        tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        tokens = tokens.clamp(max=probs.shape[-1] - 1)
        greedy = torch.tensor([r.sampling.temperature == 0 for r in reqs], device=logits.device)
        tokens = torch.where(greedy, logp.argmax(-1), tokens)
        k = max(r.sampling.top_logprobs for r in reqs)
        tops: list = [None] * len(reqs)
        if k:
            values, ids = (t.tolist() for t in logp.topk(k, dim=-1))
            tops = [list(zip(ids[j], values[j]))[:r.sampling.top_logprobs]
                    if r.sampling.top_logprobs else None for j, r in enumerate(reqs)]
        return tokens, logp.gather(1, tokens[:, None])[:, 0], tops

    def _finished(self, r: _Request) -> tuple[str, str | None] | None:
        last = r.ids[-1]
        if last in self.eos_ids:
            return "stop", self.tokenizer.convert_ids_to_tokens(last)
        if r.sampling.stop:
            tail = self._decode(r.ids[-_STOP_WINDOW:])
            for s in r.sampling.stop:
                if s in tail:
                    return "stop", s
        if len(r.ids) >= r.sampling.max_new_tokens:
            return "length", None
        return None


@dataclass
class _Prefill:
    """Requests with the same prompt ids, prefilled once."""

    ids: list[int]
    reqs: list[_Request]
    cache: DynamicCache | None = None
    pos: int = 0  # prompt positions already in ``cache``


def _join_prefill(jobs: list[_Prefill], r: _Request) -> None:
    ids = r.context_ids  # the prompt, and the tokens so far of an interrupted request
    for job in jobs:
        if job.ids == ids:
            job.reqs.append(r)
            return
    jobs.append(_Prefill(ids, [r]))


def _why_static(model, vision: bool) -> str | None:
    """Why this model cannot use continuous batching / the prefix cache (None: it can)."""
    if vision:
        return ("a vision-language model: image tokens share one id whatever the image, "
                "and its positions are 3-D (M-RoPE)")
    cache = DynamicCache(config=model.config.get_text_config())
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        kinds = sorted({type(layer).__name__ for layer in cache.layers})
        return f"the model's cache has layers other than full attention ({', '.join(kinds)})"
    return None


def _truncate(probs: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Zero out tokens outside top-k / the top-p nucleus (probs of one row)."""
    if top_k and top_k < probs.numel():
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = sorted_p.cumsum(0)
        drop = cum - sorted_p > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p[drop] = 0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    return probs


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
