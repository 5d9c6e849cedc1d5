"""Mixture-of-experts for decode and verify blocks (1 to ~256 tokens) in a handful of graph-safe launches.

    logits = x @ W_router.T                   the caller's GEMM
    route:   softmax -> top-k (-> renormalise), sigmoid(x . w_shared_gate)   } one single-program kernel up to
    align:   group the (token, slot) pairs by expert: stable counting sort   } ROUTE_ALIGN_MAX_PAIRS pairs, else two;
             (a small multi-token step, SCAN_MAX_PAIRS pairs: no align launch, the GEMMs scan the ids: PairScan)
    gate_up: act = silu(x @ Wg[e].T) * (x @ Wu[e].T) per pair                one grouped kernel
    down:    y = act @ Wd[e].T per pair, written at the pair's own row       one grouped kernel
    combine: out[t] = sum_j w[t, j] * y[t, j], j in slot order, float32      one kernel

Why this shape. At these sizes the MoE block is bound by reading expert weights, so every selected expert's
weights must stream from HBM once per step however many tokens picked it: the two grouped kernels give one
program an (expert, N tile) pair and loop over all of that expert's tokens inside the program (16 rows per
tl.dot; a later 16-row tile re-reads the weight tile from L2, not HBM). No shape depends on the routing:
every buffer is sized for the worst case of T tokens, the grid has one entry per possible work item, and a
program whose item does not exist this step returns at once. So routing runs inside a CUDA graph with no
host sync (no .item(), bincount, nonzero or unique).

Work items: the align kernel lists the experts that received pairs, ascending by id, each split into chunks
of at most CHUNK pairs so that one very popular expert (the shared one, with all T tokens) does not leave a
single program running long after the others. At most min(E', P) + P // CHUNK items for P pairs.

Shared expert (Qwen3-Next, Qwen3.5/3.6-MoE): when its intermediate size equals the routed one, it is folded
in as expert id E that every token picks in slot k, with weight sigmoid(shared_expert_gate(x)); the kernels
read its own gate/up/down tensors for that id (no copy; checkpoint names unchanged).

Quantized experts (models/layers/quant_linear.QuantExpertWeights: int4, int8, fp8 per channel or 128x128
blocks, NVFP4 with a global scale per expert, MXFP4; int4 with 16-bit scales reads the holder's stacked
`scale_zero`, built with the layer, never per call): the grouped GEMMs read the stacked packed tensors and
dequantize each (expert, N tile, K tile) in registers with the dense quantized GEMMs' tiles
(kernels/quant_tiles.py), per-row scales and the global scale applied to the accumulator; bytes read are the
packed weights and their scales. NVFP4 experts take quant_gemv's kernels over the same layout instead: one
token its GEMV over each routed expert, 2-64 tokens its rows kernel (a 35B-A3B MoE block of 16 tokens over ~40
experts, H100: 130.7 us on the dot path, 79.4 on it); both fold a quantized shared expert of their layout in
as expert E. Elsewhere a quantized shared expert keeps its QuantLinear path.
Biases ([E, N], GPT-OSS) and GPT-OSS's clamped SwiGLU ride in the same epilogues, for any weights.

Determinism: every pair's output row is computed on its own (row-independent tiles, no split-K) and written
to its own row; `combine` sums a token's k (+1) rows in slot order in float32 with no atomics. So a token's
result does not depend on which other tokens share the step, under a fixed launch config. One-token steps
use the row-reduction path (as skinny_linear does for one row): it rounds differently from the tl.dot path
of a multi-token step, so a token decoded alone and the same token inside a verify block agree to the
dtype's precision, not bit for bit.
"""

from __future__ import annotations

import dataclasses

import torch

