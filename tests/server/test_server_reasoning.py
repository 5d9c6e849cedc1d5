"""--reasoning-parser qwen3: <think>...</think> goes to reasoning_content, in whole and streamed output."""

from __future__ import annotations

import httpx
import pytest

from blockspec.server.reasoning import ReasoningParser
from tests.conftest import CHATML
from tests.server.server_helpers import sse_events, start_server, tiny_engine_config


def _stream(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning, content = "", ""
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("prompt, output, expected", [
    ("<|im_start|>assistant\n", "<think>plan</think>\n\nanswer", ("plan", "\n\nanswer")),
    ("<|im_start|>assistant\n<think>\n", "plan</think>answer", ("plan", "answer")),  # template opened it
    ("<|im_start|>assistant\n<think>\n", "plan cut off by max_tokens", ("plan cut off by max_tokens", "")),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "just content", ("", "just content")),  # thinking off
    ("<|im_start|>assistant\n", "no tags at all", ("", "no tags at all")),
    ("<|im_start|>assistant\n", "a <think> later is content", ("", "a <think> later is content")),
])
def test_parser_whole_and_split_at_every_character(prompt, output, expected):
    assert _stream(ReasoningParser("qwen3", prompt), [output]) == expected
    assert _stream(ReasoningParser("qwen3", prompt), list(output)) == expected
    reasoning, content = ReasoningParser("qwen3", prompt).parse(output)
    assert (reasoning or "", content or "") == expected


@pytest.fixture(scope="module")
def thinking_server(tiny_models):
    # The template opens <think> in the generation prompt (as Qwen3.5/3.6 do); a random model never
    # writes </think>, so all of its output must land in reasoning_content.
    config = tiny_engine_config(tiny_models["llama"], chat_template=CHATML.replace(
        "{% if add_generation_prompt %}<|im_start|>assistant\n", "{% if add_generation_prompt %}<|im_start|>"
        "assistant\n<think>\n"))
    running = start_server(config, reasoning_parser="qwen3")
    yield running
    running.stop()


def test_reasoning_content_over_http(thinking_server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "think"}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    whole = httpx.post(thinking_server.v1 + "/chat/completions", json=body, timeout=60).json()
    message = whole["choices"][0]["message"]
    assert message["content"] is None and message["reasoning_content"]
    with httpx.stream("POST", thinking_server.v1 + "/chat/completions", json={**body, "stream": True},
                      timeout=60) as r:
        events = sse_events(list(r.iter_lines()))
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert not "".join(d.get("content", "") for d in deltas)


# ---- structured output behind the reasoning ---------------------------------------------------------------
# The byte tokenizer with </think> as one token at an id the tiny qwen3 target emits (see
# tests/structured/structured_cases.py): for the user message "x" it ends its thought at output token
# 14, for "think" not within 40 tokens. The template opens <think> in the generation prompt.

JSON_OBJECT = {"response_format": {"type": "json_object"}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def gated_server(tiny_models, tmp_path_factory):
    from tests.structured.structured_cases import write_think_tokenizer

    tokenizer = write_think_tokenizer(tmp_path_factory.mktemp("think_tok"))
    config = tiny_engine_config(tiny_models["qwen3"], tokenizer=str(tokenizer), reasoning_parser="qwen3",
                                chat_template=CHATML.replace("{% if add_generation_prompt %}<|im_start|>assistant\n",
                                                             "{% if add_generation_prompt %}<|im_start|>assistant\n"
                                                             "<think>\n"))
    running = start_server(config, reasoning_parser="qwen3", enable_auto_tool_choice=True,
                           tool_call_parser="hermes")
    yield running
    running.stop()


def _chat(server, message: str, extra: dict, stream: bool = False) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": message}], "max_tokens": 40,
            "temperature": 0, **extra}
    if not stream:
        response = httpx.post(server.v1 + "/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]
    with httpx.stream("POST", server.v1 + "/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        events = sse_events(list(r.iter_lines()))
    deltas = [c["delta"] for e in events for c in e["choices"]]
    return {"reasoning_content": "".join(d.get("reasoning_content") or "" for d in deltas),
            "content": "".join(d.get("content") or "" for d in deltas),
            "finish_reason": [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]}


def test_the_answer_after_the_thought_follows_the_grammar(gated_server):
    choice = _chat(gated_server, "x", JSON_OBJECT)
    message = choice["message"]
    assert message["reasoning_content"] and "</think>" not in message["reasoning_content"]
    assert message["content"].lstrip().startswith("{")  # the grammar's JSON object, not the free model
    free = _chat(gated_server, "x", {})["message"]
    assert free["reasoning_content"] == message["reasoning_content"]  # the thought itself was not masked
    assert not free["content"].lstrip().startswith("{")
    streamed = _chat(gated_server, "x", JSON_OBJECT, stream=True)
    assert (streamed["reasoning_content"], streamed["content"]) == (message["reasoning_content"], message["content"])


@pytest.mark.parametrize("extra", [JSON_OBJECT, {"tools": [WEATHER], "tool_choice": "required"},
                                   {"tools": [WEATHER], "tool_choice": {"type": "function",
                                                                        "function": {"name": "get_weather"}}}])
def test_a_thought_that_never_ends_is_returned_as_reasoning(gated_server, extra):
    choice = _chat(gated_server, "think", {**extra, "max_tokens": 16})
    message = choice["message"]
    assert message["reasoning_content"] and not message["content"]
    # A named function's call is its output after the thought, as vLLM returns it: here nothing.
    named = isinstance(extra.get("tool_choice"), dict)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    assert calls == ([("get_weather", "")] if named else [])
    assert choice["finish_reason"] == "length"
    streamed = _chat(gated_server, "think", {**extra, "max_tokens": 16}, stream=True)
    assert streamed["reasoning_content"] == message["reasoning_content"] and not streamed["content"]
