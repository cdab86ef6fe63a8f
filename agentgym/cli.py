"""The ``agentgym`` command line. It owns printing, progress bars and log levels.

    agentgym train env=search [model=tiny trainer.total_steps=2 run_dir=runs/x]
    agentgym rollout env=search model=tiny n=4 limit=8 out=traj.jsonl
    agentgym eval env=search model=smollm2-135m data=nq limit=50 out=before.json
    agentgym eval env=code k=8 limit=50 out=pass.json  # pass@1..8 and maj@8 from 8 samples each
    agentgym compare before.json after.json          # paired exact McNemar on the same questions
    agentgym inspect runs/x                          # runs/x/inspect.html: samples per step, curves
    agentgym check-env [ENV_ID ...]
    agentgym demos env=search out=demos.jsonl        # demonstrations played through the env
    agentgym filter data=traj.jsonl out=kept.jsonl   # rejection sampling of rollouts
    agentgym sft env=search data=demos.jsonl run_dir=runs/sft
    agentgym serve --model tiny --port 30000         # HF engine behind SGLang's native API
    agentgym train env=search engine=sglang engine.urls=[http://127.0.0.1:30000]

Every command takes ``key=value`` overrides of :class:`agentgym.config.Config`
(``agentgym config`` prints the resolved config and every key).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from pathlib import Path

from tqdm import tqdm

from agentgym.config import Config, all_keys, build_config, env_names, to_dict
from agentgym.core.overrides import parse_overrides
from agentgym.supervision.server_process import exit_cleanly_on_sigterm
from agentgym.supervision.supervisor import ServiceFailed
from agentgym.supervision.watchdog import StageStalled
from agentgym import envs
from agentgym.core.device import check_device, names_host
from agentgym.core.memory import return_freed_memory
from agentgym.data.commands import env_command
from agentgym.data.demo_builders import build_demos
from agentgym.data.demos import filter_trajectories, within_budgets
from agentgym.data.rows import dataset_path, load_rows, read_rows, row_filter_applies, write_jsonl
from agentgym.envs.checker import check_envs
from agentgym.models.plan import parse_bytes, report
from agentgym.models.zoo import load_tokenizer, resolve_model
from agentgym.reporting.evaluation import (comparison_lines, eval_outcomes, eval_result,
                                           summary_lines, write_result)
from agentgym.reporting.inspector import write_page
from agentgym.reporting.stats import mcnemar
from agentgym.reporting.status import status_lines
from agentgym.retriever_server.corpus import read_corpus
from agentgym.retriever_server.index import build_index, save_index
from agentgym.rollout.chat import ChatTokens
from agentgym.rollout.manager import summarize
from agentgym.rollout.runtime import build_manager, env_factory, played_by_program, sub_config
from agentgym.tools.sandbox import make_sandbox

log = logging.getLogger("agentgym")


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


#: what ``agentgym train`` (and ``agentgym config``, which shows train's config) sets
#: unless told otherwise: group-based estimators need n > 1, and Search-R1 samples 5
#: (algo=ppo's preset sets 1)
TRAIN_DEFAULTS = {"rollout.n": 5}
#: what ``agentgym sft`` sets unless told otherwise: SFT's usual step size (RL's default is
#: 1e-6), warmup and cosine decay
SFT_DEFAULTS = {"trainer.lr": 2e-5, "trainer.warmup_steps": 2, "trainer.lr_schedule": "cosine"}
#: each ``key=value`` command's defaults over the config's (the others have none)
COMMAND_DEFAULTS = {"train": TRAIN_DEFAULTS, "config": TRAIN_DEFAULTS, "sft": SFT_DEFAULTS}
#: ``key=value`` arguments of a command's own, beside the config's keys
COMMAND_KEYS = {"eval": ("k", "samples"), "plan": ("gpus", "gpu_memory"), "compare": ("metric",),
                "inspect": ("out",)}


def _config(args: list[str], command_defaults: dict | None = None) -> Config:
    overrides = parse_overrides(args)
    if "env" in overrides:  # one canonical name: the short one when the env has it
        # fails fast with "did you mean", before any model loads (each env of a mixed run)
        overrides["env"] = ",".join(envs.short_name(envs.resolve_env_id(e))
                                    for e in env_names(overrides["env"]))
    cfg = build_config(overrides, command_defaults)
    for e in env_names(cfg.env):
        envs.resolve_env_id(e)
    _setup_logging(cfg.log_level)
    return cfg


def _gave_data(args: list[str]) -> bool:
    """Did the user name the data (``data=…`` or ``data.name=…``)?"""
    given = parse_overrides(args)
    return "data" in given or "data.name" in given


def _run_rollouts(cfg: Config, desc: str):
    rows = load_rows(cfg.env, cfg.data.name, cfg.limit, cfg=cfg)
    manager, engine, tokenizer = build_manager(cfg)
    if played_by_program(cfg):  # the agent program plays the rows
        from agentgym.serving.agents import program_manager  # lazy: loads fastapi
        manager = program_manager(manager, engine, tokenizer, cfg)
    total = len(rows) * cfg.rollout.n
    t0 = time.perf_counter()
    try:
        with tqdm(total=total, desc=desc, unit="traj", file=sys.stderr) as bar:
            trajs = engine.run(manager.run(rows, on_done=lambda t: bar.update(1)))
    finally:
        manager.close()
        engine.close()
    return trajs, tokenizer, time.perf_counter() - t0, rows


def _records(trajs, tok):
    """Each trajectory as ``agentgym rollout`` writes it: its fields, the decoded response
    (``text``) and each token decoded (``tokens``), for reading what the policy did."""
    for t in trajs:
        d = t.to_dict()
        d["text"] = tok.decode(t.token_ids[t.prompt_length:], skip_special_tokens=False)
        d["tokens"] = [tok.decode([i], skip_special_tokens=False) for i in t.token_ids]
        yield d


def cmd_rollout(args: list[str]) -> int:
    cfg = _config(args)
    trajs, tok, elapsed, _ = _run_rollouts(cfg, "rollout")
    out = Path(cfg.out or "trajectories.jsonl")
    write_jsonl(out, _records(trajs, tok))
    s = summarize(trajs)
    gen = sum(t.num_sampled for t in trajs)
    print(f"wrote {len(trajs)} trajectories to {out} in {elapsed:.1f}s "
          f"({len(trajs) / elapsed:.2f} traj/s, {gen / elapsed:.0f} generated tok/s)")
    print(f"reward {s['reward']:.3f}  em {s['em']:.3f}  turns {s['turns']:.2f}  "
          f"tool calls {s['tool_calls']:.2f}  tool failures {s['tool_failures']:.2f}  "
          f"response length {s['response_length']:.0f}")
    return 0


def cmd_eval(args: list[str]) -> int:
    given = parse_overrides(args)
    k = int(given.pop("k", 1))
    samples = given.pop("samples", None)
    if k < 1:
        raise ValueError(f"k={k}: the samples per question for pass@k must be >= 1")
    rest = [a for a in args if a.partition("=")[0] not in COMMAND_KEYS["eval"]]
    # k=1: one greedy answer per question; k > 1: k samples at rollout.temperature (1.0 unless
    # set). What eval means, so above a recipe's sampling keys, below the user's.
    cfg = _config([f"rollout.temperature={0.0 if k == 1 else 1.0}", f"rollout.n={k}", *rest])
    if not _gave_data(rest):  # the env's held-out set (nq, gsm8k, …)
        cfg.data.name = cfg.trainer.eval_data
    if k > 1 and cfg.rollout.temperature == 0:
        raise ValueError(f"k={k} samples at rollout.temperature=0 are all the same answer; "
                         f"pass@k needs rollout.temperature > 0 (e.g. 1.0)")
    trajs, tok, elapsed, rows = _run_rollouts(cfg, "eval")
    result = eval_result(cfg, trajs, elapsed, k, rows)
    print("\n".join(summary_lines(result)))
    if cfg.out:
        write_result(result, cfg.out)
        print(f"  wrote {cfg.out}")
    if samples:  # every episode as `agentgym rollout` writes it, to read what went wrong
        write_jsonl(Path(samples), _records(trajs, tok))
        print(f"  wrote {len(trajs)} episodes to {samples}")
    return 0


def cmd_status(args: list[str]) -> int:
    """``agentgym status RUN_DIR``: the run's stage and step now, time in stage, last
    metrics, last checkpoint (:mod:`agentgym.reporting.status`)."""
    if len(args) != 1 or "=" in args[0]:
        raise ValueError(f"usage: agentgym status RUN_DIR; got {args}")
    print("\n".join(status_lines(args[0])))
    return 0


def cmd_inspect(args: list[str]) -> int:
    """``agentgym inspect RUN_DIR|FILE.jsonl [out=PAGE.html]``: one self-contained HTML page
    of the run's samples per step (or a rollout file), its curves, and filters."""

    paths = [a for a in args if "=" not in a]
    opts = dict(a.split("=", 1) for a in args if "=" in a)
    out = opts.pop("out", None)
    if len(paths) != 1 or opts:
        raise ValueError(f"usage: agentgym inspect RUN_DIR|FILE.jsonl [out=PAGE.html]; got {args}")
    page = write_page(paths[0], out)
    print(f"wrote {page} (open it in a browser; it needs no server or network)")
    return 0


