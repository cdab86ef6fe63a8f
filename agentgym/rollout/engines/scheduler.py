"""Continuous batching: each step, a batched prefill of waiting prompts and one decode step
of every running request (nano-vllm's scheduler and the loop's body).

Requests whose context ids are equal (the n samples of a group) form one prefill
:class:`Job`. Jobs are prefilled in a staging pool, several at once as one padded batch
of up to ``prefill_tokens`` tokens (a long prompt in chunks, so it never stalls the rows
already decoding for long); a job's longest cached prefix is copied in instead of
computed. When its prompt is done, each request samples its first token and, unless
already finished, moves into the decode pool (a copy of the prompt's keys/values), where
one step decodes all rows together. A row leaves the moment it is finished; its keys and
values go to the prefix cache.

Per step the host does one copy from the device (the sampled ids and logprobs, and the
alternatives when asked for); rows' sampling settings and inputs live on the device
(:mod:`~agentgym.rollout.engines.decode_rows`) and are rebuilt only when rows join or
leave. The requests whose prompts finish in a prefill pass draw their first tokens in one
sample with one copy to the host, and a job's requests join the decode pool with one copy
of its keys/values.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from agentgym.rollout.engines.decode_rows import DecodeRows, results
from agentgym.rollout.engines.hf_request import StopCheck, _Request
from agentgym.rollout.engines.kv_pool import KVPool
from agentgym.rollout.engines.model_runner import ModelRunner
from agentgym.rollout.engines.prefix_cache import PrefixCache
from agentgym.rollout.engines.sampler import RowParams, sample


@dataclass
class Job:
    """Requests with the same context ids, prefilled once in staging slot ``slot``."""

    ids: list[int]
    reqs: list[_Request]
    slot: int | None = None
    pos: int = 0  # context positions already in the slot


@dataclass
class _Step:
    """A decode step in flight: its rows as launched, their results on the way."""

    reqs: list[_Request]
    host: torch.Tensor  # (B, 2 + 2K): ids, logprobs, K alternatives' logprobs and ids
    event: object | None  # the GPU event that ends the copy (None on the CPU: done)


@dataclass
class Scheduler:
    """The continuous batch: prefill jobs, decode rows, and what finished this step."""

    runner: ModelRunner
    staging: KVPool
    decode: KVPool
    prefix: PrefixCache | None
    stops: StopCheck
    stats: dict
    max_rows: int
    prefill_tokens: int
    vocab: int
    version: int = 0
    jobs: list[Job] = field(default_factory=list)
    ready: list[tuple[_Request, tuple]] = field(default_factory=list)
    _rows: DecodeRows | None = None  # None: rows joined or left since the last step
    _inflight: _Step | None = None

    def __post_init__(self) -> None:
        self.decoder = DecodeRows(self.runner, self.vocab)

    @property
    def busy(self) -> bool:
        return bool(self.jobs or self.decode.live or self._inflight)

    def room(self) -> int:
        """Requests that can still be admitted."""
        return self.max_rows - self.decode.live - sum(len(j.reqs) for j in self.jobs)

    def admit(self, r: _Request) -> None:
        ids = r.context_ids  # the prompt, and the tokens so far of an interrupted request
        self.stats["requests"] += 1
        for job in self.jobs:
            if job.ids == ids:
                job.reqs.append(r)
                return
        self.jobs.append(Job(ids, [r]))

    def step(self) -> None:
        """One prefill (if prompts wait) and one decode step (if rows run)."""
        if self.jobs:
            self._prefill()
        if self.decode.live:
            self._decode()
        else:
            self.drain()

    def running(self) -> list[_Request]:
        return [r for j in self.jobs for r in j.reqs] + list(self.decode.rows)

    def clear(self) -> None:
        """Drop every job and row (their requests are the caller's to requeue or fail)."""
        self.jobs.clear()
        self._inflight = None
        self.staging.clear()
        self.decode.clear()
        if self.runner.graphs:
            self.decoder.reset()
        self._rows = None
        self.staging.release()
        self.decode.release()

    # -- prefill ------------------------------------------------------------------------
    def _prefill(self) -> None:
        chunks = self._chunks()
        if not chunks:
            return
        width = max(n for _, n in chunks)
        self.stats["prefill_passes"] += 1
        device = self.runner.device
        ids = torch.zeros((len(chunks), width), dtype=torch.long)
        positions = torch.zeros((len(chunks), width), dtype=torch.long)
        valid = torch.zeros((len(chunks), width), dtype=torch.bool)
        for i, (job, n) in enumerate(chunks):
            ids[i, :n] = torch.tensor(job.ids[job.pos:job.pos + n])
            positions[i, :n] = torch.arange(job.pos, job.pos + n)
            valid[i, :n] = True
        last = valid.sum(1) - 1
        columns = max(job.pos + n for job, n in chunks)
        slots = torch.tensor([job.slot for job, _ in chunks])
        logits = self.runner.prefill(ids.to(device), positions.to(device), valid.to(device),
                                     slots.to(device), last.to(device), columns, self.staging)
        done = []
        for i, (job, n) in enumerate(chunks):
            job.pos += n
            self.stats["prefilled_tokens"] += n
            if job.pos == len(job.ids):
                done.append((job, i))
        if done:
            self._first_tokens(done, logits)
        for job, _ in sorted(done, key=lambda d: -d[0].slot):
            self.jobs.remove(job)
            self._free_staging(job.slot)

    def _chunks(self) -> list[tuple[Job, int]]:
        """This step's (job, tokens) pairs, the oldest job first. The padded batch is as
        wide as its longest chunk (a job longer than the budget goes in chunks of the
        budget); each later job joins when the batch, widened to its chunk, still fits the
        budget, and one that does not leaves room for a shorter one after it. So a short
        job at the head neither chops the others into its width nor holds them back."""
        chunks: list[tuple[Job, int]] = []
        width = 0
        for job in list(self.jobs):
            job.reqs = [r for r in job.reqs if not r.abandoned]
            if not job.reqs:
                self.jobs.remove(job)
                if job.slot is not None:
                    self._free_staging(job.slot)
                continue
            # before its start the job's cached prefix is unknown: its whole length bounds it
            n = min(self.prefill_tokens, len(job.ids) - job.pos)
            if chunks and (len(chunks) + 1) * max(width, n) > self.prefill_tokens:
                continue
            if job.slot is None:
                self._start(job)
                n = min(self.prefill_tokens, len(job.ids) - job.pos)
            chunks.append((job, n))
            width = max(width, n)
        return chunks

    def _start(self, job: Job) -> None:
        """A staging slot for the job, holding its longest cached prefix."""
        job.slot = self.staging.add(job, len(job.ids))
        if self.prefix is None:
            return
        path = self.prefix.match(job.ids, limit=len(job.ids) - 1)  # the last gives logits
        kv = PrefixCache.gather(path)
        if kv is not None:
            self.staging.put(job.slot, kv)
            job.pos = kv.shape[3]
            self.stats["cached_tokens"] += job.pos

    def _free_staging(self, slot: int) -> None:
        moved = self.staging.remove(slot)
        if moved is not None:
            moved.slot = slot

    def _first_tokens(self, done: list[tuple[Job, int]], logits: torch.Tensor) -> None:
        """Each request's first token from its prompt's logits (row ``i`` of ``logits``
        for a ``(job, i)`` of ``done``), all in one sample and one copy to the host; the
        unfinished ones join the decode rows with one copy of their prompt's keys/values
        per job."""
        reqs = [r for job, _ in done for r in job.reqs]
        rows = torch.tensor([i for job, i in done for _ in job.reqs], device=logits.device)
        tokens, logps, top = sample(logits.index_select(0, rows), self._params(reqs))
        drawn = iter(_host(tokens, logps, top, reqs))
        for job, _ in done:
            n = len(job.ids)
            self.stats["cached_tokens"] += (len(job.reqs) - 1) * n  # the group shared it
            if self.prefix is not None:
                slot = job.slot
                self.prefix.insert(job.ids, lambda a, b: self.staging.kv_of(slot, a, b))
            joined, slots = [], []
            for _ in job.reqs:
                r, token, logp, alt = next(drawn)
                r.push(token, logp, alt, self.version)
                finished = self.stops(r)
                if finished is not None:
                    self._finish(r, finished)
                    continue
                joined.append(r)
                slots.append(self.decode.add(r, n))
            if joined:
                # the pool appends: the joined slots are consecutive
                self.decode.copy_from(self.staging, job.slot, slots[0], n, len(slots))
                if self.runner.graphs:  # on the device, behind the step in flight
                    self.decoder.join(slots, joined, [r.ids[-1] for r in joined],
                                       [n] * len(joined))
                else:
                    self._rows = None

    # -- decode -------------------------------------------------------------------------
    def _decode(self) -> None:
        """Launch a decode step, then take in the previous step's results while this one
        computes (on a GPU the host's work overlaps the device's). A row that finished in
        the previous step has computed one token more in this one: it is dropped."""
        pool = self.decode
        if self.runner.graphs:  # the rows changed in place on the device
            self._rows = self.decoder
        elif self._rows is None:  # rows joined or left: their last tokens must be known
            self.stats["rows_rebuilt"] += 1
            self.drain()
            if not pool.live:
                return
            self._rows = self._rebuild()
        t0 = time.perf_counter()
        self.stats["decode_steps"] += 1
        self.stats["max_rows"] = max(self.stats["max_rows"], pool.live)
        columns = max(pool.length) + 1
        pool.ensure(pool.live, columns)
        step = _Step(list(pool.rows), *self._rows.step(columns))
        pool.length[:] = [n + 1 for n in pool.length]
        self.stats["forward_s"] += time.perf_counter() - t0
        self.drain()
        self._inflight = step
        if not pool.live:  # every row finished: the step just launched serves nobody, and
            self.drain()   # the engine is idle before the last caller hears of its result

    def drain(self) -> None:
        """Take in the step in flight: push each row's token, finish the rows that are
        done (their keys/values to the prefix cache, their slots freed)."""
        step, self._inflight = self._inflight, None
        if step is None:
            return
        t0 = time.perf_counter()
        if step.event is not None:
            step.event.synchronize()
        t1 = time.perf_counter()
        finished = []
        for r, (token, logp, alt) in zip(step.reqs, _rows_of(step.host.tolist(), step.reqs)):
            if r.closed:  # finished a step earlier: this token is beyond its end
                continue
            r.push(int(token), logp, alt, self.version)
            done = ("stop", None) if r.abandoned else self.stops(r)
            if done is not None:
                finished.append((r, done))
        pool = self.decode
        slots = {id(r): i for i, r in enumerate(pool.rows)}
        for r, done in sorted(finished, key=lambda f: -slots[id(f[0])]):  # last slots first
            slot = slots[id(r)]
            if self.prefix is not None and not r.abandoned:
                self.prefix.insert(r.prompt_ids + r.ids[:-1],
                                   lambda a, b, s=slot: pool.kv_of(s, a, b))
            pool.remove(slot)
            if self.runner.graphs:
                self.decoder.leave(slot)
            else:
                self._rows = None
            self._finish(r, done)
        self.stats["forward_s"] += t1 - t0
        self.stats["host_s"] += time.perf_counter() - t1

    def _rebuild(self) -> DecodeRows:
        reqs = self.decode.rows
        self.decoder.start([r.ids[-1] for r in reqs], list(self.decode.length),
                            self._params(reqs))
        return self.decoder

    def _params(self, reqs: list[_Request]) -> RowParams:
        return RowParams.build([r.sampling for r in reqs], [r.seed for r in reqs],
                               [len(r.ids) for r in reqs], self.vocab, self.runner.device)

    def _finish(self, r: _Request, done: tuple) -> None:
        """Delivered at the end of the step, once the engine's state is settled."""
        r.closed = True
        self.stats["generated_tokens"] += len(r.ids)
        self.ready.append((r, done))


def _host(tokens: torch.Tensor, logps: torch.Tensor, top, reqs: list[_Request]):
    """``(request, token, logprob, alternatives)`` per row, from one copy to the host."""
    rows = results(tokens, logps, top).cpu().tolist()
    return [(r, *row) for r, row in zip(reqs, _rows_of(rows, reqs))]


def _rows_of(rows: list[list[float]], reqs: list[_Request]):
    """``(token, logprob, alternatives or None)`` per request, from the rows of a step's
    ``(B, 2 + 2K)`` results (token, logprob, K alternatives' logprobs, their ids)."""
    for row, r in zip(rows, reqs):
        k, want = (len(row) - 2) // 2, r.sampling.top_logprobs
        alts = None
        if want:
            alts = [(int(i), v) for v, i in zip(row[2:2 + k], row[2 + k:])][:want]
        yield int(row[0]), row[1], alts
