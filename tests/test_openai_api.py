"""OpenAI's API on ``agentgym serve``, through the official ``openai`` SDK.

A real ``agentgym serve --model tiny`` process answers everything about sampling (``n``,
seeds, stop strings, logprobs, streaming, ``/v1/completions``, errors); tool calls need a
reply that calls a tool, which the random tiny model never writes, so they go to the same
app over a scripted engine (a fake for the model's output only)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from agentgym.rollout.engines.launcher import launch_serve

SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search Wikipedia.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                   "required": ["query"]}}}
CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "capital of France"}}\n</tool_call>'
HI = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def served():
    server = launch_serve("tiny")
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_are_listed_and_an_unknown_one_or_route_is_a_404(client, served):
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").owned_by == "agentgym"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found" and "'tiny'" in e.value.body["message"]
    r = httpx.post(f"{served}/v1/embeddings", json={"input": "x"}, timeout=30)
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "Invalid URL (POST /v1/embeddings)"


def test_n_seeded_choices_with_logprobs_and_token_ids(client, tiny_tokenizer):
    ask = dict(model="tiny", messages=HI, n=3, seed=7, max_tokens=6, logprobs=True,
               top_logprobs=3, extra_body={"return_token_ids": True})
    first, again = client.chat.completions.create(**ask), client.chat.completions.create(**ask)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]  # seeded: reproduced
    assert len(set(texts)) > 1  # the n choices are samples, not copies
    assert first.usage.completion_tokens == sum(len(c.token_ids) for c in first.choices)
    assert first.usage.prompt_tokens == len(first.prompt_token_ids)
    for choice in first.choices:
        ids = choice.token_ids
        if ids[-1] == tiny_tokenizer.eos_token_id:
            ids = ids[:-1]
        assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == choice.message.content
        entries = choice.logprobs.content
        assert len(entries) == len(ids)
        assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace") == \
            choice.message.content
        for e in entries:
            tops = [t.logprob for t in e.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True)
            assert e.logprob <= tops[0] + 1e-6
            same = [t.logprob for t in e.top_logprobs if t.bytes == e.bytes]
            assert not same or abs(same[0] - e.logprob) < 1e-5


def test_stop_strings_and_the_token_budget(client):
    greedy = dict(model="tiny", messages=HI, temperature=0)
    full = client.chat.completions.create(**greedy, max_completion_tokens=12)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 12
    text = full.choices[0].message.content
    stop = text[4:7]
    cut = client.chat.completions.create(**greedy, max_tokens=12, stop=[stop, "\x00never"])
    assert cut.choices[0].message.content == text[:text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def _collect(stream) -> tuple[dict, dict, list]:
    """Streamed chunks -> (text by choice, finish reason by choice, usage chunks)."""
    texts, finish, usages = {}, {}, []
    for chunk in stream:
        if not chunk.choices:
            usages.append(chunk.usage)
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "") \
                if hasattr(c, "delta") else texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return texts, finish, usages


def test_a_stream_adds_up_to_the_same_answer(client):
    ask = dict(model="tiny", messages=HI, n=2, seed=11, max_tokens=10)
    whole = client.chat.completions.create(**ask)
    texts, finish, usages = _collect(client.chat.completions.create(
        **ask, stream=True, stream_options={"include_usage": True}))
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert len(usages) == 1 and usages[0].completion_tokens == whole.usage.completion_tokens
    greedy = dict(model="tiny", messages=HI, temperature=0, max_tokens=12)
    text = client.chat.completions.create(**greedy).choices[0].message.content
    stop = text[3:6]  # a stop string met mid-stream is never sent
    texts, finish, _ = _collect(client.chat.completions.create(**greedy, stop=stop,
                                                               stream=True))
    assert texts == {0: text[:text.find(stop)]} and finish == {0: "stop"}


def test_completions_with_several_prompts_logprobs_echo_and_streaming(client, tiny_tokenizer):
    ask = dict(model="tiny", prompt=["The capital of", "Once upon"], n=2, seed=3, max_tokens=5,
               logprobs=2)
    r = client.completions.create(**ask)
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.object == "text_completion"
    for c in r.choices:
        lp = c.logprobs
        assert "".join(lp.tokens) == c.text and len(lp.token_logprobs) == len(lp.tokens)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i])
                                  for i in range(len(lp.tokens))]
        assert all(len(top) <= 2 for top in lp.top_logprobs)
    prompts = [tiny_tokenizer.encode(p) for p in ask["prompt"]]
    assert r.usage.prompt_tokens == sum(len(p) for p in prompts)
    streamed, _, _ = _collect(client.completions.create(**ask, stream=True))
    assert streamed == {c.index: c.text for c in r.choices}
    by_ids = client.completions.create(model="tiny", prompt=prompts[0], seed=3, max_tokens=5)
    assert by_ids.choices[0].text == r.choices[0].text  # token ids in, same sample
    echo = client.completions.create(model="tiny", prompt="The capital of", seed=3,
                                     max_tokens=5, echo=True)
    assert echo.choices[0].text == "The capital of" + r.choices[0].text


@pytest.mark.parametrize("bad, param", [
    (dict(n=0), "n"), (dict(temperature=2.5), "temperature"),
    (dict(top_logprobs=2), "top_logprobs"), (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(tools=[{"type": "function"}]), "tools"),
    (dict(tools=[SEARCH], tool_choice={"type": "function", "function": {"name": "find"}}),
     "tool_choice"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:,"}}]}]), "messages[0].content"),
    (dict(extra_body={"guided_json": {}}), "guided_json"),
    (dict(max_tokens=10 ** 6), "max_tokens"), (dict(logit_bias={"1": 5}), "logit_bias"),
    (dict(presence_penalty=1.0), "presence_penalty"),
    (dict(response_format={"type": "json_object"}), "response_format"),
    (dict(messages=[{"role": "robot", "content": "x"}]), "messages[0]"),
])
def test_a_bad_request_is_a_400_naming_the_value(client, bad, param):
    ask = {"model": "tiny", "messages": HI, **bad}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**ask)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    assert e.value.body["type"] == "invalid_request_error"
    if param == "max_tokens":
        assert e.value.body["code"] == "context_length_exceeded"


def test_a_body_that_is_not_json_is_a_400(served):
    r = httpx.post(f"{served}/v1/chat/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_tool_calls_come_back_in_openai_shape_and_go_back_in(scripted_server,
                                                             tiny_tokenizer):
    url, engine = scripted_server([f"Let me look.\n{CALL} + eos", "Paris. + eos"])
    client = _client(url)
    r = client.chat.completions.create(model="any", messages=[
        {"role": "user", "content": "Capital of France?"}], tools=[SEARCH])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "search"
    assert json.loads(call.function.arguments) == {"query": "capital of France"}
    prompt = tiny_tokenizer.decode(engine.prompts[0])
    assert '"name": "search"' in prompt and "<tools>" in prompt  # the envs' Hermes system
    follow = client.chat.completions.create(model="any", tools=[SEARCH], messages=[
        {"role": "user", "content": "Capital of France?"}, choice.message.model_dump(),
        {"role": "tool", "tool_call_id": call.id, "content": "Paris is the capital."}])
    assert follow.choices[0].message.content == "Paris." and not follow.choices[0].message.tool_calls
    prompt = tiny_tokenizer.decode(engine.prompts[1])
    assert f"Let me look.\n{CALL}" in prompt and "Paris is the capital." in prompt


def test_a_streamed_tool_call_and_a_call_that_does_not_parse(scripted_server):
    bad = '<tool_call>\n{"name": "browse", "arguments": {}}\n</tool_call>'
    url, _ = scripted_server([f"Let me look.\n{CALL} + eos", f"{bad} + eos"])
    client = _client(url)
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="any", messages=HI, tools=[SEARCH],
                                                stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                calls.setdefault(t.index, []).append(t)
            finish = c.finish_reason or finish
    assert content.strip() == "Let me look." and finish == "tool_calls"
    assert calls[0][0].function.name == "search" and calls[0][0].id.startswith("call_")
    r = client.chat.completions.create(model="any", messages=HI, tools=[SEARCH])
    assert r.choices[0].message.content == bad and r.choices[0].finish_reason == "stop"


def test_a_required_or_named_tool_choice_starts_the_reply_with_the_call(scripted_server,
                                                                       tiny_tokenizer):
    url, engine = scripted_server([
        '{"name": "search", "arguments": {"query": "x"}}\n</tool_call> + eos',
        '{"query": "y"}}\n</tool_call> + eos'])
    client = _client(url)
    r = client.chat.completions.create(model="any", messages=HI, tools=[SEARCH],
                                       tool_choice="required")
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"query": "x"}
    assert tiny_tokenizer.decode(engine.prompts[0]).endswith("<tool_call>\n")
    r = client.chat.completions.create(model="any", messages=HI, tools=[SEARCH], tool_choice={
        "type": "function", "function": {"name": "search"}})
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"query": "y"}
    assert tiny_tokenizer.decode(engine.prompts[1]).endswith(
        '<tool_call>\n{"name": "search", "arguments": ')


def test_the_async_client_streams_concurrent_requests(served):
    async def main():
        async with openai.AsyncOpenAI(base_url=f"{served}/v1", api_key="unused",
                                      max_retries=0, timeout=120) as c:
            async def one(seed):
                text = ""
                async for chunk in await c.chat.completions.create(
                        model="tiny", messages=HI, seed=seed, max_tokens=6, stream=True):
                    text += "".join(ch.delta.content or "" for ch in chunk.choices)
                whole = await c.chat.completions.create(model="tiny", messages=HI, seed=seed,
                                                        max_tokens=6)
                return text, whole.choices[0].message.content
            return await asyncio.gather(*(one(s) for s in range(4)))
    for streamed, whole in asyncio.run(main()):
        assert streamed == whole


def test_an_abandoned_stream_stops_decoding(tiny_model, tiny_tokenizer):
    """Closing the engine's stream (what a client's disconnect does) ends the request:
    the worker stops decoding it long before its token budget."""
    from agentgym.core.types import SamplingParams
    from agentgym.rollout.engines.hf import HFEngine
    engine = HFEngine(tiny_model, tiny_tokenizer)

    async def main():
        pieces = engine.stream([1, 2, 3], SamplingParams(max_new_tokens=400, temperature=1.0,
                                                         seed=0))
        first = await pieces.__anext__()
        await pieces.aclose()
        return first
    try:
        first = asyncio.run(main())
        assert len(first[0]) == 1
        from conftest import wait_until
        wait_until(engine.idle, 60, "the engine's idling")
        assert engine.stats["generated_tokens"] < 400
    finally:
        engine.close()
