"""A teacher behind an endpoint (``trainer.teacher=http://host:port``): SGLang's native
``/generate`` asked for the log-probs of the prompt and nothing generated, the way a 7B
teacher beside a GPU trainer is usually run; ``agentgym serve`` answers the same request
(:mod:`agentgym.serving.serve`).

The request, one per batch: ``{"input_ids": [[...], ...], "sampling_params":
{"max_new_tokens": 0, "temperature": T}, "return_logprob": true, "logprob_start_len": 0}``;
each answer's ``meta_info.input_token_logprobs`` is ``[[logprob, token_id, text], ...]``
over the whole sequence, the first logprob ``null`` (no token precedes it).
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from pathlib import Path

import torch

from agentgym.trainers.batch import Batch

logger = logging.getLogger(__name__)


def _post(url: str, body: dict, timeout_s: float):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"the teacher at {url} answered {e.code}: "
                           f"{e.read().decode(errors='replace')[:500]}") from e
    except (urllib.error.URLError, OSError) as e:
        raise RuntimeError(f"the teacher at {url} cannot be reached ({e}); is it serving? "
                           f"(trainer.teacher=http://host:port of an SGLang server or "
                           f"agentgym serve)") from e


def check_endpoint(url: str, tokenizer, timeout_s: float = 30.0) -> str | None:
    """Before the first step: the endpoint answers ``/get_model_info`` and the prompt-
    logprob request for the student's largest token id (a smaller vocabulary answers 400).
    Returns its tokenizer's folder where this machine can read it (``tokenizer_path``), for
    the caller to compare with the student's; None (logged) where it cannot."""
    base = url.rstrip("/")
    try:
        with urllib.request.urlopen(base + "/get_model_info", timeout=timeout_s) as resp:
            info = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ValueError(f"trainer.teacher={url!r}: GET /get_model_info failed ({e}); the "
                         f"teacher endpoint must be an SGLang server or agentgym serve") from e
    folder = info.get("tokenizer_path") or info.get("model_path") or ""
    probe = tokenizer("a probe of the teacher's tokenizer")["input_ids"][:8]
    top = max(len(tokenizer) - 1, 0)
    got = _post(base + "/generate", {"input_ids": [probe + [top]],
                                     "sampling_params": {"max_new_tokens": 0},
                                     "return_logprob": True, "logprob_start_len": 0}, timeout_s)
    _logprobs(got[0], len(probe) + 1, url)
    if folder and (Path(folder) / "config.json").is_file():
        return folder
    logger.warning("trainer.teacher=%s: its tokenizer (%r) is not readable here, so only "
                   "its answer to the student's token ids is checked", url, folder)
    return None


def _logprobs(answer: dict, n: int, url: str) -> list[float]:
    rows = (answer.get("meta_info") or {}).get("input_token_logprobs")
    if not isinstance(rows, list) or len(rows) != n:
        raise RuntimeError(f"the teacher at {url} returned "
                           f"{'no' if rows is None else len(rows)} input_token_logprobs for "
                           f"{n} tokens; it must answer return_logprob with "
                           f"logprob_start_len=0 (SGLang, agentgym serve)")
    return [0.0 if r[0] is None else float(r[0]) for r in rows]


def endpoint_logprobs(url: str, batch: Batch, temperature: float,
                      timeout_s: float = 600.0) -> torch.Tensor:
    """``(B, T)``: the endpoint's log-prob of each sampled token (0 elsewhere)."""
    B, T = batch.input_ids.shape
    lengths = batch.attention_mask.sum(-1).tolist()
    seqs = [batch.input_ids[i, :int(n)].tolist() for i, n in enumerate(lengths)]
    answers = _post(url + "/generate", {
        "input_ids": seqs, "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
        "return_logprob": True, "logprob_start_len": 0}, timeout_s)
    if isinstance(answers, dict):
        answers = [answers]
    out = torch.zeros((B, T), dtype=torch.float32)
    for i, (seq, answer) in enumerate(zip(seqs, answers)):
        out[i, :len(seq)] = torch.tensor(_logprobs(answer, len(seq), url))
    return torch.where(batch.loss_mask > 0, out, 0.0)