def cmd_compare(args: list[str]) -> int:
    """``agentgym compare BEFORE.json AFTER.json [metric=em]``: the paired exact McNemar test
    of two ``agentgym eval ... out=`` results on the same questions."""

    paths = [a for a in args if "=" not in a]
    opts = dict(a.split("=", 1) for a in args if "=" in a)
    metric = opts.pop("metric", "em")
    if len(paths) != 2 or opts or metric not in ("em", "format_valid", "second_hop"):
        raise ValueError(f"usage: agentgym compare BEFORE.json AFTER.json [metric=em|"
                         f"format_valid|second_hop]; got {args}")
    outcomes = [eval_outcomes(Path(p), metric) for p in paths]
    r = mcnemar(*outcomes)
    print(f"{metric} on {r.n} shared questions: {r.before:.3f} -> {r.after:.3f} "
          f"({100 * r.delta:+.1f} points); gained {r.gained}, lost {r.lost}; "
          f"exact McNemar p = {r.p_value:.4g}")
    return 0


def cmd_check_env(args: list[str]) -> int:
    _setup_logging("WARNING")
    keys = parse_overrides([a for a in args if "=" in a])  # for an env with its own check
    ids = [a for a in args if "=" not in a] or envs.env_ids()
    failed = 0
    for verdict, env_id, detail in check_envs(ids, lambda n: build_config({**keys, "env": n})):
        failed += verdict == "FAIL"
        print(f"{verdict:<5} {env_id}" + (f": {detail}" if detail else ""))
    return 1 if failed else 0


