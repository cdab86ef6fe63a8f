"""Envs and rewards from the user's own code (envs.plugins): a throw-away package installed
(pip, into a temporary site dir) registers its env through the ``agentgym.envs`` entry
point group and trains 2 steps; ``env=package.module:Class`` and ``reward=package.module:fn``
work without installing anything; bad specs say what is wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ENV_MODULE = textwrap.dedent('''
    """An env in under 50 lines: say the word the prompt asks for, in <answer> tags."""
    import re

    from agentgym.envs.base import AgentEnv


    class EchoEnv(AgentEnv):
        stop_strings = ("</answer>",)

        def _reset(self, row):
            row = row or {"prompt": [{"role": "user", "content": "Say: blue"}],
                          "reward_model": {"ground_truth": "blue"}}
            self.target = row["reward_model"]["ground_truth"]
            return [dict(m) for m in row["prompt"]], {}

        def _step(self, action, last_turn):
            m = re.search(r"<answer>(.*?)</answer>", action, re.S)
            if m is None:
                self.count("malformed_actions")
                return [{"role": "user", "content": "Answer in <answer></answer>."}], 0.0, False, {}
            return [], float(m.group(1).strip() == self.target), True, {}
''')

REWARDS_MODULE = textwrap.dedent('''
    def length_score(data_source, solution_str, ground_truth, extra_info=None):
        """verl's custom-reward signature; a dict carries extra numbers."""
        return {"score": len(solution_str) / 1000.0, "chars": len(solution_str),
                "source_seen": data_source == "echo"}


    def broken(data_source, solution_str, ground_truth, extra_info=None):
        raise RuntimeError("reward service unreachable")


    NOT_CALLABLE = 3
''')


def _rows(path: Path, env: str, n: int = 4) -> Path:
    words = ["blue", "red", "green", "gold"]
    with open(path, "w") as f:
        for i in range(n):
            w = words[i % len(words)]
            f.write(json.dumps({"env": env, "data_source": "echo",
                                "prompt": [{"role": "user", "content": f"Say: {w}"}],
                                "reward_model": {"ground_truth": w},
                                "extra_info": {"index": i}}) + "\n")
    return path


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> Path:
    """``agentgym-echo-plugin`` built and installed with pip into a temporary site dir."""
    src = tmp_path_factory.mktemp("plugin_src")
    (src / "echo_plugin").mkdir()
    (src / "echo_plugin" / "__init__.py").write_text("")
    (src / "echo_plugin" / "env.py").write_text(ENV_MODULE)
    (src / "echo_plugin" / "rewards.py").write_text(REWARDS_MODULE)
    (src / "pyproject.toml").write_text(textwrap.dedent('''
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "agentgym-echo-plugin"
        version = "0.1"

        [project.entry-points."agentgym.envs"]
        echo = "echo_plugin.env:EchoEnv"

        [tool.setuptools]
        packages = ["echo_plugin"]
    '''))
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--no-build-isolation", "--disable-pip-version-check", "--target",
                    str(site), str(src)], check=True, timeout=600)
    assert (site / "echo_plugin" / "env.py").exists()
    return site


def _agentgym(site: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    return subprocess.run([sys.executable, "-m", "agentgym.cli", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


def test_an_installed_package_registers_its_env_and_trains_on_it(plugin_site, tmp_path):
    checked = _agentgym(plugin_site, "check-env", "echo", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "ok    agentgym-echo-plugin/echo-v0" in checked.stdout
    rows = _rows(tmp_path / "echo.jsonl", "echo")
    run = tmp_path / "run"
    done = _agentgym(plugin_site, "train", "env=echo", f"data={rows}", "model=tiny",
                     f"run_dir={run}", "trainer.total_steps=2", "trainer.prompts_per_step=2",
                     "n=2", "trainer.eval_limit=0", "rollout.max_tokens_per_turn=8",
                     "rollout.max_turns=2", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "rollout/reward" in m]
    assert [m["step"] for m in steps] == [1, 2] and all(m["rollout/count"] == 4 for m in steps)
    assert "no demonstration builder" in done.stdout + done.stderr  # RL from the model as is


def test_env_and_reward_by_spec_without_installing(plugin_site, tmp_path, monkeypatch):
    """``env=echo_plugin.env:EchoEnv`` registers on first use (rows may name the class spec
    or the id); ``reward=…:length_score`` replaces the env's reward with verl's signature."""
    monkeypatch.syspath_prepend(str(plugin_site))
    from agentgym import envs
    from agentgym.cli import main
    spec = "echo_plugin.env:EchoEnv"
    env_id = envs.resolve_env_id(spec)
    assert env_id == "echo_plugin/EchoEnv-v0" and envs.resolve_env_id(spec) == env_id
    rows = _rows(tmp_path / "rows.jsonl", env_id, n=3)
    out = tmp_path / "trajs.jsonl"
    assert main(["rollout", f"env={spec}", f"data={rows}", "model=tiny", f"out={out}",
                 "reward=echo_plugin.rewards:length_score", "rollout.max_tokens_per_turn=8",
                 "rollout.max_turns=2"]) == 0
    trajs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(trajs) == 3
    for t in trajs:
        # the function's score over the episode's text, its extra numbers in the info
        assert t["reward"] == pytest.approx(t["info"]["chars"] / 1000.0)
        assert t["info"]["chars"] > 0 and t["info"]["source_seen"] is True
        assert t["info"]["env_reward"] in (0.0, 1.0)


def test_a_failing_reward_scores_zero_and_says_why(plugin_site, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_site))
    from agentgym.envs.plugins import RewardOverride
    env = RewardOverride(__import__("echo_plugin.env", fromlist=["EchoEnv"]).EchoEnv(),
                         "echo_plugin.rewards:broken")
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step("<answer>blue</answer>")
    assert terminated and reward == 0.0 and info["env_reward"] == 1.0
    assert info["reward_error"] == "RuntimeError: reward service unreachable"
    assert info["reward_failures"] == 1


@pytest.mark.parametrize("spec,message", [
    ("no_such_pkg.mod:Env", "cannot import 'no_such_pkg.mod'"),
    ("echo_plugin.env:Nope", "the module has no 'Nope'"),
    ("echo_plugin.rewards:length_score", "not a subclass of envs.base.AgentEnv"),
])
def test_bad_env_specs_say_what_is_wrong(plugin_site, monkeypatch, spec, message):
    monkeypatch.syspath_prepend(str(plugin_site))
    from agentgym import envs
    with pytest.raises(ValueError, match=message):
        envs.resolve_env_id(spec)


def test_bad_reward_specs_say_what_is_wrong(plugin_site, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_site))
    from agentgym.envs.plugins import load_reward
    with pytest.raises(ValueError, match="not a function"):
        load_reward("echo_plugin.rewards:NOT_CALLABLE")
    with pytest.raises(ValueError, match="expected 'package.module:attr'"):
        load_reward("length_score")
