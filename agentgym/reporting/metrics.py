"""Run metrics: one JSON line per step, TensorBoard events, and a reward-curve PNG.

The PNG is redrawn at the first step, then at most every :data:`PLOT_EVERY_S` seconds
and when the run closes: a redraw takes 0.2-0.7 s on a 2-core CPU (matplotlib's text
layout and PNG encoding), as long as a whole policy update of a small model, and grows
with the history.

Keys are namespaced like CleanRL's (``rollout/reward``, ``train/loss``, ``time/step_s``);
the JSONL file is the source the PNG is drawn from, so a resumed run keeps its history.
``logger=wandb`` logs the same metrics, the step's sample table (``trainer.log_samples``)
and, at the end, the curve PNGs to Weights & Biases as well (:class:`WandbSink`; the
``wandb`` extra; ``WANDB_MODE=offline`` writes local files only).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any

from agentgym.supervision.watchdog import signals_deferred

logger = logging.getLogger(__name__)


class MetricsLogger:
    """Writes ``metrics.jsonl``, TensorBoard events and a curve PNG in ``run_dir``.

    Args:
        run_dir: the run directory.
        curve_keys: metric keys drawn on the curve.
        png_name: the curve's file (``reward_curve.png`` for RL, ``loss_curve.png`` for SFT).
        ylabel: the curve's y-axis label.
        plot_every_s: the least seconds between two redraws of the PNG while the run
            goes on (the first step's and the last, at :meth:`close`, are always drawn).
    """

    def __init__(self, run_dir: str | Path,
                 curve_keys: tuple[str, ...] = ("rollout/reward", "eval/em"),
                 resume_step: int = 0, png_name: str = "reward_curve.png",
                 ylabel: str = "reward / EM", sink: str = "",
                 config: dict[str, Any] | None = None,
                 plot_every_s: float | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter
        with signals_deferred():  # imported whole, at set-up (see plot)
            _pyplot()
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.png = self.run_dir / png_name
        self.ylabel = ylabel
        self.curve_keys = curve_keys
        self.plot_every_s = PLOT_EVERY_S if plot_every_s is None else plot_every_s
        self._drawn: float | None = None  # time.monotonic() of the last redraw
        self._stale = False  # steps logged since the last redraw
        # A resumed run drops what was logged after its checkpoint (it is logged again);
        # a fresh run in an old directory starts an empty history.
        kept = [r for r in self.history() if resume_step and r["step"] <= resume_step]
        with open(self.path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        self.tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"),
                                purge_step=resume_step + 1 if resume_step else None)
        self.wandb = WandbSink(self.run_dir, config or {}) if sink == "wandb" else None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and math.isfinite(float(v))}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        for k, v in clean.items():
            self.tb.add_scalar(k, v, step)
        self.tb.flush()
        self._stale = True
        if self._drawn is None or time.monotonic() - self._drawn >= self.plot_every_s:
            self.plot()
        if self.wandb is not None:
            self.wandb.log(step, clean)

    def samples(self, step: int, path: Path) -> None:
        """A step's sample file (``run_dir/samples/step_N.jsonl``), as a W&B table."""
        if self.wandb is not None:
            self.wandb.samples(step, path)

    def history(self) -> list[dict]:
        if not self.path.exists():
            return []
        rows = []
        with open(self.path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
        for i, line in enumerate(lines):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if i < len(lines) - 1:
                    raise ValueError(f"{self.path}:{i + 1} is not JSON: {line[:200]!r}") \
                        from None
                # the last line of a run killed while writing it: that step is logged again
                logger.warning("%s: dropping an unfinished last line (%d bytes)", self.path,
                               len(line))
        return rows

    def plot(self) -> None:
        """Redraw the reward curve from the JSONL history: each key's points; for a key
        logged with ``<key>_ci95`` (the step's 95% interval over its groups) a band around
        them, and a moving average over :data:`SMOOTH` steps. With a curriculum, its own
        curves too (:func:`plot_curriculum`)."""
        with signals_deferred():  # a Ctrl-C here is raised once the PNG is written
            self._draw()

    def _draw(self) -> None:
        plt = _pyplot()
        self._drawn = time.monotonic()
        rows = self.history()
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        for key in self.curve_keys:
            pts = [(r["step"], r[key], r.get(f"{key}_ci95")) for r in rows if key in r]
            if not pts:
                continue
            xs, ys, ci = zip(*pts)
            line, = ax.plot(xs, ys, marker="o", markersize=3, linewidth=0.8, label=key)
            if all(c is not None for c in ci) and len(xs) > 1:
                ax.fill_between(xs, [y - c for y, c in zip(ys, ci)],
                                [y + c for y, c in zip(ys, ci)], color=line.get_color(),
                                alpha=0.2, label=f"{key}: 95% interval over the step's groups")
                if len(xs) >= 3:  # trailing mean, over fewer steps at the start
                    win = [ys[max(0, i - SMOOTH + 1):i + 1] for i in range(len(ys))]
                    ax.plot(xs, [sum(w) / len(w) for w in win], color=line.get_color(),
                            linewidth=2, label=f"{key}: mean of the last {SMOOTH} steps "
                                               f"(fewer at the start)")
        ax.set_xlabel("step")
        ax.set_ylabel(self.ylabel)
        ax.set_title(self.run_dir.name)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
        fig.tight_layout()
        fig.savefig(self.png)
        plt.close(fig)
        if any(k.endswith("curriculum/in_band") for r in rows for k in r):
            plot_curriculum(rows, self.run_dir / "curriculum_curve.png")
        self._stale = False  # only once drawn: a draw cut short is drawn again at close

    def close(self) -> None:
        if self._stale:
            self.plot()
        self.tb.close()
        if self.wandb is not None:
            self.wandb.close([self.png])


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend, that backend's module loaded (a
    first figure would load it, C extension included)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.backends.backend_agg  # noqa: F401
    import matplotlib.pyplot as plt
    return plt


SMOOTH = 5  # steps in the reward curve's moving average
#: the least seconds between two redraws of a run's curve PNG (:class:`MetricsLogger`)
PLOT_EVERY_S = 30.0


def plot_curriculum(rows: list[dict], png: Path) -> None:
    """``data.curriculum=solve_rate``: the recent solve rate of each level, the share of
    groups inside the band and with reward variance, and the current level (right axis)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    found = {k for r in rows for k in r}
    keys = sorted(k for k in found if "curriculum/solve_rate_" in k)
    shares = sorted(k for k in found if k.endswith(("curriculum/in_band", "rollout/signal_groups")))
    for key in [*keys, *shares]:
        pts = [(r["step"], r[key]) for r in rows if key in r]
        ax.plot(*zip(*pts), marker="o", markersize=3, linewidth=1,
                linestyle="-" if key in keys else ":", label=key.replace("curriculum/", ""))
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("share")
    ax.set_ylim(-0.02, 1.02)
    levels = sorted(k for k in found if k.endswith("curriculum/level"))
    if levels:
        right = ax.twinx()
        for key, style in zip(levels, ("-", "--", "-.", ":")):
            right.step(*zip(*[(r["step"], r[key]) for r in rows if key in r]), where="post",
                       color="black", linestyle=style, linewidth=2,
                       label=key.replace("curriculum/", ""))
        top = max(r[k] for r in rows for k in levels if k in r)
        right.set_ylim(0.5, top + 0.5)
        right.set_yticks(range(1, int(top) + 1))
        right.set_ylabel("level")
        right.legend(loc="upper right", fontsize=8)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


class WandbSink:
    """One W&B run per run directory: its id is kept in ``run_dir/wandb_id`` so a resumed
    run continues it. Project from ``WANDB_PROJECT`` (default ``agentgym``), name from the
    run directory, config the resolved config."""

    COLUMNS = ["step", "rank", "env", "uid", "reward", "advantage", "em", "response"]

    def __init__(self, run_dir: Path, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError("logger=wandb needs the wandb package: pip install "
                              "-e '.[wandb]' in the checkout (or logger='' for JSONL/TensorBoard only)") from e
        self.wandb = wandb
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "agentgym"),
                              name=run_dir.name, id=run_id, resume="allow", config=config,
                              dir=str(run_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def samples(self, step: int, path: Path) -> None:
        table = self.wandb.Table(columns=self.COLUMNS)
        with open(path, encoding="utf-8") as f:
            for line in f:
                r = json.loads(line)
                response = "".join(s["text"] for s in r["segments"] if s["kind"] != "prompt")
                table.add_data(r["step"], r["rank"], r["env"], r["uid"], r["reward"],
                               r["advantage"], r["em"], response)
        self.run.log({"samples": table}, step=step)

    def close(self, pngs: list[Path]) -> None:
        images = {f"curves/{p.stem}": self.wandb.Image(str(p)) for p in pngs if p.exists()}
        if images:
            self.run.log(images)
        self.run.finish()
        self.wandb.teardown()  # the W&B service process ends with the run
