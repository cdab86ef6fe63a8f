"""Cold start: demonstration builders, SFT's loss mask vs RL's, replay, RFT, resume.

Real components: the search env over a real local BM25 retriever, the code env over the
real sandbox, the tiny model trained by the real SFT recipe. The scripted engine (a fake
named so) only replays a demonstration's text as if the policy had sampled it.
"""

from __future__ import annotations

import asyncio
import json

import gymnasium
import pytest
import torch
from fakes import ScriptedEngine

from agentgym.rollout.chat import ChatTokens
from agentgym.cli import main as cli
from agentgym.config import RolloutConfig, build_config
from agentgym.data.rows import load_rows, write_jsonl
from agentgym.data.demo_builders import build_demos
from agentgym.envs.search_demos import bridge_entities, find_answer, keyword_rewrite, search_demo
from agentgym.data.demos import (budget_violation, filter_trajectories, record_to_trajectory,
                            replay_demo, within_budgets)
from agentgym.rollout.manager import GenerationManager
from agentgym.models.zoo import resolve_model
from agentgym.envs.base import MessagesSpace, TextSpace
from agentgym.envs.code import CodeEnv
from agentgym.envs.search import SearchEnv, search_row
from agentgym.trainers.sft import epoch_batches, sft

BIG = dict(max_response_tokens=8192, max_tokens_per_turn=4096, max_prompt_tokens=4096)


def rollout(tok, factory, actions, row, **budgets):
    """The RL path: the manager plays ``actions`` (scripted policy output) in real envs."""
    engine = ScriptedEngine(tok, actions)
    mgr = GenerationManager(engine, tok, factory, RolloutConfig(**{**BIG, **budgets}))
    try:
        return asyncio.run(mgr.play_one(row, uid="u0"))
    finally:
        mgr.close()


def assert_same_episode(rl, sft_traj):
    assert sft_traj.token_ids == rl.token_ids
    assert sft_traj.loss_mask == rl.loss_mask
    assert [(s.kind, s.start, s.end) for s in sft_traj.segments] == \
        [(s.kind, s.start, s.end) for s in rl.segments]


@pytest.fixture(scope="module")
def search_demos(retriever_url):
    rows = load_rows("search", "train", 120)
    demos = build_demos("search", rows, lambda: SearchEnv(retriever_url=retriever_url))
    assert len(demos) >= 3, "the builder found too few answerable questions"
    return demos


@pytest.fixture(scope="module")
def sandbox():
    from agentgym.tools.sandbox import Limits, LocalSandbox
    try:
        box = LocalSandbox(Limits(cpu_s=2.0, wall_s=5.0), max_concurrency=2)
    except ValueError as e:
        pytest.skip(f"local sandbox unavailable: {e}")
    yield box
    box.close()


# --- builders --------------------------------------------------------------------------
def test_search_builder_protocol_and_replay(search_demos, retriever_url):
    for demo in search_demos[:3]:
        assert demo["reward"] == 1.0 and demo["env"] == "search"
        assert demo["actions"][0].startswith("<think>")
        assert demo["actions"][0].endswith("</search>")
        assert demo["actions"][-1].endswith("</answer>")
        info = "".join(m["content"] for m in demo["observations"][-1])
        assert info.startswith("\n\n<information>Doc 1(Title: ")
        golds = demo["row"]["reward_model"]["ground_truth"]["target"]
        assert find_answer(info, golds) is not None  # the answer is really in the passages
        env = SearchEnv(retriever_url=retriever_url)  # a fresh env replays it exactly
        try:
            again = replay_demo(demo, env)
        finally:
            env.close()
        assert again["observations"] == demo["observations"]
        assert again["prompt"] == demo["prompt"] and again["reward"] == 1.0


def test_code_builder_runs_cells_in_the_sandbox_and_replays(sandbox):
    rows = load_rows("code", "train", 6)
    demos = build_demos("code", rows, lambda: CodeEnv(sandbox=sandbox), workers=2)
    assert len(demos) >= 4
    demo = demos[0]  # Natalia: 48/2 then 48+24
    assert demo["row"]["extra_info"]["id"] == "gsm8k_train_0"
    assert "print(48/2)" in demo["actions"][0] and "<code>\n```python\n" in demo["actions"][0]
    outputs = ["".join(m["content"] for m in obs) for obs in demo["observations"]]
    assert outputs == ["\n<interpreter>\n24.0\n</interpreter>\n\n",
                       "\n<interpreter>\n72\n</interpreter>\n\n"]  # really computed
    assert demo["actions"][-1].endswith("<answer>\n\\boxed{72}\n</answer>")
    env = CodeEnv(sandbox=sandbox)
    try:
        again = replay_demo(demo, env)
    finally:
        env.close()
    assert again["observations"] == demo["observations"] and again["reward"] == 1.0


