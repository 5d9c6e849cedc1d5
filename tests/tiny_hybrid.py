"""Tiny random checkpoints of the MoE and hybrid families, written by transformers itself.

Each family in its real checkpoint layout: Qwen3-MoE and Qwen3-Next as causal LMs (per-expert
tensors), Qwen3.5 dense and MoE as the VLM wrappers (`model.language_model.*`, a vision tower the
loader must skip). Weights are perturbed so norms are not identities and the DeltaNet decays vary.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.conftest import VOCAB, write_tokenizer

FAMILIES = ("qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe")

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=258,
              bos_token_id=None)
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)


def tiny_config(family: str, num_layers: int = 4, **overrides):
    import transformers

    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**{**COMMON, **MOE, "num_hidden_layers": num_layers,
                                              "intermediate_size": 96, "norm_topk_prob": True,
                                              "mlp_only_layers": [1], **overrides})
    if family == "qwen3_next":
        return transformers.Qwen3NextConfig(**{**COMMON, **MOE, **LINEAR, "num_hidden_layers": num_layers,
                                               "intermediate_size": 96, "shared_expert_intermediate_size": 48,
                                               "decoder_sparse_step": 2, **overrides})
    text = {**COMMON, **LINEAR, "num_hidden_layers": num_layers, **overrides}
    if family == "qwen3_5":
        cfg = transformers.Qwen3_5Config(text_config={**text, "intermediate_size": 96}, vision_config=TINY_VISION)
    elif family == "qwen3_5_moe":
        cfg = transformers.Qwen3_5MoeConfig(text_config={**text, **MOE, "shared_expert_intermediate_size": 48},
                                            vision_config=TINY_VISION)
    else:
        raise ValueError(family)
    cfg.tie_word_embeddings = False
    return cfg


def hf_model(family: str, cfg):
    import transformers

    if family == "qwen3_5":
        return transformers.Qwen3_5ForConditionalGeneration(cfg)
    if family == "qwen3_5_moe":
        return transformers.Qwen3_5MoeForConditionalGeneration(cfg)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def save_tiny_hybrid(out: Path, family: str, seed: int = 0, **overrides) -> Path:
    cfg = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = hf_model(family, cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                continue
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 8).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif "norm" in name:
                # Qwen3-MoE norms and the DeltaNet output norm scale by the weight, the others by 1 + weight.
                unit = family == "qwen3_moe" or "linear_attn.norm" in name
                p.copy_(0.1 * torch.randn_like(p) + (1.0 if unit else 0.0))
            elif "embed" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.08)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [258]}))
    return out


def save_all(root: Path) -> dict[str, Path]:
    return {family: save_tiny_hybrid(root / family, family) for family in FAMILIES}


def tiny_gated_deltanet(packed: bool, heads: int = 6, hk: int = 2, seed: int = 0, scale: float = 0.2):
    """One random GatedDeltaNet layer (16-wide heads, conv 4) with decays, gate biases and norm weights that vary;
    the other weights ~ N(0, scale^2)."""
    from blockspec.models.layers.gated_deltanet import GatedDeltaNet
    from blockspec.models.model_config import ModelConfig

    cfg = ModelConfig.from_dict(dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, linear_num_key_heads=hk, linear_num_value_heads=heads,
                                     linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                                     rms_norm_eps=1e-6))
    torch.manual_seed(seed)
    layer = GatedDeltaNet(cfg, packed_projections=packed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.empty_like(p).uniform_(0.5, 8).log())
            elif name == "dt_bias":
                p.copy_(torch.randn_like(p) * 0.5)
            elif name == "norm.weight":
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * scale)
    return layer
