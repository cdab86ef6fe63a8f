"""``make gpu-bundle``: what the lent GPU machine lacks, packed into device calls of at most
64 MiB each (the working tree travels with every call).

The machine (docs/GPU.md; the device tool's KINDS.md) runs Python 3.12 with torch 2.11 and
transformers 5.17 and has no network. This writes the git-ignored folder ``gpu-bundle/``:

* ``wheels``: the project's runtime dependencies that the machine's image lacks
  (:data:`IMAGE_FILE` lists the image's packages), found by walking the requirements of
  the packages installed here from ``pyproject.toml``'s dependencies, never descending
  into a package the image has; each downloaded for CPython 3.12 manylinux x86-64 at the
  version installed here (the newest such wheel when that version has none);
* ``model``: smollm2-135m's GGUF (98 MB; the zoo converts it there, as here), in chunks;
* ``part-NN/``: the files packed into calls (first fit, largest first), each call's carry
  within the limit together with the working tree, measured on every run (:func:`plan`:
  a part's room, and so the model's chunks, is the limit less the tree, the scripts and
  :data:`MARGIN`; too little room is refused); ``stash.sh`` moves a part into
  ``.gpu-store/`` (ignored, kept while the machine stays warm), ``install.sh`` installs the
  wheels with ``--no-index`` and reassembles the model, and ``README.md`` says which call
  carries what, in order.

It prints the plan with sizes and refuses to write a call over the limit.

    python scripts/gpu_bundle.py                  # gpu-bundle/ for the device (py3.12)
    python scripts/gpu_bundle.py --python 3.11 --out /tmp/b   # for this machine's Python
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MiB = 2 ** 20
LIMIT = 64 * MiB
#: the packages of the machine's image ("cuda"), one name per line (KINDS.md, 2026-11-17)
IMAGE_FILE = ROOT / "scripts" / "gpu_image.txt"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
#: kept spare in every call: the tree grows with edits between the bundle and its calls
MARGIN = MiB
#: less room than this beside the tree is not worth a bundle: refused, with what to do
MIN_ROOM = 4 * MiB


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> set[str]:
    lines = IMAGE_FILE.read_text(encoding="utf-8").splitlines()
    return {canon(x.split("==")[0]) for x in lines if x.strip() and not x.startswith("#")}


def _requirement_names(reqs: list[str]) -> list[str]:
    out = []
    for req in reqs:
        if ";" in req and "extra ==" in req.split(";", 1)[1]:
            continue  # an optional extra's requirement
        if ";" in req:
            from packaging.markers import Marker
            if not Marker(req.split(";", 1)[1]).evaluate({"python_version": "3.12"}):
                continue
        out.append(canon(re.split(r"[\s<>=!~\[;(]", req.strip(), maxsplit=1)[0]))
    return out


def closure(image: set[str]) -> dict[str, str]:
    """name -> installed version of every runtime dependency the image lacks."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        todo = _requirement_names(tomllib.load(f)["project"]["dependencies"])
    found: dict[str, str] = {}
    while todo:
        name = todo.pop()
        if name in image or name in found:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise SystemExit(f"{name} is required but not installed here: run make install first")
        found[name] = dist.version
        todo += _requirement_names(dist.requires or [])
    return found


def download(pins: dict[str, str], dest: Path, python: str) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
            "--python-version", python, "--implementation", "cp", "-d", str(dest)]
    for p in PLATFORMS:
        base += ["--platform", p]
    for name, version in sorted(pins.items()):
        if subprocess.run(base + [f"{name}=={version}"], capture_output=True).returncode:
            print(f"  {name}=={version}: no wheel for Python {python}; taking the newest")
            subprocess.run(base + [name], check=True, capture_output=True)


def split(path: Path, dest: Path, chunk: int) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    parts = []
    with open(path, "rb") as f:
        for k, data in enumerate(iter(lambda: f.read(chunk), b"")):
            out = dest / f"{path.name}.{k:02d}"
            out.write_bytes(data)
            parts.append(out)
    return parts


