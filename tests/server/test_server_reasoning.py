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
