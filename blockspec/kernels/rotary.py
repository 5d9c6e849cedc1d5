"""Rotary embedding of queries and keys in place, with the optional per-head q/k RMSNorm of Qwen3 fused,
and optionally the K/V write into the paged cache.

One program per (token, head) row of the fused qkv projection: norm (if any), rotate by the token's
position from the precomputed cos/sin table, write back; given the caches, key heads also go to
their cache slot and value heads are copied there. Replaces about fifteen small kernels (seventeen
with the cache write).
"""

from __future__ import annotations

import torch

from blockspec.kernels._triton import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rope_kernel(QKV, POS, COS, SIN, QW, KW, KC, VC, SLOTS, stride_t, num_q, num_k, eps,
                     HAS_NORM: tl.constexpr, STORE: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        half = HALF
        i = tl.arange(0, HALF)
        base = QKV + t * stride_t + h * HEAD_DIM
        if h >= num_q + num_k:  # a value head (launched only with STORE): copy it into the cache
            slot = tl.load(SLOTS + t).to(tl.int64)
            off = (slot * num_k + (h - num_q - num_k)) * HEAD_DIM
            tl.store(VC + off + i, tl.load(base + i).to(VC.dtype.element_ty))
            tl.store(VC + off + half + i, tl.load(base + half + i).to(VC.dtype.element_ty))
        else:
            x1 = tl.load(base + i).to(tl.float32)
            x2 = tl.load(base + half + i).to(tl.float32)
            if HAS_NORM:
                var = (tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / HEAD_DIM
                inv = tl.rsqrt(var + eps)
                is_q = h < num_q
                w1 = tl.where(is_q, tl.load(QW + i), tl.load(KW + i)).to(tl.float32)
                w2 = tl.where(is_q, tl.load(QW + half + i), tl.load(KW + half + i)).to(tl.float32)
                x1 = (x1 * inv).to(QKV.dtype.element_ty).to(tl.float32) * w1
                x2 = (x2 * inv).to(QKV.dtype.element_ty).to(tl.float32) * w2
                x1 = x1.to(QKV.dtype.element_ty).to(tl.float32)
                x2 = x2.to(QKV.dtype.element_ty).to(tl.float32)
            pos = tl.load(POS + t)
            c1 = tl.load(COS + pos * HEAD_DIM + i)
            c2 = tl.load(COS + pos * HEAD_DIM + half + i)
            s1 = tl.load(SIN + pos * HEAD_DIM + i)
            s2 = tl.load(SIN + pos * HEAD_DIM + half + i)
            y1 = (x1 * c1 - x2 * s1).to(QKV.dtype.element_ty)
            y2 = (x2 * c2 + x1 * s2).to(QKV.dtype.element_ty)
            tl.store(base + i, y1)
            tl.store(base + half + i, y2)
            if STORE:  # noqa: SIM102 - a compile-time branch around a run-time one
                if h >= num_q:
                    slot = tl.load(SLOTS + t).to(tl.int64)
                    off = (slot * num_k + (h - num_q)) * HEAD_DIM
                    tl.store(KC + off + i, y1.to(KC.dtype.element_ty))
                    tl.store(KC + off + half + i, y2.to(KC.dtype.element_ty))


def rope_qk_ref(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q: int,
                num_k: int, head_dim: int, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                eps: float, k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                slots: torch.Tensor | None = None) -> None:
    """In place on the q and k heads of qkv [T, (num_q + 2 num_k) * head_dim]; with caches
    ([num_blocks, block_size, num_k, head_dim]) and slots [T], also writes the K/V rows there."""
    t = qkv.shape[0]
    heads = qkv.view(t, -1, head_dim)
    q, k = heads[:, :num_q], heads[:, num_q:num_q + num_k]
    if q_weight is not None:
        for x, w in ((q, q_weight), (k, k_weight)):
            xf = x.float()
            x.copy_(w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype))
    c = cos[positions].unsqueeze(1).to(qkv.dtype)
    s = sin[positions].unsqueeze(1).to(qkv.dtype)
    half = head_dim // 2
    for x in (q, k):
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * c + rotated * s)
    if k_cache is not None:
        from blockspec.models.layers.attention import store_kv

        store_kv(k_cache, v_cache, slots, k, heads[:, num_q + num_k:])


def rope_qk(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q: int,
            num_k: int, head_dim: int, q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
            eps: float = 1e-6, k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
            slots: torch.Tensor | None = None) -> None:
    if not use_triton(qkv) or not qkv.is_contiguous():
        return rope_qk_ref(qkv, positions, cos, sin, num_q, num_k, head_dim, q_weight, k_weight, eps,
                           k_cache, v_cache, slots)
    has_norm, store = q_weight is not None, k_cache is not None
    heads = num_q + 2 * num_k if store else num_q + num_k
    _rope_kernel[(qkv.shape[0], heads)](
        qkv, positions, cos, sin, q_weight if has_norm else cos, k_weight if has_norm else cos,
        k_cache if store else qkv, v_cache if store else qkv, slots if store else positions,
        qkv.stride(0), num_q, num_k, eps, HAS_NORM=has_norm, STORE=store, HEAD_DIM=head_dim, HALF=head_dim // 2,
        num_warps=1)
