"""bench/engine_speed.py's CPU mode end to end at toy sizes: both contenders run the same
workloads in one process and the table carries every row."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import engine_speed  # noqa: E402


def test_the_engine_benchmark_runs_both_workloads_on_the_cpu():
    args = engine_speed.parse(["--device", "cpu", "--batch", "3", "--episodes", "2",
                               "--turns", "2", "--new", "5", "--layers", "1",
                               "--dtype", "float32", "--out", "none"])
    body = engine_speed.run(args, "test")
    rows = [line for line in body.splitlines() if line.startswith("| smollm2-135m")]
    assert len(rows) == 2, body
    assert "single-turn, batch 3" in rows[0] and "multi-turn, 2 episodes x 2 turns" in rows[1]
    for row in rows:  # a ratio per row: both contenders produced tokens
        assert row.rstrip().endswith("x** |"), row
