"""Tokens/s of the policy update alone: the padded path (``trainer.packing=false``, plain
AdamW, as the update ran before packing) against the packed one (the backend as built).

    .venv/bin/python bench/update_speed.py --model smollm2-135m --repeats 3 --write
    .venv/bin/python bench/update_speed.py --model tiny --repeats 1          # a quick check
    python bench/update_speed.py --random qwen2.5-1.5b --device cuda --bf16 --mfu

What is timed is one optimizer step, ``SingleBackend.train_step(backend.split(batch),
loss)``: the split into micro-batches, forward, backward, gradient clipping and the
optimizer step, with GRPO's loss (``make_loss_fn`` of ``build_config({"algo": "grpo"})``:
the recipe's) and ``trainer.micro_batch_tokens`` as a run takes it (auto: 4096 on the CPU) and
``trainer.logprob_chunk`` (1024), fp32 (``--bf16``: autocast, as the recipe on a GPU).

* **today** (the padded path): ``packing=False`` on the loss and the backend, and the
  optimizer a plain ``torch.optim.AdamW`` (not fused) with its LambdaLR, as before packing;
* **packed** (the new path): ``packing=True``, the backend as constructed (fused AdamW).

Each side has its own copy of the model (so the padded side never sees the packed
attention function) and both start every step from the same weights (a state-dict copy
restored before each step). One warm-up step per side is left out; then the sides
alternate A-B-B-A over ``--repeats`` so a drift in machine load hits both alike; medians.

Two batches, synthetic (random token ids from the model's vocabulary, fixed seeds):

* ``trl``: the bench-trl GRPO shape: ``--prompts`` (8) prompts x ``--samples`` (8): a
  35-token prompt shared in the group, completions of 27..48 tokens (uniform), all sampled.
* ``search``: multi-turn search: ``--groups`` (2) groups x ``--samples`` rows; each row a
  158-token prompt shared in the group, then generated 30, observation 240, generated 28,
  observation 240, generated 28 (86 sampled tokens; observations differ row to row, mask 0).

Tokens counted: every row's real tokens (its prompt included, as the rows the update
trains on; no padding), the same number for both sides, so the ratio is the time ratio.
With ``--mfu`` on a GPU: achieved FLOPs / ``--peak-tflops``, the FLOPs of the batch as
rows, the same for both sides: 6 x non-embedding parameters x tokens, plus causal
attention (6 x layers x attention width x length^2 per row, forward and backward), plus
the vocabulary head at every sampled position (2 x 3 x hidden x vocab).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from agentgym.core.types import Trajectory  # noqa: E402
from agentgym.trainers.batch import Batch, collate  # noqa: E402

SHAPES = ("trl", "search")
SIDES = ("today", "packed")
#: the search shape's response after its prompt: (kind, tokens)
SEARCH_TURNS = (("generated", 30), ("observation", 240), ("generated", 28),
                ("observation", 240), ("generated", 28))
SEARCH_PROMPT = 158
TRL_PROMPT, TRL_COMPLETION = 35, (27, 48)


# --- batches -----------------------------------------------------------------------------
def group_trajectories(vocab: int, groups: int, samples: int, seed: int, prompt: int,
                       turns) -> list[Trajectory]:
    """``groups`` groups of ``samples`` rows: a shared ``prompt``-token prompt, then each
    row's own ``turns(generator)``: ``(kind, tokens)`` parts, generated or observation."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda k: torch.randint(5, vocab, (k,), generator=g).tolist()  # noqa: E731
    out = []
    for q in range(groups):
        shared = rand(prompt)
        for i in range(samples):
            t = Trajectory(uid=f"q{q}", sample_index=i)
            t.append("prompt", shared, 0)
            turn = 0
            for kind, k in turns(g):
                if kind == "generated":
                    t.append(kind, rand(k), turn, logprobs=[-1.0] * k)
                else:
                    t.append(kind, rand(k), turn)
                    turn += 1
            out.append(t)
    return out


def trl_trajectories(vocab: int, prompts: int, samples: int, seed: int) -> list[Trajectory]:
    """``prompts`` groups of ``samples``: a shared 35-token prompt, a 27..48-token completion."""
    def completion(g):
        lo, hi = TRL_COMPLETION
        return [("generated", int(torch.randint(lo, hi + 1, (1,), generator=g)))]
    return group_trajectories(vocab, prompts, samples, seed, TRL_PROMPT, completion)


