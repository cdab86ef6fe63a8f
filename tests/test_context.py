"""Context management (agentgym/rollout/context.py): an episode whose history passes
rollout.context_tokens continues in a new trajectory whose prompt is the rewritten
history, token-exact; the episode's trajectories share its reward. Scripted model turns
against the real search env and retriever, and a 2-step training run of the tiny model."""

from __future__ import annotations

import asyncio
import json

import pytest
from fakes import ScriptedEngine

from agentgym.config import RolloutConfig, build_config
from agentgym.rollout.chat import ChatTokens
from agentgym.rollout.context import (CONTINUE, DROPPED, SUMMARY_REQUEST, after_summary,
                                      drop_observations, joined)
from agentgym.rollout.manager import GenerationManager, last_parts, summarize
from agentgym.envs.search import SearchEnv, search_row

ROW = search_row("what is the capital of australia", ["Canberra"], source="test")
FIND = "<search> capital of australia canberra </search>"
MISS = "<search> zzzz qqqq </search>"


def test_drop_observations_keeps_the_latest_and_the_policys_turns():
    blocks = [("prompt", [1, 2]), ("generated", [3]), ("filler", []), ("observation", [4, 4]),
              ("generated", [5]), ("filler", [6]), ("observation", [7])]
    out = drop_observations(blocks, [9])
    assert out == [("prompt", [1, 2]), ("generated", [3]), ("filler", []), ("dropped", [9]),
                   ("generated", [5]), ("filler", [6]), ("observation", [7])]
    assert drop_observations(out, [9]) == out  # nothing more to drop
    assert joined(after_summary(blocks, [8, 8], [6], [0])) == [1, 2, 8, 8, 6, 0]


def play(tok, script, retriever_url, **cfg):
    engine = ScriptedEngine(tok, script)
    factory = lambda: SearchEnv(retriever_url=retriever_url, retrieval_reward=0.25)  # noqa: E731
    mgr = GenerationManager(engine, tok, factory, RolloutConfig(max_turns=4, max_response_tokens=8192,
                                                                 **cfg))
    try:
        return asyncio.run(mgr.play(ROW, uid="q0")), engine
    finally:
        mgr.close()


def segments(traj, kind):
    return [traj.token_ids[s.start:s.end] for s in traj.segments if s.kind == kind]


def assert_masks_exact(parts, engine):
    """In every trajectory the mask is 1 exactly on sampled tokens, each the engine's
    output with its logprobs, and every generation was prompted with exactly the
    trajectory's ids before it."""
    produced = iter(zip(engine.produced, engine.prompts))
    for t in parts:
        t.check()
        for s in t.segments:
            assert all(m == int(s.kind == "generated") for m in t.loss_mask[s.start:s.end])
            if s.kind == "generated":
                ids, prompt = next(produced)
                assert t.token_ids[s.start:s.end] == ids and prompt == t.token_ids[:s.start]


def test_drop_observations_splits_the_episode_token_exactly(tiny_tokenizer, retriever_url):
    tok, chat = tiny_tokenizer, ChatTokens(tiny_tokenizer)
    prompt = chat.prompt_ids(ROW["prompt"])
    parts, engine = play(tok, [MISS, FIND, MISS, "<answer> Canberra </answer>"], retriever_url,
                         context="drop_observations", context_tokens=len(prompt) + 60)
    assert len(parts) == 3
    assert_masks_exact(parts, engine)
    first = parts[0]
    obs = segments(first, "observation")
    gen = [segments(t, "generated") for t in parts]
    assert gen == [engine.produced[:2], [engine.produced[2]], [engine.produced[3]]]
    dropped = chat.encode(DROPPED)
    # the template's rendering of the question, the policy's turns as sampled, every tool
    # output but the latest replaced by the note
    assert segments(parts[1], "prompt") == [prompt + gen[0][0] + dropped + gen[0][1] + obs[1]]
    second_obs = segments(parts[1], "observation")[0]
    assert segments(parts[2], "prompt") == [prompt + gen[0][0] + dropped + gen[0][1] + dropped
                                            + gen[1][0] + second_obs]
    # turns 0 1 | 2 | 3: rewards 0, 0.25 (the search that found it), 0, 1 (the answer);
    # each trajectory: its turns' rewards, the later turns' on its last
    assert [t.step_rewards for t in parts] == [[0.0, 1.25], [0.0, 0.0, 1.0], [0.0] * 3 + [1.0]]
    assert [t.reward for t in parts] == [1.25] * 3
    assert [(t.info["part"], t.info["parts"]) for t in parts] == [(0, 3), (1, 3), (2, 3)]
    assert len({t.info["episode"] for t in parts}) == 1 and all(t.info["em"] == 1.0 for t in parts)
    assert last_parts(parts) == [parts[2]]
    s = summarize(parts)  # one episode, not three
    assert s["reward"] == 1.25 and s["em"] == 1.0 and s["turns"] == 4
    # kept: one trajectory, the same first turns
    [whole], kept = play(tok, [MISS, FIND, MISS, "<answer> Canberra </answer>"], retriever_url)
    assert segments(whole, "generated") == kept.produced and whole.step_rewards == [0, .25, 0, 1]
    assert "parts" not in whole.info


