"""The judge reward (envs.judge) against real servers on loopback: ``agentgym serve``'s
``/v1/chat/completions`` (a real engine; and the same app with a scripted model output for
a known score), a server that is down, one that answers 503 first (an injected fault), and
the concurrency cap."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from agentgym.rollout.engines.launcher import launch_serve
from agentgym.supervision.server_process import free_port
from agentgym.envs.judge import JudgeError, JudgeReward, parse_score
from agentgym.envs.plugins import RewardOverride
from fakes import FlakyProxyFault


@pytest.fixture(scope="module")
def served_tiny(tiny_path):
    server = launch_serve(str(tiny_path))
    yield server.url
    server.stop()


def test_serve_speaks_openai_chat_completions(served_tiny):
    r = httpx.post(f"{served_tiny}/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and len(body["choices"]) == 1
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    assert 0 < body["usage"]["completion_tokens"] <= 5
    for bad, word in (({"messages": []}, "messages"), ({"messages": [{"role": "x", "content": "a"}]},
                                                       "role"),
                      ({"messages": [{"role": "user", "content": "a"}], "logit_bias": {"1": 3}},
                       "logit_bias")):
        r = httpx.post(f"{served_tiny}/v1/chat/completions", json=bad, timeout=60)
        assert r.status_code == 400 and word in r.json()["error"]["message"]


def test_judge_against_a_real_engine_reports_an_unparsable_reply(served_tiny):
    """``tiny`` (random weights) answers, but not 'Score: N': a JudgeError saying so."""
    judge = JudgeReward(url=served_tiny, max_tokens=8)
    with pytest.raises(JudgeError, match="no 'Score: N' in the judge's reply"):
        judge("nq", "<answer> Paris </answer>", ["Paris"], {"question": "capital of France?"})


def test_judge_scores_a_scripted_reply_and_sends_the_row(scripted_server, tiny_tokenizer):
    url, engine = scripted_server(["I think it matches.\nScore: 8"])
    judge = JudgeReward(url=url, scale=10)
    assert judge("nq", "... <answer> Paris </answer>", ["Paris", "paris"],
                 {"question": "capital of France?"}) == pytest.approx(0.8)
    prompt = tiny_tokenizer.decode(engine.prompts[0])
    assert "capital of France?" in prompt and "Reference answer: Paris, paris" in prompt
    assert "<answer> Paris </answer>" in prompt and "0 to 10" in prompt


def test_a_judged_episode_gets_the_score_and_a_dead_judge_scores_zero(scripted_server):
    from agentgym.envs.search import SearchEnv, search_row
    url, _ = scripted_server(["Score: 10"])
    row = {**search_row("capital of australia?", ["Canberra"]), "data_source": "nq"}
    env = RewardOverride(SearchEnv(retriever_url="http://127.0.0.1:9"), JudgeReward(url=url))
    env.reset(seed=0, options={"row": row})
    _, reward, terminated, _, info = env.step("<answer> Canberra </answer>")
    assert terminated and reward == 1.0 and info["env_reward"] == 1.0
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = RewardOverride(SearchEnv(retriever_url="http://127.0.0.1:9"),
                         JudgeReward(url=down, retries=1, timeout_s=5))
    env.reset(seed=0, options={"row": row})
    _, reward, _, _, info = env.step("<answer> Canberra </answer>")
    assert reward == 0.0 and info["reward_failures"] == 1
    assert info["reward_error"].startswith(f"JudgeError: judge at {down} failed 2 times; last: "
                                           f"ConnectError")


def test_judge_retries_a_503_then_succeeds(scripted_server):
    url, _ = scripted_server(["Score: 5"])
    proxy = FlakyProxyFault(url, fail_first=2, status=503, path="/v1/chat/completions")
    try:
        assert JudgeReward(url=proxy.url, retries=2)("nq", "x", "y") == pytest.approx(0.5)
        assert proxy.seen == {"failed": 2, "forwarded": 1}
    finally:
        proxy.close()


def test_judge_timeouts_and_the_concurrency_cap(scripted_server):
    url, engine = scripted_server(["Score: 1"] * 6, delay_s=1.0)  # 3 rounds of 2
    judge = JudgeReward(url=url, max_concurrency=2, retries=0, timeout_s=60)
    with ThreadPoolExecutor(6) as pool:
        scores = list(pool.map(lambda i: judge("nq", f"answer {i}", "gold"), range(6)))
    assert scores == [pytest.approx(0.1)] * 6 and engine.most == 2
    slow, _ = scripted_server(["Score: 1"], delay_s=5.0)
    with pytest.raises(JudgeError, match=r"failed 1 times; last: timed out after 0.5 s"):
        JudgeReward(url=slow, retries=0, timeout_s=0.5)("nq", "x", "y")


@pytest.mark.parametrize("reply,score", [("Score: 7", 0.7), ("score=3.5 then Score: 9", 0.9),
                                         ("Score: 14", 1.0), ("Score: -2", 0.0)])
def test_parse_score(reply, score):
    assert parse_score(reply, 10) == pytest.approx(score)


def test_bad_judge_settings_say_what_is_wrong():
    with pytest.raises(ValueError, match="judge.url=''"):
        JudgeReward(url="")
    with pytest.raises(ValueError, match="judge.scale"):
        JudgeReward(url="http://x", scale=0)
