"""Paged attention for decode, verify and drafter blocks: a Triton kernel and its PyTorch reference.

Every sequence in the batch brings the same number of queries q_len (1 for plain decoding, k+1 for a
verify block or a drafter block), placed at the end of its context: query i sits at position
seq_len - q_len + i. Keys come straight from the paged cache through the block table, so shapes do not
depend on context length and the call can live inside a CUDA graph. The kernel splits each sequence's
keys over several programs (flash-decoding) so that batch 1 still fills the GPU; a second small kernel
merges the partial softmaxes.

Masks: `causal` (query i sees keys up to its own position) for the target; non-causal for the DFlash
drafter, whose block queries see every block key. `kv_start[b]` hides keys before that position (the
drafter's context window). `window` > 0 is a sliding window (DFlash 2's layers): query and key at most
window - 1 positions apart. `q_start[b]`, when given, is the position of the row's first query (the
drafter's anchor: a block shorter than q_len ends before seq_len); else queries end at seq_len.
"""

from __future__ import annotations

import torch

from blockspec.kernels._triton import HAVE_TRITON, use_triton

if HAVE_TRITON:  # CPU-only installs: the reference below is the implementation there
    import triton
    import triton.language as tl


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, kv_start: torch.Tensor, q_len: int, scale: float,
                        causal: bool, window: int = 0, q_start: torch.Tensor | None = None) -> torch.Tensor:
    """q [B * q_len, H, D] -> [B * q_len, H, D]; one sequence at a time, in float32.

    Each KV head's group of query heads attends as one matrix (no repeated K/V copies): this is also
    the CPU implementation, where copying K/V per layer cost more than the attention itself."""
    b_count = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv, page = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv
    out = torch.empty_like(q)
    for b in range(b_count):
        n = int(seq_lens[b])
        pages = block_tables[b, : -(-n // page)]
        k = k_cache[pages].flatten(0, 1)[:n].float().transpose(0, 1)  # [Hkv, n, D]
        v = v_cache[pages].flatten(0, 1)[:n].float().transpose(0, 1)
        qb = q[b * q_len:(b + 1) * q_len].float().view(q_len, num_kv, group, head_dim)
        qb = qb.permute(1, 2, 0, 3).reshape(num_kv, group * q_len, head_dim)  # rows: (head in group, query)
        scores = torch.matmul(qb, k.transpose(1, 2)) * scale  # [Hkv, G * q_len, n]
        key_pos = torch.arange(n, device=q.device)
        first = n - q_len if q_start is None else int(q_start[b])
        query_pos = (first + torch.arange(q_len, device=q.device)).repeat(group)
        visible = key_pos[None, :] >= int(kv_start[b])
        if causal:
            visible = visible & (key_pos[None, :] <= query_pos[:, None])
        if window > 0:
            visible = visible & (query_pos[:, None] - key_pos[None, :] < window)
            if not causal:
                visible = visible & (key_pos[None, :] - query_pos[:, None] < window)
        scores = scores.masked_fill(~visible[None], float("-inf"))
        o = torch.matmul(scores.softmax(-1), v).view(num_kv, group, q_len, head_dim)
        out[b * q_len:(b + 1) * q_len] = o.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim).to(q.dtype)
    return out


if HAVE_TRITON:

    @triton.jit
    def _paged_attention_kernel(
        Q, K, V, Out, M, L, BT, SEQ_LENS, KV_START, Q_START,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_bt, stride_ob, stride_oh, stride_os, stride_om,
        scale, q_len, num_splits, window,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_Q_START: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(SEQ_LENS + b)
        kv_start = tl.load(KV_START + b)
        rows = tl.arange(0, BLOCK_M)
        qi = rows // GROUP
        head = kvh * GROUP + rows % GROUP
        row_ok = qi < q_len
        if HAS_Q_START:
            q0 = tl.load(Q_START + b)
        else:
            q0 = seq_len - q_len
        q_pos = q0 + qi
        if window > 0:  # no key before the first query's window is visible to any query
            kv_start = tl.maximum(kv_start, q0 - window + 1)
        kv_start = tl.maximum(kv_start, 0)
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + (b * q_len + qi)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None], other=0.0)
        # This split's share of the key range [kv_start, seq_len), in BLOCK_N tiles.
        first_tile = kv_start // BLOCK_N
        tiles = tl.cdiv(seq_len, BLOCK_N) - first_tile
        per_split = tl.cdiv(tiles, num_splits)
        t0 = first_tile + split * per_split
        t1 = tl.minimum(t0 + per_split, first_tile + tiles)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        cols = tl.arange(0, BLOCK_N)
        for t in range(t0, t1):
            n = t * BLOCK_N + cols
            n_ok = (n < seq_len) & (n >= kv_start)
            blk = tl.load(BT + b * stride_bt + n // PAGE, mask=n < seq_len, other=0)
            slot = n % PAGE
            k = tl.load(K + blk[:, None] * stride_kb + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                        mask=n_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            visible = n_ok[None, :] & row_ok[:, None]
            if CAUSAL:
                visible = visible & (n[None, :] <= q_pos[:, None])
            if window > 0:
                visible = visible & (q_pos[:, None] - n[None, :] < window)
                if not CAUSAL:
                    visible = visible & (n[None, :] - q_pos[:, None] < window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + blk[:, None] * stride_vb + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                        mask=n_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        base = b * stride_ob + kvh * stride_oh + split * stride_os
        tl.store(Out + base + rows[:, None] * stride_om + d[None, :], acc)
        tl.store(M + (b * tl.num_programs(1) + kvh) * num_splits * BLOCK_M + split * BLOCK_M + rows, m_i)
        tl.store(L + (b * tl.num_programs(1) + kvh) * num_splits * BLOCK_M + split * BLOCK_M + rows, l_i)


if HAVE_TRITON:

    @triton.jit
    def _merge_splits_kernel(Part, M, L, Out, stride_ob, stride_oh, stride_os, stride_om, stride_t, stride_h,
                             q_len, num_splits, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                             BLOCK_M: tl.constexpr, SPLITS: tl.constexpr):
        """Combine the splits' partial softmaxes of one query row (log-sum-exp weights)."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        row = tl.program_id(2)
        s = tl.arange(0, SPLITS)
        s_ok = s < num_splits
        ml_base = (b * tl.num_programs(1) + kvh) * num_splits * BLOCK_M
        m = tl.load(M + ml_base + s * BLOCK_M + row, mask=s_ok, other=float("-inf"))
        ll = tl.load(L + ml_base + s * BLOCK_M + row, mask=s_ok, other=0.0)
        m_max = tl.max(m, 0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.exp(m - m_max)
        d = tl.arange(0, HEAD_DIM)
        acc = tl.load(Part + b * stride_ob + kvh * stride_oh + s[:, None] * stride_os + row * stride_om + d[None, :],
                      mask=s_ok[:, None], other=0.0)
        num = tl.sum(acc * w[:, None], 0)
        den = tl.maximum(tl.sum(ll * w, 0), 1e-30)
        qi = row // GROUP
        head = kvh * GROUP + row % GROUP
        tl.store(Out + (b * q_len + qi) * stride_t + head * stride_h + d, (num / den).to(Out.dtype.element_ty))


def _next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, kv_start: torch.Tensor, q_len: int, scale: float, causal: bool,
                    num_splits: int = 8, window: int = 0, q_start: torch.Tensor | None = None) -> torch.Tensor:
    """Triton paged attention on CUDA (the reference elsewhere); same contract as paged_attention_ref."""
    if not use_triton(q):
        return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, kv_start, q_len, scale, causal,
                                   window, q_start)
    b_count = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv = k_cache.shape[2]
    group = num_heads // num_kv
    block_m = max(16, _next_pow2(q_len * group))
    o = torch.empty(b_count, num_kv, num_splits, block_m, head_dim, device=q.device, dtype=torch.float32)
    m = torch.empty(b_count, num_kv, num_splits, block_m, device=q.device, dtype=torch.float32)
    ll = torch.empty_like(m)
    _paged_attention_kernel[(b_count, num_kv, num_splits)](
        q, k_cache, v_cache, o, m, ll, block_tables, seq_lens, kv_start, seq_lens if q_start is None else q_start,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), o.stride(0), o.stride(1), o.stride(2), o.stride(3),
        scale, q_len, num_splits, window,
        GROUP=group, HEAD_DIM=head_dim, PAGE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_N=64, CAUSAL=causal,
        HAS_Q_START=q_start is not None,
        num_warps=4, num_stages=2,
    )
    out = torch.empty_like(q)
    _merge_splits_kernel[(b_count, num_kv, q_len * group)](
        o, m, ll, out, o.stride(0), o.stride(1), o.stride(2), o.stride(3), out.stride(0), out.stride(1),
        q_len, num_splits, GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m,
        SPLITS=_next_pow2(num_splits), num_warps=1)
    return out
