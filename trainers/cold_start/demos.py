"""The cold start's demonstrations: the env's builder run over the training rows until
enough fit the rollout budgets, and the parts of the cache key they depend on."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from agentgym import envs
from agentgym.config import Config
from agentgym.core.paths import file_digest
from agentgym.data.demo_builders import build_demos
from agentgym.data.demos import within_budgets
from agentgym.models.zoo import load_tokenizer
from agentgym.rollout.chat import ChatTokens
from agentgym.rollout.runtime import env_factory
from agentgym.trainers.hooks import Hooks


def demo_counts(cfg: Config) -> str:
    """``trainer.cold_start_demos`` as given: one count, or one per env (``8/32``)."""
    counts = cfg.per_env.get("trainer.cold_start_demos", [cfg.trainer.cold_start_demos])
    return "/".join(map(str, counts))


def demos_within_budgets(cfg: Config, env: str, rows: list[dict], model_path, want: int,
                          hooks: Hooks) -> tuple[list[dict], int, int]:
    """Demonstrations built from ``rows`` in order (the env's builder:
    :func:`agentgym.data.demo_builders.build_demos`) until ``want`` fit the rollout budgets in
    this model's tokens (:func:`agentgym.data.demos.within_budgets`). Returns ``(demos, rows
    looked at, demos over the budgets)``."""
    chat = ChatTokens(load_tokenizer(model_path))
    make_env = env_factory(cfg)
    kept: list[dict] = []
    at = over = 0
    why = None
    hooks.phase("demos", want)
    while len(kept) < want and at < len(rows):
        # about a quarter of the rows yield one on the shipped search data; ask for more
        chunk = rows[at:at + max(16, 4 * (want - len(kept)))]
        built = build_demos(env, chunk, make_env, workers=cfg.rollout.env_workers,
                            **demo_options(cfg, env))
        fit, too_long, reason = within_budgets(built, chat, env, cfg.rollout, want - len(kept))
        kept, over, why = kept + fit, over + too_long, why or reason
        if fit:
            hooks.advance(len(fit))
        at += len(chunk)
        if not kept and over >= 16:
            raise ValueError(f"cold start: the first {over} demonstrations are all over the "
                             f"rollout budgets ({why}); raise that budget or train from an "
                             f"SFT checkpoint (trainer.cold_start=PATH)")
    return kept, at, over


def sources(cfg: Config, env: str) -> Any:
    """What the env's observations come from (``EnvManifest.sources``): the cache key's part."""
    return envs.env_manifest(env).sources_for(cfg)


def demo_options(cfg: Config, env: str) -> dict:
    return envs.env_manifest(env).demo_options_for(cfg)


def builder(cfg: Config, env: str) -> dict:
    """The cache key's part for the demonstrations: the builder's options and the digest of
    its module's source, so that a change to how the env demonstrates makes new
    demonstrations (and a new SFT) rather than reusing the cached ones."""
    build = envs.env_manifest(env).demonstrate
    source = inspect.getsourcefile(build) if build else None
    return {**demo_options(cfg, env),
            **({"builder_source": file_digest(Path(source))} if source else {})}
