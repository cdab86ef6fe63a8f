"""``agentgym inspect RUN_DIR|FILE.jsonl``: one self-contained HTML page of what the policy did.

The page needs no network and no server: the samples (``run_dir/samples/step_*.jsonl``,
written by ``trainer.log_samples``, or a ``agentgym rollout out=`` file) and the run's
metrics (``metrics.jsonl``) are embedded as JSON, and a small script draws them. Each
sample is listed by its step, rank, env, reward and advantage; opened, it shows its turns,
every token coloured by the loss mask (what the policy sampled and is trained on, against
prompt and tool output), tool calls and observations set apart, and on hover the token's
id, the engine's and the trainer's logprob, their gap and the advantage. Filters by step,
env, rank and reward; the run's curves sit above. Token views are built only when a sample
is opened, so a page of thousands of samples opens as fast as its list.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: the curves shown first (any other numeric key of metrics.jsonl can be picked on the page)
DEFAULT_CURVES = ("rollout/reward", "eval/em", "rollout/signal_groups")


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _compact(r: dict, where: str) -> dict[str, Any]:
    """A sample line (or a rollout trajectory line) in the page's compact form."""
    if "token_ids" not in r or "loss_mask" not in r:
        raise ValueError(f"{where}: not a sample or trajectory line (needs token_ids and "
                         f"loss_mask; has {sorted(r)[:8]})")
    n = len(r["token_ids"])
    segs = [[s["kind"], s["start"], s["end"], s["turn"]] if isinstance(s, dict) else list(s)
            for s in r.get("segments", [])] or [["generated", 0, n, 0]]
    tokens = r.get("tokens")
    if tokens is None:
        raise ValueError(f"{where}: the line has no decoded 'tokens'; write it with this "
                         f"version's `agentgym rollout` or trainer.log_samples")
    info = r.get("info", {})
    sampled_adv = [a for a, m in zip(r.get("advantages", []), r["loss_mask"]) if m]
    return {
        "s": int(r.get("step", 0)), "r": r.get("rank", ""),
        "e": r.get("env") or str(info.get("env", "")) or r.get("data_source", ""),
        "u": str(r.get("uid", "")), "i": int(r.get("sample_index", 0)),
        "rw": float(r.get("reward", 0.0)),
        "a": r.get("advantage", sum(sampled_adv) / len(sampled_adv) if sampled_adv else None),
        "em": float(r.get("em", info.get("em", 0.0))),
        "end": "answered" if r.get("terminated") else
               ("truncated" if r.get("truncated") else str(info.get("end", ""))),
        "ans": str(info.get("answer", ""))[:200], "m": r.get("metrics", {}),
        "id": r["token_ids"], "tok": tokens, "mk": "".join(str(int(m)) for m in r["loss_mask"]),
        "el": r.get("engine_logprobs", r.get("logprobs")),
        "tl": r.get("trainer_logprobs"), "ad": r.get("advantages"), "seg": segs,
    }


def load(source: str | Path) -> tuple[list[dict], list[dict], str]:
    """The samples, the metrics rows and a title from a run directory or one JSONL file."""
    src = Path(source)
    if src.is_dir():
        files = sorted((src / "samples").glob("step_*.jsonl"),
                       key=lambda p: int(p.stem.split("_")[1]))
        if not files:
            raise FileNotFoundError(
                f"{src} has no samples/step_*.jsonl; train with trainer.log_samples=N (N > 0) "
                f"or pass a JSONL file of `agentgym rollout out=...`")
        metrics_path = src / "metrics.jsonl"
        metrics = _read_jsonl(metrics_path) if metrics_path.exists() else []
    elif src.is_file():
        files, metrics = [src], []
    else:
        raise FileNotFoundError(f"{src} is neither a run directory nor a JSONL file")
    samples = []
    for f in files:
        for k, line in enumerate(_read_jsonl(f), 1):
            samples.append(_compact(line, f"{f}:{k}"))
    return samples, metrics, src.resolve().name


def write_page(source: str | Path, out: str | Path | None = None) -> Path:
    """Write the page for ``source`` (default: ``RUN_DIR/inspect.html`` or ``FILE.html``)."""
    samples, metrics, title = load(source)
    src = Path(source)
    path = Path(out) if out else (src / "inspect.html" if src.is_dir() else src.with_suffix(".html"))
    data = {"title": title, "samples": samples, "metrics": metrics,
            "curves": [k for k in DEFAULT_CURVES if any(k in r for r in metrics)]}
    blob = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    template = Path(__file__).with_name("inspector.html").read_text(encoding="utf-8")
    html = template.replace("__TITLE__", _escape(title)).replace("__DATA__", blob)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html, encoding="utf-8")
    logger.info("wrote %s (%d samples, %d metric rows)", path, len(samples), len(metrics))
    return path


def _escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")

