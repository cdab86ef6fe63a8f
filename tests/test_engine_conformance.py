"""The conformance suite (``tests/engine_conformance.py``) over every engine we can run.

- ``hf``: the in-process HF engine.
- ``hf_graphs``: the same on its GPU path (captured decode steps) through the CPU's
  graph stand-in.
- ``served``: ``agentgym serve`` on loopback through the SGLang client (stop strings
  applied by the server).
- ``served_skip_tokenizer``: the same server run with ``--skip-tokenizer-init``, so the
  client applies stop strings, as against SGLang run that way.
- ``sglang``: a real SGLang server, when one is configured (skipped otherwise)::

      # launch one (GPU machine, pip install "sglang[all]"):
      AGENTGYM_SGLANG_MODEL=/models/Qwen2.5-0.5B-Instruct \\
          pytest tests/test_engine_conformance.py -k sglang
      # or use a running one (same model folder, for the reference forward passes):
      AGENTGYM_SGLANG_URL=http://127.0.0.1:30000 AGENTGYM_SGLANG_MODEL=/models/... \\
          pytest tests/test_engine_conformance.py -k sglang

  ``AGENTGYM_SGLANG_DETERMINISTIC=1`` says the server runs with
  ``--enable-deterministic-inference`` (seeded sampling reproducible);
  ``AGENTGYM_SGLANG_ATOL`` sets the logprob tolerance (default 0.05: SGLang computes in
  bf16 with its own kernels).
"""

from __future__ import annotations

import copy
import functools
import os

import pytest

from agentgym.rollout.engines.base import push_weights
from agentgym.rollout.engines.hf import HFEngine
from agentgym.rollout.engines.launcher import launch_serve
from agentgym.rollout.engines.sglang import SGLangEngine
from agentgym.rollout.engines.sglang_weights import unique_tensors
from engine_conformance import EngineCase, EngineConformance, perturbed


def _push(engine):
    return functools.partial(push_weights, engine)


def _served(tiny_path, tiny_tokenizer, tiny_model, extra_args=()):
    server = launch_serve(str(tiny_path), extra_args=list(extra_args))
    engine = SGLangEngine([server.url], tiny_tokenizer)
    return server, EngineCase(engine, tiny_tokenizer, copy.deepcopy(tiny_model), _push(engine))


def _real_sglang():
    from agentgym.models.zoo import load_model, load_tokenizer
    url, model_path = os.environ.get("AGENTGYM_SGLANG_URL"), os.environ.get("AGENTGYM_SGLANG_MODEL")
    if not model_path:
        pytest.skip("no SGLang server configured (set AGENTGYM_SGLANG_MODEL, and "
                    "AGENTGYM_SGLANG_URL for a running one)")
    server = None
    if not url:
        import importlib.util

        import torch
        if importlib.util.find_spec("sglang") is None or not torch.cuda.is_available():
            pytest.skip("launching SGLang needs sglang installed and a CUDA GPU")
        from agentgym.rollout.engines.launcher import launch_sglang
        server = launch_sglang(model_path, dtype="bfloat16", deterministic=True)
        url = server.url
        os.environ.setdefault("AGENTGYM_SGLANG_DETERMINISTIC", "1")
    tok = load_tokenizer(model_path)
    device = "cuda" if __import__("torch").cuda.is_available() else "cpu"
    model = load_model(model_path, dtype="bfloat16" if device == "cuda" else "float32",
                       device=device)
    engine = SGLangEngine([url], tok)
    case = EngineCase(engine, tok, model, _push(engine),
                      seeded=os.environ.get("AGENTGYM_SGLANG_DETERMINISTIC") == "1",
                      atol=float(os.environ.get("AGENTGYM_SGLANG_ATOL", "0.05")),
                      batch_invariant=False)
    return server, case


@pytest.fixture(scope="module", params=["hf", "hf_graphs", "served", "served_skip_tokenizer",
                                        "sglang"])
def case(request, tiny_path, tiny_tokenizer, tiny_model):
    server = None
    if request.param == "hf":
        engine = HFEngine(copy.deepcopy(tiny_model), tiny_tokenizer, batch_wait_s=0.02)
        c = EngineCase(engine, tiny_tokenizer, copy.deepcopy(tiny_model), _push(engine))
    elif request.param == "hf_graphs":  # the GPU's path through the CPU's graph stand-in
        engine = HFEngine(copy.deepcopy(tiny_model), tiny_tokenizer, batch_wait_s=0.02,
                          graph_standin=True, max_len=512)
        c = EngineCase(engine, tiny_tokenizer, copy.deepcopy(tiny_model), _push(engine))
    elif request.param == "served":
        server, c = _served(tiny_path, tiny_tokenizer, tiny_model)
    elif request.param == "served_skip_tokenizer":
        server, c = _served(tiny_path, tiny_tokenizer, tiny_model, ["--skip-tokenizer-init"])
    else:
        server, c = _real_sglang()
    yield c
    c.engine.close()
    if server is not None:
        server.stop()


class TestEngineConformance(EngineConformance):
    pass


def test_client_side_stops_are_counted(tiny_path, tiny_tokenizer, tiny_model):
    """Against --skip-tokenizer-init the server is never sent a stop string; the client
    cuts (and counts the tokens it threw away)."""
    server, c = _served(tiny_path, tiny_tokenizer, tiny_model, ["--skip-tokenizer-init"])
    try:
        from agentgym.core.types import SamplingParams
        from engine_conformance import generate
        prompt = tiny_tokenizer.encode("Once upon a time")
        free = generate(c.engine, [prompt], SamplingParams(max_new_tokens=16, seed=1))[0]
        stop = tiny_tokenizer.decode(free.ids[:1])
        cut = generate(c.engine, [prompt], SamplingParams(max_new_tokens=16, seed=1,
                                                          stop=(stop,)))[0]
        assert cut.ids == free.ids[:1] and cut.stop_reason == stop
        assert c.engine.stats["client_stops"] == 1
        assert c.engine.stats["wasted_tokens"] == len(free.ids) - 1
    finally:
        c.engine.close()
        server.stop()


def test_perturbed_weights_stay_tied(tiny_model):
    """``tiny`` ties ``lm_head.weight`` to the embeddings, as Qwen2.5-0.5B does: the
    perturbed weights must move them together (SGLang keeps the embedding's value and
    skips ``lm_head.weight``), and the client sends them once."""
    new = perturbed(tiny_model)
    assert new["lm_head.weight"] is new["model.embed_tokens.weight"]
    assert not new["model.embed_tokens.weight"].equal(
        tiny_model.state_dict()["model.embed_tokens.weight"])
    assert "lm_head.weight" not in unique_tensors(new)
    assert len(unique_tensors(new)) == len(new) - 1
