"""bench/hybrid_gpu.py's tiny CPU mode end to end: the flow the GPU run takes, on tiny configs, in seconds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import hybrid_gpu  # noqa: E402
import hybrid_parts  # noqa: E402

from blockspec.models.layers import moe  # noqa: E402


@pytest.fixture
def routing_hooks(monkeypatch):
    """SparseMoeBlock's route_override / record_routing hooks: the real ones when the tree has them, else a
    stand-in forward with the same contract, so the script's routing measurements run either way."""
    block = moe.SparseMoeBlock(16, 4, 2, 8, True)
    if hasattr(block, "route_override") and hasattr(block, "record_routing"):
        return

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        override = self.route_override
        weights, ids = override(logits) if override is not None else moe.route(logits, self.top_k, self.renormalize)
        if self.record_routing:
            self.last_ids = ids
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    monkeypatch.setattr(moe.SparseMoeBlock, "route_override", None, raising=False)
    monkeypatch.setattr(moe.SparseMoeBlock, "record_routing", False, raising=False)
    monkeypatch.setattr(moe.SparseMoeBlock, "forward", forward)


def test_tiny_cpu_flow(tmp_path, routing_hooks, capsys):
    args = ["--device", "cpu", "--tiny", "--in-process", "--tokens", "8", "--runs", "1", "--context", "32",
            "--out", str(tmp_path)]
    hybrid_gpu.main(args)
    res = json.loads((tmp_path / "hybrid_gpu.json").read_text())
    assert res["settings"]["tiny"] and res["copy_bandwidth_GBps"] > 0 and res["commit"]
    assert res["env"]["checks"]["moe_grouped_vs_reference"]["tokens_16"]["max_rel_err"] < 1e-4
    eq = res["graphs_vs_eager"]
    assert all(eq[key][f"k{k}_equal"] for key in ("27b", "35b", "coder30b") for k in (0, 15))
    models = {m["key"]: m for m in res["models"]}
    assert list(models) == list(hybrid_gpu.ORDER)
    for key, m in models.items():
        assert "error" not in m and "skipped" not in m, (key, m.get("error"), m.get("skipped"))
        assert m["ar"]["tok_s"] > 0 and m["k15"]["uniform"]["step_ms"] > 0 and m["verify"]["uniform"]["step_ms"] > 0
        assert 0 < m["ar_bytes_per_token"] <= m["bytes"]["total"] and m["roofline_tok_s"] > 0
        assert m["ar"]["steps"] == 7 and m["k15"]["uniform"]["tau"] >= 1
        # the verify steps alone: synthetic drafts in every routing mode (a re-capture keeps them)
        assert {v["drafts"] for v in m["verify"].values()} == {"synthetic"}, key
    assert models["4b"]["bytes"]["embedding"] == 0 and models["4b"]["bytes"]["lm_head"] > 0  # tied: read as the head
    for key in ("35b", "coder30b"):  # MoE: experts touched by 16-token verify passes, both routers
        rout, split = models[key]["routing"], models[key]["bytes"]
        top_k, num_experts = split["experts"][0]["top_k"], split["experts"][0]["num_experts"]
        for mode in ("uniform", "correlated"):
            for blocks in ("k15_blocks", "verify_blocks"):
                assert top_k <= rout[mode][blocks]["mean"] <= num_experts and rout[mode][blocks]["steps"] > 0
            assert models[key]["verify"][mode]["weight_bytes"] == pytest.approx(
                hybrid_parts.step_bytes(split, rout[mode]["verify_blocks"]["per_layer"]))
        assert rout["keep_per_token"] == 1  # round(0.5 * top-2)
        assert models[key]["ar_bytes_per_token"] < models[key]["verify"]["uniform"]["weight_bytes"]
    conc = models["27b"]["concurrency"]
    assert set(conc) == {"1", "4", "16"} and all(c["tok_s"] > 0 for c in conc.values())
    m27 = models["27b"]  # the k15 step's bytes: target + drafter layers + the LM head again, over AR's
    assert m27["k15_bytes_over_ar"] == pytest.approx(
        (m27["ar_bytes_per_token"] + m27["drafter_weight_bytes"] + m27["bytes"]["lm_head"]) / m27["ar_bytes_per_token"])
    assert m27["k15_bytes_over_ar"] > 1
    metrics = {(t["model"], t["metric"]) for t in res["targets"]}
    assert ("Qwen3.6-27B (tiny)", "k15_over_ar") in metrics
    k15 = next(t for t in res["targets"] if t["metric"] == "k15_over_ar")
    assert k15["bytes_bound"] == m27["k15_bytes_over_ar"]
    assert ("Qwen3-Coder-30B-A3B (tiny)", "verify_fraction (correlated)") in metrics
    out = capsys.readouterr().out.rstrip().splitlines()
    table_at = next(i for i, line in enumerate(out) if line.startswith("| model |"))
    assert out[table_at - 2].startswith("wrote ") and out[-1].startswith("target ")  # the table comes last