def search_trajectories(vocab: int, groups: int, samples: int, seed: int) -> list[Trajectory]:
    """``groups`` groups of ``samples`` rows: a shared 158-token prompt, then
    :data:`SEARCH_TURNS` (every row's own tokens, observations included)."""
    return group_trajectories(vocab, groups, samples, seed, SEARCH_PROMPT,
                              lambda g: SEARCH_TURNS)


def make_batch(shape: str, vocab: int, pad_id: int, args) -> Batch:
    """The shape's batch with what the update reads: advantages (one per row, on its
    sampled tokens), rollout log-probs, no ``old_logp`` (GRPO's single update takes the
    forward's own, as the recipe does)."""
    if shape == "trl":
        trajs = trl_trajectories(vocab, args.prompts, args.samples, args.seed)
    else:
        trajs = search_trajectories(vocab, args.groups, args.samples, args.seed)
    batch = collate(trajs, pad_id)
    g = torch.Generator().manual_seed(args.seed + 1)
    mask = batch.loss_mask
    batch.adv = torch.randn(len(trajs), generator=g)[:, None] * mask
    batch.old_logp = None
    batch.rollout_logp = -torch.rand(mask.shape, generator=g) * mask
    return batch


# --- the model and the two sides ---------------------------------------------------------
def load(args, device):
    """``(model, label)``: a zoo model's weights, or ``--random SHAPE`` initialised."""
    if args.random:
        from transformers import AutoConfig, AutoModelForCausalLM

        from agentgym.core.device import attn_implementation
        from agentgym.models.shapes import shape_config
        config = {k: v for k, v in shape_config(args.random).items()
                  if k not in ("_name_or_path", "transformers_version", "torch_dtype")}
        torch.manual_seed(args.seed)
        impl = attn_implementation(device, "float32")
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(**config), dtype=torch.float32,
            **({"attn_implementation": impl} if impl else {}))
        return model.to(device), f"{args.random} (random init)"
    from agentgym.models.zoo import load_model, resolve_model
    return load_model(resolve_model(args.model), "float32", device=device), args.model


def make_sides(model, cfg, args) -> dict:
    """``{side: SingleBackend}``, each over its own copy of ``model``."""
    from agentgym.trainers.backends.single import SingleBackend, lr_lambda
    t = cfg.trainer
    sides = {}
    for name in SIDES:
        packing = name == "packed"
        m = model if packing else copy.deepcopy(model)
        backend = SingleBackend(m, lr=t.lr, weight_decay=t.weight_decay,
                                schedule=t.lr_schedule, max_grad_norm=t.max_grad_norm,
                                micro_batch_tokens=t.micro_batch_tokens,
                                mixed_precision="bf16" if args.bf16 else "",
                                logprob_chunk=t.logprob_chunk, packing=packing)
        if not packing:  # the optimizer as it was built before packing: plain AdamW
            backend.optimizer = torch.optim.AdamW(
                [p for p in m.parameters() if p.requires_grad], lr=t.lr,
                betas=(0.9, 0.999), weight_decay=t.weight_decay)
            backend.scheduler = torch.optim.lr_scheduler.LambdaLR(
                backend.optimizer, lr_lambda(0, 1, t.lr_schedule))
        sides[name] = backend
    return sides


def work(backend, batch: Batch) -> tuple[int, int]:
    """``(micro-batches, tokens through the decoder)`` of one step on ``backend``: padded
    rows x width, or the packed rows' length."""
    from agentgym.trainers import packing as pk
    parts, tokens = backend.split(batch), 0
    for mb in parts:
        if backend.packing:
            tokens += pk.build_pack(mb.input_ids, mb.attention_mask.sum(-1).tolist(),
                                    mb.loss_mask, groups=mb.uids).input_ids.shape[1]
        else:
            tokens += mb.input_ids.numel()
    return len(parts), tokens


def batch_flops(model, batch: Batch) -> float:
    """Forward + backward FLOPs of ``batch`` as rows (module docstring)."""
    emb = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    params = sum(p.numel() for p in model.parameters() if id(p) not in emb)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    heads = cfg.num_attention_heads
    width = heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    lengths = batch.attention_mask.sum(-1).double()
    sampled = float((batch.loss_mask[:, 1:] > 0).sum())
    return (6 * params * float(lengths.sum())
            + 6 * cfg.num_hidden_layers * width * float((lengths ** 2).sum())
            + 6 * cfg.hidden_size * cfg.vocab_size * sampled)


