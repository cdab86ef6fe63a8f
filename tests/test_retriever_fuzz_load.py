"""The retrieval server under hostile and heavy input: a real
``python -m agentgym.retriever_server``
process (BM25 over 2,000 shipped passages, batching on) on a loopback port.

* fuzz: schemathesis generates schema-valid and schema-violating bodies from the server's
  own OpenAPI document; hypothesis adds arbitrary JSON values and raw bytes. Bounded in
  examples (about 500 requests in all). No answer may be a 5xx; every 4xx carries a message.
* load: 2,400 requests at concurrency 32; zero errors, and the server's resident memory
  grows by less than 64 MB between the first 400 and the end.
"""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
from pathlib import Path

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentgym.tools.local_retriever import LocalRetriever

CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus" / "wiki_passages.jsonl.gz"
FUZZ = settings(max_examples=120, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "small.jsonl"
    with gzip.open(CORPUS, "rt", encoding="utf-8") as src:
        path.write_text("".join(itertools.islice(src, 2000)), encoding="utf-8")
    # batching on (auto leaves it off for BM25): the load test exercises the batcher
    with LocalRetriever(path, index_dir=tmp_path_factory.mktemp("idx") / "bm25",
                        extra_args=["--batching", "on"]) as r:
        yield r


def _check_answer(r: httpx.Response | object) -> None:
    status = r.status_code
    assert status < 500, f"{status}: {r.text[:300]}"
    if status >= 400:
        body = r.json()
        assert isinstance(body.get("message"), str) and body["message"], r.text[:300]
    elif status == 200 and r.request.url.path.endswith("/retrieve"):
        for hits in r.json()["result"]:
            for h in hits:
                assert set(h) == {"document", "score"} and set(h["document"]) == {"id",
                                                                                    "contents"}


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_finds_no_server_error(server, mode):
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    op = schema["/retrieve"]["POST"]
    seen = []

    @FUZZ
    @given(case=op.as_strategy(generation_mode=GenerationMode(mode)))
    def run(case):
        response = case.call(base_url=server.url, timeout=30)
        seen.append(response.status_code)
        assert response.status_code < 500, f"{case.body!r} -> {response.status_code} " \
                                           f"{response.text[:300]}"
        if response.status_code >= 400:
            assert response.json()["message"]

    run()
    assert len(seen) >= 50
    if mode == "negative":
        assert all(400 <= s < 500 for s in seen), sorted(set(seen))
    else:
        assert 200 in seen  # schema-valid bodies do get answered


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                max_size=4),
    max_leaves=12)
bodies = st.one_of(
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({}, optional={"queries": json_values, "query": json_values,
                                        "topk": json_values, "return_scores": json_values}
                          ).map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),
)


def test_arbitrary_json_and_bytes_never_cause_a_server_error(server):
    with httpx.Client(timeout=30) as http:
        @FUZZ
        @given(body=bodies)
        def run(body):
            r = http.post(server.url + "/retrieve", content=body,
                          headers={"content-type": "application/json"})
            _check_answer(r)

        run()


@pytest.mark.parametrize("body", [
    b'{"queries": ["a"', b"\xff\xfe\x00", b'{"queries": [null]}', b'{"queries": [["a"]]}',
    b'{"queries": ["a"], "topk": 1e309}', b'{"queries": ["a"], "topk": -1}',
    b'{"queries": ["a"], "topk": 10000000000000000000000}', b'{"queries": ["a"], "topk": true}',
    b'{"queries": ["\\u0000"]}', b'{"queries": ["a"], "return_scores": "yes please"}',
    b'[' * 5000 + b']' * 5000, b'{"queries": ' + b'["a",' * 300 + b'"a"' + b']' * 300 + b'}',
])
def test_malformed_bodies_are_4xx_with_a_message(server, body):
    r = httpx.post(server.url + "/retrieve", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert 400 <= r.status_code < 500 or r.status_code == 200, r.text[:300]
    _check_answer(r)


async def _load(url: str, n: int, concurrency: int) -> list:
    queries = ["steam locomotive", "river in europe", "who wrote the novel", "capital city",
               "world war battle", "famous painter", "olympic games", "space mission"]
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        async def one(i: int):
            async with gate:
                body = {"queries": [queries[i % 8], queries[(i * 3) % 8]][: 1 + i % 2],
                        "topk": 1 + i % 5}
                try:
                    r = await client.post(url + "/retrieve", json=body)
                except httpx.HTTPError as e:
                    return f"{type(e).__name__}: {e}"
                if r.status_code != 200:
                    return f"HTTP {r.status_code}: {r.text[:200]}"
                hits = r.json()["result"]
                if len(hits) != len(body["queries"]) or any(len(h) != body["topk"] for h in hits):
                    return f"wrong shape for {body}"
                return None
        return await asyncio.gather(*(one(i) for i in range(n)))


def test_load_thousands_of_requests_no_errors_bounded_memory(server):
    proc = psutil.Process(server.pid)
    warm = asyncio.run(_load(server.url, 400, 32))
    rss0 = proc.memory_info().rss
    errors = [e for e in warm + asyncio.run(_load(server.url, 2000, 32)) if e]
    rss1 = proc.memory_info().rss
    assert errors == []
    assert rss1 - rss0 < 64 << 20, f"server RSS grew {(rss1 - rss0) >> 20} MB"
    stats = httpx.get(server.url + "/health").json()["batching"]
    assert stats["requests"] >= 2400 and stats["batches"] <= stats["requests"]
