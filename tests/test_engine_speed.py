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


def test_a_warm_up_twin_has_the_timed_shapes_and_none_of_its_prefixes():
    batch = engine_speed.prompts(16, 1000)
    twin = engine_speed.twins(batch, 1000)
    assert [len(p) for p in twin] == [len(p) for p in batch]
    assert all(t[0] != p[0] and all(100 <= i < 1000 for i in t) for t, p in zip(twin, batch))


def test_the_compiled_baseline_compiles_one_decode_step_for_every_turn(monkeypatch):
    """The static ``generate`` of a lockstep rollout (histories growing every turn, so each
    turn a longer prompt): its warm-up and its timed run, every turn of both, run one
    compiled decode step (dynamo's graphs counted by a backend that runs them eagerly; on
    the CPU, as transformers compiles only on CUDA unless told)."""
    import torch
    from transformers import CompileConfig

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    config = CompileConfig(backend=backend, dynamic=False, mode="default")
    config._compile_all_devices = True  # transformers' switch to compile off CUDA
    monkeypatch.setattr(engine_speed, "compile_config", lambda: config)
    torch._dynamo.reset()
    model = engine_speed.random_model("smollm2-135m", torch.float32, "cpu", layers=1)
    vocab = model.config.vocab_size
    episodes = engine_speed.prompts(2, vocab, seed=1)
    warm = engine_speed.twins(episodes, vocab)
    assert engine_speed.hf_turns(model, warm, 3, True, 0, vocab // 2) == 2 * 3 * 64
    assert len(graphs) == 1
    assert engine_speed.hf_turns(model, episodes, 3, True, 0) == 2 * 3 * 64
    assert len(graphs) == 1, "the timed run compiled again"
    torch._dynamo.reset()
