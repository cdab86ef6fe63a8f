"""Supervised fine-tuning on multi-turn episodes: the cold start before RL.

    agentgym demos env=search out=demos/search.jsonl         # or env=code; or rollout+filter
    agentgym sft env=search data=demos/search.jsonl model=smollm2-135m run_dir=runs/sft
    agentgym train env=search model=runs/sft/checkpoints/step_N   # RL from the SFT result

The data are demonstrations, rollout trajectories or chat conversations
(:mod:`agentgym.data.demos`), each turned into the token stream and loss mask a rollout of
the same episode would have: the loss is the mean negative log-likelihood over the
tokens the assistant writes (mask 1) of each optimizer batch; prompt, observations and
template filler (mask 0) only condition. Same backend, checkpoints (``trainer.resume``),
metrics (JSONL, TensorBoard, ``loss_curve.png``) and progress hooks as GRPO.

Batches: ``sft.batch_size`` sequences per optimizer step, drawn as in HF's
``group_by_length``: each epoch is shuffled, cut into mega-batches of 16 batches, each
sorted by length and split, and the batch order shuffled again; so sequences of one
batch have similar lengths and the ``trainer.micro_batch_tokens`` micro-batches carry
little padding. ``train/pad_fraction`` reports the padding actually computed.

With ``trainer.packing`` (the default) the sequences of a batch are one group
(:data:`SHARED`; one per rank with ``trainer.nprocs`` > 1, so every rank has rows): their
longest common prefix of tokens (the chat template's system turn and the env's
instructions, the same in every demonstration of an env: 139 of a search demonstration's
tokens, 86 of an arithmetic one's) is encoded once per micro-batch and every sequence
attends to it, as GRPO's samples share their prompt (:mod:`agentgym.trainers.packing`; the
loss and gradients are those of encoding each sequence whole). ``train/shared_tokens``
counts the tokens not encoded again.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

from agentgym.core.memory import give_back
from agentgym.supervision.watchdog import closed_with_end_state
from agentgym.rollout.chat import ChatTokens
from agentgym.config import Config
from agentgym.data.rows import dataset_path, load_rows, read_rows
from agentgym.data.demos import record_to_trajectory
from agentgym.reporting.metrics import MetricsLogger
from agentgym.models.zoo import is_vision_language, load_tokenizer, resolve_model
from agentgym.core.types import Trajectory
from agentgym.trainers.algos import aggregate
from agentgym.trainers.backends.base import token_logprobs
from agentgym.trainers.batch import Batch, collate
from agentgym.trainers.packing import shared_tokens
from agentgym.trainers.hooks import Hooks
from agentgym.trainers.backends.factory import make_backend, policy_spec
from agentgym.trainers.checkpoints import resume, save_checkpoint, start_run

logger = logging.getLogger(__name__)

MEGA_BATCHES = 16  # batches per length-sorted mega-batch (HF's group_by_length uses 50)
#: the group key of a packed SFT batch's sequences (``SHARED/r``: one group per rank of a
#: sharded backend, one in all on a single process), whose common prefix is packed once
SHARED = "sft-batch"


def load_sft_data(cfg: Config, tokenizer) -> tuple[list[Trajectory], list[str], int]:
    """The records of ``cfg.data.name`` as trajectories for this tokenizer; those longer than
    ``sft.max_length`` are left out. Returns ``(trajectories, each one's env (a record's
    ``env``, else ``cfg.env``), number left out)``."""
    path = dataset_path(cfg.env, cfg.data.name)
    records = read_rows(path)
    if cfg.limit:
        records = records[:cfg.limit]
    if not records:
        raise ValueError(f"{path} holds no records")
    chat = ChatTokens(tokenizer)
    trajs, envs, dropped = [], [], 0
    for i, rec in enumerate(records):
        try:
            traj = record_to_trajectory(rec, chat, cfg.env)
        except (KeyError, ValueError) as e:
            raise ValueError(f"{path}:{i + 1}: {e}") from e
        if len(traj.token_ids) > cfg.sft.max_length:
            dropped += 1
            continue
        if traj.num_sampled == 0:
            raise ValueError(f"{path}:{i + 1}: no assistant tokens to learn (loss mask all 0)")
        trajs.append(traj)
        envs.append(rec.get("env") or cfg.env)
    if dropped:
        logger.warning("%d of %d records are longer than sft.max_length=%d tokens and are "
                       "left out", dropped, len(records), cfg.sft.max_length)
    if not trajs:
        raise ValueError(f"every record of {path} is longer than sft.max_length="
                         f"{cfg.sft.max_length}")
    return trajs, envs, dropped


def step_lr_scales(plan: list[list[int]], envs: list[str],
                   lr_by_env: dict[str, float] | None) -> list[float]:
    """Each step's rate as a fraction of the peak (``lr_by_env``'s largest): the mean of
    its rows' envs' rates over that peak (a length-grouped batch is nearly always one
    env's). All 1.0 without ``lr_by_env``."""
    if not lr_by_env:
        return [1.0] * len(plan)
    unknown = sorted(set(envs) - set(lr_by_env))
    if unknown:
        raise ValueError(f"sft: no learning rate for env(s) {unknown}; the rates given are "
                         f"for {sorted(lr_by_env)}")
    peak = max(lr_by_env.values())
    return [sum(lr_by_env[envs[i]] for i in batch) / (len(batch) * peak) for batch in plan]


def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int,
                  group_by_length: bool = True) -> list[list[int]]:
    """Index batches of one epoch (a pure function of seed and epoch, so a resumed run
    draws the same ones); length-grouped as in the module docstring, or plain shuffled."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    if not group_by_length:
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    mega = batch_size * MEGA_BATCHES
    batches = []
    for lo in range(0, len(order), mega):
        chunk = sorted(order[lo:lo + mega], key=lambda i: -lengths[i])
        batches.extend(chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size))
    rng.shuffle(batches)
    return batches


@dataclass(frozen=True)
class NLLLoss:
    """Micro-batch loss: token-mean NLL over the whole optimizer batch (exact under
    gradient accumulation, like the RL losses' ``token-mean``); picklable."""

    num_tokens: float
    chunk: int = 0  # trainer.logprob_chunk
    packing: bool = True  # trainer.packing (agentgym.trainers.packing)

    def __call__(self, model, mb: Batch):
        dev = next(model.parameters()).device
        mask = mb.loss_mask.to(dev)
        logp, _ = token_logprobs(model, mb, dev, chunk=self.chunk, packing=self.packing)
        return aggregate(-logp, mask, "token-mean", num_tokens=self.num_tokens), {}


def sft_loss_fn(num_tokens: float, chunk: int = 0, packing: bool = True) -> NLLLoss:
    return NLLLoss(num_tokens, chunk, packing)


def padding_stats(micro: list[Batch], packing: bool = False) -> tuple[int, int]:
    """``(real tokens, tokens computed)`` over micro-batches: padded rows, or with
    ``packing`` the real tokens alone (a packed row has no padding)."""
    real = sum(int(mb.attention_mask.sum()) for mb in micro)
    padded = real if packing else sum(mb.input_ids.numel() for mb in micro)
    return real, padded


def plan_steps(cfg: Config, lengths: list[int]) -> list[list[int]]:
    """Every optimizer step's batch, in order (epochs, or ``sft.max_steps``)."""
    s = cfg.sft
    plan: list[list[int]] = []
    epoch = 0
    while True:
        plan.extend(epoch_batches(lengths, s.batch_size, cfg.trainer.seed, epoch,
                                  s.group_by_length))
        epoch += 1
        if (s.max_steps and len(plan) >= s.max_steps) or (not s.max_steps and epoch >= s.epochs):
            break
    return plan[:s.max_steps] if s.max_steps else plan


def sft(cfg: Config, hooks: Hooks | None = None,
        lr_by_env: dict[str, float] | None = None) -> Path:
    """Run SFT as configured; return the run directory. ``lr_by_env``: each env's
    demonstrations at their own peak rate (the cold start's per-env
    ``trainer.cold_start_lr``; ``trainer.lr`` is then the largest of them)."""
    hooks = hooks or Hooks()
    t = cfg.trainer
    model = cfg.model.path or cfg.model.name
    path = resolve_model(model)
    if is_vision_language(path):  # the NLL forward would silently run without the images
        raise ValueError(
            f"agentgym sft with a vision-language model (model={model}) is not supported "
            "yet: demonstrations are trained on their text alone and the images would be "
            "dropped; use a text-only model, or train the VL model with `agentgym train`")
    run_dir = start_run(cfg)
    tokenizer = load_tokenizer(path)
    trajs, envs, dropped = load_sft_data(cfg, tokenizer)
    lengths = [len(tr.token_ids) for tr in trajs]
    plan = plan_steps(cfg, lengths)
    scales = step_lr_scales(plan, envs, lr_by_env)
    per_epoch = math.ceil(len(trajs) / cfg.sft.batch_size)
    logger.info("sft: %d sequences (%d left out), %d steps, %d assistant tokens per epoch",
                len(trajs), dropped, len(plan), sum(tr.num_sampled for tr in trajs))
    backend = make_backend(cfg, policy_spec(cfg, path), t.lr, total_steps=len(plan),
                           warmup_steps=t.warmup_steps)
    try:
        return _sft_steps(cfg, run_dir, backend, tokenizer, trajs, plan, scales, per_epoch,
                          path, hooks)
    finally:
        backend.close()


def _sft_steps(cfg: Config, run_dir: Path, backend, tokenizer, trajs, plan, scales,
               per_epoch: int, path, hooks: Hooks) -> Path:
    t = cfg.trainer
    start = resume(t.resume, run_dir, backend)["step"]
    metrics_log = MetricsLogger(run_dir, curve_keys=("train/loss",), resume_step=start,
                                png_name="loss_curve.png", ylabel="NLL per assistant token")
    with closed_with_end_state(lambda _state: metrics_log.close()):  # never hides the error
        hooks.phase("sft", len(plan) - start)
        for step in range(start, len(plan)):
            t0 = time.perf_counter()
            batch = collate([trajs[i] for i in plan[step]], tokenizer.pad_token_id)
            if t.packing:  # one group per rank, so every rank has rows to train on
                batch.uids = [f"{SHARED}/{i % max(1, t.nprocs)}" for i in range(len(batch))]
            micro = backend.split(batch)
            num_tokens = float(batch.loss_mask.sum().clamp(min=1))
            out = backend.train_step(micro, sft_loss_fn(num_tokens, t.logprob_chunk, t.packing),
                                     lr_scale=scales[step])
            real, padded = padding_stats(micro, t.packing)
            shared = sum(shared_tokens(mb.input_ids, mb.attention_mask.sum(-1).tolist(),
                                       mb.uids) for mb in micro) if t.packing else 0
            elapsed = time.perf_counter() - t0
            m = {"train/loss": out["loss"], "train/grad_norm": out["grad_norm"],
                 "train/lr": out["lr"], "train/epoch": (step + 1) / per_epoch,
                 "train/assistant_tokens": num_tokens, "train/tokens": float(real),
                 "train/pad_fraction": 1 - real / padded, "train/micro_batches": len(micro),
                 "train/shared_tokens": float(shared),
                 "time/step_s": elapsed, "time/tokens_per_s": real / elapsed}
            done = step + 1
            metrics_log.log(done, m)
            if done % t.save_every == 0 or done == len(plan):
                save_checkpoint(run_dir, done, backend, tokenizer, keep=t.keep_checkpoints)
            hooks.advance()
            hooks.step_end(done, m)
            give_back()  # the step's freed memory, back to the system (agentgym.core.memory)
        if cfg.sft.eval_limit and start < len(plan):
            final = evaluate_policy(cfg, backend, tokenizer, path, hooks)
            metrics_log.log(len(plan), final)
            hooks.step_end(len(plan), final)
    return run_dir


def evaluate_policy(cfg: Config, backend, tokenizer, path, hooks: Hooks) -> dict:
    """Greedy episodes of the env's held-out set (``trainer.eval_data``, first
    ``sft.eval_limit``) with the trained weights (any backend's full state dict, LoRA
    merged, loaded into an engine's copy of the model): format validity and EM."""
    from agentgym.rollout.runtime import engine_for  # lazy: loads httpx
    from agentgym.trainers.workers import evaluate  # lazy: loads httpx
    rows = load_rows(cfg.env, cfg.trainer.eval_data, cfg.sft.eval_limit, cfg=cfg)
    engine = engine_for(cfg, path, tokenizer)
    try:
        engine.update_weights(backend.state_dict(), 1)
        return evaluate(cfg, engine, tokenizer, rows, hooks)
    finally:
        engine.close()
