"""The DFlash drafter: a few non-causal decoder layers that denoise a block of MASK tokens.

The drafter borrows the target's embedding and LM head. Its residual stream holds only the block
[anchor, MASK, ..., MASK]; keys and values come from the block and from the target's context
features. Context K/V are projected once per committed token and kept in a paged cache that shares
the target's block tables (same positions, same slots); block K/V live for one pass only.
Projections are fused like the target's (q|k|v, gate|up), so decode steps run the same skinny kernels;
z-lab's separate checkpoint names load into the fused slices and train/export.py splits them back.
DFlash 2 checkpoints (DFlash2DraftModel) add a dynamic convolution around every sublayer and a candidate
selector over the drafts (spec/dflash2.py); both are parts of this drafter when the config names them.
The drafter is a Proposer (spec/proposer.py): the runner hands it the step's sequences and takes drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.errors import ConfigError
from blockspec.kernels.paged_attention import paged_attention
from blockspec.kernels.rotary import rope_qk
from blockspec.kernels.skinny_linear import linear, skinny_linear
from blockspec.loader.quant.online import OnlineScheme, quantize_modules, quantize_weight
from blockspec.models.layers.attention import DecodeMetadata, gather_kv, pad_index, sdpa, store_kv
from blockspec.models.layers.linear import (
    FusedLinear,
    Linear,
    folded_linear,
    folds,
    fused_attention_residual,
    fused_swiglu_residual,
)
from blockspec.models.layers.norm import RMSNorm
from blockspec.models.layers.quant_linear import QuantLinear
from blockspec.models.layers.rotary import RotaryEmbedding
from blockspec.models.model_config import ModelConfig, read_config_json
from blockspec.models.weight_utils import copy_named
from blockspec.spec.dflash2 import CandidateSelector, GroupedDynamicConv
from blockspec.spec.proposer import (
    DecodeInputs,
    Drafts,
    Proposer,
    StepContext,
    TargetNeeds,
    exponential_noise,
    sampling_temperatures,
)

if TYPE_CHECKING:
    from blockspec.engine.scheduler import ScheduledSeq
    from blockspec.engine.sequence import Sequence

ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# z-lab stores the selector's codebooks without the nn.Embedding ".weight" suffix
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def dflash2_only(name: str) -> bool:
    """A DFlash 2 parameter with no DFlash 1 counterpart (convolutions, selector): what stays freshly
    initialised when a DFlash 2 drafter starts from a DFlash 1 drafter's weights."""
    return name.startswith("candidate_selector.") or ".attention_conv." in name or ".mlp_conv." in name


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Spread n layers from layer 1 to L-3 (the DFlash paper's choice)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DrafterConfig:
    model: ModelConfig
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int | None
    layer_types: list[str]
    sliding_window: int | None
    is_causal: bool | None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    architecture: str = "DFlashDraftModel"
    # DFlash 2 (all zero for DFlash 1): convolution taps and channels per group, selector rank and K
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def method(self) -> str:
        return "dflash2" if self.architecture == "DFlash2DraftModel" else "dflash"

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> DrafterConfig:
        archs = cfg.get("architectures") or []
        if archs and archs[0] not in ARCHITECTURES:
            raise ConfigError(f"draft model architecture {archs[0]!r} is not a DFlash drafter: pass a z-lab DFlash "
                              "checkpoint (architectures: DFlashDraftModel or DFlash2DraftModel)")
        architecture = archs[0] if archs else ARCHITECTURES[0]
        dcfg = cfg.get("dflash_config") or {}

        def value(name: str, default: Any = None) -> Any:
            return dcfg.get(name, cfg.get(name, default))

        dflash2 = {name: int(value(name) or 0) for name in DFLASH2_FIELDS}
        if architecture == "DFlash2DraftModel":
            missing = [name for name, v in dflash2.items() if v <= 0]
            if missing:
                raise ConfigError(f"DFlash 2 drafter config lacks {', '.join(missing)} (in dflash_config): "
                                  "not a complete DFlash2DraftModel checkpoint")
            if int(cfg["hidden_size"]) % dflash2["conv_group_size"]:
                raise ConfigError(f"conv_group_size {dflash2['conv_group_size']} does not divide hidden_size "
                                  f"{cfg['hidden_size']}: the DFlash 2 config is inconsistent")
            if dflash2["selector_top_k"] > int(cfg["vocab_size"]):
                raise ConfigError(f"selector_top_k {dflash2['selector_top_k']} exceeds vocab_size {cfg['vocab_size']}")
        else:
            dflash2 = dict.fromkeys(DFLASH2_FIELDS, 0)

        model = ModelConfig.from_dict({**cfg, "architectures": ["DFlashDraftModel"]})
        n_layers = model.num_hidden_layers
        num_target_layers = value("num_target_layers")
        layer_ids = value("target_layer_ids")
        if layer_ids is None:
            if num_target_layers is None:
                raise ConfigError("drafter config has neither dflash_config.target_layer_ids nor num_target_layers")
            layer_ids = default_target_layer_ids(int(num_target_layers), n_layers)
        mask_token_id = value("mask_token_id")
        if mask_token_id is None:
            raise ConfigError("drafter config lacks dflash_config.mask_token_id: not a DFlash checkpoint?")
        is_causal = value("is_causal")
        softcap = value("final_logit_softcapping")
        return cls(
            model=model,
            block_size=int(value("block_size", 16)),
            mask_token_id=int(mask_token_id),
            target_layer_ids=[int(i) for i in layer_ids],
            num_target_layers=None if num_target_layers is None else int(num_target_layers),
            layer_types=list(value("layer_types") or ["full_attention"] * n_layers),
            sliding_window=value("sliding_window"),
            is_causal=None if is_causal is None else bool(is_causal),
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            final_logit_softcapping=None if not softcap else float(softcap),
            architecture=architecture,
            **dflash2,
            raw=cfg,
        )

    @classmethod
    def from_dir(cls, path: Path) -> DrafterConfig:
        return cls.from_dict(read_config_json(path))

    def check_target(self, target: ModelConfig) -> None:
        """Refuse a drafter that cannot read this target's features or tokens."""
        m = self.model
        if m.hidden_size != target.hidden_size:
            raise ConfigError(f"drafter hidden_size {m.hidden_size} != target hidden_size {target.hidden_size}: "
                              "use the drafter trained for this target")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ConfigError(f"drafter mask_token_id {self.mask_token_id} is outside the target vocabulary "
                              f"({target.vocab_size}): use the drafter trained for this target")
        if m.vocab_size != target.vocab_size:
            raise ConfigError(f"drafter vocab_size {m.vocab_size} != target vocab_size {target.vocab_size}: "
                              "use the drafter trained for this target")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise ConfigError(f"drafter target_layer_ids {self.target_layer_ids} name layers the target lacks "
                              f"(it has {target.num_hidden_layers}): use the drafter trained for this target")

    def layer_mask_kind(self, i: int) -> tuple[bool, int | None]:
        """(causal, sliding window) of drafter layer i, as the reference defines them."""
        sliding = self.layer_types[i] == "sliding_attention"
        causal = sliding if self.is_causal is None else self.is_causal
        return causal, (int(self.sliding_window) if sliding and self.sliding_window else None)


@dataclass
class DraftMetadata:
    """One drafter pass over a ragged batch.

    ctx_*:    the newly committed context tokens of every sequence (written to the cache, no queries).
    block_*:  the [anchor, MASK * k] block tokens of the sequences that draft this step.
    query_index/query_unpad: pad/unpad the flat block tokens to [B, Qmax] (as AttentionMetadata).
    kv_slots:  [B, Lc] cache slots of the visible context keys; key_pos: [B, Lc + Qmax] absolute
               position of every key (context keys first, then the block), -1 where padding.
    query_pos: [B, Qmax] absolute position of every block query.
    (Those five are the reference path's; the fast path uses `decode`, `block_slots` and `block_start`.)
    block_index: [Tb] each block token's index in its block (DFlash 2's convolution stays inside blocks).
    """

    ctx_positions: torch.Tensor
    ctx_slots: torch.Tensor
    block_positions: torch.Tensor
    query_index: torch.Tensor | None = None
    query_unpad: torch.Tensor | None = None
    kv_slots: torch.Tensor | None = None
    key_pos: torch.Tensor | None = None
    query_pos: torch.Tensor | None = None
    # Uniform-block fast path: block K/V go into the cache at block_slots and the paged kernel
    # attends non-causally over [kv_start, anchor + q_len).
    decode: DecodeMetadata | None = None
    block_slots: torch.Tensor | None = None
    block_start: torch.Tensor | None = None  # [B] each block's anchor position (its first query)
    block_index: torch.Tensor | None = None
    _masks: dict[tuple[bool, int | None], torch.Tensor] = field(default_factory=dict)

    def mask(self, causal: bool, window: int | None) -> torch.Tensor:
        """[B, 1, Qmax, Lc + Qmax] visibility; cached per (causal, window) for the pass."""
        key = (causal, window)
        if key not in self._masks:
            q = self.query_pos[:, :, None]
            k = self.key_pos[:, None, :]
            visible = k >= 0
            if causal:
                visible = visible & (k <= q)
            if window is not None:
                visible = visible & (q - k < window)
                if not causal:
                    visible = visible & (k - q < window)
            self._masks[key] = visible[:, None]
        return self._masks[key]


class DFlashAttention(nn.Module):
    """q|k|v in one FusedLinear (as the target's attention), so decode steps project, norm, rotate and
    store K/V in two kernels; the unfused path reads each projection from its slice of the weight."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, causal: bool, window: int | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        h, d = cfg.hidden_size, cfg.head_dim
        self.qkv_proj = FusedLinear(h, [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d],
                                    cfg.attention_bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.rotary = rotary
        self.causal, self.window = causal, window
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self._row_views: dict[tuple[int, int], tuple[torch.Tensor, QuantLinear | None]] = {}

    def rows(self, first: int, last: int) -> nn.Module | tuple[torch.Tensor, torch.Tensor | None]:
        """Checkpoint projections first..last of q|k|v as one projection: (weight, bias) row slices of a plain
        fused weight, or a QuantLinear sharing a quantized one's storage (made once: a plain attribute, so the
        bytes are not counted twice). A quantized layout that cannot be cut there runs whole (None view)."""
        p = self.qkv_proj
        start, end = p.shard_offset(first), p.shard_offset(last + 1)
        if not isinstance(p, QuantLinear):
            return p.weight[start:end], None if p.bias is None else p.bias[start:end]
        cached = self._row_views.get((start, end))
        if cached is None or cached[0] is not p.qweight:  # re-made after the layer's storage moved (.to())
            cached = (p.qweight, p.row_slice(start, end))
            self._row_views[(start, end)] = cached
        return cached[1] if cached[1] is not None else p

    def _shard(self, x: torch.Tensor, shard: int) -> torch.Tensor:
        """x through one checkpoint projection (0: q, 1: k, 2: v), a row slice of the fused weight: the same
        GEMM, and the same numbers, as the separate q_proj/k_proj/v_proj layers gave."""
        proj = self.rows(shard, shard)
        if isinstance(proj, tuple):
            return linear(x, *proj)
        y = proj(x)
        if proj is self.qkv_proj:  # an uncuttable quantized layout: all of q|k|v, then its columns
            y = y[..., self.qkv_proj.shard_offset(shard):self.qkv_proj.shard_offset(shard + 1)]
        return y

    def proj_q(self, x: torch.Tensor) -> torch.Tensor:
        return self._shard(x, 0)

    def proj_k(self, x: torch.Tensor) -> torch.Tensor:
        return self._shard(x, 1)

    def proj_v(self, x: torch.Tensor) -> torch.Tensor:
        return self._shard(x, 2)

    def _kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        k = self.k_norm(self.proj_k(x).view(t, self.num_kv_heads, self.head_dim))
        v = self.proj_v(x).view(t, self.num_kv_heads, self.head_dim)
        (k,) = self.rotary(positions, k)
        return k, v

    def write_context(self, ctx: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        k, v = self._kv(ctx, positions)
        store_kv(self.k_cache, self.v_cache, slots, k, v)

    def can_fuse(self) -> bool:
        """The fused kernels apply: rotary over the whole head (rope_qk's layout) and a bound cache."""
        return self.rotary.rotary_dim == self.head_dim and self.k_cache is not None and self.v_cache is not None

    def decode_fusable(self, meta: DraftMetadata) -> bool:
        """The uniform-block fast path with the fused kernels."""
        return meta.decode is not None and self.can_fuse()

    def paged(self, q: torch.Tensor, meta: DraftMetadata) -> torch.Tensor:
        """Uniform blocks: the block's queries over the cache (context and block K/V already stored), with
        this layer's mask: non-causal or causal, sliding window or not, queries from each anchor on."""
        d = meta.decode
        return paged_attention(q, self.k_cache, self.v_cache, d.block_tables, d.seq_lens, d.kv_start, d.q_len,
                               self.head_dim**-0.5, causal=self.causal, window=self.window,
                               q_start=meta.block_start)

    def write_context_fused(self, ctx_raw: torch.Tensor, norm: RMSNorm, positions: torch.Tensor,
                            slots: torch.Tensor) -> None:
        """write_context on the un-normed fc output: the drafter's hidden_norm folds into this layer's K|V
        GEMM as its prologue, then rope_qk does k_norm + rotary and writes K and V to the cache. rope_qk
        norms only when given a q weight, so q_norm's rides along unused (no q heads: num_q=0)."""
        proj = self.rows(1, 2)  # k|v rows: a contiguous view
        if isinstance(proj, tuple):
            kv = skinny_linear(ctx_raw, *proj, norm_weight=norm.weight, eps=norm.eps)
        else:
            kv = folded_linear(ctx_raw, proj, norm)
            if proj is self.qkv_proj:
                kv = kv[:, self.qkv_proj.shard_offset(1):].contiguous()
        rope_qk(kv, positions, self.rotary.cos, self.rotary.sin, 0, self.num_kv_heads, self.head_dim,
                self.q_norm.weight, self.k_norm.weight, self.k_norm.eps, self.k_cache, self.v_cache, slots)

    def attend_fused(self, qkv: torch.Tensor, meta: DraftMetadata) -> torch.Tensor:
        """Fused q|k|v projection [T, (nq + 2 nk) d] of the block -> attention output [T, nq d], before
        o_proj: q/k norm, rotary and the block's K/V cache write in one kernel, then the paged kernel."""
        t, nq, nk, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        rope_qk(qkv, meta.block_positions, self.rotary.cos, self.rotary.sin, nq, nk, d, self.q_norm.weight,
                self.k_norm.weight, self.q_norm.eps, self.k_cache, self.v_cache, meta.block_slots)
        q = qkv[:, : nq * d].view(t, nq, d)
        return self.paged(q, meta).reshape(t, -1)

    def forward(self, x: torch.Tensor, meta: DraftMetadata) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_norm(self.proj_q(x).view(t, self.num_heads, self.head_dim))
        (q,) = self.rotary(meta.block_positions, q)
        kb, vb = self._kv(x, meta.block_positions)
        if meta.decode is not None:
            store_kv(self.k_cache, self.v_cache, meta.block_slots, kb, vb)
            return self.o_proj(self.paged(q, meta).reshape(t, -1))
        k = torch.cat([gather_kv(self.k_cache, meta.kv_slots), kb[meta.query_index].transpose(1, 2)], dim=2)
        v = torch.cat([gather_kv(self.v_cache, meta.kv_slots), vb[meta.query_index].transpose(1, 2)], dim=2)
        qp = q[meta.query_index].transpose(1, 2)
        out = sdpa(qp, k, v, meta.mask(self.causal, self.window), self.head_dim**-0.5)
        out = out.transpose(1, 2).reshape(-1, self.num_heads * self.head_dim)[meta.query_unpad]
        return self.o_proj(out)


class DFlashMLP(nn.Module):
    """SwiGLU with gate|up in one FusedLinear (as the target's MLP): decode steps run it as one skinny GEMM
    with the norm and SwiGLU folded in. z-lab's gate_proj/up_proj names load into its halves
    (copy_named) and export.zlab_state_dict splits them back."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = FusedLinear(cfg.hidden_size, [cfg.intermediate_size, cfg.intermediate_size], bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, rotary: RotaryEmbedding, causal: bool, window: int | None) -> None:
        super().__init__()
        m = cfg.model
        self.self_attn = DFlashAttention(m, rotary, causal, window)
        self.mlp = DFlashMLP(m)
        self.input_layernorm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        conv = (m.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.attention_conv = GroupedDynamicConv(*conv) if cfg.conv_kernel_size else None
        self.mlp_conv = GroupedDynamicConv(*conv) if cfg.conv_kernel_size else None

    def forward(self, h: torch.Tensor, meta: DraftMetadata) -> torch.Tensor:
        """The block's residual stream in, the layer's output out. Decode steps (<= 16 block rows on GPU,
        fast-path layers) take the target layers' fused kernels and update h IN PLACE (the caller owns
        it); everything else the unfused ops (DFlash 2's convolutions sit between the norms and the GEMMs
        the fused kernels fold them into)."""
        attn, mlp = self.self_attn, self.mlp
        if self.attention_conv is not None:
            h = h + self.convolved(attn, self.attention_conv, self.input_layernorm(h), meta)
            return h + self.convolved(mlp, self.mlp_conv, self.post_attention_layernorm(h), meta)
        if not (attn.decode_fusable(meta) and folds(h, attn.qkv_proj)):
            h = h + attn(self.input_layernorm(h), meta)
            return h + mlp(self.post_attention_layernorm(h))
        h = fused_attention_residual(h, self.input_layernorm, attn.qkv_proj, attn.o_proj,
                                     lambda qkv: attn.attend_fused(qkv, meta))
        return fused_swiglu_residual(h, self.post_attention_layernorm, mlp.gate_up_proj, mlp.down_proj)

    @staticmethod
    def convolved(sublayer: nn.Module, conv: GroupedDynamicConv, x: torch.Tensor, meta: DraftMetadata
                  ) -> torch.Tensor:
        x, post = conv.prepare(x, meta.block_index)
        y = sublayer(x, meta) if isinstance(sublayer, DFlashAttention) else sublayer(x)
        return conv.finish(y, post, meta.block_index)


class DFlashDrafter(Proposer):
    def __init__(self, cfg: DrafterConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        m = cfg.model
        rotary = RotaryEmbedding(m.head_dim, max_positions, m.rope_theta, m.rope_scaling)
        self.layers = nn.ModuleList(DFlashLayer(cfg, rotary, *cfg.layer_mask_kind(i))
                                    for i in range(m.num_hidden_layers))
        self.fc = Linear(len(cfg.target_layer_ids) * m.hidden_size, m.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.candidate_selector = (CandidateSelector(m.vocab_size, m.hidden_size, cfg.selector_rank,
                                                     cfg.selector_top_k) if cfg.selector_top_k else None)
        self.method = cfg.method
        self.needs = TargetNeeds(layer_ids=tuple(cfg.target_layer_ids))
        self.num_candidates = cfg.selector_top_k
        # --speculative-config "quantization": the online scheme its projections were rounded to (quantize_online),
        # and its own rounded copy of the target's LM head to draft through (copy_head)
        self.online: OnlineScheme | None = None
        self.draft_head: QuantLinear | None = None

    def quantizable(self) -> list[str]:
        """The projections an online quantization rounds: every layer's q|k|v, o, gate|up and down, and fc (the
        step's bytes; DFlash 2's small convolution and selector projections stay as loaded)."""
        names = ["fc"]
        for i in range(len(self.layers)):
            names += [f"layers.{i}.self_attn.qkv_proj", f"layers.{i}.self_attn.o_proj",
                      f"layers.{i}.mlp.gate_up_proj", f"layers.{i}.mlp.down_proj"]
        return names

    def quantize_online(self, scheme: OnlineScheme) -> None:
        """Round the loaded projections to `scheme`, each full-precision weight freed once its copy exists."""
        quantize_modules(self, self.quantizable(), scheme)
        self.online = scheme

    def copy_head(self, lm_head_weight: torch.Tensor) -> None:
        """Draft through a copy of the target's LM head rounded as the projections were (after quantize_online)."""
        if self.online is None:
            raise RuntimeError("copy_head rounds the head as the drafter's projections are: quantize_online first")
        self.draft_head = quantize_weight(lm_head_weight, self.online, lm_head_weight.dtype, "the drafting LM head")

    @property
    def max_drafts(self) -> int:
        return self.config.block_size - 1

    def describe(self) -> str:
        if self.online is None:
            return self.method
        head = ", its LM head copy too" if self.draft_head is not None else ""
        return f"{self.method} ({self.online.describe()}{head})"

    @property
    def attention_layers(self) -> list[DFlashAttention]:
        return [layer.self_attn for layer in self.layers]

    def write_context(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Project newly committed context features into every layer's K/V cache (once per token).

        Context vectors enter K/V without the layers' input norms (DESIGN.md §1).
        """
        if features.shape[0] == 0:
            return
        attns = self.attention_layers
        if folds(features, self.fc) and all(a.can_fuse() for a in attns):
            # decode steps: fc, then per layer one K|V GEMM (hidden_norm as its prologue) and one rope_qk
            ctx_raw = folded_linear(features, self.fc)
            for attn in attns:
                attn.write_context_fused(ctx_raw, self.hidden_norm, positions, slots)
            return
        ctx = self.hidden_norm(self.fc(features))
        for attn in attns:
            attn.write_context(ctx, positions, slots)

    def forward_blocks(self, block_embeds: torch.Tensor, meta: DraftMetadata) -> torch.Tensor:
        """Denoise the [anchor, MASK * k] blocks against the cached context; normed hidden [Tb, H]."""
        scale = self.config.input_embedding_scale
        # a tensor of our own: the fused decode layers update h in place
        h = block_embeds * scale if scale != 1.0 else block_embeds.clone()
        for layer in self.layers:
            h = layer(h, meta)
        return self.norm(h)

    def forward(self, features: torch.Tensor, block_embeds: torch.Tensor, meta: DraftMetadata) -> torch.Tensor:
        self.write_context(features, meta.ctx_positions, meta.ctx_slots)
        if block_embeds.shape[0] == 0:
            return block_embeds
        return self.forward_blocks(block_embeds, meta)

    def compute_logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        # rows flattened to 2-D: a 3-D input sends CPU linear through a batched matmul over the whole head
        rows = hidden.reshape(-1, hidden.shape[-1])
        logits = linear(rows, lm_head_weight) if self.draft_head is None else self.draft_head(rows.contiguous())
        logits = logits.view(*hidden.shape[:-1], -1)
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def select(self, hidden: torch.Tensor, anchors: torch.Tensor, lm_head_weight: torch.Tensor,
               temperature: torch.Tensor | None = None, noise: torch.Tensor | None = None) -> Drafts:
        """hidden [R, P, H] of the draft slots -> drafts: an argmax per slot (DFlash 1), or the candidate
        selector's walk from the anchor token (DFlash 2: greedy, or sampled with q where temperature > 0)."""
        logits = self.compute_logits(hidden, lm_head_weight)
        if self.candidate_selector is None:
            return Drafts(logits.argmax(-1))
        path, candidates, q = self.candidate_selector.walk(hidden, logits, anchors, temperature, noise)
        return Drafts(path, candidates, q)

    # ---- the proposer interface (spec/proposer.py) ----------------------------------------------

    def propose(self, items: list[ScheduledSeq], ctx: StepContext) -> Drafts | None:
        inputs = self.general_inputs(items, ctx)
        if inputs is None:
            return None
        features, embeds, meta, rows = inputs
        hidden = self(features, embeds, meta)
        if not rows:
            return None
        drafting = [item for item in items if item.num_drafts]
        width = max(len(r) for r in rows)
        index = ctx.tensor([r + [r[-1]] * (width - len(r)) for r in rows])
        anchors = ctx.tensor([item.seq.output_ids[-1] for item in drafting])
        temperature = noise = None
        if self.candidate_selector is not None:
            temperature = sampling_temperatures([item.seq for item in drafting], ctx.device)
        if temperature is not None:
            noise = torch.ones(len(rows), width, self.num_candidates, device=ctx.device)
            for r, item in enumerate(drafting):
                if not item.seq.params.greedy:
                    noise[r, :item.num_drafts] = exponential_noise(item.seq, (item.num_drafts, self.num_candidates),
                                                                   ctx.device)
        return self.select(hidden[index], anchors, ctx.target.lm_head_weight, temperature, noise)

    def general_inputs(self, items: list[ScheduledSeq], ctx: StepContext
                       ) -> tuple[torch.Tensor, torch.Tensor, DraftMetadata, list[list[int]]] | None:
        """Drafter inputs for a general-path step, consuming the sequences' pending features.

        Returns (context features, block embeddings, metadata, per drafting block the rows of its outputs
        that become drafts: offsets 1..k), or None when the drafter has nothing to do.
        """
        feats, ctx_pos, ctx_slots = [], [], []
        block_tokens, block_pos, q_lens, kv_slots, key_pos, query_pos = [], [], [], [], [], []
        for item in items:
            seq = item.seq
            if seq.pending_features is not None:
                feats.append(seq.pending_features)
                ctx_pos.extend(range(seq.drafter_computed, seq.num_computed))
                ctx_slots.extend(ctx.slots(seq, seq.drafter_computed, seq.num_computed))
                seq.drafter_computed, seq.pending_features = seq.num_computed, None
            if item.num_drafts:
                anchor = seq.num_tokens - 1
                lo = 0 if ctx.draft_window is None else max(0, anchor - ctx.draft_window)
                block_tokens.append(seq.output_ids[-1])
                block_tokens.extend([self.config.mask_token_id] * item.num_drafts)
                block_pos.extend(range(anchor, anchor + item.num_drafts + 1))
                q_lens.append(item.num_drafts + 1)
                kv_slots.append(ctx.slots(seq, lo, anchor))
                key_pos.append(list(range(lo, anchor)))
                query_pos.append(list(range(anchor, anchor + item.num_drafts + 1)))
        if not feats and not block_tokens:
            return None
        starts = [sum(q_lens[:b]) for b in range(len(q_lens))]
        query_index, query_unpad = pad_index(q_lens, starts)
        lc = max((len(s) for s in kv_slots), default=0)
        qmax = max(q_lens, default=0)
        keys = [kp + [-1] * (lc - len(kp)) + qp + [-1] * (qmax - len(qp)) for kp, qp in zip(key_pos, query_pos)]
        b = len(q_lens)
        meta = DraftMetadata(
            ctx_positions=ctx.tensor(ctx_pos),
            ctx_slots=ctx.tensor(ctx_slots),
            block_positions=ctx.tensor(block_pos),
            query_index=ctx.tensor(query_index).view(b, qmax),
            query_unpad=ctx.tensor(query_unpad),
            kv_slots=ctx.tensor([s + [0] * (lc - len(s)) for s in kv_slots]).view(b, lc),
            key_pos=ctx.tensor(keys).view(b, lc + qmax),
            query_pos=ctx.tensor([q + [q[-1]] * (qmax - len(q)) for q in query_pos]).view(b, qmax),
            block_index=ctx.tensor([i for n in q_lens for i in range(n)]),
        )
        hidden_size = self.config.model.hidden_size
        features = torch.cat(feats) if feats else torch.zeros(0, 1, device=ctx.device, dtype=ctx.dtype)
        embeds = ctx.target.embed(ctx.tensor(block_tokens)) if block_tokens else \
            torch.zeros(0, hidden_size, device=ctx.device, dtype=ctx.dtype)
        rows = [[s + i for i in range(1, n)] for s, n in zip(starts, q_lens)]
        return features, embeds, meta, rows

    def write_pending(self, seqs: list[Sequence], ctx: StepContext, keep_last: bool = True) -> None:
        feats, pos, slots = [], [], []
        for seq in seqs:
            rows = seq.pending_features
            n = 0 if rows is None else rows.shape[0] - int(keep_last)
            if n <= 0:
                continue
            feats.append(rows[:n])
            pos += range(seq.drafter_computed, seq.drafter_computed + n)
            slots += ctx.slots(seq, seq.drafter_computed, seq.drafter_computed + n)
            seq.drafter_computed += n
            seq.pending_features = rows[n:] if keep_last else None
        if feats:
            self.write_context(torch.cat(feats), ctx.tensor(pos), ctx.tensor(slots))

    def propose_decode(self, inputs: DecodeInputs, target: nn.Module) -> Drafts:
        """Project the rows the previous step committed, denoise the [anchor, MASK * k] blocks, select."""
        v = inputs.views
        bp, q = v.batch, v.q_len
        self.write_context(inputs.features[v.ctx_rows], v.ctx_positions, v.ctx_slots)
        conv = self.layers[0].attention_conv is not None
        meta = DraftMetadata(ctx_positions=v.ctx_positions, ctx_slots=v.ctx_slots, block_positions=v.positions,
                             block_slots=v.slots, block_start=v.anchor,
                             decode=DecodeMetadata(v.tables, v.draft_seq_lens, v.draft_kv_start, q),
                             block_index=torch.arange(q, device=v.anchor.device).repeat(bp) if conv else None)
        hidden = self.forward_blocks(target.embed(v.draft_tokens), meta).view(bp, q, -1)[:, 1:]
        return self.select(hidden, v.token, target.lm_head_weight, inputs.temperature, inputs.noise)

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        if name.startswith("model."):
            name = name[len("model."):]
        if name in CODEBOOKS:
            name += ".weight"
        return copy_named(self, name, tensor)

