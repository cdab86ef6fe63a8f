"""``env=openenv``: an OpenEnv server written with ``openenv-core``'s own helpers
(``agentgym.tools.openenv_guess``, served by uvicorn on loopback, no mock of the package)
played over its WebSocket protocol: the episode holds what the server sent, a refused
action is the policy's, and a server killed mid-training is restarted with its failed
episodes kept out of the update."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal

import pytest

pytest.importorskip("openenv")
pytest.importorskip("websockets")

from agentgym.cli import main  # noqa: E402
from agentgym.config import RolloutConfig  # noqa: E402
from agentgym.envs import check_env  # noqa: E402
from agentgym.envs.openenv_env import (DEFAULT_APP, OpenEnvConfig, OpenEnvEnv,  # noqa: E402
                                       _SERVED, seed_rows, served_url, stop_served)
from agentgym.rollout.engines.base import ENGINES  # noqa: E402
from agentgym.rollout.manager import GenerationManager  # noqa: E402
from agentgym.trainers import loop  # noqa: E402
from conftest import wait_until  # noqa: E402
from fakes import ScriptedEngine  # noqa: E402


def _target(seed: int) -> int:  # the guessing game's number for a seed (openenv_guess.py)
    return random.Random(seed).randint(1, 20)


@pytest.fixture
def server():
    url = served_url(DEFAULT_APP)
    yield url
    stop_served()


def test_the_env_passes_the_contract_against_a_real_server(server):
    env = OpenEnvEnv(url=server)
    try:
        check_env(env)
        row = seed_rows(OpenEnvConfig(size=8))[3]
        obs, info = env.reset(options={"row": row})
        assert info["seed"] == 3 and "Guess it" in obs[-1]["content"]
        wrong = 1 if _target(3) != 1 else 2
        obs, reward, terminated, _, info = env.step(f'I guess {{"guess": {wrong}}}')
        assert obs == [{"role": "user", "content": f"{wrong} is wrong: the number is "
                        f"{'higher' if wrong < _target(3) else 'lower'}."}]
        assert (reward, terminated) == (0.0, False)
        obs, reward, _, _, info = env.step('{"guess": "seven"}')  # the server's validation
        assert "VALIDATION_ERROR" in obs[0]["content"] and "guess" in obs[0]["content"]
        assert info["malformed_actions"] == 1 and info["infra_failures"] == 0
        _, reward, terminated, _, _ = env.step(f'{{"guess": {_target(3)}}}')
        assert (reward, terminated) == (1.0, True)
    finally:
        env.close()


def test_an_episode_holds_the_tokens_and_rewards_the_server_sent(server, tiny_tokenizer):
    seed = 5
    wrong = 1 if _target(seed) != 1 else 2
    replies = [f'{{"guess": {wrong}}}', f'<action>{{"guess": {_target(seed)}}}</action>']
    engine = ScriptedEngine(tiny_tokenizer, [f"{r} + eos" for r in replies])
    mgr = GenerationManager(engine, tiny_tokenizer, lambda: OpenEnvEnv(url=server),
                            RolloutConfig(max_turns=4))
    try:
        traj = asyncio.run(mgr.play_one(seed_rows(OpenEnvConfig(size=8))[seed], uid="s5"))
    finally:
        mgr.close()
    text = {s.kind: [] for s in traj.segments}
    for s in traj.segments:
        text[s.kind].append(tiny_tokenizer.decode(traj.token_ids[s.start:s.end]))
    assert "Guess it" in text["prompt"][0]
    assert any(f"{wrong} is wrong" in o for o in text["observation"])
    assert [tiny_tokenizer.decode(ids) for ids in engine.produced] == \
        [r + tiny_tokenizer.eos_token for r in replies]
    sampled = [t for t, m in zip(traj.token_ids, traj.loss_mask) if m]
    assert sampled == [t for ids in engine.produced for t in ids]  # the mask: replies only
    assert traj.reward == 1.0 and traj.terminated


class _GuessingEngine(ScriptedEngine):
    """Scripted model output for a training run of the guessing game: the number of the
    episode's seed on even samples, a wrong one on odd samples (reward variance), read
    from the seed the test registers per prompt. A fake of the model's output only."""

    needs_model = False
    on_reply = None

    def __init__(self, tokenizer):
        self.tok, self.replies = tokenizer, 0

    async def generate(self, prompt_ids, sampling, images=None, session_id=None):
        self.replies += 1
        if self.on_reply is not None:
            self.on_reply(self.replies)
        uid, sample = str(session_id).split("/")[:2]
        seed = int(uid.rsplit("-", 1)[1])
        guess = _target(seed) if int(sample) % 2 == 0 else (1 if _target(seed) != 1 else 2)
        ids = self.tok.encode(f'{{"guess": {guess}}}', add_special_tokens=False) + \
            [self.tok.eos_token_id]
        from agentgym.core.types import GenerateOutput
        return GenerateOutput(ids, [-1.0] * len(ids), "stop")

    @classmethod
    def from_config(cls, cfg, model, tokenizer):
        return cls(tokenizer)


if "test-guessing" not in ENGINES:
    ENGINES.register("test-guessing", _GuessingEngine)


def test_a_killed_server_is_restarted_and_its_failed_episodes_are_not_trained_on(
        tmp_path, monkeypatch):
    killed = []

    def kill_once(k: int) -> None:
        if k == 6 and not killed:  # mid step 2: the served process dies
            app = next(iter(_SERVED.values()))
            killed.append(app.server.pid)
            os.killpg(app.server.pid, signal.SIGKILL)
            wait_until(lambda: not app.server.alive, 30, "the killed server's exit")

    monkeypatch.setattr(_GuessingEngine, "on_reply", staticmethod(kill_once))
    trained: list[str] = []
    update = loop.update_policy

    def recording_update(cfg, backend, batch, *args, **kwargs):
        from agentgym.models.zoo import load_tokenizer, resolve_model
        tok = load_tokenizer(resolve_model("tiny"))
        for ids, keep in zip(batch.input_ids, batch.attention_mask):
            trained.append(tok.decode(ids[keep.bool()].tolist()))
        return update(cfg, backend, batch, *args, **kwargs)

    monkeypatch.setattr(loop, "update_policy", recording_update)
    run = tmp_path / "run"
    try:
        assert main(["train", "env=openenv", "model=tiny", "engine=test-guessing",
                     "trainer.total_steps=3", "trainer.prompts_per_step=2", "n=2",
                     "rollout.max_turns=1", "trainer.cold_start=off", "trainer.eval_limit=0",
                     f"run_dir={run}"]) == 0
    finally:
        stop_served()
    assert killed, "the fault was never injected"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "rollout/reward" in s] == [1, 2, 3]
    by_step = {s["step"]: s for s in steps if "rollout/reward" in s}
    assert len(killed) == 1 and [by_step[k]["infra/restarts"] for k in (1, 2, 3)] == [0, 1, 1]
    assert by_step[1]["rollout/infra_failed"] == 0 and by_step[2]["rollout/infra_failed"] >= 1
    assert all(m["rollout/infra_dropped"] == 0 for m in by_step.values())
    # the failed plays were replayed once the server was back, and only the replays count:
    # every step's reward is the right half of its samples, every sequence trained whole
    assert [by_step[k]["rollout/reward"] for k in (1, 2, 3)] == [0.5, 0.5, 0.5]
    assert len(trained) == 12 and not [t for t in trained if "unavailable" in t]
