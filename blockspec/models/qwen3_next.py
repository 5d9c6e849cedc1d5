"""Qwen3-Next: hybrid decoder of Gated DeltaNet layers and gated full-attention layers, MoE MLPs.

Every `full_attention_interval`-th layer (or as `layer_types` says) is softmax attention whose
q_proj also emits a per-head output gate (sigmoid), with zero-centred q/k RMSNorm and rotary on a
fraction of each head (`partial_rotary_factor`); the others are Gated DeltaNet linear attention
with a recurrent state per sequence. Norms are zero-centred (scale = 1 + weight). The MLP of each
layer is sparse or dense as the config says (qwen3_moe.mlp_for_layer).

Qwen3.5/3.6 (qwen3_5.py) is this model with unpacked DeltaNet projections. Recurrent state
lives in per-layer slots (models/layers/recurrent_state.py): `allocate_state` makes them, the
runner's per-step StateMetadata points each sequence at its slot, `commit_state` rolls verify
blocks forward to their last accepted token.
"""

from __future__ import annotations

import torch
from torch import nn

from blockspec.kernels.rms_norm import rms_norm_ref
from blockspec.kernels.rotary import NORM_ZERO_CENTERED, rope_heads
from blockspec.models import deterministic
from blockspec.models.layers.attention import PagedAttention, current_metadata
from blockspec.models.layers.gated_deltanet import GatedDeltaNet
from blockspec.models.layers.linear import FusedLinear, Linear, folded_linear, folds, fused_swiglu_residual
from blockspec.models.layers.moe import load_expert_weight
from blockspec.models.layers.recurrent_state import (
    SLOTS_PER_SEQUENCE,
    DecodeStateMetadata,
    LayerState,
    bytes_per_sequence,
    physical_slots,
    state_dtype_of,
)
from blockspec.models.layers.rotary import RotaryEmbedding
from blockspec.models.llama import LlamaForCausalLM, LlamaMLP
from blockspec.models.model_config import ModelConfig
from blockspec.models.qwen3_moe import mlp_for_layer
from blockspec.models.weight_utils import copy_named


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm with scale (1 + weight), computed in float32 and cast back (Qwen3-Next, Qwen3.5)."""

    zero_centered = True  # --deterministic runs it through kernels/rms_norm.py's zero-centred form

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, self.weight, self.eps, zero_centered=True)[0]

    def kernel_weight(self) -> torch.Tensor:
        """1 + weight, for GEMMs that fold the norm in; recomputed only when the weight changes (loading)."""
        cached = self.__dict__.get("_scale")
        if cached is None or cached[0] != self.weight._version:
            cached = (self.weight._version, (1.0 + self.weight.float()).to(self.weight.dtype))
            self.__dict__["_scale"] = cached
        return cached[1]


class GatedAttention(nn.Module):
    """Paged softmax attention whose output is gated per channel by sigmoid(gate), gate from q_proj.

    q_proj emits [q, gate] per head; q|k|v are one fused GEMM (checkpoint names load into its slices).
    """

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.qkv_proj = FusedLinear(h, [self.num_heads * d * 2, self.num_kv_heads * d, self.num_kv_heads * d], bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(d, cfg.rms_norm_eps)
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, d**-0.5)

    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        t, nq, nk, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, gate = qkv[:, : 2 * nq * d].view(t, nq, 2 * d).chunk(2, dim=-1)
        k = qkv[:, 2 * nq * d:(2 * nq + nk) * d].view(t, nk, d)
        v = qkv[:, (2 * nq + nk) * d:].view(t, nk, d)
        return q, gate, k, v

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, gate, k, v = self._split(self.qkv_proj(x))
        q, k = self.rotary(positions, self.q_norm(q), self.k_norm(k))
        return self.o_proj(self.attn(q.contiguous(), k, v, gate=gate))

    def forward_residual(self, positions: torch.Tensor, h: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """Decode rows on the GPU: h += o_proj(attention(norm(h))) with the norm folded into the q|k|v GEMM,
        q/k norms, partial rotary and the K/V cache write in one kernel, the add in o_proj's GEMM."""
        nq, nk, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = folded_linear(h, self.qkv_proj, norm)
        cache = self.attn.cache_for_store()
        rope_heads(qkv, positions, self.rotary.cos, self.rotary.sin, nq, nk, d, 2 * d, 2 * nq * d,
                   (2 * nq + nk) * d, NORM_ZERO_CENTERED, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                   *(cache if cache is not None else ()))
        q, gate, k, v = self._split(qkv)
        # q and the gate stay views of the projection: the paged kernel reads q by strides and gates its output
        # in the merge launch (the copy, sigmoid and product were three launches a layer of their own)
        out = self.attn(q, k, v, stored=cache is not None, gate=gate)
        return folded_linear(out, self.o_proj, residual=h)


