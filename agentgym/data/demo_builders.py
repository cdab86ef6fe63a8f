"""Demonstrations for the cold start, built by the envs themselves.

Each env that can demonstrate its protocol names its builder (``EnvManifest.demonstrate``:
the search env's is :mod:`agentgym.envs.search_demos`, the code env's
:mod:`agentgym.envs.code_demos`). A builder drives a real env instance (the same factory
rollouts use: the retriever, the sandbox), proposes each action, and records the
observations the env itself returned, so a demonstration replays exactly
(:func:`agentgym.data.demos.replay_demo`). A demonstration is kept only if the env rewards
its final answer as correct. :func:`build_demos` runs a builder over rows in threads; which
of them fit a run's rollout budgets is :func:`agentgym.data.demos.within_budgets`.
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Callable

logger = logging.getLogger(__name__)


def builders() -> list[str]:
    """The registered envs (short names) that can build demonstrations."""
    from agentgym import envs  # lazy: loads gymnasium
    return [short for short, env_id in envs.short_names().items()
            if envs.env_manifest(env_id).demonstrate is not None]


def build_demos(env_name: str, rows: list[dict], make_env: Callable, workers: int = 4,
                on_done: Callable[[bool], None] | None = None, **options) -> list[dict]:
    """Run the builder of env ``env_name`` (``EnvManifest.demonstrate``) over ``rows`` in
    ``workers`` threads (one env each per row); ``options``: the builder's keywords
    (``EnvManifest.demo_options``).

    Returns the kept demonstrations in row order, each with a ``uid``.
    """
    from agentgym import envs  # lazy: loads gymnasium
    from agentgym.rollout.manager import row_uid  # lazy: loads httpx
    builder = envs.env_manifest(env_name).demonstrate
    if builder is None:
        raise ValueError(f"no demonstration builder for env {env_name!r}; valid: "
                         f"{', '.join(builders())} (or rejection-sample: agentgym rollout, "
                         f"then agentgym filter)")

    def one(i: int, row: dict) -> dict | None:
        env = make_env()
        try:
            demo = builder(row, env, **options)
        except Exception as e:  # noqa: BLE001 - one bad row must not stop the build
            logger.warning("row %d: builder failed (%s: %s)", i, type(e).__name__, e)
            demo = None
        finally:
            env.close()
        if demo is not None:
            demo["uid"] = row_uid(row, i)
        if on_done is not None:
            on_done(demo is not None)
        return demo

    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="demo") as pool:
        results = list(pool.map(one, range(len(rows)), rows))
    return [d for d in results if d is not None]