class _BarHooks:
    """Progress bars and one summary line per training step."""

    def __init__(self) -> None:
        self.bar = None

    def phase(self, name: str, total: int) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar = tqdm(total=total, desc=f"{name:8s}", unit="it", leave=False, file=sys.stderr)

    def advance(self, k: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(k)

    def announce(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def step_end(self, step: int, m: dict) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if "rollout/reward" not in m:
            print(f"step {step:4d} | eval EM {m.get('eval/em', float('nan')):.3f} "
                  f"(n={m.get('eval/count', 0):.0f}) format-valid "
                  f"{m.get('eval/format_valid', float('nan')):.3f}", flush=True)
            return
        extra = ""
        if "critic/vf_loss" in m:
            extra += f" vf {m['critic/vf_loss']:.3f} ev {m['critic/explained_var']:.2f}"
        if "rollout/signal_groups" in m:
            extra += f" signal {m['rollout/signal_groups']:.2f}"
        if "rollout/groups_kept" in m:
            extra += (f" groups {m['rollout/groups_kept']:.0f} kept/"
                      f"{m['rollout/groups_dropped']:.0f} dropped")
        print(f"step {step:4d} | reward {m['rollout/reward']:.3f} em {m['rollout/em']:.3f} "
              f"len {m['rollout/response_length']:.0f} turns {m['rollout/turns']:.2f} "
              f"kl {m.get('train/kl', 0.0):.4f} drift {m.get('rollout/drift_mean', float('nan')):.1e}"
              f"{extra} | gen {m['time/generate_s']:.1f}s env {m['time/env_s']:.2f}s "
              f"rollout {m['time/rollout_s']:.1f}s train {m['time/train_s']:.1f}s", flush=True)


def cmd_train(args: list[str]) -> int:
    """``agentgym train``: :func:`agentgym.trainers.loop.train` with progress bars, then
    the before / after table and where the run's curves and files are."""
    from agentgym.trainers.loop import train  # lazy: loads torch

    # train() checks the algorithm's settings before any model loads
    cfg = _config(args, TRAIN_DEFAULTS)
    run_dir = train(cfg, _BarHooks())
    _print_comparison(Path(run_dir), cfg)
    run = Path(run_dir)
    curves = [f"{run / 'reward_curve.png'} (RL reward)"]
    if (run / "curriculum_curve.png").exists():
        curves.append(f"{run / 'curriculum_curve.png'} (curriculum: solve rate by level)")
    if (run / "cold_start" / "loss_curve.png").exists():
        curves.append(f"{run / 'cold_start' / 'loss_curve.png'} (cold-start SFT loss)")
    print(f"curves: {', '.join(curves)}; TensorBoard: tensorboard --logdir {run}")
    print(f"run directory: {run_dir} (metrics.jsonl, checkpoints/"
          f"{', cold_start/' if (run / 'cold_start').is_dir() else ''}"
          f"{', samples/' if (run / 'samples').is_dir() else ''})")
    if (run / "samples").is_dir():
        print(f"what the policy did, step by step: agentgym inspect {run}")
    return 0


def _print_comparison(run_dir: Path, cfg: Config) -> None:
    """The run's before / after-SFT / after-RL table (a table per env of a mixed run)."""
    names = env_names(cfg.env)
    subs = [(None, cfg)] if len(names) == 1 else [(e, sub_config(cfg, e)) for e in names]
    for line in comparison_lines(run_dir, [(e, c.trainer.eval_data, row_filter_applies(c))
                                           for e, c in subs], cfg.env):
        print(line)


class _SFTHooks(_BarHooks):
    """One bar over the SFT steps, its postfix the running loss; eval results printed."""

    def phase(self, name: str, total: int) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar = tqdm(total=total, desc=name, unit="step", file=sys.stderr)

    def step_end(self, step: int, m: dict) -> None:
        if "train/loss" in m:
            if self.bar is not None:
                self.bar.set_postfix(loss=f"{m['train/loss']:.3f}",
                                     pad=f"{m['train/pad_fraction']:.2f}")
            return
        super().step_end(step, m)


def cmd_sft(args: list[str]) -> int:
    from agentgym.trainers.sft import sft  # lazy: loads torch

    cfg = _config(args, SFT_DEFAULTS)
    if not _gave_data(args):
        raise ValueError("agentgym sft needs data=FILE.jsonl (demonstrations from agentgym "
                         "demos, trajectories from agentgym rollout/filter, or conversations)")
    hooks = _SFTHooks()
    run_dir = sft(cfg, hooks)
    if hooks.bar is not None:
        hooks.bar.close()
    print(f"run directory: {run_dir} (metrics.jsonl, loss_curve.png, tensorboard/, "
          f"checkpoints/); continue with RL: agentgym train env={cfg.env} "
          f"model={run_dir}/checkpoints/step_N")
    return 0


def cmd_demos(args: list[str]) -> int:
    """``agentgym demos env=search|code [data=train limit=N out=FILE]``."""
    cfg = _config(args)
    rows = load_rows(cfg.env, cfg.data.name, cfg.limit, cfg=cfg)
    options = envs.env_manifest(cfg.env).demo_options_for(cfg)
    t0 = time.perf_counter()
    with tqdm(total=len(rows), desc=f"{cfg.env} demos", unit="row", file=sys.stderr) as bar:
        demos = build_demos(cfg.env, rows, env_factory(cfg), workers=cfg.rollout.env_workers,
                            on_done=lambda ok: bar.update(1), **options)
    # keep what a rollout under these budgets could have produced, in this model's tokens
    chat = ChatTokens(load_tokenizer(resolve_model(cfg.model.path or cfg.model.name)))
    kept, over, _ = within_budgets(demos, chat, cfg.env, cfg.rollout)
    out = Path(cfg.out or f"demos_{cfg.env}.jsonl")
    write_jsonl(out, kept)
    print(f"wrote {len(kept)} demonstrations for {len(rows)} questions to {out} in "
          f"{time.perf_counter() - t0:.0f}s ({len(rows) - len(demos)} without a correct "
          f"demonstration, {over} over the rollout budgets of {cfg.model.name})")
    return 0


def cmd_filter(args: list[str]) -> int:
    """``agentgym filter data=ROLLOUTS.jsonl out=KEPT.jsonl [sft.min_reward=1.0]``:
    rejection sampling (the RFT loop: rollout → filter → sft)."""

    cfg = _config(args)
    if not _gave_data(args):
        raise ValueError("agentgym filter needs data=FILE.jsonl (from agentgym rollout)")
    records = read_rows(dataset_path(cfg.env, cfg.data.name))
    kept = filter_trajectories(records, cfg.sft.min_reward, cfg.sft.max_per_prompt)
    out = Path(cfg.out or "kept.jsonl")
    write_jsonl(out, kept)
    prompts = len({r.get("uid") for r in kept})
    print(f"kept {len(kept)} of {len(records)} trajectories (reward >= {cfg.sft.min_reward}, "
          f"ended with an answer) from {prompts} prompts -> {out}")
    return 0


def cmd_config(args: list[str]) -> int:
    """``agentgym config KEY=VALUE …``: the config ``agentgym train`` resolves from them
    (JSON), and every key."""
    cfg = _config(args, TRAIN_DEFAULTS)
    print(json.dumps(to_dict(cfg), indent=2))
    print("keys: " + " ".join(all_keys(cfg)), file=sys.stderr)
    return 0


def cmd_plan(args: list[str]) -> int:
    """``agentgym plan recipe=… gpus=8 gpu_memory=80GB``: memory per device, and a verdict."""
    given = parse_overrides(args)
    rest = [a for a in args if a.partition("=")[0] not in COMMAND_KEYS["plan"]]
    cfg = _config(rest)
    device = "host" if names_host(cfg.trainer.device) else "gpu"
    gpus = int(given.get("gpus", cfg.trainer.nprocs))
    print("\n".join(report(cfg, gpus, parse_bytes(given.get("gpu_memory", "80GB")), device)))
    return 0


def cmd_index(args: list[str]) -> int:
    """``agentgym index build --corpus FILE --method dense|bm25 --out DIR``."""
    from agentgym.retriever_server.__main__ import index_parser  # lazy: loads pydantic

    ns = index_parser().parse_args(args)
    _setup_logging("WARNING")

    from agentgym.retriever_server.encoder import EncoderSpec  # lazy: loads numpy

    docs = read_corpus(ns.corpus)
    options = {}
    if ns.method == "dense":
        spec = EncoderSpec(ns.encoder, ns.pooling, ns.query_prefix, ns.passage_prefix,
                           ns.max_length, dtype=ns.dtype)
        options = {"spec": spec, "faiss_type": ns.faiss, "nlist": ns.nlist,
                   "nprobe": ns.nprobe, "hnsw_m": ns.hnsw_m, "ef_search": ns.ef_search,
                   "batch_size": ns.batch_size}
    t0 = time.perf_counter()
    with tqdm(total=len(docs), desc=f"{ns.method} index", unit="passage", file=sys.stderr) as bar:
        index = build_index(docs, ns.method, progress=bar.update, **options)
    save_index(index, ns.out)
    elapsed = time.perf_counter() - t0
    print(f"indexed {len(docs)} passages with {ns.method} in {elapsed:.1f}s "
          f"({len(docs) / elapsed:.0f} passages/s) -> {ns.out}")
    print(f"serve it: agentgym serve-retriever --index {ns.out}")
    return 0


def cmd_serve_retriever(args: list[str]) -> int:
    """``agentgym serve-retriever --index DIR [--port N …]`` (= ``python -m
    agentgym.retriever_server``)."""
    from agentgym.retriever_server.__main__ import serve, server_parser  # lazy: loads pydantic

    ns = server_parser("agentgym serve-retriever").parse_args(args)
    _setup_logging(ns.log_level)
    serve(ns)
    return 0


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agentgym serve",
        description="Serve a policy with the in-process HF engine behind a subset of SGLang's "
                    "native HTTP API (/generate with input_ids, weight updates, pause/"
                    "continue), so engine=sglang engine.urls=[...] rolls out through it.")
    p.add_argument("--model", required=True, help="zoo name (tiny, smollm2-135m) or HF folder")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (no authentication: "
                   "bind others deliberately)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="", choices=["", "float32", "bfloat16"],
                   help="weights (default: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--device", default="auto",
                   help="auto (CUDA when available) | cpu | cuda | cuda:N")
    p.add_argument("--max-batch-size", type=int, default=32, help="requests decoded together")
    p.add_argument("--seed", type=int, default=0, help="sampler seed of unseeded requests")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="refuse stop strings, as SGLang does with this flag (clients stop "
                        "on their side)")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--log-level", default="info")
    return p


