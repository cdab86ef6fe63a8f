"""Generation speed: our HF engine against transformers' own ``generate``, in one process.

Random-initialised models of the shipped shapes (no weights travel), the same prompts of
40-72 random token ids, 256 sampled tokens each (temperature 1, no EOS):

* ``ours``: :class:`agentgym.rollout.engines.hf.HFEngine` (continuous batching over the KV
  pool and prefix cache; on a GPU the decode step replays CUDA graphs), driven by
  ``engine.run`` as the trainer drives it (on the CPU its steps run on the main thread,
  as ``generate``'s do);
* ``generate``: transformers' ``generate`` with its dynamic cache, eager;
* ``generate static``: ``generate`` with ``cache_implementation="static"``, whose decode
  step transformers compiles (``torch.compile``, inductor, mode ``reduce-overhead``: CUDA
  graphs; GPU only: on the CPU the compile alone takes longer than the whole run).

Single-turn: ``--batch`` prompts at once. Multi-turn: ``--episodes`` episodes of
``--turns`` turns, each turn samples 64 tokens and then appends 90-110 observation tokens;
ours serves each episode's turns as they come (its next turn's prompt extends its
history: the prefix cache), ``generate`` runs every turn as one batch of the whole
histories, left-padded (a lockstep rollout over transformers).

**Warm-ups.** Before each timed run every contender runs the same workload once, untimed:
the same batch size, the same prompt lengths (so the same left-padded widths), the same
``max_new_tokens`` and, multi-turn, the same turns with the same observation lengths; only
the token ids differ (shifted by half the vocabulary), so the warm-up leaves nothing in
our prefix cache that the timed run could reuse. The static ``generate`` compiles during
its warm-up; that warm-up's wall time (the compile, the CUDA-graph recording, one untimed
run) and the number of graphs dynamo compiled in it are the table's last column, apart
from tokens/s; a graph compiled inside a timed run is flagged there too (there should be
none).

**One compile per workload for the static baseline** (transformers 5.17, the GPU image's,
and 5.23 read alike; the CPU test ``tests/test_engine_speed.py`` counts the graphs). Only
the decode step is compiled (``_sample`` calls ``get_compiled_call`` for the decode
forwards; ``_prefill`` calls the model eagerly, chunked prefill aside), and dynamo guards
the decode step on the shapes of its tensors: ``input_ids`` ``(batch, 1)``, the 4D mask
and the cache's keys and values, ``(batch, heads, max_cache_len, head_dim)``
(``cache_utils.StaticLayer.lazy_initialization``; the mask's width is the same
``max_cache_len``, ``StaticLayer.get_mask_sizes``). Each call sizes a new cache at
``max(max_length - 1, generation_config.max_cache_len, model._previous_max_cache_length)``
(``generation/utils.py``, ``_prepare_cache_for_generation`` and ``_prepare_static_cache``).
So in a lockstep rollout, whose histories grow every turn, every turn got a longer cache
and its decode step a new shape (on the CPU: "tensor 'kwargs['past_key_values'].layers[0]
.keys' size mismatch at index 2. expected 187, actual 298"), and every batch size too
("tensor 'kwargs['input_ids']' size mismatch at index 0"): with dynamo's defaults the
second distinct shape recompiles the step with dynamic sizes, after which inductor's
CUDA graphs still record once per distinct shape; and the old warm-up (one turn of two
episodes, 16 tokens single-turn) compiled none of the timed shapes, so the compiles fell
inside the timing. Here every static call passes ``max_cache_len``: the single-turn
batch's width + ``new``, and for a multi-turn run the last turn's worst case (longest
prompt + (turns - 1) x (64 + 110) + 64), the same for all turns, so every turn replays one
compiled decode step; and ``compile_config=CompileConfig(dynamic=False)``, so each (batch,
cache length) the bars time gets its own static-shape compile, in its warm-up, rather than
a dynamic-shape one. What stays per call: each ``generate`` builds a new cache, whose
tensors are ``mark_static_address``'ed without a guard (dynamo does not recompile; torch's
``cudagraph_trees`` re-records when a static input's address changes), so the CUDA graph
is re-recorded once per call: that is inside the timing, as it is for any caller of
``generate``. The fixed size costs the static baseline attention over every slot (its
mask spans ``max_cache_len``): a multi-turn run's early turns attend over the last turn's
length.

**The GPU bars** (``--bars``, what ``make gpu-check`` runs): ours against the static
``generate`` single-turn at batch 64 and 256 on the smollm2-135m shape, >= 1.0x on the
qwen2.5-1.5b shape, and >= 3x multi-turn. So ``--bars`` measures smollm2-135m single-turn
at batch 64 and 256 and multi-turn (64 episodes x 8 turns), and qwen2.5-1.5b single-turn
at batch 64 only (the bar names the shape, not a batch: 64 is the rollout's batch, and a
1.5B multi-turn row or batch 256 would add a compile and minutes of a lent machine for no
bar), bf16. ``make gpu-check`` also drops the eager ``generate`` (``--baselines static``):
no bar names it, and warmed on the timed shapes it would cost about as long again.

Tokens/s count sampled tokens. ms per step is the wall time over the decode steps; for
ours it is split into the step's device part (forward and sampling, up to the copy of the
sampled ids) and the engine's host work (the rest of the step).

    python bench/engine_speed.py                               # CPU: docs/BENCHMARKS.md
    python bench/engine_speed.py --device cuda --batch 64 256 --episodes 64 \\
        --shapes smollm2-135m qwen2.5-1.5b --out docs/GPU.md    # a GPU: docs/GPU.md
    python bench/engine_speed.py --device cuda --bars --baselines static --out none
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
OBSERVATION = (90, 110)  # tokens appended after each turn (the least, the most)
#: what ``--bars`` measures on the GPU: (shape, single-turn batches, multi-turn episodes)
BARS = (("smollm2-135m", (64, 256), 64), ("qwen2.5-1.5b", (64,), 0))
BASELINES = {"eager": "generate", "static": "generate static"}  # --baselines: row keys


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


def shifted(ids: list[int], vocab: int, shift: int) -> list[int]:
    """``ids`` moved by ``shift`` within [100, vocab): a warm-up's twin of a timed prompt,
    the same length, sharing no prefix with it (so nothing of it hits our prefix cache)."""
    return [100 + (i - 100 + shift) % (vocab - 100) for i in ids] if shift else ids


def twins(batch: list[list[int]], vocab: int) -> list[list[int]]:
    return [shifted(p, vocab, vocab // 2) for p in batch]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# -- transformers' generate -------------------------------------------------------------
def compile_config():
    """How the static ``generate`` compiles its decode step: transformers' defaults
    (inductor, ``reduce-overhead``) but static shapes, one compile per (batch, cache
    length) rather than a dynamic-shape recompile at the second (the module's docstring)."""
    from transformers import CompileConfig
    return CompileConfig(dynamic=False)


def hf_generate(model, batch: list[list[int]], new: int, static: bool,
                cache_len: int = 0) -> torch.Tensor:
    """Left-padded ``generate`` of every prompt, ``new`` sampled tokens each (temperature
    1, no EOS): the sampled ids ``(len(batch), new)``. ``static``: a static cache of
    ``cache_len`` slots (0: the batch's width + ``new``), the decode step compiled."""
    width = max(len(p) for p in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    # A fixed max_cache_len fixes the compiled decode step's shapes (the cache's keys and
    # values, the 4D mask) across calls: transformers sizes each call's new StaticCache at
    # max(max_length - 1, max_cache_len, model._previous_max_cache_length)
    # (generation/utils.py, _prepare_cache_for_generation, _prepare_static_cache).
    kw = ({"cache_implementation": "static", "max_cache_len": cache_len or width + new,
           "compile_config": compile_config()} if static else {})
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             max_new_tokens=new, min_new_tokens=new, do_sample=True,
                             temperature=1.0, top_p=1.0, top_k=0, **kw)
    return out[:, width:]


def turns_cache_len(episodes: list[list[int]], turns: int) -> int:
    """The static cache a lockstep rollout's last turn can need: its longest history
    (longest prompt, then each earlier turn's samples and longest observation) plus its
    own samples. Every turn gets this size, so one compiled decode step serves them all."""
    return max(map(len, episodes)) + (turns - 1) * (TURN + OBSERVATION[1]) + TURN


def hf_turns(model, episodes: list[list[int]], turns: int, static: bool, seed: int,
             shift: int = 0) -> int:
    """Every turn one ``generate`` over the whole histories (a lockstep rollout). ``shift``
    moves the observations' ids (a warm-up: the same lengths, other ids)."""
    rng, histories, sampled = random.Random(seed), [list(p) for p in episodes], 0
    cache_len = turns_cache_len(episodes, turns) if static else 0
    vocab = model.config.vocab_size
    for _ in range(turns):
        out = hf_generate(model, histories, TURN, static, cache_len)
        for i, h in enumerate(histories):
            h.extend(out[i].tolist())
            h.extend(shifted(observation(rng, vocab), vocab, shift))
        sampled += out.numel()
    return sampled


def observation(rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(rng.randint(*OBSERVATION))]


# -- ours -------------------------------------------------------------------------------
def our_engine(model, rows: int):
    from agentgym.models.zoo import load_tokenizer, resolve_model
    from agentgym.rollout.engines.hf import HFEngine
    engine = HFEngine(model, load_tokenizer(resolve_model("tiny")), max_batch_size=rows,
                      cache_tokens=1 << 20)
    engine.eos_ids.clear()  # random weights: every request samples its whole budget
    return engine


#: how our engine is driven (--paths): the trainer's way, agentgym serve's, async training's
PATHS = {"run": "ours", "served": "ours served", "thread": "ours, engine thread"}


def drive(engine, coro, path: str = "run"):
    """``coro``'s result, our engine driven as ``path`` says: ``run``, ``engine.run`` (the
    steps on this thread, the rollout's event loop on a helper: the trainer's rollouts);
    ``served``, the requests from another thread's event loop while this thread steps
    (``engine.drive``: ``agentgym serve``); ``thread``, this thread's event loop while
    the engine's own thread steps (asynchronous training, whose main thread updates)."""
    if path == "run":
        return engine.run(coro)
    if path == "thread":
        return asyncio.run(coro)
    import threading
    loop = asyncio.new_event_loop()
    client = threading.Thread(target=loop.run_forever, name="bench-client", daemon=True)
    client.start()
    try:
        done = asyncio.run_coroutine_threadsafe(coro, loop)
        engine.drive(done)
        return done.result()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        client.join()
        loop.close()


def ours_generate(engine, batch: list[list[int]], new: int, path: str = "run") -> int:
    from agentgym.core.types import SamplingParams

    async def go():
        return await asyncio.gather(*(engine.generate(
            p, SamplingParams(max_new_tokens=new, temperature=1.0, seed=k))
            for k, p in enumerate(batch)))
    return sum(len(o.ids) for o in drive(engine, go(), path))


def ours_turns(engine, episodes: list[list[int]], turns: int, seed: int,
               shift: int = 0, path: str = "run") -> int:
    from agentgym.core.types import SamplingParams
    vocab = engine.model.config.vocab_size

    async def episode(k: int, history: list[int]) -> int:
        rng, sampled = random.Random(seed * 1000 + k), 0
        for t in range(turns):
            out = await engine.generate(history, SamplingParams(
                max_new_tokens=TURN, temperature=1.0, seed=k * 100 + t), session_id=str(k))
            history = history + out.ids + shifted(observation(rng, vocab), vocab, shift)
            sampled += len(out.ids)
        return sampled

    async def go():
        return await asyncio.gather(*(episode(k, list(p)) for k, p in enumerate(episodes)))
    return sum(drive(engine, go(), path))


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


def _graphs() -> int:
    """Graphs dynamo has compiled in this process so far (its own counter)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def _ours(row: dict, device: str, engine, warm, fn, name: str = "ours") -> None:
    """Ours on one workload: ``warm`` (the twin workload) untimed, then ``fn`` timed, with
    the decode step's device / host split from the engine's counters."""
    warm()
    if name != "ours":  # another path: tokens/s only
        row[name] = timed(device, fn)
        return
    before = dict(engine.stats)
    row["ours"] = timed(device, fn)
    steps = engine.stats["decode_steps"] - before["decode_steps"]
    row["split"] = ((engine.stats["forward_s"] - before["forward_s"]) / steps,
                    (engine.stats["host_s"] - before["host_s"]) / steps)


def _theirs(row: dict, device: str, name: str, warm, fn) -> None:
    """A ``generate`` baseline on one workload: ``warm`` untimed (the static one compiles
    there; its wall time and graphs go to ``row["warm-up"]``), then ``fn`` timed, counting
    any graph compiled inside the timing."""
    graphs = _graphs()
    sync(device)
    t0 = time.perf_counter()
    warm()
    sync(device)
    row["warm-up"][name] = time.perf_counter() - t0, _graphs() - graphs
    graphs = _graphs()
    row[name] = timed(device, fn)
    row["compiled while timed"][name] = _graphs() - graphs


def measure(shape: str, dtype_name: str, args, batches=None, episodes=None,
            on_row=None) -> list[dict]:
    """One shape's rows: single-turn at each of ``batches`` (default ``--batch``), then
    multi-turn over ``episodes`` episodes (default ``--episodes``; 0: none). Every
    contender runs each workload's twin (same shapes, other ids) untimed first."""
    batches = args.batch if batches is None else batches
    episodes = args.episodes if episodes is None else episodes
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    model = random_model(shape, dtype, args.device, args.layers)
    new, vocab = args.new, model.config.vocab_size
    baselines = [(BASELINES[b], b == "static") for b in args.baselines]
    rows = []
    engine = our_engine(model, max([*batches, episodes]))
    captured = _captured(engine)
    try:
        for b in batches:
            batch = prompts(b, vocab)
            warm = twins(batch, vocab)
            row = {"shape": f"{shape}, {dtype_name}", "workload": f"single-turn, batch {b}",
                   "steps": new, "warm-up": {}, "compiled while timed": {},
                   "captured": captured}
            _ours(row, args.device, engine, lambda: ours_generate(engine, warm, new),
                  lambda: ours_generate(engine, batch, new))
            for path in args.paths[1:]:
                _ours(row, args.device, engine,
                      lambda: ours_generate(engine, warm, new, path),
                      lambda: ours_generate(engine, batch, new, path), PATHS[path])
            for name, static in baselines:
                _theirs(row, args.device, name, lambda: hf_generate(model, warm, new, static),
                        lambda: hf_generate(model, batch, new, static).numel())
            rows.append(row)
            print(_line(row), flush=True)
            if on_row:
                on_row(row)
        if episodes:
            eps = prompts(episodes, vocab, seed=1)
            warm, half = twins(eps, vocab), vocab // 2
            row = {"shape": f"{shape}, {dtype_name}", "steps": TURN * args.turns,
                   "workload": f"multi-turn, {episodes} episodes x {args.turns} turns",
                   "warm-up": {}, "compiled while timed": {}, "captured": captured}
            _ours(row, args.device, engine, lambda: ours_turns(engine, warm, args.turns, 0, half),
                  lambda: ours_turns(engine, eps, args.turns, 0))
            for path in args.paths[1:]:
                _ours(row, args.device, engine,
                      lambda: ours_turns(engine, warm, args.turns, 0, half, path),
                      lambda: ours_turns(engine, eps, args.turns, 0, 0, path), PATHS[path])
            for name, static in baselines:
                _theirs(row, args.device, name,
                        lambda: hf_turns(model, warm, args.turns, static, 0, half),
                        lambda: hf_turns(model, eps, args.turns, static, 0))
            rows.append(row)
            print(_line(row), flush=True)
            if on_row:
                on_row(row)
    finally:
        engine.close()
    return rows


def _rate(t: tuple[float, int]) -> float:
    return t[1] / t[0]


def _line(row: dict) -> str:
    parts = [f"{row['shape']} {row['workload']}:"]
    for name in (*PATHS.values(), "generate", "generate static"):
        if name in row:
            parts.append(f"{name} {_rate(row[name]):,.0f} tok/s")
    if "generate static" in row["warm-up"]:
        secs, graphs = row["warm-up"]["generate static"]
        parts.append(f"(static warm-up {secs:.1f} s, {graphs} graphs compiled; "
                     f"{row['compiled while timed']['generate static']} while timed)")
    return " ".join(parts)


def _warm_cell(row: dict) -> str:
    secs, graphs = row["warm-up"]["generate static"]
    late = row["compiled while timed"]["generate static"]
    return (f"{secs:.1f} s, {graphs} graph{'s' * (graphs != 1)} compiled"
            + (f"; **{late} more compiled inside the timing**" if late else ""))


def table(rows: list[dict], device: str = "") -> str:
    """The rows as markdown: ours, then each baseline the rows carry (tokens/s, ms per
    decode step, ours / it); with the static ``generate``, its warm-up apart."""
    names = [n for n in BASELINES.values() if rows and n in rows[0]]
    paths = [n for n in list(PATHS.values())[1:] if rows and n in rows[0]]
    short = {"generate": "generate", "generate static": "static"}
    head = ("| shape | workload | ours tok/s (ms/step: device + host) |"
            + "".join(f" {n} tok/s (ms/step) | ours / {short[n]} |" for n in names)
            + (" static warm-up, untimed (compile included) |"
               if "generate static" in names else "")
            + "".join(f" {n} tok/s | {n} / ours |" for n in paths))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ours = r["ours"]
        dev_ms, host_ms = (1000 * x for x in r["split"])
        line = (f"| {r['shape']} | {r['workload']} | {_rate(ours):,.0f} "
                f"({1000 * ours[0] / r['steps']:.1f}: {dev_ms:.1f} + {host_ms:.1f}) |")
        for n in names:
            line += (f" {_rate(r[n]):,.0f} ({1000 * r[n][0] / r['steps']:.1f}) | "
                     f"**{_rate(ours) / _rate(r[n]):.2f}x** |")
        if "generate static" in names:
            line += f" {_warm_cell(r)} |"
        for n in paths:
            line += f" {_rate(r[n]):,.0f} | {_rate(r[n]) / _rate(ours):.2f} |"
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
    ap.add_argument("--bars", action="store_true", help="only the shapes and workloads "
                    "the GPU bars name (BARS; overrides --shapes, --batch, --episodes)")
    ap.add_argument("--baselines", nargs="+", default=None, choices=list(BASELINES),
                    help="transformers' generate as eager (dynamic cache) and/or static "
                    "(static cache, compiled: CUDA only); default both on CUDA, eager else")
    ap.add_argument("--paths", nargs="+", default=["run"], choices=list(PATHS),
                    help="how our engine is driven: run (engine.run, the trainer's), served "
                    "(another thread's event loop sends, engine.drive steps here: agentgym "
                    "serve), thread (the engine's own thread steps: async training); the "
                    "first is the table's ours, the others columns beside it")
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
    args.baselines = args.baselines or (["eager", "static"] if gpu else ["eager"])
    if "static" in args.baselines and not gpu:
        ap.error("--baselines static needs --device cuda: transformers compiles the static "
                 "cache's decode step on CUDA only")
    if args.paths[0] != "run":
        ap.error("--paths: the first is 'run' (the table's ours); others go beside it")
    if "thread" in args.paths and args.paths[-1] != "thread":
        ap.error("--paths: 'thread' goes last: its second OpenMP team would slow every "
                 "measurement after it on the CPU")
    args.plan = ([(s, list(b), e) for s, b, e in BARS] if args.bars
                 else [(s, args.batch, args.episodes) for s in args.shapes])
    return args


def _captured(engine) -> tuple[int, float] | None:
    """The decode steps our engine captured as graphs when it started, and the seconds
    that took (None where it captures none: the CPU)."""
    runner = engine.scheduler.runner if engine.scheduler is not None else None
    if runner is None or not runner.graphs:
        return None
    return runner.stats["graphs"], runner.stats["capture_s"]


def _section(args, command: str, rows: list[dict], ident: str = "") -> str:
    where = torch.cuda.get_device_name() if args.device == "cuda" else machine()
    warm = ("the static `generate`'s warm-up (its compile and CUDA-graph recording "
            "included) is the last column, outside tokens/s" if "static" in args.baselines
            else "warm-ups are outside tokens/s")
    return (f"Machine: {where}; torch {torch.__version__}, transformers "
            f"{__import__('transformers').__version__}, one process. Command: "
            f"`{command}`.\n\n" + table(rows, args.device)
            + f"\n\nSingle-turn: prompts of 40-72 random ids, {args.new} sampled tokens each "
            "(temperature 1, no EOS). Multi-turn: each turn samples 64 tokens, then 90-110 "
            "observation tokens are appended. Random-initialised weights of each shape. "
            "Each contender first ran each workload once untimed (the same batch, prompt "
            f"lengths, tokens and turns; other ids); {warm}." + _capture_note(rows) + ident)


def _capture_note(rows: list[dict]) -> str:
    """What capturing every decode step at engine start cost ours, per shape."""
    seen = {r["shape"]: r["captured"] for r in rows if r.get("captured")}
    return "".join(f" Ours captured {n} decode steps as graphs at engine start ({shape}): "
                   f"{secs:.1f} s, before and outside every timing." for shape, (n, secs)
                   in seen.items())


def run(args: argparse.Namespace, command: str, progress=None) -> str:
    """Measure every shape of the plan; the section's text (machine, command, table).
    ``progress``, if given, gets the section as far as it has come after every row."""
    if args.threads:
        torch.set_num_threads(args.threads)
    rows: list[dict] = []

    def on_row(row):
        rows.append(row)
        if progress:
            progress(_section(args, command, rows))
    for shape, batches, episodes in args.plan:
        for dtype in args.dtype:
            measure(shape, dtype, args, batches, episodes, on_row)
    ident = ""
    if args.identity:
        i = identity(args.device)
        ident = (f"\n\nIdentity (smollm2-135m's real weights, fp32): our greedy sequences equal "
                 f"transformers' greedy `generate` of each prompt alone on **{i['same']} of "
                 f"{i['prompts']}** prompts (32 tokens, all {i['prompts']} batched on our side); "
                 f"our sampled tokens' logprobs are within **{i['drift']:.1e}** of a forward "
                 "pass over the finished sequence.")
        print(ident.strip(), flush=True)
    return _section(args, command, rows, ident)


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