def test_summarize_trains_the_summary_and_restarts_from_it(tiny_tokenizer, retriever_url):
    tok, chat = tiny_tokenizer, ChatTokens(tiny_tokenizer)
    prompt = chat.prompt_ids(ROW["prompt"])
    summary = "The capital is Canberra. + eos"
    parts, engine = play(tok, [FIND, summary, "<answer> Canberra </answer>"], retriever_url,
                         context="summarize", context_tokens=len(prompt) + 20)
    assert len(parts) == 2
    assert_masks_exact(parts, engine)
    search, said, answer = engine.produced
    assert segments(parts[0], "generated") == [search, said]
    request = chat.encode(SUMMARY_REQUEST)
    assert segments(parts[0], "observation")[-1] == request
    filler, cont = chat.after_action_ids(said, [{"role": "user", "content": CONTINUE}], "inline")
    assert segments(parts[1], "prompt") == [prompt + said + filler + cont]
    assert segments(parts[1], "generated") == [answer]
    # turns: the search (0.25), the summary (0 of its own, the answer's 1 after it), the answer
    assert [t.step_rewards for t in parts] == [[0.25, 1.0], [0.0, 0.0, 1.0]]


def keep_prompt_and_last_turn(blocks, tokenizer):
    """A user strategy (rollout.context=test_context:keep_prompt_and_last_turn)."""
    return [blocks[0], *blocks[-3:]] if len(blocks) > 4 else None


def test_a_user_strategy_rewrites_the_context(tiny_tokenizer, retriever_url, monkeypatch):
    tok, chat = tiny_tokenizer, ChatTokens(tiny_tokenizer)
    prompt = chat.prompt_ids(ROW["prompt"])
    parts, engine = play(tok, [MISS, MISS, "<answer> Canberra </answer>"], retriever_url,
                         context="test_context:keep_prompt_and_last_turn",
                         context_tokens=len(prompt) + 1)
    assert_masks_exact(parts, engine)
    assert len(parts) == 2  # before turn 1 there is one turn only: nothing to rewrite
    first = parts[0]
    last_turn = segments(first, "generated")[-1] + segments(first, "observation")[-1]
    assert segments(parts[1], "prompt") == [prompt + last_turn]


def test_the_context_settings_are_checked():
    with pytest.raises(ValueError, match="context_tokens >= 1"):
        build_config({"rollout.context": "drop_observations"})
    with pytest.raises(ValueError, match="valid: keep, drop_observations, summarize"):
        build_config({"rollout.context": "forget", "rollout.context_tokens": 10})


def test_search_training_with_dropped_observations(tmp_path, tiny_tokenizer):
    """Two GRPO steps of the tiny model on search with rollout.context=drop_observations
    and a small context: every trajectory of a split episode is token-exact (its prompt the
    template's rendering of the question, then each earlier turn as sampled, its filler,
    and the dropped note or, for the latest turn, its observation) with the mask on its
    sampled tokens only."""
    from agentgym.data.rows import load_rows
    from agentgym.rollout.manager import row_uid
    from agentgym.trainers.loop import train
    chat = ChatTokens(tiny_tokenizer)
    cfg = build_config({"env": "search", "model": "tiny", "trainer.total_steps": 2,
                        "trainer.prompts_per_step": 2, "rollout.n": 2, "rollout.max_turns": 4,
                        "rollout.max_tokens_per_turn": 8, "trainer.eval_limit": 0,
                        "trainer.cold_start": "off", "trainer.log_samples": 1000,
                        "rollout.context": "drop_observations", "rollout.context_tokens": 300,
                        "trainer.save_every": 100, "run_dir": str(tmp_path / "run")})
    run = train(cfg)
    rows = {row_uid(r, i): r for i, r in enumerate(load_rows("search", cfg.data.name, None))}
    records = [json.loads(x) for p in sorted((run / "samples").glob("step_*.jsonl"))
               for x in p.read_text().splitlines()]
    episodes: dict[str, list] = {}
    for r in records:
        if "parts" in r["info"]:
            episodes.setdefault(f"{r['step']}/{r['info']['episode']}", []).append(r)
    assert episodes, "no episode passed the context limit"
    dropped = chat.encode(DROPPED)
    for parts in episodes.values():
        parts.sort(key=lambda r: r["info"]["part"])
        assert [r["info"]["part"] for r in parts] == list(range(parts[0]["info"]["parts"]))
        question = chat.prompt_ids(rows[parts[0]["uid"]]["prompt"])
        turns: dict[int, dict[str, list[int]]] = {}  # each turn's own tokens, by kind
        for j, r in enumerate(parts):
            ids, segs = r["token_ids"], r["segments"]
            for s in segs:
                assert r["loss_mask"][s["start"]:s["end"]] == \
                    [int(s["kind"] == "generated")] * (s["end"] - s["start"])
            assert segs[0]["kind"] == "prompt"
            history = sorted(turns)
            expected = question + [i for k in history for i in
                                   turns[k]["generated"] + turns[k].get("filler", []) +
                                   (turns[k]["observation"] if k == history[-1] else dropped)
                                   ] if j else question
            assert ids[:segs[0]["end"]] == expected, (j, r["info"])
            for s in segs[1:]:
                turns.setdefault(s["turn"], {})[s["kind"]] = ids[s["start"]:s["end"]]