def cmd_serve(args: list[str]) -> int:
    """``agentgym serve --model M --port N``: the HF engine behind SGLang's native API."""
    from agentgym.serving.serve import serve  # lazy: loads torch

    try:
        ns = serve_parser().parse_args(args)
    except SystemExit as e:
        return int(e.code or 0)
    _setup_logging(ns.log_level)
    try:
        check_device(ns.device)
    except ValueError as e:
        print(f"agentgym serve: {str(e).replace('trainer.device', '--device')}", file=sys.stderr)
        return 2
    serve(ns.model, host=ns.host, port=ns.port, dtype=ns.dtype, device=ns.device,
          max_batch_size=ns.max_batch_size, seed=ns.seed,
          skip_tokenizer_init=ns.skip_tokenizer_init, weight_version=ns.weight_version,
          log_level=ns.log_level.lower())
    return 0


def sandbox_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentgym sandbox",
                                description="Run Python code in the code sandbox; print the "
                                            "result as JSON.")
    p.add_argument("action", choices=["exec"])
    p.add_argument("--file", default="-", help="code file; '-' or absent: read stdin")
    p.add_argument("--session", default=None, help="run as a cell of this session (notebook)")
    p.add_argument("overrides", nargs="*", metavar="sandbox.KEY=VALUE")
    return p