def test_spawn_records_failures(tmp_path):
    crash = hybrid_gpu.spawn([sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path / "a.json", 30)
    assert crash["error"] == "exit status 3 (nothing recorded)"
    part = tmp_path / "b.json"
    partial = hybrid_gpu.spawn([sys.executable, "-c", f"import pathlib, sys; pathlib.Path({str(part)!r})"
                                f".write_text('{{\"ar\": 1}}'); sys.exit(1)"], part, 30)
    assert partial["ar"] == 1 and partial["error"] == "exit status 1"
    slow = hybrid_gpu.spawn([sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "c.json", 0.5)
    assert slow["error"].startswith("timed out")


def test_gpt_oss_published_shapes_and_tiny_flow(tmp_path):
    """gpt-oss-20b / 120b in their published shapes: parameter counts as the model cards state them, the bytes
    held (MXFP4 experts) and whether the 120b fits one H200 with its drafter; then the tiny CPU flow (one
    model: the two differ only in depth and expert count, which the tiny dimensions replace)."""
    from blockspec.bench.footprint import target_footprint

    sizes = {}
    for key, params in (("gptoss20b", 20.9e9), ("gptoss120b", 116.8e9)):
        cfg = hybrid_gpu.CONFIGS[key]
        assert target_footprint(cfg, "bfloat16").total_params == pytest.approx(params, rel=2e-3)
        draft, _ = hybrid_parts.drafter_config(cfg, hybrid_gpu.MASK_TOKEN[key], layers=5)
        draft.update(hybrid_gpu.drafter_shape(key, tiny=False))
        sizes[key] = hybrid_parts.param_bytes_estimate(cfg, draft, torch.bfloat16)
        assert sizes[key] == target_footprint(cfg, "bfloat16").weight_bytes + 1_569_534_208  # + the drafter's
    assert sizes["gptoss120b"] == pytest.approx(66.8e9, rel=1e-2) and sizes["gptoss120b"] < 141e9 - 10e9  # H200
    hybrid_gpu.main(["--device", "cpu", "--tiny", "--in-process", "--tokens", "8", "--runs", "1", "--context", "32",
                     "--models", "gptoss120b", "--skip-equality", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "hybrid_gpu.json").read_text())
    assert res["env"]["checks"]["quantized_experts_cuda_graph"]["capturable"]  # CPU: no graphs to refuse it
    for m in res["models"]:
        assert "error" not in m, m.get("error")
        assert m["ar"]["tok_s"] > 0 and m["k15_over_ar"] > 0 and m["roofline_tok_s"] > 0
        experts = m["bytes"]["experts"][0]
        # tiny: gate|up [256, 64] and down [64, 128] as E2M1 bytes + an E8M0 scale per 32, fp32 biases
        assert experts["scheme"] == "mxfp4" and experts["bytes_per_expert"] == 8704 + 4352 + 1280
        assert m["drafter_config"]["attention_bias"] and m["drafter_config"]["model_type"] == "gpt_oss"


def test_122b_nvfp4_shape_and_tiny_flow(tmp_path):
    """Qwen3.5-122B-A10B in NVFP4 (issue 14's H200 run): the published shape (122.11B parameters) held at ~71 GB
    with its experts quantized, + a 1.5 GB drafter, leaving an H200 room for the KV cache; then that path's
    tiny CPU flow: dummy NVFP4 weights, the load-memory record beside the weights (no peak counter on CPU)."""
    from blockspec.bench.footprint import target_footprint

    assert target_footprint(hybrid_gpu.CONFIGS["122b"], "bfloat16").total_params == pytest.approx(122.11e9, rel=1e-3)
    cfg = hybrid_gpu.model_config("122b", False, "nvfp4")
    draft, _ = hybrid_parts.drafter_config(cfg, hybrid_gpu.MASK_TOKEN["122b"], layers=5)
    target = hybrid_parts.param_bytes_estimate(cfg, None, torch.bfloat16)
    assert 68e9 < target < 73e9 and target == pytest.approx(target_footprint(cfg, "bfloat16").weight_bytes, rel=1e-2)
    assert hybrid_parts.param_bytes_estimate(cfg, draft, torch.bfloat16) - target < 2e9 and target < 141e9 - 60e9
    hybrid_gpu.main(["--device", "cpu", "--tiny", "--in-process", "--tokens", "8", "--runs", "1", "--context", "32",
                     "--models", "122b", "--quant", "nvfp4", "--skip-equality", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "hybrid_gpu_nvfp4.json").read_text())
    (m,) = res["models"]
    assert "error" not in m, m.get("error")
    assert m["ar"]["tok_s"] > 0 and m["k15_over_ar"] > 0 and m["bytes"]["experts"][0]["scheme"] == "nvfp4"
    load = m["load_memory"]
    assert load["weight_bytes"] == m["bytes"]["total"] + m["drafter_weight_bytes"] == m["weights_estimate_bytes"]
    assert load["peak_bytes"] is None and "note" in load
    assert [(t["metric"], t["pass"]) for t in res["targets"]] == [("load_peak_over_weights_GB", None)]


def test_models_none_runs_the_checks_only():
    assert hybrid_gpu.parse_args(["--models", "none"]).models == []
    assert hybrid_gpu.parse_args([]).models == list(hybrid_gpu.ORDER)
