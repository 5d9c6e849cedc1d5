"""The official openai client against a real server: chat and completions, streaming and not, models."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.server_helpers import sse_events


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.v1, api_key="unused", max_retries=0, timeout=60)


MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


def test_models_list_shows_every_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-2", "greedy"]
    assert all(m.model_extra["max_model_len"] == 512 for m in models.data)
    assert client.models.retrieve("tiny-2").id == "tiny-2"


def test_chat_non_streaming(client):
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.model == "tiny"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("length", "stop")
    assert resp.usage.completion_tokens == 12 or choice.finish_reason == "stop"
    assert resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    spec = resp.model_extra["spec_decode"]
    assert spec["completion_tokens"] == resp.usage.completion_tokens and spec["steps"] >= 1
    assert len(spec["accepted_per_position"]) == 4  # k = 4


def test_chat_streaming_matches_non_streaming(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_streaming_and_not(client):
    whole = client.completions.create(model="tiny-2", prompt="Once upon a time", max_tokens=10, temperature=0)
    assert whole.object == "text_completion" and whole.model == "tiny-2"
    assert whole.usage.completion_tokens == 10 and whole.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model="tiny-2", prompt="Once upon a time", max_tokens=10,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_completion_from_token_ids_and_batch(client):
    text = client.completions.create(model="tiny", prompt="Hel", max_tokens=4, temperature=0,
                                     extra_body={"return_token_ids": True})
    prompt_ids = text.choices[0].model_extra["prompt_token_ids"]
    assert len(prompt_ids) == 3  # byte tokenizer
    ids = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=4, temperature=0)
    assert ids.choices[0].text == text.choices[0].text
    batch = client.completions.create(model="tiny", prompt=["Hel", "abc"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == text.choices[0].text
    assert batch.usage.prompt_tokens == 6 and batch.usage.completion_tokens == 16


def test_n_greater_than_one_gives_n_choices(client):
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, n=3, temperature=1.0,
                                          seed=7)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert resp.usage.completion_tokens == 18
    again = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, n=3, temperature=1.0,
                                           seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in resp.choices]


def test_alias_defaults_and_request_override(client):
    greedy_alias = client.chat.completions.create(model="greedy", messages=MESSAGES, max_tokens=10)
    explicit = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0)
    assert greedy_alias.model == "greedy"
    assert greedy_alias.choices[0].message.content == explicit.choices[0].message.content


def test_logprobs_chat_and_completions(client):
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)  # greedy: the top token
    comp = client.completions.create(model="tiny", prompt="abc", max_tokens=3, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3


def test_return_token_ids_and_meta_info(tiny_server):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "return_token_ids": True,
            "return_meta_info": True, "chat_template_kwargs": None, "some_unknown_field": {"x": 1}}
    resp = httpx.post(tiny_server.v1 + "/chat/completions", json=body, timeout=60).json()
    assert len(resp["choices"][0]["token_ids"]) == resp["usage"]["completion_tokens"]
    assert len(resp["prompt_token_ids"]) == resp["usage"]["prompt_tokens"]
    meta = resp["meta_info"]
    assert meta["completion_tokens"] == resp["usage"]["completion_tokens"]
    assert meta["spec_verify_ct"] >= 1 and meta["spec_accept_length"] >= 1.0
    with httpx.stream("POST", tiny_server.v1 + "/chat/completions", json={**body, "stream": True},
                      timeout=60) as r:
        events = sse_events(list(r.iter_lines()))
    streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    assert streamed == resp["choices"][0]["token_ids"]
    assert events[0]["prompt_token_ids"] == resp["prompt_token_ids"]
    assert events[-1]["meta_info"]["completion_tokens"] == meta["completion_tokens"]


def test_stop_strings_and_min_tokens(tiny_server):
    base = {"model": "tiny", "prompt": "hello", "max_tokens": 12, "temperature": 0}
    text = httpx.post(tiny_server.v1 + "/completions", json=base, timeout=60).json()["choices"][0]["text"]
    stop = next((ch for ch in text[1:] if ch.isascii() and ch.isprintable()), None)
    assert stop is not None, f"the tiny model's output {text!r} has no printable ASCII to stop at"
    cut = httpx.post(tiny_server.v1 + "/completions", json={**base, "stop": stop}, timeout=60).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert cut["text"] == text[:text.index(stop)]
    forced = httpx.post(tiny_server.v1 + "/completions", json={**base, "ignore_eos": True, "min_tokens": 12},
                        timeout=60).json()
    assert forced["usage"]["completion_tokens"] == 12
