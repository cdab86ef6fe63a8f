"""The engine conformance suite: what every rollout engine must do, whatever serves it.

Subclass :class:`EngineConformance` and give it a ``case`` fixture returning an
:class:`EngineCase` (see ``tests/test_engine_conformance.py``: the in-process HF engine,
``agentgym serve`` through the SGLang client, and a real SGLang server when one is
configured). The checks:

- greedy outputs identical for identical inputs (one after another, and side by side);
- logprobs equal to a forward pass of the same weights (``log_softmax(logits / T)``);
- stop strings cut the output at the token that completes them; ``max_new_tokens`` is
  honoured (``finish_reason == "length"``);
- many concurrent requests each get their own answer;
- a weight update is visible in the next generation (and undone by pushing back).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

from agentgym.core.types import SamplingParams

PROMPTS = ["<search> capital of france", "hello there, how are you today?",
           "Question: who wrote hamlet?\n", "a", "The answer is", "def f(x):\n    return",
           "1 + 1 =", "Once upon a time"]


@dataclass
class EngineCase:
    """An engine under test and what the suite needs to judge it.

    Attributes:
        engine: the :class:`~agentgym.rollout.engines.base.Engine`.
        tokenizer: the policy's tokenizer.
        model: the same weights in this process, for reference forward passes.
        push: ``push(state_dict, version)`` loads weights into the engine the way a
            trainer does (pause, update, resume).
        seeded: the engine honours ``SamplingParams.seed`` (SGLang: only with
            ``--enable-deterministic-inference``); else stop checks use greedy output.
        atol: logprob tolerance against the reference forward pass.
        batch_invariant: outputs do not depend on batch companions (fp32 HF engine).
    """

    engine: Any
    tokenizer: Any
    model: Any
    push: Callable[[dict, int], None]
    seeded: bool = True
    atol: float = 1e-4
    batch_invariant: bool = True


def run(coro):
    return asyncio.run(coro)


def generate(engine, prompts: list[list[int]], sampling: SamplingParams) -> list:
    async def go():
        return await asyncio.gather(*(engine.generate(p, sampling, session_id=f"s{i}")
                                      for i, p in enumerate(prompts)))
    return run(go())


def forward_logprobs(model, prompt: list[int], ids: list[int], temperature: float) -> list[float]:
    """A trainer's logprobs of ``ids`` after ``prompt``: one forward pass, no padding."""
    seq = prompt + ids
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq], device=device)).logits[0].float()
    logp = torch.log_softmax(logits[:-1] / (temperature or 1.0), dim=-1)
    targets = torch.tensor(seq[1:], device=device)
    return logp.gather(1, targets[:, None])[:, 0][len(prompt) - 1:].cpu().tolist()


def perturbed(model, seed: int = 0, scale: float = 0.5) -> dict:
    """The model's state dict with every floating tensor moved by ``scale`` x its std.

    Tensors that share storage (tied embeddings: ``lm_head.weight`` is
    ``model.embed_tokens.weight``) are moved once, and every name of them maps to the
    same new tensor, so the result is still tied: engines send it once (SGLang's loaders
    skip ``lm_head.weight`` under ``tie_word_embeddings``) and ``load_state_dict`` gives
    the reference model the same values.
    """
    g = torch.Generator().manual_seed(seed)
    out: dict = {}
    moved: dict = {}  # storage of an original tensor -> its new tensor
    for k, v in model.state_dict().items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key in moved:
            out[k] = moved[key]
            continue
        if v.is_floating_point() and v.numel() > 1:
            noise = torch.randn(v.shape, generator=g).to(v.device, v.dtype)
            out[k] = v + scale * float(v.float().std()) * noise
        else:
            out[k] = v.clone()
        moved[key] = out[k]
    return out


