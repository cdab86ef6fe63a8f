"""Context management: what an episode's history becomes once it passes
``rollout.context_tokens`` (``rollout.context``).

The manager keeps the context the policy sees as blocks of token ids, each ``(kind,
ids)``: ``prompt``, then per turn ``generated`` (what the policy sampled), ``filler`` (the
template's closing of the assistant turn) and ``observation`` (what the env answered);
a strategy maps the blocks to new ones. Before each generation, when the context is longer
than ``rollout.context_tokens``, the strategy runs; if it changed the context, the episode
goes on in a new trajectory whose prompt (mask 0) is the new blocks joined, so every
trajectory holds exactly the tokens the policy conditioned on and nothing is re-tokenised.
The episode's trajectories share its reward (each carries the reward of its own turns plus
every later turn's: the return from its turns on) and count as one episode in the group
statistics (:func:`agentgym.trainers.algos._group_stats`), the same splitting training an
OpenAI-SDK agent uses (:mod:`agentgym.serving.agents`).

Each trajectory has its own ``rollout.max_response_tokens`` after its prompt, so an
episode that keeps rewriting its context is bounded by ``rollout.max_turns`` alone.

- ``keep``: the history only grows (the token budget ends the episode).
- ``drop_observations``: every tool output but the latest is replaced by a short note
  (:data:`DROPPED`, rendered as the env's observations are); the policy's own turns stay.
- ``summarize``: the policy is asked (:data:`SUMMARY_REQUEST`) to summarise the episode so
  far; its summary is sampled and trained on like any turn (reward 0 of its own, the
  return of what follows), and the new context is the first prompt, the summary as the
  policy's turn and :data:`CONTINUE`.
- ``package.module:function``: ``function(blocks, tokenizer) -> blocks`` (None: leave the
  context as it is); a user's strategy over the same blocks.
"""

from __future__ import annotations

from typing import Callable

from agentgym.core.choices import CONTEXT_STRATEGIES

Blocks = list[tuple[str, list[int]]]

DROPPED = "[An earlier tool output was removed to save context.]"
SUMMARY_REQUEST = ("The conversation is getting long. Summarize what you have found so far "
                   "that is needed to finish the task: facts, results and what is left to do.")
CONTINUE = "Continue from your summary."
BUILTIN = CONTEXT_STRATEGIES  # the strategies implemented here


def joined(blocks: Blocks) -> list[int]:
    return [i for _, ids in blocks for i in ids]


def drop_observations(blocks: Blocks, dropped_ids: list[int]) -> Blocks:
    """Every ``observation`` block but the last replaced by ``dropped_ids`` (kind
    ``dropped``, so a later pass leaves it alone)."""
    last = max((i for i, (kind, _) in enumerate(blocks) if kind == "observation"), default=-1)
    return [("dropped", list(dropped_ids)) if kind == "observation" and i != last else (kind, ids)
            for i, (kind, ids) in enumerate(blocks)]


def after_summary(blocks: Blocks, summary_ids: list[int], filler: list[int],
                  continue_ids: list[int]) -> Blocks:
    """The context after a summary: the first prompt, the summary as the policy's turn,
    the template's closing and the note to continue."""
    return [blocks[0], ("generated", list(summary_ids)), ("filler", list(filler)),
            ("observation", list(continue_ids))]


def load_strategy(spec: str) -> Callable[[Blocks, object], Blocks | None] | None:
    """The user function ``spec`` names (None for a built-in strategy)."""
    if spec in BUILTIN:
        return None
    from agentgym.envs.plugins import load_spec  # lazy: imports the envs
    fn = load_spec(spec, "rollout.context")
    if not callable(fn):
        raise ValueError(f"rollout.context={spec!r} is {type(fn).__name__}, not a function")
    return fn
