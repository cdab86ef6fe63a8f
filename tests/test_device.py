"""One device resolver (agentgym.core.device): its answers on this machine, and a walk over the
library code that fails on a device named anywhere else."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch

from agentgym.core import device as dev
from agentgym.config import build_config
from agentgym.core.overrides import parse_overrides

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("agentgym", "trainers", "envs", "tools", "retriever_server")
#: device names; "meta" (shape-only construction) is not a placement and stays allowed
NAMES = {"cpu", "cuda", "mps", "xpu", "npu", "hpu"}


def _named_devices(path: Path) -> list[str]:
    """``line: what`` for each place ``path`` names a device: a string literal that is a
    device ("cpu", "cuda", "cuda:1"), a ``torch.device(...)`` call (but ``"meta"``),
    ``.cuda(...)``, ``torch.cuda.*`` or ``.is_cuda``. ``torch.device`` as a type annotation
    names no device."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.split(":")[0] in NAMES:
                found.append(f"{node.lineno}: {node.value!r}")
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.device":
            if [ast.unparse(a) for a in node.args] != ["'meta'"]:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute):
            if ast.unparse(node) == "torch.cuda" or node.attr in ("cuda", "is_cuda"):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_device_named_outside_the_resolver():
    offenders = {}
    for package in LIBRARY:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "agentgym" / "core" / "device.py":
                continue
            if hits := _named_devices(path):
                offenders[str(path.relative_to(ROOT))] = hits
    assert not offenders, f"devices named outside agentgym/core/device.py: {offenders}"


def test_the_walk_sees_each_way_of_naming_a_device(tmp_path):
    """The check above can fail: each form it looks for is caught in a sample file."""
    sample = tmp_path / "sample.py"
    sample.write_text("import torch\n"
                      "a = torch.zeros(1, device='cpu')\n"
                      "b = torch.device(0)\n"
                      "c = a.cuda()\n"
                      "d = torch.cuda.is_available()\n"
                      "e = a.is_cuda\n"
                      "f = 'cuda:1'\n"
                      "g = torch.device('meta')\n")
    lines = sorted({int(h.split(":")[0]) for h in _named_devices(sample)})
    assert lines == [2, 3, 4, 5, 6, 7]  # not line 8: "meta" places nothing


def test_a_runs_device_is_resolved_in_one_place():
    """Code that needs the device a run's config names asks ``run_device(cfg)``; the resolver
    is called directly only where the device is another's: a loader given one, ``serve``'s
    own ``--device``, a rank process's local index."""
    callers = set()
    for package in LIBRARY:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(
                        "resolve_device") and path.name != "device.py":
                    callers.add(str(path.relative_to(ROOT)))
    assert callers == {"agentgym/models/zoo.py", "agentgym/serving/serve.py",
                       "trainers/backends/ranks.py"}
    cfg = build_config(parse_overrides(["trainer.device=cpu"]))
    assert dev.run_device(cfg) == torch.device("cpu")


def test_resolve_device_on_this_machine():
    cpu = torch.device("cpu")
    assert dev.resolve_device("cpu") == cpu
    if torch.cuda.is_available():
        assert dev.resolve_device("auto").type == "cuda"
        assert dev.resolve_device("cuda:0") == torch.device("cuda", 0)
        with pytest.raises(ValueError, match="cuda:99"):
            dev.resolve_device("cuda:99")
    else:
        assert dev.resolve_device("auto") == cpu
        assert dev.resolve_device("auto", local_rank=3) == cpu
        for spec in ("cuda", "cuda:0"):
            with pytest.raises(ValueError, match=r"no CUDA device.*trainer.device=auto or cpu"):
                dev.resolve_device(spec)


@pytest.mark.parametrize("bad", ["gpu", "CUDA", "cuda:", "cuda:x", "cpu:0", "", "tpu"])
def test_bad_device_names_the_value_and_the_valid_ones(bad):
    with pytest.raises(ValueError, match=r"trainer.device=.*valid: auto \| cpu \| cuda \| cuda:N"):
        dev.resolve_device(bad)
    with pytest.raises(ValueError, match="trainer.device"):
        build_config(parse_overrides([f"trainer.device={bad}"]))


def test_what_goes_with_the_device():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)  # no GPU needed to ask
    assert dev.engine_dtype("", "float32", cpu) == "float32"
    assert dev.engine_dtype("", "float32", gpu) == "bfloat16"
    assert dev.engine_dtype("float32", "float32", gpu) == "float32"  # set: kept
    assert dev.mixed_precision("", cpu) == "" and dev.mixed_precision("", gpu) == "bf16"
    assert dev.mixed_precision("fp32", gpu) == "" and dev.mixed_precision("bf16", cpu) == "bf16"
    with pytest.raises(ValueError, match="fp16"):
        dev.mixed_precision("fp16", cpu)
    assert dev.attn_implementation(cpu, "float32") is None
    assert dev.attn_implementation(gpu, "float32") == "sdpa"
    assert dev.attn_implementation(gpu, "bfloat16") in ("sdpa", "flash_attention_2")


@pytest.mark.parametrize("flags,warns", [((), True), (("avx512_bf16",), False),
                                          (None, False)])
