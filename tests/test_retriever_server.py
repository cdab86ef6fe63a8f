"""The retrieval server: a real ``python -m agentgym.retriever_server`` process over a real BM25
index of the first 2,000 shipped passages, on a free loopback port."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path

import httpx
import pytest

from agentgym.retriever_server.bm25 import BM25Index
from agentgym.tools.local_retriever import (LocalRetriever, default_index_dir,
                                            ensure_local_retriever, stop_local_retrievers)

CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus" / "wiki_passages.jsonl.gz"
N_SMALL = 2000


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "small.jsonl"
    with gzip.open(CORPUS, "rt", encoding="utf-8") as src:
        path.write_text("".join(itertools.islice(src, N_SMALL)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def server(small_corpus, tmp_path_factory):
    with LocalRetriever(small_corpus, index_dir=tmp_path_factory.mktemp("idx") / "bm25") as r:
        yield r


def post(url: str, body, **kw) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(url + "/retrieve", content=body,
                          headers={"content-type": "application/json"}, **kw)
    return httpx.post(url + "/retrieve", json=body, **kw)


def test_health(server):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200
    body = r.json()
    assert {k: body[k] for k in ("status", "documents", "method")} == {
        "status": "ok", "documents": N_SMALL, "method": "bm25"}
    assert body["limits"] == {"max_queries": 256, "max_topk": 50, "max_query_chars": 2048,
                              "max_body_bytes": 1 << 20}


def test_retrieve_shape_and_exact_title_ranks_first(server):
    titles = ["Lockheed SR-71 Blackbird", "Doris A. Davis", "Gluten-free diet",
              "First Bank of the United States"]
    r = post(server.url, {"queries": titles, "topk": 4})
    assert r.status_code == 200
    result = r.json()["result"]
    assert len(result) == len(titles)
    for title, hits in zip(titles, result):
        assert len(hits) == 4
        for hit in hits:
            assert set(hit) == {"document", "score"}
            assert set(hit["document"]) == {"id", "contents"}
            assert isinstance(hit["document"]["id"], str)
            assert isinstance(hit["score"], float)
        assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
        assert hits[0]["document"]["contents"].startswith(f'"{title}"\n')


def test_default_topk_is_3_and_return_scores_false_keeps_the_shape(server):
    r = post(server.url, {"queries": ["steam locomotive"], "return_scores": False})
    assert r.status_code == 200
    hits = r.json()["result"][0]
    assert len(hits) == 3
    assert all(set(h) == {"document", "score"} and h["score"] is None for h in hits)
    scored = post(server.url, {"queries": ["steam locomotive"]}).json()["result"][0]
    assert [h["document"] for h in hits] == [h["document"] for h in scored]


def test_query_with_no_known_term_still_answers(server):
    r = post(server.url, {"queries": ["the of and", "zzqxv qqzzx"], "topk": 2})
    assert r.status_code == 200
    assert [[h["score"] for h in hits] for hits in r.json()["result"]] == [[0.0, 0.0]] * 2


def test_request_id_is_echoed(server):
    r = post(server.url, {"queries": ["uranus"]}, headers={"X-Request-ID": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"


@pytest.mark.parametrize("body, field", [
    ({"queries": []}, "queries"),
    ({"queries": [""]}, "queries"),
    ({"queries": ["ok", "   "]}, "queries[1]"),
    ({"queries": "uranus"}, "queries"),
    ({"queries": ["uranus"], "topk": 0}, "topk"),
    ({"queries": ["uranus"], "topk": 1000}, "less than or equal to 50"),
    ({"queries": ["uranus"], "topk": "three"}, "topk"),
    ({"queries": ["uranus"], "top_k": 5}, "top_k"),
    ({"queries": ["x" * 2049]}, "queries[0]"),
    ({"queries": ["uranus"] * 257}, "at most 256 items"),
    ({"topk": 3}, "exactly one of them"),
    ({"queries": ["a"], "query": "b"}, "exactly one of them"),
    ({"query": ""}, "query"),
    ({"query": 3}, "query"),
    ({"query": "x" * 2049}, "at most 2048 characters"),
    ([1, 2], "JSON object"),
    (b"not json", "not valid JSON"),
    (b"", "JSON object"),
])
def test_bad_input_is_4xx_naming_the_field(server, body, field):
    r = post(server.url, body)
    assert 400 <= r.status_code < 500, r.text
    assert field in r.json()["message"]


def test_single_query_shape_answers_as_a_batch_of_one(server):
    single = post(server.url, {"query": "steam locomotive", "topk": 2})
    batch = post(server.url, {"queries": ["steam locomotive"], "topk": 2})
    assert single.status_code == 200
    assert single.json() == batch.json() and len(single.json()["result"][0]) == 2


def test_huge_body_is_413_naming_the_limit(server):
    body = json.dumps({"queries": ["x" * 2000] * 600}).encode()  # ~1.2 MB
    r = post(server.url, body)
    assert r.status_code == 413 and "limit of 1048576 bytes" in r.json()["message"]

    def chunks():  # no Content-Length: the limit applies while the body streams in
        for _ in range(40):
            yield b"x" * 65536
    r = httpx.post(server.url + "/retrieve", content=chunks(),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "1048576 bytes" in r.json()["message"]


def test_wrong_method_and_path_are_4xx_with_a_message(server):
    r = httpx.get(server.url + "/retrieve")
    assert r.status_code == 405 and "GET is not allowed" in r.json()["message"]
    r = httpx.post(server.url + "/search", json={"queries": ["x"]})
    assert r.status_code == 404 and "POST /retrieve" in r.json()["message"]


def test_non_json_content_type_is_4xx(server):
    r = httpx.post(server.url + "/retrieve", content=b"queries=uranus",
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert 400 <= r.status_code < 500 and "application/json" in r.json()["message"]


def test_index_save_load_roundtrip(small_corpus, tmp_path):
    index = BM25Index.from_corpus(small_corpus)
    index.save(tmp_path / "ix")
    loaded = BM25Index.load(tmp_path / "ix")
    queries = ["who invented the steam locomotive", "coeliac disease symptoms"]
    assert len(loaded) == N_SMALL
    assert loaded.search(queries, 5) == index.search(queries, 5)


def test_startup_failure_reports_the_server_log(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "0", "contents": "fine"}\nnot json at all\n')
    with pytest.raises(RuntimeError, match=r"(?s)exited.*bad\.jsonl:2: expected a JSON object"):
        LocalRetriever(bad, index_dir=tmp_path / "ix", startup_timeout=30).start()


def test_ensure_local_retriever_caches_index_and_reuses_server(small_corpus, tmp_path,
                                                               monkeypatch):
    monkeypatch.setenv("AGENTGYM_CACHE", str(tmp_path / "cache"))
    try:
        url = ensure_local_retriever(small_corpus)
        assert ensure_local_retriever(str(small_corpus)) == url  # one server per corpus
        assert httpx.get(url + "/health").json()["documents"] == N_SMALL
    finally:
        stop_local_retrievers()
    index_dir = default_index_dir(small_corpus)
    assert index_dir.is_relative_to(tmp_path / "cache" / "retriever")
    assert (index_dir / "docs.jsonl").exists()
    with LocalRetriever(small_corpus) as again:  # second start loads the cached index
        assert "loaded BM25 index" in again.log_path.read_text()
        assert json.loads(post(again.url, {"queries": ["uranus"]}).text)["result"][0]
    assert not again.alive and again.url is None
