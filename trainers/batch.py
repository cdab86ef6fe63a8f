"""Trajectories → padded tensors, and token-budgeted micro-batches."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from agentgym.core.types import Trajectory


@dataclass
class Batch:
    """Right-padded tensors of ``B`` trajectories of up to ``T`` tokens.

    From the trajectories (:func:`collate`):

    * ``input_ids``, ``attention_mask`` ``(B, T)``;
    * ``loss_mask`` ``(B, T)``: 1 on sampled tokens only;
    * ``rollout_logp`` ``(B, T)``: the engine's logprobs of the sampled tokens (0 elsewhere);
    * ``token_rewards`` ``(B, T)``: each turn's env reward on the last token sampled in that
      turn (:func:`turn_reward_positions`);
    * ``rewards`` ``(B,)``: the episode reward; ``truncated`` ``(B,)``: cut off by a turn or
      token budget (as opposed to terminated);
    * ``turn_ids`` ``(B, T)``: the turn of each sampled token, -1 elsewhere.

    Filled in by the step's phases, in this order (None until then):

    * ``old_logp`` ``(B, T)``: the trainer's logprobs before the update (omitted when the
      update's own forward pass gives them, ``phases.reuses_update_logprobs``);
    * ``ref_logp`` ``(B, T)``: the frozen reference's (``algo.kl_coef`` > 0);
    * ``teacher_logp`` ``(B, T)``: on-policy distillation's teacher's, with ``teacher_mask``
      the sampled tokens of the rows a teacher scored (``trainer.teacher``);
    * ``values`` ``(B, T)``: the critic's value of each token's state; ``last_values``
      ``(B,)``: of the state each sequence ends in (PPO);
    * ``adv`` ``(B, T)``: each sampled token's advantage; ``returns`` ``(B, T)``: the
      critic's targets (PPO; None for critic-free estimators).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logp: torch.Tensor
    rewards: torch.Tensor
    uids: list[str]
    token_rewards: torch.Tensor
    truncated: torch.Tensor
    #: per row, the prompt's processed images (VL models; :mod:`agentgym.models.vision`) or None
    images: list | None = None
    #: per row, its episode (an agent episode may yield several rows; advantages count an
    #: episode once, :func:`agentgym.trainers.algos._group_stats`); None: one row per episode
    episodes: list[str] | None = None
    #: ``(B, T)`` the turn (the env's step index) of each sampled token, -1 elsewhere: what
    #: turn-level estimators (:mod:`agentgym.trainers.turn_credit`) read; None when not
    #: collated here
    turn_ids: torch.Tensor | None = None
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    teacher_logp: torch.Tensor | None = None
    teacher_mask: torch.Tensor | None = None
    values: torch.Tensor | None = None
    last_values: torch.Tensor | None = None
    adv: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def map_tensors(self, fn) -> "Batch":
        """A batch whose every tensor is ``fn(tensor)`` (the row lists kept as they are)."""
        return dataclasses.replace(self, **{
            f.name: fn(v) for f in dataclasses.fields(self)
            if isinstance(v := getattr(self, f.name), torch.Tensor)})

    def select(self, index: list[int]) -> "Batch":
        """Rows ``index``, trimmed to their longest sequence."""
        idx = torch.tensor(index)
        width = int(self.attention_mask[idx].sum(-1).max())
        out = self.map_tensors(lambda t: t[idx, :width] if t.dim() == 2 else t[idx])
        out.uids = [self.uids[i] for i in index]
        out.images = [self.images[i] for i in index] if self.images is not None else None
        out.episodes = [self.episodes[i] for i in index] if self.episodes is not None else None
        return out


def turn_reward_positions(traj: Trajectory) -> list[int]:
    """Where each step reward of ``traj`` lands: the last token sampled in that turn.

    ``traj.step_rewards[k]`` is what the env returned for the action of turn ``k``, so it
    belongs to the last token of that action. Returns one position per step reward.
    """
    last: dict[int, int] = {}
    for seg in traj.segments:
        if seg.kind == "generated":
            last[seg.turn] = seg.end - 1
    if not last:
        raise ValueError(f"trajectory {traj.uid!r} has no sampled token to carry its reward")
    out, prev = [], min(last.values())
    for k in range(len(traj.step_rewards)):
        prev = last.get(k, prev)
        out.append(prev)
    return out


def collate(trajs: list[Trajectory], pad_id: int) -> Batch:
    width = max(len(t.token_ids) for t in trajs)
    B = len(trajs)
    ids = torch.full((B, width), pad_id, dtype=torch.long)
    attn = torch.zeros((B, width), dtype=torch.long)
    mask = torch.zeros((B, width), dtype=torch.float32)
    logp = torch.zeros((B, width), dtype=torch.float32)
    turn_ids = torch.full((B, width), -1, dtype=torch.long)
    for i, t in enumerate(trajs):
        n = len(t.token_ids)
        ids[i, :n] = torch.tensor(t.token_ids)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
        logp[i, :n] = torch.tensor(t.logprobs, dtype=torch.float32)
        for seg in t.segments:
            if seg.kind == "generated":
                turn_ids[i, seg.start:seg.end] = seg.turn
    token_rewards = torch.zeros((B, width), dtype=torch.float32)
    for i, t in enumerate(trajs):
        if t.step_rewards:
            for pos, r in zip(turn_reward_positions(t), t.step_rewards):
                token_rewards[i, pos] += float(r)
        elif t.reward:  # built without per-turn rewards: the last token
            sampled = [j for j, m in enumerate(t.loss_mask) if m]
            if not sampled:
                raise ValueError(f"trajectory {t.uid!r} has a reward but no sampled token")
            token_rewards[i, sampled[-1]] += float(t.reward)
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    truncated = torch.tensor([bool(t.truncated) for t in trajs])
    images = [t.images for t in trajs]
    episodes = [t.info.get("episode") for t in trajs]
    return Batch(ids, attn, mask, logp, rewards, [t.uid for t in trajs], token_rewards,
                 truncated, images=images if any(v is not None for v in images) else None,
                 episodes=[e or f"{t.uid}/{t.sample_index}/{i}" for i, (e, t) in
                           enumerate(zip(episodes, trajs))] if any(episodes) else None,
                 turn_ids=turn_ids)
