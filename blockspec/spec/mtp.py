"""The target's own multi-token-prediction head (Qwen3-Next, Qwen3.5 / 3.6 checkpoints) as a proposer.

The checkpoint carries it under `mtp.` (`model.language_model.mtp.` in some VLM wrappers): `fc` [H, 2H],
`pre_fc_norm_embedding`, `pre_fc_norm_hidden`, one full-attention decoder layer of the target's own kind
(`layers.0`, gated attention; a sparse or dense MLP as the target's layer 0 would have) and a final `norm`;
the embedding and the LM head are the target's. At position p it reads the token x_{p+1} and a hidden
state h_p and predicts x_{p+2}:

    out_p = norm(layer(fc([norm_e(embed(x_{p+1})), norm_h(h_p)])))

For committed positions h_p is the target's final-normed hidden state; for drafts it is the head's own
previous output. The head's layer keeps a paged K/V cache beside the target's (same block tables). Each
step first runs the positions the previous step committed (a causal pass writing their K/V); the output at
the last one (anchor - 1) gives draft 1, then N - 1 one-token passes at anchor, anchor + 1, ... give the
others (vLLM's MTP proposer does the same). Draft K/V past the committed frontier is overwritten by the
next step's context pass, like the target's rejected verify rows.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from blockspec.errors import ConfigError
from blockspec.models.layers.attention import (
    AttentionMetadata,
    DecodeMetadata,
    PagedAttention,
    forward_context,
    ragged_metadata,
)
from blockspec.models.layers.linear import Linear
from blockspec.models.layers.moe import load_expert_weight
from blockspec.models.layers.rotary import RotaryEmbedding
from blockspec.models.model_config import ModelConfig
from blockspec.models.qwen3_next import HybridDecoderLayer, ZeroCenteredRMSNorm
from blockspec.models.weight_utils import copy_named
from blockspec.spec.proposer import DecodeInputs, Drafts, Proposer, StepContext, TargetNeeds

if TYPE_CHECKING:
    from blockspec.engine.scheduler import ScheduledSeq
    from blockspec.engine.sequence import Sequence

# vLLM's spellings of the method; the two model-specific ones are its deprecated aliases of "mtp"
METHODS = ("mtp", "qwen3_next_mtp", "qwen3_5_mtp")
# checkpoint prefixes of the head's tensors, longest first (the VLM wrappers nest it)
PREFIXES = ("model.language_model.mtp.", "language_model.mtp.", "model.mtp.", "mtp.")
MAX_DRAFTS = 15


def mtp_layer_count(cfg: ModelConfig) -> int:
    """MTP layers the checkpoint declares (Qwen3-Next: num_nextn_predict_layers; Qwen3.5: mtp_num_hidden_layers)."""
    raw = cfg.raw
    return int(raw.get("mtp_num_hidden_layers") or raw.get("num_nextn_predict_layers") or 0)


def head_name(checkpoint_name: str) -> str | None:
    """The head's own name of a checkpoint tensor (prefix removed), None for tensors that are not the head's."""
    for prefix in PREFIXES:
        if checkpoint_name.startswith(prefix):
            return checkpoint_name[len(prefix):]
    return None


FLOAT_DTYPES = ("F32", "F16", "BF16")


def check_target(cfg: ModelConfig, target: nn.Module | type[nn.Module],
                 tensors: dict[str, tuple[str, tuple[int, ...]]] | None) -> None:
    """Refuse, with the reason, a target whose checkpoint has no MTP head this proposer can run (`target`: the
    model or its class; `tensors`: the checkpoint's {name: (dtype, shape)}, None for random weights)."""
    if not getattr(target, "has_recurrent_state", False) or not hasattr(target, "packed_projections"):
        raise ConfigError(f"speculative method \"mtp\" runs the MTP head of Qwen3-Next and Qwen3.5/3.6 "
                          f"checkpoints; {cfg.architecture or cfg.model_type} has none: use a DFlash drafter "
                          "(\"method\": \"dflash\")")
    layers = mtp_layer_count(cfg)
    head = {} if tensors is None else {n: dtype for n, (dtype, _) in tensors.items() if head_name(n) is not None}
    if tensors is not None and not head:
        raise ConfigError("this checkpoint has no MTP weights (no mtp.* tensors: some quantized or re-packaged "
                          "uploads drop them): use the original checkpoint, or a DFlash drafter")
    packed = sorted(n for n, dtype in head.items() if dtype not in FLOAT_DTYPES)
    if packed:
        raise ConfigError(f"this checkpoint stores its MTP head quantized ({packed[0]} is {head[packed[0]]}); "
                          "blockspec runs MTP heads kept in bf16/fp16/fp32 (as NVFP4 uploads keep them): use such a "
                          "checkpoint, or a DFlash drafter")
    if layers > 1:
        raise ConfigError(f"the checkpoint declares {layers} MTP layers; blockspec runs heads of one layer (every "
                          "published Qwen3-Next / Qwen3.5 / 3.6 checkpoint)")


def mtp_unavailable(model_dir: Path, load: bool = True) -> str | None:
    """Why the checkpoint in `model_dir` has no MTP head this proposer can run, or None when it has one: the
    engine's own check, from config.json and the shard headers alone (no weights read, no model built), so
    `tune` can tell before it builds an engine for the head. load=False: random weights, tensors not checked."""
    from blockspec.loader.safetensors_loader import read_tensor_headers
    from blockspec.models.registry import model_class

    cfg = ModelConfig.from_dir(model_dir)
    try:
        check_target(cfg, model_class(cfg), read_tensor_headers(model_dir) if load else None)
    except ConfigError as exc:
        return str(exc)
    return None


class MTPHead(nn.Module):
    """The `mtp.*` module: parameter names are the checkpoint's with the prefix removed."""

    def __init__(self, cfg: ModelConfig, max_positions: int, packed_projections: bool) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        layer_cfg = dataclasses.replace(cfg, layer_types=["full_attention"])
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim)
        self.fc = Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(h, eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(h, eps)
        self.layers = nn.ModuleList([HybridDecoderLayer(layer_cfg, rotary, 0, packed_projections)])
        self.norm = ZeroCenteredRMSNorm(h, eps)

    @property
    def attention(self) -> PagedAttention:
        return self.layers[0].self_attn.attn

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """embeds [T, H] of x_{p+1}, hidden [T, H] h_p, positions [T] p -> the head's normed output [T, H]
        (attention metadata from the forward context, as for the target's layers)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        return self.norm(self.layers[0](positions, x))

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        return load_expert_weight(self, name, tensor) or copy_named(self, name, tensor)


class MTPProposer(Proposer):
    method = "mtp"
    needs = TargetNeeds(final_hidden=True, next_tokens=True)

    def __init__(self, head: MTPHead) -> None:
        super().__init__()
        self.head = head

    @property
    def max_drafts(self) -> int:
        return MAX_DRAFTS

    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [self.head.attention]

    def _run(self, target: nn.Module, meta: AttentionMetadata, tokens: torch.Tensor, hidden: torch.Tensor,
             positions: torch.Tensor) -> torch.Tensor:
        with forward_context(meta):
            return self.head(target.embed(tokens), hidden, positions)

    def _context(self, seqs: list[Sequence], ctx: StepContext, keep_last: bool) -> dict[int, torch.Tensor]:
        """The causal pass over the sequences' pending positions (all, or all but the last): their K/V into
        the head's cache. Returns each sequence's output at its last position run (by id)."""
        spans, tokens, hidden, positions = [], [], [], []
        for seq in seqs:
            rows = seq.pending_features
            n = 0 if rows is None else rows.shape[0] - int(keep_last)
            if n <= 0:
                continue
            start = seq.drafter_computed
            spans.append((seq, start, n))
            tokens += seq.token_ids(start + 1, start + n + 1)
            hidden.append(rows[:n])
            positions += range(start, start + n)
            seq.drafter_computed += n
            seq.pending_features = rows[n:] if keep_last else None
        if not spans:
            return {}
        meta = ragged_metadata([(seq.block_table, start, n) for seq, start, n in spans], ctx.block_size, ctx.device)
        out = self._run(ctx.target, meta, ctx.tensor(tokens), torch.cat(hidden), ctx.tensor(positions))
        ends = torch.tensor([n for _, _, n in spans]).cumsum(0) - 1
        return {id(seq): out[int(end)] for (seq, _, _), end in zip(spans, ends)}

    def write_pending(self, seqs: list[Sequence], ctx: StepContext, keep_last: bool = True) -> None:
        self._context(seqs, ctx, keep_last)

    def propose(self, items: list[ScheduledSeq], ctx: StepContext) -> Drafts | None:
        last = self._context([item.seq for item in items], ctx, keep_last=False)
        drafting = [item for item in items if item.num_drafts]
        if not drafting:
            return None
        missing = [item.seq.request_id for item in drafting if id(item.seq) not in last]
        if missing:
            raise RuntimeError(f"MTP head has no context output at the anchor for {missing}: the previous step's "
                               "committed positions were not handed to it")
        target = ctx.target
        h = torch.stack([last[id(item.seq)] for item in drafting])
        counts = [item.num_drafts for item in drafting]
        drafts = torch.zeros(len(drafting), max(counts), dtype=torch.int64, device=ctx.device)
        drafts[:, 0] = target.compute_logits(h).argmax(-1)
        for j in range(1, max(counts)):  # draft j + 1 from draft j at position anchor + j - 1
            live = [r for r, n in enumerate(counts) if n > j]
            rows = ctx.tensor(live)
            spans = [(drafting[r].seq.block_table, drafting[r].seq.num_tokens - 2 + j, 1) for r in live]
            meta = ragged_metadata(spans, ctx.block_size, ctx.device)
            positions = ctx.tensor([start for _, start, _ in spans])
            out = self._run(target, meta, drafts[rows, j - 1], h[rows], positions)
            h = h.index_copy(0, rows, out)
            drafts[rows, j] = target.compute_logits(out).argmax(-1)
        return Drafts(drafts)

    def propose_decode(self, inputs: DecodeInputs, target: nn.Module) -> Drafts:
        v = inputs.views
        bp, q = v.batch, v.q_len
        # Context rows: row i of a sequence pairs h at ctx_pos0 + i with the token after it, which is the
        # previous verify input one row on (an accepted draft) or, for the last row, the new anchor token.
        index = torch.arange(q, device=v.anchor.device)
        last = (v.ctx_count - 1).clamp(min=0)
        following = inputs.feature_tokens[(v.ctx_rows + 1).clamp(max=inputs.feature_tokens.shape[0] - 1)]
        tokens = torch.where(index[None, :] == last[:, None], v.token[:, None], following.view(bp, q))
        meta = AttentionMetadata(slot_mapping=v.ctx_slots,
                                 decode=DecodeMetadata(v.tables, v.ctx_pos0 + q, v.kv_start, q))
        out = self._run(target, meta, tokens.view(-1), inputs.features[v.ctx_rows], v.ctx_positions)
        h = out.view(bp, q, -1)[torch.arange(bp, device=out.device), last]
        drafts = [target.compute_logits(h).argmax(-1)]
        slots = v.slots.view(bp, q)
        for j in range(1, q - 1):
            meta = AttentionMetadata(slot_mapping=slots[:, j - 1],
                                     decode=DecodeMetadata(v.tables, v.anchor + j, v.kv_start, 1))
            h = self._run(target, meta, drafts[-1], h, v.anchor + j - 1)
            drafts.append(target.compute_logits(h).argmax(-1))
        return Drafts(torch.stack(drafts, dim=1))


def build_mtp(cfg: ModelConfig, target: nn.Module, model_dir: Path, max_positions: int, device: torch.device,
              dtype: torch.dtype, load: bool) -> MTPProposer:
    """The target checkpoint's MTP head as a proposer, its weights read from the checkpoint (unless `load` is
    False: random weights in its shapes, for benchmarks)."""
    from blockspec.engine.engine import build_module
    from blockspec.loader.safetensors_loader import read_tensor_headers
    from blockspec.loader.weights import load_weights

    check_target(cfg, target, read_tensor_headers(model_dir) if load else None)
    head = build_module(lambda: MTPHead(cfg, max_positions, target.packed_projections), device, dtype)
    if load:
        load_weights(head, model_dir, device, dtype, names=head_name)
    return MTPProposer(head)
