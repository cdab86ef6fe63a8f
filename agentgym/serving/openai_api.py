"""OpenAI's HTTP API over any rollout engine: ``/v1/models``, ``/v1/chat/completions``
and ``/v1/completions``, as the official ``openai`` SDK calls them.

:class:`OpenAIFrontend` turns a request into prompt token ids, samples its ``n`` choices on
an :class:`~agentgym.rollout.engines.base.Engine` and answers in OpenAI's shapes
(streamed as OpenAI's server-sent events when ``stream`` is set). ``agentgym serve`` mounts
it (:func:`openai_routes`); so can anything else that holds an engine.

Chat requests honour ``messages`` (system/developer, user, assistant with ``tool_calls``,
``tool``; string content or text parts), ``n``, ``temperature``, ``top_p``, ``seed``,
``stop``, ``max_tokens`` / ``max_completion_tokens``, ``logprobs`` / ``top_logprobs``,
``stream`` / ``stream_options.include_usage``, ``tools`` / ``tool_choice`` /
``parallel_tool_calls``. Tools reach the prompt as the envs' function calling puts them
there (the chat template's ``tools=``, else Hermes instructions in the system message,
:meth:`agentgym.rollout.chat.ChatTokens.with_tools`); the reply's ``<tool_call>`` blocks are
parsed by :func:`agentgym.envs.function_calling.parse_tool_calls` and answered as OpenAI's
``tool_calls`` (``finish_reason`` ``"tool_calls"``). A reply whose calls do not parse is
answered as plain content, as the model wrote it. ``tool_choice="required"`` or a named
function starts the reply with ``<tool_call>`` (and the name): the model writes the rest.

Two extensions from vLLM: ``top_k``, and ``return_token_ids`` (the response then carries
``prompt_token_ids`` and each choice its ``token_ids``: what a trainer needs, untouched by
any re-tokenisation).

Logprobs are the engine's: ``log_softmax(logits / temperature)`` before top-p/top-k. Errors
are OpenAI's: ``{"error": {"message", "type", "param", "code"}}`` with 400 for a bad
request (the message names the value and what is valid), 404 for an unknown model or
route. One model is served: a request naming another model is answered by it, so an
agent written for another model name runs unchanged (docs/decisions/serving.md, "One model
is served").
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from agentgym.core.types import GenerateOutput, SamplingParams
from agentgym.serving.openai_chat import (chat_choice, chat_plan, completion_choice,
                                          completion_plans)
from agentgym.serving.openai_common import (Call, OpenAIError, _Plan, error_body, token_bytes,
                                            usage)
from agentgym.serving.openai_stream import chat_events, completion_events
from agentgym.rollout.chat import ChatTokens

logger = logging.getLogger(__name__)

class OpenAIFrontend:
    """OpenAI's API over ``engine``.

    Args:
        engine: any :class:`~agentgym.rollout.engines.base.Engine`.
        tokenizer: the model's (chat template, decoding).
        model_id: what ``/v1/models`` lists.
        max_context: prompt plus ``max_tokens`` may not exceed it.
        default_max_tokens: a chat reply's budget when the request sets none.
        on_call: called with a :class:`Call` for every answered request (before its
            response is sent).
    """

    def __init__(self, engine, tokenizer, model_id: str, max_context: int = 1 << 20,
                 default_max_tokens: int = 256,
                 on_call: Callable[[Call], None] | None = None, chat_tokens=None) -> None:
        self.engine, self.tok, self.model_id = engine, tokenizer, model_id
        self.max_context, self.default_max_tokens = max_context, default_max_tokens
        self.on_call = on_call
        self.chat_tokens = chat_tokens or ChatTokens(tokenizer, image_processor=None)
        self.eos_ids = set(getattr(engine, "eos_ids", None) or {tokenizer.eos_token_id})
        self.created = int(time.time())
        self._ids = itertools.count()

    # -- models ---------------------------------------------------------------------------
    def models(self) -> dict:
        return {"object": "list", "data": [self.model(self.model_id)]}

    def model(self, name: str) -> dict:
        if name != self.model_id:
            raise OpenAIError(f"The model '{name}' does not exist; this server serves "
                              f"'{self.model_id}'", 404, "model", "model_not_found")
        return {"id": self.model_id, "object": "model", "created": self.created,
                "owned_by": "agentgym"}

    # -- chat -----------------------------------------------------------------------------
    async def chat(self, body: dict) -> dict | AsyncIterator[str]:
        """``/v1/chat/completions``: a response object, or (``stream``) its SSE lines."""
        plan = chat_plan(self, body)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        model = body.get("model") or self.model_id
        samplings = self.samplings(plan)  # refusals come before a stream starts
        if plan.stream:
            return chat_events(self, plan, samplings, body, rid, created, model)
        outs = await self.sample(plan, samplings)
        self._record("chat", body, plan, outs)
        choices = [chat_choice(self, plan, k, out) for k, out in enumerate(outs)]
        answer = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                  "system_fingerprint": self.fingerprint(), "choices": choices,
                  "usage": usage(plan, outs)}
        if plan.token_ids:
            answer["prompt_token_ids"] = plan.prompt_ids
        return answer

    # -- completions ----------------------------------------------------------------------
    async def completions(self, body: dict) -> dict | AsyncIterator[str]:
        """``/v1/completions``: a response object, or (``stream``) its SSE lines."""
        plans = completion_plans(self, body)
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        model = body.get("model") or self.model_id
        samplings = [self.samplings(p) for p in plans]
        if plans[0].stream:
            return completion_events(self, plans, samplings, body, rid, created, model)
        every = await asyncio.gather(*(self.sample(p, s) for p, s in zip(plans, samplings)))
        choices, total = [], {"prompt_tokens": 0, "completion_tokens": 0}
        for i, (plan, outs) in enumerate(zip(plans, every)):
            self._record("completion", body, plan, outs)
            choices += [completion_choice(self, plan, body, i * plan.n + k, out)
                        for k, out in enumerate(outs)]
            for key, value in usage(plan, outs).items():
                if key in total:
                    total[key] += value
        total["total_tokens"] = total["prompt_tokens"] + total["completion_tokens"]
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "system_fingerprint": self.fingerprint(), "choices": choices, "usage": total}

    # -- shared ---------------------------------------------------------------------------
    def chat_prompt(self, messages: list[dict], tools: list[dict] | None,
                    forced: str) -> list[int]:
        """A chat request's prompt ids: the messages through the chat template (tools in
        it), then the text the reply is forced to start with."""
        return self.chat_tokens.prompt_ids(messages, tools) + \
            (self.chat_tokens.encode(forced) if forced else [])

    def fingerprint(self) -> str:
        return f"agentgym-v{getattr(self.engine, 'policy_version', 0)}"

    def samplings(self, plan: _Plan) -> list[SamplingParams]:
        """One per choice: a seeded request's k-th choice is seeded ``seed + k``, so the n
        choices are n samples, not n copies."""
        s = plan.sampling
        if s.seed is None or plan.n == 1:
            return [s] * plan.n
        return [SamplingParams(**{**s.__dict__, "seed": s.seed + k}) for k in range(plan.n)]

    async def sample(self, plan: _Plan, samplings: list[SamplingParams]) -> list[GenerateOutput]:
        return list(await asyncio.gather(*(self.engine.generate(plan.prompt_ids, s)
                                           for s in samplings)))

    def _record(self, kind: str, body: dict, plan: _Plan, outs: list[GenerateOutput]) -> None:
        if self.on_call is not None:
            self.on_call(Call(kind, body, list(plan.prompt_ids), list(outs), plan.messages,
                              plan.tools, plan.forced, plan))

    def visible_ids(self, ids: list[int]) -> list[int]:
        """The sampled ids without a final EOS (it has no text)."""
        return ids[:-1] if ids and ids[-1] in self.eos_ids else ids

    def text(self, out: GenerateOutput, stops: tuple[str, ...]) -> str:
        """The reply's text: special tokens skipped, cut at a matched stop string."""
        text = self.tok.decode(self.visible_ids(out.ids), skip_special_tokens=True)
        if out.finish_reason == "stop" and out.stop_reason in stops and out.stop_reason in text:
            text = text[:text.find(out.stop_reason)]
        return text

    def token_entry(self, token: int, logprob: float, top: list | None) -> dict:
        """A chat ``logprobs.content`` entry: the token's text, bytes and alternatives. A
        special token the content skips keeps its text but has no bytes, so the entries'
        bytes join to exactly the content."""
        raw = token_bytes(self.tok, token)
        skipped = token in self.tok.all_special_ids
        entry = {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob,
                 "bytes": [] if skipped else list(raw)}
        entry["top_logprobs"] = [{"token": token_bytes(self.tok, t).decode(
            "utf-8", errors="replace"), "logprob": lp, "bytes": list(token_bytes(self.tok, t))}
            for t, lp in (top or [])]
        return entry


