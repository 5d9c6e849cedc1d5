"""Rotary embedding of queries and keys in place, with the optional per-head q/k RMSNorm of Qwen3 fused,
and optionally the K/V write into the paged cache.

One program per (token, head) row of the fused qkv projection: norm (if any), rotate by the token's
position from the precomputed cos/sin table, write back; given the caches, key heads also go to
their cache slot and value heads are copied there. Replaces about fifteen small kernels (seventeen
with the cache write).
"""

from __future__ import annotations

import torch

from blockspec.kernels._triton import HAVE_TRITON, pdl, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from blockspec.kernels._triton import release_dependents, wait_for_inputs

    @triton.jit
    def _rope_kernel(QKV, POS, COS, SIN, QW, KW, KC, VC, SLOTS, stride_t, num_q, num_k, eps,
                     HAS_NORM: tl.constexpr, STORE: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                     PDL: tl.constexpr):
        wait_for_inputs(PDL)
        release_dependents(PDL)  # one (token, head) a program: nothing to wait for after the loads
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
    on = pdl(qkv)
    _rope_kernel[(qkv.shape[0], heads)](
        qkv, positions, cos, sin, q_weight if has_norm else cos, k_weight if has_norm else cos,
        k_cache if store else qkv, v_cache if store else qkv, slots if store else positions,
        qkv.stride(0), num_q, num_k, eps, HAS_NORM=has_norm, STORE=store, HEAD_DIM=head_dim, HALF=head_dim // 2,
        PDL=on, num_warps=1, launch_pdl=on)


# ---- heads at any offsets, partial rotary, zero-centred norms (Qwen3-Next / Qwen3.5 gated attention) ------

NORM_NONE, NORM_RMS, NORM_ZERO_CENTERED = 0, 1, 2

if HAVE_TRITON:

    @triton.jit
    def _rope_heads_kernel(X, POS, COS, SIN, QW, KW, KC, VC, SLOTS, stride_t, num_q, num_k, q_stride, k_base,
                           v_base, eps, NORM: tl.constexpr, STORE: tl.constexpr, HEAD_DIM: tl.constexpr,
                           ROT: tl.constexpr, PDL: tl.constexpr):
        # One program per (token, head). Query heads start every q_stride elements (the gated attention's
        # q_proj interleaves [q, gate] per head), key heads at k_base, value heads at v_base. The first ROT
        # dimensions rotate (neox halves), the rest pass through; the norm spans the whole head.
        wait_for_inputs(PDL)
        release_dependents(PDL)  # one (token, head) a program: nothing to wait for after the loads
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        i = tl.arange(0, HEAD_DIM)
        row = X + t * stride_t
        if h >= num_q + num_k:  # a value head (launched only with STORE): copy it into the cache
            slot = tl.load(SLOTS + t).to(tl.int64)
            src = row + v_base + (h - num_q - num_k) * HEAD_DIM
            tl.store(VC + (slot * num_k + (h - num_q - num_k)) * HEAD_DIM + i,
                     tl.load(src + i).to(VC.dtype.element_ty))
        else:
            is_q = h < num_q
            base = tl.where(is_q, row + h * q_stride, row + k_base + (h - num_q) * HEAD_DIM)
            half: tl.constexpr = ROT // 2
            partner = tl.where(i < half, i + half, tl.where(i < ROT, i - half, i))
            x = tl.load(base + i).to(tl.float32)
            xp = tl.load(base + partner).to(tl.float32)
            if NORM != 0:
                inv = tl.rsqrt(tl.sum(x * x, 0) / HEAD_DIM + eps)
                w = tl.where(is_q, tl.load(QW + i), tl.load(KW + i)).to(tl.float32)
                wp = tl.where(is_q, tl.load(QW + partner), tl.load(KW + partner)).to(tl.float32)
                if NORM == 1:  # RMSNorm: the normed value rounds, then the weighted one
                    x = ((x * inv).to(X.dtype.element_ty).to(tl.float32) * w).to(X.dtype.element_ty).to(tl.float32)
                    xp = ((xp * inv).to(X.dtype.element_ty).to(tl.float32) * wp).to(X.dtype.element_ty)
                    xp = xp.to(tl.float32)
                else:  # zero-centred: scale (1 + w) in float32, one rounding
                    x = (x * inv * (1.0 + w)).to(X.dtype.element_ty).to(tl.float32)
                    xp = (xp * inv * (1.0 + wp)).to(X.dtype.element_ty).to(tl.float32)
            pos = tl.load(POS + t)
            rot = i < ROT
            c = tl.load(COS + pos * ROT + i, mask=rot, other=1.0)
            s = tl.load(SIN + pos * ROT + i, mask=rot, other=0.0)
            sign = tl.where(i < half, -1.0, 1.0)
            y = tl.where(rot, x * c + sign * xp * s, x).to(X.dtype.element_ty)
            tl.store(base + i, y)
            if STORE:  # noqa: SIM102 - a compile-time branch around a run-time one
                if h >= num_q:
                    slot = tl.load(SLOTS + t).to(tl.int64)
                    tl.store(KC + (slot * num_k + (h - num_q)) * HEAD_DIM + i, y.to(KC.dtype.element_ty))


