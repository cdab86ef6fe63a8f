"""bench/update_speed.py end to end on the tiny model at toy sizes: both sides run both
shapes in one process and the table carries a row per shape; the synthetic batches have
the shapes the benchmark names."""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import update_speed  # noqa: E402


def test_the_update_benchmark_times_both_sides_on_both_shapes():
    args = update_speed.parse(["--model", "tiny", "--repeats", "1", "--prompts", "2",
                               "--groups", "1", "--samples", "3"])
    rows = update_speed.measure(args)
    assert [r["shape"] for r in rows] == ["trl", "search"]
    for r in rows:
        for side in update_speed.SIDES:
            assert len(r[side]["all"]) == 1 and r[side]["tok_s"] > 0
        # the packed side runs fewer tokens through the decoder: a group's prompt once
        assert r["packed"]["forwarded"] < r["today"]["forwarded"]
    body = update_speed.table(rows, mfu_peak=1.0)
    lines = [line for line in body.splitlines() if line.startswith(("| trl", "| search"))]
    assert len(lines) == 2 and all("x** |" in line and "%" in line for line in lines), body


def test_the_search_shape_shares_its_prompt_and_samples_86_tokens_a_row():
    args = update_speed.parse(["--groups", "2", "--samples", "4"])
    batch = update_speed.make_batch("search", 1000, 0, args)
    assert batch.input_ids.shape == (8, 158 + 566)
    assert batch.loss_mask.sum(-1).tolist() == [86.0] * 8
    assert batch.old_logp is None and batch.adv.shape == batch.loss_mask.shape
    ids = batch.input_ids
    assert torch.equal(ids[0, :158], ids[3, :158]) and not torch.equal(ids[0, :158], ids[4, :158])
    obs = batch.loss_mask[0] == 0
    obs[:158] = False  # the observations: every row its own
    assert not torch.equal(ids[0, obs], ids[1, obs])


def test_the_trl_shape_has_27_to_48_sampled_tokens_after_a_shared_prompt():
    args = update_speed.parse(["--prompts", "3", "--samples", "8"])
    batch = update_speed.make_batch("trl", 1000, 0, args)
    sampled = batch.loss_mask.sum(-1)
    assert len(batch) == 24 and bool(((sampled >= 27) & (sampled <= 48)).all())
    assert (batch.attention_mask.sum(-1) - sampled).tolist() == [35] * 24
