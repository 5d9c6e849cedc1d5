"""The pieces of bench without a server: prompt sets, percentiles, /metrics and response-stat parsing."""

from __future__ import annotations

import json

import pytest

from blockspec.bench.client import RequestOptions, RequestResult, SpecStats, api_root, build_body, spec_from_chunk
from blockspec.bench.metrics import parse_spec_counters
from blockspec.bench.prompts import BUILTIN_CLASSES, load_prompt_sets
from blockspec.bench.stats import RunResult, percentile, summarize
from blockspec.errors import ConfigError


def test_builtin_prompt_sets_and_limits(tmp_path):
    sets = load_prompt_sets("code,reasoning,dialogue,prose,json")
    assert list(sets) == list(BUILTIN_CLASSES)
    assert [p.id for p in sets["code"]] == ["sorting", "lru", "dijkstra", "mixed"]
    assert all(len(ps) >= 4 and all(p.messages[-1]["role"] == "user" for p in ps) for ps in sets.values())
    assert len(sets["dialogue"][0].messages) == 3  # a conversation to continue
    assert [p.id for p in load_prompt_sets("code:2")["code"]] == ["sorting", "lru"]
    he = load_prompt_sets("humaneval:3")["humaneval"]
    assert [p.id for p in he] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert he[0].text.startswith("from typing import List") and "def " in he[0].messages[0]["content"]
    f = tmp_path / "mine.jsonl"
    f.write_text(json.dumps({"prompt": "hello"}) + "\n\n" + json.dumps(
        {"id": "x", "class": "other", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}) + "\n")
    mine = load_prompt_sets(f"{f},prose:1")
    assert list(mine) == ["mine", "other", "prose"]
    assert mine["mine"][0].completion_text() == "hello" and mine["other"][0].max_tokens == 5
    for bad in ("poetry", str(tmp_path / "missing.jsonl")):
        with pytest.raises(ConfigError):
            load_prompt_sets(bad)


def test_request_body_and_urls():
    prompt = load_prompt_sets("code:1")["code"][0]
    chat = build_body(prompt, RequestOptions(model="m", max_tokens=7, ignore_eos=True))
    assert chat["messages"] == prompt.messages and chat["stream"] and chat["stream_options"]["include_usage"]
    assert chat["max_tokens"] == 7 and chat["ignore_eos"] and chat["return_meta_info"]
    comp = build_body(prompt, RequestOptions(model="m", endpoint="completions", meta_info=False))
    assert comp["prompt"].startswith("Write a Python module") and "return_meta_info" not in comp
    assert api_root("http://h:1/v1/") == api_root("http://h:1") == "http://h:1"


def test_percentiles_match_numpy():
    import numpy as np

    xs = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    for q in (0, 50, 95, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None


def test_prometheus_spec_counters_and_deltas():
    before = parse_spec_counters(
        '# HELP x\nvllm:spec_decode_num_drafts_total{model_name="m"} 10.0\n'
        'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 40.0\n'
        'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 12.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 8.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 4.0\n')
    after = parse_spec_counters(
        'vllm:spec_decode_num_drafts{engine="0"} 20\nvllm:spec_decode_num_draft_tokens{engine="0"} 80\n'
        'vllm:spec_decode_num_accepted_tokens{engine="0"} 27\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos{engine="0",position="0"} 17\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos{engine="0",position="1"} 10\n')
    spec = after.minus(before).to_spec()
    assert spec.steps == 10 and spec.tau == pytest.approx(2.5) and spec.accepted_per_position == [9, 6]
    assert spec.acceptance_rates() == [0.9, 0.6]
    assert parse_spec_counters("http_requests_total 3\n") is None
    cache0 = parse_spec_counters('vllm:prefix_cache_queries_total{model_name="m"} 100\n'
                                 'vllm:prefix_cache_hits_total{model_name="m"} 10\n')
    cache1 = parse_spec_counters('vllm:prefix_cache_queries_total{model_name="m"} 300\n'
                                 'vllm:prefix_cache_hits_total{model_name="m"} 160\n')
    assert cache1.minus(cache0).prefix_cache() == {"queries": 200, "hits": 150}
    assert cache1.minus(cache1).prefix_cache() is None


def test_response_stat_dialects():
    blockspec = {"choices": [], "spec_decode": {"tau": 2.5, "steps": 4, "accepted_per_position": [3, 2, 1, 0],
                                                "num_draft_tokens": 16}}
    s = spec_from_chunk(blockspec, 11)
    assert (s.steps, s.tau, s.accepted_per_position, s.source) == (4, 2.5, [3, 2, 1, 0], "response")
    sglang = {"choices": [], "meta_info": {"spec_verify_ct": 5, "spec_accept_length": 3.2}}
    assert spec_from_chunk(sglang, 16).tau == pytest.approx(3.2)
    assert spec_from_chunk({"choices": [], "meta_info": {"spec_verify_ct": 4}}, 12).tau == pytest.approx(3.0)
    assert spec_from_chunk({"choices": [{"delta": {"content": "x"}}]}, None) is None


def test_summary_takes_medians_of_runs_and_pools_latencies():
    def req(pid, tokens, ttft, e2e, spec=None):
        return RequestResult(pid, "code", ok=True, ttft=ttft, e2e=e2e, output_tokens=tokens, itl=[0.01] * 3,
                             tokens_from_usage=True, spec=spec)

    runs = [RunResult("code", 1, 0, 2.0, [req("a", 100, 0.1, 1.0, SpecStats(10, 30.0, 40, [8, 6, 4, 2])),
                                          req("b", 50, 0.2, 1.0)]),
            RunResult("code", 1, 1, 4.0, [req("a", 100, 0.1, 2.0), RequestResult("b", "code", error="HTTP 500")])]
    row = summarize(runs)
    assert (row["requests"], row["errors"], row["error_examples"]) == (4, 1, ["HTTP 500"])
    assert row["aggregate_tok_s_runs"] == [75.0, 25.0] and row["aggregate_tok_s"] == 50.0
    assert row["tok_s_per_request_runs"] == [75.0, 50.0]
    assert row["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert row["spec"]["tau"] == 3.0 and row["spec"]["acceptance_per_position"] == [0.8, 0.6, 0.4, 0.2]
    assert row["per_prompt"]["a"]["tok_s"] == pytest.approx(75.0) and row["per_prompt"]["a"]["tau"] == 3.0
    assert (row["prefix_cache_hit_rate"], row["prefix_cache_source"]) == (None, None)
    for r in runs[0].results:
        r.prompt_tokens, r.cached_tokens = 100, 60
    runs[1].results[0].prompt_tokens, runs[1].results[0].cached_tokens = 100, 90
    assert summarize(runs)["prefix_cache_hit_rate"] == pytest.approx(0.7)  # from the responses' usage
    runs[1].results[0].cached_tokens = None  # a server that does not say: the /metrics deltas instead
    runs[0].metrics_cache, runs[1].metrics_cache = {"queries": 300, "hits": 100}, {"queries": 100, "hits": 100}
    assert (summarize(runs)["prefix_cache_hit_rate"], summarize(runs)["prefix_cache_source"]) == (0.5, "metrics")
