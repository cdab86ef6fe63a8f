"""State masking and multi-turn assembly, with scripted model output and real envs."""

from __future__ import annotations

import asyncio
import threading
import time

import gymnasium
import pytest
from fakes import DeadRetrieverFault, ScriptedEngine, TimeoutRetrieverFault

from agentgym.rollout.chat import ChatTokens
from agentgym.config import RolloutConfig
from agentgym.rollout.manager import GenerationManager, summarize
from agentgym.envs.base import MessagesSpace, TextSpace
from agentgym.envs.search import INVALID_ACTION, SearchEnv, search_row

ROW = search_row("what is the capital of australia", ["Canberra"], source="test")


def run(engine, tok, env_factory, **cfg):
    mgr = GenerationManager(engine, tok, env_factory, RolloutConfig(**cfg))
    try:
        return asyncio.run(mgr.play_one(ROW, uid="q0"))
    finally:
        mgr.close()


def assert_mask_exact(traj, engine, tok):
    """Mask is 1 exactly on the engine's tokens, and they decode to what it produced."""
    traj.check()
    produced = [i for ids in engine.produced for i in ids]
    assert traj.sampled_ids() == produced
    for seg in traj.segments:
        sampled = seg.kind == "generated"
        assert all(m == int(sampled) for m in traj.loss_mask[seg.start:seg.end])
    gen_segs = [s for s in traj.segments if s.kind == "generated"]
    assert [traj.token_ids[s.start:s.end] for s in gen_segs] == engine.produced
    assert [traj.logprobs[s.start:s.end] for s in gen_segs] == \
        [[-0.25 * (k + 1) for k in range(len(ids))] for ids in engine.produced]
    text = tok.decode(traj.sampled_ids(), skip_special_tokens=False)
    assert text == "".join(tok.decode(ids, skip_special_tokens=False) for ids in engine.produced)


def test_search_turns_mask_and_reward(tiny_tokenizer, retriever_url):
    tok = tiny_tokenizer
    engine = ScriptedEngine(tok, [
        "<think>I need the capital.</think><search> capital of Australia </search>",
        "<think>It says Canberra.</think><answer> Canberra </answer>",
    ])
    traj = run(engine, tok, lambda: SearchEnv(retriever_url=retriever_url))
    assert_mask_exact(traj, engine, tok)
    kinds = [s.kind for s in traj.segments]
    assert kinds == ["prompt", "generated", "observation", "generated"]
    obs = traj.segments[2]
    obs_text = tok.decode(traj.token_ids[obs.start:obs.end])
    assert obs_text.startswith("\n\n<information>Doc 1(Title:") and \
        obs_text.endswith("</information>\n\n")
    # The second request's prompt is exactly the running token stream.
    assert engine.prompts[1] == traj.token_ids[:traj.segments[3].start]
    assert traj.terminated and not traj.truncated and traj.reward == 1.0
    assert traj.metrics["tool_calls"] == 1 and traj.metrics["turns"] == 2


def test_malformed_and_unclosed_tags_become_observations(tiny_tokenizer, retriever_url):
    tok = tiny_tokenizer
    engine = ScriptedEngine(tok, [
        "I will just talk without any tags.",
        "<search> unclosed search",
        "<answer>Sydney</answer>",
    ])
    traj = run(engine, tok, lambda: SearchEnv(retriever_url=retriever_url))
    assert_mask_exact(traj, engine, tok)
    obs_texts = [tok.decode(traj.token_ids[s.start:s.end]) for s in traj.segments
                 if s.kind == "observation"]
    assert obs_texts == [INVALID_ACTION, INVALID_ACTION]
    assert traj.metrics["malformed_actions"] == 2
    assert traj.terminated and traj.reward == 0.0 and traj.info["em"] == 0.0


def test_sampled_eos_is_masked_in_and_kept(tiny_tokenizer, retriever_url):
    tok = tiny_tokenizer
    engine = ScriptedEngine(tok, ["no tags here + eos", "<answer>Canberra</answer> + eos"])
    traj = run(engine, tok, lambda: SearchEnv(retriever_url=retriever_url))
    assert_mask_exact(traj, engine, tok)
    eos_positions = [i for i, t in enumerate(traj.token_ids) if t == tok.eos_token_id
                     and i >= traj.prompt_length]
    assert eos_positions and all(traj.loss_mask[i] == 1 for i in eos_positions)
    # Prompt EOS tokens (chat template ends of turns) stay masked out.
    assert all(traj.loss_mask[i] == 0 for i in range(traj.prompt_length))
    assert traj.reward == 1.0


