"""Turn-level credit (trainers/turn_credit.py): each estimator against advantages computed by
hand on a small batch, the turn ids collate builds, and on a toy env whose outcome is a coin
and whose first turn is scored, turn-level GRPO learns the first turn where outcome-only
GRPO does not."""

from __future__ import annotations

import json

import pytest
import torch

from agentgym.config import AlgoConfig, build_config
from agentgym.core.types import Trajectory
from agentgym.data.rows import write_jsonl
from toy_envs import two_step_rows
from agentgym.trainers.algos import compute_advantages, needs_groups
from agentgym.trainers.batch import collate
from agentgym.trainers.loop import train
from agentgym.trainers.turn_credit import row_turns

# Three samples of one prompt (token ids 5 6), T = 8. Row 0: turn 0 at 2-3 (reward 1),
# observation 9 at 4, turn 1 at 5-6 (outcome 1). Row 1: turn 0 at 2 (0), observation 8 8
# at 3-4, turn 1 at 5 (outcome 0). Row 2: turn 0 at 2 (0.5), observation 9 at 3, turn 1 at
# 4 (0.5), observation 7 at 5, turn 2 at 6 (outcome 1).
IDS = torch.tensor([[5, 6, 1, 1, 9, 1, 1, 0],
                    [5, 6, 1, 8, 8, 1, 0, 0],
                    [5, 6, 1, 9, 1, 7, 1, 0]])
TURNS = torch.tensor([[-1, -1, 0, 0, -1, 1, 1, -1],
                      [-1, -1, 0, -1, -1, 1, -1, -1],
                      [-1, -1, 0, -1, 1, -1, 2, -1]])
MASK = (TURNS >= 0).float()
REWARDS = torch.zeros(3, 8)
REWARDS[0, 3], REWARDS[0, 6] = 1.0, 1.0
REWARDS[2, 2], REWARDS[2, 4], REWARDS[2, 6] = 0.5, 0.5, 1.0
GROUPS = ["q", "q", "q"]


def per_turn(adv: torch.Tensor) -> list[list[float]]:
    """Each row's advantage per turn, checking it is the same on every token of the turn
    and 0 off the mask."""
    out = []
    for b in range(adv.shape[0]):
        assert torch.all(adv[b][MASK[b] == 0] == 0)
        row = []
        for k in range(int(TURNS[b].max()) + 1):
            vals = adv[b][TURNS[b] == k]
            assert torch.allclose(vals, vals[0].expand_as(vals))
            row.append(float(vals[0]))
        out.append(row)
    return out