def _head_views(x: torch.Tensor, num_q: int, num_k: int, head_dim: int, q_stride: int, k_base: int,
                v_base: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, nq, d], [T, nk, d], [T, nk, d] views of the rows of x at the given offsets."""
    t = x.shape[0]
    q = x.as_strided((t, num_q, head_dim), (x.stride(0), q_stride, 1), x.storage_offset())
    k = x[:, k_base:k_base + num_k * head_dim].view(t, num_k, head_dim)
    v = x[:, v_base:v_base + num_k * head_dim].view(t, num_k, head_dim)
    return q, k, v


def rope_heads_ref(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q: int,
                   num_k: int, head_dim: int, q_stride: int, k_base: int, v_base: int, norm: int,
                   q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                   k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                   slots: torch.Tensor | None = None) -> None:
    """The definition (in place): per-head norm, neox rotary of the first cos.shape[1] dims, cache write."""
    q, k, v = _head_views(x, num_q, num_k, head_dim, q_stride, k_base, v_base)
    rot = cos.shape[1]
    half = rot // 2
    for heads, w in ((q, q_weight), (k, k_weight)):
        y = heads.float()
        if norm != NORM_NONE:
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
            if norm == NORM_RMS:
                y = (w.float() * y.to(x.dtype).float()).to(x.dtype).float()
            else:
                y = (y * (1.0 + w.float())).to(x.dtype).float()
        c, s = cos[positions][:, None].float(), sin[positions][:, None].float()
        r = y[..., :rot]
        rotated = torch.cat((-r[..., half:], r[..., :half]), dim=-1)
        y = torch.cat((r * c + rotated * s, y[..., rot:]), dim=-1)
        heads.copy_(y.to(x.dtype))
    if k_cache is not None:
        from blockspec.models.layers.attention import store_kv

        store_kv(k_cache, v_cache, slots, k, v)


def rope_heads(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q: int,
               num_k: int, head_dim: int, q_stride: int, k_base: int, v_base: int, norm: int = NORM_NONE,
               q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6,
               k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
               slots: torch.Tensor | None = None) -> None:
    """rope_qk for heads at arbitrary offsets of each row of x (one launch on GPU, in place)."""
    rot = cos.shape[1]
    if not use_triton(x) or x.stride(1) != 1 or head_dim & (head_dim - 1) or rot % 2:
        return rope_heads_ref(x, positions, cos, sin, num_q, num_k, head_dim, q_stride, k_base, v_base, norm,
                              q_weight, k_weight, eps, k_cache, v_cache, slots)
    store = k_cache is not None
    heads = num_q + 2 * num_k if store else num_q + num_k
    has_norm = norm != NORM_NONE
    on = pdl(x)
    _rope_heads_kernel[(x.shape[0], heads)](
        x, positions, cos, sin, q_weight if has_norm else cos, k_weight if has_norm else cos,
        k_cache if store else x, v_cache if store else x, slots if store else positions,
        x.stride(0), num_q, num_k, q_stride, k_base, v_base, eps, NORM=norm, STORE=store, HEAD_DIM=head_dim,
        ROT=rot, PDL=on, num_warps=1 if head_dim <= 128 else 2, launch_pdl=on)
