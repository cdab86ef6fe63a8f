"""Core types (one mask definition), the registry and the typed config."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentgym.config import Config, build_config, set_key
from agentgym.core.overrides import parse_overrides
from agentgym.core.registry import Registry
from agentgym.core.types import Trajectory


def test_trajectory_mask_follows_segment_kind():
    t = Trajectory()
    t.append("prompt", [1, 2, 3], turn=0)
    t.append("generated", [4, 5], turn=0, logprobs=[-0.1, -0.2])
    t.append("observation", [6, 7, 8], turn=0)
    t.append("filler", [9], turn=0)
    t.append("generated", [10], turn=1, logprobs=[-0.3])
    t.check()
    assert t.loss_mask == [0, 0, 0, 1, 1, 0, 0, 0, 0, 1]
    assert t.logprobs == [0, 0, 0, -0.1, -0.2, 0, 0, 0, 0, -0.3]
    assert t.sampled_ids() == [4, 5, 10] and t.prompt_length == 3 and t.response_length == 7
    assert Trajectory.from_dict(t.to_dict()) == t


def test_trajectory_rejects_inconsistencies():
    t = Trajectory()
    with pytest.raises(ValueError, match="logprobs"):
        t.append("generated", [1, 2], turn=0, logprobs=[-1.0])
    with pytest.raises(ValueError, match="not sampled"):
        t.append("observation", [1], turn=0, logprobs=[-1.0])
    t.append("prompt", [1], turn=0)
    with pytest.raises(ValueError, match="first"):
        t.append("prompt", [2], turn=0)
    t.loss_mask[0] = 1
    with pytest.raises(ValueError, match="mask inside"):
        t.check()
    t.loss_mask.append(0)
    with pytest.raises(ValueError, match="length mismatch"):
        t.check()


def test_registry_duplicates_and_did_you_mean():
    r = Registry("widget")
    r.register("alpha", "json:dumps")
    with pytest.raises(ValueError, match="already registered"):
        r.register("alpha", object())
    with pytest.raises(KeyError, match="did you mean 'alpha'"):
        r.get("alpah")
    import json
    assert r.get("alpha") is json.dumps  # lazy entry point resolved on use


def test_config_overrides_and_shorthands():
    cfg = build_config(parse_overrides(["model=tiny", "n=4", "rollout.temperature=0.5",
                                        "engine.urls=[http://a, http://b]", "limit=8",
                                        "trainer.lr=1e-5"]))
    assert cfg.trainer.lr == 1e-5
    assert cfg.model.name == "tiny" and cfg.rollout.n == 4 and cfg.limit == 8
    assert cfg.rollout.temperature == 0.5 and cfg.engine.urls == ["http://a", "http://b"]


def test_yaml_boolean_words_stay_words_for_text_keys():
    """YAML 1.1 reads off/on/yes/no as booleans; a text key keeps the word, a boolean key
    still takes it."""
    cfg = build_config(parse_overrides(["trainer.cold_start=off", "engine.prefix_cache=off",
                                        "engine.continuous_batching=No", "data=nq",
                                        "data.answerable_only=false"]))
    assert cfg.trainer.cold_start == "off"
    assert cfg.engine.prefix_cache is False and cfg.engine.continuous_batching is False
    assert cfg.data.name == "nq" and cfg.data.answerable_only is False
    assert build_config(parse_overrides(["engine.prefix_cache=yes"])).engine.prefix_cache is True


def test_config_errors_name_the_bad_value():
    cfg = Config()
    with pytest.raises(KeyError, match="did you mean 'rollout.temperature'"):
        set_key(cfg, "rollout.temprature", 1.0)
    with pytest.raises(ValueError, match="rollout.n='four'"):
        set_key(cfg, "rollout.n", "four")
    with pytest.raises(ValueError, match="model.dtype='fp8'"):
        set_key(cfg, "model.dtype", "fp8")
    with pytest.raises(ValueError, match="rollout.max_turns must be >= 1"):
        set_key(cfg, "rollout.max_turns", 0)
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides(["model"])


def test_envs_and_tools_import_without_torch():
    code = ("import sys, envs, envs.search, tools.retriever, tools.local_retriever, "
            "agentgym.core.types; assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
