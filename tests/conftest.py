"""Shared fixtures: the tiny model, a real local retriever, the toy env registration;
and ``wait_until``, how a test waits for an effect that lands after its cause.

Models and the BM25 index are built into the normal cache (``$AGENTGYM_CACHE`` or
``~/.cache/agentgym``); on a clean machine the first run builds them (seconds)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from agentgym import envs  # noqa: E402


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


# A test run sent SIGTERM stops as on Ctrl-C: pytest tears the fixtures down (the session's
# retriever server, the Ray cluster) instead of dying with them still running.
if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
    signal.signal(signal.SIGTERM, _interrupt)

if "agentgym-test/Letter-v0" not in envs.env_ids():
    envs.register_env("agentgym-test/Letter-v0", "toy_envs:LetterEnv")
if "agentgym-test/Level-v0" not in envs.env_ids():
    envs.register_env("agentgym-test/Level-v0", "toy_envs:LevelEnv")
if "agentgym-test/TwoStep-v0" not in envs.env_ids():
    envs.register_env("agentgym-test/TwoStep-v0", "toy_envs:TwoStepEnv")
if "agentgym-test/Talk-v0" not in envs.env_ids():
    envs.register_env("agentgym-test/Talk-v0", "toy_envs:TalkEnv")


def wait_until(condition, timeout: float, what: str) -> None:
    """Poll ``condition()`` until it is true; fail saying ``what`` did not happen after
    ``timeout`` seconds. For effects that land after the call that caused them (a process
    exiting after a signal, a line a child is still writing): a test waits on the
    condition itself, with a deadline generous enough for a loaded machine, never on a
    fixed sleep. Import it with ``from conftest import wait_until``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.05)


@pytest.fixture(scope="session")
def tiny_path():
    from agentgym.models.zoo import resolve_model
    return resolve_model("tiny")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_path):
    from agentgym.models.zoo import load_tokenizer
    return load_tokenizer(tiny_path)


@pytest.fixture(scope="session")
def tiny_model(tiny_path):
    from agentgym.models.zoo import load_model
    return load_model(tiny_path)


@pytest.fixture(scope="session")
def retriever_url():
    from agentgym.core.paths import data_dir
    from agentgym.tools.local_retriever import LocalRetriever
    with LocalRetriever(data_dir() / "corpus" / "wiki_passages.jsonl.gz") as r:
        yield r.url


@pytest.fixture
def scripted_server(tiny_model, tiny_tokenizer):
    """The real ``agentgym serve`` app (uvicorn, loopback) over a scripted engine:
    ``start(script)`` -> ``(url, engine)``."""
    import threading

    import uvicorn

    from agentgym.supervision.server_process import free_port
    from agentgym.serving.serve import ServeState, create_app
    from fakes import ScriptedServed
    servers = []

    def start(script, delay_s=0.0):
        engine = ScriptedServed(tiny_model, tiny_tokenizer, script, delay_s)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(ServeState(engine, "scripted")),
                                               host="127.0.0.1", port=port, log_level="error"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        wait_until(lambda: server.started, 60, "the scripted server's start")
        servers.append((server, thread))
        return f"http://127.0.0.1:{port}", engine

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=30)