from blockspec.kernels import quant_gemv
from blockspec.kernels._triton import HAVE_TRITON, pdl, use_triton
from blockspec.kernels.quant_tiles import FP4_GLOBAL_BIAS

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from blockspec.kernels._triton import release_dependents, wait_for_inputs
    from blockspec.kernels.quant_tiles import _dequant_tile  # the quantized layouts' tiles, shared
    from blockspec.kernels.skinny_linear import _accumulate  # the skinny GEMM's K-tile step, shared

    @triton.jit
    def _route_probs(L, offs_t, t_mask, E: tl.constexpr, EP: tl.constexpr):
        """Softmax in float32 over the logits as stored, as route() computes it ([BLOCK_T, EP]; padded rows
        uniform over zero logits, finite, never stored; padded experts 0)."""
        offs_e = tl.arange(0, EP)
        lmask = t_mask[:, None] & (offs_e[None, :] < E)
        logits = tl.load(L + offs_t[:, None].to(tl.int64) * E + offs_e[None, :], mask=lmask,
                         other=float("-inf")).to(tl.float32)
        logits = tl.where(t_mask[:, None], logits, 0.0)
        mx = tl.max(logits, axis=1)
        p = tl.exp(logits - mx[:, None])
        return p / tl.sum(p, axis=1)[:, None]

    @triton.jit
    def _shared_gate(X, WS, SW_OUT, offs_t, t_mask, H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
        """sigmoid(x . w_gate) per token, rounded where F.linear and torch.sigmoid round."""
        acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
        offs_h = tl.arange(0, BLOCK_H)
        for h0 in range(0, H, BLOCK_H):
            hs = h0 + offs_h
            xv = tl.load(X + offs_t[:, None].to(tl.int64) * H + hs[None, :],
                         mask=t_mask[:, None] & (hs[None, :] < H), other=0.0)
            wv = tl.load(WS + hs, mask=hs < H, other=0.0)
            acc += xv.to(tl.float32) * wv.to(tl.float32)[None, :]
        g = tl.sum(acc, axis=1).to(SW_OUT.dtype.element_ty).to(tl.float32)
        tl.store(SW_OUT + offs_t, (1.0 / (1.0 + tl.exp(-g))).to(SW_OUT.dtype.element_ty), mask=t_mask)

    @triton.jit
    def _route_block(L, X, WS, W_OUT, IDS_OUT, SW_OUT, t0, T,
                     E: tl.constexpr, EP: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
                     H: tl.constexpr, RENORM: tl.constexpr, DO_TOPK: tl.constexpr, SHARED: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
        """Route tokens t0 .. t0 + BLOCK_T: softmax in float32 over the logits as stored (as route() does),
        TOP_K rounds of argmax (ties to the lowest id), weights rounded to the logits' dtype as route()
        returns them; with SHARED also sigmoid(x . w_gate), rounded where F.linear and torch.sigmoid round.
        Returns the selected ids [BLOCK_T, KP] (zeros without DO_TOPK)."""
        dtype = W_OUT.dtype.element_ty
        offs_t = t0 + tl.arange(0, BLOCK_T)
        t_mask = offs_t < T
        id_sel = tl.zeros([BLOCK_T, KP], dtype=tl.int32)
        if DO_TOPK:
            offs_e = tl.arange(0, EP)
            probs = _route_probs(L, offs_t, t_mask, E, EP)
            offs_k = tl.arange(0, KP)
            w_sel = tl.zeros([BLOCK_T, KP], dtype=tl.float32)
            for j in tl.static_range(TOP_K):
                val, best = tl.max(probs, axis=1, return_indices=True, return_indices_tie_break_left=True)
                w_sel = tl.where(offs_k[None, :] == j, val[:, None], w_sel)
                id_sel = tl.where(offs_k[None, :] == j, best[:, None].to(tl.int32), id_sel)
                probs = tl.where(offs_e[None, :] == best[:, None], -1.0, probs)
            if RENORM:
                w_sel = w_sel / tl.sum(w_sel, axis=1)[:, None]
            out_mask = t_mask[:, None] & (offs_k[None, :] < TOP_K)
            out_off = offs_t[:, None].to(tl.int64) * TOP_K + offs_k[None, :]
            tl.store(W_OUT + out_off, w_sel.to(dtype), mask=out_mask)
            tl.store(IDS_OUT + out_off, id_sel, mask=out_mask)
        if SHARED:
            _shared_gate(X, WS, SW_OUT, offs_t, t_mask, H, BLOCK_T, BLOCK_H)
        return id_sel

    @triton.jit
    def _route_selection(L, X, WS, W_OUT, IDS_OUT, SW_OUT, T, E: tl.constexpr, EP: tl.constexpr,
                         TOP_K: tl.constexpr, H: tl.constexpr, RENORM: tl.constexpr, SHARED: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
        """_route_block for one block of several tokens, returning the selection [BLOCK_T, EP] that
        _align_selection groups: at each selected expert the slot it fills, elsewhere (and on padded rows) -1.
        The rounds mark it in the probabilities' own layout and the outputs are scattered from it, rounded as
        _route_block rounds them (the renormalising sum over the selected column entries)."""
        dtype = W_OUT.dtype.element_ty
        offs_t = tl.arange(0, BLOCK_T)
        t_mask = offs_t < T
        offs_e = tl.arange(0, EP)
        probs = _route_probs(L, offs_t, t_mask, E, EP)
        sel = tl.full([BLOCK_T, EP], -1, dtype=tl.int32)
        work = probs
        for j in tl.static_range(TOP_K):
            _, best = tl.max(work, axis=1, return_indices=True, return_indices_tie_break_left=True)
            hit = offs_e[None, :] == best[:, None]
            sel = tl.where(hit, j, sel)
            work = tl.where(hit, -1.0, work)
        w = probs
        if RENORM:  # padded rows too (their uniform probabilities: no division by zero), never stored
            w = probs / tl.sum(tl.where(sel >= 0, probs, 0.0), axis=1)[:, None]
        sel = tl.where(t_mask[:, None], sel, -1)
        chosen = sel >= 0
        out_off = offs_t[:, None].to(tl.int64) * TOP_K + sel
        tl.store(W_OUT + out_off, w.to(dtype), mask=chosen)
        tl.store(IDS_OUT + out_off, offs_e[None, :] + 0 * sel, mask=chosen)
        if SHARED:
            _shared_gate(X, WS, SW_OUT, offs_t, t_mask, H, BLOCK_T, BLOCK_H)
        return sel

    @triton.jit
    def _route_kernel(L, X, WS, W_OUT, IDS_OUT, SW_OUT, T,
                      E: tl.constexpr, EP: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
                      H: tl.constexpr, RENORM: tl.constexpr, DO_TOPK: tl.constexpr, SHARED: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
        wait_for_inputs(PDL)
        release_dependents(PDL)  # a few programs: their dependents' placement does not matter
        _route_block(L, X, WS, W_OUT, IDS_OUT, SW_OUT, tl.program_id(0) * BLOCK_T, T, E, EP, TOP_K, KP, H,
                     RENORM, DO_TOPK, SHARED, BLOCK_T, BLOCK_H)

    @triton.jit
    def _pair_expert(IDS, p, valid, TOP_K: tl.constexpr, SLOTS: tl.constexpr, E: tl.constexpr,
                     FRESH: tl.constexpr):
        """Expert of pair p = t * SLOTS + j: ids[t, j] for a routed slot, E for the shared slot j == TOP_K.
        FRESH: the ids were written by this program (before a barrier): read them past the L1 cache."""
        t = p // SLOTS
        j = p - t * SLOTS
        routed = valid & (j < TOP_K)
        ptrs = IDS + t.to(tl.int64) * TOP_K + j
        if FRESH:
            e = tl.load(ptrs, mask=routed, other=0, cache_modifier=".cg").to(tl.int32)
        else:
            e = tl.load(ptrs, mask=routed, other=0).to(tl.int32)
        return tl.where(routed, e, tl.where(valid, E, 0))

    @triton.jit
    def _align_body(IDS, SORTED, ITEM_EXPERT, ITEM_START, ITEM_COUNT, NUM_ITEMS, P, T, pid, per_program,
                    TOP_K: tl.constexpr, SLOTS: tl.constexpr, E: tl.constexpr, NB: tl.constexpr,
                    CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, FRESH: tl.constexpr):
        """A stable counting sort of the pairs by expert; this program places pairs [lo, hi), per_program
        pairs from pid's. Each program histograms all pairs itself (P is at most a few thousand: cheaper
        than another launch), so the places follow with no communication between programs: place = start
        of the expert's run + that expert's pairs before lo + its earlier pairs within [lo, hi)."""
        offs = tl.arange(0, BLOCK_P)
        lo = pid * per_program
        hi = tl.minimum(lo + per_program, P)
        counts = tl.zeros([NB], dtype=tl.int32)
        before = tl.zeros([NB], dtype=tl.int32)
        c = 0
        while c < P:  # a while loop: Triton's interpreter cannot range() over a runtime bound
            p = c + offs
            valid = p < P
            h = tl.histogram(_pair_expert(IDS, p, valid, TOP_K, SLOTS, E, FRESH), NB, mask=valid)
            counts += h
            before += h * (c < lo).to(tl.int32)
            c += BLOCK_P
        run_start = tl.cumsum(counts, 0) - counts

        base = run_start + before
        c = lo
        while c < hi:
            p = c + offs
            valid = p < hi
            e = _pair_expert(IDS, p, valid, TOP_K, SLOTS, E, FRESH)
            same_earlier = (e[:, None] == e[None, :]) & (offs[None, :] < offs[:, None]) & valid[None, :]
            rank = tl.sum(same_earlier.to(tl.int32), axis=1)
            tl.store(SORTED + tl.gather(base, e, 0) + rank, p, mask=valid)
            base += tl.histogram(e, NB, mask=valid)
            c += BLOCK_P

        if pid == 0:  # the work items: each expert with pairs, in CHUNK-pair pieces, ascending by id
            bins = tl.arange(0, NB)
            chunks = (counts + CHUNK - 1) // CHUNK
            item0 = tl.cumsum(chunks, 0) - chunks
            tl.store(NUM_ITEMS, tl.sum(chunks, axis=0))
            ci = 0
            while ci * CHUNK < T:  # an expert has at most T pairs (one per token)
                has = chunks > ci
                tl.store(ITEM_EXPERT + item0 + ci, bins, mask=has)
                tl.store(ITEM_START + item0 + ci, run_start + ci * CHUNK, mask=has)
                tl.store(ITEM_COUNT + item0 + ci, tl.minimum(counts - ci * CHUNK, CHUNK), mask=has)
                ci += 1

    @triton.jit
    def _align_kernel(IDS, SORTED, ITEM_EXPERT, ITEM_START, ITEM_COUNT, NUM_ITEMS, P, T, per_program,
                      TOP_K: tl.constexpr, SLOTS: tl.constexpr, E: tl.constexpr, NB: tl.constexpr,
                      CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr = False):
        wait_for_inputs(PDL)
        release_dependents(PDL)
        _align_body(IDS, SORTED, ITEM_EXPERT, ITEM_START, ITEM_COUNT, NUM_ITEMS, P, T, tl.program_id(0),
                    per_program, TOP_K, SLOTS, E, NB, CHUNK, BLOCK_P, False)

    @triton.jit
    def _align_selection(sel, T, SORTED, ITEM_EXPERT, ITEM_START, ITEM_COUNT, NUM_ITEMS, E: tl.constexpr,
                         EP: tl.constexpr, TOP_K: tl.constexpr, SHARED: tl.constexpr, SLOTS: tl.constexpr,
                         BLOCK_T: tl.constexpr):
        """_align_body for a step whose tokens all fit one route block (T <= BLOCK_T <= CHUNK), from the
        routing's selection still in registers ([BLOCK_T, EP], see _route_selection): no write-read round trip
        through memory. Column e holds expert e's pairs, one a token at most: its run starts after the
        earlier experts' pairs (a scan of the column counts), a pair's place in it is the number of earlier
        tokens in the column (a scan down the column); each expert with pairs is one work item (at most
        T <= CHUNK pairs), ascending by id, the shared expert E last: the layout _align_body builds."""
        offs_t = tl.arange(0, BLOCK_T)
        offs_e = tl.arange(0, EP)
        chosen = (sel >= 0).to(tl.int32)
        counts = tl.sum(chosen, axis=0)
        run_start = tl.cumsum(counts, 0) - counts
        place = run_start[None, :] + tl.cumsum(chosen, axis=0) - chosen
        tl.store(SORTED + place, offs_t[:, None] * SLOTS + sel, mask=chosen > 0)
        has = (counts > 0).to(tl.int32)
        item = tl.cumsum(has, 0) - has
        tl.store(ITEM_EXPERT + item, offs_e, mask=has > 0)
        tl.store(ITEM_START + item, run_start, mask=has > 0)
        tl.store(ITEM_COUNT + item, counts, mask=has > 0)
        items = tl.sum(has, axis=0)
        if SHARED:  # every token's slot TOP_K: one run after all routed pairs, in token order
            routed = tl.sum(counts, axis=0)
            tl.store(SORTED + routed + offs_t, offs_t * SLOTS + TOP_K, mask=offs_t < T)
            tl.store(ITEM_EXPERT + items, E)
            tl.store(ITEM_START + items, routed)
            tl.store(ITEM_COUNT + items, T)
            items += 1
        tl.store(NUM_ITEMS, items)

    @triton.jit
    def _route_align_kernel(L, X, WS, W_OUT, IDS_OUT, SW_OUT, SORTED, ITEM_EXPERT, ITEM_START, ITEM_COUNT,
                            NUM_ITEMS, T, P,
                            E: tl.constexpr, EP: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
                            H: tl.constexpr, RENORM: tl.constexpr, SHARED: tl.constexpr, BLOCK_T: tl.constexpr,
                            BLOCK_H: tl.constexpr, SLOTS: tl.constexpr, NB: tl.constexpr, CHUNK: tl.constexpr,
                            BLOCK_P: tl.constexpr, ONE_TOKEN: tl.constexpr, ONE_BLOCK: tl.constexpr = False,
                            PDL: tl.constexpr = False):
        # One program routes every token, then groups the pairs: one launch instead of two for small steps.
        # One token (ONE_TOKEN, a decode step) needs no sort: its slots are distinct experts, so work item j
        # is slot j (pair j), written from the ids in registers. Tokens that fit one route block (ONE_BLOCK,
        # a verify block) are grouped from the routing's selection in registers (_route_selection,
        # _align_selection); more go through memory, after a barrier (_align_body).
        wait_for_inputs(PDL)
        release_dependents(PDL)  # one program: the grouped GEMM's programs find every other SM free
        if ONE_TOKEN:
            ids = _route_block(L, X, WS, W_OUT, IDS_OUT, SW_OUT, 0, 1, E, EP, TOP_K, KP, H, RENORM, True, SHARED,
                               1, BLOCK_H)
            offs_k = tl.arange(0, KP)
            tl.store(ITEM_EXPERT + offs_k, tl.reshape(ids, [KP]), mask=offs_k < TOP_K)
            if SHARED:
                tl.store(ITEM_EXPERT + TOP_K, E)
            offs_s = tl.arange(0, NB)
            s_mask = offs_s < SLOTS
            tl.store(SORTED + offs_s, offs_s, mask=s_mask)
            tl.store(ITEM_START + offs_s, offs_s, mask=s_mask)
            tl.store(ITEM_COUNT + offs_s, tl.full([NB], 1, tl.int32), mask=s_mask)
            tl.store(NUM_ITEMS, SLOTS)
        elif ONE_BLOCK:
            sel = _route_selection(L, X, WS, W_OUT, IDS_OUT, SW_OUT, T, E, EP, TOP_K, H, RENORM, SHARED, BLOCK_T,
                                   BLOCK_H)
            _align_selection(sel, T, SORTED, ITEM_EXPERT, ITEM_START, ITEM_COUNT, NUM_ITEMS, E, EP, TOP_K, SHARED,
                             SLOTS, BLOCK_T)
        else:
            t0 = 0
            while t0 < T:
                _route_block(L, X, WS, W_OUT, IDS_OUT, SW_OUT, t0, T, E, EP, TOP_K, KP, H, RENORM, True, SHARED,
                             BLOCK_T, BLOCK_H)
                t0 += BLOCK_T
            tl.debug_barrier()
            _align_body(IDS_OUT, SORTED, ITEM_EXPERT, ITEM_START, ITEM_COUNT, NUM_ITEMS, P, T, 0, P, TOP_K, SLOTS,
                        E, NB, CHUNK, BLOCK_P, True)

    @triton.jit
    def _expert_tile(W, S, Z, rows, n_mask, k0, z_row, K: tl.constexpr, QUANT: tl.constexpr, SCHEME: tl.constexpr,
                     G: tl.constexpr, NG: tl.constexpr, SCALE_ROW_DIV: tl.constexpr, HAS_ZERO: tl.constexpr,
                     PER_ROW: tl.constexpr, FAST: tl.constexpr, BLOCK_K: tl.constexpr, TILE: tl.constexpr):
        """Weights [BLOCK_N, BLOCK_K] of `rows` (int64) at columns k0.., from an expert's base pointers: loaded
        as stored, or (QUANT) dequantized in registers by the shared quantized tiles (SPLIT = 1)."""
        if QUANT:
            w = _dequant_tile(W, S, Z, rows, n_mask, k0, z_row, 1, SCHEME, K, G, NG, SCALE_ROW_DIV, HAS_ZERO,
                              PER_ROW, BLOCK_K, K % BLOCK_K == 0, FAST, TILE)
            return tl.reshape(w, [w.shape[1], BLOCK_K])
        else:
            ks = k0 + tl.arange(0, BLOCK_K)
            return tl.load(W + rows[:, None] * K + ks[None, :], mask=n_mask[:, None] & (ks < K)[None, :], other=0.0)

    @triton.jit
    def _expert_epilogue(acc, S, GS, B, e, rows, b_rows, n_mask, PER_ROW: tl.constexpr, HAS_GS: tl.constexpr,
                         GS_FACTOR: tl.constexpr, HAS_BIAS: tl.constexpr, N_W: tl.constexpr, E: tl.constexpr):
        """acc [BM, BN] (float32) times what the quantized tiles leave to the accumulator (per-row scales of
        `rows`, the expert's NVFP4 global scale and the fast tiles' 2^26), plus the expert's bias at `b_rows`
        of its [N_W] (none for the folded shared expert, id E). Still float32: the caller rounds it where
        F.linear would."""
        if PER_ROW:
            acc = acc * tl.load(S + rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_GS:
            acc = acc * tl.load(GS + e).to(tl.float32)
        if GS_FACTOR != 1.0:
            acc = acc * GS_FACTOR
        if HAS_BIAS:
            live = b_rows * 0 + e < E  # a vector: Triton's interpreter refuses a mask of vector & scalar
            b = tl.load(B + e.to(tl.int64) * N_W + b_rows, mask=n_mask & live, other=0.0)
            acc = acc + b.to(tl.float32)[None, :]
        return acc

    @triton.jit
    def _grouped_gemm_kernel(A, W, WU, SW, SWU, OUT, SORTED, ITEM_EXPERT, ITEM_START, ITEM_COUNT, NUM_ITEMS,
                             QS, QZ, QGS, BIAS, IDS, P,
                             N_OUT: tl.constexpr, K: tl.constexpr, SLOTS: tl.constexpr, E: tl.constexpr,
                             GATED: tl.constexpr, SHARED: tl.constexpr, USE_DOT: tl.constexpr,
                             DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, SCHEME: tl.constexpr, G: tl.constexpr, NG: tl.constexpr,
                             SCALE_ROW_DIV: tl.constexpr, HAS_ZERO: tl.constexpr, PER_ROW: tl.constexpr,
                             HAS_GS: tl.constexpr, GS_FACTOR: tl.constexpr, FAST: tl.constexpr,
                             W_STRIDE: tl.constexpr, S_STRIDE: tl.constexpr, Z_STRIDE: tl.constexpr,
                             HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr, LIMIT: tl.constexpr,
                             ALPHA: tl.constexpr, SCAN: tl.constexpr = False, TOP_K: tl.constexpr = 1,
                             PB: tl.constexpr = 1, PDL: tl.constexpr = False):
        # One program: one work item (an expert and up to CHUNK of its pairs, contiguous in SORTED) times
        # BLOCK_N output columns; it loops over the item's pairs BLOCK_M at a time.
        # SCAN (a small step, no align launch): program p of the P = T * SLOTS pairs takes pair p's expert if p is
        #   that expert's first pair (else returns), and finds the expert's pairs itself in the routing's IDS
        #   [T, TOP_K] (PB: P rounded up to a power of two), ascending as the align kernel sorts them; act and y
        #   are both in pair order (the combine's rows).
        # GATED (gate_up): A = x [T, K] read at each pair's token; W = gate_up [E, 2 * N_OUT, K] (gate rows
        #   n, up rows N_OUT + n); OUT = act [P, N_OUT] in sorted order; act(gate, up) in the epilogue: SiLU(gate)
        #   * up, or (CLAMPED) GPT-OSS's clamped SwiGLU with LIMIT and ALPHA.
        # not GATED (down): A = act, read in sorted order; W = down [E, N_OUT, K]; OUT = y [P, N_OUT] at each
        #   pair's own row (pair = t * SLOTS + j), so the combine reads a token's rows in slot order.
        # SHARED: expert id E is the shared expert, whose weights are SW (gate / down) and SWU (up), [N_OUT, K].
        # SCHEME != "none": W is the stacked packed weight of a quantized layout (kernels/quant_tiles.py), QS /
        #   QZ its scales / zeros and QGS its per-expert NVFP4 global scales [E]; expert e's tensors start
        #   W_STRIDE / S_STRIDE / Z_STRIDE elements after expert e - 1's. No folded shared expert then.
        # HAS_BIAS: BIAS [E, rows of W] (GPT-OSS), added before the activation / the combine.
        QUANT: tl.constexpr = SCHEME != "none"
        N_W: tl.constexpr = 2 * N_OUT if GATED else N_OUT  # rows of one expert's weight
        wait_for_inputs(PDL)
        item = tl.program_id(0)
        if SCAN:
            q = tl.arange(0, PB)
            e_all = tl.where(q < P, _pair_expert(IDS, q, q < P, TOP_K, SLOTS, E, False), -1)
            e = tl.sum(tl.where(q == item, e_all, 0), axis=0)
            member = (e_all == e).to(tl.int32)
            if tl.sum(tl.where(q < item, member, 0), axis=0) > 0:  # not the expert's first pair
                return
            count = tl.sum(member, axis=0)
            rank = tl.where(member > 0, tl.cumsum(member, 0) - 1, -1)  # place among the expert's pairs
            start = 0
        else:
            if item >= tl.load(NUM_ITEMS):
                return
            e = tl.load(ITEM_EXPERT + item)
            start = tl.load(ITEM_START + item)
            count = tl.load(ITEM_COUNT + item)
        dtype = OUT.dtype.element_ty
        TILE: tl.constexpr = A.dtype.element_ty if (USE_DOT or FAST or not QUANT) else tl.float32
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N_OUT
        rows_g = offs_n.to(tl.int64)
        rows_u = rows_g
        s_base = QS
        z_base = QZ
        if QUANT:
            g_base = W + e.to(tl.int64) * W_STRIDE
            u_base = g_base
            s_base = QS + e.to(tl.int64) * S_STRIDE
            z_base = QZ + e.to(tl.int64) * Z_STRIDE
            if GATED:
                rows_u = rows_g + N_OUT
        elif GATED:
            g_base = W + e.to(tl.int64) * (2 * N_OUT * K)
            u_base = g_base + N_OUT * K
            if SHARED:  # noqa: SIM102 (a compile-time guard around the runtime test)
                if e == E:
                    g_base = SW
                    u_base = SWU
        else:
            g_base = W + e.to(tl.int64) * (N_OUT * K)
            u_base = g_base
            if SHARED:  # noqa: SIM102
                if e == E:
                    g_base = SW
                    u_base = SW
        zr_g = tl.zeros([BLOCK_N], dtype=tl.int32)
        zr_u = zr_g
        if QUANT and PER_ROW and HAS_ZERO and SCHEME == "int8":  # per-row int8 zero points, subtracted in the tile
            zr_g = tl.load(z_base + rows_g, mask=n_mask, other=0).to(tl.int32)
            zr_u = tl.load(z_base + rows_u, mask=n_mask, other=0).to(tl.int32)

        offs_k = tl.arange(0, BLOCK_K)
        m0 = 0
        while m0 < count:
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_mask = offs_m < count
            pos = start + offs_m  # place in sorted order
            if SCAN:  # the expert's pairs ranked offs_m, and act in pair order
                pair = tl.sum(tl.where(rank[None, :] == offs_m[:, None], q[None, :], 0), axis=1)
                pos = pair
            else:
                pair = tl.load(SORTED + pos, mask=m_mask, other=0)
            if GATED:
                a_rows = A + (pair // SLOTS)[:, None].to(tl.int64) * K
            else:
                a_rows = A + pos[:, None].to(tl.int64) * K
            if USE_DOT:
                acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            else:  # one row: products accumulated elementwise, summed across K once after the loop
                acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
                acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + offs_k
                av = tl.load(a_rows + ks[None, :], mask=m_mask[:, None] & (ks < K)[None, :], other=0.0)
                wg = _expert_tile(g_base, s_base, z_base, rows_g, n_mask, k0, zr_g, K, QUANT, SCHEME, G, NG,
                                  SCALE_ROW_DIV, HAS_ZERO, PER_ROW, FAST, BLOCK_K, TILE)
                acc_g = _accumulate(acc_g, av, wg, USE_DOT, DOT_PRECISION)
                if GATED:
                    wu = _expert_tile(u_base, s_base, z_base, rows_u, n_mask, k0, zr_u, K, QUANT, SCHEME, G, NG,
                                      SCALE_ROW_DIV, HAS_ZERO, PER_ROW, FAST, BLOCK_K, TILE)
                    acc_u = _accumulate(acc_u, av, wu, USE_DOT, DOT_PRECISION)
            if USE_DOT:
                yg = acc_g
                yu = acc_u
            else:
                yg = tl.sum(acc_g, axis=1)[None, :]
                yu = tl.sum(acc_u, axis=1)[None, :]
            yg = _expert_epilogue(yg, s_base, QGS, BIAS, e, rows_g, rows_g, n_mask, PER_ROW, HAS_GS, GS_FACTOR,
                                  HAS_BIAS, N_W, E)
            y = yg.to(dtype)  # the F.linear output
            if GATED:
                yu = _expert_epilogue(yu, s_base, QGS, BIAS, e, rows_u, rows_g + N_OUT, n_mask, PER_ROW, HAS_GS,
                                      GS_FACTOR, HAS_BIAS, N_W, E)
                g = y.to(tl.float32)
                u = yu.to(dtype).to(tl.float32)
                if CLAMPED:  # as GatedActivation computes it, rounded once
                    g = tl.minimum(g, LIMIT)
                    u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
                    y = (g / (1.0 + tl.exp(-g * ALPHA)) * (u + 1.0)).to(dtype)
                else:  # as silu_mul_ref rounds: F.silu, then the multiply
                    sg = (g / (1.0 + tl.exp(-g))).to(dtype)
                    y = (sg.to(tl.float32) * u).to(dtype)
                out_rows = pos
            else:
                out_rows = pair
            out_mask = m_mask[:, None] & n_mask[None, :]
            release_dependents(PDL)  # the first tile's store; later calls have no effect
            tl.store(OUT + out_rows[:, None].to(tl.int64) * N_OUT + offs_n[None, :], y, mask=out_mask)
            m0 += BLOCK_M

    @triton.jit
    def _combine_kernel(Y, WTS, SWTS, SOUT, RES, OUT, H: tl.constexpr, TOP_K: tl.constexpr, SLOTS: tl.constexpr,
                        SHARED: tl.constexpr, HAS_SOUT: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_H: tl.constexpr,
                        PDL: tl.constexpr = False):
        # out[t] = sum over the token's slots, in slot order, of weight * pair row: float32, no atomics; the
        # shared expert last, from its slot (SHARED) or its own output rows SOUT [T, H] (HAS_SOUT).
        # HAS_RES: out[t] = res[t] + that sum, rounded as the separate add rounds (the sum first).
        wait_for_inputs(PDL)
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = offs < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            w = tl.load(WTS + t * TOP_K + j).to(tl.float32)
            acc += w * tl.load(Y + (t * SLOTS + j) * H + offs, mask=mask, other=0.0).to(tl.float32)
        if SHARED:
            w = tl.load(SWTS + t).to(tl.float32)
            acc += w * tl.load(Y + (t * SLOTS + TOP_K) * H + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOUT:
            w = tl.load(SWTS + t).to(tl.float32)
            acc += w * tl.load(SOUT + t * H + offs, mask=mask, other=0.0).to(tl.float32)
        out = acc.to(OUT.dtype.element_ty)
        if HAS_RES:
            r = tl.load(RES + t * H + offs, mask=mask, other=0.0)
            out = (out.to(tl.float32) + r.to(tl.float32)).to(OUT.dtype.element_ty)
        release_dependents(PDL)
        tl.store(OUT + t * H + offs, out, mask=mask)


FIXED_ROUTE_TOKENS = 16  # moe_route's tile under --deterministic
CHUNK = 64  # pairs per work item: 4 tiles of 16 rows; only the shared expert reaches it below T = 64
BLOCK_P = 128  # pairs per align program
ROUTE_ALIGN_MAX_PAIRS = 512  # up to here one program routes and groups a whole step (one launch, not two)
# Warps of that program (bench/moe_route_time.py, H100, moe_route_time_t{1,16}_h100_2f16e03.json): a block of more
# than one token 8 (Coder-30B's 16: 6.2 / 5.8 / 7.0 us at 4 / 8 / 16); one token 1, its top-k in one warp with no
# barrier (Coder-30B 2.1 / 2.7 / 2.8 us at 1 / 2 / 4, Qwen3.6-35B-A3B 3.1 / 3.9 / 3.4)
ROUTE_ALIGN_WARPS = 8
ROUTE_ONE_TOKEN_WARPS = 1
# Past this many experts a block of several tokens routes one token a program, then groups: one program's top-k
# over 256 experts (+ the shared gate) for 16 tokens took 38 us a layer in the 35B-A3B verify graph on an H200,
# the two launches 16 (bench/results/hybrid_gpu_moe_profile_h200_5a32f84.json; moe_route_time: 13.9 vs 9.9);
# at 128 experts the single program still wins (6.5 vs 7.5 us)
ROUTE_ALIGN_MAX_EXPERTS = 128
_NUM_SMS = 132  # H100 / H200
_MIN_PROGRAMS = 2 * _NUM_SMS


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Launch parameters of one grouped GEMM (gate_up or down)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    @property
    def use_dot(self) -> bool:
        return self.block_m > 1


def fixed_gemm_config(k: int, quantized: bool = False) -> GemmConfig:
    """--deterministic's expert GEMM over reduction length k: 16-row tensor-core tiles, one K order and one tile
    from the weight's shape (and format) alone, whatever the step's token count (one token too: not the one-row
    path). Quantized stacks dequantize each tile in registers, at least 32 columns wide (an MXFP4 scale group),
    as gemm_config's quantized tiles."""
    return GemmConfig(16, 32, min(128, max(32 if quantized else 16, _next_pow2(k))), 4, 3)


def _next_pow2(v: int) -> int:
    return 1 << max(v - 1, 0).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_items(tokens: int, slots: int, experts: int) -> int:
    """Upper bound on work items: every expert with a pair once, plus one more per CHUNK pairs."""
    pairs = tokens * slots
    return min(experts, pairs) + pairs // CHUNK


# One-token configs measured per expert shape (n output columns, k, gated) where they beat the heuristic by more
# than noise: bench/moe_kernels.py --sweep --tokens 1 on an H100, each call of the timed graph routed anew (an
# earlier sweep reused one routing, so the experts stayed in L2 and it timed L2), bench/results/
# moe_kernels_t1_cold_sweep_h100_9b31817.json. Qwen3-Coder-30B-A3B gate_up 21.0 vs 23.0 us, down 11.7 vs 12.2;
# engine AR 277.5 -> 287.7 tok/s on the same machine (hybrid_gpu_moe_base_h100_9b31817.json ->
# hybrid_gpu_moe_one_token_tuned_h100_9b31817.json). Qwen3.6-35B-A3B's shapes were best at the heuristic's config.
_TUNED_ONE_TOKEN = {
    (768, 2048, True): GemmConfig(1, 2, 512, 4, 3),
    (2048, 768, False): GemmConfig(1, 16, 256, 4, 3),
}


def gemm_config(tokens: int, n: int, k: int, items: int, gated: bool, quantized: bool = False,
                itemsize: int = 2) -> GemmConfig:
    """Launch config for `tokens` tokens, n output columns, reduction length k, up to `items` work items.

    A hand heuristic (no autotune: CUDA graphs are captured right after warm-up), after skinny_linear's:
    the kernels stream expert weights, so they want >= 2 programs per SM with enough bytes in flight each.
    - One token (every expert has one row): the row-reduction path, BLOCK_N 8 (4 while that leaves too
      few programs), BLOCK_K 256, 4 warps: the best or within 4% of it for both Qwen3.6-35B-A3B and
      Qwen3-Coder-30B-A3B GEMMs in `bench/moe_kernels.py --sweep` on an H100 (bench/results/
      moe_kernels_sweep_h100.json, a sweep whose experts stayed in L2; the old 16 x 512 x 8 warps took
      1.2-1.7x longer on gate_up). Re-timed streaming from HBM, Coder-30B's shapes do better elsewhere:
      _TUNED_ONE_TOKEN.
    - More tokens: tl.dot over 16-row tiles (the smallest tl.dot tile; decode experts rarely see more),
      BLOCK_K 128 whatever the token count (so a row rounds the same in any batch), BLOCK_N 64/32/16; a bf16
      gate_up 32 x 256, also whatever the token count (bench/moe_kernels.py --sweep --tokens 16 --pool 18 / 40,
      each call routed anew: bench/results/moe_kernels_pool{18,40}_cold_sweep_h100_491e80a.json).
    - Quantized experts: the tl.dot path at every token count (one token padded to 16 rows), as the dense
      quantized GEMMs do for 4-bit weights at one row: the dequantized tile goes straight into the MMA (the
      row-reduction path would widen it to float32 first), and BLOCK_K >= 32 (an MXFP4 scale group). Not
      tuned on a GPU yet (bench/moe_kernels.py --quant).
    `items` is the worst case; a step that touches fewer experts has fewer live programs. Shapes in
    _TUNED_ONE_TOKEN take their measured one-token config instead.
    """
    if tokens == 1 and not quantized:
        tuned = _TUNED_ONE_TOKEN.get((n, k, gated))
        if tuned is not None:
            return tuned
        block_n = 8 if items * _cdiv(n, 8) >= _MIN_PROGRAMS else 4
        return GemmConfig(1, block_n, min(256, max(64, _next_pow2(k))), 4, 3)
    # 32 x 256 tiles for 2-byte experts: Coder-30B 44.4 vs 47.6 us, 35B-A3B 61.3 vs 62.8 (T = 16, cold), 80 KB of
    # shared memory (Triton keeps num_stages - 1 tiles in flight: within the 99 KB of RTX cards); float32 experts,
    # never timed on it, keep the tiles they had
    if gated and not quantized and itemsize <= 2:
        block_n = 32 if items * _cdiv(n, 32) >= _MIN_PROGRAMS else 16
        return GemmConfig(16, block_n, min(256, max(16, _next_pow2(k))), 4, 3)
    block_k = min(128, max(32 if quantized else 16, _next_pow2(k)))
    block_n = next((b for b in (64, 32) if items * _cdiv(n, b) >= _MIN_PROGRAMS), 16)
    return GemmConfig(16, block_n, block_k, 4, 3)


@dataclasses.dataclass(frozen=True)
class SharedWeights:
    """A shared expert folded into the grouped launches: its own [I, H] gate and up, [H, I] down."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


@dataclasses.dataclass(frozen=True)
class QuantOperand:
    """A stacked quantized expert projection ([E, N, K] logically) as the grouped kernels read it: the packed
    tensors (float8 ones as uint8 views, a missing zeros tensor replaced by the scales: never read), each
    expert's element strides, and the format's constants (kernels/quant_linear.QuantMeta)."""

    experts: int
    n: int
    k: int
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    global_scale: torch.Tensor | None
    meta: object  # kernels.quant_linear.QuantMeta
    fast: bool  # the PTX unpackers (a GPU, int4 with 16-bit / NVFP4 with bf16 activations)

    @property
    def strides(self) -> tuple[int, int, int]:
        return self.qweight[0].numel(), self.scales[0].numel(), self.zeros[0].numel()


Weights = torch.Tensor | QuantOperand


def quant_operand(holder, dtype: torch.dtype) -> QuantOperand | None:
    """A QuantExpertWeights-like holder (scheme, qweight / scales / zeros [E, ...], global_scale [E] or None,
    group_size, out_features, in_features, perm) as the kernels read it with `dtype` activations; None where
    they do not (an act-order permutation, a layout they do not index)."""
    # imported here: kernels.quant_linear imports the layouts' definitions, whose module imports this one
    from blockspec.kernels.quant_linear import QuantWeights, fast_unpack, kernel_operands, quant_meta, scale_zero_of

    qw, s, z, gs = holder.qweight, holder.scales, holder.zeros, holder.global_scale
    packed = scale_zero_of(holder)  # int4 with 16-bit scales: [E, N, K/G] int32, s and z are views of it
    if getattr(holder, "perm", None) is not None or qw.dim() != 3 or s.dim() != 3:
        return None
    e = qw.shape[0]
    contiguous = packed.is_contiguous() if packed is not None else s.is_contiguous() and (z is None or
                                                                                          z.is_contiguous())
    if not (qw.is_contiguous() and contiguous) or s.shape[0] != e:
        return None
    if gs is not None and (tuple(gs.shape) != (e,) or not gs.is_contiguous()):
        return None
    first = QuantWeights(holder.scheme, qw[0], s[0], None if z is None else z[0], None if gs is None else gs[0],
                         holder.group_size, holder.out_features, holder.in_features,
                         scale_zero=None if packed is None else packed[0])
    meta = quant_meta(first)
    if meta is None:
        return None
    qwk, sk, zk = kernel_operands(holder, meta)
    return QuantOperand(e, meta.n, meta.k, qwk, sk, zk, gs if meta.has_gs else None, meta, fast_unpack(meta, dtype))


def _dims(w: Weights) -> tuple[int, int, int]:
    """(experts, rows, columns) of a stacked projection."""
    return (w.experts, w.n, w.k) if isinstance(w, QuantOperand) else tuple(w.shape)


def fused_supported(x: torch.Tensor, gate_up, down) -> bool:
    """Whether the Triton MoE kernels apply: 2-D activations with either stacked weights of x's dtype
    ([E, 2I, H] / [E, H, I], contiguous) or quantized expert holders the kernels read (`quant_operand`)."""
    if not (use_triton(x) and x.dim() == 2 and x.shape[0] >= 1
            and x.dtype in (torch.float32, torch.float16, torch.bfloat16)):
        return False
    if isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor):
        return (x.dtype == gate_up.dtype == down.dtype and gate_up.is_contiguous() and down.is_contiguous()
                and gate_up.device == x.device)
    if isinstance(gate_up, torch.Tensor) or isinstance(down, torch.Tensor):
        return False
    gu, dn = quant_operand(gate_up, x.dtype), quant_operand(down, x.dtype)
    return (gu is not None and dn is not None and gu.qweight.device == x.device and gu.experts == dn.experts
            and gu.k == dn.n == x.shape[1] and gu.n == 2 * dn.k)


def shared_foldable(shared: SharedWeights | quant_gemv.Nvfp4Shared, gate_up, down, x: torch.Tensor | None = None,
                    biases: bool = False, clamped: bool = False) -> bool:
    """The shared expert rides along as expert E when it has the routed experts' shapes and dtype (unquantized
    experts), or, quantized (`quant_gemv.Nvfp4Shared`), where the NVFP4 one-token or rows kernel takes x's step
    (1 to quant_gemv.MOE_ROWS_MAX_TOKENS tokens; a prefill keeps it beside the routed experts)."""
    if isinstance(shared, quant_gemv.Nvfp4Shared):
        if x is None or isinstance(gate_up, torch.Tensor) or not (x.shape[0] == 1 or quant_gemv.moe_rows_step(x)):
            return False  # (before the operands: a prefill asks every layer)
        gu, dn = quant_operand(gate_up, x.dtype), quant_operand(down, x.dtype)
        return gu is not None and dn is not None and quant_gemv.moe_step_applies(x, gu, dn, shared, biases, clamped)
    if not all(isinstance(t, torch.Tensor) for t in (gate_up, down, shared.gate, shared.up, shared.down)):
        return False
    i, h = gate_up.shape[1] // 2, gate_up.shape[2]
    return (shared.gate.shape == shared.up.shape == (i, h) and shared.down.shape == (h, i)
            and all(t.dtype == gate_up.dtype and t.is_contiguous() for t in (shared.gate, shared.up, shared.down)))


def _route_consts(logits: torch.Tensor, top_k: int, renormalize: bool, x: torch.Tensor | None,
                  shared: bool, block_t: int | None = None) -> dict:
    t, e = logits.shape
    h = x.shape[1] if x is not None else 1
    return dict(E=e, EP=_next_pow2(e), TOP_K=top_k, KP=_next_pow2(top_k), H=h, RENORM=renormalize,
                SHARED=shared, BLOCK_T=block_t or min(16, _next_pow2(t)), BLOCK_H=min(256, _next_pow2(h)))


def _route_outputs(logits: torch.Tensor, top_k: int, x: torch.Tensor | None, shared: bool, topk: bool
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    t, dev = logits.shape[0], logits.device
    weights = torch.empty(t, top_k, dtype=logits.dtype, device=dev) if topk else None
    ids = torch.empty(t, top_k, dtype=torch.int32, device=dev) if topk else None
    shared_w = torch.empty(t, dtype=x.dtype, device=dev) if shared and x is not None else None
    return weights, ids, shared_w


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool, x: torch.Tensor | None = None,
              shared_gate: torch.Tensor | None = None, topk: bool = True, block_t: int | None = None
              ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """One launch: (weights [T, k] in the logits' dtype, ids [T, k] int32, shared weights [T] or None).

    The same selection as layers.moe.route (ties aside: lowest id first); with `shared_gate` ([1, H] or [H])
    also sigmoid(x @ shared_gate.T). topk=False computes only the shared weights (routing overridden).
    block_t: tokens a program (default up to 16 by T). The tile's shape sets how a row's softmax sums are
    reduced, so --deterministic fixes it (FIXED_ROUTE_TOKENS) for every T.
    """
    shared = shared_gate is not None
    if shared and x is None:
        raise ValueError("the shared expert's gate needs x")
    weights, ids, shared_w = _route_outputs(logits, top_k, x, shared, topk)
    if not topk and not shared:
        return weights, ids, shared_w
    consts = _route_consts(logits, top_k, renormalize, x, shared, block_t)
    dummy = logits
    on = pdl(logits)
    _route_kernel[(_cdiv(logits.shape[0], consts["BLOCK_T"]),)](
        logits, x if x is not None else dummy, shared_gate if shared else dummy,
        weights if weights is not None else dummy, ids if ids is not None else dummy,
        shared_w if shared_w is not None else dummy, logits.shape[0], DO_TOPK=topk, PDL=on, num_warps=4,
        launch_pdl=on, **consts)
    return weights, ids, shared_w


@dataclasses.dataclass
class Layout:
    """The pairs grouped by expert: `sorted_pairs` [P] (pair = token * slots + slot) and the work items."""

    sorted_pairs: torch.Tensor
    item_expert: torch.Tensor
    item_start: torch.Tensor
    item_count: torch.Tensor
    num_items: torch.Tensor  # [1], on the device
    max_items: int


@dataclasses.dataclass(frozen=True)
class PairScan:
    """A small step's grouping left to the grouped GEMMs themselves (their SCAN mode): the routing's ids [T, k]
    and the pair count T * slots. It saves the align launch, a latency-bound few microseconds a layer (6.8 us of
    a Qwen3.6-35B-A3B verify layer on an H100, hybrid_gpu_moe_profile_nopdl_h100_4de5e48.json), for a scan of
    the step's ids by every program (a few hundred int32s from L2, beside its expert's weight tiles)."""

    ids: torch.Tensor
    pairs: int


SCAN_MAX_PAIRS = 256  # pairs up to which the grouped GEMMs scan the ids themselves (a verify block of 16 tokens
# takes 128-176 pairs: top-8 / top-10 and a shared slot); more go through the align kernel


def scan_applies(tokens: int, top_k: int, shared: bool) -> bool:
    """Whether a step of `tokens` tokens is grouped by the GEMMs' scan instead of an align launch: more than one
    token (one token's slots are distinct experts: the routing launch lists them) and at most SCAN_MAX_PAIRS pairs."""
    return tokens > 1 and tokens * (top_k + int(shared)) <= SCAN_MAX_PAIRS


def _layout(tokens: int, top_k: int, num_experts: int, shared: bool, device: torch.device
            ) -> tuple[Layout, dict]:
    """Empty layout buffers (one allocation) and the align kernels' constants."""
    slots = top_k + int(shared)
    experts = num_experts + int(shared)
    pairs = tokens * slots
    n_items = max_items(tokens, slots, experts)
    buf = torch.empty(pairs + 3 * n_items + 1, dtype=torch.int32, device=device)
    sorted_pairs, item_expert, item_start, item_count, num_items = buf.split([pairs, n_items, n_items, n_items, 1])
    consts = dict(TOP_K=top_k, SLOTS=slots, E=num_experts, NB=_next_pow2(experts), CHUNK=CHUNK, BLOCK_P=BLOCK_P)
    return Layout(sorted_pairs, item_expert, item_start, item_count, num_items, n_items), consts


def moe_align(ids: torch.Tensor, num_experts: int, shared: bool) -> Layout:
    """Group the T * (k + shared) pairs by expert (stable: ascending pair index within an expert), one launch."""
    t, k = ids.shape
    layout, consts = _layout(t, k, num_experts, shared, ids.device)
    pairs = layout.sorted_pairs.numel()
    ids = ids if ids.is_contiguous() else ids.contiguous()
    on = pdl(ids)
    _align_kernel[(_cdiv(pairs, BLOCK_P),)](
        ids, layout.sorted_pairs, layout.item_expert, layout.item_start, layout.item_count, layout.num_items,
        pairs, t, BLOCK_P, PDL=on, num_warps=4, launch_pdl=on, **consts)
    return layout


def moe_route_align(logits: torch.Tensor, top_k: int, renormalize: bool, x: torch.Tensor | None = None,
                    shared_gate: torch.Tensor | None = None, group: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Layout | None]:
    """`moe_route` then `moe_align`, as one single-program launch when the step is small (one token, or at most
    ROUTE_ALIGN_MAX_PAIRS pairs over at most ROUTE_ALIGN_MAX_EXPERTS experts), else as the two launches.
    group=False (the experts scan the ids themselves: `layout_wanted`): the routing alone, a token a program, and
    no layout."""
    t, e = logits.shape
    shared = shared_gate is not None
    if not group:
        return (*moe_route(logits, top_k, renormalize, x, shared_gate, block_t=1), None)
    small = t * (top_k + int(shared)) <= ROUTE_ALIGN_MAX_PAIRS
    if not small or (t > 1 and e > ROUTE_ALIGN_MAX_EXPERTS):  # a small block: one token a routing program
        weights, ids, shared_w = moe_route(logits, top_k, renormalize, x, shared_gate, block_t=1 if small else None)
        return weights, ids, shared_w, moe_align(ids, e, shared)
    if shared and x is None:
        raise ValueError("the shared expert's gate needs x")
    weights, ids, shared_w = _route_outputs(logits, top_k, x, shared, True)
    layout, align_consts = _layout(t, top_k, e, shared, logits.device)
    route_consts = _route_consts(logits, top_k, renormalize, x, shared)
    dummy = logits
    on = pdl(logits)
    _route_align_kernel[(1,)](
        logits, x if x is not None else dummy, shared_gate if shared else dummy, weights, ids,
        shared_w if shared else dummy, layout.sorted_pairs, layout.item_expert, layout.item_start,
        layout.item_count, layout.num_items, t, layout.sorted_pairs.numel(), **route_consts,
        **{k: v for k, v in align_consts.items() if k not in ("TOP_K", "E")}, ONE_TOKEN=t == 1,
        ONE_BLOCK=t <= min(route_consts["BLOCK_T"], CHUNK), PDL=on,
        num_warps=ROUTE_ONE_TOKEN_WARPS if t == 1 else ROUTE_ALIGN_WARPS, launch_pdl=on)
    return weights, ids, shared_w, layout


def layout_wanted(x: torch.Tensor, top_k: int, gate_up, down, shared: SharedWeights | quant_gemv.Nvfp4Shared | None,
                  biases: bool = False, clamped: bool = False) -> bool:
    """Whether `moe_experts` reads an align layout for x's step, so the routing launch should build one: not
    where the grouped GEMMs scan the ids themselves (`scan_applies`), unless NVFP4 experts take the step on
    quant_gemv's rows kernel, which reads the layout."""
    if not scan_applies(x.shape[0], top_k, shared is not None):
        return True
    if not isinstance(gate_up, torch.Tensor):
        gate_up, down = quant_operand(gate_up, x.dtype), quant_operand(down, x.dtype)
    return quant_gemv.moe_rows_applies(x, gate_up, down, shared, biases, clamped)


def _grouped_gemm(a: torch.Tensor, w: Weights, wu: torch.Tensor | None, sw: torch.Tensor | None,
                  swu: torch.Tensor | None, out: torch.Tensor, layout: Layout | PairScan, slots: int, num_experts: int,
                  gated: bool, cfg: GemmConfig, bias: torch.Tensor | None = None, limit: float | None = None,
                  alpha: float = 1.702) -> None:
    n_out, k = out.shape[1], a.shape[1]
    dot_precision = "ieee" if a.dtype == torch.float32 else "tf32"
    if isinstance(w, QuantOperand):
        m = w.meta
        if sw is not None:
            raise ValueError("quantized experts take the shared expert on its own path, not folded in")
        fmt = dict(SCHEME=m.scheme, G=m.group, NG=m.n_groups, SCALE_ROW_DIV=m.scale_row_div, HAS_ZERO=m.has_zero,
                   PER_ROW=m.per_row, HAS_GS=m.has_gs, FAST=w.fast,
                   GS_FACTOR=FP4_GLOBAL_BIAS if (m.scheme in ("nvfp4", "mxfp4") and w.fast) else 1.0)
        strides = w.strides
        weight, scales, zeros, gs = w.qweight, w.scales, w.zeros, w.global_scale
    else:
        fmt = dict(SCHEME="none", G=1, NG=1, SCALE_ROW_DIV=1, HAS_ZERO=False, PER_ROW=False, HAS_GS=False,
                   FAST=False, GS_FACTOR=1.0)
        strides = (0, 0, 0)
        weight, scales, zeros, gs = w, w, w, None
    on = pdl(a)
    if isinstance(layout, PairScan):
        ids = layout.ids
        items, lists = layout.pairs, (ids,) * 5
        scan = dict(SCAN=True, TOP_K=ids.shape[1], PB=_next_pow2(layout.pairs))
    else:
        ids = layout.sorted_pairs
        items, scan = layout.max_items, {}
        lists = (layout.sorted_pairs, layout.item_expert, layout.item_start, layout.item_count, layout.num_items)
    _grouped_gemm_kernel[(items, _cdiv(n_out, cfg.block_n))](
        a, weight, wu if wu is not None else weight, sw if sw is not None else weight,
        swu if swu is not None else weight, out, *lists,
        scales, zeros, gs if gs is not None else scales, bias if bias is not None else scales, ids, items,
        N_OUT=n_out, K=k, SLOTS=slots, E=num_experts, GATED=gated, SHARED=sw is not None, USE_DOT=cfg.use_dot,
        DOT_PRECISION=dot_precision, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        W_STRIDE=strides[0], S_STRIDE=strides[1], Z_STRIDE=strides[2], HAS_BIAS=bias is not None,
        CLAMPED=limit is not None, LIMIT=float(limit) if limit is not None else 0.0, ALPHA=float(alpha),
        PDL=on, num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=on, **fmt, **scan)


def _check_bias(bias: torch.Tensor | None, e: int, n: int, dtype: torch.dtype, name: str) -> torch.Tensor | None:
    if bias is None:
        return None
    if tuple(bias.shape) != (e, n) or bias.dtype != dtype:
        raise ValueError(f"{name} {tuple(bias.shape)} {bias.dtype} is not [{e}, {n}] of {dtype}")
    return bias if bias.is_contiguous() else bias.contiguous()


def moe_experts(x: torch.Tensor, gate_up, down, weights: torch.Tensor, ids: torch.Tensor,
                shared: SharedWeights | quant_gemv.Nvfp4Shared | None = None,
                shared_weight: torch.Tensor | None = None,
                configs: tuple[GemmConfig, GemmConfig] | None = None, layout: Layout | None = None,
                residual: torch.Tensor | None = None, gate_up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None, limit: float | None = None, alpha: float = 1.702,
                shared_out: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts (+ the folded shared expert), as layers.moe.experts_reference (+ shared_weight * shared(x)),
    plus `residual` ([T, H], x's dtype) when given (the add folded into the combine launch).

    x [T, H]; gate_up [E, 2I, H]; down [E, H, I]: tensors of x's dtype, or both quantized expert holders
    (models.layers.quant_linear.QuantExpertWeights: dequantized in registers, see `quant_operand`); weights /
    ids [T, k]; shared (foldable, see `shared_foldable`: unquantized, or NVFP4 on the rows kernel) with
    shared_weight [T].
    gate_up_bias [E, 2I] / down_bias [E, H] (x's dtype) are added to the projections; `limit` (not None)
    makes the activation GPT-OSS's clamped SwiGLU with `alpha` (layers.moe.GatedActivation), else SiLU(gate)
    * up. Four launches: align, gate_up, down, combine; three when `layout` comes from `moe_route_align`, or when
    the step is small enough for the GEMMs to group its pairs themselves (`scan_applies`, layout None).
    `configs` overrides the (gate_up, down) launch configs. `shared_out` ([T, H], x's dtype): a shared expert's
    output computed outside (one that does not fold: quantized), added with shared_weight in the combine launch.
    """
    t, h = x.shape
    if not isinstance(gate_up, torch.Tensor):
        gate_up, down = quant_operand(gate_up, x.dtype), quant_operand(down, x.dtype)
        if gate_up is None or down is None:
            raise ValueError("these quantized experts are not in a layout the grouped kernels read "
                             "(see fused_supported)")
    quantized = isinstance(gate_up, QuantOperand)
    e, two_i, _ = _dims(gate_up)
    i = two_i // 2
    k = ids.shape[1]
    has_shared = shared is not None
    if shared_out is not None and (has_shared or shared_weight is None):
        raise ValueError("shared_out takes shared_weight, and excludes a folded shared expert")
    slots = k + int(has_shared)
    x = x if x.is_contiguous() else x.contiguous()
    weights = weights if weights.is_contiguous() else weights.contiguous()
    gate_up_bias = _check_bias(gate_up_bias, e, two_i, x.dtype, "gate_up_bias")
    down_bias = _check_bias(down_bias, e, h, x.dtype, "down_bias")
    if configs is None and quant_gemv.moe_applies(x, gate_up, down, shared,
                                                  gate_up_bias is not None or down_bias is not None, limit is not None):
        act = quant_gemv.nvfp4_moe(x, ids, gate_up, gated=True, shared=shared)  # one token: no alignment needed
        y = quant_gemv.nvfp4_moe(act, ids, down, gated=False, shared=shared)
        return _combine(x, y, weights, shared_weight, residual, k, slots, has_shared, shared_out)
    on_rows = configs is None and quant_gemv.moe_rows_applies(x, gate_up, down, shared, gate_up_bias is not None
                                                              or down_bias is not None, limit is not None)
    if layout is None and not on_rows and scan_applies(t, k, has_shared):
        layout = PairScan(ids if ids.is_contiguous() else ids.contiguous(), t * slots)
    elif layout is None:
        layout = moe_align(ids, e, has_shared)
    if on_rows:
        rows = dict(slots=slots, tokens=t, shared=shared)  # a verify block
        act = quant_gemv.nvfp4_moe_rows(x, layout, gate_up, gated=True, **rows)
        y = quant_gemv.nvfp4_moe_rows(act, layout, down, gated=False, **rows)
        return _combine(x, y, weights, shared_weight, residual, k, slots, has_shared, shared_out)
    if isinstance(shared, quant_gemv.Nvfp4Shared):
        raise ValueError("a quantized shared expert folds in only where the NVFP4 rows kernel takes the experts "
                         "(see shared_foldable)")
    if configs is None:  # the worst case's items either way: the align path's tiles, so the same sums
        tiles = dict(quantized=quantized, itemsize=x.element_size())
        items = max_items(t, slots, e + int(has_shared))
        configs = (gemm_config(t, i, h, items, True, **tiles), gemm_config(t, h, i, items, False, **tiles))
    act = torch.empty(t * slots, i, dtype=x.dtype, device=x.device)
    y = torch.empty(t * slots, h, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, gate_up, None, shared.gate if has_shared else None, shared.up if has_shared else None,
                  act, layout, slots, e, True, configs[0], gate_up_bias, limit, alpha)
    _grouped_gemm(act, down, None, shared.down if has_shared else None, None, y, layout, slots, e, False,
                  configs[1], down_bias)
    return _combine(x, y, weights, shared_weight, residual, k, slots, has_shared, shared_out)


def _combine(x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, shared_weight: torch.Tensor | None,
             residual: torch.Tensor | None, k: int, slots: int, has_shared: bool,
             shared_out: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's slots of y [T * slots, H] summed with their routing weights (+ shared_weight times the shared
    expert's slot, or its rows `shared_out`) (+ the residual): one launch."""
    t, h = x.shape
    out = torch.empty_like(x)
    has_res = residual is not None
    for name, extra in (("residual", residual), ("shared_out", shared_out)):
        if extra is not None and (extra.shape != x.shape or extra.dtype != x.dtype or not extra.is_contiguous()):
            raise ValueError(f"{name} {tuple(extra.shape)} {extra.dtype} does not match x {tuple(x.shape)} {x.dtype}")
    block_h = min(512, _next_pow2(h))
    on = pdl(x)
    has_sout = shared_out is not None
    _combine_kernel[(t, _cdiv(h, block_h))](
        y, weights, shared_weight if has_shared or has_sout else weights, shared_out if has_sout else y,
        residual if has_res else y, out, H=h, TOP_K=k, SLOTS=slots, SHARED=has_shared, HAS_SOUT=has_sout,
        HAS_RES=has_res, BLOCK_H=block_h, PDL=on, num_warps=4, launch_pdl=on)
    return out