def test_keyword_rewrite_and_find_answer():
    assert keyword_rewrite("who does brant daugherty play in pretty little liars") == \
        "brant daugherty play pretty little liars"
    info = ('Doc 1(Title: "Canberra") Canberra is the capital of Australia.\n'
            'Doc 2(Title: "Sydney") Sydney is the largest city.\n')
    assert find_answer(info, ["the Largest City"]) == (2, "Sydney", "the Largest City")
    assert find_answer(info, ["Canb"]) is None  # whole words only
    assert find_answer(info, ["Perth"]) is None


# --- the SFT mask is the RL mask --------------------------------------------------------
def test_bridge_names_are_what_the_passages_add_to_the_question():
    info = ('\n\n<information>Doc 1(Title: "Alex da Kid") Alex da Kid worked with Eminem and '
            'Nicki Minaj on Love the Way You Lie.\nDoc 2(Title: "Rihanna") Rihanna sang it; '
            'Nicki Minaj again.</information>\n\n')
    got = bridge_entities(info, "Alex da Kid worked on a track with Eminem released in what year?")
    # names of two words or more that the question lacks, each once, in passage order
    assert got == [(1, "Alex da Kid", "Nicki Minaj"), (1, "Alex da Kid", "Love the Way You Lie")]


def test_a_two_hop_demonstration_searches_the_bridge_and_replays(retriever_url):
    """A HotpotQA question whose answer is not in the question's own results: the second
    search is a name the first results mention, and the answer comes from that name's own
    article (the one such question among the 1,000 HotpotQA training rows the shipped
    corpus supports: docs/decisions/data.md, "Two-hop demonstrations")."""
    row = next(r for r in load_rows("search", "train")
               if r["extra_info"]["question"].startswith("Alex da Kid worked"))
    env = SearchEnv(retriever_url=retriever_url)
    try:
        demo = search_demo(row, env)
        assert demo is not None and demo["builder"] == "search-two-hop"
        first, second, answer = demo["actions"]
        assert first.endswith(f"<search> {row['extra_info']['question']} </search>")
        assert "mentions Nicki Minaj" in second
        assert second.endswith("<search> Nicki Minaj </search>")
        assert find_answer("".join(m["content"] for m in demo["observations"][0]),
                           ["2010"]) is None  # not in the first search's passages
        assert "(Nicki Minaj) says the answer is 2010" in answer
        assert replay_demo(demo, env)["observations"] == demo["observations"]
        assert search_demo(row, env, max_searches=1) is None  # one search cannot answer it
    finally:
        env.close()


def test_search_demo_tokenizes_exactly_as_its_rollout(search_demos, tiny_tokenizer,
                                                      retriever_url):
    tok, chat = tiny_tokenizer, ChatTokens(tiny_tokenizer)
    for demo in search_demos[:2]:
        rl = rollout(tok, lambda: SearchEnv(retriever_url=retriever_url), demo["actions"],
                     demo["row"])
        assert rl.reward == 1.0 and rl.terminated
        sft_traj = record_to_trajectory(demo, chat, "search")
        assert_same_episode(rl, sft_traj)  # same observations from the env, same mask
        assert sum(sft_traj.loss_mask) == sum(len(chat.encode(a)) for a in demo["actions"])


def test_code_demo_tokenizes_exactly_as_its_rollout(sandbox, tiny_tokenizer):
    tok, chat = tiny_tokenizer, ChatTokens(tiny_tokenizer)
    (demo,) = build_demos("code", load_rows("code", "train", 1), lambda: CodeEnv(sandbox=sandbox))
    rl = rollout(tok, lambda: CodeEnv(sandbox=sandbox), demo["actions"], demo["row"])
    assert rl.reward == 1.0
    assert_same_episode(rl, record_to_trajectory(demo, chat, "code"))


class ChatToy(gymnasium.Env):
    """A chat-format env: each observation is a new user message; 'yes' ends it."""

    observation_format = "chat"
    stop_strings = ()

    def __init__(self):
        self.action_space, self.observation_space = TextSpace(), MessagesSpace()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return [{"role": "user", "content": "say yes"}], {}

    def step(self, action):
        done = "yes" in action
        return ([] if done else [{"role": "user", "content": "no"}]), float(done), done, False, {}


