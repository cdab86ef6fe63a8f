"""make gpu-bundle (scripts/gpu_bundle.py): what the lent GPU machine's image lacks, in
calls that fit the device tool's 64 MiB with the working tree."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_bundle", ROOT / "scripts" / "gpu_bundle.py")
bundle = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bundle)


def test_the_bundle_carries_only_what_the_image_lacks():
    image = bundle.image_packages()
    assert {"torch", "transformers", "numpy", "tokenizers", "safetensors", "httpx"} <= image
    needed = bundle.closure(image)
    assert {"gymnasium", "bm25s", "fastapi", "uvicorn", "faiss-cpu", "math-verify",
            "gguf"} <= set(needed)
    assert not set(needed) & image  # nothing the machine has
    assert "starlette" in needed and "pydantic-core" in needed  # fastapi's, found by walking


def test_files_are_packed_into_calls_within_the_limit(tmp_path):
    sizes = [30, 20, 20, 10, 5, 1]
    files = []
    for k, size in enumerate(sizes):
        f = tmp_path / f"f{k}"
        f.write_bytes(b"x" * size)
        files.append(f)
    calls = bundle.pack(files, 40)
    assert sorted(f.name for c in calls for f in c) == sorted(f.name for f in files)
    assert all(sum(f.stat().st_size for f in c) <= 40 for c in calls)
    assert len(calls) == 3  # 86 bytes in calls of 40: first fit, largest first
    with pytest.raises(SystemExit, match="f0 is .* more than the .* a call has"):
        bundle.pack(files, 25)


def test_a_split_file_reassembles(tmp_path):
    data = bytes(range(256)) * 1000
    src = tmp_path / "model.gguf"
    src.write_bytes(data)
    parts = bundle.split(src, tmp_path / "parts", 100_000)
    assert [p.name for p in parts] == ["model.gguf.00", "model.gguf.01", "model.gguf.02"]
    assert b"".join(p.read_bytes() for p in sorted(parts)) == data


def test_the_gpu_check_runs_every_stage_in_its_cpu_smoke(tmp_path):
    """``scripts/gpu_check.py --cpu-smoke``: each stage a lent GPU would run (but the gpu
    tests), on the CPU with tiny shapes, so a stage's bug shows here and not on the GPU."""
    import subprocess
    import sys
    out = tmp_path / "GPU.md"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--cpu-smoke",
                           "--out", str(out), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    from agentgym.models.shapes import is_vision, shape_config, shape_names
    for name in shape_names():
        if not is_vision(shape_config(name)):
            assert f"random-init {name} " in text
    assert "generation, HF engine" in text and "update, tiny" in text
    assert "--cpu-smoke (not a GPU figure)" in text
    assert "## Engine speed against transformers' generate" in text  # the first stage
    assert "| smollm2-135m, float32 | multi-turn, 2 episodes x 2 turns |" in text
