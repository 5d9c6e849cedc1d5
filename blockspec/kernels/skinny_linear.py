"""Skinny GEMM for M <= 16 rows (decode, speculative verify) with the small ops around a projection folded in.

    y = epilogue(prologue(x) @ W.T + bias)

Batch-1 decode is launch-bound, so one kernel does what otherwise takes three to five: an optional RMSNorm
prologue (each program recomputes the row statistics: x is tiny), then one of three epilogues: plain output,
SwiGLU over a stacked [gate; up] weight, or a residual add written in place. float32 accumulation; the
epilogues round as the reference (`skinny_linear_ref`) does; a one-row norm folds into the main loop and
rounds once (x * w_norm) where the reference rounds twice, so it agrees to bf16 precision, not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockspec.kernels._triton import HAVE_TRITON, pdl, use_triton
from blockspec.kernels.activation import silu_mul_ref
from blockspec.kernels.arrivals import ARRIVALS, arrival_counters, can_split
from blockspec.kernels.rms_norm import rms_norm, rms_norm_ref

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from blockspec.kernels._triton import release_dependents, wait_for_inputs

    @triton.jit
    def _accumulate(acc, xv, w, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """acc += xv @ w.T for one K tile: a tensor-core dot for a block of rows; for one row the
        products, summed across K once after the loop."""
        if USE_DOT:
            acc = tl.dot(xv, tl.trans(w), acc, input_precision=DOT_PRECISION)
        else:
            acc += w.to(tl.float32) * xv.to(tl.float32)
        return acc

    @triton.jit(do_not_specialize=["N2", "TILES1"])  # PAIR's second width may be 1: no constexpr to reassign
    def _skinny_linear_kernel(X, W, B, NW, Y, M, N_OUT, eps, W2, Y2, N2, TILES1, XN, WS, CNT, K: tl.constexpr,
                              HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, GATED: tl.constexpr,
                              HAS_RES: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              PAIR: tl.constexpr, NORM_OUT: tl.constexpr, SPLIT_K: tl.constexpr = 1,
                              PDL: tl.constexpr = False):
        # One program owns BLOCK_N output columns for all M rows; with GATED it reads the matching gate rows
        # (n) and up rows (N_OUT + n) of W. With HAS_RES, Y is the residual: read, added to, written back.
        # With PAIR the programs from TILES1 on compute a second projection of the same x (W2 -> Y2, N2
        # columns; no bias, gate or residual): two small GEMMs of one input in one launch. With NORM_OUT
        # (and HAS_NORM) program 0 also writes rms_norm(x) itself to XN, rounded as rms_norm_ref rounds it:
        # an MoE block's router GEMM and the norm its experts read, in one launch.
        # K is constexpr: a model has a handful of K values, the trip count and (when BLOCK_K divides K) the
        # K masks become compile-time, and Triton's interpreter cannot range() over a runtime scalar under
        # NumPy >= 2.4.
        # SPLIT_K > 1 (the dot path, no norm, gate or pair; SPLIT_K * BLOCK_K divides K): programs tile * SPLIT_K
        # + s each take K / SPLIT_K of a tile's columns and store their float32 sums to WS; the last of them to
        # arrive (CNT[tile], reset to 0 by it) adds the SPLIT_K sums in split order and runs the epilogue, so the
        # result does not depend on which program came last.
        dtype = Y.dtype.element_ty
        pid = tl.program_id(0)
        split = 0
        if SPLIT_K > 1:
            split = pid % SPLIT_K
            pid = pid // SPLIT_K
        if PAIR:  # noqa: SIM102 (a compile-time branch around a runtime one: not one condition in Triton)
            if pid >= TILES1:
                W = W2
                Y = Y2
                N_OUT = N2
                pid = pid - TILES1
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N_OUT
        x_rows = X + offs_m[:, None].to(tl.int64) * K  # [BLOCK_M, 1]
        g_rows = W + offs_n[:, None].to(tl.int64) * K  # [BLOCK_N, 1]
        u_rows = W + (offs_n[:, None] + N_OUT).to(tl.int64) * K
        wait_for_inputs(PDL)

        if HAS_NORM and USE_DOT:  # first pass over K: per-row sum of squares, as rms_norm_ref computes it
            # (the dot path keeps its operand a plain load: a transformed one stalls Triton's pipelining)
            ss = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + offs_k
                xv = tl.load(x_rows + ks[None, :], mask=m_mask[:, None] & (ks[None, :] < K), other=0.0)
                xf = xv.to(tl.float32)
                ss += tl.sum(xf * xf, axis=1)
            rstd = tl.rsqrt(ss / K + eps)

        if USE_DOT:
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        else:  # M == 1: accumulate products elementwise, reduce across K once after the loop
            acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        ss1 = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)  # one-row norm: x^2 summed across K at the end
        K_PART: tl.constexpr = K // SPLIT_K
        for kk in range(0, K_PART, BLOCK_K):
            ks = split * K_PART + kk + offs_k
            k_mask = ks < K
            x_mask = m_mask[:, None] & k_mask[None, :]
            xv = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0)
            if HAS_NORM and USE_DOT:
                h = (xv.to(tl.float32) * rstd[:, None]).to(dtype)
                nw = tl.load(NW + ks, mask=k_mask, other=0.0)
                xv = (h.to(tl.float32) * nw.to(tl.float32)[None, :]).to(dtype)
                xv = tl.where(x_mask, xv, 0.0).to(dtype)  # padded rows: rsqrt(0 + 0) would be inf
                if NORM_OUT:  # noqa: SIM102 (compile-time around runtime)
                    if pid == 0:
                        tl.store(XN + offs_m[:, None].to(tl.int64) * K + ks[None, :], xv, mask=x_mask)
            elif HAS_NORM:
                # one row: the norm folds into the same pass, norm(x) @ W.T == rstd * ((x * w_norm) @ W.T),
                # the statistics gathered on the way (a separate first pass stalled every program ~13 us)
                xf = xv.to(tl.float32)
                ss1 += xf * xf  # elementwise: a reduction across warps every iteration stalled the stream
                nw = tl.load(NW + ks, mask=k_mask, other=0.0)
                xv = (xf * nw.to(tl.float32)[None, :]).to(dtype)
            w_mask = n_mask[:, None] & k_mask[None, :]
            wg = tl.load(g_rows + ks[None, :], mask=w_mask, other=0.0)
            acc_g = _accumulate(acc_g, xv, wg, USE_DOT, DOT_PRECISION)
            if GATED:
                wu = tl.load(u_rows + ks[None, :], mask=w_mask, other=0.0)
                acc_u = _accumulate(acc_u, xv, wu, USE_DOT, DOT_PRECISION)

        if SPLIT_K > 1:
            cols = tl.arange(0, BLOCK_N)
            part = WS + (pid * SPLIT_K * BLOCK_M + offs_m[:, None]) * BLOCK_N + cols[None, :]
            tl.store(part + split * (BLOCK_M * BLOCK_N), acc_g)
            tl.debug_barrier()  # every thread's sums stored before the arrival is counted (release, gpu scope)
            if tl.atomic_add(CNT + pid, 1, sem="acq_rel") != SPLIT_K - 1:
                return
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # split order, whoever arrived last
                acc_g += tl.load(part + s * (BLOCK_M * BLOCK_N), cache_modifier=".cg")
            tl.atomic_xchg(CNT + pid, 0)  # ready for the next launch
        if USE_DOT:
            yg = acc_g
            yu = acc_u
        else:
            yg = tl.sum(acc_g, axis=1)[None, :]  # [1, BLOCK_N]
            yu = tl.sum(acc_u, axis=1)[None, :]
            if HAS_NORM:
                rstd1 = tl.rsqrt(tl.sum(ss1, axis=1) / K + eps)[:, None]
                yg = yg * rstd1
                yu = yu * rstd1
                if NORM_OUT:  # noqa: SIM102 (compile-time around runtime)
                    if pid == 0:  # a second pass over the one row (K elements: a few us at most)
                        for k0 in range(0, K, BLOCK_K):
                            ks = k0 + offs_k
                            k_mask = ks < K
                            xf = tl.load(x_rows + ks[None, :], mask=k_mask[None, :], other=0.0).to(tl.float32)
                            h = (xf * rstd1).to(dtype)
                            nw = tl.load(NW + ks, mask=k_mask, other=0.0)
                            tl.store(XN + ks[None, :], (h.to(tl.float32) * nw.to(tl.float32)[None, :]).to(dtype),
                                     mask=k_mask[None, :])
        if HAS_BIAS:
            yg += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            if GATED:
                yu += tl.load(B + N_OUT + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y = yg.to(dtype)  # the F.linear output
        if GATED:  # silu_mul_ref: F.silu rounds, then the bf16 multiply rounds again
            g = y.to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(dtype)
            y = (s.to(tl.float32) * yu.to(dtype).to(tl.float32)).to(dtype)
        release_dependents(PDL)
        out_mask = m_mask[:, None] & n_mask[None, :]
        y_ptrs = Y + offs_m[:, None].to(tl.int64) * N_OUT + offs_n[None, :]
        if HAS_RES:
            r = tl.load(y_ptrs, mask=out_mask, other=0.0)
            y = (r.to(tl.float32) + y.to(tl.float32)).to(dtype)
        tl.store(y_ptrs, y, mask=out_mask)


SMALL_WEIGHT = 1 << 22  # elements: below this a verify block's GEMM is launch-bound and one kernel wins
_NUM_SMS = 132  # H100 / H200
_MIN_PROGRAMS = 2 * _NUM_SMS


def _next_pow2(v: int) -> int:
    return 1 << max(v - 1, 0).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Launch configs measured per projection shape on an H100 (bench/tune_skinny.py: --model 4b/35b/coder30b --rows 1
# and --model 27b/coder30b --rows 16; bench/results/tune_skinny_*_h100*.json), where they beat the heuristic below
# by more than noise: (1 for one row | 16 for the 2-16-row dot path, n output columns, k, gated) -> config.
# Weights under ~50 MB were timed L2-resident before 6b17b85; tune_skinny_{coder30b,35b}_m{1,16}_cold_h100_491e80a
# re-timed the MoE models' projections streamed from HBM.
_TUNED = {
    (1, 12288, 2560, False): (4, 512, 4, 3),  # Qwen3.5-4B Gated DeltaNet [qkv | z]: 22.9 vs 23.7 us
    (1, 10240, 2560, False): (4, 512, 4, 3),  # 4B gated attention q|gate|k|v: 19.8 vs 20.4
    (1, 9216, 2560, True): (4, 256, 4, 3),  # 4B gate|up: 34.7 vs 38.7
    (1, 2560, 9216, False): (8, 1024, 8, 3),  # 4B down: 17.9 vs 20.2
    (1, 248320, 2560, False): (4, 512, 4, 3),  # 4B LM head (the tied embedding): 401 vs 407
    (1, 12288, 2048, False): (8, 1024, 4, 3),  # Qwen3.6-35B-A3B [qkv | z]: 18.5 vs 20.3
    (1, 9216, 2048, False): (16, 256, 4, 3),  # 35B-A3B attention: 7.2 vs 11.1
    # Qwen3-Coder-30B-A3B q|k|v, weights rotated past L2 (tune_skinny's default since 6b17b85; the earlier
    # (16, 256, 4, 3) was picked on an L2-resident weight): 9.2 vs 10.3 us
    (1, 5120, 2048, False): (4, 1024, 8, 3),
    (16, 5120, 2048, False): (64, 256, 4, 3),  # Coder-30B q|k|v, verify block: 8.3 vs 9.5
    (16, 16384, 5120, False): (64, 128, 4, 3),  # Qwen3.6-27B [qkv | z], verify block: 61.4 vs 62.8
    (16, 5120, 6144, False): (64, 128, 4, 5),  # 27B out_proj / o_proj (+ residual): 25.9 vs 27.9
    (16, 14336, 5120, False): (32, 128, 4, 3),  # 27B attention q|gate|k|v: 54.9 vs 57.0
    (16, 17408, 5120, True): (32, 256, 4, 5),  # 27B gate|up: 125.6 vs 127.9
    (16, 5120, 17408, False): (64, 256, 8, 5),  # 27B down (+ residual): 67.2 vs 76.0
    (16, 5120, 25600, False): (64, 256, 8, 5),  # 27B drafter fc: 99.1 vs 109.2
}


def _launch_config(m: int, n: int, k: int, gated: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for m rows, n output columns, reduction length k.

    A hand heuristic (no autotune: CUDA graphs are captured right after warm-up). The kernel is bound by
    streaming W, so it wants enough programs to fill the GPU (>= 2 per SM where n allows) with enough
    bytes in flight each. BLOCK_N is the largest candidate that still gives >= _MIN_PROGRAMS programs,
    else the smallest. With gated=True n is the output width (I); each program then reads 2*BLOCK_N rows.
    - m == 1 (multiply + row-sum path): BLOCK_N 4..16, wide BLOCK_K so each thread issues several
      16-byte loads along K per iteration; 8 warps once the tile reaches 8192 elements.
    - 2 <= m <= 16 (tl.dot path, rows padded to 16): BLOCK_N 16..64, BLOCK_K 128 (256 bytes of bf16 per
      W row per stage; 256 where fewer programs than SMs), 3 stages of cp.async pipelining.
    - 2 <= m <= 16 on weights above SMALL_WEIGHT (bench/tune_skinny.py sweep on the Qwen3-8B shapes, H100):
      BLOCK_N 32 with deep pipelining, 5 stages of BLOCK_K 256 for long rows (K > 4096) and the LM head,
      128 otherwise; the gated [gate; up] pair (two tiles per stage) 3 stages of 128. A narrow weight whose
      32-column tiles would leave half the SMs idle takes 16 x 256.
    """
    tuned = _TUNED.get((1 if m == 1 else 16, n, k, gated))
    if tuned is not None:
        return tuned
    if m == 1:
        block_k = min(512, max(64, _next_pow2(k)))
        block_n = next((b for b in (16, 8) if _cdiv(n, b) >= _MIN_PROGRAMS), 4)
        return block_n, block_k, 8 if block_n * block_k >= 8192 else 4, 3
    if (2 if gated else 1) * n * k > SMALL_WEIGHT:
        if gated:
            return 32, 128, 4, 3
        if _cdiv(n, 32) < _NUM_SMS // 2:  # narrow (an MoE model's o_proj 4096 -> 2048): 32 would idle half the SMs
            return 16, 256, 4, 5  # 9.7 vs 11.3 us for 2048 x 4096 (tune_skinny_coder30b_m16_cold; 35B-A3B alike)
        return 32, 256 if k > 4096 or n >= 65536 else 128, 4, 5
    block_n = next((b for b in (64, 32) if _cdiv(n, b) >= _MIN_PROGRAMS), 16)
    # a narrow weight (an MoE router: 128-256 columns) leaves a few programs each walking all of K: halve their
    # steps (Qwen3-Coder-30B-A3B router at 16 rows: 6.15 us at BLOCK_K 256 vs 13.19 at 128, tune_skinny on an H100)
    block_k = min(256 if _cdiv(n, block_n) < _NUM_SMS else 128, max(16, _next_pow2(k)))
    return block_n, block_k, 4, 3


