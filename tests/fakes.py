"""Fakes used only to script model output or inject faults (real components elsewhere)."""

from __future__ import annotations

import asyncio
import json
import threading

from fastapi import Request  # module level: FastAPI resolves the proxy's annotation here

from agentgym.rollout.engines.base import Engine
from agentgym.core.types import GenerateOutput, SamplingParams
from agentgym.tools.errors import ToolTimeout, ToolUnavailable


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

    async def pause(self, partial: bool = False):
        pass

    def resume(self):
        pass


class ScriptedServed(ScriptedEngine):
    """Scripted replies behind the real serve app (which reads the model's vocabulary and
    EOS ids); records how many requests run at once."""

    def __init__(self, model, tokenizer, script, delay_s=0.0):
        super().__init__(tokenizer, script, delay_s=delay_s)
        self.model, self.tokenizer = model, tokenizer
        self.eos_ids = {tokenizer.eos_token_id}
        self.max_batch_size, self.stats = 32, {}  # what /server_info reports (engine=sglang)
        self.running = self.most = 0
        self._lock = threading.Lock()

    async def generate(self, prompt_ids, sampling, images=None, session_id=None):
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            return await super().generate(prompt_ids, sampling, images, session_id)
        finally:
            with self._lock:
                self.running -= 1


class ScriptedAgentModel(ScriptedServed):
    """The rollout engine of a training run (``engine=scripted-agent-model``, registered by
    tests/test_agents.py), replying by what its prompt holds: a search call for the
    question, then, once a tool result is in the prompt, an answer (right on every other
    reply). A fake of the model's output only: the trainer updates the real tiny model on
    these tokens when a group's rewards differ."""

    CALL = ('<tool_call>\n{"name": "search", "arguments": {"query": "capital of Peru"}}'
            '\n</tool_call>')

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer, [])
        self.replies = 0

    @classmethod
    def from_config(cls, cfg, model, tokenizer):
        return cls(model, tokenizer)

    async def generate(self, prompt_ids, sampling, images=None, session_id=None):
        seen = self.tok.decode(prompt_ids)
        if "<|im_start|>tool" not in seen:
            self.script.append(f"{self.CALL} + eos")
        else:
            self.replies += 1
            self.script.append("Lima + eos" if self.replies % 2 else "Cusco + eos")
        return await super().generate(prompt_ids, sampling, images, session_id)


class ScriptedCalcModel(ScriptedAgentModel):
    """The rollout engine of an ``env=verifiers`` run on tests/vf_envs/vf_calc
    (``engine=scripted-calc-model``, registered by tests/test_verifiers.py): a call of the
    environment's ``calc_add`` tool with the question's numbers, then, once the tool's
    result is in the prompt, a reply that cycles through right and brief, right and
    wordy, and wrong, so a group's rewards differ. A fake of the model's output only."""

    async def generate(self, prompt_ids, sampling, images=None, session_id=None):
        import re
        seen = self.tok.decode(prompt_ids)
        a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)\?", seen)[-1])
        if "<|im_start|>tool" not in seen:
            call = {"name": "calc_add", "arguments": {"a": a, "b": b}}
            self.script.append(f"<tool_call>\n{json.dumps(call)}\n</tool_call> + eos")
        else:
            reply = [f"{a + b}", f"The tool says the sum is {a + b} .", "7"][self.replies % 3]
            self.replies += 1
            self.script.append(f"{reply} + eos")
        return await ScriptedServed.generate(self, prompt_ids, sampling, images, session_id)


class ScriptedSWEModel(ScriptedAgentModel):
    """The rollout engine of an ``env=mini-swe-agent`` run on the built-in SWE tasks
    (``engine=scripted-swe-model``, registered by tests/test_swe.py), replying in
    mini-swe-agent's text format: a first reply that edits minicalc/ops.py (the right fix
    for the task's first sample, a harmless ``ls`` for its second, so each group's rewards
    differ), then, once a command's output is in the prompt, the submit command. A fake of
    the model's output only."""

    FIXES = {"clamp()": "sed -i 's/if x < hi/if x > hi/' minicalc/ops.py",
             "mean()": "sed -i 's/(len(values) + 1)/len(values)/' minicalc/ops.py"}

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer)
        self.firsts: dict[str, int] = {}

    async def generate(self, prompt_ids, sampling, images=None, session_id=None):
        seen = self.tok.decode(prompt_ids)
        task = next(k for k in self.FIXES if k in seen)
        if "<returncode>" not in seen:
            with self._lock:
                k = self.firsts[task] = self.firsts.get(task, -1) + 1
            command = self.FIXES[task] if k % 2 == 0 else "ls"
        else:
            command = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
        self.script.append(f"THOUGHT: next.\n\n```mswea_bash_command\n{command}\n``` + eos")
        return await ScriptedServed.generate(self, prompt_ids, sampling, images, session_id)


class StallingLetterModelFault(ScriptedServed):
    """Fault injection (``engine=stalling-letter-model-fault``, registered by
    tests/test_stalls.py): a prompt holding ``#0`` sends the request to an engine step that
    never returns (``blocked_engine_step``, in a thread, until the test releases
    toy_envs.STALL_RELEASE); any other prompt gets an 'e'-heavy reply."""

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer, [])

    @classmethod
    def from_config(cls, cfg, model, tokenizer):
        return cls(model, tokenizer)

    async def generate(self, prompt_ids, sampling, images=None, session_id=None):
        if "#0" in self.tok.decode(prompt_ids):  # the engine's own thread, stuck
            threading.Thread(target=blocked_engine_step, daemon=True, name="engine-step").start()
            await asyncio.get_running_loop().create_future()  # its answer never comes
        self.script.append("eee eee + eos")
        return await super().generate(prompt_ids, sampling, images, session_id)


