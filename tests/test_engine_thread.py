"""bench/engine_thread.py end to end at toy sizes: both modes run in their own processes,
alternated, and the table compares them."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import engine_thread  # noqa: E402


def test_the_thread_benchmark_runs_both_modes_in_processes():
    body = engine_thread.main(["--batch", "2", "--new", "3", "--updates", "1", "--reps", "2",
                               "--pairs", "1", "--layers", "1", "--out", "none"])
    rows = [line for line in body.splitlines() if line.startswith("| own thread")
            or line.startswith("| trainer's thread")]
    assert len(rows) == 2, body
    for row in rows:  # one measured step per process (the warm-up left out)
        assert row.rstrip().endswith("| 1 |"), row
    assert "rollout **" in body and "update **" in body