def test_tool_call_at_the_token_budget_truncates(tiny_tokenizer, retriever_url):
    tok = tiny_tokenizer
    first = "<search> Canberra </search>"
    probe = ScriptedEngine(tok, [first, "<answer>x</answer>"])
    used = run(probe, tok, lambda: SearchEnv(retriever_url=retriever_url)).segments[2].end
    budget = used - len(probe.prompts[0]) + 60  # turn 1 + its observation + 60 tokens
    long_call = "<search> " + "very " * 200 + "long query </search>"
    engine = ScriptedEngine(tok, [first, long_call])
    traj = run(engine, tok, lambda: SearchEnv(retriever_url=retriever_url),
               max_response_tokens=budget, max_tokens_per_turn=256)
    assert_mask_exact(traj, engine, tok)
    assert traj.truncated and not traj.terminated
    # The unclosed call was cut by the remaining budget (60), not the per-turn cap (256);
    # the env saw it as malformed, and its observation no longer fit.
    second = [s for s in traj.segments if s.kind == "generated"][1]
    assert len(second) == 60 and traj.response_length == budget
    assert traj.info.get("end") == "token_budget" and traj.metrics["malformed_actions"] == 1


def test_max_turns_truncates(tiny_tokenizer, retriever_url):
    tok = tiny_tokenizer
    engine = ScriptedEngine(tok, ["<search> a </search>", "<search> b </search>"])
    traj = run(engine, tok, lambda: SearchEnv(retriever_url=retriever_url, max_turns=2))
    assert_mask_exact(traj, engine, tok)
    assert traj.truncated and not traj.terminated and traj.metrics["turns"] == 2


@pytest.mark.parametrize("fault, name", [(DeadRetrieverFault, "ToolUnavailable"),
                                         (TimeoutRetrieverFault, "ToolTimeout")])
def test_tool_failures_become_observations(tiny_tokenizer, fault, name):
    tok = tiny_tokenizer
    engine = ScriptedEngine(tok, ["<search> x </search>", "<answer>Canberra</answer>"])
    traj = run(engine, tok, lambda: SearchEnv(retriever=fault()), on_infra_error="keep")
    assert_mask_exact(traj, engine, tok)
    obs = [tok.decode(traj.token_ids[s.start:s.end]) for s in traj.segments
           if s.kind == "observation"]
    assert len(obs) == 1 and f"Search failed ({name})" in obs[0]
    assert traj.metrics["tool_failures"] == 1 and traj.reward == 1.0
    # not the policy's failure: the episode is marked, with the reason
    assert traj.metrics["infra_failures"] == 1 and traj.metrics["infra_retried"] == 0
    assert traj.info["infra_error"].startswith(f"search: {name}: ")


def test_an_infra_failed_episode_is_replayed_once_with_the_same_seed(tiny_tokenizer):
    tok = tiny_tokenizer
    turns = ["<search> x </search>", "<answer>Canberra</answer>"]
    engine = ScriptedEngine(tok, turns * 2)
    traj = run(engine, tok, lambda: SearchEnv(retriever=DeadRetrieverFault()))
    assert len(engine.produced) == 4 and engine.prompts[2] == engine.prompts[0]
    assert traj.metrics["infra_retried"] == 1 and traj.metrics["infra_failures"] == 1


def test_a_bad_request_is_the_policys_failure_not_the_infrastructures(tiny_tokenizer):
    from agentgym.tools.errors import ToolBadRequest

    class RejectingRetriever:  # fault injection: the server answers 4xx to the query
        def retrieve(self, queries):
            raise ToolBadRequest("query too long (injected fault)")

        def close(self):
            pass

    tok = tiny_tokenizer
    engine = ScriptedEngine(tok, ["<search> x </search>", "<answer>Canberra</answer>"])
    traj = run(engine, tok, lambda: SearchEnv(retriever=RejectingRetriever()))
    assert len(engine.produced) == 2  # not replayed
    assert traj.metrics["tool_failures"] == 1 and traj.metrics["infra_failures"] == 0
    assert "infra_error" not in traj.info


def test_dead_retriever_url_is_an_observation(tiny_tokenizer):
    tok = tiny_tokenizer
    engine = ScriptedEngine(tok, ["<search> x </search>", "<answer>Canberra</answer>"])
    traj = run(engine, tok, lambda: SearchEnv(retriever_url="http://127.0.0.1:9", timeout=0.5),
               on_infra_error="keep")
    assert traj.metrics["tool_failures"] == 1 and traj.terminated
    assert traj.metrics["infra_failures"] == 1


class ChatToy(gymnasium.Env):
    """A chat-format env: the observation is a new user message, answer 'yes' to end."""

    observation_format = "chat"
    stop_strings = ("</try>",)

    def __init__(self):
        self.action_space, self.observation_space = TextSpace(), MessagesSpace()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "say yes"}], {}

    def step(self, action):
        done = "yes" in action
        obs = [] if done else [{"role": "user", "content": "no, say yes"}]
        return obs, float(done), done, False, {}


