"""Exported drafters load in blockspec and in z-lab's reference package, with identical tensors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from blockspec.loader.weights import load_weights
from blockspec.models.model_config import ModelConfig
from blockspec.spec.dflash import DFlashDrafter, DrafterConfig
from blockspec.train.drafter_init import build_training_drafter, pick_mask_token, spread_layer_ids
from blockspec.train.export import drafter_config_json, save_drafter, zlab_state_dict

dflash_model = pytest.importorskip("dflash.model", reason="test-only oracle: pip install --no-deps dflash")

SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
           "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "head_dim": 64, "rms_norm_eps": 1e-05, "rope_theta": 100000.0, "max_position_embeddings": 8192,
           "vocab_size": 49152, "tie_word_embeddings": True}


def test_export_loads_in_reference_and_blockspec(tmp_path, tiny_models):
    target = ModelConfig.from_dir(tiny_models["llama"])
    cfg_json = drafter_config_json(target, 2, 8, 300, [1, 3])
    drafter = build_training_drafter(DrafterConfig.from_dict(cfg_json), 128, torch.device("cpu"), seed=3)
    out = save_drafter(drafter, cfg_json, tmp_path / "d", dtype=torch.float32)
    saved = json.loads((out / "config.json").read_text())
    assert saved["architectures"] == ["DFlashDraftModel"] and saved["block_size"] == 8
    assert saved["dflash_config"] == {"mask_token_id": 300, "target_layer_ids": [1, 3]}
    tensors = load_file(str(out / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_norm.weight",
            "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
            "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight"} <= set(tensors)
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in tensors)  # fused weights split back

    ref = dflash_model.DFlashDraftModel.from_pretrained(out, dtype=torch.float32)
    assert ref.block_size == 8 and ref.mask_token_id == 300 and list(ref.target_layer_ids) == [1, 3]
    ref_params = dict(ref.named_parameters())
    assert set(tensors) == set(ref_params)  # z-lab's names and shapes, nothing more or less
    for name, t in zlab_state_dict(drafter).items():
        assert ref_params[name].shape == t.shape == tensors[name].shape
        torch.testing.assert_close(ref_params[name].detach(), t, rtol=0, atol=0)

    # blockspec -> export -> blockspec: every parameter back bit for bit (q/k/v, gate/up into the fused slices)
    again = DFlashDrafter(DrafterConfig.from_dir(out), 128)
    load_weights(again, out, "cpu", torch.float32)
    mine = dict(drafter.named_parameters())
    assert set(dict(again.named_parameters())) == set(mine)
    for name, p in again.named_parameters():
        assert torch.equal(p, mine[name]), name

    back = DrafterConfig.from_dir(out)
    back.check_target(target)
    assert back.block_size == 8 and back.target_layer_ids == [1, 3] and back.mask_token_id == 300


def test_default_smollm2_drafter_fits_in_25_mb():
    target = ModelConfig.from_dict(SMOLLM2)
    layer_ids = spread_layer_ids(target.num_hidden_layers)
    assert layer_ids == [1, 8, 14, 20, 27]  # z-lab's spread (round half to even)
    cfg = DrafterConfig.from_dict(drafter_config_json(target, 2, 16, 16, layer_ids))
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg, 64)
    size = sum(p.numel() * 2 for p in drafter.parameters())  # bf16
    assert size <= 25_000_000


def test_mask_token_prefers_an_unused_special_token():
    class Tok:
        bos_token_id, eos_token_id, pad_token_id, unk_token_id = 1, 2, 2, None
        chat_template = "<|im_start|>{{ m }}<|im_end|>"
        added_tokens_decoder = {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>", 5: "<file_sep>",
                                7: "<gh_stars>"}

    counts = torch.zeros(20, dtype=torch.long)
    assert pick_mask_token(Tok(), counts, 20) == 7
    counts[7] = 3
    assert pick_mask_token(Tok(), counts, 20) == 5
    counts[5] = counts[0] = 1
    counts[19] = 1
    assert pick_mask_token(Tok(), counts, 20) == 18  # no unused special: the highest unused id
