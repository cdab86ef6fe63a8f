"""``data=`` reads verl's data as verl writes it: rows built exactly as verl's
``examples/data_preprocess`` scripts build them (no ``env`` field), written by ``datasets``
(``Dataset.to_parquet``, ``save_to_disk``) as those scripts write them."""

from __future__ import annotations

import json
import logging

import datasets
import pytest

from agentgym.cli import main
from agentgym.data.rows import ACCEPTED, load_rows

QUESTIONS = [("Natalia sold clips to 48 of her friends in April, and then she sold half as "
              "many clips in May. How many clips did Natalia sell altogether?", "72"),
             ("Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
              "babysitting. How much did she earn?", "10")]


def gsm8k_rows() -> list[dict]:
    """Rows as verl's examples/data_preprocess/gsm8k.py makes them."""
    follow = "Let's think step by step and output the final answer after \"####\"."
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"{q} {follow}"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": a},
             "extra_info": {"split": "test", "index": i, "answer": f"... #### {a}",
                            "question": q}} for i, (q, a) in enumerate(QUESTIONS)]


def search_r1_rows() -> list[dict]:
    """Rows as verl's preprocess_search_r1_dataset.py makes them (with agent_name, as its
    tool-agent configs add)."""
    q, answers = "who wrote the novel 1984?", ["George Orwell", "Eric Blair"]
    return [{"data_source": "searchR1_nq", "agent_name": "tool_agent",
             "prompt": [{"role": "system", "content": "You are a helpful and harmless assistant."},
                        {"role": "user", "content": f"Answer the question. Question: {q}"}],
             "ability": "fact-reasoning",
             "reward_model": {"style": "rule", "ground_truth": {"target": answers}},
             "extra_info": {"index": 0, "need_tools_kwargs": True, "question": q,
                            "split": "train", "tools_kwargs": {"search": {"create_kwargs": {
                                "ground_truth": {"target": answers}, "question": q,
                                "data_source": "searchR1_nq"}}}}}]


def _same(got: list[dict], want: list[dict], env: str) -> None:
    assert [r["env"] for r in got] == [env] * len(want)
    for g, w in zip(got, want):
        assert {k: g[k] for k in w} == w


def test_parquet_jsonl_shards_globs_and_save_to_disk_read_alike(tmp_path, monkeypatch):
    rows = gsm8k_rows()
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "test.parquet"))  # what verl's script calls
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    shards = tmp_path / "shards"
    shards.mkdir()
    for i, row in enumerate(rows):
        datasets.Dataset.from_list([row]).to_parquet(str(shards / f"part-{i:05d}.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "saved_dict"))
    for source in ("test.parquet", "test.jsonl", "shards", "shards/part-*.parquet", "saved"):
        _same(load_rows("code", str(tmp_path / source)), rows, "code")
    # a glob the shell did not expand (quoted, as the README writes it): ~ is still home
    monkeypatch.setenv("HOME", str(tmp_path))
    _same(load_rows("code", "~/shards/part-*.parquet"), rows, "code")
    _same(load_rows("code", "~/test.parquet"), rows, "code")
    with pytest.raises(ValueError, match="a DatasetDict saved by save_to_disk; pass one "
                                         "split's folder, e.g. data=.*saved_dict/train"):
        load_rows("code", str(tmp_path / "saved_dict"))


def test_a_rows_env_is_still_checked_and_verls_own_fields_are_named(tmp_path, caplog):
    path = tmp_path / "search.parquet"
    datasets.Dataset.from_list(search_r1_rows()).to_parquet(str(path))
    with caplog.at_level(logging.WARNING, logger="agentgym.data.rows"):
        rows = load_rows("search", str(path))
    assert rows[0]["reward_model"]["ground_truth"]["target"] == ["George Orwell", "Eric Blair"]
    said = caplog.text
    assert "agent_name ['tool_agent']" in said and "tools_kwargs for ['search']" in said
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({**gsm8k_rows()[0], "env": "search"}) + "\n")
    with pytest.raises(ValueError, match="row is for env 'search', not 'code'"):
        load_rows("code", str(other))


@pytest.mark.parametrize("content", [b"\x00\xca\xfe\xba\xbe binary", b"just some prose\n",
                                     b"[1, 2, 3]\n"])
def test_a_file_that_is_no_dataset_gets_an_error_naming_what_is_accepted(tmp_path, content):
    path = tmp_path / "notes.txt"
    path.write_bytes(content)
    with pytest.raises(ValueError) as e:
        load_rows("code", str(path))
    assert f"data={path}" in str(e.value) and ACCEPTED in str(e.value)


def test_agentgym_eval_on_verl_parquet_and_on_the_same_rows_as_jsonl(tmp_path, capsys):
    rows = gsm8k_rows()
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "gsm8k.parquet"))
    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = []
    for name in ("gsm8k.parquet", "gsm8k.jsonl"):
        out = tmp_path / f"{name}.json"
        assert main(["eval", "env=code", "model=tiny", f"data={tmp_path / name}",
                     f"out={out}", "rollout.max_turns=1",
                     "rollout.max_tokens_per_turn=8"]) == 0
        results.append(json.loads(out.read_text()))
    assert results[0]["n"] == results[1]["n"] == 2
    assert [e["uid"] for e in results[0]["episodes"]] == \
        [e["uid"] for e in results[1]["episodes"]]
    assert "EM" in capsys.readouterr().out
    bad = tmp_path / "gsm8k.txt"
    bad.write_text("Natalia sold clips...\n")
    assert main(["eval", "env=code", "model=tiny", f"data={bad}"]) == 2
    assert ACCEPTED in capsys.readouterr().err


def test_the_code_env_takes_verls_gsm8k_answer_form():
    from agentgym.envs.code import CodeEnv
    env = CodeEnv()
    env.reset(seed=0, options={"row": {**gsm8k_rows()[0], "env": "code"}})
    _, reward, terminated, _, info = env.step("48 + 24 = 72.\n#### 72")
    assert terminated and reward == 1.0 and info["answer"] == "72"
    env.close()