_SPLIT_MAX_TILES = 16  # launches of at most this many tiles split their K


def split_k(m: int, n: int, k: int, block_n: int, block_k: int) -> int:
    """Programs a tile's K is split over (a power of two) on the dot path: a weight so narrow that a few programs
    each walk all of K (an MoE router, 128-256 columns at 16 rows: 8-16 tiles) gets up to _MIN_PROGRAMS programs,
    each with whole BLOCK_K steps. bench/tune_skinny.py on an H100 (16 rows, weights streamed from HBM, with the
    router's norm launch: tune_skinny_{coder30b,35b,8b}_m16_split_h100_74fd879.json): Qwen3-Coder-30B-A3B's router
    6.48 -> 5.56 us at 8 splits, Qwen3.6-35B-A3B's 6.45 -> 5.73; but wider launches lost at every split: o_proj
    2048 x 4096 (128 tiles) 9.56 -> 10.8 us at 2, Coder q|k|v (80 tiles) 12.5 -> 14.1, Qwen3-8B down 37.8 -> 38.9."""
    tiles = _cdiv(n, block_n)
    if m == 1 or tiles > _SPLIT_MAX_TILES:
        return 1
    split = 1
    while tiles * split * 2 <= _MIN_PROGRAMS and k % (2 * split * block_k) == 0:
        split *= 2
    return split


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except that 2 or 3 rows on CPU are padded to 4. MKL's 2- and 3-row GEMM reads the
    weight about once per row: 1.2-1.5x the 4-row time on decoder-sized weights and 1.7x on SmolLM2's
    LM head (25.4 vs 14.7 ms for 3 rows on two cores), exactly the shapes of small-k speculation."""
    if x.device.type == "cpu" and x.dim() == 2 and x.shape[0] in (2, 3):
        padded = torch.cat([x, x.new_zeros(4 - x.shape[0], x.shape[1])])
        return F.linear(padded, weight, bias)[: x.shape[0]]
    return F.linear(x, weight, bias)


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                      norm_weight: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: rms_norm_ref -> F.linear -> silu_mul_ref -> residual add (in place, returns residual)."""
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps)[0]
    y = linear(x, weight, bias)
    if gated:
        y = silu_mul_ref(y)
    if residual is None:
        return y
    return residual.copy_(residual + y)