def cmd_sandbox(args: list[str]) -> int:
    """``agentgym sandbox exec [--file F.py | -] [--session ID] [sandbox.KEY=VALUE ...]``.

    Runs the code (from the file, or stdin) in the configured code sandbox and prints its
    ``ExecResult`` as JSON. Exit status: 0 when the sandbox ran the code (whatever the
    code's own status; see ``exit_code`` in the JSON), 1 when the sandbox itself failed,
    2 for a usage or config error.
    """
    try:
        ns = sandbox_parser().parse_intermixed_args(args)
    except SystemExit as e:  # usage error (2) or --help (0); main() must not exit
        return int(e.code or 0)
    overrides = [o for o in ns.overrides if o != "-"]  # a bare '-' means stdin
    outside = [o for o in overrides if not o.startswith("sandbox.")]
    if outside:
        raise ValueError(f"only sandbox.* overrides are accepted, got {' '.join(outside)} "
                         f"(keys: agentgym config)")
    cfg = build_config(parse_overrides(overrides))
    _setup_logging(cfg.log_level)
    code = sys.stdin.read() if ns.file == "-" else Path(ns.file).read_text()
    with contextlib.closing(make_sandbox(cfg.sandbox)) as sandbox:
        result = sandbox.run_sync(code, session=ns.session)
    print(json.dumps(result.to_dict(), indent=2))
    return 1 if result.error else 0


