"""Paged attention for decode, verify, drafter blocks and ragged prefill: Triton kernels and their references.

Decode/verify (`paged_attention`): every sequence in the batch brings the same number of queries q_len
(1 for plain decoding, k+1 for a verify block or a drafter block), placed at the end of its context:
query i sits at position seq_len - q_len + i. Keys come straight from the paged cache through the block
table, so shapes do not depend on context length and the call can live inside a CUDA graph. The kernel
splits each sequence's keys over several programs (flash-decoding) so that batch 1 still fills the GPU;
a second small kernel merges the partial softmaxes.

Ragged prefill (`ragged_paged_attention`): prefill chunks and mixed batches, described as the runner's
general path does (padded query index and positions, and the cache slot of every key position); the
kernel tiles each sequence's queries and reads the keys by slot. Layers with sinks or a sliding window
take it on the GPU (SDPA has neither); the others keep the SDPA paths of models/layers/attention.py.

Masks: `causal` (query i sees keys up to its own position) for the target; non-causal for the DFlash
drafter, whose block queries see every block key. `kv_start[b]` hides keys before that position (the
drafter's context window). `window` (sliding-window layers: GPT-OSS, DFlash 2 drafters): query and key
fewer than `window` positions apart (for causal layers: keys at positions > p - window). `q_start[b]`,
when given, is the position of row b's first query (a DFlash 2 drafter block shorter than q_len ends
before seq_len, its padding queries after it); else queries end at seq_len. `sinks` [H] (GPT-OSS): a
learned logit per head that joins every row's softmax as one more key with a zero value, so attention
weights may sum to less than one.
"""

from __future__ import annotations

import torch

from blockspec.device import sm_count
from blockspec.kernels._triton import HAVE_TRITON, pdl, use_triton

if HAVE_TRITON:  # CPU-only installs: the reference below is the implementation there
    import triton
    import triton.language as tl

    from blockspec.kernels._triton import release_dependents, wait_for_inputs


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim; with `sinks` (broadcastable to scores[..., :1]) each row's normaliser also
    counts exp(sink), the sink's own weight being dropped (it attends to nothing)."""
    if sinks is None:
        return scores.softmax(-1)
    logits = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
    return logits.softmax(-1)[..., :-1]


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, kv_start: torch.Tensor, q_len: int, scale: float,
                        causal: bool, sinks: torch.Tensor | None = None, window: int | None = None,
                        q_start: torch.Tensor | None = None) -> torch.Tensor:
    """q [B * q_len, H, D] -> [B * q_len, H, D]; one sequence at a time, in float32.

    Each KV head's group of query heads attends as one matrix (no repeated K/V copies): this is also
    the CPU implementation, where copying K/V per layer cost more than the attention itself."""
    b_count = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv, page = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv
    # per row (head in group, query) of each KV head's matrix
    row_sinks = None if sinks is None else \
        sinks.float().view(num_kv, group, 1).expand(num_kv, group, q_len).reshape(num_kv, group * q_len, 1)
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
        if window is not None:
            visible = visible & (query_pos[:, None] - key_pos[None, :] < window)
            if not causal:
                visible = visible & (key_pos[None, :] - query_pos[:, None] < window)
        scores = scores.masked_fill(~visible[None], float("-inf"))
        o = torch.matmul(softmax_with_sinks(scores, row_sinks), v).view(num_kv, group, q_len, head_dim)
        out[b * q_len:(b + 1) * q_len] = o.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim).to(q.dtype)
    return out


