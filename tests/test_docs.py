"""The docs' commands are checked against the code (scripts/check_docs.py): every shell
command in README.md, docs/ENVS.md, docs/ECOSYSTEM.md, docs/decisions/*.md and the recipes'
headers parses, its keys resolve, its paths exist or an earlier command writes them; the
cheap ones run. docs/DECISIONS.md's split into docs/decisions/ kept every heading."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_docs.py"
#: every heading of docs/DECISIONS.md at d018375, before it was split into one file per
#: area under docs/decisions/ (``git show d018375:docs/DECISIONS.md | grep -E '^#{2,3} '``)
DECISIONS_HEADINGS = Path(__file__).resolve().parent / "data" / "decisions_headings.txt"
DECISIONS_MAX_LINES = 600


def _check(*args: str, report: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--report", str(report), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)


def test_every_documented_command_checks_and_the_cheap_ones_run(tmp_path):
    done = _check("--run", report=tmp_path / "report.json")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["problems"] == [], "\n".join(report["problems"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert report["commands"] >= 150  # the README alone shows over a hundred
    # config, check-env, index build on the shipped corpus and a tiny train ran for real
    assert {k for k, v in report["ran"].items() if v >= 1} >= {
        "config", "check-env", "index", "plan", "sandbox", "train"}, report["ran"]


def test_a_readme_command_naming_a_key_that_does_not_exist_fails(tmp_path):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first_block = readme.index("```bash\n") + len("```bash\n")
    bad = readme[:first_block] + "agentgym train env=search trainer.lrr=1e-6\n" + \
        readme[first_block:]
    (tmp_path / "README.md").write_text(bad, encoding="utf-8")
    line = bad[:first_block].count("\n") + 1
    done = _check("--docs", str(tmp_path / "README.md"), report=tmp_path / "report.json")
    problems = json.loads((tmp_path / "report.json").read_text())["problems"]
    assert done.returncode == 1
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{tmp_path / 'README.md'}:{line}: agentgym train "
                                  f"env=search trainer.lrr=1e-6: does not resolve: "
                                  f"unknown config key 'trainer.lrr'"), problems
    assert "did you mean 'trainer.lr'" in problems[0]
    # the same file without the line passes: the failure is that key's
    (tmp_path / "README.md").write_text(readme, encoding="utf-8")
    assert _check("--docs", str(tmp_path / "README.md"),
                  report=tmp_path / "report.json").returncode == 0


STALE = """\
# A page with one stale command of each kind

```bash
agentgym trian env=search
agentgym eval env=search data=data/search/gone.jsonl
agentgym rollout env=search model=tiny limit=2 out=t.jsonl
agentgym inspect t.jsonl
agentgym inspect t2.jsonl
agentgym index build --corpus data/corpus/wiki_passages.jsonl.gz --method bm26 --out x
make tset
pip install -e '.[wandbb]'
python bench/engine_speed.py --no-such-flag
pytest -m sloww tests/test_envs.py
agentgym train env=search agent=examples.search_agent:gone
agentgym train env=search trainer.cold_start=runs/none
agentgym sft env=search data=t.jsonl run_dir=runs/s
agentgym train env=search trainer.cold_start=runs/s
```

Prose: `agentgym eval env=search lmit=5` and `agentgym inspect traj.jsonl`.
"""


def test_each_kind_of_stale_command_is_found_and_nothing_else(tmp_path):
    (tmp_path / "page.md").write_text(STALE, encoding="utf-8")
    done = _check("--docs", str(tmp_path / "page.md"), report=tmp_path / "report.json")
    problems = json.loads((tmp_path / "report.json").read_text())["problems"]
    assert done.returncode == 1
    found = {int(p.split(":")[1]): p for p in problems}
    assert len(found) == len(problems), problems  # one problem per stale line
    expected = {
        4: "no subcommand 'trian'",
        5: "data= 'data/search/gone.jsonl' does not exist",
        8: "the path 't2.jsonl' does not exist",
        9: "argument --method: invalid choice: 'bm26'",
        10: "the Makefile has no target 'tset'",
        11: "pyproject.toml has no extra 'wandbb'",
        12: "bench/engine_speed.py has no flag --no-such-flag",
        13: "marker 'sloww' is not registered",
        14: "agent=examples.search_agent:gone: AttributeError",
        15: "trainer.cold_start= 'runs/none' does not exist",
        20: "unknown config key 'lmit'",
    }
    assert sorted(found) == sorted(expected), problems
    for line, what in expected.items():
        assert what in found[line], found[line]


def test_the_first_screen_shows_the_three_uses_and_installs_nobody_elses_package():
    first = "\n".join((ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:60])
    for command in ("agentgym serve-retriever --corpus", "agentgym train env=search",
                    "pytest tests/test_envs.py", "make demo", "make test"):
        assert command in first, command
    # PyPI's `agentgym` is another project: every install line, in the docs and in the
    # errors that name a missing extra, installs this checkout
    code = [p for d in ("agentgym", "envs", "tools", "trainers", "retriever_server", "bench",
                        "scripts") for p in sorted((ROOT / d).rglob("*.py"))]
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
                 *sorted((ROOT / "docs" / "decisions").glob("*.md")), *code]:
        text = page.read_text(encoding="utf-8")
        assert not re.search(r"pip install '?agentgym(?![\w-])", text), page


def test_every_old_decisions_heading_is_in_exactly_one_area_file_and_none_is_long():
    """Code and docs cite docs/DECISIONS.md's sections by heading, so the split by area
    (issue 79) keeps each heading, word for word, in one docs/decisions/ file; a file stays
    short enough to read (its "In force" first, then the history)."""
    files = sorted((ROOT / "docs" / "decisions").glob("*.md"))
    assert files, "no docs/decisions/*.md"
    lines = {f.name: f.read_text(encoding="utf-8").splitlines() for f in files}
    old = DECISIONS_HEADINGS.read_text(encoding="utf-8").splitlines()
    assert len(old) >= 50, len(old)
    for heading in old:
        holders = [name for name, text in lines.items() for line in text
                   if line.rstrip() == heading]
        assert len(holders) == 1, (heading, holders)
    for name, text in lines.items():
        assert len(text) <= DECISIONS_MAX_LINES, (name, len(text))
        assert "## In force" in text, name
    index = (ROOT / "docs" / "DECISIONS.md").read_text(encoding="utf-8")
    assert len(index.splitlines()) <= 60, "docs/DECISIONS.md is the index of the area files"
    for name in lines:
        assert f"(decisions/{name})" in index, name
