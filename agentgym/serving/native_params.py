"""What ``agentgym serve``'s native ``/generate`` accepts: SGLang's ``sampling_params``
made our :class:`~agentgym.core.types.SamplingParams`, and token ids checked against the
vocabulary. A bad value is a :class:`BadRequest` (the server's 400) that names it and what
is valid."""

from __future__ import annotations

from typing import Any

from agentgym.core.types import SamplingParams

#: ``sampling_params`` keys this server honours; SGLang has more (penalties, grammars...).
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop", "sampling_seed",
                 "n", "no_stop_trim", "ignore_eos", "skip_special_tokens",
                 "spaces_between_special_tokens")


class BadRequest(ValueError):
    """A request the server refuses (400), with a message naming the bad value."""


def parse_sampling(params: Any, *,
                   allow_stop: bool) -> tuple[SamplingParams, int, bool, bool]:
    """SGLang ``sampling_params`` → (our SamplingParams, n, no_stop_trim,
    skip_special_tokens); the last two only shape ``text``.

    Defaults are SGLang's (``max_new_tokens`` 128, temperature 1, top-p 1, top-k off);
    an unknown or unsupported key is a :class:`BadRequest`.
    """
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadRequest(f"sampling_params must be an object, got {type(params).__name__}")
    unknown = sorted(set(params) - set(SAMPLING_KEYS))
    if unknown:
        raise BadRequest(f"sampling_params {unknown} not supported by agentgym serve; "
                         f"supported: {', '.join(SAMPLING_KEYS)}")
    p = {k: v for k, v in params.items() if v is not None}
    if p.get("ignore_eos"):
        raise BadRequest("sampling_params.ignore_eos=true is not supported by agentgym serve")
    top_k = p.get("top_k", -1)
    if not isinstance(top_k, int) or (top_k < 1 and top_k != -1):
        raise BadRequest(f"sampling_params.top_k={top_k!r}: must be -1 (disable) or at least 1")
    stop = p.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if stop and not allow_stop:
        raise BadRequest("sampling_params.stop needs the server's tokenizer, and this server "
                         "runs with --skip-tokenizer-init; stop on the client side instead")
    if not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"sampling_params.stop={stop!r}: must be a non-empty string or a "
                         "list of them")
    n = p.get("n", 1)
    if not isinstance(n, int) or n < 1:
        raise BadRequest(f"sampling_params.n={n!r}: must be an integer >= 1")
    temperature = float(p.get("temperature", 1.0))
    if 0 <= temperature < 1e-6:  # SGLang's greedy
        temperature = 0.0
    try:
        sampling = SamplingParams(max_new_tokens=int(p.get("max_new_tokens", 128)),
                                  temperature=temperature, top_p=float(p.get("top_p", 1.0)),
                                  top_k=0 if top_k == -1 else top_k, stop=tuple(stop),
                                  seed=p.get("sampling_seed"))
    except (TypeError, ValueError) as e:
        raise BadRequest(f"sampling_params: {e}") from None
    return (sampling, n, bool(p.get("no_stop_trim", False)),
            bool(p.get("skip_special_tokens", True)))


def check_ids(ids: Any, vocab: int, where: str) -> list[int]:
    """``ids`` (a request's ``where``) when it is a non-empty list of ids in the vocabulary."""
    if not isinstance(ids, list) or not ids:
        raise BadRequest(f"{where} must be a non-empty list of token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRequest(f"{where} must hold integers only")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise BadRequest(f"{where} holds ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    return ids