def ragged_paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               query_index: torch.Tensor, query_pos: torch.Tensor, kv_slots: torch.Tensor,
                               query_unpad: torch.Tensor, scale: float, sinks: torch.Tensor | None = None,
                               window: int | None = None) -> torch.Tensor:
    """Causal attention of a ragged batch over the paged cache (K/V already written), in float32.

    q [T, H, D]; query_index / query_pos [B, Qmax]: flat token index and position of each padded query;
    kv_slots [B, Lmax]: cache slot of key position j of sequence b (positions start at 0); query_unpad [T]:
    each real token's row among the B * Qmax padded ones. Returns [T, H, D]."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv = k_cache.shape[2]
    group = num_heads // num_kv
    b_count, qmax = query_index.shape
    flat_k = k_cache.view(-1, num_kv, head_dim)
    flat_v = v_cache.view(-1, num_kv, head_dim)
    k = flat_k[kv_slots].float().permute(0, 2, 1, 3)  # [B, Hkv, L, D]
    v = flat_v[kv_slots].float().permute(0, 2, 1, 3)
    qg = q[query_index].float().view(b_count, qmax, num_kv, group, head_dim).permute(0, 2, 3, 1, 4)
    scores = torch.matmul(qg.reshape(b_count, num_kv, group * qmax, head_dim), k.transpose(2, 3)) * scale
    key_pos = torch.arange(kv_slots.shape[1], device=q.device)
    qpos = query_pos[:, None, :, None]  # [B, 1, Qmax, 1]
    visible = key_pos <= qpos
    if window is not None:
        visible = visible & (qpos - key_pos < window)
    scores = scores.view(b_count, num_kv, group, qmax, -1).masked_fill(~visible[:, :, None], float("-inf"))
    row_sinks = None if sinks is None else sinks.float().view(1, num_kv, group, 1, 1)
    o = torch.matmul(softmax_with_sinks(scores, row_sinks).flatten(2, 3), v)  # [B, Hkv, G * Qmax, D]
    o = o.view(b_count, num_kv, group, qmax, head_dim).permute(0, 3, 1, 2, 4).reshape(-1, num_heads, head_dim)
    return o[query_unpad].to(q.dtype)


if HAVE_TRITON:

    @triton.jit
    def _online_softmax_step(s, visible, v, m_i, l_i, acc):
        """Fold one key tile into a running softmax: scores s [M, N] where visible, values v [N, D]; returns
        the new row maxima, normalisers and (unnormalised) accumulator."""
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)

    @triton.jit
    def _first_tile(kv_start, q0, window, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr):
        """The first BLOCK_N key tile any query of the block sees."""
        lo = kv_start
        if WINDOWED:  # the first query sees keys after q0 - window: earlier tiles are skipped
            lo = tl.maximum(lo, q0 + 1 - window)
        return lo // BLOCK_N

    @triton.jit
    def _split_share(seq_len, kv_start, q0, window, num_splits, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr):
        """The default split of a sequence's visible key range into BLOCK_N tiles: (first tile, tiles, tiles a
        split, splits with keys). At least a tile a split, so a short context leaves the last splits of the
        launch without keys and one launch shape serves every context inside a CUDA graph; the attention and
        merge kernels both derive which splits hold keys from this alone. (At least 2-8 tiles a split measured
        slower at batch 1 for decode and verify blocks alike: attention_sweep_min_tiles_h100_cfe33e7.json.)"""
        first_tile = _first_tile(kv_start, q0, window, BLOCK_N, WINDOWED)
        tiles = tl.cdiv(seq_len, BLOCK_N) - first_tile
        per_split = tl.maximum(tl.cdiv(tiles, tl.maximum(tl.minimum(num_splits, tiles), 1)), 1)
        return first_tile, tiles, per_split, tl.cdiv(tl.maximum(tiles, 0), per_split)

    @triton.jit
    def _paged_attention_kernel(
        Q, K, V, Out, M, L, BT, SEQ_LENS, KV_START, Q_START,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_bt, stride_ob, stride_oh, stride_os, stride_om,
        scale, q_len, num_splits, window,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, HAS_Q_START: tl.constexpr,
        ROW_TILES: tl.constexpr, SPLIT_TILES: tl.constexpr, PDL: tl.constexpr = False, EARLY: tl.constexpr = False,
    ):
        """One (sequence, KV head, tile of BLOCK_M query rows, split of the key range): its rows are the
        (query, head of the group) pairs tile * BLOCK_M.. of that KV head, all queries' heads in one matrix.
        SPLIT_TILES = 0: the sequence's key range shared evenly among the splits (`_split_share`); a split without
        keys stores nothing (the merge reads the splits with keys only). > 0 (deterministic mode): split s holds
        the absolute key tiles [s * SPLIT_TILES, (s + 1) * SPLIT_TILES), tiles no row of the program can see are
        skipped (exactly nothing for those rows), splits past the sequence store nothing."""
        # The step's lengths are written before its first layer, never by the kernel just before this one: under
        # PDL they are read, and a split without keys returns, before waiting for that kernel (q, the new keys).
        if EARLY:  # `decode_releases_early`
            release_dependents(PDL)
        b = tl.program_id(0)
        kvh = tl.program_id(1) // ROW_TILES
        rows = (tl.program_id(1) % ROW_TILES) * BLOCK_M + tl.arange(0, BLOCK_M)
        split = tl.program_id(2)
        seq_len = tl.load(SEQ_LENS + b)
        kv_start = tl.load(KV_START + b)
        qi = rows // GROUP
        head = kvh * GROUP + rows % GROUP
        row_ok = qi < q_len
        if HAS_Q_START:
            q0 = tl.load(Q_START + b)
        else:
            q0 = seq_len - q_len
        q_pos = q0 + qi
        d = tl.arange(0, HEAD_DIM)
        if SPLIT_TILES > 0:
            hi = seq_len
            if CAUSAL:  # the tile's last query sees nothing past its own position
                last_q = tl.minimum(((tl.program_id(1) % ROW_TILES) * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
                hi = tl.minimum(hi, q0 + last_q + 1)
            t0 = tl.maximum(split * SPLIT_TILES, _first_tile(kv_start, q0, window, BLOCK_N, WINDOWED))
            t1 = tl.minimum((split + 1) * SPLIT_TILES, tl.cdiv(hi, BLOCK_N))
            live = split * (SPLIT_TILES * BLOCK_N) < seq_len
        else:
            first_tile, tiles, per_split, _ = _split_share(seq_len, kv_start, q0, window, num_splits, BLOCK_N,
                                                           WINDOWED)
            t0 = first_tile + split * per_split
            t1 = tl.minimum(t0 + per_split, first_tile + tiles)
            if t1 <= t0:  # a split without keys (past a short context): the merge reads nothing of it
                return
            live = True
        wait_for_inputs(PDL)
        q = tl.load(Q + (b * q_len + qi)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None], other=0.0)
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
            if WINDOWED:
                visible = visible & (q_pos[:, None] - n[None, :] < window)
                if not CAUSAL:
                    visible = visible & (n[None, :] - q_pos[:, None] < window)
            v = tl.load(V + blk[:, None] * stride_vb + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                        mask=n_ok[:, None], other=0.0)
            m_i, l_i, acc = _online_softmax_step(s, visible, v, m_i, l_i, acc)
        if not EARLY:
            release_dependents(PDL)
        base = b * stride_ob + kvh * stride_oh + split * stride_os
        TOTAL_M: tl.constexpr = ROW_TILES * BLOCK_M
        ml = (b * (tl.num_programs(1) // ROW_TILES) + kvh) * num_splits * TOTAL_M + split * TOTAL_M + rows
        live_rows = rows < tl.where(live, TOTAL_M, 0)  # all rows, or none for a split past the sequence
        tl.store(Out + base + rows[:, None] * stride_om + d[None, :], acc, mask=live_rows[:, None])
        tl.store(M + ml, m_i, mask=live_rows)
        tl.store(L + ml, l_i, mask=live_rows)


if HAVE_TRITON:

    @triton.jit
    def _gated(y, g):
        """y times sigmoid(g) (g in float32), rounded as the two PyTorch ops (sigmoid in y's dtype, then the product)
        would round it."""
        sg = (1.0 / (1.0 + tl.exp(-g))).to(y.dtype)
        return (y.to(tl.float32) * sg.to(tl.float32)).to(y.dtype)

    @triton.jit
    def _merge_splits_kernel(Part, M, L, Out, SINKS, GATE, SEQ_LENS, KV_START, Q_START, stride_ob, stride_oh,
                             stride_os, stride_om, stride_t, stride_h, stride_gt, stride_gh, q_len, num_splits, window,
                             GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, WINDOWED: tl.constexpr,
                             HAS_Q_START: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_GATE: tl.constexpr,
                             PDL: tl.constexpr = False, EARLY: tl.constexpr = False):
        """Combine the splits' partial softmaxes of one query row (log-sum-exp weights), the sink's logit
        joining the normaliser; with HAS_GATE the output times sigmoid(gate), rounded as the two PyTorch ops
        (sigmoid in the activation dtype, then the product) would round it. Only the splits with keys are read
        (`_split_share`, from the sequence's length: a graph's launch has up to 64 splits, a short context
        fills a few), CHUNK at a time with a running maximum; a chunk's maxima, normalisers and values in one round
        trip (a row that saw no key of a split has m = -inf, l = 0 and zero values there, which weigh nothing:
        k = 15 target graph of Qwen3-8B NVFP4 4.165 -> 4.149 ms on an H100 against masking the values by the
        maxima)."""
        if EARLY:  # `decode_releases_early`
            release_dependents(PDL)
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        row = tl.program_id(2)
        qi = row // GROUP
        head = kvh * GROUP + row % GROUP
        seq_len = tl.load(SEQ_LENS + b)
        if HAS_Q_START:
            q0 = tl.load(Q_START + b)
        else:
            q0 = seq_len - q_len
        n_live = _split_share(seq_len, tl.load(KV_START + b), q0, window, num_splits, BLOCK_N, WINDOWED)[3]
        wait_for_inputs(PDL)  # the lengths above are the step's, not the attention launch's: read before it ends
        ml_base = (b * tl.num_programs(1) + kvh) * num_splits * BLOCK_M + row
        part = Part + b * stride_ob + kvh * stride_oh + row * stride_om
        d = tl.arange(0, HEAD_DIM)
        c = tl.arange(0, CHUNK)
        m_run = tl.max(tl.full([CHUNK], float("-inf"), tl.float32), 0)
        if HAS_SINKS:  # the sink joins as one more logit with a zero value
            m_run = tl.load(SINKS + head).to(tl.float32)
        m_safe = tl.where(m_run == float("-inf"), 0.0, m_run)
        den = tl.exp(m_run - m_safe)  # the sink's weight, or 0
        num = tl.zeros([HEAD_DIM], dtype=tl.float32)
        for s0 in range(0, n_live, CHUNK):
            s = s0 + c
            s_ok = s < n_live
            m = tl.load(M + ml_base + s * BLOCK_M, mask=s_ok, other=float("-inf"))
            acc = tl.load(part + s[:, None] * stride_os + d[None, :], mask=s_ok[:, None], other=0.0)
            ll = tl.load(L + ml_base + s * BLOCK_M, mask=s_ok, other=0.0)
            m_new = tl.maximum(m_run, tl.max(m, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_run - m_safe)
            w = tl.exp(m - m_safe)
            num = num * alpha + tl.sum(acc * w[:, None], 0)
            den = den * alpha + tl.sum(ll * w, 0)
            m_run = m_new
        den = tl.maximum(den, 1e-30)
        y = (num / den).to(Out.dtype.element_ty)
        if HAS_GATE:
            y = _gated(y, tl.load(GATE + (b * q_len + qi) * stride_gt + head * stride_gh + d).to(tl.float32))
        if not EARLY:
            release_dependents(PDL)
        tl.store(Out + (b * q_len + qi) * stride_t + head * stride_h + d, y)


if HAVE_TRITON:

    @triton.jit
    def _merge_fixed_splits_kernel(Part, M, L, Out, SEQ_LENS, SINKS, stride_ob, stride_oh, stride_os, stride_om,
                                   stride_t, stride_h, q_len, num_splits, SPLIT: tl.constexpr, GROUP: tl.constexpr,
                                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, HAS_SINKS: tl.constexpr):
        """Deterministic mode: one query row's splits folded one after another in split order, up to the
        sequence's last split. A split the row sees nothing of (m = -inf, l = 0, acc = 0: past its position, or
        before its sliding window) leaves the running values exactly as they were (its weight is exp(-inf) = 0,
        theirs exp(0) = 1), so a row merges the same numbers in the same order whatever the sequence's length
        past its position. HAS_SINKS: the head's sink logit joins the normaliser last, once, as one more key
        with a zero value."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        row = tl.program_id(2)
        qi = row // GROUP
        head = kvh * GROUP + row % GROUP
        seq_len = tl.load(SEQ_LENS + b)
        n_live = tl.minimum(tl.cdiv(seq_len, SPLIT), num_splits)
        ml_base = (b * tl.num_programs(1) + kvh) * num_splits * BLOCK_M + row
        d = tl.arange(0, HEAD_DIM)
        part = Part + b * stride_ob + kvh * stride_oh + row * stride_om + d
        m = tl.load(M + ml_base)
        den = tl.load(L + ml_base)
        acc = tl.load(part)
        for s in range(1, n_live):
            m_s = tl.load(M + ml_base + s * BLOCK_M)
            m_new = tl.maximum(m, m_s)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            beta = tl.exp(m_s - m_safe)
            den = den * alpha + tl.load(L + ml_base + s * BLOCK_M) * beta
            acc = acc * alpha + tl.load(part + s * stride_os) * beta
            m = m_new
        if HAS_SINKS:
            sink = tl.load(SINKS + head).to(tl.float32)
            m_new = tl.maximum(m, sink)
            alpha = tl.exp(m - m_new)
            den = den * alpha + tl.exp(sink - m_new)
            acc = acc * alpha
        den = tl.maximum(den, 1e-30)
        tl.store(Out + (b * q_len + qi) * stride_t + head * stride_h + d, (acc / den).to(Out.dtype.element_ty))


