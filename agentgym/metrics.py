"""Run metrics: one JSON line per step, TensorBoard events, and a reward-curve PNG.

Keys are namespaced like CleanRL's (``rollout/reward``, ``train/loss``, ``time/step_s``);
the JSONL file is the source the PNG is drawn from, so a resumed run keeps its history.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

logger = logging.getLogger(__name__)


class MetricsLogger:
    """Writes ``metrics.jsonl``, TensorBoard events and a curve PNG in ``run_dir``.

    Args:
        run_dir: the run directory.
        curve_keys: metric keys drawn on the curve.
        png_name: the curve's file (``reward_curve.png`` for RL, ``loss_curve.png`` for SFT).
        ylabel: the curve's y-axis label.
    """

    def __init__(self, run_dir: str | Path,
                 curve_keys: tuple[str, ...] = ("rollout/reward", "eval/em"),
                 resume_step: int = 0, png_name: str = "reward_curve.png",
                 ylabel: str = "reward / EM") -> None:
        from torch.utils.tensorboard import SummaryWriter
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.png = self.run_dir / png_name
        self.ylabel = ylabel
        self.curve_keys = curve_keys
        # A resumed run drops what was logged after its checkpoint (it is logged again);
        # a fresh run in an old directory starts an empty history.
        kept = [r for r in self.history() if resume_step and r["step"] <= resume_step]
        with open(self.path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        self.tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"),
                                purge_step=resume_step + 1 if resume_step else None)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and math.isfinite(float(v))}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        for k, v in clean.items():
            self.tb.add_scalar(k, v, step)
        self.tb.flush()
        self.plot()

    def history(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    def plot(self) -> None:
        """Redraw the reward curve from the JSONL history."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = self.history()
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        for key in self.curve_keys:
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", markersize=3, label=key)
        ax.set_xlabel("step")
        ax.set_ylabel(self.ylabel)
        ax.set_title(self.run_dir.name)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
        fig.tight_layout()
        fig.savefig(self.png)
        plt.close(fig)

    def close(self) -> None:
        self.tb.close()