#: ``key=value`` commands (take config overrides).
COMMANDS = {"train": cmd_train, "rollout": cmd_rollout, "eval": cmd_eval, "inspect": cmd_inspect,
            "check-env": cmd_check_env, "config": cmd_config, "plan": cmd_plan, "sft": cmd_sft, "demos": cmd_demos, "filter": cmd_filter,
            "compare": cmd_compare, "status": cmd_status}
#: Commands with their own ``--flag`` arguments (each parses its raw argv).
FLAG_COMMANDS: dict = {"index": cmd_index, "serve-retriever": cmd_serve_retriever,
                       "serve": cmd_serve, "sandbox": cmd_sandbox}
#: their parsers (``sandbox``'s parses intermixed), which the docs' check uses too; the
#: retriever's are imported when asked for
FLAG_PARSERS = {"index": lambda: _retriever().index_parser(), "serve": serve_parser,
                "serve-retriever": lambda: _retriever().server_parser("agentgym serve-retriever"),
                "sandbox": sandbox_parser}


def _retriever():
    from agentgym.retriever_server import __main__ as retriever  # lazy: loads pydantic
    return retriever


def cmd_env(env: str, name: str, args: list[str]) -> int:
    """A command an env's manifest brings (``agentgym swe validate``): its lines printed."""
    _setup_logging("WARNING")
    report = env_command(env, name, args)
    while True:
        try:
            print(next(report), flush=True)
        except StopIteration as done:
            return int(done.value or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    run = {**COMMANDS, **FLAG_COMMANDS}
    if argv and argv[0] not in run and not argv[0].startswith("-"):
        if (env := envs.env_commands().get(argv[0])) is not None:  # an env's: agentgym swe
            run[argv[0]] = lambda rest: cmd_env(env, argv[0], rest)
    names = sorted(run)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in names:
        parser = argparse.ArgumentParser(prog="agentgym", description=__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("command", choices=names)
        parser.add_argument("args", nargs="*", help="key=value overrides, or the command's flags")
        if not argv:
            parser.print_help(sys.stderr)
            return 2
        parser.parse_args(argv[:1])  # prints usage (and exits) for -h or an unknown command
    command, rest = argv[0], argv[1:]
    # SIGTERM ends a command as Ctrl-C does: through finally blocks and exit handlers, so
    # the servers it started (in sessions of their own) and their folders go with it. The
    # serve commands are such servers: uvicorn shuts them down gracefully on SIGTERM and
    # re-raises it, so their exit status says SIGTERM (docs/decisions/serving.md,
    # "Retriever server").
    if command not in ("serve", "serve-retriever"):
        exit_cleanly_on_sigterm()
    return_freed_memory()  # a long run's RSS must not only grow (agentgym.core.memory)
    try:
        return run[command](rest)
    except (KeyError, ValueError, FileNotFoundError) as e:
        log.debug("command failed", exc_info=True)
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"agentgym {command}: error: {msg}", file=sys.stderr)
        return 2
    except (OSError, ServiceFailed) as e:  # a checkpoint (2) or a service (1): says what to do
        # loaded by then; importing it here keeps torch out of --help
        from agentgym.trainers.checkpoints import CheckpointError  # lazy: loads torch
        if isinstance(e, OSError) and not isinstance(e, CheckpointError):
            raise
        log.debug("command failed", exc_info=True)
        print(f"agentgym {command}: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, CheckpointError) else 1
    except StageStalled as e:  # a stage past its deadline: where, and how to continue
        log.debug("command failed", exc_info=True)
        print(f"agentgym {command}: error: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:  # Ctrl-C: what was interrupted is in the log at DEBUG
        log.debug("interrupted", exc_info=True)
        print(f"agentgym {command}: interrupted" + (" (trainer.resume=auto with the same "
              "run_dir continues from its last checkpoint)" if command in ("train", "sft")
              else ""), file=sys.stderr)
        return 130
    finally:  # an MCP server lives as long as the command that connected to it
        if (mcp := sys.modules.get("agentgym.tools.mcp_client")) is not None:
            mcp.close_shared()


if __name__ == "__main__":
    sys.exit(main())
