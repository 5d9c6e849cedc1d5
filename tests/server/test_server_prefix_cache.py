"""Prefix caching seen from the API: usage.prompt_tokens_details.cached_tokens (chat and completions, whole
and streamed) and vLLM's prefix-cache counters on /metrics."""

from __future__ import annotations

import httpx

from tests.server.server_helpers import metric, sse_events

SYSTEM = "You are a terse assistant. " * 6  # 162 bytes: 10 full blocks of 16 tokens with the template around it


def test_cached_tokens_in_usage_and_the_metrics(tiny_server):
    url = tiny_server.base_url
    before = httpx.get(url + "/metrics").text
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello there"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0}
    first = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
    second = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
    n = first["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": (n - 1) // 16 * 16}
    assert second["spec_decode"]["cached_tokens"] == (n - 1) // 16 * 16
    stream_body = {**body, "messages": [messages[0], {"role": "user", "content": "another question"}],
                   "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=stream_body, timeout=60) as r:
        events = sse_events(list(r.iter_lines()))
    usage = events[-1]["usage"]
    assert 0 < usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]  # the system prompt
    prompt = SYSTEM + "complete this"
    completion = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0}
    httpx.post(url + "/v1/completions", json=completion, timeout=60)
    again = httpx.post(url + "/v1/completions", json={**completion, "n": 2, "stream": True,
                                                      "stream_options": {"include_usage": True}}, timeout=60)
    usage = sse_events(again.text.splitlines())[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == (len(prompt) - 1) // 16 * 16  # one prompt, n = 2
    after = httpx.get(url + "/metrics").text

    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert delta("vllm:prefix_cache_queries_total") >= 3 * n + 2 * len(prompt)
    assert delta("vllm:prefix_cache_hits_total") >= 2 * ((n - 1) // 16 * 16)
    assert 0 < delta("vllm:prefix_cache_hits_total") < delta("vllm:prefix_cache_queries_total")


def test_periodic_stats_line_reports_the_hit_rate():
    from blockspec.server.async_engine import EngineSnapshot
    from blockspec.server.stats_log import format_stats

    prev = EngineSnapshot(prompt_tokens=100, prefix_cache_queries=1000, prefix_cache_hits=100)
    cur = EngineSnapshot(prompt_tokens=300, prefix_cache_queries=1400, prefix_cache_hits=400)
    assert format_stats(prev, cur, 10.0)[0].endswith("Prefix cache hit rate: 75.0%")
