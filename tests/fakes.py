"""Fakes used only to script model output or inject faults (real components elsewhere)."""

from __future__ import annotations

import asyncio

from agentgym.engines.base import Engine
from agentgym.types import GenerateOutput, SamplingParams
from tools.errors import ToolTimeout, ToolUnavailable


class ScriptedEngine(Engine):
    """Plays canned model turns: each ``generate`` returns the next script entry's ids.

    A script entry is text (tokenized here; a trailing ``" + eos"`` appends the EOS id as if sampled)
    or a list of ids. Output is cut at ``max_new_tokens`` (finish_reason "length"),
    like a real engine. Every returned id gets logprob ``-0.25 * (k + 1)`` so tests can
    tell positions apart. ``produced`` records exactly what was returned.
    """

    def __init__(self, tokenizer, script: list, delay_s: float = 0.0):
        self.tok, self.script, self.delay_s = tokenizer, list(script), delay_s
        self.produced: list[list[int]] = []
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids, sampling: SamplingParams, images=None):
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        self.prompts.append(list(prompt_ids))
        entry = self.script.pop(0)
        if isinstance(entry, str):
            eos = entry.endswith(" + eos")
            text = entry[: -len(" + eos")] if eos else entry
            ids = self.tok.encode(text, add_special_tokens=False) + \
                ([self.tok.eos_token_id] if eos else [])
        else:
            ids = list(entry)
        reason = "stop"
        if len(ids) > sampling.max_new_tokens:
            ids, reason = ids[: sampling.max_new_tokens], "length"
        self.produced.append(ids)
        return GenerateOutput(ids, [-0.25 * (k + 1) for k in range(len(ids))], reason)

    @classmethod
    def from_config(cls, cfg, model, tokenizer):
        raise NotImplementedError("scripted engines are built by tests")

    def update_weights(self, state_dict, version):
        self.policy_version = version

    async def pause(self):
        pass

    def resume(self):
        pass


class DeadRetrieverFault:
    """Injects a retriever that is down (connection refused)."""

    def retrieve(self, queries):
        raise ToolUnavailable("connection refused (injected fault)")

    def close(self):
        pass


class TimeoutRetrieverFault:
    """Injects a retriever that times out."""

    def retrieve(self, queries):
        raise ToolTimeout("retrieval timed out after 0.1s (injected fault)")

    def close(self):
        pass