def tree_bytes() -> int:
    """What travels with every call: tracked files and untracked ones git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, check=True, capture_output=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names
               if n and (ROOT / n.decode()).is_file())


def first_fit(sizes: dict[str, int], room: int) -> list[list[str]]:
    """Names into calls of ``room`` bytes, first fit, largest first; an oversized one is an
    error."""
    calls: list[list[str]] = []
    used: list[int] = []
    for name, size in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        if size > room:
            raise SystemExit(f"{name} is {size / MiB:.1f} MiB, more than the {room / MiB:.1f} "
                             f"MiB a call has beside the working tree: refusing (a smaller "
                             f"tree leaves more; then run make gpu-bundle again)")
        k = next((i for i, u in enumerate(used) if u + size <= room), None)
        if k is None:
            calls.append([])
            used.append(0)
            k = len(calls) - 1
        calls[k].append(name)
        used[k] += size
    return calls


def room_for(tree: int, limit: int = LIMIT, margin: int = MARGIN, scripts: int = 0) -> int:
    """What a call has for its part: the limit less the working tree (measured, it travels
    with every call), the scripts a call carries beside its part, and ``margin``. Under
    :data:`MIN_ROOM` it is refused, with the sizes and what to do."""
    room = limit - tree - scripts - margin
    if room < MIN_ROOM:
        raise SystemExit(
            f"the working tree is {tree / MiB:.1f} MiB and a device call carries at most "
            f"{limit / MiB:g} MiB: with {margin / MiB:g} MiB kept spare that leaves "
            f"{room / MiB:.1f} MiB for the bundle's files, under the {MIN_ROOM / MiB:g} MiB "
            f"worth a call; make the tree smaller (`git ls-files -z --cached --others "
            f"--exclude-standard | xargs -0 du -b | sort -n | tail` lists its largest files: "
            f"git-ignore or remove the untracked ones, move large data out of git) and run "
            f"make gpu-bundle again")
    return room


def chunk_sizes(total: int, chunk: int) -> list[int]:
    """The sizes :func:`split` gives a file of ``total`` bytes cut every ``chunk`` bytes."""
    return [chunk] * (total // chunk) + ([total % chunk] if total % chunk else [])


def plan(sizes: dict[str, int], model: str, model_bytes: int, tree: int, limit: int = LIMIT,
         margin: int = MARGIN, scripts: int = 0) -> tuple[int, int, list[list[str]]]:
    """``(room, chunk, calls)``: each call a list of names (the wheels of ``sizes`` and the
    model's chunks, ``MODEL.00``...) whose bytes with the tree, the scripts and the margin
    fit in ``limit``. The chunk is the whole room, or the model cut in equal pieces (as few
    as fit, or one or two more), whichever packs into the fewest calls, then leaves the
    largest part smallest (the tree can grow most before the bundle must be rebuilt), then
    cuts the fewest chunks."""
    room = room_for(tree, limit, margin, scripts)
    least = -(-model_bytes // room)
    candidates = [room] + [-(-model_bytes // n) for n in range(least, least + 3)]
    best = None
    for chunk in dict.fromkeys(candidates):
        pieces = {f"{model}.{k:02d}": b for k, b in enumerate(chunk_sizes(model_bytes, chunk))}
        every = {**sizes, **pieces}
        calls = first_fit(every, room)
        key = (len(calls), max(sum(every[x] for x in c) for c in calls), len(pieces))
        if best is None or key < best[0]:
            best = (key, chunk, calls)
    return room, best[1], best[2]


INSTALL = """#!/bin/sh
# Install what the calls stashed in .gpu-store/ (no network): the wheels into /tmp/site,
# smollm2-135m's GGUF reassembled. Source it: `. gpu-bundle/install.sh`.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
    --target /tmp/site .gpu-store/*.whl
export PYTHONPATH=/tmp/site:$PWD
mkdir -p .gpu-store/model && cat .gpu-store/{gguf}.* > .gpu-store/model/{gguf}
export AGENTGYM_SMOLLM2_GGUF=$PWD/.gpu-store/model/{gguf}
python3 -c "import agentgym, envs, trainers; print('agentgym imports')"
"""
STASH = """#!/bin/sh
# Keep one part's files between calls (ignored: the tree's next copy does not remove them).
set -e
mkdir -p .gpu-store && cp gpu-bundle/part-$1/* .gpu-store/ && ls .gpu-store | wc -l
"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "gpu-bundle")
    ap.add_argument("--python", default="3.12", help="the machine's Python (default 3.12)")
    ap.add_argument("--limit-mib", type=float, default=LIMIT / MiB)
    a = ap.parse_args(argv)
    from agentgym.models.zoo import SMOLLM2_GGUF, smollm2_gguf_path
    install = INSTALL.replace("{gguf}", SMOLLM2_GGUF)
    scripts = len(install.encode()) + len(STASH.encode())  # carried with every part
    limit = int(a.limit_mib * MiB)
    tree = tree_bytes()
    room_for(tree, limit, scripts=scripts)  # a tree too large is refused before any download
    shutil.rmtree(a.out, ignore_errors=True)
    store = a.out / "files"
    pins = closure(image_packages())
    print(f"{len(pins)} packages the image lacks: "
          + ", ".join(f"{n}=={v}" for n, v in sorted(pins.items())))
    download(pins, store, a.python)
    wheels = sorted(store.glob("*.whl"))
    gguf = smollm2_gguf_path()
    room, chunk, names = plan({f.name: f.stat().st_size for f in wheels}, gguf.name,
                              gguf.stat().st_size, tree, limit, scripts=scripts)
    by_name = {f.name: f for f in wheels + split(gguf, store, chunk)}
    calls = [[by_name[n] for n in call] for call in names]
    n_chunks = len(chunk_sizes(gguf.stat().st_size, chunk))
    print(f"working tree {tree / MiB:.1f} MiB, limit {limit / MiB:g} MiB, "
          f"{MARGIN / MiB:g} MiB spare, scripts {scripts / 1024:.1f} KiB: {room / MiB:.1f} "
          f"MiB a part; {gguf.name} ({gguf.stat().st_size / MiB:.1f} MiB) in {n_chunks} "
          f"chunks of at most {chunk / MiB:.1f} MiB; {len(calls)} calls")
    readme = [f"# gpu-bundle: {len(calls)} calls, then the check", "",
              f"Every call carries the working tree ({tree / MiB:.1f} MiB when this was "
              f"written) and one part (at most {room / MiB:.1f} MiB), in calls that follow "
              f"each other within the machine's warm time:", ""]
    largest = 0
    for k, call in enumerate(calls, 1):
        part = a.out / f"part-{k:02d}"
        part.mkdir(parents=True)
        for f in call:
            shutil.move(str(f), part / f.name)
        size = sum(f.stat().st_size for f in part.iterdir())
        total = tree + size + scripts
        if total > limit:
            raise SystemExit(f"call {k} would carry {total / MiB:.1f} MiB: refusing")
        largest = max(largest, size + scripts)
        readme.append(f"{k}. carry `gpu-bundle/part-{k:02d}`, `gpu-bundle/stash.sh`, "
                      f"`gpu-bundle/install.sh` ({(size + scripts) / MiB:.1f} MiB; with the "
                      f"tree {total / MiB:.1f} MiB): `sh gpu-bundle/stash.sh {k:02d}` "
                      f"({', '.join(sorted(p.name for p in part.iterdir()))})")
        print(f"call {k}: {total / MiB:5.1f} MiB ({size / MiB:.1f} part + {scripts / 1024:.1f} "
              f"KiB scripts + {tree / MiB:.1f} tree)")
    shutil.rmtree(store)
    bound = (limit - largest) // (MiB // 10) / 10  # rounded down: the README never overstates
    readme += ["", f"The parts were sized for this tree: while it is at most {bound:.1f} MiB "
               f"every call fits the {limit / MiB:g} MiB; "
               f"past that, run `make gpu-bundle` again (it measures the tree each time).",
               "", "gpu-bundle/ is ignored: its scripts travel only when a call carries them.",
               "", f"{len(calls) + 1}. `. gpu-bundle/install.sh && make gpu-check "
               f"GPU_CHECK_ARGS=\"--out $OUT/GPU.md\"` (carry the scripts again; the parts "
               f"are in .gpu-store/; no venv is built there; GPU.md is rewritten under $OUT "
               f"after every stage). It can share the last call: `sh gpu-bundle/stash.sh "
               f"{len(calls):02d} && . gpu-bundle/install.sh && set +e; timeout 565 make "
               f"gpu-check GPU_CHECK_ARGS=\"--out $OUT/GPU.md\"` keeps a call inside its 10 "
               f"minutes (the whole check needs more: docs/GPU.md)."]
    (a.out / "README.md").write_text("\n".join(readme) + "\n")
    (a.out / "install.sh").write_text(install)
    (a.out / "stash.sh").write_text(STASH)
    print(f"wrote {a.out} ({len(calls)} calls of at most {a.limit_mib:g} MiB; README.md says "
          f"which carries what)")


if __name__ == "__main__":
    main()