if HAVE_TRITON:

    @triton.jit
    def _ragged_attention_kernel(
        Q, K, V, Out, SINKS, QUERY_INDEX, QUERY_POS, KV_SLOTS,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
        stride_qib, stride_qpb, stride_kvb, qmax, lmax, scale, window,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr, HAS_SINKS: tl.constexpr,
    ):
        """One (sequence, KV head, tile of BLOCK_Q queries): the tile's query heads of that KV head as the
        rows of one matrix, keys read by slot from the key range its queries can see."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        qi = tl.program_id(2) * BLOCK_Q + rows // GROUP
        head = kvh * GROUP + rows % GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (qi < qmax)
        tok = tl.load(QUERY_INDEX + b * stride_qib + qi, mask=row_ok, other=0)
        q_pos = tl.load(QUERY_POS + b * stride_qpb + qi, mask=row_ok, other=-1)
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None],
                    other=0.0)
        hi = tl.minimum(tl.max(q_pos, 0) + 1, lmax)
        lo = 0
        if WINDOWED:
            lo = tl.maximum(tl.min(tl.where(row_ok, q_pos, lmax), 0) + 1 - window, 0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        cols = tl.arange(0, BLOCK_N)
        for start in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
            n = start + cols
            n_ok = n < hi
            slot = tl.load(KV_SLOTS + b * stride_kvb + n, mask=n_ok, other=0)
            k = tl.load(K + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=n_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            visible = n_ok[None, :] & row_ok[:, None] & (n[None, :] <= q_pos[:, None])
            if WINDOWED:
                visible = visible & (q_pos[:, None] - n[None, :] < window)
            v = tl.load(V + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=n_ok[:, None], other=0.0)
            m_i, l_i, acc = _online_softmax_step(s, visible, v, m_i, l_i, acc)
        if HAS_SINKS:
            sink = tl.load(SINKS + head, mask=row_ok, other=0.0).to(tl.float32)
            m_new = tl.maximum(m_i, sink)
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.exp(sink - m_new)
            acc = acc * alpha[:, None]
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        row = b * qmax + qi
        tl.store(Out + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None])


def _next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


_KEY_TILE = 64  # keys per step of the paged kernel (BLOCK_N) in --deterministic mode; fixed splits are whole tiles


def _ragged_tile(head_dim: int) -> tuple[int, int]:
    """(keys a step, warps) of the ragged (prefill) kernel. Its key tiles are gathered through the block table into
    registers (no cp.async pipeline): 8 warps, 32-key tiles at head_dim 256. Chosen from register counts, not timed:
    compiled without the JIT's divisibility specialisation, 64-key tiles at 4 warps seemed to spill 1.8 KB a thread;
    as launched (strides multiples of 16) they take 255 registers and 8 bytes of stack, and 64-key tiles at 8 warps
    201 registers without spills (bench/compile_sm90.py), a candidate for a prefill measurement."""
    return (32 if head_dim >= 256 else 64), 8


def _decode_tile(rows: int) -> tuple[int, int]:
    """(keys a step, warps) of the paged decode / verify kernel for `rows` query rows a KV head, from
    bench/attention_sweep.py --sweep on an H100 (bench/results/attention_sweep_h100_0c3de9e.json): 64-key tiles
    everywhere; 8 warps for decode rows, 4 for verify blocks (Qwen3.6-27B 16 queries: 12.2 us vs 16.6 with the
    32-key, 8-warp tile). As launched none spills: 64 registers for Qwen3-8B decode rows, 140-212 for verify blocks
    (bench/compile_sm90.py with the JIT's divisibility specialisation)."""
    return 64, (8 if rows <= _FEW_ROWS else 4)


def _split_partials(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, kv_start: torch.Tensor, q_start: torch.Tensor | None, q_len: int,
                    scale: float, causal: bool, window: int | None, num_splits: int, block_m: int,
                    split_tiles: int, block_n: int = _KEY_TILE, num_warps: int = 4, early: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The partial softmaxes of every (sequence, KV head, row tile, split): (o, m, l, rows per KV head) for a merge
    kernel. split_tiles 0: each sequence's key range shared evenly among num_splits; > 0: fixed absolute splits
    of that many 64-key tiles (--deterministic). `early`: the dependents may launch before this launch's wait
    (`decode_releases_early`)."""
    b_count, head_dim = seq_lens.shape[0], q.shape[2]
    num_kv = k_cache.shape[2]
    group = q.shape[1] // num_kv
    row_tiles = -(-(q_len * group) // block_m)
    total_m = row_tiles * block_m
    o = torch.empty(b_count, num_kv, num_splits, total_m, head_dim, device=q.device, dtype=torch.float32)
    m = torch.empty(b_count, num_kv, num_splits, total_m, device=q.device, dtype=torch.float32)
    ll = torch.empty_like(m)
    on = pdl(q)
    _paged_attention_kernel[(b_count, num_kv * row_tiles, num_splits)](
        q, k_cache, v_cache, o, m, ll, block_tables, seq_lens, kv_start, seq_lens if q_start is None else q_start,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), o.stride(0), o.stride(1), o.stride(2), o.stride(3),
        scale, q_len, num_splits, window or 0,
        GROUP=group, HEAD_DIM=head_dim, PAGE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
        WINDOWED=window is not None, HAS_Q_START=q_start is not None, ROW_TILES=row_tiles, SPLIT_TILES=split_tiles,
        PDL=on, EARLY=early, num_warps=num_warps, num_stages=2, launch_pdl=on,
    )
    return o, m, ll, total_m


_SPLITS = 8  # the fewest key-range splits of a (sequence, KV head, row tile)
_MAX_SPLITS = 64
_MAX_BLOCK_SPLITS = 32  # the most for verify and drafter blocks (more rows a KV head than _FEW_ROWS)
_FEW_ROWS = 16  # query rows a KV head up to which a block counts as decode rows (8 warps a program)


def split_count(device: torch.device, programs: int, rows: int = 1) -> int:
    """How many splits each (sequence, KV head, row tile) program's key range may take: enough to give every SM
    two programs (batch 1 has 2 to 8 KV heads: 8 splits would leave most of 132 SMs idle on a latency chain of
    tiles), between 8 and 64, or 32 for blocks of more than _FEW_ROWS rows a KV head. The count is fixed per
    launch shape (a CUDA graph captures it); the kernel uses at most one split a 64-key tile of the sequence
    (its length is read on the device), so a short context runs fewer and the merge reads only those, yet the
    launched ones still cost: H100 sweep (attention_sweep --sweep, b23d1d3), Qwen3-Coder-30B-A3B shape at batch
    1: decode 5.6 / 6.5 / 6.6 us at 16 / 32 / 64 splits for 1,024 keys, 19.6 / 15.3 / 13.0 for 8,192; a
    16-query verify block 8.3 / 10.4 / 12.8 for 1,024 keys, 26.8 / 21.6 / 21.9 for 8,192 (Qwen3.6-35B-A3B's
    alike): 64 for decode rows, where long contexts gain most, 32 for blocks, best or near it at both lengths."""
    if device.type != "cuda":
        return _SPLITS
    cap = _MAX_SPLITS if rows <= _FEW_ROWS else _MAX_BLOCK_SPLITS
    return max(_SPLITS, min(cap, -(-2 * sm_count(device) // programs)))


def default_launch(device: torch.device, b_count: int, num_kv: int, q_len: int, group: int, head_dim: int
                   ) -> tuple[int, int]:
    """(query rows a tile, splits) that paged_attention picks. Row tiles of at most 8192 / head_dim rows (a
    [BLOCK_M, HEAD_DIM] float32 accumulator of <= 64 registers a thread): a 27B verify (16 queries x 6 heads,
    head_dim 256) as 3 programs of 32 rows a (KV head, split), not one of 128 whose accumulator spilled."""
    rows = q_len * group
    block_m = min(max(16, _next_pow2(rows)), max(16, 8192 // head_dim))
    return block_m, split_count(device, b_count * num_kv * -(-rows // block_m), rows)


def decode_releases_early(b_count: int, q_len: int) -> bool:
    """Whether the split attention and its merge let their dependents launch before their own PDL wait: then the
    merge is in flight for the whole attention, and the output projection after it loads its first weights during
    both. Batch-1 decode rows only (Qwen3-8B NVFP4, H100, batch-1 graph replays): the AR graph 3.145 -> 3.049 ms,
    while verify and drafter blocks lost (k = 15 target graph 4.165 -> 4.212, drafter 0.718 -> 0.766;
    bench/results/early_release_8b_nvfp4_h100_1e3f9ff.json); int4 alike. Gained most where o_proj loads its weights
    before its own wait (the streamed 4-bit GEMVs); elsewhere neutral or a little faster, AR graph: dense bf16 Qwen3-8B
    (skinny_linear's o_proj) 5.750 -> 5.703 ms, Qwen3.6-27B / 35B-A3B NVFP4 10.350 -> 10.383 / 2.356 -> 2.347
    (bench/results/ab_engine_{8b_bf16,27b_35b_nvfp4}_early_release_h100_330860a.json)."""
    return b_count == 1 and q_len == 1


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, kv_start: torch.Tensor, q_len: int, scale: float, causal: bool,
                    num_splits: int | None = None, sinks: torch.Tensor | None = None, window: int | None = None,
                    q_start: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                    tile: tuple[int, int] | None = None) -> torch.Tensor:
    """Triton paged attention on CUDA (the reference elsewhere); same contract as paged_attention_ref. q may be
    a strided view (unit stride along head_dim: a slice of the fused projection). `gate` [B * q_len, H, D] (a
    view as q): the output times sigmoid(gate), Qwen3-Next / 3.5's gated attention, in the merge launch.
    num_splits None: `split_count`; tile None: `_decode_tile` (both set by bench/attention_sweep.py to compare)."""
    if not use_triton(q):
        out = paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, kv_start, q_len, scale, causal,
                                  sinks, window, q_start)
        return out if gate is None else out * torch.sigmoid(gate)
    b_count = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv = k_cache.shape[2]
    group = num_heads // num_kv
    block_m, splits = default_launch(q.device, b_count, num_kv, q_len, group, head_dim)
    num_splits = num_splits or splits
    block_n, num_warps = tile or _decode_tile(q_len * group)
    out = torch.empty_like(q)
    early = decode_releases_early(b_count, q_len)
    o, m, ll, total_m = _split_partials(q, k_cache, v_cache, block_tables, seq_lens, kv_start, q_start, q_len, scale,
                                        causal, window, num_splits, block_m, 0, block_n, num_warps, early=early)
    gate_t = q if gate is None else gate
    on = pdl(q)
    _merge_splits_kernel[(b_count, num_kv, q_len * group)](
        o, m, ll, out, q if sinks is None else sinks, gate_t, seq_lens, kv_start,
        seq_lens if q_start is None else q_start, o.stride(0), o.stride(1), o.stride(2), o.stride(3),
        out.stride(0), out.stride(1), gate_t.stride(0), gate_t.stride(1), q_len, num_splits, window or 0,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=total_m, BLOCK_N=block_n, CHUNK=_MERGE_CHUNK,
        WINDOWED=window is not None, HAS_Q_START=q_start is not None, HAS_SINKS=sinks is not None,
        HAS_GATE=gate is not None, PDL=on, EARLY=early, num_warps=_merge_warps(head_dim), launch_pdl=on)
    return out


_MERGE_CHUNK = 16  # splits a merge program reads at once: every split with keys of a 1,024-key context


def _merge_warps(head_dim: int) -> int:
    """One warp for [16, head_dim <= 128] partial values (a chunk: 64 float32 registers a thread or fewer), two
    for head_dim 256."""
    return max(1, _MERGE_CHUNK * head_dim // 2048)


def ragged_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           query_index: torch.Tensor, query_pos: torch.Tensor, kv_slots: torch.Tensor,
                           query_unpad: torch.Tensor, scale: float, sinks: torch.Tensor | None = None,
                           window: int | None = None) -> torch.Tensor:
    """Triton ragged prefill attention on CUDA (the reference elsewhere); same contract as
    ragged_paged_attention_ref."""
    if not use_triton(q):
        return ragged_paged_attention_ref(q, k_cache, v_cache, query_index, query_pos, kv_slots, query_unpad,
                                          scale, sinks, window)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv = k_cache.shape[2]
    group = num_heads // num_kv
    b_count, qmax = query_index.shape
    block_q = max(1, 64 // group)
    block_m = max(16, _next_pow2(block_q * group))
    flat_k = k_cache.view(-1, num_kv, head_dim)
    flat_v = v_cache.view(-1, num_kv, head_dim)
    out = torch.empty(b_count * qmax, num_heads, head_dim, device=q.device, dtype=q.dtype)
    query_index, query_pos, kv_slots = (t.contiguous() for t in (query_index, query_pos, kv_slots))
    block_n, num_warps = _ragged_tile(head_dim)  # at 4 warps head_dim 256 spilled 1.8 KB a thread
    _ragged_attention_kernel[(b_count, num_kv, triton.cdiv(qmax, block_q))](
        q, flat_k, flat_v, out, q if sinks is None else sinks, query_index, query_pos, kv_slots,
        q.stride(0), q.stride(1), flat_k.stride(0), flat_k.stride(1), flat_v.stride(0), flat_v.stride(1),
        out.stride(0), out.stride(1), query_index.stride(0), query_pos.stride(0), kv_slots.stride(0),
        qmax, kv_slots.shape[1], scale, window or 0,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        WINDOWED=window is not None, HAS_SINKS=sinks is not None, num_warps=num_warps, num_stages=2,
    )
    return out[query_unpad]


# ---- deterministic mode (--deterministic) ---------------------------------------------------------------------

DETERMINISTIC_SPLIT = 512  # keys per split, at absolute positions [s * 512, (s + 1) * 512)


def _det_block_m(head_dim: int) -> int:
    """Query rows per program in deterministic mode: from the head size only (never from the row count: a
    different tile could take a different tensor-core instruction), at most 64 float32 accumulator registers
    a thread."""
    return max(16, min(64, 8192 // head_dim))


def fixed_split_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor, q_len: int,
                              scale: float, sinks: torch.Tensor | None = None,
                              window: int | None = None) -> torch.Tensor:
    """The deterministic-mode definition (and CPU path): causal attention of every sequence's last q_len
    queries over its paged keys, one query at a time over exactly the keys its position sees (those less than
    `window` positions back on sliding-window layers), the head's sink logit in its softmax, in float32, so a
    query's arithmetic does not depend on the others in the call. q [B * q_len, H, D] -> [B * q_len, H, D]."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv, page = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv
    head_sinks = None if sinks is None else sinks.float().view(num_kv, group, 1)
    out = torch.empty_like(q)
    for b in range(seq_lens.shape[0]):
        n = int(seq_lens[b])
        for i in range(q_len):
            pos = n - q_len + i
            keys = torch.arange(0 if window is None else max(0, pos + 1 - window), pos + 1, device=q.device)
            slots = block_tables[b, keys // page].long() * page + keys % page
            k = k_cache.view(-1, num_kv, head_dim)[slots].float().permute(1, 2, 0)  # [Hkv, D, keys]
            v = v_cache.view(-1, num_kv, head_dim)[slots].float().transpose(0, 1)  # [Hkv, keys, D]
            qr = q[b * q_len + i].float().view(num_kv, group, head_dim)
            weights = softmax_with_sinks(torch.matmul(qr, k) * scale, head_sinks)
            out[b * q_len + i] = torch.matmul(weights, v).view(num_heads, head_dim).to(q.dtype)
    return out


def fixed_split_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                          seq_lens: torch.Tensor, q_len: int, scale: float,
                          split_tokens: int = DETERMINISTIC_SPLIT, sinks: torch.Tensor | None = None,
                          window: int | None = None) -> torch.Tensor:
    """Causal paged attention whose rows are batch-invariant (--deterministic), for decode, verify and prefill.

    Same layout as paged_attention (every sequence's q_len queries at the end of its context, positions from
    0), the target's case only: no kv_start. The keys are cut at fixed absolute positions
    (DETERMINISTIC_SPLIT) whatever the context length, each split walks its 64-key tiles in order, a fixed
    row tile (from head_dim alone), and the splits merge one after another in order: a query's result is
    the same alone, in a k+1 verify block, beside other sequences, or inside a prefill chunk. The split count
    covers every position the block table can address (fixed per CUDA graph); the programs and the merge stop
    at the sequence's own length. `split_tokens` (a multiple of 64) is fixed for a model's whole run: the tests
    shrink it to cross several splits with short contexts.
    GPT-OSS: `window` (sliding-window layers) masks keys `window` or more positions back; tiles wholly before
    every row's window are skipped, which leaves a row's running softmax exactly as it was, and splits before
    its window merge as no-ops, so the cut points and the order stay the absolute ones. `sinks` [H]: each
    head's sink logit joins the normaliser after the ordered merge, once per row."""
    if not use_triton(q):
        return fixed_split_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, q_len, scale, sinks, window)
    b_count = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv, page = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv
    num_splits = -(-(block_tables.shape[1] * page) // split_tokens)
    o, m, ll, total_m = _split_partials(q, k_cache, v_cache, block_tables, seq_lens, torch.zeros_like(seq_lens), None,
                                        q_len, scale, True, window, num_splits, _det_block_m(head_dim),
                                        split_tokens // _KEY_TILE)
    out = torch.empty_like(q)
    _merge_fixed_splits_kernel[(b_count, num_kv, q_len * group)](
        o, m, ll, out, seq_lens, q if sinks is None else sinks, o.stride(0), o.stride(1), o.stride(2), o.stride(3),
        out.stride(0), out.stride(1), q_len, num_splits, SPLIT=split_tokens, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_M=total_m, HAS_SINKS=sinks is not None, num_warps=1)
    return out
