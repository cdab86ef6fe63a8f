"""The config's choices are stated once, by their owners (agentgym.core.choices): each owner
implements exactly its names, the config validates against them, and config.py copies none."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agentgym.config import AlgoConfig, build_config
from agentgym.core import choices
from agentgym.core.device import mixed_precision
from agentgym.rollout import context
from agentgym.trainers import algos
from agentgym.trainers.backends.ranks import RANK_BACKENDS
from agentgym.trainers.backends.single import lr_lambda
from agentgym.trainers.rollout_correction import behaviour_weights

#: each vocabulary with the section and key the config checks against it
VOCABULARIES = {
    "ADVANTAGES": ("algo", "advantage"), "POLICY_LOSSES": ("algo", "policy_loss"),
    "LOSS_AGG_MODES": ("algo", "loss_agg_mode"), "KL_ESTIMATORS": ("algo", "kl_estimator"),
    "KL_MODES": ("algo", "kl_mode"), "OFF_POLICY_MODES": ("algo", "off_policy"),
    "CONTEXT_STRATEGIES": ("rollout", "context"), "WEIGHT_SYNC_MODES": ("engine", "weight_sync"),
    "BACKENDS": ("trainer", "backend"), "ZERO_STAGES": ("trainer", "zero_stage"),
    "LR_SCHEDULES": ("trainer", "lr_schedule"),
    "MIXED_PRECISIONS": ("trainer", "mixed_precision"),
    "ON_INFRA_ERROR": ("rollout", "on_infra_error"),
}


def test_the_algorithms_owner_registers_exactly_its_names():
    assert set(algos.ADVANTAGES.names()) == set(choices.ADVANTAGES)
    assert set(algos.POLICY_LOSSES.names()) == set(choices.POLICY_LOSSES)
    assert {n for n, e in choices.ADVANTAGES.items() if e.needs_critic} == {"gae", "gae_turn"}
    for name, flags in choices.ADVANTAGES.items():
        assert AlgoConfig(advantage=name).needs_critic == flags.needs_critic, name
        assert algos.needs_groups(name) == flags.needs_groups, name


def test_every_named_mode_runs_in_its_owner_and_no_other_does():
    logp = torch.tensor([[0.0, -1.0, -2.0]])
    ref, mask = torch.tensor([[0.0, -1.5, -1.0]]), torch.tensor([[0, 1, 1]])
    for mode in choices.LOSS_AGG_MODES:
        assert torch.isfinite(algos.aggregate(logp, mask, mode, norm_len=4))
    for kind in choices.KL_ESTIMATORS:
        assert algos.kl_estimate(logp, ref, mask, kind)[0, 0] == 0
    for mode in choices.OFF_POLICY_MODES:
        weights, _ = behaviour_weights(logp, ref, mask, mode)
        assert weights.shape == logp.shape
    for bad, run in [("token-sum", lambda m: algos.aggregate(logp, mask, m)),
                     ("k4", lambda m: algos.kl_estimate(logp, ref, mask, m)),
                     ("is", lambda m: behaviour_weights(logp, ref, mask, m))]:
        with pytest.raises(ValueError, match=f"'{bad}'; valid"):
            run(bad)
    assert all(context.load_strategy(s) is None for s in choices.CONTEXT_STRATEGIES)
    assert set(RANK_BACKENDS) == set(choices.SHARDED_BACKENDS)
    assert set(choices.BACKENDS) == {"single", *RANK_BACKENDS}
    for schedule in choices.LR_SCHEDULES:
        assert lr_lambda(2, 10, schedule)(5) > 0
    with pytest.raises(ValueError, match="'linear'; valid"):
        lr_lambda(2, 10, "linear")
    for precision in choices.MIXED_PRECISIONS:
        mixed_precision(precision, torch.device("cpu"))
    with pytest.raises(ValueError, match="'fp16'; valid"):
        mixed_precision("fp16", torch.device("cpu"))


def test_the_config_accepts_each_name_and_refuses_another_naming_the_valid_ones():
    for vocabulary, (section, key) in VOCABULARIES.items():
        names = list(getattr(choices, vocabulary))
        for name in names:
            extra = {"rollout.context_tokens": 64} if key == "context" else {}
            build_config({f"{section}.{key}": name, **extra})
        bad = "nonesuch" if isinstance(names[0], str) else 9
        with pytest.raises(ValueError, match=rf"{section}\.{key}={bad!r}.*valid: {names[0]}"):
            build_config({f"{section}.{key}": bad})


def test_config_py_copies_no_choice_list_of_an_owner():
    """A tuple or list literal in config.py that holds any owner's name is a copy."""
    owned = {v for name in VOCABULARIES for v in getattr(choices, name)} - {""}  # "": a default
    source = Path(sys.modules[AlgoConfig.__module__].__file__).read_text()
    copies = [(node.lineno, [e.value for e in node.elts])
              for node in ast.walk(ast.parse(source))
              if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) > 1
              and all(isinstance(e, ast.Constant) for e in node.elts)
              and owned & {e.value for e in node.elts if isinstance(e.value, str)}]
    assert not copies, f"config.py restates choices its owners state: {copies}"


def test_an_estimator_or_loss_registered_outside_the_project_joins_the_vocabulary(monkeypatch):
    monkeypatch.setattr(choices, "ADVANTAGES", dict(choices.ADVANTAGES))
    monkeypatch.setattr(algos, "ADVANTAGES", algos.Registry("advantage estimator"))
    with pytest.raises(ValueError, match="algo.advantage='my_gae'"):
        AlgoConfig(advantage="my_gae")
    algos.estimator("my_gae", needs_critic=True)(algos.gae_advantages)
    assert AlgoConfig(advantage="my_gae").needs_critic
    with pytest.raises(ValueError, match="'gae' is built in"):
        algos.estimator("gae", needs_critic=False)
    monkeypatch.setattr(choices, "POLICY_LOSSES", choices.POLICY_LOSSES)
    monkeypatch.setattr(algos, "POLICY_LOSSES", algos.Registry("policy loss"))
    with pytest.raises(ValueError, match="algo.policy_loss='my_clip'"):
        AlgoConfig(policy_loss="my_clip")
    algos.policy_loss("my_clip")(lambda *args, **params: None)  # a stand-in loss
    assert AlgoConfig(policy_loss="my_clip").policy_loss == "my_clip"


def test_the_vocabulary_and_the_config_load_no_torch():
    code = ("import sys, agentgym.core.choices, agentgym.config, agentgym.models.plan; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
