"""``agentgym serve``'s answer to SGLang's prompt-scoring request: ``/generate`` with
``max_new_tokens: 0``, ``return_logprob`` and ``logprob_start_len`` >= 0 generates nothing
and returns ``meta_info.input_token_logprobs`` (``[[logprob, id, null], ...]`` from the
start on, the first token's logprob null), at the request's temperature (1 when 0 or
absent): what a teacher behind an endpoint answers for on-policy distillation
(:mod:`agentgym.trainers.distill_endpoint`)."""

from __future__ import annotations

import uuid
from typing import Any

import torch


def start_of(body: dict, bad) -> int:
    """``logprob_start_len`` (-1, SGLang's default: output tokens only); ``bad``: the 400."""
    start = body.get("logprob_start_len")
    start = -1 if start is None else start
    if not isinstance(start, int) or start < -1:
        raise bad(f"logprob_start_len={start!r}: must be -1 (output tokens only) or a "
                  f"position in the prompt")
    return start


def is_scoring(body: dict, start: int) -> bool:
    """Whether a ``/generate`` body asks only for its prompt's logprobs."""
    params = body.get("sampling_params")
    params = params if isinstance(params, list) else [params]
    return (bool(body.get("return_logprob")) and start >= 0
            and all(isinstance(p, dict) and p.get("max_new_tokens") == 0 for p in params))


def temperatures(prompts: list[list[int]], params: Any, start: int, bad) -> list[float]:
    """Each prompt's temperature, checked with the start (``bad``: the 400 to raise)."""
    temps = []
    for p in (params if isinstance(params, list) else [params] * len(prompts)):
        t = float((p or {}).get("temperature", 1.0) or 1.0)
        if t < 0:
            raise bad(f"sampling_params.temperature={t}: must be >= 0")
        temps.append(t)
    if len(temps) != len(prompts):
        raise bad(f"sampling_params is a list of {len(temps)} for {len(prompts)} prompts")
    for i, ids in enumerate(prompts):
        if start >= len(ids):
            raise bad(f"logprob_start_len={start} is past prompt {i}'s {len(ids)} tokens")
    return temps


@torch.no_grad()
def prompt_logprobs(model, prompts: list[list[int]], temps: list[float]) -> list[list[float]]:
    """Per prompt, the log-prob of each token given those before it (position 0: 0.0),
    from ``model``'s logits divided by the prompt's temperature."""
    device = next(model.parameters()).device
    out = []
    for ids, t in zip(prompts, temps):
        x = torch.tensor([ids], device=device)
        logits = model(input_ids=x).logits[0, :-1].float() / t
        lp = torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0]
        out.append([0.0] + lp.cpu().tolist())
    return out


def answers(prompts: list[list[int]], rows: list[list[float]], start: int, version: int,
            with_text: bool) -> list[dict]:
    """SGLang's answer per prompt: no output, the prompt's logprobs from ``start`` on."""
    out = []
    for ids, lps in zip(prompts, rows):
        meta = {"id": uuid.uuid4().hex, "finish_reason": {"type": "length", "length": 0},
                "prompt_tokens": len(ids), "completion_tokens": 0, "cached_tokens": 0,
                "weight_version": version, "output_token_logprobs": [],
                "input_token_logprobs": [[None if j == 0 else lps[j], t, None]
                                         for j, t in enumerate(ids) if j >= start]}
        out.append({"output_ids": [], "meta_info": meta, **({"text": ""} if with_text else {})})
    return out
