"""Core data types shared by envs, tools, rollout and trainers (no torch here).

The one definition of the loss mask lives in :class:`Trajectory`: ``loss_mask[i] == 1``
exactly when token ``i`` was sampled by the policy. Prompt tokens, observation tokens,
chat-template filler and any EOS that was *appended* (rather than sampled) are 0.
Every consumer (policy loss, KL, entropy, value loss, GAE, length metrics) reads the
same mask; nothing recomputes it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]
#: ``played``: an action of a demonstration kept in the context but not learned (a wrong
#: step shown so that the recovery after it is learned; :mod:`agentgym.data.demos`)
SegmentKind = Literal["prompt", "generated", "played", "observation", "filler"]

#: Segment kinds whose tokens the policy sampled (mask 1). Everything else is mask 0.
SAMPLED_KINDS = ("generated",)


def message(role: str, content: Any) -> dict:
    """A chat message as a plain dict (``{"role", "content"}``), the form envs return.

    Content is a string, or for vision-language envs a list of parts
    (``{"type": "text", "text": ...}`` / ``{"type": "image", "image": ...}``).
    """
    if role not in ("system", "user", "assistant", "tool"):
        raise ValueError(f"message role {role!r} is not one of system/user/assistant/tool")
    return {"role": role, "content": content}


@dataclass
class Segment:
    """A contiguous run of tokens ``[start, end)`` of one kind, produced by one turn."""

    kind: SegmentKind
    start: int
    end: int
    turn: int

    def __len__(self) -> int:
        return self.end - self.start


#: turn k of an episode samples with seed ``seed + SEED_STRIDE * k`` (a prime, so the turns
#: of episodes whose seeds are near draw apart); a summary turn strides by another prime
SEED_STRIDE, SUMMARY_SEED_STRIDE = 7919, 104729


@dataclass
class SamplingParams:
    """Per-request sampling settings understood by every rollout engine.

    ``temperature == 0`` means greedy. Returned logprobs are always those of the
    temperature-scaled distribution ``log_softmax(logits / max(temperature, eps))``
    *before* top-p/top-k truncation, i.e. what a trainer recomputes with a plain
    forward pass (greedy uses temperature 1 for the logprob).
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_logprobs: int = 0  # also return each position's k likeliest (id, logprob)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        self.stop = tuple(self.stop)

    @classmethod
    def for_turn(cls, rollout, max_new_tokens: int, seed: int, turn: int, *,
                 stop: tuple[str, ...] = (), greedy: bool = False, top_logprobs: int = 0,
                 stride: int = SEED_STRIDE) -> "SamplingParams":
        """An episode's ``turn`` under a ``RolloutConfig``: its temperature (0 when
        ``greedy``), top-p and top-k, at most ``max_new_tokens``, seeded ``seed + stride *
        turn`` so each turn of each episode draws its own numbers. The one builder for the
        manager and the served agents; the HTTP endpoints build theirs from the request."""
        return cls(max_new_tokens=max_new_tokens,
                   temperature=0.0 if greedy else rollout.temperature, top_p=rollout.top_p,
                   top_k=rollout.top_k, stop=stop, seed=(seed + stride * turn) % 2**31,
                   top_logprobs=top_logprobs)


@dataclass
class GenerateOutput:
    """What an engine returns for one request: the sampled ids and their logprobs.

    ``finish_reason`` is ``"stop"`` (EOS token or a stop string was produced) or
    ``"length"`` (``max_new_tokens`` reached). ``ids`` are exactly what was sampled.
    """

    ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    stop_reason: str | None = None  # the EOS token text or the stop string that matched
    policy_version: int | None = None  # weights that sampled these ids (None: not stamped)
    #: per position, the ``sampling.top_logprobs`` likeliest ``(id, logprob)`` (None: not asked)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    #: per position, the weights' version that sampled it (a partial rollout spans several;
    #: None: all ``policy_version``)
    token_versions: list[int] | None = None

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.logprobs):
            raise ValueError(f"{len(self.ids)} ids but {len(self.logprobs)} logprobs")


