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


def test_files_are_packed_into_calls_within_the_limit():
    sizes = {f"f{k}": size for k, size in enumerate([30, 20, 20, 10, 5, 1])}
    calls = bundle.first_fit(sizes, 40)
    assert sorted(x for c in calls for x in c) == sorted(sizes)
    assert all(sum(sizes[x] for x in c) <= 40 for c in calls)
    assert len(calls) == 3  # 86 bytes in calls of 40: first fit, largest first
    with pytest.raises(SystemExit, match="f0 is .* more than the .* a call has"):
        bundle.first_fit(sizes, 25)


def test_a_split_file_reassembles(tmp_path):
    data = bytes(range(256)) * 1000
    src = tmp_path / "model.gguf"
    src.write_bytes(data)
    parts = bundle.split(src, tmp_path / "parts", 100_000)
    assert [p.name for p in parts] == ["model.gguf.00", "model.gguf.01", "model.gguf.02"]
    assert b"".join(p.read_bytes() for p in sorted(parts)) == data
    assert [p.stat().st_size for p in parts] == bundle.chunk_sizes(len(data), 100_000)


MiB = 2 ** 20
LIMIT = 64 * MiB  # the device tool's: the working tree and what a call carries, together
#: the wheels the bundle carried on 2026-11-27 (bytes), faiss-cpu the largest by far
WHEELS = {"faiss_cpu.whl": 18_834_180, "pydantic_core.whl": 2_264_846, "pydantic.whl": 494_865,
          "gymnasium.whl": 476_306, "latex2sympy2_extended.whl": 209_050,
          "fastapi.whl": 159_475, "antlr4_python3_runtime.whl": 144_462,
          "gguf.whl": 118_475, "uvicorn.whl": 87_427, "starlette.whl": 80_571,
          "bm25s.whl": 76_043, "opentelemetry_api.whl": 60_335, "math_verify.whl": 29_967,
          "typing_inspection.whl": 14_874, "annotated_types.whl": 13_427,
          "farama_notifications.whl": 2_897}
GGUF = 98_362_432  # SmolLM2-135M-Instruct.Q4_1.gguf


@pytest.mark.parametrize("tree_mib", [1, 10, 25.4, 30, 40, 44])
def test_every_call_with_the_tree_fits_the_limit(tree_mib):
    """The parts are sized from the measured tree: a 40 MiB model chunk (the old fixed
    size) beside a 30 MiB tree would be a 70 MiB call, which the device refuses."""
    tree = int(tree_mib * MiB)
    scripts = 1500
    room, chunk, calls = bundle.plan(WHEELS, "m.gguf", GGUF, tree, LIMIT, scripts=scripts)
    assert room == LIMIT - tree - scripts - bundle.MARGIN
    n = -(-GGUF // chunk)
    pieces = {f"m.gguf.{k:02d}": min(chunk, GGUF - k * chunk) for k in range(n)}
    assert sum(pieces.values()) == GGUF
    sizes = {**WHEELS, **pieces}
    assert sorted(x for c in calls for x in c) == sorted(sizes)  # each once, nothing else
    for call in calls:
        assert tree + sum(sizes[x] for x in call) + scripts + bundle.MARGIN <= LIMIT
    # no call is wasted: as few as the bytes allow, or one more (the wheels do not cut)
    assert len(calls) <= -(-sum(sizes.values()) // room) + 1


def test_the_chunk_follows_the_room_not_a_constant():
    small = bundle.plan(WHEELS, "m.gguf", GGUF, 30 * MiB)[1]
    large = bundle.plan(WHEELS, "m.gguf", GGUF, 5 * MiB)[1]
    assert small <= 64 * MiB - 30 * MiB - bundle.MARGIN < 40 * MiB
    assert small < large <= 64 * MiB - 5 * MiB - bundle.MARGIN


@pytest.mark.parametrize("tree_mib", [59.5, 64, 80])
def test_a_tree_that_leaves_too_little_room_is_refused(tree_mib):
    with pytest.raises(SystemExit, match=rf"the working tree is {tree_mib:.1f} MiB and a device "
                                         r"call carries at most 64 MiB.*make the tree smaller"
                                         r".*make gpu-bundle again"):
        bundle.plan(WHEELS, "m.gguf", GGUF, int(tree_mib * MiB))
    assert bundle.room_for(58 * MiB) == 5 * MiB  # 4 MiB is still worth a call
    # room enough for a call, not for the largest wheel (faiss-cpu, 18 MiB): refused too
    with pytest.raises(SystemExit, match=r"faiss_cpu.whl is 18.0 MiB, more than the 13.0 MiB"):
        bundle.plan(WHEELS, "m.gguf", GGUF, 50 * MiB)


def test_the_bundle_written_says_which_call_carries_what(tmp_path, monkeypatch):
    """main() end to end with a stand-in download, model and tree: every part on disk, with
    the scripts and the tree, within the limit, and README.md naming each part's files."""
    import agentgym.models.zoo as zoo

    def fake_download(pins, dest, python):
        dest.mkdir(parents=True, exist_ok=True)
        for name, size in [("big.whl", 3 * MiB), ("small.whl", 100_000)]:
            (dest / name).write_bytes(b"w" * size)

    gguf = tmp_path / zoo.SMOLLM2_GGUF
    data = bytes(range(256)) * (20 * MiB // 256)
    gguf.write_bytes(data)
    monkeypatch.setattr(bundle, "closure", lambda image: {"big": "1", "small": "1"})
    monkeypatch.setattr(bundle, "download", fake_download)
    monkeypatch.setattr(bundle, "tree_bytes", lambda: 6 * MiB)
    monkeypatch.setattr(zoo, "smollm2_gguf_path", lambda: gguf)
    out = tmp_path / "bundle"
    bundle.main(["--out", str(out), "--limit-mib", "16"])
    scripts = sum((out / s).stat().st_size for s in ("install.sh", "stash.sh"))
    parts = sorted(out.glob("part-*"))
    readme = (out / "README.md").read_text()
    assert readme.startswith(f"# gpu-bundle: {len(parts)} calls, then the check")
    for k, part in enumerate(parts, 1):
        files = sorted(f.name for f in part.iterdir())
        assert 6 * MiB + sum(f.stat().st_size for f in part.iterdir()) + scripts <= 16 * MiB
        assert f"{k}. carry `gpu-bundle/part-{k:02d}`" in readme
        assert f"`sh gpu-bundle/stash.sh {k:02d}` ({', '.join(files)})" in readme
    chunks = sorted(f for p in parts for f in p.iterdir() if f.name.startswith(gguf.name))
    assert b"".join(f.read_bytes() for f in chunks) == data
    assert {f.name for p in parts for f in p.iterdir()} >= {"big.whl", "small.whl"}
    assert "while it is at most" in readme and not (out / "files").exists()
    monkeypatch.setattr(bundle, "tree_bytes", lambda: 15 * MiB)
    with pytest.raises(SystemExit, match="the working tree is 15.0 MiB"):
        bundle.main(["--out", str(tmp_path / "b2"), "--limit-mib", "16"])


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
    assert "## Update speed: packed against padded" in text and "| trl | 4,096 | 4 |" in text
    assert "| smollm2-135m, float32 | multi-turn, 2 episodes x 2 turns |" in text
