"""The rollout-engine interface: token-in/token-out, async.

An engine takes prompt token ids and returns the ids it sampled with their logprobs;
it never decodes and re-encodes. Engines are registered by name (``engine=hf``); GPU-only
engines (``sglang``) are lazy entry points so CPU machines never import them.
"""

from __future__ import annotations

import abc
from typing import Any

from agentgym.core.registry import Registry
from agentgym.core.types import GenerateOutput, SamplingParams

ENGINES: Registry = Registry("rollout engine")


class Engine(abc.ABC):
    """Async token-in/token-out generation.

    Concurrent ``generate`` calls from many trajectories may be batched together by
    the engine; each call still gets exactly its own sampled ids back.
    """

    #: Version of the weights currently served; stamped on every trajectory.
    policy_version: int = 0
    #: Whether :meth:`from_config` needs the policy loaded in this process (False for
    #: engines whose weights live in servers).
    needs_model: bool = True

    @classmethod
    @abc.abstractmethod
    def from_config(cls, cfg, model, tokenizer) -> "Engine":
        """Build from the run config (``cfg.engine`` section); ``model`` may be unused by
        engines that serve weights elsewhere."""

    @abc.abstractmethod
    async def generate(self, prompt_ids: list[int], sampling: SamplingParams,
                       images: list[Any] | None = None,
                       session_id: str | None = None) -> GenerateOutput:
        """Sample a continuation of ``prompt_ids``. ``session_id`` names the trajectory
        the request belongs to (engines over several servers keep a trajectory on one
        server, so its prefix stays cached); others ignore it."""

    async def stream(self, prompt_ids: list[int], sampling: SamplingParams,
                     images: list[Any] | None = None, session_id: str | None = None):
        """Yield pieces ``(ids, logprobs, tops | None)`` as they are sampled, then the whole
        :class:`GenerateOutput`. This default yields everything as one piece once
        :meth:`generate` returns; engines that see tokens as they come override it."""
        out = await self.generate(prompt_ids, sampling, images, session_id)
        yield list(out.ids), list(out.logprobs), out.top_logprobs
        yield out

    @abc.abstractmethod
    def update_weights(self, state_dict: dict, version: int) -> None:
        """Load new policy weights and set ``policy_version`` (call while paused)."""

    @abc.abstractmethod
    async def pause(self, partial: bool = False) -> None:
        """Hold new requests and return once nothing runs (before a weight update): the
        in-flight ones finish first, or with ``partial`` (an engine that can) stop where
        they are and continue under the new weights after :meth:`resume` (partial
        rollouts: each token records the version that sampled it)."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Release requests held by :meth:`pause`."""

    def close(self) -> None:
        """Release resources (threads, servers). Idempotent."""

    def run(self, coro):
        """Run ``coro`` (a rollout that awaits this engine) from outside any event loop and
        return its result; an engine may run its own steps on the calling thread meanwhile
        (:meth:`HFEngine.run <agentgym.rollout.engines.hf.HFEngine.run>` on the CPU)."""
        import asyncio
        return asyncio.run(coro)


def push_weights(engine: Engine, state_dict: dict, version: int, partial: bool = False) -> None:
    """Load new weights the way a trainer does: pause (in-flight batches finish, or with
    ``partial`` are interrupted to continue on the new weights; new ones wait),
    :meth:`Engine.update_weights`, resume. Call from outside any event loop."""
    import asyncio

    async def swap() -> None:
        # an engine written before partial rollouts takes no argument: ask only when wanted
        await (engine.pause(partial=True) if partial else engine.pause())
        try:
            engine.update_weights(state_dict, version)
        finally:
            engine.resume()
    asyncio.run(swap())


ENGINES.register("hf", "agentgym.rollout.engines.hf:HFEngine")
ENGINES.register("sglang", "agentgym.rollout.engines.sglang:SGLangEngine")
