"""OpenAI's streamed answers: ``chat.completion.chunk`` / ``text_completion`` events as the
engine samples, then ``data: [DONE]``.

Text is released as soon as it cannot change: a trailing partial UTF-8 character, or a
tail that could begin a stop string (or, with tools, a ``<tool_call>``), is held back until
the next token settles it, so the streamed pieces always add up to the non-streamed
answer. With tools, text from the first ``<tool_call>`` on is held; at the end the calls
are sent as one ``tool_calls`` delta each (complete arguments), or, if they do not parse,
the held text as content. The engine's tokens arrive one by one from the HF engine
(:meth:`~agentgym.rollout.engines.hf.HFEngine.stream`); other engines send the reply as one
piece. A client that disconnects abandons its requests: the engine stops decoding them.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator

from agentgym.core.types import GenerateOutput
from agentgym.serving.openai_common import _TOOL_OPEN, _Plan, error_body, merged, sse, usage
from agentgym.serving.openai_chat import completion_logprobs, logprob_entries, tool_calls

logger = logging.getLogger(__name__)


def _held(text: str, guards: tuple[str, ...]) -> int:
    """How much of ``text`` can be released: up to a guard it holds, and short of a
    tail that may begin one or a partial character."""
    cut = len(text.rstrip("\ufffd"))
    for g in guards:
        at = text.find(g)
        if at >= 0:
            cut = min(cut, at)
            continue
        for k in range(min(len(g) - 1, len(text)), 0, -1):
            if text.endswith(g[:k]):
                cut = min(cut, len(text) - k)
                break
    return cut


class _Choice:
    """One streamed choice: its sampled ids so far and the text already sent."""

    def __init__(self, front, plan: _Plan, prefix: str = "") -> None:
        self.front, self.plan = front, plan
        self.guards = plan.sampling.stop + ((_TOOL_OPEN,) if plan.tools else ())
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list = []
        self.sent = ""
        self.prefix = prefix  # text before the sampled text (forced start, echo)
        self.reported = 0  # tokens whose logprobs were sent

    def add(self, ids: list[int], logprobs: list[float], tops) -> str:
        """New tokens in; the text that can now be sent."""
        self.ids += ids
        self.logprobs += logprobs
        self.tops += tops or [None] * len(ids)
        text = self.prefix + self.front.tok.decode(self.front.visible_ids(self.ids),
                                                   skip_special_tokens=True)
        ready = text[:_held(text, self.guards)]
        if len(ready) <= len(self.sent) or not ready.startswith(self.sent):
            return ""
        new, self.sent = ready[len(self.sent):], ready
        return new

    def partial(self) -> GenerateOutput:
        return GenerateOutput(list(self.ids), list(self.logprobs), "length",
                              top_logprobs=self.tops if self.plan.logprobs else None)

    def rest(self, final: str) -> str:
        """What is left of ``final`` (the whole answer's text) after what was sent."""
        if not final.startswith(self.sent):
            logger.warning("streamed text %r is not a prefix of the answer %r",
                           self.sent[:60], final[:60])
            return ""
        return final[len(self.sent):]


async def chat_events(front, plan: _Plan, samplings: list, body: dict, rid: str, created: int,
                      model: str) -> AsyncIterator[str]:
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": front.fingerprint()}

    def chunk(k: int, delta: dict, finish: str | None = None, logprobs=None, ids=None) -> str:
        choice = {"index": k, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if plan.token_ids and ids is not None:
            choice["token_ids"] = ids
        return sse({**head, "choices": [choice], **({"usage": None} if plan.usage_chunk
                                                    else {})})

    states = [_Choice(front, plan, plan.forced) for _ in range(plan.n)]
    outs: list[GenerateOutput | None] = [None] * plan.n
    for k in range(plan.n):
        yield chunk(k, {"role": "assistant", "content": ""})
    streams = [front.engine.stream(plan.prompt_ids, s) for s in samplings]
    try:
        async for k, item in merged(streams):
            if isinstance(item, GenerateOutput):
                outs[k] = item
                continue
            st = states[k]
            new = st.add(*item)
            entries = None
            if plan.logprobs is not None:
                lps = logprob_entries(front, st.partial(), st.reported, len(st.ids))
                st.reported += len(lps)
                entries = {"content": lps, "refusal": None}
            if new or (entries and entries["content"]):
                yield chunk(k, {"content": new}, logprobs=entries, ids=item[0])
    except Exception as e:  # the engine failed mid-stream: OpenAI's error event
        logger.exception("streamed generation failed")
        yield sse(error_body(f"generation failed: {type(e).__name__}: {e}", "server_error"))
        yield sse("[DONE]")
        return
    front._record("chat", body, plan, outs)
    for k, (st, out) in enumerate(zip(states, outs)):
        full = plan.forced + front.text(out, plan.sampling.stop)
        calls = tool_calls(full, plan)
        rest = st.rest(full[:full.find(_TOOL_OPEN)] if calls else full)
        if rest:
            yield chunk(k, {"content": rest})
        for i, call in enumerate(calls or []):
            yield chunk(k, {"tool_calls": [{"index": i, **call}]})
        finish = "tool_calls" if calls else ("length" if out.finish_reason == "length"
                                             else "stop")
        yield chunk(k, {}, finish)
    if plan.usage_chunk:
        yield sse({**head, "choices": [], "usage": usage(plan, outs)})
    yield sse("[DONE]")


async def completion_events(front, plans: list[_Plan], samplings: list[list], body: dict,
                            rid: str, created: int, model: str) -> AsyncIterator[str]:
    head = {"id": rid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": front.fingerprint()}

    def chunk(index: int, text: str, finish: str | None = None, logprobs=None) -> str:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return sse({**head, "choices": [choice], **({"usage": None} if plans[0].usage_chunk
                                                    else {})})

    slots = [(plan, s) for plan, mine in zip(plans, samplings) for s in mine]
    states, offsets = [_Choice(front, plan) for plan, _ in slots], [0] * len(slots)
    outs: list[GenerateOutput | None] = [None] * len(slots)
    if body.get("echo"):
        for i, (plan, _) in enumerate(slots):
            echo = front.tok.decode(plan.prompt_ids, skip_special_tokens=True)
            offsets[i] = len(echo)
            yield chunk(i, echo)
    try:
        async for i, item in merged([front.engine.stream(p.prompt_ids, s) for p, s in slots]):
            if isinstance(item, GenerateOutput):
                outs[i] = item
                continue
            st, plan = states[i], slots[i][0]
            new, lps = st.add(*item), None
            if plan.logprobs is not None:
                lps = completion_logprobs(front, st.partial(), st.reported, len(st.ids),
                                          offsets[i])
                st.reported += len(lps["tokens"])
                offsets[i] += sum(len(t) for t in lps["tokens"])
            if new or (lps and lps["tokens"]):
                yield chunk(i, new, logprobs=lps)
    except Exception as e:
        logger.exception("streamed generation failed")
        yield sse(error_body(f"generation failed: {type(e).__name__}: {e}", "server_error"))
        yield sse("[DONE]")
        return
    total = {"prompt_tokens": 0, "completion_tokens": 0}
    for n, plan in enumerate(plans):
        mine = outs[n * plan.n:(n + 1) * plan.n]
        front._record("completion", body, plan, mine)
        for key in total:
            total[key] += usage(plan, mine)[key]
    for i, ((plan, _), st, out) in enumerate(zip(slots, states, outs)):
        rest = st.rest(front.text(out, plan.sampling.stop))
        if rest:
            yield chunk(i, rest)
        yield chunk(i, "", "length" if out.finish_reason == "length" else "stop")
    if plans[0].usage_chunk:
        total["total_tokens"] = total["prompt_tokens"] + total["completion_tokens"]
        yield sse({**head, "choices": [], "usage": total})
    yield sse("[DONE]")