def blocked_engine_step() -> None:
    from toy_envs import STALL_RELEASE
    STALL_RELEASE.wait()


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
        import httpx
        import uvicorn
        from fastapi import FastAPI
        from fastapi.responses import Response

        from agentgym.supervision.server_process import free_port
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
        from conftest import wait_until
        wait_until(lambda: self._server.started or not self._thread.is_alive(), 60,
                   "the fault proxy to start")
        assert self._server.started, f"the fault proxy could not serve on port {port}"

    def close(self):
        self._server.should_exit = True
        self._thread.join(timeout=10)


class SearchingEngine(ScriptedEngine):
    """Scripted model output for whole training runs of the search env: the first turn of
    every episode searches (``<search>QUERY</search>``), the next answers; even samples
    answer ``right``, odd ones ``wrong`` (so GRPO groups have reward variance). Sessions
    tell the episodes apart (the manager passes one per episode).

    ``on_generate(k)`` runs before the k-th reply (from 1): the place a test injects a
    fault at a known point of the run. Logprobs are a fixed -1.0 per token (the trainer
    recomputes its own)."""

    needs_model = False

    def __init__(self, tokenizer, query: str = "who wrote the declaration of independence",
                 right: str = "Thomas Jefferson", wrong: str = "Canberra",
                 on_generate=None) -> None:
        self.tok, self.query, self.right, self.wrong = tokenizer, query, right, wrong
        self.on_generate = on_generate
        self.calls = 0
        self._turns: dict[str, int] = {}

    async def generate(self, prompt_ids, sampling: SamplingParams, images=None, session_id=None):
        self.calls += 1
        if self.on_generate is not None:
            self.on_generate(self.calls)
        turn = self._turns.get(session_id, 0)
        self._turns[session_id] = turn + 1
        if turn == 0:
            text = f"<search> {self.query} </search>"
        else:
            sample = int(str(session_id).split("/")[1])
            text = f"<answer> {self.right if sample % 2 == 0 else self.wrong} </answer>"
        ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        return GenerateOutput(ids, [-1.0] * len(ids), "stop")

    @classmethod
    def from_config(cls, cfg, model, tokenizer):
        return cls(tokenizer)


class DroppingProxyFault:
    """Injects dropped connections: a TCP proxy on loopback in front of a real server.
    :meth:`drop_for` cuts every open connection and, for that many seconds, closes each
    new one at once without an answer (as a restarting load balancer or a flapping link
    does); otherwise bytes pass both ways unchanged. ``dropped`` counts the connections
    it refused."""

    def __init__(self, upstream_port: int) -> None:
        import socket
        import threading
        self._socket = socket
        self.upstream = ("127.0.0.1", upstream_port)
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self.dropped = 0
        self._until = 0.0
        self._closed = False
        self._live: set = set()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def drop_for(self, seconds: float) -> None:
        import time
        with self._lock:
            self._until = time.monotonic() + seconds
            live, self._live = list(self._live), set()
        for s in live:
            self._cut(s)

    def _cut(self, s) -> None:
        try:
            s.shutdown(self._socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()

    def _accept(self) -> None:
        import threading
        import time
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            with self._lock:
                dropping = time.monotonic() < self._until
                if dropping:
                    self.dropped += 1
            if dropping:
                self._cut(client)
                continue
            try:
                upstream = self._socket.create_connection(self.upstream)
            except OSError:
                self._cut(client)
                continue
            with self._lock:
                self._live |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                t = threading.Thread(target=self._pump, args=(a, b), daemon=True)
                t.start()

    def _pump(self, a, b) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        with self._lock:
            self._live -= {a, b}
        self._cut(a)
        self._cut(b)

    def close(self) -> None:
        self._closed = True
        self._server.close()
        self.drop_for(0)


def scripted_length_reward(data_source, solution_str, ground_truth, extra_info=None):
    """A scripted reward in verl's custom-reward signature (``reward=fakes:…``): the
    episode's text length, so a random model's samples differ and an update has a signal."""
    return len(solution_str) / 1000.0


class AnsweringEngine(ScriptedEngine):
    """Scripted model output for whole training runs of a question-answer env
    (``env=reasoning_gym``): it finds which of :attr:`answers`' questions its prompt holds
    and answers ``<answer>{answer}</answer>`` on even samples and ``<answer>{wrong}</answer>``
    on odd ones, so GRPO groups have reward variance. With :attr:`code` set, an episode's
    first reply runs that code (``<code>```python …```</code>``) and the answer comes
    once an ``<interpreter>`` reply is in the prompt. Logprobs are a fixed -1.0 per token
    (the trainer recomputes its own)."""

    needs_model = False
    answers: dict[str, str] = {}  # question -> the right answer (set by the test)
    wrong = "no idea"
    code = ""

    def __init__(self, tokenizer) -> None:
        self.tok, self.replies = tokenizer, []

    async def generate(self, prompt_ids, sampling: SamplingParams, images=None, session_id=None):
        seen = self.tok.decode(prompt_ids)
        found = [a for q, a in self.answers.items() if q.strip() in seen]
        assert len(found) == 1, f"the prompt holds {len(found)} of the test's questions"
        sample = int(str(session_id).split("/")[1])
        if self.code and "<interpreter>" not in seen:
            text = f"<code>\n```python\n{self.code}\n```\n</code>"
        else:
            text = f"<answer>{found[0] if sample % 2 == 0 else self.wrong}</answer>"
        self.replies.append(text)
        ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        return GenerateOutput(ids, [-1.0] * len(ids), "stop")

    @classmethod
    def from_config(cls, cfg, model, tokenizer):
        return cls(tokenizer)
