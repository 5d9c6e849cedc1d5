"""Qwen3-MoE: the Qwen3 block (per-head q/k RMSNorm) with a sparse top-k expert MLP.

Layers are sparse unless `mlp_only_layers` or `decoder_sparse_step` make them dense (then a plain
SwiGLU of `intermediate_size`). Everything but the MLP is the Llama/Qwen3 code, so the model
reuses LlamaForCausalLM's interface (embed, forward with context features, logits).
"""

from __future__ import annotations

import torch
from torch import nn

from blockspec.models.layers.moe import SparseMoeBlock, load_expert_weight
from blockspec.models.layers.norm import RMSNorm
from blockspec.models.layers.rotary import RotaryEmbedding
from blockspec.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from blockspec.models.model_config import ModelConfig
from blockspec.models.weight_utils import copy_named


def mlp_for_layer(cfg: ModelConfig, layer: int) -> nn.Module:
    """The layer's MLP: a sparse MoE block where the config makes it sparse, else a dense SwiGLU."""
    moe = cfg.moe
    if moe is None or not moe.is_sparse(layer):
        return LlamaMLP(cfg)
    return SparseMoeBlock(cfg.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size,
                          moe.norm_topk_prob, moe.shared_intermediate_size)


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block (its forward) with Qwen3 attention and the layer's own MLP."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, layer: int) -> None:
        nn.Module.__init__(self)  # not LlamaDecoderLayer's: it would build a dense MLP first
        self.self_attn = LlamaAttention(cfg, rotary, qkv_bias=False, qk_norm=True)
        self.mlp = mlp_for_layer(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3MoeModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, layer_cls: type[nn.Module] = Qwen3MoeDecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim)
        self.layers = nn.ModuleList(layer_cls(cfg, rotary, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    layer_cls: type[nn.Module] = Qwen3MoeDecoderLayer
    supports_deterministic = True  # models/deterministic.moe_residual: fixed routing tiles and expert GEMM tiles

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        nn.Module.__init__(self)  # LlamaForCausalLM's interface, our own layers
        self.config = cfg
        self.model = Qwen3MoeModel(cfg, max_positions or cfg.max_position_embeddings, self.layer_cls)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        if name == "lm_head.weight" and self.lm_head is None:
            return True
        return load_expert_weight(self, name, tensor) or copy_named(self, name, tensor)