def timed_step(backend, batch: Batch, loss_fn, init: dict, device) -> float:
    """Seconds of one ``train_step`` (split included) from the weights ``init``."""
    backend.model.load_state_dict(init)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        PEAK["before"] = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    backend.train_step(backend.split(batch), loss_fn)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        PEAK["step"] = torch.cuda.max_memory_allocated(device) - PEAK["before"]
    return time.perf_counter() - t0


#: GPU bytes of the last timed step: allocated before it, and its peak above that
PEAK: dict[str, int] = {}


def measure(args) -> list[dict]:
    """One row per shape: each side's step times, tokens/s and work (module docstring)."""
    from agentgym.config import build_config
    from agentgym.core.device import resolve_device
    from agentgym.models.plan import micro_batch_tokens
    from agentgym.trainers.phases import make_loss_fn
    device = resolve_device(args.device)
    cfg = build_config({"algo": "grpo"})
    model, label = load(args, device)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sides = make_sides(model, cfg, args)
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    vocab, pad_id = text.vocab_size, getattr(text, "pad_token_id", None) or 0
    rows = []
    budgets = args.micro_batch_tokens or [micro_batch_tokens(build_config(
        {"algo": "grpo", "model": args.random or args.model, "trainer.device": args.device}))]
    for shape, budget in [(s, b) for s in args.shapes for b in budgets]:
        for side in sides.values():
            side.micro_batch_tokens = budget
        batch = make_batch(shape, vocab, pad_id, args)
        base = make_loss_fn(cfg, 1.0, float(batch.loss_mask.sum()), len(batch),
                            cfg.rollout.max_response_tokens)
        losses = {s: dataclasses.replace(base, packing=s == "packed") for s in SIDES}
        for s in SIDES:  # warm-up, left out: optimizer state, allocator, kernels
            timed_step(sides[s], batch, losses[s], init, device)
        times: dict[str, list[float]] = {s: [] for s in SIDES}
        peaks: dict[str, int] = {}
        for k in range(args.repeats):
            for s in (SIDES if k % 2 == 0 else SIDES[::-1]):
                times[s].append(timed_step(sides[s], batch, losses[s], init, device))
                if PEAK:
                    peaks[s] = max(peaks.get(s, 0), PEAK["step"])
                print(f"  {shape} {budget} {s}: {times[s][-1]:.2f} s"
                      + (f", {PEAK['before'] / 2**30:.2f} GiB before, step peak "
                         f"+{PEAK['step'] / 2**30:.2f} GiB" if PEAK else ""), flush=True)
        tokens = int(batch.attention_mask.sum())
        row = {"shape": shape, "budget": budget, "peaks": peaks, "model": label, "rows": len(batch), "tokens": tokens,
               "sampled": int(batch.loss_mask.sum()), "flops": batch_flops(model, batch)}
        for s in SIDES:
            mbs, forwarded = work(sides[s], batch)
            sec = statistics.median(times[s])
            row[s] = {"seconds": sec, "all": times[s], "tok_s": tokens / sec,
                      "micro_batches": mbs, "forwarded": forwarded}
        row["ratio"] = row["today"]["seconds"] / row["packed"]["seconds"]
        rows.append(row)
    return rows


