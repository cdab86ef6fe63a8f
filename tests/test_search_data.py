"""The shipped search data (data/README.md): valid verl rows, disjoint splits, the corpus.

The rebuild checks read ../shared/data and are skipped where it is absent."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

from agentgym.envs.search_prompt import make_prompt

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
SHARED = ROOT.parent / "shared" / "data"
CORPUS = DATA / "corpus" / "wiki_passages.jsonl.gz"
TRAIN, EVAL = DATA / "search" / "train.jsonl", DATA / "search" / "nq_eval.jsonl"
HOTPOT = DATA / "search" / "hotpotqa_eval.jsonl"
needs_shared = pytest.mark.skipif(not (SHARED / "search").is_dir(),
                                  reason="../shared/data not available")


def norm(q: str) -> str:
    return " ".join(q.lower().split()).rstrip("?").strip()


def read(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def corpus() -> list[dict]:
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_files_exist_and_stay_small():
    sizes = {p: p.stat().st_size for p in (CORPUS, TRAIN, EVAL, HOTPOT, DATA / "README.md")}
    assert sum(sizes.values()) < 15e6, sizes


@pytest.mark.parametrize("path, split, n, sources", [
    (TRAIN, "train", 3000, {"nq": 2000, "hotpotqa": 1000}),
    (EVAL, "test", 500, {"nq": 500}),
    (HOTPOT, "test", 500, {"hotpotqa": 500}),
])
def test_rows_are_verl_search_rows(path, split, n, sources):
    rows = read(path)
    assert len(rows) == n
    counts: dict[str, int] = {}
    for i, row in enumerate(rows):
        assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info",
                            "env"}
        assert row["env"] == "search" and row["ability"] == "fact-reasoning"
        counts[row["data_source"]] = counts.get(row["data_source"], 0) + 1
        info = row["extra_info"]
        assert info["split"] == split and info["index"] == i
        assert row["prompt"] == [{"role": "user", "content": make_prompt(info["question"])}]
        assert row["reward_model"]["style"] == "rule"
        target = row["reward_model"]["ground_truth"]["target"]
        assert target and all(isinstance(a, str) and a.strip() for a in target)
    assert counts == sources


def test_train_and_eval_questions_are_disjoint():
    train = {norm(r["extra_info"]["question"]) for r in read(TRAIN)}
    evals = {norm(r["extra_info"]["question"]) for r in read(EVAL)}
    hotpot = {norm(r["extra_info"]["question"]) for r in read(HOTPOT)}
    assert len(train) == 3000 and len(evals) == 500 and len(hotpot) == 500  # no duplicates
    assert not train & evals and not train & hotpot


@needs_shared
def test_train_excludes_every_held_out_question():
    held_out = {norm(r["question"]) for r in read(SHARED / "search" / "nq_test_sub1000.jsonl")}
    held_out |= {norm(r["question"]) for r in read(SHARED / "search" / "hotpotqa_dev_500.jsonl")}
    assert not {norm(r["extra_info"]["question"]) for r in read(TRAIN)} & held_out
    first = read(SHARED / "search" / "nq_test_sub1000.jsonl")[:500]
    assert [(r["extra_info"]["id"], r["extra_info"]["question"]) for r in read(EVAL)] == \
        [(r["id"], r["question"]) for r in first]
    hotpot = read(SHARED / "search" / "hotpotqa_dev_500.jsonl")
    assert [(r["extra_info"]["question"], r["reward_model"]["ground_truth"]["target"])
            for r in read(HOTPOT)] == [(r["question"], [r["answer"]]) for r in hotpot]


def test_corpus_passages(corpus):
    assert len(corpus) == 21012
    assert len({d["id"] for d in corpus}) == 21012
    for d in corpus:
        assert list(d) == ["id", "title", "text", "contents"]
        assert d["contents"] == f'"{d["title"]}"\n{d["text"]}'


def test_eval_answers_are_mostly_in_the_corpus(corpus):
    text = "\n".join(d["contents"].lower() for d in corpus)
    rows = read(EVAL)
    found = sum(any(a.lower() in text for a in r["reward_model"]["ground_truth"]["target"])
                for r in rows)
    assert found / len(rows) > 0.7  # measured 0.80 (data/README.md)


@needs_shared
def test_rebuild_is_byte_identical(tmp_path):
    spec = importlib.util.spec_from_file_location("build_search_data",
                                                  ROOT / "scripts" / "build_search_data.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main([str(SHARED), "--out", str(tmp_path)])
    for rel in ("corpus/wiki_passages.jsonl.gz", "search/train.jsonl", "search/nq_eval.jsonl",
                "search/hotpotqa_eval.jsonl"):
        assert (tmp_path / rel).read_bytes() == (DATA / rel).read_bytes(), rel
