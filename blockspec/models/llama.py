"""Llama-style decoder (Llama, SmolLM, Qwen2, Qwen3): pre-norm attention + SwiGLU blocks.

The families differ only in small switches (q/k/v bias, per-head q/k RMSNorm), so one module
carries all of them; qwen2.py and qwen3.py name the switches. Parameter names follow the Hugging
Face checkpoints so weights load by name. `forward` can also return the DFlash context features:
the residual stream at the output of chosen layers, concatenated in the order asked for.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn

from blockspec.kernels.activation import silu_mul
from blockspec.kernels.rotary import rope_qk
from blockspec.kernels.skinny_linear import skinny_linear, skinny_supported
from blockspec.models import deterministic
from blockspec.models.layers.attention import PagedAttention
from blockspec.models.layers.linear import FusedLinear, Linear, fused_attention_residual, fused_swiglu_residual
from blockspec.models.layers.norm import RMSNorm
from blockspec.models.layers.quant_linear import QuantLinear
from blockspec.models.layers.rotary import RotaryEmbedding
from blockspec.models.model_config import ModelConfig
from blockspec.models.weight_utils import copy_named


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool,
                 sliding_window: int | None = None, sinks: bool = False) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        bias = qkv_bias or cfg.attention_bias
        self.qkv_proj = FusedLinear(h, [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, d**-0.5, sliding_window, sinks)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attend(positions, self.qkv_proj(x)))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Fused q|k|v projection [T, (nq + 2 nk) d] -> attention output [T, nq d], before o_proj."""
        t, nq, nk, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        stored = False
        if self.rotary.rotary_dim == d:
            # q/k norm, rotary and the K/V cache write in place on the fused projection (one kernel on GPU)
            norm_w = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else (None, None)
            eps = self.q_norm.eps if self.q_norm is not None else 0.0
            cache = self.attn.cache_for_store()
            rope_qk(qkv, positions, self.rotary.cos, self.rotary.sin, nq, nk, d, *norm_w, eps,
                    *(cache if cache is not None else ()))
            stored = cache is not None
            q = qkv[:, : nq * d].view(t, nq, d)
            k = qkv[:, nq * d:(nq + nk) * d].view(t, nk, d)
        else:
            q = qkv[:, : nq * d].view(t, nq, d)
            k = qkv[:, nq * d:(nq + nk) * d].view(t, nk, d)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(positions, q, k)
        v = qkv[:, (nq + nk) * d:].view(t, nk, d)
        return self.attn(q, k, v, stored=stored)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        h, i = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        self.gate_up_proj = FusedLinear(h, [i, i], bias=cfg.mlp_bias)
        self.down_proj = Linear(i, h, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._swiglu(x))

    def _swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up: a quantized gate|up folds it into its GEMM where its mma kernels take the rows
        (QuantLinear.forward_gated)."""
        if isinstance(self.gate_up_proj, QuantLinear):
            return self.gate_up_proj.forward_gated(x)
        return silu_mul(self.gate_up_proj(x))

    def forward_residual(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """h + self(x), h updated in place: a quantized down projection adds into h inside its GEMM (the
        quantized decode path; on the dot path the norm and SwiGLU folds measured slower than their own
        launches, so SwiGLU is folded only where the mma kernels take the rows: `_swiglu`)."""
        act = self._swiglu(x)
        if isinstance(self.down_proj, QuantLinear):
            return self.down_proj.forward_residual(act, h)
        return h.add_(self.down_proj(act))


class LlamaDecoderLayer(nn.Module):
    deterministic = False  # batch-invariant kernels (models/deterministic.py): set by the model's set_deterministic

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, qkv_bias, qk_norm)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The residual stream h in, the layer's output out. Decode and verify batches (<= 16 rows on
        GPU) take four skinny GEMMs with the norms, SwiGLU and residual adds folded in, updating h in
        place; everything else the unfused ops."""
        attn = self.self_attn
        if self.deterministic:
            h = deterministic.attention_residual(h, self.input_layernorm, attn.qkv_proj, attn.o_proj,
                                                 lambda qkv: attn.attend(positions, qkv))
            if not isinstance(self.mlp, LlamaMLP):  # an MoE block (Qwen3-MoE's sparse layers)
                return deterministic.moe_residual(h, self.post_attention_layernorm, self.mlp)
            return deterministic.swiglu_residual(h, self.post_attention_layernorm, self.mlp.gate_up_proj,
                                                 self.mlp.down_proj)
        if self._quantized or not skinny_supported(h, attn.qkv_proj.weight):
            a = attn(positions, self.input_layernorm(h))
            x, h = self.post_attention_layernorm(a, residual=h)  # fused residual add + norm
            if isinstance(self.mlp, LlamaMLP):  # h is the norm's fresh sum: updated in place
                return self.mlp.forward_residual(x, h)
            return h + self.mlp(x)
        h = fused_attention_residual(h, self.input_layernorm, attn.qkv_proj, attn.o_proj,
                                     lambda qkv: attn.attend(positions, qkv))
        if not isinstance(self.mlp, LlamaMLP):  # MoE blocks keep their own path
            return self.mlp.forward_norm_residual(h, self.post_attention_layernorm)  # the norm in the router GEMM
        return fused_swiglu_residual(h, self.post_attention_layernorm, self.mlp.gate_up_proj, self.mlp.down_proj)


    @functools.cached_property
    def _quantized(self) -> bool:
        """Whether a projection is quantized (QuantLinear: no bf16 `weight` for the fused path); fixed once the
        loader has swapped the modules in, before the first forward."""
        mlp = [self.mlp.gate_up_proj, self.mlp.down_proj] if isinstance(self.mlp, LlamaMLP) else []
        attn = self.self_attn
        return any(isinstance(p, QuantLinear) for p in (attn.qkv_proj, attn.o_proj, *mlp))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, qkv_bias: bool, qk_norm: bool, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, rotary, qkv_bias, qk_norm) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Target model: Llama architecture and its close relatives."""

    qkv_bias = False
    qk_norm = False
    supports_deterministic = True  # --deterministic (models/deterministic.py); subclasses not covered say False
    deterministic = False

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, self.qkv_bias, self.qk_norm, max_positions or cfg.max_position_embeddings)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    @property
    def state_layers(self) -> list[nn.Module]:
        """Token mixers with recurrent state (the hybrids' Gated DeltaNet layers): none here."""
        return []

    @property
    def prefill_graph_safe(self) -> bool:
        """Every row's computation stays in its row and the paged KV cache (dense MLPs, or MoE blocks that route
        each token on its own), so a short prefill padded to a bucket can be one CUDA graph
        (runner/prefill_graphs.py): padding rows only add expert work whose output is never read."""
        from blockspec.models.layers.moe import SparseMoeBlock

        return all(isinstance(layer.mlp, (LlamaMLP, SparseMoeBlock)) for layer in self.model.layers)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, capture_layer_ids: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the final-normed hidden states [T, H] and, if asked, the context features [T, n*H]."""
        h = self.embed(input_ids)
        hs = h.shape[-1]
        # layers may update h in place (decode), so captured layers are copied out as they finish
        features = h.new_empty(h.shape[0], len(capture_layer_ids) * hs) if capture_layer_ids else None
        for i, layer in enumerate(self.model.layers):
            h = layer(positions, h)
            for j, layer_id in enumerate(capture_layer_ids):
                if layer_id == i:
                    features[:, j * hs:(j + 1) * hs] = h
        if self.deterministic:  # the per-row kernel whatever the norm's module (the hybrids' zero-centred one)
            return deterministic.norm(h, self.model.norm), features
        return self.model.norm(h), features

    def set_deterministic(self, on: bool) -> None:
        """--deterministic: every decoder layer, its attention (and recurrent-state mixers) and the LM head take
        the batch-invariant kernels (models/deterministic.py); only for classes with supports_deterministic."""
        if on and not self.supports_deterministic:
            raise ValueError(f"{type(self).__name__} has no deterministic path")
        self.deterministic = on
        for module in (*self.model.layers, *self.attention_layers, *self.state_layers):
            module.deterministic = on

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Through skinny_linear: one decode row takes its kernel (8% faster than cuBLAS for Qwen3-8B's head
        on an H100); its dispatch sends larger heads with more rows to cuBLAS."""
        if self.deterministic:
            return deterministic.logits(hidden, self.lm_head_weight)
        return skinny_linear(hidden, self.lm_head_weight)

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy one checkpoint tensor into its parameter; False for names this model does not have."""
        if name == "lm_head.weight" and self.lm_head is None:
            return True  # tied checkpoints sometimes store the head too; the embedding is the head
        return copy_named(self, name, tensor)
