"""One installed namespace: a wheel built from the repository adds the import name
``agentgym`` and nothing else at the top level; the repository's folders ``envs/``,
``tools/``, ``trainers/`` and ``retriever_server/`` are its subpackages there, and in a
checkout (:mod:`agentgym._layout` finds them beside ``agentgym/``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("agentgym", "envs", "tools", "trainers", "retriever_server")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out, src = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("src")
    tracked = subprocess.run(["git", "ls-files", *FOLDERS, "pyproject.toml", "README.md"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for rel in tracked:  # built from a copy: setuptools leaves build/ where it builds
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(src)], check=True,
                   capture_output=True, text=True)
    (whl,) = out.glob("agentgym_rl-*.whl")  # the distribution agentgym-rl
    return whl


def _installed_path(path: Path) -> str:
    rel = path.relative_to(ROOT).as_posix()
    return rel if rel.startswith("agentgym/") else f"agentgym/{rel}"


def test_the_wheel_holds_one_top_level_package_and_every_module(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"agentgym"}, tops
    tracked = subprocess.run(["git", "ls-files", *FOLDERS], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    modules = [ROOT / p for p in tracked if p.endswith(".py")]
    assert len(modules) > 100
    missing = [str(p.relative_to(ROOT)) for p in modules if _installed_path(p) not in names]
    assert missing == []  # a new subpackage must be listed in pyproject's packages
    assert "agentgym/reporting/inspector.html" in names


def test_the_installed_wheel_imports_under_agentgym_alone(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(target), str(wheel)], check=True, capture_output=True)
    tops = {p.name for p in target.iterdir() if not p.name.endswith(".dist-info")}
    assert tops - {"bin"} == {"agentgym"}, tops  # bin/: the console script
    code = textwrap.dedent("""
        import agentgym.envs, agentgym.trainers, agentgym.tools.sandbox
        import agentgym.retriever_server.schema
        for m in (agentgym, agentgym.envs, agentgym.trainers, agentgym.tools.sandbox,
                  agentgym.retriever_server.schema):
            assert m.__file__.startswith(TARGET), m.__file__
        assert "agentgym/Search-v0" in agentgym.envs.env_ids()
        print("installed ok")
    """).replace("TARGET", repr(str(target)))
    env = {**os.environ, "PYTHONPATH": str(target)}  # before site-packages' editable finder
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "installed ok" in out.stdout


def test_in_a_checkout_the_folders_are_agentgym_subpackages():
    code = textwrap.dedent("""
        import agentgym.envs.search, agentgym.trainers.loop, agentgym.tools.sandbox
        import agentgym.retriever_server.schema
        for m in (agentgym.envs.search, agentgym.trainers.loop, agentgym.tools.sandbox,
                  agentgym.retriever_server.schema):
            print(m.__name__, m.__file__)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    files = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert files == {
        "agentgym.envs.search": str(ROOT / "envs" / "search.py"),
        "agentgym.trainers.loop": str(ROOT / "trainers" / "loop.py"),
        "agentgym.tools.sandbox": str(ROOT / "tools" / "sandbox.py"),
        "agentgym.retriever_server.schema": str(ROOT / "retriever_server" / "schema.py")}
