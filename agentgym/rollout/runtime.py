"""Wiring a config into live objects: policy model, engine, env factory, manager."""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from agentgym.config import Config, env_names, env_presets, set_key
from agentgym.rollout.engines.base import ENGINES, Engine
from agentgym.rollout.manager import GenerationManager
from agentgym import envs
from agentgym.core.device import engine_dtype, run_device
from agentgym.models.zoo import load_model, load_tokenizer, resolve_model
from agentgym.envs.judge import from_config
from agentgym.envs.plugins import RewardOverride, load_reward

logger = logging.getLogger(__name__)


def load_policy(cfg: Config):
    """Resolve ``model.path``/``model.name`` to an HF folder; load model and tokenizer."""
    path = resolve_model(cfg.model.path or cfg.model.name)
    device = run_device(cfg)
    # rollout-only commands (eval, rollout, demos) play the engine's copy
    dtype = engine_dtype(cfg.engine.dtype, cfg.model.dtype, device)
    logger.info("loading policy from %s (%s, %s)", path, dtype, device)
    return load_model(path, dtype=dtype, device=device), load_tokenizer(path), path


def build_engine(cfg: Config, model, tokenizer) -> Engine:
    """The registered engine ``engine.name``, built from the config by its own class."""
    return ENGINES.get(cfg.engine.name).from_config(cfg, model, tokenizer)


def engine_for(cfg: Config, path, tokenizer) -> Engine:
    """The rollout engine for the policy at ``path``: with a copy of the model loaded here
    (``engine.dtype``, else ``model.dtype``) for in-process engines; servers hold their own
    (``engine=sglang``)."""
    model = None
    if ENGINES.get(cfg.engine.name).needs_model:
        device = run_device(cfg)
        model = load_model(path, dtype=engine_dtype(cfg.engine.dtype, cfg.model.dtype, device),
                           device=device)
    return build_engine(cfg, model, tokenizer)


class MixedEnvs:
    """A mixed run's env factory (``env=[search,code]``): ``factory(row)`` makes the env
    that ``row["env"]`` names, each with its own settings (:func:`env_factory`), and
    :meth:`tokens_per_turn` is that env's ``rollout.max_tokens_per_turn``."""

    takes_row = True

    def __init__(self, factories: dict[str, Callable[[], Any]],
                 turn_tokens: dict[str, int] | None = None) -> None:
        self.factories = factories
        self.turn_tokens = turn_tokens or {}
        self._by_name = {alias: name for name in factories for alias in envs.env_aliases(name)}

    def _name(self, row: dict | None) -> str:
        name = (row or {}).get("env")
        if name not in self._by_name:
            raise ValueError(f"row for env {name!r} in a run mixing "
                             f"{', '.join(self.factories)}")
        return self._by_name[name]

    def __call__(self, row: dict | None = None):
        return self.factories[self._name(row)]()

    def tokens_per_turn(self, row: dict) -> int | None:
        """The token budget of one action of ``row``'s env (None: the run's)."""
        return self.turn_tokens.get(self._name(row))


def played_by_program(cfg: Config) -> bool:
    """Whether the run's rows are played by the user's program (``agent=``), not stepped
    by an env here (its manifest's ``played_by_program``: ``env=agent``)."""
    return any(envs.env_manifest(e).played_by_program for e in env_names(cfg.env))


def env_factory(cfg: Config) -> Callable[[], Any]:
    """A zero-argument factory of fresh envs for ``cfg.env`` (resolves tools once); for a
    mixed run, a :class:`MixedEnvs` that makes the env each row names."""
    names = env_names(cfg.env)
    if len(names) > 1:
        subs = {e: sub_config(cfg, e) for e in names}
        return MixedEnvs({e: env_factory(sub) for e, sub in subs.items()},
                         {e: sub.rollout.max_tokens_per_turn for e, sub in subs.items()})
    env_id = envs.resolve_env_id(cfg.env)
    # the env's manifest builds its arguments from the config (EnvManifest.kwargs): starts
    # or connects its services once here, not per episode
    kwargs = {"max_turns": cfg.rollout.max_turns, **envs.env_manifest(env_id).kwargs_for(cfg)}
    make = functools.partial(envs.make_env, env_id, **kwargs)
    if cfg.reward:  # a judge or the user's function replaces the env's reward (envs.plugins)
        if cfg.reward == "judge":
            return functools.partial(RewardOverride.wrap, make, from_config(cfg),
                                     cfg.reward_process)
        load_reward(cfg.reward)  # a bad spec fails here, before any rollout
        return functools.partial(RewardOverride.wrap, make, cfg.reward, cfg.reward_process)
    return make


def build_manager(cfg: Config, model=None, tokenizer=None):
    """Everything a rollout needs; returns ``(manager, engine, tokenizer)``."""
    if tokenizer is None or (model is None and ENGINES.get(cfg.engine.name).needs_model):
        if ENGINES.get(cfg.engine.name).needs_model:
            model, tokenizer, _ = load_policy(cfg)
        else:
            tokenizer = load_tokenizer(resolve_model(cfg.model.path or cfg.model.name))
    engine = build_engine(cfg, model, tokenizer)
    manager = GenerationManager(engine, tokenizer, env_factory(cfg), cfg.rollout,
                                seed=cfg.trainer.seed, deadlines=cfg.deadlines)
    return manager, engine, tokenizer


def sub_config(cfg: Any, env: str) -> Any:
    """``cfg`` for one env of a mixed run: ``env`` set; its own dataset when ``data`` names
    one per env (``data=[train,arith]``, in env order), else the shared name; its own
    held-out set when ``trainer.eval_data`` names one per env, else its preset's; its own
    value of each key given per env (``rollout.max_turns=[4,2]``: ``cfg.per_env``)."""
    import copy

    names = env_names(cfg.env)
    sub = copy.deepcopy(cfg)
    sub.env = env
    preset = env_presets(env)
    if "trainer.eval_data" in preset:
        sub.trainer.eval_data = preset["trainer.eval_data"]
    data, evals = env_names(cfg.data.name), env_names(cfg.trainer.eval_data)
    for key, given in (("data", data), ("trainer.eval_data", evals)):
        if len(given) > 1 and len(given) != len(names):
            raise ValueError(f"{key}={','.join(given)} names {len(given)} datasets for "
                             f"{len(names)} envs ({','.join(names)}); give one, or one per "
                             f"env in env order")
    if len(data) > 1:
        sub.data.name = data[names.index(env)]
    if len(evals) > 1:
        sub.trainer.eval_data = evals[names.index(env)]
    for key, values in cfg.per_env.items():
        set_key(sub, key, values[names.index(env)])  # one value: the sub's per_env drops it
    return sub