def test_conversation_tokenizes_exactly_as_a_chat_rollout(tiny_tokenizer):
    tok = tiny_tokenizer
    rl = rollout(tok, ChatToy, ["maybe + eos", "yes + eos"], {"prompt": []})
    conv = {"messages": [{"role": "user", "content": "say yes"},
                         {"role": "assistant", "content": "maybe"},
                         {"role": "user", "content": "no"},
                         {"role": "assistant", "content": "yes"}]}
    sft_traj = record_to_trajectory(conv, ChatTokens(tok), "search")
    assert_same_episode(rl, sft_traj)
    filler = [s for s in sft_traj.segments if s.kind == "filler"]
    assert [tok.decode(sft_traj.token_ids[s.start:s.end]) for s in filler] == ["\n"]
    assert sft_traj.token_ids[-1] == tok.eos_token_id and sft_traj.loss_mask[-1] == 1


# --- bad input --------------------------------------------------------------------------
def test_bad_records_name_the_problem(tiny_tokenizer, search_demos):
    chat = ChatTokens(tiny_tokenizer)
    with pytest.raises(ValueError, match="none of demonstration, trajectory, conversation"):
        record_to_trajectory({"text": "hello"}, chat, "search")
    bad = dict(search_demos[0], observations=[])
    with pytest.raises(ValueError, match="need 1 observations"):
        record_to_trajectory(bad, chat, "search")
    alien = {"token_ids": [1, 2, 10**7], "loss_mask": [0, 1, 1], "segments": [
        ["prompt", 0, 1, 0], ["generated", 1, 3, 0]]}
    with pytest.raises(ValueError, match="another model's tokenizer"):
        record_to_trajectory(alien, chat, "search")


def test_sft_cli_needs_data(capsys):
    assert cli(["sft", "env=search", "model=tiny"]) == 2
    assert "needs data=FILE.jsonl" in capsys.readouterr().err


def test_budget_violation_names_the_budget(search_demos, tiny_tokenizer):
    traj = record_to_trajectory(search_demos[0], ChatTokens(tiny_tokenizer), "search")
    assert budget_violation(traj, RolloutConfig(**BIG)) is None
    small = RolloutConfig(**{**BIG, "max_tokens_per_turn": 3})
    assert "rollout.max_tokens_per_turn" in budget_violation(traj, small)
    assert "rollout.max_turns" in budget_violation(traj, RolloutConfig(**{**BIG, "max_turns": 1}))


def test_within_budgets_keeps_the_demonstrations_that_fit_in_order(search_demos, tiny_tokenizer):
    """The one budget filter of ``agentgym demos`` and the cold start."""
    chat = ChatTokens(tiny_tokenizer)
    kept, over, why = within_budgets(search_demos, chat, "search", RolloutConfig(**BIG))
    assert kept == search_demos and over == 0 and why is None
    small = RolloutConfig(**{**BIG, "max_tokens_per_turn": 3})
    kept, over, why = within_budgets(search_demos, chat, "search", small)
    assert kept == [] and over == len(search_demos) and "rollout.max_tokens_per_turn" in why
    # a demonstration over the per-turn budget before the first that fits: skipped, counted;
    # with a limit, the ones after the limit-th kept are not looked at (nor counted)
    long = {**search_demos[1], "actions": ["x " * 400], "observations": []}
    turn300 = RolloutConfig(**{**BIG, "max_tokens_per_turn": 300})
    kept, over, why = within_budgets([long, search_demos[0], long], chat, "search", turn300)
    assert kept == search_demos[:1] and over == 2 and "rollout.max_tokens_per_turn" in why
    kept, over, _ = within_budgets([long, search_demos[0], long], chat, "search", turn300,
                                   limit=1)
    assert kept == search_demos[:1] and over == 1


