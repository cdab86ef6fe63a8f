"""A request in :class:`~agentgym.rollout.engines.hf.HFEngine`'s queue, and how its tokens
reach the caller: the worker thread samples, the caller's event loop receives (its future
at the end and, when streaming, each token on a queue as it is sampled). A caller that
went away (cancelled, or its loop closed) is noticed, so its row stops decoding."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from agentgym.core.types import GenerateOutput, SamplingParams


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    seed: int = 0  # the counter-based draw's seed (agentgym.rollout.engines.sampler)
    images: Any = None  # agentgym.models.vision.VisionInputs (VL models)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    pieces: asyncio.Queue | None = None  # streaming: each token, then None at the end
    versions: list[int] = field(default_factory=list)  # per token, the weights that sampled it
    tail: str = ""  # the text of the last tokens, where a stop string would show
    closed: bool = False  # finished (its result on the way): nothing more is pushed
    longest_stop: int = field(init=False)  # characters of the longest stop string

    def __post_init__(self) -> None:
        self.longest_stop = max(map(len, self.sampling.stop or ()), default=0)

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


class StopCheck:
    """Whether a request is done after its last token: an EOS id, a stop string, or its
    ``max_new_tokens``. Stop strings are found incrementally: each token's text is looked
    up once per id and appended to the request's tail, and only a match that ends in the
    new token's text is looked for (the earlier text was checked already). A tokenizer
    whose per-token texts do not concatenate to its decoded text (one that strips or
    merges at boundaries), and any token whose text is a partial UTF-8 character, falls
    back to decoding the request's last tokens."""

    WINDOW = 32  # tokens decoded on the fallback (each token is >= 1 character)

    def __init__(self, tokenizer, eos_ids: set[int]) -> None:
        import functools
        self.tokenizer, self.eos_ids = tokenizer, eos_ids
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode = (functools.partial(backend.decode, skip_special_tokens=False)
                        if backend is not None else
                        functools.partial(tokenizer.decode, skip_special_tokens=False))
        self._pieces: dict[int, str] = {}
        probe = tokenizer.encode("a stop: </tag> ok\n", add_special_tokens=False)
        self.incremental = "".join(self._piece(i) for i in probe) == self._decode(probe)

    def _piece(self, token: int) -> str:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._decode([token])
        return piece

    def __call__(self, r: _Request) -> tuple[str, str | None] | None:
        last = r.ids[-1]
        if last in self.eos_ids:
            return "stop", self.tokenizer.convert_ids_to_tokens(last)
        if r.sampling.stop:
            found = self._stop_string(r, last)
            if found is not None:
                return "stop", found
        if len(r.ids) >= r.sampling.max_new_tokens:
            return "length", None
        return None

    def _stop_string(self, r: _Request, last: int) -> str | None:
        piece = self._piece(last)
        if not self.incremental or "\ufffd" in piece:
            r.tail = self._decode(r.ids[-self.WINDOW:])[-(r.longest_stop + self.WINDOW):]
            return next((s for s in r.sampling.stop if s in r.tail), None)
        if not piece:  # nothing new to end a match in
            return None
        n = len(piece)
        tail = r.tail = (r.tail + piece)[-(r.longest_stop + n):]
        for s in r.sampling.stop:  # a match must end inside the new piece
            if s in tail[-(len(s) + n - 1):]:
                return s
        return None
