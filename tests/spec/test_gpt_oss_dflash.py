"""DFlash drafters on GPT-OSS targets: the published drafter shape loads against the published target,
greedy speculation through the engine equals z-lab's reference loop (transformers' gpt_oss target) and
greedy autoregressive decoding, over ragged batches, chunked prefill, the decode path and preemption."""

from __future__ import annotations

import pytest
import torch
import transformers

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine, build_module
from blockspec.engine.sampling_params import SamplingParams
from blockspec.models.model_config import ModelConfig
from blockspec.spec.dflash import DFlashDrafter, DrafterConfig
from tests.engine.test_lossless import PROMPTS, run_all
from tests.tiny_gpt_oss import save_tiny_gpt_oss, save_tiny_gpt_oss_drafter, save_tiny_gpt_oss_mxfp4

dflash_model = pytest.importorskip("dflash.model", reason="test-only oracle: pip install --no-deps dflash")

# z-lab/gpt-oss-20b-DFlash's config.json as published, and gpt-oss-20b's shape fields
GPT_OSS_20B_DRAFTER = {
    "architectures": ["DFlashDraftModel"], "attention_bias": True, "attention_dropout": 0.0, "block_size": 8,
    "bos_token_id": 199998, "dflash_config": {"mask_token_id": 200000, "target_layer_ids": [1, 6, 11, 16, 21]},
    "dtype": "bfloat16", "eos_token_id": 200002, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 7680,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64, "num_hidden_layers": 8,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 150000, "vocab_size": 201088}
GPT_OSS_20B = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088,
               "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
               "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4,
               "sliding_window": 128, "attention_bias": True}
GREEDY = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Target (bf16 layout: the expert reference loop of MXFP4 would cost seconds on CPU) and drafter."""
    root = tmp_path_factory.mktemp("gpt_oss_dflash")
    target = save_tiny_gpt_oss(root / "target")
    return target, save_tiny_gpt_oss_drafter(root / "drafter", target)


@pytest.fixture(scope="module")
def ar_reference(pair) -> dict[str, list[int]]:
    engine = Engine(EngineConfig(model=str(pair[0]), device="cpu"))
    return {f"r{i}": engine.generate([p], GREEDY)[0].token_ids for i, p in enumerate(PROMPTS)}


def test_published_drafter_loads_for_the_published_target():
    cfg = DrafterConfig.from_dict(GPT_OSS_20B_DRAFTER)
    cfg.check_target(ModelConfig.from_dict(GPT_OSS_20B))
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (8, 200000, [1, 6, 11, 16, 21])
    assert all(cfg.layer_mask_kind(i) == (False, None) for i in range(8))  # non-causal, no window
    drafter = build_module(lambda: DFlashDrafter(cfg, 64), torch.device("meta"), torch.bfloat16)
    assert drafter.layers[0].self_attn.qkv_proj.bias is not None and drafter.layers[0].self_attn.o_proj.bias is not None
    size = sum(p.numel() * p.element_size() for p in drafter.parameters())
    assert size == pytest.approx(1.46 * 2**30, rel=0.01)  # the published checkpoint's 1.46 GiB


def test_greedy_loop_matches_dflash_generate(pair, tmp_path):
    """MXFP4 experts here: transformers dequantizes them for the reference loop, we keep them packed."""
    target_dir, draft_dir = save_tiny_gpt_oss_mxfp4(tmp_path / "mxfp4"), pair[1]
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32,
                                                               attn_implementation="eager").float().eval()
    ref_drafter = dflash_model.DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (13,), generator=torch.Generator().manual_seed(13)).tolist()
    with torch.no_grad():
        ref = dflash_model.dflash_generate(ref_drafter, target, torch.tensor([ids]), max_new_tokens=30,
                                           stop_token_ids=None, temperature=0.0)[0, len(ids):].tolist()
    spec = SpeculativeConfig(model=str(draft_dir), num_speculative_tokens=15)
    engine = Engine(EngineConfig(model=str(target_dir), device="cpu", speculative=spec))
    assert engine.generate([ids], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].token_ids == ref


@pytest.mark.parametrize("k", [3, 7])
def test_dflash_greedy_equals_autoregressive(pair, ar_reference, k):
    spec = SpeculativeConfig(model=str(pair[1]), num_speculative_tokens=k)
    engine = Engine(EngineConfig(model=str(pair[0]), device="cpu", speculative=spec, max_num_batched_tokens=24))
    assert run_all(engine, PROMPTS, GREEDY) == ar_reference
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_high_acceptance_with_preemption_equals_autoregressive(pair, ar_reference, monkeypatch):
    """Known continuations (most drafts right) with a KV cache small enough to preempt and recompute."""
    block = 16 * 4 * 2 * 2 * 16 * 4  # tokens x layers x (K, V) x kv heads x head_dim x fp32
    engine = Engine(EngineConfig(model=str(pair[0]), device="cpu", max_num_batched_tokens=20, max_model_len=96,
                                 kv_cache_memory=7 * block))
    engine.enable_synthetic_drafts(ar_reference, 0.9, 15)
    preempted = []
    preempt = engine.scheduler._preempt
    monkeypatch.setattr(engine.scheduler, "_preempt", lambda seq, out: (preempted.append(seq), preempt(seq, out)))
    assert run_all(engine, PROMPTS, GREEDY) == ar_reference
    assert preempted
