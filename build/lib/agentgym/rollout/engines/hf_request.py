"""A request in :class:`~agentgym.rollout.engines.hf.HFEngine`'s queue, and how its tokens
reach the caller: the worker thread samples, the caller's event loop receives (its future
at the end and, when streaming, each token on a queue as it is sampled). A caller that
went away (cancelled, or its loop closed) is noticed, so its row stops decoding."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import torch

from agentgym.core.types import GenerateOutput, SamplingParams


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    generator: torch.Generator | None = None
    images: Any = None  # agentgym.models.vision.VisionInputs (VL models)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    pieces: asyncio.Queue | None = None  # streaming: each token, then None at the end
    versions: list[int] = field(default_factory=list)  # per token, the weights that sampled it

    @property
    def context_ids(self) -> list[int]:
        """What the next token is conditioned on: the prompt and the tokens so far (a
        request interrupted by a weight update is prefilled again from these)."""
        return self.prompt_ids + self.ids

    def push(self, token: int, logprob: float, top: list[tuple[int, float]] | None,
             version: int = 0) -> None:
        """One sampled token (and its alternatives, when asked for); streamed if asked."""
        self.ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if top is not None:
            self.tops.append(top)
        if self.pieces is not None:
            self._deliver(_put, self.pieces, (token, logprob, top))

    @property
    def abandoned(self) -> bool:
        """The caller is gone (cancelled, or its event loop closed): stop decoding it."""
        return self.future.done() or self.loop.is_closed()

    def finish(self, reason: str, stop_reason: str | None, version: int | None = None) -> None:
        mixed = len(set(self.versions)) > 1
        out = GenerateOutput(self.ids, self.logprobs, reason, stop_reason,  # type: ignore[arg-type]
                             min(self.versions) if mixed else version,
                             self.tops if self.sampling.top_logprobs else None,
                             list(self.versions) if mixed else None)
        self._deliver(_set_result, self.future, out)
        if self.pieces is not None:
            self._deliver(_put, self.pieces, None)

    def fail(self, exc: BaseException) -> None:
        self._deliver(_set_exception, self.future, exc)
        if self.pieces is not None:
            self._deliver(_put, self.pieces, None)

    def _deliver(self, fn, target, value) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, target, value)
        except RuntimeError:  # the caller's loop closed meanwhile; nobody is waiting
            pass


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _put(queue: asyncio.Queue, item: Any) -> None:
    queue.put_nowait(item)