# --- report ------------------------------------------------------------------------------
def table(rows: list[dict], mfu_peak: float | None = None) -> str:
    """The rows as markdown: per shape, each side's median tokens/s, the ratio, the work."""
    head = ("| shape | micro-batch tokens | rows | tokens (sampled) | today tok/s | packed tok/s "
            "| packed / today |"
            + (" today MFU | packed MFU |" if mfu_peak else "")
            + " micro-batches (today / packed) | tokens through the decoder (today / packed) |"
            + " step s, each (today; packed) |"
            + (" step's peak above its start, GiB (today / packed) |"
               if rows and rows[0]["peaks"] else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        a, b = r["today"], r["packed"]
        line = (f"| {r['shape']} | {r['budget']:,} | {r['rows']} | {r['tokens']:,} ({r['sampled']:,}) | "
                f"{a['tok_s']:,.0f} | {b['tok_s']:,.0f} | **{r['ratio']:.2f}x** |")
        if mfu_peak:
            line += "".join(f" {r['flops'] / s['seconds'] / (mfu_peak * 1e12):.1%} |"
                            for s in (a, b))
        line += (f" {a['micro_batches']} / {b['micro_batches']} | {a['forwarded']:,} / "
                 f"{b['forwarded']:,} | {', '.join(f'{x:.2f}' for x in a['all'])}; "
                 f"{', '.join(f'{x:.2f}' for x in b['all'])} |")
        if r["peaks"]:
            line += f" {r['peaks']['today'] / 2**30:.2f} / {r['peaks']['packed'] / 2**30:.2f} |"
        lines.append(line)
    return "\n".join(lines)


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a zoo name or a local folder")
    ap.add_argument("--random", metavar="SHAPE", default="",
                    help="a shipped shape (agentgym/models/configs), randomly initialised")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 weights)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    ap.add_argument("--prompts", type=int, default=8, help="trl: groups")
    ap.add_argument("--groups", type=int, default=2, help="search: groups")
    ap.add_argument("--samples", type=int, default=8, help="rows a group")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed steps per side, alternated A-B-B-A")
    ap.add_argument("--micro-batch-tokens", type=int, nargs="+", default=None,
                    help="trainer.micro_batch_tokens, one row per value (default: what a run "
                    "of the model on --device takes: trainer.micro_batch_tokens=0, auto)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mfu", action="store_true", help="MFU column (a GPU only)")
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="the device's peak for --mfu (989: H100 bf16 dense)")
    ap.add_argument("--note", default="", help="conditions to record with the figures")
    ap.add_argument("--write", action="store_true", help="write docs/BENCHMARKS.md's section")
    return ap.parse_args(argv)


def run(args, command: str = "") -> str:
    """Measure and return the section's body (machine, command, table)."""
    from bench.report import machine
    load_before = os.getloadavg()[0]
    rows = measure(args)
    load_after = os.getloadavg()[0]
    on_gpu = not args.device.startswith("cpu")
    if args.mfu and not on_gpu:
        print("--mfu: no GPU in use; tokens/s and ratios only", flush=True)
    peak = args.peak_tflops if args.mfu and on_gpu else None
    where = (torch.cuda.get_device_name(args.device) if on_gpu else machine())
    precision = "bf16 autocast over fp32 weights" if args.bf16 else "fp32"
    text = [f"Machine: {where}; torch threads {torch.get_num_threads()}; 1-minute load "
            f"average {load_before:.2f} before, {load_after:.2f} after (the machine may be "
            f"shared). Command: `{command}`.",
            f"Model `{rows[0]['model']}`, {precision}, GRPO loss, micro-batches of at most "
            f"the row's tokens, log-prob chunk 1024. One `train_step` timed (split, forward, "
            f"backward, clip, optimizer step) from the same weights each time; one warm-up "
            f"step per side left out; {args.repeats} timed steps per side alternated A-B-B-A; "
            f"medians. *today*: `trainer.packing=false` and plain AdamW (the update before "
            f"packing); *packed*: `trainer.packing=true`, fused AdamW. Tokens: every row's "
            f"real tokens (its prompt included), the same for both sides. "
            f"`trl`: {args.prompts} x {args.samples}, prompt {TRL_PROMPT} shared, completions "
            f"{TRL_COMPLETION[0]}..{TRL_COMPLETION[1]}; `search`: {args.groups} x "
            f"{args.samples}, prompt {SEARCH_PROMPT} shared, then generated 30, observation "
            f"240, generated 28, observation 240, generated 28. {args.note}".rstrip(), "",
            table(rows, peak)]
    return "\n".join(text)


def main(argv=None) -> None:
    args = parse(argv)
    shown = [a for a in (argv if argv is not None else sys.argv[1:])]
    if "--note" in shown:  # the command without its note text
        i = shown.index("--note")
        shown = shown[:i] + shown[i + 2:]
    command = " ".join([".venv/bin/python bench/update_speed.py", *shown])
    body = run(args, command)
    print(body)
    if args.write:
        from bench.report import write_section
        name = args.random or args.model
        write_section(f"Policy update speed: packed vs padded ({name}, "
                      f"{'GPU' if not args.device.startswith('cpu') else 'CPU'})", body)


if __name__ == "__main__":
    main()