def test_chat_format_filler_closes_turns(tiny_tokenizer):
    tok = tiny_tokenizer
    chat = ChatTokens(tok)
    assert chat.assistant_close == tok.eos_token + "\n"
    # Turn 1 stops at a stop string (template closing appended as filler, mask 0);
    # turn 2 samples EOS itself (only the newline is filler).
    engine = ScriptedEngine(tok, ["<try>no</try>", "maybe + eos", "yes + eos"])
    traj = run(engine, tok, ChatToy)
    assert_mask_exact(traj, engine, tok)
    kinds = [s.kind for s in traj.segments]
    assert kinds == ["prompt", "generated", "filler", "observation",
                     "generated", "filler", "observation", "generated"]
    fillers = [tok.decode(traj.token_ids[s.start:s.end]) for s in traj.segments
               if s.kind == "filler"]
    assert fillers == [tok.eos_token + "\n", "\n"]
    # The whole stream equals the chat template of the full conversation.
    full = tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say yes"},
         {"role": "assistant", "content": "<try>no</try>"},
         {"role": "user", "content": "no, say yes"}, {"role": "assistant", "content": "maybe"},
         {"role": "user", "content": "no, say yes"}], tokenize=False,
        add_generation_prompt=True) + "yes" + tok.eos_token
    assert tok.decode(traj.token_ids, skip_special_tokens=False) == full


def test_many_trajectories_progress_independently(tiny_tokenizer, retriever_url):
    tok = tiny_tokenizer
    script = ["<answer>Canberra</answer>"] * 6
    engine = ScriptedEngine(tok, script, delay_s=0.01)
    mgr = GenerationManager(engine, tok, lambda: SearchEnv(retriever_url=retriever_url),
                            RolloutConfig(n=3))
    trajs = asyncio.run(mgr.run([ROW, {**ROW, "extra_info": {"index": 7}}]))
    mgr.close()
    assert [t.sample_index for t in trajs] == [0, 1, 2, 0, 1, 2]
    assert len({t.uid for t in trajs}) == 2
    s = summarize(trajs)
    assert s["reward"] == 1.0 and s["format_valid"] == 1.0 and s["count"] == 6
    # an env's own verdict (env=swe: a diff that applies) is the summary's, as in eval's
    # episodes: two of six ended on their own but were not format-valid by the env's rule
    for t in trajs[:2]:
        t.info["format_valid"] = 0.0
    assert summarize(trajs)["format_valid"] == 4 / 6


class SlowToolEnv(ChatToy):
    """Each step blocks its thread (a slow tool); records how many steps overlap."""

    observation_format = "inline"
    lock, active, peak, loop_thread_steps = threading.Lock(), 0, 0, 0

    def step(self, action):
        cls = SlowToolEnv
        if threading.current_thread() is threading.main_thread():
            cls.loop_thread_steps += 1
        with cls.lock:
            cls.active += 1
            cls.peak = max(cls.peak, cls.active)
        time.sleep(0.2)
        with cls.lock:
            cls.active -= 1
        return [], 1.0, True, False, {}


def test_env_steps_run_off_the_event_loop_and_overlap(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, ["yes"] * 4)
    mgr = GenerationManager(engine, tiny_tokenizer, SlowToolEnv, RolloutConfig(n=4))
    trajs = asyncio.run(mgr.run([ROW]))
    mgr.close()
    assert len(trajs) == 4 and all(t.reward == 1.0 for t in trajs)
    assert SlowToolEnv.loop_thread_steps == 0  # never on the event loop's thread
    assert SlowToolEnv.peak >= 2  # blocking steps of different trajectories overlapped


def test_the_trajectory_writer_masks_by_kind_and_writes_nothing_that_does_not_fit(
        tiny_tokenizer):
    """The one writer of token ids and masks (rollouts, demonstrations, agents' calls)."""
    from agentgym.core.types import Trajectory
    from agentgym.rollout.writer import TrajectoryWriter
    chat = ChatTokens(tiny_tokenizer)
    w = TrajectoryWriter(Trajectory(), chat, "chat")
    w.prompt(chat.prompt_ids([{"role": "user", "content": "capital of Australia?"}]))
    action = w.written("<search> capital </search>", 0, ("</search>",))
    assert action == chat.encode("<search> capital </search>")  # ends at a stop: no EOS
    said = [{"role": "user", "content": "Canberra"}]
    filler, obs = w.after_action(action, said, 0)
    t = w.traj
    assert filler and obs and t.token_ids[-len(obs):] == obs
    assert t.loss_mask == [0] * t.prompt_length + [1] * len(action) + [0] * (len(filler) +
                                                                          len(obs))
    assert [s.kind for s in t.segments] == ["prompt", "generated", "filler", "observation"]
    written = list(t.token_ids)  # a budget the observation would reach: nothing written
    assert w.after_action(action, said, 1,
                          max_response=t.response_length + len(filler) + len(obs)) is None
    assert t.token_ids == written
    w.sampled([7, 8], [-0.5, -0.25], 1)
    assert w.extend(t.token_ids + [5, 6], 2) and t.token_ids[-2:] == [5, 6]
    assert t.segments[-1].kind == "observation" and t.loss_mask[-4:] == [1, 1, 0, 0]
    assert not w.extend([9] + t.token_ids, 3) and t.segments[-1].turn == 2
    t.check()