# --- batching ---------------------------------------------------------------------------
def test_epoch_batches_cover_every_record_and_group_lengths():
    lengths = [(i * 37) % 500 + 10 for i in range(200)]
    for grouped in (True, False):
        batches = epoch_batches(lengths, 8, seed=3, epoch=1, group_by_length=grouped)
        assert sorted(i for b in batches for i in b) == list(range(200))
        assert batches == epoch_batches(lengths, 8, seed=3, epoch=1, group_by_length=grouped)

    def padded(batches):
        return sum(len(b) * max(lengths[i] for i in b) for b in batches)
    grouped = epoch_batches(lengths, 8, 3, 1, True)
    plain = epoch_batches(lengths, 8, 3, 1, False)
    assert padded(grouped) < 0.8 * padded(plain)  # bucketing removes most padding
    assert epoch_batches(lengths, 8, 3, 2, True) != grouped  # a new order every epoch


# --- training ---------------------------------------------------------------------------
def greedy_episodes(model, rows, retriever_url, max_tokens=96):
    cfg = build_config({"env": "search", "model": str(model), "rollout.temperature": 0.0,
                        "rollout.max_tokens_per_turn": max_tokens, "retriever.topk": 1,
                        "retriever.url": retriever_url})
    from agentgym.rollout.runtime import build_manager
    mgr, engine, _ = build_manager(cfg)
    try:
        return asyncio.run(mgr.run(rows, n=1))
    finally:
        mgr.close()
        engine.close()


def test_sft_teaches_tiny_the_search_protocol(tmp_path, retriever_url):
    torch.manual_seed(0)
    rows = load_rows("search", "train", 200)
    demos = build_demos("search", rows, lambda: SearchEnv(retriever_url=retriever_url, topk=1))
    data = tmp_path / "demos.jsonl"
    write_jsonl(data, demos[:4])
    train_rows = [d["row"] for d in demos[:4]]
    before = greedy_episodes("tiny", train_rows, retriever_url)
    assert not any(t.terminated for t in before)  # random weights: no protocol at all
    cfg = build_config({"env": "search", "model": "tiny", "data": str(data),
                        "run_dir": str(tmp_path / "run"), "sft.max_steps": 80,
                        "sft.batch_size": 4, "trainer.lr": 1e-2, "trainer.seed": 0})
    run = sft(cfg)
    losses = [json.loads(x)["train/loss"] for x in (run / "metrics.jsonl").read_text().splitlines()
              if x.strip()]
    assert losses[-1] < 0.1 * losses[0]
    assert (run / "loss_curve.png").stat().st_size > 0
    after = greedy_episodes(run / "checkpoints" / "step_80", train_rows, retriever_url)
    for t in after:  # search, read the information, answer: no malformed action
        assert t.terminated and t.metrics["malformed_actions"] == 0, t.info
        assert t.metrics["tool_calls"] >= 1
    assert sum(t.reward for t in after) >= 3