class EngineConformance:
    """Tests every engine must pass; subclasses provide the ``case`` fixture."""

    def encode(self, case: EngineCase, text: str) -> list[int]:
        return case.tokenizer.encode(text)

    def test_greedy_is_repeatable(self, case: EngineCase):
        prompt = self.encode(case, PROMPTS[1])
        greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
        first = generate(case.engine, [prompt], greedy)[0]
        again = generate(case.engine, [prompt], greedy)[0]
        side_by_side = generate(case.engine, [prompt] * 4, greedy)
        assert again.ids == first.ids
        assert again.logprobs == pytest.approx(first.logprobs, abs=case.atol)
        for out in side_by_side:
            assert out.ids == side_by_side[0].ids
            assert out.logprobs == pytest.approx(side_by_side[0].logprobs, abs=case.atol)
        if case.batch_invariant:
            assert side_by_side[0].ids == first.ids

    @pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
    def test_logprobs_match_a_forward_pass(self, case: EngineCase, temperature: float):
        prompts = [self.encode(case, p) for p in PROMPTS[:4]]
        sampling = SamplingParams(max_new_tokens=10, temperature=temperature, seed=11)
        outs = generate(case.engine, prompts, sampling)
        for p, out in zip(prompts, outs):
            assert len(out.ids) == len(out.logprobs) >= 1
            ref = forward_logprobs(case.model, p, out.ids, temperature)
            assert out.logprobs == pytest.approx(ref, abs=case.atol)

    def _free_run(self, case: EngineCase, prompt: list[int], n: int):
        """A continuation of ``n`` tokens with no stop, reproducible on this engine."""
        sampling = SamplingParams(max_new_tokens=n, temperature=1.0 if case.seeded else 0.0,
                                  seed=5, stop=("\x00never",))
        return sampling, generate(case.engine, [prompt], sampling)[0]

    def test_max_new_tokens_is_honoured(self, case: EngineCase):
        prompt = self.encode(case, PROMPTS[0])
        sampling, free = self._free_run(case, prompt, 20)
        eos = {case.tokenizer.eos_token_id}
        if free.finish_reason == "length":
            assert len(free.ids) == 20
        else:
            assert free.ids[-1] in eos or free.stop_reason
        short = generate(case.engine, [prompt], SamplingParams(
            max_new_tokens=5, temperature=sampling.temperature, seed=5))[0]
        assert len(short.ids) <= 5
        if not any(t in eos for t in free.ids[:5]):
            assert short.finish_reason == "length" and short.ids == free.ids[:5]

    def test_stop_strings_cut_at_the_completing_token(self, case: EngineCase):
        tok = case.tokenizer
        prompt = self.encode(case, PROMPTS[7])
        sampling, free = self._free_run(case, prompt, 24)
        # a stop string that first completes at token k of that continuation
        ks = [i for i in range(2, len(free.ids)) if tok.decode(free.ids[i:i + 1]).strip()
              and tok.decode(free.ids[i:i + 1]) not in tok.decode(free.ids[:i])
              and free.ids[i] != tok.eos_token_id]
        if not ks:
            pytest.skip("the continuation repeats itself; no fresh token to stop on")
        k = ks[0]
        stop = tok.decode(free.ids[k:k + 1])
        cut = generate(case.engine, [prompt], SamplingParams(
            max_new_tokens=24, temperature=sampling.temperature, seed=5,
            stop=(stop, "\x00never")))[0]
        assert cut.finish_reason == "stop" and cut.stop_reason == stop
        assert cut.ids == free.ids[:k + 1]
        assert cut.logprobs == pytest.approx(free.logprobs[:k + 1], abs=case.atol)

    def test_many_concurrent_requests_get_their_own_answers(self, case: EngineCase):
        prompts = [self.encode(case, f"{PROMPTS[i % len(PROMPTS)]} #{i}") for i in range(48)]
        greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
        together = generate(case.engine, prompts, greedy)
        assert len(together) == len(prompts)
        for p, out in zip(prompts, together):  # each answer belongs to its own prompt
            assert 1 <= len(out.ids) <= 6
            ref = forward_logprobs(case.model, p, out.ids, 0.0)
            assert out.logprobs == pytest.approx(ref, abs=case.atol)
        if case.batch_invariant:
            alone = [generate(case.engine, [p], greedy)[0] for p in prompts[:6]]
            assert [o.ids for o in alone] == [o.ids for o in together[:6]]

    def test_weight_update_is_visible_in_the_next_generation(self, case: EngineCase):
        prompt = self.encode(case, PROMPTS[2])
        greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
        before = generate(case.engine, [prompt], greedy)[0]
        original = {k: v.detach().clone() for k, v in case.model.state_dict().items()}
        version = case.engine.policy_version
        new = perturbed(case.model)
        try:
            case.push(new, version + 1)
            assert case.engine.policy_version == version + 1
            after = generate(case.engine, [prompt], greedy)[0]
            case.model.load_state_dict(new)
            ref_new = forward_logprobs(case.model, prompt, after.ids, 0.0)
        finally:
            case.model.load_state_dict(original)
        ref_old = forward_logprobs(case.model, prompt, after.ids, 0.0)
        assert after.logprobs == pytest.approx(ref_new, abs=case.atol)  # the new weights
        assert max(abs(a - b) for a, b in zip(after.logprobs, ref_old)) > 10 * case.atol
        case.push(original, version + 2)  # and back
        restored = generate(case.engine, [prompt], greedy)[0]
        assert restored.ids == before.ids
        assert restored.logprobs == pytest.approx(before.logprobs, abs=case.atol)