def openai_routes(app, front, prefix: str = "") -> None:
    """Mount ``front`` on a FastAPI ``app`` under ``prefix`` (which may hold path
    parameters): the routes, and OpenAI's error bodies for its errors and for unknown
    routes. ``front``: an :class:`OpenAIFrontend`, or a function of the request that
    returns the one to answer it (an agent's episode, :mod:`agentgym.serving.agents`)."""
    pick = front if callable(front) and not isinstance(front, OpenAIFrontend) \
        else (lambda request: front)

    @app.exception_handler(OpenAIError)
    async def _refused(request: Request, exc: OpenAIError) -> JSONResponse:
        logger.info("%d %s: %s", exc.status, request.url.path, exc)
        return JSONResponse(status_code=exc.status, content=exc.body())

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        message = f"Invalid URL ({request.method} {request.url.path})" if exc.status_code in (
            404, 405) else str(exc.detail)
        return JSONResponse(status_code=exc.status_code, content=error_body(message))

    async def body_of(request: Request) -> dict:
        try:
            body = json.loads(await request.body() or b"null")
        except ValueError as e:
            raise OpenAIError(f"the body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise OpenAIError("the body must be a JSON object")
        return body

    def answer(result):
        if isinstance(result, dict):
            return result
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.get(prefix + "/v1/models")
    async def models(request: Request):
        return pick(request).models()

    @app.get(prefix + "/v1/models/{name:path}")
    async def model(request: Request):
        return pick(request).model(request.path_params["name"])

    @app.post(prefix + "/v1/chat/completions")
    async def chat_completions(request: Request):
        return answer(await pick(request).chat(await body_of(request)))

    @app.post(prefix + "/v1/completions")
    async def completions(request: Request):
        return answer(await pick(request).completions(await body_of(request)))
