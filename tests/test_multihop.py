"""Multi-hop search (issue 47): the shipped HotpotQA data (data/README.md, "multihop/"),
the multihop corpus served by a real local BM25 server, two-search demonstrations and the
hop reward."""

from __future__ import annotations

import gzip
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from agentgym.envs.multihop import doc_title, gold_hits, gold_paragraphs, hop_order
from agentgym.envs.search_prompt import make_prompt

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
MULTI = DATA / "multihop"
TRAIN, TEST = MULTI / "train.jsonl.gz", MULTI / "test.jsonl"


def read(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def norm(q: str) -> str:
    return " ".join(q.lower().split()).rstrip("?").strip()


def pair(row: dict) -> frozenset:
    return frozenset(g["title"] for g in row["extra_info"]["gold_paragraphs"])


@pytest.fixture(scope="module")
def train() -> list[dict]:
    return read(TRAIN)


@pytest.fixture(scope="module")
def test_rows() -> list[dict]:
    return read(TEST)


@pytest.fixture(scope="module")
def multihop_url():
    """A real local BM25 server over ``retriever.corpus=multihop`` (index cached on disk)."""
    from agentgym.core.paths import shipped_corpus
    from agentgym.tools.local_retriever import LocalRetriever
    with LocalRetriever(shipped_corpus("multihop")) as r:
        yield r.url


def test_files_exist_and_stay_small():
    sizes = {p.name: p.stat().st_size for p in MULTI.iterdir()}
    assert set(sizes) == {"corpus.jsonl.gz", "questions.jsonl.gz", "train.jsonl.gz",
                          "test.jsonl"}
    assert sum(sizes.values()) < 8e6, sizes


def test_rows_are_tagged_two_hop_search_rows(train, test_rows):
    assert len(test_rows) == 500 and len(train) > 1000
    for rows, split in ((train, "train"), (test_rows, "test")):
        for i, row in enumerate(rows):
            info = row["extra_info"]
            assert row["env"] == "search" and row["data_source"] == "hotpotqa"
            assert row["prompt"] == [{"role": "user", "content": make_prompt(info["question"])}]
            assert info["split"] == split and info["index"] == i and info["hops"] == 2
            assert info["type"] in ("bridge", "comparison")
            assert len(gold_paragraphs(row)) == 2 and all(g["id"] and g["title"]
                                                          for g in gold_paragraphs(row))
            assert row["reward_model"]["ground_truth"]["target"][0].strip()
            assert info["bridge"] is None or info["type"] == "bridge"
    assert not any(r["extra_info"].get("type_inferred") for r in test_rows)
    assert {r["extra_info"]["type"] for r in test_rows} == {"bridge", "comparison"}


def test_training_is_disjoint_from_every_heldout_set(train, test_rows):
    """By question (multihop_test, data=hotpotqa) and by gold-paragraph pair
    (multihop_test); multihop_test shares no question with data=train either."""
    hotpot_eval = {norm(r["extra_info"]["question"]) for r in read(DATA / "search" /
                                                                  "hotpotqa_eval.jsonl")}
    search_train = {norm(r["extra_info"]["question"]) for r in read(DATA / "search" /
                                                                   "train.jsonl")}
    tq = [norm(r["extra_info"]["question"]) for r in train]
    held = {norm(r["extra_info"]["question"]) for r in test_rows}
    assert len(set(tq)) == len(tq)
    assert not set(tq) & held and not set(tq) & hotpot_eval
    assert not held & search_train and not held & hotpot_eval
    assert not {pair(r) for r in train} & {pair(r) for r in test_rows}


def test_every_gold_paragraph_is_in_the_served_corpus(train, test_rows):
    from agentgym.core.paths import shipped_corpus
    titles = {d["id"]: d["title"] for d in read(shipped_corpus("multihop"))}
    for row in train + test_rows:
        for g in gold_paragraphs(row):
            assert titles.get(g["id"]) == g["title"], (row["extra_info"]["id"], g)


def test_the_split_rebuilds_to_the_same_bytes(tmp_path):
    """Stage 2 of scripts/build_multihop_data.py (from the shipped questions and corpus)."""
    spec = importlib.util.spec_from_file_location("build_multihop",
                                                  ROOT / "scripts" / "build_multihop_data.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    for name in ("questions.jsonl.gz", "corpus.jsonl.gz"):
        shutil.copy(MULTI / name, tmp_path / name)
    build.split_rows(tmp_path)
    for name in ("train.jsonl.gz", "test.jsonl"):
        assert (tmp_path / name).read_bytes() == (MULTI / name).read_bytes(), name
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / build.SOURCES[0][0]).write_text("[]")
    with pytest.raises(SystemExit, match="missing"):
        build.check_sources(tmp_path / "raw")


def test_hop_order_puts_the_bridge_second_and_finds_its_phrase():
    q = ("What government position was held by the woman who portrayed Corliss Archer in "
         "the film Kiss and Tell?")
    golds = [("Shirley Temple", "Shirley Temple Black was an American actress and diplomat."),
             ("Kiss and Tell (1945 film)", "Kiss and Tell is a 1945 American comedy film "
                                           "starring Shirley Temple as Corliss Archer.")]
    assert hop_order(q, "bridge", golds) == ([1, 0], "Shirley Temple")
    assert hop_order("Were Scott Derrickson and Ed Wood of the same nationality?", "comparison",
                     [("Scott Derrickson", "a director"), ("Ed Wood", "a filmmaker")]) == \
        ([0, 1], None)
    with pytest.raises(ValueError, match="2 gold paragraphs"):
        hop_order(q, "bridge", golds[:1])


def test_gold_hits_match_by_id_or_title():
    golds = [{"id": "hp-1", "title": "Ed Wood"}, {"id": "hp-2", "title": "Scott Derrickson"}]
    docs = [{"id": "7", "contents": '"Scott Derrickson"\nAn American director.'},
            {"id": "hp-1", "contents": '"Ed Wood (film)"\nA 1994 film.'}]
    assert doc_title(docs[0]["contents"]) == "Scott Derrickson"
    assert gold_hits(docs, golds) == [0, 1]
    assert gold_hits(docs[:1], golds[:1]) == []
    with pytest.raises(ValueError, match="gold_paragraphs"):
        gold_paragraphs({"extra_info": {"id": "x", "gold_paragraphs": [{"text": "no id"}]}})


def _bridge_case(train, url):
    """A training bridge row whose question search brings only the first hop and whose
    bridge phrase brings the second (found by playing the env, hop reward off)."""
    from agentgym.envs.search import SearchEnv
    env = SearchEnv(retriever_url=url)
    try:
        for row in train:
            info = row["extra_info"]
            if info["type"] != "bridge" or not info["bridge"]:
                continue
            env.reset(seed=0, options={"row": row})
            first = env.step(f"<search> {info['question']} </search>")[4].get("gold_hits")
            second = env.step(f"<search> {info['bridge']} </search>")[4].get("gold_hits")
            if first == [0] and second and 1 in second:
                return row
    finally:
        env.close()
    raise AssertionError("no training bridge row reaches both hops one by one")


def test_hop_reward_pays_once_per_new_gold_paragraph(train, multihop_url):
    """``search.hop_reward``: off by default; on, a search earns it per gold paragraph it
    brings first (a repeated search earns nothing), on both protocols; the outcome reward
    stays the answer's; one-hop rows never earn it."""
    from agentgym.envs.search import SearchEnv, search_row
    row = _bridge_case(train, multihop_url)
    info = row["extra_info"]
    ask, bridge = f"<search> {info['question']} </search>", f"<search> {info['bridge']} </search>"
    answer = f"<answer> {row['reward_model']['ground_truth']['target'][0]} </answer>"
    env = SearchEnv(retriever_url=multihop_url)
    env.reset(seed=0, options={"row": row})
    assert [env.step(a)[1] for a in (ask, bridge, answer)] == [0.0, 0.0, 1.0]  # off
    env = SearchEnv(retriever_url=multihop_url, hop_reward=0.25, max_turns=5)
    env.reset(seed=0, options={"row": row})
    steps = [env.step(a) for a in (ask, ask, bridge, bridge, answer)]
    assert [s[1] for s in steps] == [0.25, 0.0, 0.25, 0.0, 1.0]
    assert [s[4]["gold_retrieved"] for s in steps] == [1, 1, 2, 2, 2]
    env = SearchEnv(retriever_url=multihop_url, hop_reward=0.25, protocol="tools")
    env.reset(seed=0, options={"row": row})
    call = '<tool_call>\n{"name": "search", "arguments": {"query": %s}}\n</tool_call>'
    both = call % json.dumps(info["question"]) + "\n" + call % json.dumps(info["bridge"])
    assert [env.step(both)[1] for _ in range(2)] == [0.5, 0.0]  # both paragraphs, once
    env.reset(seed=0, options={"row": search_row(info["question"], ["x"])})
    _, reward, _, _, step_info = env.step(call % json.dumps(info["question"]))
    assert reward == 0.0 and "gold_retrieved" not in step_info and "gold_hits" not in step_info
    env.close()
    # hop_reward_from=2: the first search's paragraph earns nothing, the second hop's does
    env = SearchEnv(retriever_url=multihop_url, hop_reward=0.25, hop_reward_from=2,
                    max_turns=5)
    env.reset(seed=0, options={"row": row})
    steps = [env.step(a) for a in (ask, ask, bridge, bridge, answer)]
    assert [s[1] for s in steps] == [0.0, 0.0, 0.25, 0.0, 1.0]
    assert [s[4]["gold_retrieved"] for s in steps] == [1, 1, 2, 2, 2]
    env = SearchEnv(retriever_url=multihop_url, hop_reward=0.25, hop_reward_from=2,
                    protocol="tools")
    env.reset(seed=0, options={"row": row})
    assert env.step(both)[1] == 0.25  # two searches in one turn: the second's paragraph
    env.close()
    with pytest.raises(ValueError, match="hop_reward"):
        SearchEnv(retriever_url=multihop_url, hop_reward=-1)
    with pytest.raises(ValueError, match="hop_reward_from"):
        SearchEnv(retriever_url=multihop_url, hop_reward_from=0)
    from agentgym.config import build_config
    with pytest.raises(ValueError, match="search.hop_reward"):
        build_config({"search.hop_reward": -0.5})
    with pytest.raises(ValueError, match="search.hop_reward_from must be >= 1"):
        build_config({"search.hop_reward_from": 0})
    assert build_config({"search.hop_reward_from": 2}).search.hop_reward_from == 2


def test_demonstrations_search_twice_and_find_each_gold_paragraph(train, multihop_url):
    from agentgym.data.demo_builders import build_demos
    from agentgym.data.demos import replay_demo
    from agentgym.envs.search import SearchEnv
    rows = [r for r in train if r["extra_info"]["type"] == "bridge"][:12] + \
        [r for r in train if r["extra_info"]["type"] == "comparison"][:8]
    demos = build_demos("search", rows, lambda: SearchEnv(retriever_url=multihop_url),
                        workers=2, max_searches=2)
    kinds = {d["builder"] for d in demos}
    assert kinds == {"search-multihop-bridge", "search-multihop-comparison"}, kinds
    env = SearchEnv(retriever_url=multihop_url)
    for demo in demos:
        actions, golds = demo["actions"], gold_paragraphs(demo["row"])
        assert len(actions) == 3 and [a.count("<search>") for a in actions] == [1, 1, 0]
        assert "<answer>" in actions[2] and demo["reward"] == 1.0
        for k, obs in enumerate(demo["observations"]):
            shown = obs[0]["content"].split("</information>")[0]
            assert f'(Title: "{golds[k]["title"]}")' in shown, (k, golds[k])
        if demo["builder"] == "search-multihop-bridge":
            assert f"<search> {demo['row']['extra_info']['bridge']} </search>" in actions[1]
        assert replay_demo(demo, env)["observations"] == demo["observations"]
    env.close()
    assert build_demos("search", rows[:2], lambda: SearchEnv(retriever_url=multihop_url),
                       max_searches=1) == []


def test_config_resolves_and_picks_the_multihop_corpus(capsys):
    from agentgym.cli import main
    from agentgym.config import build_config
    from agentgym.envs.search import corpus_name
    assert main(["config", "env=search", "data=multihop", "search.hop_reward=0.5"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["data"]["name"] == "multihop" and shown["search"]["hop_reward"] == 0.5
    assert shown["retriever"]["corpus"] == "auto"

    def name(**keys) -> str:
        cfg = build_config({"env": "search", **keys})
        return corpus_name(cfg.retriever.corpus, cfg.data.name, cfg.trainer.eval_data)

    assert name(data="multihop") == name(data="multihop_test") == "multihop"
    assert name(data="train", **{"trainer.eval_data": "multihop_test"}) == "multihop"
    assert name(data="train") == "wiki"
    assert name(data="multihop", **{"retriever.corpus": "wiki"}) == "wiki"
    with pytest.raises(ValueError, match="retriever.corpus"):
        build_config({"retriever.corpus": "wikipedia"})
    from agentgym.core.paths import shipped_corpus
    with pytest.raises(ValueError, match="valid: wiki, multihop"):
        shipped_corpus("full")


def test_the_curriculum_rows_hold_both_levels():
    """``data=multihop_curriculum``: NQ rows (one-hop levels 1-3) and the multi-hop rows
    (level 4); the curriculum starts at the lowest and moves up."""
    from agentgym.core.paths import shipped_corpus
    from agentgym.data.rows import load_rows
    from agentgym.envs.answerable import MULTI_HOP, difficulty_levels
    rows = load_rows("search", "multihop_curriculum")
    sources = {r["data_source"] for r in rows}
    assert sources == {"nq", "hotpotqa"} and all(
        gold_paragraphs(r) for r in rows if r["data_source"] == "hotpotqa")
    sample = [r for r in rows if r["data_source"] == "nq"][:20] + \
        [r for r in rows if r["data_source"] == "hotpotqa"][:20]
    levels = difficulty_levels(sample, shipped_corpus("multihop"))
    assert set(levels[20:]) == {MULTI_HOP} and max(levels[:20]) < MULTI_HOP


def test_second_hop_counts_the_second_search_that_completes_the_pair(train, multihop_url):
    """``second_hop`` (multi-hop rows' episode metric): 1 when the second search brings the
    gold paragraph still missing; not when it repeats the first, nor on a one-hop row."""
    from agentgym.envs.search import SearchEnv, search_row
    row = _bridge_case(train, multihop_url)
    info = row["extra_info"]
    ask, bridge = f"<search> {info['question']} </search>", f"<search> {info['bridge']} </search>"
    answer = "<answer> nothing </answer>"
    env = SearchEnv(retriever_url=multihop_url, max_turns=5)
    outcomes = {}
    for name, actions in (("ask, bridge", (ask, bridge, answer)),
                          ("ask, ask, bridge", (ask, ask, bridge, answer)),
                          ("bridge, ask", (bridge, ask, answer)), ("ask", (ask, answer))):
        env.reset(seed=0, options={"row": row})
        last = [env.step(a)[4] for a in actions][-1]
        assert last["episode_metrics"] == ["answer_seen", "gold_retrieved", "second_hop"]
        outcomes[name] = (last["second_hop"], last["gold_retrieved"])
    assert outcomes == {"ask, bridge": (1, 2), "ask, ask, bridge": (0, 2),
                        "bridge, ask": (1, 2), "ask": (0, 1)}
    env.reset(seed=0, options={"row": search_row(info["question"], ["x"])})
    last = [env.step(a)[4] for a in (ask, bridge, answer)][-1]
    assert last["episode_metrics"] == ["answer_seen"] and "second_hop" not in last
    env.close()


def _eval_cases(rows, url):
    """Two bridge and two comparison held-out rows, each with the model output it gets:
    a bridge row whose question search brings only hop 1 and whose bridge phrase brings
    hop 2 (searched in that order, then answered right); a bridge row asked twice with
    the question (the repeat brings nothing new), answered wrong; a comparison row
    answered at once, wrong; a comparison row whose entity searches each bring only their
    own paragraph, answered right."""
    from agentgym.envs.multihop import strip_title
    from agentgym.envs.search import SearchEnv
    env = SearchEnv(retriever_url=url)

    def hits(row, query):
        env.reset(seed=0, options={"row": row})
        return env.step(f"<search> {query} </search>")[4].get("gold_hits", [])

    def answer(row, right=True):
        return f"<answer> {row['reward_model']['ground_truth']['target'][0] if right else 'no'}" \
               " </answer>"
    bridge = next(r for r in rows if r["extra_info"]["type"] == "bridge" and
                  r["extra_info"]["bridge"] and hits(r, r["extra_info"]["question"]) == [0]
                  and 1 in hits(r, r["extra_info"]["bridge"]))
    ask = f"<search> {bridge['extra_info']['question']} </search>"
    other = next(r for r in rows if r["extra_info"]["type"] == "bridge" and r is not bridge)
    again = f"<search> {other['extra_info']['question']} </search>"
    comparisons = [r for r in rows if r["extra_info"]["type"] == "comparison"]
    names = lambda r: [strip_title(g["title"]) for g in gold_paragraphs(r)]  # noqa: E731
    entities = next(r for r in comparisons if hits(r, names(r)[0]) == [0]
                    and hits(r, names(r)[1]) == [1])
    env.close()
    return [(bridge, [ask, f"<search> {bridge['extra_info']['bridge']} </search>",
                      answer(bridge)]),
            (other, [again, again, answer(other, right=False)]),
            (next(r for r in comparisons if r is not entities), [answer(entities, False)]),
            (entities, [f"<search> {names(entities)[0]} </search>",
                        f"<search> {names(entities)[1]} </search>", answer(entities)])]


def test_eval_reports_searches_and_the_second_hop_by_type(test_rows, multihop_url,
                                                          scripted_server, tmp_path, capsys):
    """`agentgym eval` on multi-hop rows, the model's output scripted (the real serve app,
    the real BM25 retriever over the multihop corpus): searches per episode, the share
    with 2+ searches and with a second hop, overall and by type, in print and JSON."""
    from agentgym.cli import main
    cases = _eval_cases(test_rows, multihop_url)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row, _ in cases))
    url, engine = scripted_server([a for _, actions in cases for a in actions])
    out = tmp_path / "eval.json"
    assert main(["eval", "env=search", "model=tiny", f"data={data}", f"out={out}",
                 "engine=sglang", f"engine.urls=[{url}]", f"retriever.url={multihop_url}",
                 "rollout.max_concurrency=1", "rollout.max_response_tokens=8192",
                 "rollout.max_prompt_tokens=4096", "rollout.max_turns=4"]) == 0
    printed = capsys.readouterr().out
    assert engine.script == []  # every scripted turn was played, in row order
    result = json.loads(out.read_text())
    eps = result["episodes"]
    assert [(e["type"], e["tool_calls"], e["second_hop"], e["em"]) for e in eps] == [
        ("bridge", 2, 1, 1.0), ("bridge", 2, 0, 0.0), ("comparison", 0, 0, 0.0),
        ("comparison", 2, 1, 1.0)]
    assert result["em"] == 0.5 and result["mean_tool_calls"] == 1.5
    assert result["tool_calls_2plus"] == 0.75 and result["second_hop"] == 0.5
    assert result["second_hop_n"] == 4 and result["tool_calls_label"] == "searches"
    lo, hi = result["mean_tool_calls_ci95"]
    assert 0.0 <= lo <= 1.5 <= hi <= 2.0
    by_type = result["by_type"]
    assert {t: (s["n"], s["em"], s["tool_calls"], s["tool_calls_2plus"], s["second_hop"])
            for t, s in by_type.items()} == {"bridge": (2, 0.5, 2.0, 1.0, 0.5),
                                             "comparison": (2, 0.5, 1.0, 0.5, 0.5)}
    assert "searches per episode 1.50 [" in printed and "2+ searches 0.750 [" in printed
    assert "second search brought the second gold paragraph 0.500 [" in printed
    assert "of 4 multi-hop episodes)" in printed
    assert any(line.split()[:2] == ["bridge", "2"] for line in printed.splitlines())
    assert main(["compare", str(out), str(out), "metric=second_hop"]) == 0
    assert "second_hop on 4 shared questions: 0.500 -> 0.500" in capsys.readouterr().out
