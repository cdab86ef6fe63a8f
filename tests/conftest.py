"""Shared fixtures: the tiny model, a real local retriever, the toy env registration.

Models and the BM25 index are built into the normal cache (``$AGENTGYM_CACHE`` or
``~/.cache/agentgym``); on a clean machine the first run builds them (seconds)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import envs  # noqa: E402


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


# A test run sent SIGTERM stops as on Ctrl-C: pytest tears the fixtures down (the session's
# retriever server, the Ray cluster) instead of dying with them still running.
if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
    signal.signal(signal.SIGTERM, _interrupt)

if "agentgym-test/Letter-v0" not in envs.env_ids():
    envs.register_env("agentgym-test/Letter-v0", "toy_envs:LetterEnv")
if "agentgym-test/Talk-v0" not in envs.env_ids():
    envs.register_env("agentgym-test/Talk-v0", "toy_envs:TalkEnv")


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
    from tools.local_retriever import LocalRetriever
    with LocalRetriever(data_dir() / "corpus" / "wiki_passages.jsonl.gz") as r:
        yield r.url