def skinny_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the Triton kernel applies to this activation / weight pair."""
    return (use_triton(x) and x.dim() == 2 and 1 <= x.shape[0] <= 16 and x.is_contiguous()
            and x.dtype == weight.dtype and weight.is_contiguous())


def _operands_fit(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  norm_weight: torch.Tensor | None, gated: bool, residual: torch.Tensor | None) -> bool:
    """The remaining operands have the shapes, dtype and layout the kernel indexes them with."""
    if weight.dim() != 2 or weight.shape[1] != x.shape[1] or (gated and weight.shape[0] % 2):
        return False
    n_out = weight.shape[0] // 2 if gated else weight.shape[0]

    def fits(t: torch.Tensor | None, shape: tuple[int, ...]) -> bool:
        return t is None or (t.shape == shape and t.dtype == x.dtype and t.is_contiguous() and t.device == x.device)

    return (fits(bias, (weight.shape[0],)) and fits(norm_weight, (x.shape[1],))
            and fits(residual, (x.shape[0], n_out)))


def _skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          norm_weight: torch.Tensor | None, eps: float, gated: bool,
                          residual: torch.Tensor | None, norm_out: torch.Tensor | None = None,
                          split: int | None = None) -> torch.Tensor:
    """Launch without the support checks (the tests call it on CPU tensors under TRITON_INTERPRET=1). `split`:
    the K split of the dot path (default `split_k`; 1 where a norm or the SwiGLU rides along)."""
    m, k = x.shape
    n_out = weight.shape[0] // 2 if gated else weight.shape[0]
    out = residual if residual is not None else torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps, num_stages = _launch_config(m, n_out, k, gated)
    use_dot = m > 1
    block_m = 16 if use_dot else 1
    tiles = triton.cdiv(n_out, block_n)
    if not use_dot or norm_weight is not None or gated or tiles > ARRIVALS:
        split = 1
    elif split is None:
        split = split_k(m, n_out, k, block_n, block_k)
        if split > 1 and not can_split(x):
            split = 1  # the counters must outlive any one graph: allocated by an eager launch (the warm-up's) first
    if split > 1 and k % (split * block_k):
        raise ValueError(f"a K split of {split} needs K = {k} in whole {block_k}-column steps a split")
    ws, cnt = x, x  # (not read without a split)
    if split > 1:
        ws = torch.empty(tiles * split * block_m * block_n, dtype=torch.float32, device=x.device)
        cnt = arrival_counters(x.device)
    on = pdl(x)
    _skinny_linear_kernel[(tiles * split,)](
        x, weight, bias if bias is not None else x, norm_weight if norm_weight is not None else x, out,
        m, n_out, eps, weight, out, n_out, 0, norm_out if norm_out is not None else x, ws, cnt, K=k,
        HAS_BIAS=bias is not None, HAS_NORM=norm_weight is not None, GATED=gated, HAS_RES=residual is not None,
        USE_DOT=use_dot, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PAIR=False,
        NORM_OUT=norm_out is not None and norm_weight is not None, SPLIT_K=split, PDL=on, num_warps=num_warps,
        num_stages=num_stages, launch_pdl=on)
    return out


def _skinny_pair_triton(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, norm_weight: torch.Tensor | None,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Both projections in one launch with the first one's config (the larger: it sets the time)."""
    m, k = x.shape
    n1, n2 = w1.shape[0], w2.shape[0]
    y1 = torch.empty(m, n1, dtype=x.dtype, device=x.device)
    y2 = torch.empty(m, n2, dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps, num_stages = _launch_config(m, n1, k)
    tiles1 = triton.cdiv(n1, block_n)
    use_dot = m > 1
    on = pdl(x)
    _skinny_linear_kernel[(tiles1 + triton.cdiv(n2, block_n),)](
        x, w1, x, norm_weight if norm_weight is not None else x, y1, m, n1, eps, w2, y2, n2, tiles1, x, x, x, K=k,
        HAS_BIAS=False, HAS_NORM=norm_weight is not None, GATED=False, HAS_RES=False, USE_DOT=use_dot,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=16 if use_dot else 1,
        BLOCK_N=block_n, BLOCK_K=block_k, PAIR=True, NORM_OUT=False, PDL=on, num_warps=num_warps,
        num_stages=num_stages, launch_pdl=on)
    return y1, y2


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  norm_weight: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False,
                  residual: torch.Tensor | None = None, norm_out: torch.Tensor | None = None) -> torch.Tensor:
    """One launch for norm + projection + SwiGLU / residual add. 2-16 rows (verify) on a large weight
    take the norm as its own kernel first (a norm inside the tl.dot loop stalls its pipelining), and a
    square residual projection (N >= K, K <= 4096) goes to cuBLAS with the add in its epilogue: measured
    fastest per Qwen3-8B shape on an H100 (bench/tune_skinny.py, bench/NOTES.md). A narrower one (an MoE
    model's o_proj, 4096 -> 2048) stays on the kernel: cuBLAS split K there and added a reduction launch
    (Qwen3-Coder-30B-A3B verify: 8.7 + 2.3 us against 7.3 on the kernel, tune_skinny_coder30b_m16). The reference
    elsewhere (CPU, grad). `norm_out` (with norm_weight; x's shape, dtype and device): also receives
    rms_norm(x) itself, from the same launch where the kernel folds the norm in."""
    if skinny_supported(x, weight) and _operands_fit(x, weight, bias, norm_weight, gated, residual) and (
            norm_out is None or (norm_out.shape == x.shape and norm_out.dtype == x.dtype and norm_out.is_contiguous()
                                 and norm_out.device == x.device)):
        if x.shape[0] == 1 or weight.numel() <= SMALL_WEIGHT:
            return _skinny_linear_triton(x, weight, bias, norm_weight, eps, gated, residual, norm_out)
        if norm_weight is not None:
            x = rms_norm(x, norm_weight, eps)[0]
            if norm_out is not None:
                norm_out.copy_(x)
        if residual is not None and bias is None and not gated and weight.shape[0] >= x.shape[1] <= 4096:
            return residual.addmm_(x, weight.t())  # the add rides in the GEMM's epilogue (beta = 1)
        return _skinny_linear_triton(x, weight, bias, None, eps, gated, residual)
    if norm_out is not None and norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps)[0]
        norm_out.copy_(x)
        norm_weight = None
    return skinny_linear_ref(x, weight, bias, norm_weight=norm_weight, eps=eps, gated=gated, residual=residual)


def skinny_linear_pair(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
                       eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(skinny_linear(x, w1, norm...), skinny_linear(x, w2, norm...)) in one launch where the kernel applies: a
    Gated DeltaNet layer's [qkv | z] and [b | a] projections of one decode row, whose second GEMM (a few dozen
    columns) was a launch of its own every layer (30 of a Qwen3.6-35B-A3B token's ~530). Rows above one on
    weights beyond SMALL_WEIGHT take the norm as its own kernel first, as skinny_linear does."""
    if (skinny_supported(x, w1) and skinny_supported(x, w2) and _operands_fit(x, w1, None, norm_weight, False, None)
            and _operands_fit(x, w2, None, norm_weight, False, None)):
        if x.shape[0] > 1 and norm_weight is not None and max(w1.numel(), w2.numel()) > SMALL_WEIGHT:
            return _skinny_pair_triton(rms_norm(x, norm_weight, eps)[0], w1, w2, None, eps)
        return _skinny_pair_triton(x, w1, w2, norm_weight, eps)
    return (skinny_linear(x, w1, norm_weight=norm_weight, eps=eps),
            skinny_linear(x, w2, norm_weight=norm_weight, eps=eps))