def _conversations(n=6):
    return [{"messages": [{"role": "user", "content": f"what is {i} plus {i}"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}"}]}
            for i in range(n)]


def test_sft_resume_matches_an_uninterrupted_run(tmp_path):
    from safetensors.torch import load_file
    data = tmp_path / "conv.jsonl"
    write_jsonl(data, _conversations())
    common = {"env": "search", "model": "tiny", "data": str(data), "sft.batch_size": 2,
              "trainer.lr": 1e-3, "trainer.lr_schedule": "constant", "trainer.save_every": 2}
    sft(build_config({**common, "run_dir": str(tmp_path / "a"), "sft.max_steps": 4}))
    sft(build_config({**common, "run_dir": str(tmp_path / "b"), "sft.max_steps": 2}))
    sft(build_config({**common, "run_dir": str(tmp_path / "b"), "sft.max_steps": 4}))
    a = load_file(tmp_path / "a/checkpoints/step_4/model.safetensors")
    b = load_file(tmp_path / "b/checkpoints/step_4/model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    steps = [json.loads(x)["step"] for x in (tmp_path / "b/metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_an_sft_step_interrupted_whose_closing_fails_too_is_still_an_interrupt(
        tmp_path, monkeypatch):
    """A Ctrl-C in an SFT step (a fault injected into its curve's draw) whose loss curve
    then fails to draw at close: the KeyboardInterrupt is what the caller gets."""
    from agentgym.reporting.metrics import MetricsLogger
    draws = []

    def interrupted_then_broken_draw_fault(self):
        draws.append(len(draws))
        raise KeyboardInterrupt if len(draws) == 1 else OSError("No space left on device")
    monkeypatch.setattr(MetricsLogger, "plot", interrupted_then_broken_draw_fault)
    data = tmp_path / "conv.jsonl"
    write_jsonl(data, _conversations())
    with pytest.raises(KeyboardInterrupt):
        sft(build_config({"env": "search", "model": "tiny", "data": str(data),
                          "sft.batch_size": 2, "sft.max_steps": 2,
                          "run_dir": str(tmp_path / "run")}))
    assert draws == [0, 1]


def test_rft_loop_rollout_filter_sft_then_rl(tmp_path, tiny_tokenizer, retriever_url):
    """rollout → filter (reward >= 1) → sft → train from the SFT checkpoint."""
    tok = tiny_tokenizer
    row = search_row("what is the capital of australia", ["Canberra"], source="test")
    factory = lambda: SearchEnv(retriever_url=retriever_url)  # noqa: E731
    good = rollout(tok, factory, ["<search> capital of australia </search>",
                                  "<answer> Canberra </answer>"], row)
    bad = rollout(tok, factory, ["<answer> Sydney </answer>"], row)
    unfinished = rollout(tok, factory, ["no tags"] * 4, row)
    records = [t.to_dict() for t in (good, bad, unfinished)]
    assert filter_trajectories(records, 1.0) == [records[0]]
    assert len(filter_trajectories(records, 0.0)) == 2  # unfinished episodes never kept
    assert len(filter_trajectories([records[0]] * 3, 1.0, max_per_prompt=2)) == 2
    rollouts, kept = tmp_path / "rollouts.jsonl", tmp_path / "kept.jsonl"
    write_jsonl(rollouts, records)
    assert cli(["filter", "env=search", f"data={rollouts}", f"out={kept}"]) == 0
    assert [json.loads(x)["reward"] for x in kept.read_text().split("\n") if x] == [1.0]
    run = tmp_path / "sft"
    assert cli(["sft", "env=search", f"data={kept}", "model=tiny", f"run_dir={run}",
                "sft.max_steps=1", "sft.eval_limit=2", f"retriever.url={retriever_url}",
                "rollout.max_tokens_per_turn=16"]) == 0
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["eval/count"] == 2 and 0 <= last["eval/format_valid"] <= 1  # held-out eval ran
    ckpt = run / "checkpoints" / "step_1"
    assert (ckpt / "model.safetensors").exists() and (run / "loss_curve.png").exists()
    rl = tmp_path / "rl"
    assert cli(["train", "env=search", f"model={ckpt}", f"run_dir={rl}", f"retriever.url={retriever_url}",
                "trainer.total_steps=1", "trainer.prompts_per_step=1", "n=2", "trainer.eval_limit=0",
                "rollout.max_tokens_per_turn=16", "rollout.max_turns=2",
                "trainer.cold_start=off"]) == 0
    config = json.loads((rl / "config.json").read_text())
    assert config["model"]["name"] == str(ckpt)
    assert (rl / "checkpoints" / "step_1" / "model.safetensors").exists()


def test_demos_cli_writes_replayable_demonstrations(tmp_path, retriever_url, capsys):
    out = tmp_path / "demos.jsonl"
    assert cli(["demos", "env=search", "model=tiny", "limit=40", f"out={out}",
                f"retriever.url={retriever_url}", "rollout.max_response_tokens=4096",
                "rollout.max_tokens_per_turn=1024"]) == 0
    printed = capsys.readouterr().out
    demos = [json.loads(x) for x in out.read_text().splitlines()]
    assert f"wrote {len(demos)} demonstrations for 40 questions" in printed
    assert demos and all(d["type"] == "demonstration" and d["reward"] == 1.0 for d in demos)
    assert len({d["uid"] for d in demos}) == len(demos)
    # the budgets are enforced for the configured model's tokenizer
    assert cli(["demos", "env=search", "model=tiny", "limit=40", f"out={out}",
                f"retriever.url={retriever_url}", "rollout.max_tokens_per_turn=8"]) == 0
    assert out.read_text() == "" and f"{len(demos)} over the rollout budgets" in \
        capsys.readouterr().out
    assert cli(["demos", "env=geometry"]) == 2  # unknown env: an error naming valid ones


def test_sft_on_fsdp_with_lora_matches_single(tmp_path):
    """The same SFT steps on FSDP2 over 2 ranks and on one process, LoRA adapters only:
    equal losses, and equal merged checkpoints that load with from_pretrained."""
    from safetensors.torch import load_file
    data = tmp_path / "conv.jsonl"
    write_jsonl(data, _conversations())
    common = {"env": "search", "model": "tiny", "data": str(data), "sft.batch_size": 4,
              "trainer.lr": 1e-2, "sft.max_steps": 3, "model.lora.rank": 4,
              "trainer.micro_batch_tokens": 64}
    runs = {}
    for name, over in (("single", {}), ("fsdp", {"trainer.backend": "fsdp",
                                                  "trainer.nprocs": 2})):
        runs[name] = sft(build_config({**common, **over, "run_dir": str(tmp_path / name)}))
    losses = {n: [json.loads(x)["train/loss"] for x in (r / "metrics.jsonl").read_text().split("\n") if x]
              for n, r in runs.items()}
    assert losses["fsdp"] == pytest.approx(losses["single"], rel=1e-5)
    a = load_file(runs["single"] / "checkpoints/step_3/model.safetensors")
    b = load_file(runs["fsdp"] / "checkpoints/step_3/model.safetensors")
    init = load_file(resolve_model("tiny") / "model.safetensors")
    assert a.keys() == b.keys() and set(a) <= set(init)  # (a tied lm_head is left out)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-4)
    assert any(not torch.equal(a[k], init[k]) for k in a)  # the merged adapters moved them
    from transformers import AutoModelForCausalLM
    ids = torch.tensor([[5, 9, 31, 77]])
    with torch.no_grad():
        la = AutoModelForCausalLM.from_pretrained(runs["single"] / "checkpoints/step_3")(input_ids=ids).logits
        lb = AutoModelForCausalLM.from_pretrained(runs["fsdp"] / "checkpoints/step_3")(input_ids=ids).logits
    torch.testing.assert_close(lb, la, rtol=0, atol=1e-4)


# --- each env's demonstrations at their own rate (the cold start's per-env cold_start_lr) --
def test_per_env_rates_scale_each_step_by_its_rows_envs():
    from agentgym.trainers.sft import step_lr_scales
    envs = ["search", "search", "code", "code"]
    rates = {"search": 2e-4, "code": 1e-4}
    assert step_lr_scales([[0, 1], [2, 3], [0, 2]], envs, rates) == \
        pytest.approx([1.0, 0.5, 0.75])
    assert step_lr_scales([[0, 1], [2]], envs, None) == [1.0, 1.0]
    with pytest.raises(ValueError, match=r"no learning rate for env\(s\) \['code'\]"):
        step_lr_scales([[2]], envs, {"search": 2e-4})
    cfg = build_config({"env": "search,code", "trainer.cold_start_lr": [2e-4, 1e-4]})
    assert cfg.per_env["trainer.cold_start_lr"] == [2e-4, 1e-4]
    assert cfg.trainer.cold_start_lr == 2e-4  # the key holds the largest: the SFT's peak
    with pytest.raises(ValueError, match=r"trainer.cold_start_lr=\[0.0002\] gives 1 values"):
        build_config({"env": "search,code", "trainer.cold_start_lr": [2e-4]})


def test_a_step_at_half_rate_is_the_half_rate_optimizers_step_and_the_next_is_on_schedule(
        tiny_path):
    """``train_step(lr_scale=0.5)`` at rate r moves the weights as a step at r / 2 does, and
    the step after it is back on r's schedule."""
    from agentgym.trainers.backends.base import ModelSpec
    from agentgym.trainers.backends.single import SingleBackend
    from agentgym.trainers.batch import collate
    from agentgym.core.types import Trajectory
    from agentgym.trainers.sft import sft_loss_fn
    t = Trajectory(uid="a")
    t.append("prompt", [5, 6, 7, 8], 0)
    t.append("generated", [9, 10, 11], 0, logprobs=[0.0] * 3)
    batch = collate([t], 0)
    loss = sft_loss_fn(3.0)
    scaled = SingleBackend(ModelSpec(str(tiny_path)).load(), lr=1e-2, weight_decay=0.1)
    half = SingleBackend(ModelSpec(str(tiny_path)).load(), lr=5e-3, weight_decay=0.1)
    a = scaled.train_step(scaled.split(batch), loss, lr_scale=0.5)
    b = half.train_step(half.split(batch), loss)
    assert a["lr"] == pytest.approx(5e-3) and b["lr"] == pytest.approx(5e-3)
    wa, wb = scaled.state_dict(), half.state_dict()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=0, rtol=0)
    assert [g["lr"] for g in scaled.optimizer.param_groups] == [pytest.approx(1e-2)] * \
        len(scaled.optimizer.param_groups)
    assert scaled.train_step(scaled.split(batch), loss)["lr"] == pytest.approx(1e-2)
