"""/metrics: vLLM's names, and the counters move when requests run."""

from __future__ import annotations

import httpx

from tests.server.server_helpers import metric


def test_counters_histograms_and_spec_decode_metrics_move(tiny_server):
    url = tiny_server.base_url
    before = httpx.get(url + "/metrics")
    assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain")
    body = {"model": "tiny", "prompt": "count me", "max_tokens": 20, "ignore_eos": True, "temperature": 0}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    spec = resp["spec_decode"]
    after = httpx.get(url + "/metrics").text
    old = before.text

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(old, name, **labels)

    assert delta("vllm:prompt_tokens_total") == resp["usage"]["prompt_tokens"]
    assert delta("vllm:generation_tokens_total") == 20
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    for hist in ("vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
        assert delta(hist + "_count") == 1, hist
    assert 0 < delta("vllm:spec_decode_num_drafts_total") <= spec["steps"]  # the last steps may draft nothing
    assert delta("vllm:spec_decode_num_draft_tokens_total") == spec["num_draft_tokens"] > 0
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == spec["num_accepted_tokens"]
    per_pos = [delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(4)]
    assert per_pos == spec["accepted_per_position"]
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="3"}' in after
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert f'{gauge}{{model_name="tiny"}}' in after


def test_periodic_stats_line_reports_throughput_and_draft_acceptance():
    from blockspec.server.async_engine import EngineSnapshot
    from blockspec.server.stats_log import format_stats

    prev = EngineSnapshot(prompt_tokens=100, generation_tokens=50, num_drafts=10, num_draft_tokens=40,
                          num_accepted_tokens=10, accepted_per_pos=(6, 3, 1, 0))
    cur = EngineSnapshot(num_running=2, kv_usage=0.25, prompt_tokens=300, generation_tokens=150, num_drafts=30,
                         num_draft_tokens=120, num_accepted_tokens=50, accepted_per_pos=(22, 14, 9, 5))
    assert len(format_stats(cur, cur, 10.0)) == 1  # busy with no new drafts: no speculation line
    lines = format_stats(prev, cur, 10.0)
    assert lines[0].startswith("Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 10.0 tokens/s")
    assert "Running: 2 reqs" in lines[0] and "KV cache usage: 25.0%" in lines[0]
    assert "Mean acceptance length: 3.00" in lines[1] and "Avg Draft acceptance rate: 50.0%" in lines[1]
    assert "Per-position acceptance rate: 0.800, 0.550, 0.400, 0.250" in lines[1]
    assert format_stats(EngineSnapshot(), EngineSnapshot(), 10.0) == []