def close(a: list[list[float]], b: list[list[float]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x == pytest.approx(y, abs=1e-5), (a, b)


def test_turns_are_read_from_the_turn_ids():
    turns = row_turns(REWARDS, MASK, TURNS)
    assert [[(t.number, t.reward, t.first, t.last) for t in row] for row in turns] == [
        [(0, 1.0, 2, 3), (1, 1.0, 5, 6)], [(0, 0.0, 2, 2), (1, 0.0, 5, 5)],
        [(0, 0.5, 2, 2), (1, 0.5, 4, 4), (2, 1.0, 6, 6)]]
    with pytest.raises(ValueError, match="no turn"):
        row_turns(REWARDS, MASK, torch.where(MASK > 0, -1, TURNS))


def test_mt_grpo_by_hand():
    # outcomes 1, 0, 1 (mean 2/3); turn 0 of all three: 1, 0, 0.5 (mean 0.5); turn 1 is a
    # non-final turn of row 2 only (a group of one: 0). Turn k gets the sum from k on.
    adv, ret = compute_advantages("mt_grpo", REWARDS, MASK, group_ids=GROUPS, turn_ids=TURNS,
                                  norm_by_std=False)
    close(per_turn(adv), [[0.5 + 1 / 3, 1 / 3], [-0.5 - 2 / 3, -2 / 3], [1 / 3, 1 / 3, 1 / 3]])
    close(per_turn(ret), [[2.0, 1.0], [0.0, 0.0], [2.0, 1.5, 1.0]])
    # with the std (unbiased; outcomes: 0.57735, turn 0: 0.5) and gamma 0.5
    adv, _ = compute_advantages("mt_grpo", REWARDS, MASK, group_ids=GROUPS, turn_ids=TURNS,
                                gamma=0.5, norm_by_std=True)
    ao = [x / (0.57735027 + 1e-6) for x in (1 / 3, -2 / 3, 1 / 3)]
    at = [x / (0.5 + 1e-6) for x in (0.5, -0.5, 0.0)]
    close(per_turn(adv), [[at[0] + 0.5 * ao[0], ao[0]], [at[1] + 0.5 * ao[1], ao[1]],
                          [at[2] + 0.25 * ao[2], 0.5 * ao[2], ao[2]]])
    # a group of one learns nothing
    adv, _ = compute_advantages("mt_grpo", REWARDS, MASK, group_ids=["a", "b", "c"],
                                turn_ids=TURNS)
    assert torch.all(adv == 0)


def test_gigpo_by_hand():
    # episode returns 2, 0, 2 (mean 4/3): A^E = 2/3, -4/3, 2/3. Returns-to-go: row 0 2, 1;
    # row 1 0, 0; row 2 2, 1.5, 1. Anchor states: the prompt for every turn 0 (to-go 2, 0,
    # 2); observation [9] before turn 1 of rows 0 and 2 (1, 1.5: -0.25, +0.25); row 1's
    # turn 1 ([8 8]) and row 2's turn 2 ([7]) alone (0).
    adv, ret = compute_advantages("gigpo", REWARDS, MASK, group_ids=GROUPS, turn_ids=TURNS,
                                  input_ids=IDS, norm_by_std=False)
    close(per_turn(adv), [[4 / 3, 2 / 3 - 0.25], [-8 / 3, -4 / 3], [4 / 3, 2 / 3 + 0.25, 2 / 3]])
    close(per_turn(ret), [[2.0, 1.0], [0.0, 0.0], [2.0, 1.5, 1.0]])
    adv, _ = compute_advantages("gigpo", REWARDS, MASK, group_ids=GROUPS, turn_ids=TURNS,
                                input_ids=IDS, norm_by_std=False, step_weight=0.0)
    close(per_turn(adv), [[2 / 3] * 2, [-4 / 3] * 2, [2 / 3] * 3])
    # a different observation before row 2's turn 1: row 0's turn 1 is alone too
    ids = IDS.clone()
    ids[2, 3] = 4
    adv, _ = compute_advantages("gigpo", REWARDS, MASK, group_ids=GROUPS, turn_ids=TURNS,
                                input_ids=ids, norm_by_std=False)
    close(per_turn(adv), [[4 / 3, 2 / 3], [-8 / 3, -4 / 3], [4 / 3, 2 / 3, 2 / 3]])


def test_gae_over_turns_by_hand():
    values = torch.zeros(3, 8)
    values[2, 2], values[2, 4], values[2, 6] = 0.5, 1.0, 0.8  # each turn's first token
    values[2, 3] = 99.0  # not a turn's first token: never read
    rows = [2]
    r, m, t, v = REWARDS[rows], MASK[rows], TURNS[rows], values[rows]
    # gamma 1, lam 1: delta_2 = 1 - 0.8 = 0.2; delta_1 = 0.5 + 0.8 - 1 = 0.3;
    # delta_0 = 0.5 + 1 - 0.5 = 1.0; A = 1.5, 0.5, 0.2; targets A + V = 2.0, 1.5, 1.0
    adv, ret = compute_advantages("gae_turn", r, m, values=v, turn_ids=t, norm_by_std=False)
    assert per_turn_row(adv, 2) == pytest.approx([1.5, 0.5, 0.2])
    assert per_turn_row(ret, 2) == pytest.approx([2.0, 1.5, 1.0])
    # gamma 0.9, lam 0.5: A_2 = 0.2; A_1 = 0.5 + 0.72 - 1 + 0.45 * 0.2 = 0.31;
    # A_0 = 0.5 + 0.9 - 0.5 + 0.45 * 0.31 = 1.0395
    adv, _ = compute_advantages("gae_turn", r, m, values=v, turn_ids=t, gamma=0.9, lam=0.5,
                                norm_by_std=False)
    assert per_turn_row(adv, 2) == pytest.approx([1.0395, 0.31, 0.2])
    # truncated: bootstrapped from the value after the last token (2.0): delta_2 = 1 + 2 - 0.8
    adv, _ = compute_advantages("gae_turn", r, m, values=v, turn_ids=t, norm_by_std=False,
                                truncated=torch.tensor([True]), last_values=torch.tensor([2.0]))
    assert per_turn_row(adv, 2) == pytest.approx([3.5, 2.5, 2.2])
    with pytest.raises(ValueError, match="last_values"):
        compute_advantages("gae_turn", r, m, values=v, turn_ids=t,
                           truncated=torch.tensor([True]))
    assert AlgoConfig(advantage="gae_turn").needs_critic
    assert needs_groups("mt_grpo") and needs_groups("gigpo")


def per_turn_row(adv: torch.Tensor, row: int) -> list[float]:
    return [float(adv[0][TURNS[row] == k][0]) for k in range(int(TURNS[row].max()) + 1)]


def test_the_estimators_name_a_missing_input():
    with pytest.raises(ValueError, match="turn_ids"):
        compute_advantages("mt_grpo", REWARDS, MASK, group_ids=GROUPS, turn_ids=None)
    with pytest.raises(ValueError, match="input_ids"):
        compute_advantages("gigpo", REWARDS, MASK, group_ids=GROUPS, turn_ids=TURNS)


def test_collate_gives_each_sampled_token_its_turn():
    t = Trajectory(uid="q")
    t.append("prompt", [5, 6], 0)
    t.append("generated", [1, 1], 0, [-0.1, -0.2])
    t.append("observation", [9], 0)
    t.append("generated", [1], 1, [-0.3])
    t.step_rewards = [1.0, 0.0]
    batch = collate([t], pad_id=0)
    assert batch.turn_ids.tolist() == [[-1, -1, 0, 0, -1, 1]]
    assert batch.token_rewards.tolist() == [[0, 0, 0, 1.0, 0, 0]]
    assert batch.select([0]).turn_ids.tolist() == [[-1, -1, 0, 0, -1, 1]]


def _first_turn_share(run) -> tuple[float, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    shares = [r["rollout/em"] for r in rows if "rollout/em" in r]  # turn 0's 'e' share
    return sum(shares[:3]) / 3, sum(shares[-3:]) / 3


def test_turn_level_credit_learns_where_the_outcome_alone_does_not(tmp_path):
    """TwoStep: the outcome is a coin (a checksum's parity of the second reply), the first
    turn is scored by its share of 'e' when the rows say so. Outcome-only GRPO (no turn
    reward) has nothing to learn from; turn-level GRPO (mt_grpo) with the turn reward
    learns to write 'e'. Same seed, same steps."""
    runs = {}
    for name, turn_reward, advantage in (("outcome", False, "grpo"),
                                         ("turn", True, "mt_grpo")):
        data = tmp_path / f"{name}.jsonl"
        write_jsonl(data, two_step_rows(64, turn_reward))
        cfg = build_config({"env": "agentgym-test/TwoStep-v0", "model": "tiny",
                            "data": str(data), "algo.advantage": advantage,
                            "trainer.total_steps": 20, "trainer.prompts_per_step": 4,
                            "rollout.n": 8, "rollout.max_tokens_per_turn": 8,
                            "trainer.lr": 1e-2, "trainer.eval_limit": 0,
                            "trainer.save_every": 100, "trainer.seed": 0,
                            "run_dir": str(tmp_path / name)})
        runs[name] = _first_turn_share(train(cfg))
    (o0, o1), (t0, t1) = runs["outcome"], runs["turn"]
    assert t1 > t0 + 0.25, runs
    assert o1 < o0 + 0.1, runs


@pytest.mark.parametrize("algo", [{"algo": "ppo", "algo.advantage": "gae_turn",
                                   "trainer.prompts_per_step": 8},
                                  {"algo.advantage": "gigpo", "rollout.n": 4}])
def test_the_turn_level_recipes_train(tmp_path, algo):
    """PPO with GAE over turns (a critic) and GiGPO run two steps end to end: finite
    losses, and advantages that differ between the two turns of an episode."""
    data = tmp_path / "rows.jsonl"
    write_jsonl(data, two_step_rows(16, True))
    cfg = build_config({"env": "agentgym-test/TwoStep-v0", "model": "tiny", "data": str(data),
                        "trainer.total_steps": 2, "trainer.prompts_per_step": 2,
                        "rollout.max_tokens_per_turn": 8, "trainer.eval_limit": 0,
                        "trainer.save_every": 100, "trainer.log_samples": 100,
                        "run_dir": str(tmp_path / "run"), **algo})
    run = train(cfg)
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "rollout/reward" in m]
    assert len(steps) == 2 and all(torch.isfinite(torch.tensor(m["train/pg_loss"]))
                                   for m in steps)
    differ = 0
    for line in (run / "samples" / "step_2.jsonl").read_text().splitlines():
        r = json.loads(line)
        gen = [s for s in r["segments"] if s["kind"] == "generated"]
        firsts = {round(r["advantages"][s["start"]], 4) for s in gen}
        differ += len(firsts) > 1
    assert differ > 0  # the turns of an episode got their own advantages
