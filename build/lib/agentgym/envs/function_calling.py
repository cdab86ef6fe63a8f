"""Function calling: tools declared as OpenAI function schemas, calls in the Hermes format.

An env that sets ``tools`` (a list of ``{"type": "function", "function": {"name",
"description", "parameters"}}``) gets them into the prompt through the tokenizer's chat
template (``apply_chat_template(..., tools=tools)``) when the template renders tools;
otherwise through :func:`fallback_system_message`, a system message with Qwen2.5's Hermes
instructions, so the model sees the same protocol either way (:mod:`agentgym.rollout.chat`).

The model calls tools as Hermes / Qwen do, any number per turn::

    <tool_call>
    {"name": "search", "arguments": {"query": "capital of Australia"}}
    </tool_call>

:func:`parse_tool_calls` returns each call checked against its schema: unknown tool, bad
JSON, a missing or unknown argument and a wrong argument type are :class:`CallError`s whose
message says what was wrong (the env returns it as the call's ``tool`` message). Results
go back as ``{"role": "tool", "name": ..., "content": ...}`` messages, rendered by the chat
template after the assistant turn (``observation_format = "chat"``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"

#: Qwen2.5's tool instructions (its chat template's system text), for templates without tools
HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')

_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                       "boolean": (bool,), "array": (list,), "object": (dict,),
                                       "null": (type(None),)}


def function_tool(name: str, description: str, properties: dict[str, dict],
                  required: list[str] | None = None) -> dict:
    """An OpenAI function schema."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties,
                       "required": list(required if required is not None else properties)}}}


def fallback_system_message(tools: list[dict], system: str = "") -> dict:
    """The system message that carries ``tools`` for a chat template that does not render
    them (an existing system prompt first, as Qwen2.5's template does)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    text = HERMES_SYSTEM.format(tools=listed)
    return {"role": "system", "content": f"{system}\n\n{text}" if system else text}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class CallError:
    """A call that cannot run; ``message`` says why (and is shown to the model)."""

    message: str
    name: str = ""


def parse_tool_calls(text: str, tools: list[dict]) -> list[ToolCall | CallError]:
    """Every ``<tool_call>`` block of ``text``, in order, checked against ``tools``; an
    unterminated ``<tool_call>`` at the end is a :class:`CallError` too."""
    schemas = {t["function"]["name"]: t["function"].get("parameters", {}) for t in tools}
    out: list[ToolCall | CallError] = []
    end = 0
    for m in _CALL.finditer(text):
        out.append(_one(m.group(1).strip(), schemas))
        end = m.end()
    if _OPEN in text[end:]:
        out.append(CallError("a <tool_call> was opened but not closed with </tool_call>"))
    return out


def _one(body: str, schemas: dict[str, dict]) -> ToolCall | CallError:
    try:
        call = json.loads(body)
    except ValueError as e:
        return CallError(f"the tool call is not valid JSON ({e.msg} at position {e.pos}): "
                         f"{body[:120]!r}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return CallError(f'a tool call must be {{"name": ..., "arguments": {{...}}}}; got '
                         f"{body[:120]!r}")
    name, args = call["name"], call.get("arguments", {})
    if name not in schemas:
        return CallError(f"unknown tool {name!r}; available: {', '.join(schemas)}", name)
    if isinstance(args, str):  # some models send the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return CallError(f"{name}: arguments is a string that is not JSON: {args[:80]!r}",
                             name)
    if not isinstance(args, dict):
        return CallError(f"{name}: arguments must be an object, got {type(args).__name__}", name)
    problem = check_arguments(args, schemas[name])
    return CallError(f"{name}: {problem}", name) if problem else ToolCall(name, args)


def check_arguments(args: dict, schema: dict) -> str:
    """What is wrong with ``args`` for the JSON schema ``schema`` (object, its
    ``properties`` by type and ``enum``, ``required``, no unknown keys when
    ``additionalProperties`` is false); ``""`` when nothing is."""
    props: dict[str, Any] = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in args]
    if missing:
        return f"missing required argument(s) {missing}; expected {list(props)}"
    if schema.get("additionalProperties") is False:
        extra = sorted(set(args) - set(props))
        if extra:
            return f"unknown argument(s) {extra}; expected {list(props)}"
    for key, value in args.items():
        spec = props.get(key)
        if not spec:
            continue
        kind = spec.get("type")
        kinds = kind if isinstance(kind, list) else [kind] if kind else []
        if kinds and not any(isinstance(value, _TYPES.get(k, object)) and
                             not (k in ("integer", "number") and isinstance(value, bool))
                             for k in kinds):
            return (f"argument {key!r} must be {' or '.join(kinds)}, got "
                    f"{type(value).__name__} {json.dumps(value)[:60]}")
        if "enum" in spec and value not in spec["enum"]:
            return f"argument {key!r} must be one of {spec['enum']}, got {value!r}"
    return ""


def tool_message(name: str, content: str) -> dict:
    """A tool result as the chat message the template renders."""
    return {"role": "tool", "name": name, "content": content}
