"""Generation speed: our HF engine against transformers' own ``generate``, in one process.

Random-initialised models of the shipped shapes (no weights travel), the same prompts of
40-72 random token ids, 256 sampled tokens each (temperature 1, no EOS), a warm-up run of
each contender first:

* ``ours``: :class:`agentgym.rollout.engines.hf.HFEngine` (continuous batching over the KV
  pool and prefix cache; on a GPU the decode step replays CUDA graphs), driven by
  ``engine.run`` as the trainer drives it (on the CPU its steps run on the main thread,
  as ``generate``'s do);
* ``generate``: transformers' ``generate`` with its dynamic cache, eager;
* ``generate static``: ``generate`` with ``cache_implementation="static"``, whose decode
  step transformers compiles (CUDA graphs; GPU only: on the CPU the compile alone takes
  longer than the whole run).

Single-turn: ``--batch`` prompts at once. Multi-turn: ``--episodes`` episodes of
``--turns`` turns, each turn samples 64 tokens and then appends ~100 observation tokens;
ours serves each episode's turns as they come (its next turn's prompt extends its
history: the prefix cache), ``generate`` runs every turn as one batch of the whole
histories, left-padded (a lockstep rollout over transformers).

Tokens/s count sampled tokens. ms per step is the wall time over the decode steps; for
ours it is split into the step's device part (forward and sampling, up to the copy of the
sampled ids) and the engine's host work (the rest of the step).

    python bench/engine_speed.py                               # CPU: docs/BENCHMARKS.md
    python bench/engine_speed.py --device cuda --batch 64 256 --episodes 64 \\
        --shapes smollm2-135m qwen2.5-1.5b --out docs/GPU.md    # a GPU: docs/GPU.md
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import machine, write_section  # noqa: E402

SAMPLED = 256  # tokens each single-turn prompt samples (--new)
TURN = 64  # tokens each turn of the multi-turn workload samples


def random_model(shape: str, dtype: torch.dtype, device: str, layers: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    from agentgym.models.shapes import shape_config
    config = {k: v for k, v in shape_config(shape).items()
              if k not in ("_name_or_path", "transformers_version", "torch_dtype")}
    config.update(eos_token_id=None, bos_token_id=None, pad_token_id=0)
    if layers:  # the shape's widths at fewer layers (the benchmark's test)
        config["num_hidden_layers"] = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config),
                                             attn_implementation="sdpa", dtype=dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(device).eval()


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(40, 72))] for _ in range(n)]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# -- transformers' generate -------------------------------------------------------------
def hf_generate(model, batch: list[list[int]], new: int, static: bool) -> torch.Tensor:
    """Left-padded ``generate`` of every prompt, ``new`` sampled tokens each (temperature
    1, no EOS): the sampled ids ``(len(batch), new)``."""
    width = max(len(p) for p in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kw = {"cache_implementation": "static"} if static else {}
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             max_new_tokens=new, min_new_tokens=new, do_sample=True,
                             temperature=1.0, top_p=1.0, top_k=0, **kw)
    return out[:, width:]


def hf_turns(model, episodes: list[list[int]], turns: int, static: bool, seed: int) -> int:
    """Every turn one ``generate`` over the whole histories (a lockstep rollout)."""
    rng, histories, sampled = random.Random(seed), [list(p) for p in episodes], 0
    for _ in range(turns):
        out = hf_generate(model, histories, TURN, static)
        for i, h in enumerate(histories):
            h.extend(out[i].tolist())
            h.extend(observation(rng, model.config.vocab_size))
        sampled += out.numel()
    return sampled


def observation(rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(rng.randint(90, 110))]


# -- ours -------------------------------------------------------------------------------
def our_engine(model, rows: int):
    from agentgym.models.zoo import load_tokenizer, resolve_model
    from agentgym.rollout.engines.hf import HFEngine
    engine = HFEngine(model, load_tokenizer(resolve_model("tiny")), max_batch_size=rows,
                      cache_tokens=1 << 20)
    engine.eos_ids.clear()  # random weights: every request samples its whole budget
    return engine


def ours_generate(engine, batch: list[list[int]], new: int) -> int:
    from agentgym.core.types import SamplingParams

    async def go():
        return await asyncio.gather(*(engine.generate(
            p, SamplingParams(max_new_tokens=new, temperature=1.0, seed=k))
            for k, p in enumerate(batch)))
    return sum(len(o.ids) for o in engine.run(go()))


def ours_turns(engine, episodes: list[list[int]], turns: int, seed: int) -> int:
    from agentgym.core.types import SamplingParams
    vocab = engine.model.config.vocab_size

    async def episode(k: int, history: list[int]) -> int:
        rng, sampled = random.Random(seed * 1000 + k), 0
        for t in range(turns):
            out = await engine.generate(history, SamplingParams(
                max_new_tokens=TURN, temperature=1.0, seed=k * 100 + t), session_id=str(k))
            history = history + out.ids + observation(rng, vocab)
            sampled += len(out.ids)
        return sampled

    async def go():
        return await asyncio.gather(*(episode(k, list(p)) for k, p in enumerate(episodes)))
    return sum(engine.run(go()))


# -- identity ---------------------------------------------------------------------------
def identity(device: str, n: int = 64, new: int = 32) -> dict:
    """smollm2-135m's real weights in fp32: ours (all prompts at once) against
    transformers' greedy ``generate`` of each prompt alone, and our sampled tokens'
    logprobs against a forward pass over the finished sequence."""
    from agentgym.core.types import SamplingParams
    from agentgym.models.zoo import load_model, load_tokenizer, resolve_model
    path = resolve_model("smollm2-135m")
    model, tok = load_model(path, device=device), load_tokenizer(path)
    from agentgym.rollout.engines.hf import HFEngine
    engine = HFEngine(model, tok, max_batch_size=n)
    rng = random.Random(3)
    words = "the of and to in is was for on with as by at from that which who city river".split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 20))) for _ in range(n)]
    batch = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
             for t in texts]
    batch = [b["input_ids"] if isinstance(b, dict) or hasattr(b, "keys") else b for b in batch]

    async def go(sp):
        return await asyncio.gather(*(engine.generate(p, sp(k)) for k, p in enumerate(batch)))
    try:
        greedy = engine.run(go(lambda k: SamplingParams(max_new_tokens=new, temperature=0)))
        sampled = engine.run(go(lambda k: SamplingParams(max_new_tokens=new, seed=k)))
    finally:
        engine.close()
    same, drift = 0, 0.0
    with torch.inference_mode():
        for p, g, s in zip(batch, greedy, sampled):
            ref = model.generate(torch.tensor([p], device=device), max_new_tokens=len(g.ids),
                                 do_sample=False)[0, len(p):].tolist()
            same += ref == g.ids
            ids = torch.tensor([p + s.ids], device=device)
            logp = torch.log_softmax(model(ids).logits[0, len(p) - 1:-1].float(), -1)
            want = logp.gather(1, torch.tensor(s.ids, device=device)[:, None])[:, 0]
            drift = max(drift, (want - torch.tensor(s.logprobs, device=device)).abs().max().item())
    return {"prompts": n, "same": same, "drift": drift}


# -- the run ----------------------------------------------------------------------------
def timed(device: str, fn) -> tuple[float, int]:
    sync(device)
    t0 = time.perf_counter()
    n = fn()
    sync(device)
    return time.perf_counter() - t0, n


def measure(shape: str, dtype_name: str, args) -> list[dict]:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    model = random_model(shape, dtype, args.device, args.layers)
    new = args.new
    vocab = model.config.vocab_size
    contenders = [("generate", False)] + ([("generate static", True)]
                                          if args.device == "cuda" else [])
    rows = []
    most = max(args.batch + [args.episodes])
    engine = our_engine(model, most)
    try:
        for b in args.batch:
            batch = prompts(b, vocab)
            row = {"shape": f"{shape}, {dtype_name}", "workload": f"single-turn, batch {b}",
                   "steps": new}
            ours_generate(engine, batch[:max(2, b // 8)], 16)  # warm-up
            before = dict(engine.stats)
            row["ours"] = timed(args.device, lambda: ours_generate(engine, batch, new))
            steps = engine.stats["decode_steps"] - before["decode_steps"]
            row["split"] = ((engine.stats["forward_s"] - before["forward_s"]) / steps,
                            (engine.stats["host_s"] - before["host_s"]) / steps)
            for name, static in contenders:
                hf_generate(model, batch, 16, static)  # warm-up (and the compile)
                row[name] = timed(args.device,
                                  lambda: hf_generate(model, batch, new, static).numel())
            rows.append(row)
            print(_line(row), flush=True)
        if args.episodes:
            episodes = prompts(args.episodes, vocab, seed=1)
            row = {"shape": f"{shape}, {dtype_name}", "steps": TURN * args.turns,
                   "workload": f"multi-turn, {args.episodes} episodes x {args.turns} turns"}
            ours_turns(engine, episodes[:2], 2, seed=9)  # warm-up
            before = dict(engine.stats)
            row["ours"] = timed(args.device, lambda: ours_turns(engine, episodes, args.turns, 0))
            steps = engine.stats["decode_steps"] - before["decode_steps"]
            row["split"] = ((engine.stats["forward_s"] - before["forward_s"]) / steps,
                            (engine.stats["host_s"] - before["host_s"]) / steps)
            for name, static in contenders:
                hf_turns(model, episodes[:2], 1, static, seed=9)
                row[name] = timed(args.device,
                                  lambda: hf_turns(model, episodes, args.turns, static, 0))
            rows.append(row)
            print(_line(row), flush=True)
    finally:
        engine.close()
    return rows


def _rate(t: tuple[float, int]) -> float:
    return t[1] / t[0]


def _line(row: dict) -> str:
    parts = [f"{row['shape']} {row['workload']}:"]
    for name in ("ours", "generate", "generate static"):
        if name in row:
            parts.append(f"{name} {_rate(row[name]):,.0f} tok/s")
    return " ".join(parts)


def table(rows: list[dict], device: str) -> str:
    static = device == "cuda"
    head = ("| shape | workload | ours tok/s (ms/step: device + host) | generate tok/s (ms/step) "
            "| ours / generate |" + (" generate static tok/s (ms/step) | ours / static |"
                                     if static else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ours, gen = r["ours"], r["generate"]
        dev_ms, host_ms = (1000 * x for x in r["split"])
        line = (f"| {r['shape']} | {r['workload']} | {_rate(ours):,.0f} "
                f"({1000 * ours[0] / r['steps']:.1f}: {dev_ms:.1f} + {host_ms:.1f}) | "
                f"{_rate(gen):,.0f} ({1000 * gen[0] / r['steps']:.1f}) | "
                f"**{_rate(ours) / _rate(gen):.2f}x** |")
        if static:
            st = r["generate static"]
            line += (f" {_rate(st):,.0f} ({1000 * st[0] / r['steps']:.1f}) | "
                     f"**{_rate(ours) / _rate(st):.2f}x** |")
        lines.append(line)
    return "\n".join(lines)


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", nargs="+", default=["smollm2-135m"])
    ap.add_argument("--batch", nargs="+", type=int, default=None)
    ap.add_argument("--episodes", type=int, default=None)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--new", type=int, default=SAMPLED, help="tokens each single-turn "
                    "prompt samples")
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the shape's "
                    "(0: the shape's own; a quick check of the benchmark itself)")
    ap.add_argument("--dtype", nargs="+", default=None, choices=["float32", "bfloat16"])
    ap.add_argument("--identity", action="store_true", help="also compare greedy sequences "
                    "and logprobs with transformers' (smollm2-135m's real weights, fp32)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: all)")
    ap.add_argument("--out", default=None, help="page to write (default: BENCHMARKS on the "
                    "CPU, GPU.md on a GPU); 'none' writes nothing")
    args = ap.parse_args(argv)
    gpu = args.device == "cuda"
    args.batch = args.batch or ([64, 256] if gpu else [16, 64])
    args.episodes = args.episodes if args.episodes is not None else (64 if gpu else 8)
    args.dtype = args.dtype or (["bfloat16"] if gpu else ["float32", "bfloat16"])
    return args


def run(args: argparse.Namespace, command: str) -> str:
    """Measure every shape; the section's text (machine, command, table)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    gpu = args.device == "cuda"
    rows = [r for shape in args.shapes for dtype in args.dtype for r in measure(shape, dtype, args)]
    where = (torch.cuda.get_device_name() if gpu else machine())
    ident = ""
    if args.identity:
        i = identity(args.device)
        ident = (f"\n\nIdentity (smollm2-135m's real weights, fp32): our greedy sequences equal "
                 f"transformers' greedy `generate` of each prompt alone on **{i['same']} of "
                 f"{i['prompts']}** prompts (32 tokens, all {i['prompts']} batched on our side); "
                 f"our sampled tokens' logprobs are within **{i['drift']:.1e}** of a forward "
                 "pass over the finished sequence.")
        print(ident.strip(), flush=True)
    return (f"Machine: {where}; torch {torch.__version__}, transformers "
            f"{__import__('transformers').__version__}, one process. Command: "
            f"`{command}`.\n\n" + table(rows, args.device)
            + f"\n\nSingle-turn: prompts of 40-72 random ids, {args.new} sampled tokens each "
            "(temperature 1, no EOS). Multi-turn: each turn samples 64 tokens, then ~100 "
            "observation tokens are appended. Random-initialised weights of each shape." + ident)


def main(argv=None) -> None:
    args = parse(argv)
    gpu = args.device == "cuda"
    body = run(args, "python bench/engine_speed.py " + " ".join(sys.argv[1:]))
    out = args.out or (str(ROOT / "docs" / "GPU.md") if gpu else None)
    title = f"Engine speed against transformers' generate ({'GPU' if gpu else 'CPU'})"
    if out and out != "none":
        write_section(title, body, Path(out))
    elif out is None:
        write_section(title, body)
    print(body)


if __name__ == "__main__":
    main()
