"""What the OpenAI API's modules share: its errors, the plan of a checked request, usage,
token bytes and server-sent events."""

from __future__ import annotations

import asyncio
import functools
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from agentgym.core.types import GenerateOutput, SamplingParams

_SAMPLING = ("n", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
             "logprobs", "return_token_ids", "user", "metadata", "store", "service_tier",
             "frequency_penalty", "presence_penalty", "logit_bias", "model")
CHAT_KEYS = _SAMPLING + ("messages", "max_tokens", "max_completion_tokens", "top_logprobs",
                         "tools", "tool_choice", "parallel_tool_calls", "response_format")
COMPLETION_KEYS = _SAMPLING + ("prompt", "max_tokens", "echo", "best_of", "suffix")
ROLES = ("system", "developer", "user", "assistant", "tool")
_TOOL_OPEN = "<tool_call>"


class OpenAIError(Exception):
    """A request answered with OpenAI's error body and ``status``."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict:
        return error_body(str(self), self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Call:
    """One answered request, as :attr:`OpenAIFrontend.on_call` sees it: the prompt's ids
    and each choice's sampled ids and logprobs, exactly as the engine saw them."""

    kind: str  # "chat" or "completion"
    request: dict
    prompt_ids: list[int]
    outputs: list[GenerateOutput]
    messages: list[dict] = field(default_factory=list)  # as rendered (chat)
    tools: list[dict] | None = None
    forced: str = ""  # text the reply was started with (tool_choice)
    plan: Any = None  # the checked request (openai_common._Plan)


@dataclass
class _Plan:
    """A validated request: what to sample and how to answer."""

    prompt_ids: list[int]
    sampling: SamplingParams
    n: int
    stream: bool
    usage_chunk: bool
    logprobs: int | None  # None: no logprobs; else how many alternatives
    token_ids: bool
    tools: list[dict] | None = None
    forced: str = ""
    parallel: bool = True
    messages: list[dict] = field(default_factory=list)


def usage(plan: _Plan, outs: list[GenerateOutput]) -> dict:
    """OpenAI's usage: the prompt counted once, every choice's sampled tokens."""
    done = sum(len(o.ids) for o in outs)
    return {"prompt_tokens": len(plan.prompt_ids), "completion_tokens": done,
            "total_tokens": len(plan.prompt_ids) + done}


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: each of its 256 characters -> its byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer, token: int) -> bytes:
    """The exact bytes of one token of a byte-level BPE vocabulary (a piece of a UTF-8
    character stays a piece); for other vocabularies, the token decoded alone."""
    piece = tokenizer.convert_ids_to_tokens(int(token))
    table = _byte_decoder()
    if isinstance(piece, str) and piece and all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return tokenizer.decode([int(token)], skip_special_tokens=False).encode("utf-8")


async def merged(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """``(index, item)`` from several async iterators as items come; closing this closes
    them all (an engine's stream then abandons its request)."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, it: AsyncIterator) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
        except Exception as e:  # handed to the reader, which raises it
            await queue.put((i, e))
        finally:
            await queue.put((i, end))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is end:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def sse(payload: dict | str) -> str:
    """One server-sent event as OpenAI writes it."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"