@dataclass
class Trajectory:
    """One episode as token ids, with the loss mask and the rollout logprobs.

    Attributes:
        token_ids: prompt followed by the response (generated, observation, filler),
            shape ``(len,)``.
        loss_mask: 1 for tokens the policy sampled, else 0; same length.
        logprobs: the engine's logprob for each sampled token, 0.0 where mask is 0.
        prompt_length: number of leading prompt tokens.
        segments: contiguous token runs with their kind and turn index.
        reward: scalar episode reward (sum of the env's step rewards).
        policy_version: version of the (oldest) weights that generated the sampled tokens.
        terminated / truncated: the env answered / a turn or token budget ran out.
        uid: prompt identifier shared by the ``n`` samples of one prompt (GRPO groups).
        metrics: per-trajectory counters (turns, tool_calls, tool_failures, ...).
    """

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_length: int = 0
    segments: list[Segment] = field(default_factory=list)
    reward: float = 0.0
    step_rewards: list[float] = field(default_factory=list)
    policy_version: int = 0
    terminated: bool = False
    truncated: bool = False
    uid: str = ""
    sample_index: int = 0
    data_source: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    #: the policy version that sampled each turn (asynchronous training lets a weight
    #: update land between turns; ``policy_version`` is then the oldest of them)
    turn_versions: list[int] = field(default_factory=list)
    #: per sampled token, in order, the policy version that sampled it (partial rollouts:
    #: a turn interrupted by a weight update goes on under the new weights)
    token_versions: list[int] = field(default_factory=list)
    #: processed images of the prompt (:class:`agentgym.models.vision.VisionInputs`), for VL
    #: models; not written by :meth:`to_dict` (only their grid sizes are)
    images: Any = None

    # -- building ---------------------------------------------------------------------
    def append(self, kind: SegmentKind, ids: list[int], turn: int,
               logprobs: list[float] | None = None) -> None:
        """Append a segment; the mask and logprobs follow from its kind."""
        if not ids:
            return
        sampled = kind in SAMPLED_KINDS
        if sampled:
            if logprobs is None or len(logprobs) != len(ids):
                raise ValueError(f"sampled segment of {len(ids)} ids needs as many logprobs, "
                                 f"got {None if logprobs is None else len(logprobs)}")
        elif logprobs is not None:
            raise ValueError(f"a {kind!r} segment is not sampled and carries no logprobs")
        start = len(self.token_ids)
        self.token_ids.extend(int(i) for i in ids)
        self.loss_mask.extend([1 if sampled else 0] * len(ids))
        self.logprobs.extend(float(x) for x in logprobs) if sampled else \
            self.logprobs.extend([0.0] * len(ids))
        if kind == "prompt":
            if start != 0:
                raise ValueError("the prompt segment must come first")
            self.prompt_length = len(ids)
        self.segments.append(Segment(kind, start, len(self.token_ids), turn))

    # -- reading ----------------------------------------------------------------------
    @property
    def response_length(self) -> int:
        return len(self.token_ids) - self.prompt_length

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)

    def sampled_ids(self) -> list[int]:
        """The masked-in token ids, in order (what the policy produced)."""
        return [t for t, m in zip(self.token_ids, self.loss_mask) if m]

    def check(self) -> None:
        """Raise ``ValueError`` if lengths, mask or segments are inconsistent."""
        n = len(self.token_ids)
        if not (n == len(self.loss_mask) == len(self.logprobs)):
            raise ValueError(f"length mismatch: {n} ids, {len(self.loss_mask)} mask, "
                             f"{len(self.logprobs)} logprobs")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask must hold only 0 and 1")
        pos = 0
        for seg in self.segments:
            if seg.start != pos or seg.end <= seg.start:
                raise ValueError(f"segments must tile the sequence; bad segment {seg}")
            want = 1 if seg.kind in SAMPLED_KINDS else 0
            if any(m != want for m in self.loss_mask[seg.start:seg.end]):
                raise ValueError(f"mask inside {seg} is not {want}")
            pos = seg.end
        if pos != n:
            raise ValueError(f"segments cover {pos} of {n} tokens")
        if any(m == 0 and lp != 0.0 for m, lp in zip(self.loss_mask, self.logprobs)):
            raise ValueError("logprobs must be 0.0 where loss_mask is 0")

    def to_dict(self) -> dict:
        images, self.images = self.images, None
        try:
            d = dataclasses.asdict(self)
        finally:
            self.images = images
        d["segments"] = [[s.kind, s.start, s.end, s.turn] for s in self.segments]
        d.pop("images")
        if images is not None:
            d["image_grid_thw"] = images.image_grid_thw.tolist()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Trajectory":
        d = dict(d)
        d["segments"] = [Segment(*s) for s in d.get("segments", [])]
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})