def test_bf16_on_a_cpu_that_emulates_it_is_warned_once(monkeypatch, caplog, flags, warns):
    # the CPU's flags are injected: this machine's own are whatever it happens to be
    monkeypatch.setattr(dev, "cpu_bf16_flags", lambda: flags)
    monkeypatch.setattr(dev, "_WARNED_BF16", set())
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    with caplog.at_level("WARNING", logger=dev.__name__):
        assert dev.engine_dtype("bfloat16", "float32", cpu) == "bfloat16"
        assert dev.engine_dtype("bfloat16", "float32", cpu) == "bfloat16"
        assert dev.engine_dtype("", "bfloat16", cpu) == "bfloat16"
        assert dev.mixed_precision("bf16", cpu) == "bf16"
        dev.engine_dtype("bfloat16", "float32", gpu), dev.mixed_precision("bf16", gpu)
        dev.engine_dtype("", "float32", cpu), dev.mixed_precision("", cpu)
    named = [r.getMessage().split(" ")[0] for r in caplog.records]
    assert named == (["engine.dtype", "model.dtype", "trainer.mixed_precision"] if warns
                     else [])
    assert all("amx_bf16, avx512_bf16" in r.getMessage() for r in caplog.records)


def test_cpu_bf16_flags_read_this_machine():
    flags = dev.cpu_bf16_flags()
    if flags is None:
        pytest.skip("no flags line in /proc/cpuinfo here (not Linux x86)")
    line = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags"))
    assert set(flags) == set(dev.NATIVE_BF16_FLAGS) & set(line.split(":", 1)[1].split())


def test_models_load_where_the_resolver_says(tiny_path):
    from agentgym.models.zoo import load_model
    from agentgym.trainers.backends.base import ModelSpec
    expected = dev.resolve_device("auto")
    assert next(load_model(tiny_path).parameters()).device == expected
    assert next(ModelSpec(str(tiny_path)).load().parameters()).device == expected
    assert next(load_model(tiny_path, device="cpu").parameters()).device.type == "cpu"
    with pytest.raises(ValueError, match="trainer.device='gpu'"):
        load_model(tiny_path, device="gpu")


@pytest.mark.parametrize("offload", [False, True])
def test_the_kl_reference_follows_the_policy_or_is_offloaded(tiny_path, offload):
    from agentgym.trainers.reference import reference
    cfg = build_config(parse_overrides(["model.name=tiny", "algo.kl_coef=0.1",
                                        f"algo.ref_offload={str(offload).lower()}"]))
    ref = reference(cfg, tiny_path, backend=None)
    where = next(ref.model.parameters()).device
    assert where == (torch.device("cpu") if offload else dev.resolve_device("auto"))
    assert not any(p.requires_grad for p in ref.model.parameters())
    sharded = build_config(parse_overrides(["trainer.backend=fsdp", "algo.kl_coef=0.1"]))
    assert reference(sharded, tiny_path, backend="the ranks").backend == "the ranks"


def test_freed_memory_goes_back_to_the_system(monkeypatch):
    """glibc's thresholds are fixed (agentgym.core.memory); the user's own choice is kept."""
    import ctypes.util
    import sys

    from agentgym.core.memory import return_freed_memory
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    glibc = sys.platform.startswith("linux") and "musl" not in (ctypes.util.find_library("c") or "")
    assert return_freed_memory() is glibc
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert return_freed_memory() is False
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "65536")
    assert return_freed_memory() is False


_HEAP_PROBE = """
import ctypes
from agentgym.core.memory import give_back, return_freed_memory
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def step(mib):  # a step's blocks, under the mmap threshold: from the heap, touched, freed
    blocks = [libc.malloc(1 << 20) for _ in range(mib)]
    for b in blocks:
        ctypes.memset(b, 1, 1 << 20)
    held = rss()
    for b in blocks:
        libc.free(b)
    return held
assert return_freed_memory()
base = rss()
out = [base]
for mib in (256, 512, 256):  # a step, one that needs twice as much, the first again
    held = step(mib)
    freed = rss()
    given = give_back()
    out += [held, freed, rss(), given]
print(*out)
"""


def test_a_steps_freed_heap_is_kept_until_a_step_ends_above_what_a_step_needs():
    """Blocks under the mmap threshold come from the heap and stay in the process when
    freed, so the next step reuses them without faulting pages in again; give_back()
    returns them when a step ends above the RSS at which a step begun from a returned
    heap ended (here the step that needs twice as much), as the trainers call it at the
    end of every step."""
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _HEAP_PROBE], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    base, *steps = out.stdout.split()
    (held1, freed1, after1, given1), (held2, freed2, after2, given2), \
        (held3, freed3, after3, given3) = (steps[i:i + 4] for i in range(0, 12, 4))
    base, mib = int(base), 1 << 20
    assert int(held1) - base > 200 * mib  # touched: resident
    # the first step (a new process's heap counts as returned) sets the ceiling: kept
    assert given1 == "False" and int(after1) - base > 200 * mib
    # twice as much: its freed pages are above the ceiling and go back to the system
    assert int(freed2) - base > 450 * mib
    assert given2 == "True" and int(freed2) - int(after2) > 400 * mib
    # begun from a returned heap, no higher than the ceiling: kept for the next step
    assert int(held3) - int(after2) > 200 * mib and given3 == "False"
    assert int(after3) - int(after2) > 200 * mib


def test_the_keeper_returns_the_heap_when_a_step_ends_above_what_a_fresh_step_needed():
    """The policy alone (agentgym.core.memory.Keeper), in GiB of RSS at each step's end: a
    step begun from a returned heap raises the ceiling and keeps; a step begun from a kept
    heap returns it only above the ceiling."""
    from agentgym.core.memory import Keeper
    keeper = Keeper()
    ends = [9, 12, 11, 13, 10, 10.5, 12, 14, 15]
    assert [keeper.step_end(gib * 2**30) for gib in ends] == \
        [False, True, False, True, False, False, True, False, True]
    assert keeper.ceiling == 14 * 2**30
