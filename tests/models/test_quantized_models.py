"""Quantized targets end to end (CPU, fp32): logits equal transformers' on the dequantized checkpoint, greedy
DFlash equals greedy autoregressive decoding, and memory figures count the bytes the layouts hold.

The oracle checkpoints come from tests/loader/quant_helpers.py: compressed-tensors' own compression and
decompression, or GPTQ / ModelOpt tensors packed from their definitions.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers

from blockspec.bench.footprint import target_footprint
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.memory import weight_bytes
from blockspec.engine.sampling_params import SamplingParams
from blockspec.engine.scheduler import ScheduledSeq
from blockspec.engine.sequence import Sequence
from blockspec.models.layers.quant_linear import QuantLinear
from blockspec.runner.model_runner import ModelRunner
from tests.engine.test_lossless import run_all
from tests.loader.quant_helpers import write_ct_checkpoint, write_packed_checkpoint
from tests.loader.quant_model import load_quantized
from tests.tiny_hybrid import save_tiny_hybrid

pytest.importorskip("compressed_tensors")

TOL = dict(rtol=1e-4, atol=1e-4)
PROMPTS = ["hello world", "a" * 37, "The quick brown fox jumps over", "def f(n):\n    return"]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_hybrid")
    return {f: save_tiny_hybrid(root / f, f, num_layers=4) for f in ("qwen3_moe", "qwen3_5", "qwen3_next")}


def _source(family, tiny_models, hybrids):
    return tiny_models[family] if family in tiny_models else hybrids[family]


def _hf(path, family):
    cls = transformers.AutoModelForImageTextToText if family.startswith("qwen3_5") else \
        transformers.AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def _our_logits(model, ids):
    """One-shot prefill of the first 16 tokens, then token-by-token decode through the paged runner."""
    if getattr(model, "has_recurrent_state", False):
        model.allocate_state(4)
    runner = ModelRunner(model, None, torch.device("cpu"), torch.float32, block_size=16)
    runner.allocate_kv_cache(8)
    seq = Sequence("t", ids, SamplingParams(temperature=0), None, [], None)
    seq.block_table, seq.state_slot = [3, 5], 0
    parts = []
    with torch.inference_mode():
        for n in [16] + [1] * (len(ids) - 16):
            hidden, _, _ = runner._target([ScheduledSeq(seq, n, 0)], None)
            if hasattr(model, "commit_state"):
                model.commit_state([seq], [n])
            seq.num_computed += n
            parts.append(model.compute_logits(hidden))
    return torch.cat(parts)


@pytest.mark.parametrize("family,fmt", [
    ("qwen3", "ct:int4_asym_g32"), ("qwen3", "ct:nvfp4"), ("qwen2", "ct:fp8_tensor"), ("qwen3_moe", "ct:fp8_channel"),
    ("qwen3_5", "ct:nvfp4"), ("qwen3_next", "ct:int4_g32"), ("qwen3", "gptq-act-order"),
    ("qwen3_moe", "modelopt-nvfp4"), ("qwen3_5", "awq"),
])
def test_logits_match_the_dequantized_model(tiny_models, hybrids, tmp_path, family, fmt):
    src = _source(family, tiny_models, hybrids)
    if fmt.startswith("ct:"):
        out, ref = write_ct_checkpoint(src, tmp_path / "q", fmt[3:])
    else:
        method = fmt.removesuffix("-act-order")
        out, ref = write_packed_checkpoint(src, tmp_path / "q", method, act_order=fmt.endswith("act-order"),
                                           sym=method != "gptq")
    ids = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        want = _hf(ref, family)(torch.tensor([ids])).logits[0]
    model = load_quantized(out)
    assert any(isinstance(m, QuantLinear) for m in model.modules())
    torch.testing.assert_close(_our_logits(model, ids), want, **TOL)


def _run(engine: Engine) -> dict[str, list[int]]:
    return run_all(engine, PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def quantized_qwen3(tiny_models, tmp_path_factory):
    return write_ct_checkpoint(tiny_models["qwen3"], tmp_path_factory.mktemp("qq") / "int4", "int4_asym_g32")[0]


def test_greedy_dflash_equals_autoregressive_on_a_quantized_target(quantized_qwen3, tiny_drafter):
    ar = _run(Engine(EngineConfig(model=str(quantized_qwen3), device="cpu", quantization="compressed-tensors")))
    for k in (4, 15):
        spec = SpeculativeConfig(model=str(tiny_drafter), num_speculative_tokens=k)
        engine = Engine(EngineConfig(model=str(quantized_qwen3), device="cpu", speculative=spec,
                                     max_num_batched_tokens=24))
        assert _run(engine) == ar
        assert engine.allocator.num_free == engine.allocator.num_blocks


def test_hybrid_nvfp4_target_lossless_with_high_acceptance(hybrids, tmp_path):
    out, _ = write_ct_checkpoint(hybrids["qwen3_5"], tmp_path / "nvfp4", "nvfp4")
    ar = _run(Engine(EngineConfig(model=str(out), device="cpu")))
    engine = Engine(EngineConfig(model=str(out), device="cpu", max_num_batched_tokens=20))
    engine.enable_synthetic_drafts(ar, 0.85, 7)
    assert _run(engine) == ar


def test_start_up_report_and_plan_count_the_quantized_bytes(quantized_qwen3, caplog):
    with caplog.at_level(logging.INFO, logger="blockspec"):
        engine = Engine(EngineConfig(model=str(quantized_qwen3), device="cpu"))
    total, quantized = weight_bytes(engine.runner.target)
    assert 0 < quantized < total
    assert "of it quantized layers" in caplog.text
    config = json.loads((quantized_qwen3 / "config.json").read_text())
    plan = target_footprint(config, "float32", model_dir=quantized_qwen3)
    assert plan.weight_bytes == total  # plan's figure is what the engine holds
    assert plan.read_bytes_per_token < plan.weight_bytes
    unquantized = target_footprint({k: v for k, v in config.items() if k != "quantization_config"}, "float32")
    assert plan.weight_bytes < unquantized.weight_bytes


def test_dummy_weights_in_quantized_layouts(quantized_qwen3):
    engine = Engine(EngineConfig(model=str(quantized_qwen3), device="cpu", load_format="dummy"))
    assert isinstance(engine.runner.target.model.layers[0].self_attn.qkv_proj, QuantLinear)
    out = engine.generate(["hi"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_plan_and_start_up_report_count_int4s_packed_scales(quantized_qwen3, caplog):
    """In bfloat16 an int4 layer holds its scales and zeros as one int32 a group (scale_zero, what the kernels
    read): the engine's weight bytes and plan's figure both count it, as the only copy of them."""
    with caplog.at_level(logging.INFO, logger="blockspec"):
        engine = Engine(EngineConfig(model=str(quantized_qwen3), device="cpu", dtype="bfloat16"))
    total, quantized = weight_bytes(engine.runner.target)
    layers = [m for m in engine.runner.target.modules() if isinstance(m, QuantLinear)]
    packed = sum(m.scale_zero.numel() * 4 for m in layers)
    assert packed and quantized == sum(m.qweight.numel() for m in layers) + packed
    assert "of it quantized layers" in caplog.text
    config = json.loads((quantized_qwen3 / "config.json").read_text())
    plan = target_footprint(config, "bfloat16", model_dir=quantized_qwen3)
    assert plan.weight_bytes == total