class HybridDecoderLayer(nn.Module):
    deterministic = False  # batch-invariant kernels (models/deterministic.py): set by the model's set_deterministic

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, layer: int, packed_projections: bool) -> None:
        super().__init__()
        linear = cfg.layer_types[layer] == "linear_attention"
        self.linear_attn = GatedDeltaNet(cfg, packed_projections) if linear else None
        self.self_attn = None if linear else GatedAttention(cfg, rotary)
        self.mlp = mlp_for_layer(cfg, layer)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The residual stream in, the layer's output out. Uniform decode/verify rows on the GPU take the
        fused path (norms folded into GEMMs, residual adds in place); everything else the plain ops. Under
        --deterministic every row takes the batch-invariant kernels (models/deterministic.py), never the fused path."""
        if self.deterministic:
            return self._forward_deterministic(positions, h)
        mixer = self.linear_attn if self.linear_attn is not None else self.self_attn
        if self._fused(h, mixer):
            if self.linear_attn is not None:
                h = self.linear_attn.forward_residual(h, self.input_layernorm)
            else:
                h = self.self_attn.forward_residual(positions, h, self.input_layernorm)
            if isinstance(self.mlp, LlamaMLP):
                return fused_swiglu_residual(h, self.post_attention_layernorm, self.mlp.gate_up_proj,
                                             self.mlp.down_proj)
            return self.mlp.forward_norm_residual(h, self.post_attention_layernorm)  # the norm in the router GEMM
        x = self.input_layernorm(h)
        x = self.linear_attn(x) if self.linear_attn is not None else self.self_attn(positions, x)
        h = h + x
        if isinstance(self.mlp, LlamaMLP):  # the fresh h updated in place (a quantized down adds in its GEMM)
            return self.mlp.forward_residual(self.post_attention_layernorm(h), h)
        return h + self.mlp(self.post_attention_layernorm(h))

    def _forward_deterministic(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Both halves with h updated in place, the same arithmetic for every row of any step."""
        if self.linear_attn is not None:
            h = deterministic.deltanet_residual(h, self.input_layernorm, self.linear_attn)
        else:
            h = deterministic.gated_attention_residual(h, positions, self.input_layernorm, self.self_attn)
        if isinstance(self.mlp, LlamaMLP):
            return deterministic.swiglu_residual(h, self.post_attention_layernorm, self.mlp.gate_up_proj,
                                                 self.mlp.down_proj)
        return deterministic.moe_residual(h, self.post_attention_layernorm, self.mlp)

    def _fused(self, h: torch.Tensor, mixer: nn.Module) -> bool:
        """A uniform decode / verify step (the metadata the fused paths read) whose projections all run on their
        kernels for these rows: plain ones through skinny_linear, quantized ones through quant_linear
        (layers.linear.folded_linear; checkpoints often leave some of a layer's projections unquantized)."""
        meta = current_metadata()
        if getattr(meta, "decode", None) is None:
            return False
        if self.linear_attn is not None and getattr(meta, "state_decode", None) is None:
            return False
        projections = ([mixer.in_proj_qkvz, mixer.in_proj_ba, mixer.out_proj] if self.linear_attn is not None
                       else [mixer.qkv_proj, mixer.o_proj])
        if isinstance(self.mlp, LlamaMLP):
            projections += [self.mlp.gate_up_proj, self.mlp.down_proj]
        return all(folds(h, p) for p in projections)


class HybridModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, packed_projections: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim)
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, rotary, i, packed_projections)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3NextForCausalLM(LlamaForCausalLM):
    """Target model with recurrent state: LlamaForCausalLM's interface plus the state hooks."""

    packed_projections = True  # Qwen3-Next packs q/k/v/z and b/a per key-head group
    has_recurrent_state = True  # the runner attaches a StateMetadata to every step
    supports_deterministic = True  # models/deterministic.py: per-token conv and recurrence, gated attention, MoE

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        nn.Module.__init__(self)  # LlamaForCausalLM's interface, our own layers
        self.config = cfg
        self.model = HybridModel(cfg, max_positions or cfg.max_position_embeddings, self.packed_projections)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers if layer.self_attn is not None]

    @property
    def state_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if layer.linear_attn is not None]

    def state_bytes_per_seq(self, checkpoints: int = 0) -> int:
        """Recurrent + conv state of one sequence, with `checkpoints` extra states per layer."""
        return bytes_per_sequence(self.state_layers, self.model.embed_tokens.weight.dtype, checkpoints)

    def allocate_state(self, max_num_seqs: int, checkpoints: int = 0, snapshots: int = 0) -> int:
        """State slots for `max_num_seqs` sequences (a pair each plus the scratch pair, see
        recurrent_state.py), `checkpoints` per-row states per DeltaNet layer and `snapshots` prefix-cache
        snapshot entries; returns their bytes."""
        weight = self.model.embed_tokens.weight
        total = 0
        for layer in self.state_layers:
            layer.state = LayerState(physical_slots(max_num_seqs), layer.conv_dim, layer.conv_kernel - 1,
                                     layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, weight.dtype,
                                     state_dtype_of(layer.state_dtype_name, weight.dtype), weight.device,
                                     checkpoints, checkpoint_rows=max_num_seqs, snapshots=snapshots)
            total += layer.state.nbytes
        return total

    def restore_state(self, slots: list[int], entries: list[int]) -> None:
        """Start sequences on cached prefixes: load each slot from its snapshot entry, in every DeltaNet layer."""
        layers = self.state_layers
        if not layers:
            return
        device = layers[0].state.ssm.device
        slot_t, entry_t = torch.tensor(slots, device=device), torch.tensor(entries, device=device)
        for layer in layers:
            layer.state.restore(slot_t, entry_t)

    def commit_decode(self, sd: DecodeStateMetadata, counts: torch.Tensor) -> None:
        """Uniform decode path: each row's committed state (after counts[row] tokens) into its write slot."""
        for layer, saved in sd.pending:
            layer.commit_decode(sd, saved, counts)

    @property
    def state_scratch_slot(self) -> int:
        """The scratch pair's first slot: padded decode rows read it."""
        layers = self.state_layers
        return layers[0].state.ssm.shape[0] - SLOTS_PER_SEQUENCE

    def commit_state(self, seqs: list, committed: list[int]) -> None:
        """After acceptance: move each verify block's slot to the state after its committed tokens."""
        layers = self.state_layers
        pending = layers[0].state.pending if layers and layers[0].state is not None else None
        if pending is not None and [s.state_slot for s in seqs] != pending.meta.slots:
            raise RuntimeError("commit_state got sequences in another order than the step that verified them")
        for layer in layers:
            layer.commit(committed)

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        if name == "lm_head.weight" and self.lm_head is None:
            return True
        return load_expert_weight(self, name, tensor) or copy_named(self, name, tensor)
