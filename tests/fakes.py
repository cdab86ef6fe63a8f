"""Fakes used only to script model output or inject faults (real components elsewhere)."""

from __future__ import annotations

import asyncio

from fastapi import Request  # module level: FastAPI resolves the proxy's annotation here

from agentgym.rollout.engines.base import Engine
from agentgym.core.types import GenerateOutput, SamplingParams
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

    async def generate(self, prompt_ids, sampling: SamplingParams, images=None, session_id=None):
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


class FlakyProxyFault:
    """Injects transient server failures: an HTTP proxy on loopback in front of a real
    server that answers ``status`` (with ``body``) to the first ``fail_first`` requests to
    ``path`` and forwards everything else (counting what it saw in ``seen``). Raise
    ``left`` to inject more."""

    def __init__(self, upstream: str, fail_first: int, status: int = 503,
                 path: str = "/generate",
                 body: bytes = b'{"error": {"message": "injected fault"}}') -> None:
        import threading

        import httpx
        import uvicorn
        from fastapi import FastAPI
        from fastapi.responses import Response

        from agentgym.core.server_process import free_port
        self.upstream, self.left, self.status, self.path = upstream, fail_first, status, path
        self.seen = {"failed": 0, "forwarded": 0}
        app = FastAPI()

        @app.api_route("/{rest:path}", methods=["GET", "POST"])
        async def proxy(rest: str, request: Request):
            if "/" + rest == self.path and self.left > 0:
                self.left -= 1
                self.seen["failed"] += 1
                return Response(status_code=self.status, content=body,
                                media_type="application/json")
            self.seen["forwarded"] += 1
            async with httpx.AsyncClient(timeout=120) as http:
                r = await http.request(request.method, f"{self.upstream}/{rest}",
                                       content=await request.body(),
                                       headers={"content-type": "application/json"})
            return Response(status_code=r.status_code, content=r.content,
                            media_type=r.headers.get("content-type"))

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                     log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        import time
        while not self._server.started:
            time.sleep(0.02)

    def close(self):
        self._server.should_exit = True
        self._thread.join(timeout=10)
