"""Requests of OpenAI's API checked and turned into sampling plans; choices answered.

Each check raises :class:`~agentgym.serving.openai_api.OpenAIError` (400) naming the bad
value and what is valid; the ranges are OpenAI's (``temperature`` in [0, 2], at most 4
``stop`` strings, ``top_logprobs`` up to 20, ``n`` up to 128).
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from agentgym.core.types import GenerateOutput, SamplingParams
from agentgym.serving.openai_common import (_TOOL_OPEN, CHAT_KEYS, COMPLETION_KEYS, ROLES,
                                         OpenAIError, _Plan)

logger = logging.getLogger(__name__)


def _unknown(body: Any, keys: tuple[str, ...]) -> None:
    if not isinstance(body, dict):
        raise OpenAIError("the body must be a JSON object")
    extra = sorted(set(body) - set(keys))
    if extra:
        raise OpenAIError(f"Unrecognized request argument supplied: {', '.join(extra)} "
                          f"(agentgym serve takes {', '.join(keys)})", param=extra[0])


def _number(body: dict, key: str, lo: float, hi: float, default, integer: bool = False):
    value = body.get(key)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not lo <= value <= hi:
        what = "an integer" if integer else "a number"
        raise OpenAIError(f"{key}={value!r}: must be {what} in [{lo}, {hi}]", param=key)
    return value


def _flag(body: dict, key: str) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise OpenAIError(f"{key}={value!r}: must be true or false", param=key)
    return bool(value)


def _neutral(body: dict) -> None:
    """Penalties, logit bias and structured output: refused unless they change nothing."""
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise OpenAIError(f"{key}={body[key]!r}: agentgym serve samples without "
                              "penalties; send 0 or leave it out", param=key)
    if body.get("logit_bias"):
        raise OpenAIError("logit_bias is not supported by agentgym serve; leave it out or "
                          "send {}", param="logit_bias")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise OpenAIError(f"response_format={fmt!r}: agentgym serve does not constrain "
                          "output; only {'type': 'text'} is accepted", param="response_format")


def _sampling(front, body: dict, prompt_len: int, default_max: int | None,
              logprobs: int | None) -> tuple[SamplingParams, int]:
    """``(sampling, n)`` from the keys both APIs share; ``default_max`` None: the rest
    of the context."""
    _neutral(body)
    room = front.max_context - prompt_len
    if room < 1:
        raise OpenAIError(f"the prompt has {prompt_len} tokens; this model's context is "
                          f"{front.max_context}", param="messages",
                          code="context_length_exceeded")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    most = _number(body, key, 1, 1 << 30, None, integer=True)
    if most is not None and prompt_len + most > front.max_context:
        raise OpenAIError(f"{key}={most} plus the prompt's {prompt_len} tokens exceeds this "
                          f"model's context of {front.max_context} tokens", param=key,
                          code="context_length_exceeded")
    if most is None:
        most = min(default_max or room, room)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or len(stop) > 4 or \
            not all(isinstance(s, str) and s for s in stop):
        raise OpenAIError(f"stop={body.get('stop')!r}: must be a string or a list of at most "
                          "4 non-empty strings", param="stop")
    top_k = _number(body, "top_k", -1, 1 << 20, -1, integer=True)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise OpenAIError(f"seed={seed!r}: must be an integer", param="seed")
    sampling = SamplingParams(
        max_new_tokens=most, temperature=float(_number(body, "temperature", 0, 2, 1.0)),
        top_p=max(float(_number(body, "top_p", 0, 1, 1.0)), 1e-9),  # 0: the top token only
        top_k=max(top_k, 0),
        stop=tuple(stop), seed=seed, top_logprobs=logprobs or 0)
    return sampling, _number(body, "n", 1, 128, 1, integer=True)


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise OpenAIError("stream_options is only allowed with stream=true",
                              param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage",
                                                             "include_obfuscation"}:
            raise OpenAIError(f"stream_options={options!r}: takes include_usage",
                              param="stream_options")
    return stream, bool((options or {}).get("include_usage"))


# -- chat ----------------------------------------------------------------------------------
def chat_plan(front, body: dict) -> _Plan:
    _unknown(body, CHAT_KEYS)
    messages = _messages(front, body.get("messages"))
    tools, forced, parallel = _tools(body)
    logprobs = None
    if _flag(body, "logprobs"):
        logprobs = _number(body, "top_logprobs", 0, 20, 0, integer=True)
    elif body.get("top_logprobs") is not None:
        raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
    ids = front.chat_prompt(messages, tools, forced)
    sampling, n = _sampling(front, body, len(ids), front.default_max_tokens, logprobs)
    stream, include_usage = _stream_flags(body)
    return _Plan(ids, sampling, n, stream, include_usage, logprobs,
                 _flag(body, "return_token_ids"), tools, forced, parallel, messages)


def _messages(front, raw: Any) -> list[dict]:
    """OpenAI's messages as the chat template takes them: ``developer`` as ``system``, text
    parts joined, an assistant's ``tool_calls`` rendered as the model writes them, a
    ``tool`` message named after the call it answers."""
    if not isinstance(raw, list) or not raw:
        raise OpenAIError("messages must be a non-empty list of {role, content}",
                          param="messages")
    names: dict[str, str] = {}
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            got = m.get("role") if isinstance(m, dict) else m
            raise OpenAIError(f"{where}.role={got!r}: must be one of {', '.join(ROLES)}",
                              param=where)
        role = "system" if m["role"] == "developer" else m["role"]
        calls = m.get("tool_calls") if role == "assistant" else None
        content = _content(m.get("content"), where, empty_ok=bool(calls))
        if calls:
            out.append(_assistant_calls(front, content, _calls(calls, where, names)))
        elif role == "tool":
            tid = m.get("tool_call_id")
            name = m.get("name") or names.get(tid, "")
            out.append({"role": "tool", "content": content, "name": name,
                        **({"tool_call_id": tid} if tid else {})})
        else:
            out.append({"role": role, "content": content})
    return out


def _content(content: Any, where: str, empty_ok: bool) -> str:
    if isinstance(content, str):
        return content
    if content is None and empty_ok:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        odd = sorted({str(p.get("type")) for p in content if p.get("type") != "text"})
        if odd:
            raise OpenAIError(f"{where}.content has parts of type {odd}; this server's model "
                              "takes text parts only", param=f"{where}.content")
        return "\n".join(str(p.get("text", "")) for p in content)
    raise OpenAIError(f"{where}.content must be a string or a list of text parts; got "
                      f"{str(content)[:80]!r}", param=f"{where}.content")


def _calls(calls: Any, where: str, names: dict[str, str]) -> list[dict]:
    if not isinstance(calls, list):
        raise OpenAIError(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise OpenAIError(f"{where}.tool_calls[{j}] must be {{id, type: 'function', "
                              "function: {name, arguments}}", param=f"{where}.tool_calls")
        args = fn.get("arguments") or "{}"
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise OpenAIError(f"{where}.tool_calls[{j}].function.arguments is not JSON: "
                                  f"{args[:80]!r}", param=f"{where}.tool_calls") from None
        names[c.get("id")] = fn["name"]
        out.append({"name": fn["name"], "arguments": args})
    return out


def _assistant_calls(front, content: str, calls: list[dict]) -> dict:
    """An assistant turn with calls: for the template when it renders them, else as
    Hermes blocks after the content (what :func:`tool_call_text` writes)."""
    if front.chat_tokens.renders_tools:
        return {"role": "assistant", "content": content,
                "tool_calls": [{"type": "function", "function": c} for c in calls]}
    return {"role": "assistant", "content": "\n".join(
        ([content] if content else []) + [tool_call_text(c) for c in calls])}


def tool_call_text(call: dict) -> str:
    """One call as the Hermes format writes it (the envs' function calling)."""
    body = json.dumps({"name": call["name"], "arguments": call["arguments"]},
                      ensure_ascii=False)
    return f"{_TOOL_OPEN}\n{body}\n</tool_call>"


def _tools(body: dict) -> tuple[list[dict] | None, str, bool]:
    """``(tools to render and parse, text the reply is forced to start with, parallel)``."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise OpenAIError(f"tool_choice={choice!r} needs tools", param="tool_choice")
        return None, "", True
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function"
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise OpenAIError("tools must be a list of {type: 'function', function: {name, "
                          "description, parameters}}", param="tools")
    names = [t["function"]["name"] for t in tools]
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else _flag(body, "parallel_tool_calls")
    if choice in (None, "auto"):
        return tools or None, "", parallel
    if choice == "none":
        return None, "", parallel
    if choice == "required":
        return tools, _TOOL_OPEN + "\n", parallel
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if name not in names:
        raise OpenAIError(f"tool_choice={choice!r}: must be 'none', 'auto', 'required' or "
                          f"{{type: 'function', function: {{name}}}} with a name among "
                          f"{names}", param="tool_choice")
    return tools, _TOOL_OPEN + "\n" + json.dumps({"name": name})[:-1] + ', "arguments": ', \
        parallel


def tool_calls(text: str, plan: _Plan) -> list[dict] | None:
    """The reply's calls in OpenAI's shape (None: no call, or one that does not parse; the
    text is then the answer)."""
    from agentgym.envs.function_calling import CallError, parse_tool_calls  # lazy: imports the envs
    if not plan.tools or _TOOL_OPEN not in text:
        return None
    parsed = parse_tool_calls(text, plan.tools)
    bad = [p.message for p in parsed if isinstance(p, CallError)]
    if bad or not parsed:
        logger.info("a reply's tool call does not parse (%s); answered as content", bad)
        return None
    calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": p.name,
                           "arguments": json.dumps(p.arguments, ensure_ascii=False)}}
             for p in parsed]
    return calls if plan.parallel else calls[:1]


def chat_choice(front, plan: _Plan, k: int, out: GenerateOutput) -> dict:
    full = plan.forced + front.text(out, plan.sampling.stop)
    message: dict[str, Any] = {"role": "assistant", "content": full}
    finish = "length" if out.finish_reason == "length" else "stop"
    calls = tool_calls(full, plan)
    if calls:
        before = full[:full.find(_TOOL_OPEN)].strip()
        message = {"role": "assistant", "content": before or None, "tool_calls": calls}
        finish = "tool_calls"
    choice = {"index": k, "message": message, "logprobs": None, "finish_reason": finish}
    if plan.logprobs is not None:
        choice["logprobs"] = {"content": logprob_entries(front, out, 0), "refusal": None}
    if plan.token_ids:
        choice["token_ids"] = list(out.ids)
    return choice


def logprob_entries(front, out: GenerateOutput, start: int, stop: int | None = None) -> list:
    """Chat logprob entries of the sampled tokens ``[start, stop)`` (a final EOS left out)."""
    ids = front.visible_ids(out.ids)[start:stop]
    tops = out.top_logprobs or [None] * len(out.ids)
    return [front.token_entry(t, out.logprobs[start + j], tops[start + j])
            for j, t in enumerate(ids)]


# -- completions ---------------------------------------------------------------------------
def completion_plans(front, body: dict) -> list[_Plan]:
    """One plan per prompt (``prompt``: a string, a list of them, token ids or a list
    of those)."""
    _unknown(body, COMPLETION_KEYS)
    prompts = _prompts(front, body.get("prompt"))
    if body.get("suffix"):
        raise OpenAIError("suffix is not supported by agentgym serve", param="suffix")
    logprobs = _number(body, "logprobs", 0, 20, None, integer=True)
    if _flag(body, "echo") and logprobs is not None:
        raise OpenAIError("echo with logprobs is not supported by agentgym serve (it would "
                          "need the prompt's logprobs)", param="echo")
    stream, include_usage = _stream_flags(body)
    plans = []
    for ids in prompts:
        sampling, n = _sampling(front, body, len(ids), 16, logprobs)
        plans.append(_Plan(ids, sampling, n, stream, include_usage, logprobs,
                           _flag(body, "return_token_ids")))
    best_of = body.get("best_of")
    if best_of not in (None, 1, plans[0].n):
        raise OpenAIError(f"best_of={best_of!r}: agentgym serve returns every sample; leave "
                          "it out or make it equal to n", param="best_of")
    return plans


def _prompts(front, prompt: Any) -> list[list[int]]:
    def ints(p):
        return isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                                 for t in p)
    if isinstance(prompt, str):
        prompts = [prompt]
    elif ints(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or ints(p)
                                                     for p in prompt):
        prompts = prompt
    else:
        raise OpenAIError("prompt must be a string, a list of strings, a list of token ids or "
                          f"a list of those; got {str(prompt)[:80]!r}", param="prompt")
    vocab = len(front.tok)
    out = []
    for p in prompts:
        ids = list(front.tok.encode(p)) if isinstance(p, str) else list(p)
        if not ids:
            raise OpenAIError("prompt: an empty prompt has no tokens", param="prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"prompt holds token ids outside [0, {vocab}): {bad[:5]}",
                              param="prompt")
        out.append(ids)
    return out


def completion_choice(front, plan: _Plan, body: dict, index: int, out: GenerateOutput) -> dict:
    text = front.text(out, plan.sampling.stop)
    if body.get("echo"):
        text = front.tok.decode(plan.prompt_ids, skip_special_tokens=True) + text
    choice = {"index": index, "text": text, "logprobs": None,
              "finish_reason": "length" if out.finish_reason == "length" else "stop"}
    if plan.logprobs is not None:
        choice["logprobs"] = completion_logprobs(front, out, 0, None, 0)
    if plan.token_ids:
        choice["token_ids"] = list(out.ids)
        choice["prompt_token_ids"] = list(plan.prompt_ids)
    return choice


def completion_logprobs(front, out: GenerateOutput, start: int, stop: int | None,
                        offset: int) -> dict:
    """``/v1/completions``' logprobs of tokens ``[start, stop)``; offsets from ``offset``."""
    entries = logprob_entries(front, out, start, stop)
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]}
                             for e in entries] if out.top_logprobs is not None else None,
            "text_offset": offsets}
