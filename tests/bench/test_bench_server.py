"""`blockspec bench` against the real blockspec server, in-process on 127.0.0.1.

The embedded SmolLM2-135M (no drafter: tau must be exactly 1) with a few short requests, and the
tiny Qwen3 + DFlash drafter, where per-position acceptance read from the responses must agree with
the /metrics deltas.
"""

from __future__ import annotations

import json

import pytest

from blockspec.bench.report import JSON_NAME, MD_NAME, PNG_ACCEPTANCE, PNG_CONCURRENCY
from blockspec.cli import main
from blockspec.config import EngineConfig, SpeculativeConfig

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def embedded_server(default_model):
    from tests.server.server_helpers import start_server

    running = start_server(EngineConfig(model=None, max_model_len=1024, max_num_seqs=4),
                           served_model_names=["smollm2"], model_root="smollm2")
    yield running
    running.stop()


def test_bench_embedded_model_writes_every_file(embedded_server, tmp_path, capsys):
    rc = main(["bench", "--base-url", embedded_server.v1, "--prompts", "code:1,json:1", "--concurrency", "1,2",
               "--max-tokens", "6", "--runs", "2", "--warmup", "1", "--out", str(tmp_path), "--json"])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    data = json.loads((tmp_path / JSON_NAME).read_text())
    assert printed["results"] == data["results"] and data["model"] == "smollm2"
    for name in (PNG_CONCURRENCY, PNG_ACCEPTANCE):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC and (tmp_path / name).stat().st_size > 5000
    md = (tmp_path / MD_NAME).read_text()
    assert "| code | 1 |" in md and "| json | 2 |" in md and PNG_CONCURRENCY in md

    rows = data["results"]
    assert [(r["prompt_class"], r["concurrency"]) for r in rows] == [("code", 1), ("code", 2), ("json", 1),
                                                                      ("json", 2)]
    for r in rows:
        assert r["errors"] == 0 and r["runs"] == 2 and r["tokens_from_usage"] is True
        assert r["requests"] == 2 * r["concurrency"] and len(r["aggregate_tok_s_runs"]) == 2
        assert 0 < r["output_tokens"] <= 6 * r["requests"]
        assert 0 < r["ttft_ms"]["p50"] <= r["e2e_ms"]["p50"]
        assert r["tpot_ms"]["p50"] > 0 and r["itl_ms"]["p50"] > 0
        assert r["tok_s_per_request"] > 0 and r["aggregate_tok_s"] > 0
        assert r["spec"]["tau"] == 1.0 and r["spec"]["source"] == "response"  # no drafter: one token per step
        assert 0 < r["prefix_cache_hit_rate"] < 1 and r["prefix_cache_source"] == "response"  # prompts repeat
    for run in data["raw"]:
        for q in run["requests"]:
            assert q["ok"] and 1 <= q["output_tokens"] <= 6 and q["prompt_tokens"] > 10
            assert q["e2e"] >= q["ttft"] + sum(q["itl"]) - 1e-6
            assert q["tok_s"] == pytest.approx(q["output_tokens"] / q["e2e"])
            assert len(q["itl"]) <= q["output_tokens"] - 1
        assert run["wall_s"] > 0


def test_bench_reads_acceptance_from_responses_and_metrics(tiny_models, tiny_drafter, tmp_path, capsys):
    from tests.server.server_helpers import start_server

    running = start_server(EngineConfig(model=str(tiny_models["qwen3"]), max_model_len=512, max_num_seqs=4,
                                        speculative=SpeculativeConfig(model=str(tiny_drafter),
                                                                      num_speculative_tokens=4)))
    try:
        rc = main(["bench", "--base-url", running.base_url, "--prompts", "dialogue:2", "--concurrency", "1,2",
                   "--max-tokens", "24", "--runs", "1", "--warmup", "0", "--ignore-eos", "--out", str(tmp_path),
                   "--quiet"])
    finally:
        running.stop()
    assert rc == 0
    table = capsys.readouterr().out
    assert "dialogue" in table and "tau source: response" in table
    data = json.loads((tmp_path / JSON_NAME).read_text())
    for row, run in zip(data["results"], data["raw"]):
        spec = row["spec"]
        assert spec["source"] == "response" and len(spec["acceptance_per_position"]) == 4
        assert 1.0 <= spec["tau"] <= 5.0
        assert all(0.0 <= a <= 1.0 for a in spec["acceptance_per_position"])
        # The server's counters moved by exactly the accepted tokens the responses reported; they count
        # only steps that drafted, so a request's last step (k cut to 0 by max_tokens) is not among them.
        assert run["metrics_spec"]["accepted_per_position"] == spec["accepted_per_position"]
        assert 0 <= spec["steps"] - run["metrics_spec"]["steps"] <= row["requests"]
        assert row["output_tokens"] == 24 * row["requests"]  # --ignore-eos
    assert (tmp_path / PNG_ACCEPTANCE).read_bytes()[:8] == PNG_MAGIC
