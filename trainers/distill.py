"""On-policy distillation: a teacher's log-probs of the tokens the student sampled, as a
dense per-token advantage beside (or instead of) the env's.

The student samples as in any RL step; the teacher scores those trajectories (a forward
pass over them, it never generates) and every sampled token gets

    adv_t = A_env,t + c * (log p_teacher(y_t) - log p_student(y_t))

with ``c = algo.distill_coef``: the negative per-token reverse KL of the student from the
teacher (Agarwal et al. 2024, GKD; the Tinker cookbook's and verl's on-policy
distillation). ``algo=opd`` sets ``A_env`` to 0 (``algo.advantage=none``). The term is
not group-normalised, so a group of one gets it in full. ``algo.distill_discount`` (γ,
0 by default, the formula above) adds γ-discounted terms of the tokens sampled after
``t`` (the Tinker cookbook's ``kl_discount_factor``). Prompts and observations are never
scored: every tensor here is 0 off the loss mask.

The student's log-probs are those of sampling time (``batch.rollout_logp``), so the term
is the reverse KL of the policy that drew the samples; the teacher's are taken at the
temperature the policy loss uses (``rollout.temperature``), as the student's were.

Where the teacher lives (:func:`teachers`): a model in this process (the single backend:
on the policy's device, or in host memory with ``algo.teacher_offload``), in the ranks of
a sharded backend beside the policy (``model=<spec>`` of their ``apply``), or behind an
endpoint that returns prompt log-probs (SGLang's ``/generate`` with ``return_logprob`` and
``logprob_start_len=0``, as ``agentgym serve`` answers it). ``trainer.teacher=[A,B]`` in
a mixed run gives each env its own (verl's multi-teacher recipe); an env given ``""``
is not distilled.

A teacher whose tokenizer differs from the student's (the vocabulary, the special tokens,
the tokens of the chat template) is refused before the first step
(:func:`check_tokenizers`): its log-probs of the student's token ids would mean nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from agentgym.trainers.algos import discounted_scan
from agentgym.trainers.batch import Batch
from agentgym.models.zoo import load_tokenizer, resolve_model
from agentgym.trainers.backends.base import ModelSpec, batched_logprobs
from agentgym.trainers.distill_endpoint import check_endpoint, endpoint_logprobs

logger = logging.getLogger(__name__)

#: the conversation both chat templates render for :func:`check_tokenizers`
PROBE_CHAT = [{"role": "system", "content": "You are a helpful assistant."},
              {"role": "user", "content": "What is 2 + 3?"},
              {"role": "assistant", "content": "<think>2 + 3 = 5</think> 5"},
              {"role": "user", "content": "And 4 + 4?"}]


# --- the estimator -----------------------------------------------------------------------
def distill_term(teacher_logp: torch.Tensor, student_logp: torch.Tensor, mask: torch.Tensor,
                 coef: float, discount: float = 0.0) -> torch.Tensor:
    """``(B, T)``: ``coef * (teacher_logp - student_logp)`` on the sampled tokens (0
    elsewhere); with ``discount`` γ > 0, each token also gets the γ-discounted terms of the
    tokens its row samples after it (observations between turns neither count nor
    discount, as in :func:`~agentgym.trainers.algos.discounted_scan`)."""
    on = mask > 0
    term = torch.where(on, coef * (teacher_logp.float() - student_logp.float()), 0.0)
    if discount > 0:
        zeros = torch.zeros_like(term)
        term = discounted_scan(term, mask, zeros, torch.zeros(term.shape[0]), discount, 1.0)
    return torch.where(on, term, 0.0)


def distill_metrics(teacher_logp: torch.Tensor, student_logp: torch.Tensor,
                    mask: torch.Tensor) -> dict[str, float]:
    """The mean per-token reverse KL (``log p_student - log p_teacher``, the k1 estimate
    on the student's samples) and the two log-probs, over the sampled tokens scored."""
    n = mask.sum().clamp(min=1)
    on = mask > 0
    t = torch.where(on, teacher_logp.float(), 0.0)
    s = torch.where(on, student_logp.float(), 0.0)
    return {"distill/reverse_kl": float((s - t).sum() / n),
            "distill/teacher_logp": float(t.sum() / n),
            "distill/student_logp": float(s.sum() / n)}


# --- the tokenizers must agree -----------------------------------------------------------
def tokenizer_difference(student, teacher) -> str | None:
    """The first way ``teacher`` tokenizes differently from ``student``, in words; None when
    they agree: the vocabulary (each token's id), the special tokens (and their ids), the
    chat template's tokens (:data:`PROBE_CHAT` rendered by each, as token ids)."""
    sv, tv = student.get_vocab(), teacher.get_vocab()
    if sv != tv:
        if len(sv) != len(tv):
            return f"the vocabulary has {len(sv)} tokens in the student's, {len(tv)} in the teacher's"
        token = next(tok for tok in sorted(sv) if tv.get(tok) != sv[tok])
        return (f"the vocabulary differs: token {token!r} is id {sv[token]} in the student's "
                f"and {tv.get(token)} in the teacher's")
    ss = {k: str(v) for k, v in student.special_tokens_map.items()}
    ts = {k: str(v) for k, v in teacher.special_tokens_map.items()}
    for key in sorted(set(ss) | set(ts)):
        if ss.get(key) != ts.get(key):
            return (f"the special token {key} is {ss.get(key)!r} in the student's and "
                    f"{ts.get(key)!r} in the teacher's")
    if sorted(student.all_special_ids) != sorted(teacher.all_special_ids):
        return (f"the special token ids are {sorted(student.all_special_ids)} in the "
                f"student's and {sorted(teacher.all_special_ids)} in the teacher's")
    sc, tc = (_chat_ids(tok) for tok in (student, teacher))
    if sc != tc:
        if sc is None or tc is None:
            return (f"the chat template: the {'student' if sc is None else 'teacher'} has "
                    f"none, the {'teacher' if sc is None else 'student'} has one")
        at = next((i for i, (a, b) in enumerate(zip(sc, tc)) if a != b), min(len(sc), len(tc)))
        return (f"the chat template renders the same conversation differently from token "
                f"{at}: {student.decode(sc[at:at + 8])!r} in the student's, "
                f"{teacher.decode(tc[at:at + 8])!r} in the teacher's")
    return None


def _chat_ids(tok) -> list[int] | None:
    if not getattr(tok, "chat_template", None):
        return None
    out = tok.apply_chat_template(PROBE_CHAT, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def check_tokenizers(student, teacher, student_name: str, teacher_name: str) -> None:
    """Refuse a teacher that tokenizes otherwise than the student, naming both and the
    first difference."""
    diff = tokenizer_difference(student, teacher)
    if diff is not None:
        raise ValueError(f"trainer.teacher={teacher_name!r} tokenizes differently from the "
                         f"student {student_name!r}: {diff}. On-policy distillation scores "
                         f"the student's token ids with the teacher, so both need the same "
                         f"tokenizer: use a teacher of the student's family (its "
                         f"vocabulary, special tokens and chat template)")


# --- the teacher -------------------------------------------------------------------------
@dataclass
class Teacher:
    """One teacher: a model in this process (``model``), one the sharded backend's ranks
    hold (``backend`` with ``spec``), or an endpoint (``url``)."""

    name: str  # as trainer.teacher gave it
    model: Any = None
    backend: Any = None
    spec: Any = None  # agentgym.trainers.backends.base.ModelSpec, for the ranks
    url: str = ""
    micro_batch_tokens: int = 4096
    chunk: int = 0
    packing: bool = True
    timeout_s: float = 600.0

    def logprobs(self, batch: Batch, temperature: float) -> torch.Tensor:
        """``(B, T)``: the teacher's log-prob of each sampled token (0 elsewhere)."""
        if self.url:
            return endpoint_logprobs(self.url, batch, temperature, self.timeout_s)
        if self.backend is not None:
            return self.backend.teacher_logprobs(batch, temperature, self.spec)
        return batched_logprobs(self.model, batch, temperature, self.micro_batch_tokens,
                                chunk=self.chunk, packing=self.packing)[0]


def teacher_names(cfg) -> list[str]:
    """``trainer.teacher`` per env of the run, in env order (``""``: that env has none)."""
    from agentgym.config import env_names  # lazy: imports the config
    envs = env_names(cfg.env)
    given = cfg.per_env.get("trainer.teacher")
    if given is not None:
        return [str(g) for g in given]
    return [cfg.trainer.teacher] * len(envs)


def teachers(cfg, tokenizer, backend) -> dict[str, Teacher] | None:
    """The run's teachers by env (None when it distils nothing), each checked against the
    student's tokenizer before any step."""
    if cfg.algo.distill_coef <= 0:
        return None
    from agentgym.config import env_names  # lazy: imports the config
    out: dict[str, Teacher] = {}
    loaded: dict[str, Teacher] = {}  # one teacher serving several envs loads once
    for env, name in zip(env_names(cfg.env), teacher_names(cfg)):
        if name:
            if name not in loaded:
                loaded[name] = _teacher(cfg, name, tokenizer, backend)
            out[env] = loaded[name]
    return out


def _teacher(cfg, name: str, tokenizer, backend) -> Teacher:
    t = cfg.trainer
    student = cfg.model.path or cfg.model.name
    if name.startswith(("http://", "https://")):
        folder = check_endpoint(name, tokenizer)
        if folder is not None:
            check_tokenizers(tokenizer, load_tokenizer(folder), student, name)
        return Teacher(name=name, url=name.rstrip("/"))
    path = resolve_model(name)
    check_tokenizers(tokenizer, load_tokenizer(path), student, name)
    spec = ModelSpec(str(path), cfg.model.dtype, device=t.device)
    if t.backend != "single" and not cfg.algo.teacher_offload:
        logger.info("teacher %s: in the ranks, sharded as the policy is", path)
        return Teacher(name=name, backend=backend, spec=spec)
    from agentgym.trainers.reference import frozen_model  # lazy: loads gymnasium
    model, tokens = frozen_model(cfg, path, cfg.algo.teacher_offload)
    logger.info("teacher %s: on %s", path, "the host" if cfg.algo.teacher_offload else t.device)
    return Teacher(name=name, model=model, micro_batch_tokens=tokens, chunk=t.logprob_chunk,
                   packing=t.packing)


def teacher_logprobs(by_env: dict[str, Teacher], batch: Batch, envs: list[str],
                     temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(teacher_logp (B, T), scored (B, T))``: each row scored by its env's teacher
    (``envs``: per row); ``scored`` is the loss mask on the rows that have one."""
    B, T = batch.input_ids.shape
    out = torch.zeros((B, T), dtype=torch.float32)
    scored = torch.zeros((B, T), dtype=torch.float32)
    groups: dict[int, tuple[Teacher, list[int]]] = {}
    for i, env in enumerate(envs):
        teacher = by_env.get(env)
        if teacher is not None:
            groups.setdefault(id(teacher), (teacher, []))[1].append(i)
    for teacher, rows in groups.values():
        part = batch if len(rows) == B else batch.select(rows)
        lp = teacher.logprobs(part, temperature)
        idx = torch.tensor(rows)
        out[idx, :lp.shape[1]] = lp.float()
        scored[idx] = batch.loss_mask[idx].float()
    return out, scored
