"""Paged attention: the per-step metadata, the KV write, and the plain-PyTorch reference kernel.

A step runs a flat, ragged batch of tokens (prefill chunks and k+1-token verify blocks side by side).
The runner describes the batch once per step in an `AttentionMetadata`; every attention layer reads
it from the forward context, writes its new K/V into its paged cache and attends. The reference
kernel gathers each sequence's keys into a padded [batch, max_len] view and runs SDPA under a mask;
it is the oracle for the Triton kernels and the path used on CPU. Layers with attention sinks or a
sliding window (GPT-OSS) take kernels.paged_attention's ragged kernel instead (SDPA has neither).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from blockspec.device import cuda_capability, upload
from blockspec.kernels.paged_attention import (
    fixed_split_attention,
    paged_attention,
    ragged_paged_attention,
    softmax_with_sinks,
)

if TYPE_CHECKING:
    from blockspec.models.layers.recurrent_state import DecodeStateMetadata, StateMetadata


@dataclass
class DecodeMetadata:
    """Uniform decode/verify batch: every sequence has q_len new tokens at the end of its context.

    block_tables: [B, max_blocks] int32/64; seq_lens: [B] context length including the new tokens;
    kv_start: [B] first visible key position (0, or the drafter's window start). Fixed shapes for a
    given (B, q_len), so a step using only these can be captured in a CUDA graph.
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    kv_start: torch.Tensor
    q_len: int


@dataclass
class AttentionMetadata:
    """Where a step's tokens go in the paged cache and which keys each query sees.

    slot_mapping: [T] cache slot (block * block_size + offset) for each new token's K/V.
    Either `decode` is set (uniform decode/verify: the paged kernel reads the cache directly), or the
    general ragged description below is (prefill chunks and mixed batches: the reference gathers):
    query_index:  [B, Qmax] flat token index of each (padded) query; padding points at token 0.
    query_unpad:  [T] index into the flattened [B * Qmax] padded queries of each real token.
    kv_slots:     [B, Lmax] cache slot of key position j of sequence b (padding points at slot 0).
    mask:         [B, 1, Qmax, Lmax] True where query i of sequence b may attend to key j.
    query_pos:    [B, Qmax] position of each padded query (sliding-window layers derive their mask from it).
    """

    slot_mapping: torch.Tensor
    query_index: torch.Tensor | None = None
    query_unpad: torch.Tensor | None = None
    kv_slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    query_pos: torch.Tensor | None = None
    decode: DecodeMetadata | None = None
    # One sequence prefilling from position 0: its keys are exactly the new tokens, so contiguous
    # causal SDPA (flash attention on GPU) replaces the masked gather.
    fresh_prefill: bool = False
    # Hybrid models: each sequence's span and recurrent-state slot (models/layers/recurrent_state.py).
    state: StateMetadata | None = None
    # Hybrid models on the uniform decode path (with `decode`): each row's state slots.
    state_decode: DecodeStateMetadata | None = None
    # --deterministic, ragged steps: each sequence's block table [B, max_blocks], its context length after
    # the step [B], and (first token index, number of new tokens) per sequence, so that prefill chunks
    # attend through the same paged kernel as decode rows (kernels/paged_attention.fixed_split_attention).
    block_tables: torch.Tensor | None = None
    seq_ends: torch.Tensor | None = None
    seq_tokens: list[tuple[int, int]] | None = None


@dataclass
class DenseCausalMetadata:
    """Whole sequences without a cache (drafter training): the step's T tokens are a right-padded
    [batch, T // batch] grid, attention is plain causal SDPA and no K/V is stored."""

    batch: int


_CONTEXT: list[AttentionMetadata | DenseCausalMetadata] = []


def ragged_metadata(spans: list[tuple[list[int], int, int]], block_size: int, device: torch.device,
                    block_tables: bool = False) -> AttentionMetadata:
    """Causal attention metadata for a ragged batch: per sequence (block table, start, n), queries at
    positions [start, start + n) over keys [0, start + n) of its paged cache (new K/V written first).
    `block_tables`: also the per-sequence tables the deterministic mode's paged kernel reads."""
    def slots(table: list[int], lo: int, hi: int) -> list[int]:
        return [table[p // block_size] * block_size + p % block_size for p in range(lo, hi)]

    q_lens = [n for _, _, n in spans]
    offsets = [sum(q_lens[:b]) for b in range(len(spans))]
    kv_lens = [start + n for _, start, n in spans]
    lmax, qmax = max(kv_lens), max(q_lens)
    query_index, query_unpad = pad_index(q_lens, offsets)

    def t(values: list) -> torch.Tensor:
        return upload(values, torch.int64, device)

    # key slots from the block tables on the device: a hit on a 6,000-token prefix listed 6,000 slots in Python
    # (~1.5 ms of a TTFT that waits on the host); padding keys point into block 0 (always masked out)
    width = -(-lmax // block_size)
    tables = t([list(table[:-(-n // block_size)]) + [0] * (width - -(-n // block_size))
                for (table, _, _), n in zip(spans, kv_lens)]).view(len(spans), width)
    kv_slots = (tables[:, :, None] * block_size + torch.arange(block_size, device=device)).view(len(spans), -1)
    query_pos = t([[start + (i if i < n else 0) for i in range(qmax)] for _, start, n in spans])
    key = torch.arange(lmax, device=device)
    kv_len = t(kv_lens)
    mask = (key[None, None, :] <= query_pos[:, :, None]) & (key[None, None, :] < kv_len[:, None, None])
    meta = AttentionMetadata(
        slot_mapping=t([s for (table, start, n) in spans for s in slots(table, start, start + n)]),
        query_index=t(query_index).view(len(spans), qmax),
        query_unpad=t(query_unpad),
        kv_slots=kv_slots[:, :lmax],
        mask=mask[:, None],
        query_pos=query_pos,
    )
    if block_tables:
        meta.block_tables = tables
        meta.seq_ends = kv_len
        meta.seq_tokens = list(zip(offsets, q_lens))
    return meta


def pad_index(lengths: list[int], starts: list[int]) -> tuple[list[list[int]], list[int]]:
    """Ragged rows of a flat array -> padded [B, max(lengths)] indices into it (padding repeats the row's
    first index) and the padded-flat position of every real entry."""
    width = max(lengths) if lengths else 0
    index, unpad = [], []
    for b, (n, s) in enumerate(zip(lengths, starts)):
        index.append([s + i for i in range(n)] + [s] * (width - n))
        unpad.extend(b * width + i for i in range(n))
    return index, unpad


@contextmanager
def forward_context(meta: AttentionMetadata | DenseCausalMetadata) -> Iterator[None]:
    """Make `meta` visible to every attention layer for the duration of one forward pass."""
    _CONTEXT.append(meta)
    try:
        yield
    finally:
        _CONTEXT.pop()


def current_metadata() -> AttentionMetadata | DenseCausalMetadata:
    if not _CONTEXT:
        raise RuntimeError("attention called outside forward_context(): the runner sets the metadata")
    return _CONTEXT[-1]


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Write K/V of shape [T, Hkv, D] into caches of shape [num_blocks, block_size, Hkv, D]."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, kv_slots: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, Hkv, D] cache -> [B, Hkv, Lmax, D] keys or values by slot."""
    flat = cache.view(-1, *cache.shape[2:])
    return flat[kv_slots].transpose(1, 2)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, Q, D], k/v [B, Hkv, L, D] -> [B, H, Q, D] with grouped-query heads."""
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D] -> [T, H * D]; keys and values come from the paged cache (already written)."""
    num_tokens, num_heads, head_dim = q.shape
    qp = q[meta.query_index].transpose(1, 2)  # [B, H, Qmax, D]
    k = gather_kv(k_cache, meta.kv_slots)
    v = gather_kv(v_cache, meta.kv_slots)
    out = sdpa(qp, k, v, meta.mask, scale)  # [B, H, Qmax, D]
    out = out.transpose(1, 2).reshape(-1, num_heads * head_dim)
    return out[meta.query_unpad]


def _flash_varlen_ok(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether aten's flash attention forward takes these operands as they are: CUDA sm80+, 16-bit, head_dim a
    multiple of 8 up to 256, query heads a multiple of the KV heads, unit stride along head_dim."""
    d = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and k_cache.dtype == q.dtype
            and d % 8 == 0 and d <= 256 and q.shape[1] % k_cache.shape[2] == 0 and q.stride(-1) == 1
            and hasattr(torch.ops.aten, "_flash_attention_forward")
            and cuda_capability(q.device)[0] >= 8)


def tail_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_slots: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One sequence whose T new tokens are the last T of its L cached keys (a prefix-cache hit, a later prefill
    chunk, an eager verify): causal attention aligned to the bottom right, which flash attention computes
    without a mask. q [T, H, D] -> [T, H * D].

    A hit's prefill waits on the host, not the GPU (6,000 cached + 200 new tokens on the Qwen3-8B shape: ~12 ms
    of kernels in a 24-32 ms TTFT), so this is three operations a layer: the keys and values gathered by slot
    straight into flash attention's [L, Hkv, D] layout, and aten's flash forward on q as it sits in the fused
    q|k|v projection (its causal mask is bottom-right aligned; it reads grouped KV heads itself). The SDPA route
    with `causal_lower_right` it replaces cost ~150 us of host time a layer (transposes, the bias dispatch, an
    output copy); a boolean-mask SDPA before that took cuDNN's masked path (7.7 ms of GPU time on that hit)."""
    t, h, d = q.shape
    if _flash_varlen_ok(q, k_cache):
        slots = kv_slots.reshape(-1)
        k = k_cache.view(-1, *k_cache.shape[2:]).index_select(0, slots)  # [L, Hkv, D]
        v = v_cache.view(-1, *v_cache.shape[2:]).index_select(0, slots)
        out = torch.ops.aten._flash_attention_forward(q[None], k[None], v[None], None, None, t, k.shape[0], 0.0,
                                                      True, False, scale=scale)[0]
        return out.view(t, h * d)
    k = gather_kv(k_cache, kv_slots).to(q.dtype)  # [1, Hkv, L, D]
    v = gather_kv(v_cache, kv_slots).to(q.dtype)
    qb = q.transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(qb, k, v, attn_mask=causal_lower_right(t, k.shape[2]),
                                         scale=scale, enable_gqa=k.shape[1] != h)
    return out[0].transpose(0, 1).reshape(t, -1)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, scale: float,
                           sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] of `batch` equal-length rows -> [T, H * D], causal, no cache."""
    t, h, d = q.shape
    qb, kb, vb = (x.reshape(batch, t // batch, x.shape[1], d).transpose(1, 2) for x in (q, k, v))
    if sinks is None and window is None:
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=kb.shape[1] != h)
        return out.transpose(1, 2).reshape(t, h * d)
    pos = torch.arange(t // batch, device=q.device)
    visible = pos[None, :] <= pos[:, None]
    if window is not None:
        visible = visible & (pos[:, None] - pos[None, :] < window)
    group = h // kb.shape[1]
    kb, vb = kb.repeat_interleave(group, dim=1), vb.repeat_interleave(group, dim=1)
    scores = (qb @ kb.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    weights = softmax_with_sinks(scores.float(), None if sinks is None else sinks.float().view(1, h, 1, 1))
    return (weights.to(vb.dtype) @ vb).transpose(1, 2).reshape(t, h * d)


class PagedAttention(nn.Module):
    """Attention over a paged KV cache that the runner binds after allocating it.

    `sliding_window`: queries see only the keys less than that many positions back (None: all);
    `sinks`: a learned per-head logit in every softmax (GPT-OSS), the checkpoint's `self_attn.sinks`.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, sinks: bool = False) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # --deterministic (models/deterministic.py): decode, verify and prefill all through fixed_split_attention
        self.deterministic = False

    def cache_for_store(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(k_cache, v_cache, slot_mapping) when this step's K/V go to the paged cache, so a fused
        rotary kernel can write them (then forward(..., stored=True)); None for dense training passes."""
        meta = current_metadata()
        if isinstance(meta, DenseCausalMetadata) or self.k_cache is None or self.v_cache is None:
            return None
        return self.k_cache, self.v_cache, meta.slot_mapping

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stored: bool = False,
                gate: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D] -> [T, H * D]; `gate` [T, H, D] (gated attention): the output times sigmoid(gate), in the
        paged kernel's merge launch on the decode path, as two PyTorch ops elsewhere."""
        out, gated = self._attend(q, k, v, stored, gate)
        return out if gate is None or gated else out * torch.sigmoid(gate.reshape(out.shape))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stored: bool,
                gate: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
        """The attention output [T, H * D], and whether `gate` is already applied (the decode path's kernel)."""
        meta = current_metadata()
        if isinstance(meta, DenseCausalMetadata):
            return dense_causal_attention(q, k, v, meta.batch, self.scale, self.sinks, self.sliding_window), False
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("KV cache not bound: the runner allocates it before the first step")
        if not stored:
            store_kv(self.k_cache, self.v_cache, meta.slot_mapping, k, v)
        if self.deterministic:
            return self._attend_deterministic(q, meta), False
        if meta.decode is not None:
            d = meta.decode
            out = paged_attention(q, self.k_cache, self.v_cache, d.block_tables, d.seq_lens, d.kv_start, d.q_len,
                                  self.scale, causal=True, sinks=self.sinks, window=self.sliding_window, gate=gate)
            return out.reshape(q.shape[0], -1), True
        if meta.fresh_prefill and self.sinks is None and self.sliding_window is None:
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                 v.transpose(0, 1)[None], is_causal=True, scale=self.scale,
                                                 enable_gqa=k.shape[1] != q.shape[1])
            return out[0].transpose(0, 1).reshape(q.shape[0], -1), False
        if self.sinks is not None or self.sliding_window is not None:
            if meta.query_pos is None:
                raise RuntimeError("sliding-window / sink attention needs AttentionMetadata.query_pos (the runner's)")
            out = ragged_paged_attention(q, self.k_cache, self.v_cache, meta.query_index, meta.query_pos,
                                         meta.kv_slots, meta.query_unpad, self.scale, self.sinks, self.sliding_window)
            return out.reshape(q.shape[0], -1), False
        if q.is_cuda and meta.kv_slots is not None and meta.kv_slots.shape[0] == 1 and q.dtype != torch.float32:
            return tail_prefill_attention(q, self.k_cache, self.v_cache, meta.kv_slots, self.scale), False
        return paged_attention_reference(q, self.k_cache, self.v_cache, meta, self.scale), False

    def _attend_deterministic(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Every query through the fixed-split paged kernel: a uniform decode/verify batch in one call, a
        ragged step (prefill chunks, mixed batches) one call per sequence with its new tokens as the queries.
        Sinks and the sliding window (GPT-OSS) ride along."""
        extra = dict(sinks=self.sinks, window=self.sliding_window)
        if meta.decode is not None:
            d = meta.decode
            out = fixed_split_attention(q, self.k_cache, self.v_cache, d.block_tables, d.seq_lens, d.q_len, self.scale,
                                        **extra)
            return out.reshape(q.shape[0], -1)
        if meta.block_tables is None or meta.seq_ends is None or meta.seq_tokens is None:
            raise RuntimeError("deterministic attention needs the block tables of a ragged step: "
                               "ragged_metadata(..., block_tables=True), as the runner builds it in this mode")
        outs = [fixed_split_attention(q[first:first + n], self.k_cache, self.v_cache, meta.block_tables[b:b + 1],
                                      meta.seq_ends[b:b + 1], n, self.scale, **extra)
                for b, (first, n) in enumerate(meta.seq_tokens)]
        return torch.cat(outs).reshape(q.shape[0], -1)
