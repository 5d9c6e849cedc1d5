"""1-16 decode / verify rows through an NVFP4 (or int4) layer on tensor cores, the weights never leaving registers.

quant_linear's one-row paths dequantize a tile and either reduce it with float32 multiplies or hand it to
`tl.dot`, which stages it through shared memory into the mma operand layout. Here each lane loads 16 bytes of
one weight row (lane = 4 g + t: row g of the warp's 8, bytes 16 t .. 16 t + 15 of a 64-byte span) and feeds
them to `mma.sync.m16n8k16` as the B operand where they are, with no layout conversion: the order of the
products over K does not matter to the sum, so the k index the mma gives a B register is simply defined to be
the physical column that lane loaded, and x is loaded in the same order for the A operand. x has one row, so
A's rows are copies of it: the aligned quad of x pairs (P0, P1, P2, P3) of bytes 0-3 is A as loaded, row g
reading (P0 | P2) and row g + 8 (P1 | P3). One mma takes B = (bytes 0, 2) and keeps its row g, the other
B = (bytes 1, 3) and keeps its row g + 8: every product is counted once and no register is copied.
C register c of lane (g, t) then holds the dot product of weight row 2 t + c (of the 8) with x.

Narrow layers have too few rows for enough warps, so a row's K can be split over P of the warp's 8 mma
columns (column c: row c // P, K part c % P), each A row g then carrying x of part g % P: C[g][n] is right where
g % P == n % P, and the P parts of a row are summed after the loop.

2 to 16 rows (`_rows_kernel`) turn the mma around: the weights are the A operand (a lane decodes 4 bytes of
weight row g and 4 of row g + 8 of a 16-row group), the tokens the B operand (the x pairs of token g, and of
g + 8 for a second block of 8 tokens, beside those bytes), so each x register serves two weight rows and every
C register is one (row, token) sum. K is split over the program's warps and summed once at the end. One row of a
wide layer (ROWS_ONE_WIDE, ROWS_ONE) or a narrow long-K one (ROWS_ONE_LONG_K, SPLIT_ONE) runs on it too: it loads 2
bytes of x a weight byte against the GEMV's 4, and measured faster there (bench/quant_gemv.py --stream / --splits).

MoE experts take the same forms: one token the GEMV over each routed expert's weights (`_moe_kernel`), 2 to 64
the rows kernel over moe_grouped's work items (`_moe_rows_kernel`: an expert and its tokens gathered through the
sorted pairs, 8 a pass), a gate|up group of 16 weight rows holding 8 outputs' gate and up rows so that SiLU(gate)
* up is its epilogue; a quantized shared expert of the same layout is expert id E.

The E2M1 decode is quant_tiles' PTX (w * scale * 2^-26 as bf16 pairs, exact), the 2^26 and the global scale
are applied to the float32 sums. int4 (groups of >= 32 weights, so that a lane's 16 bytes share one scale|zero
word) decodes each pair to bf16 (q - z) * s, rounded once as dequantize() rounds it (quant_tiles.int4_decode_ptx);
quant_linear's dot path decodes int4 cheaply too and stays faster for most shapes (`launch_config`).

SwiGLU folds into every kernel's epilogue (`gated`, a [gate; up] layer of N = 2I rows -> [M, I]): a program reads
the gate rows of its outputs in one half of its tile rows and their up rows in the other (each warp still streams
adjacent rows; interleaving them within a warp measured ~10% slower), or, in the rows kernel, as each 16-row
group's lo and hi rows, and one launch replaces the GEMM and the SwiGLU kernel after it.

One row can also stream (`_stream_kernel`, the parts kernel's tiles): each loop step issues the next step's weight
loads before its own mmas, and the first step's before the PDL wait, while the kernel before still runs: weights do
not depend on it. Its dependents are released right after the wait, so that their first weights are in flight during
this launch too (bench/pdl_preload.py: a read-only launch chained that way reached 90-98% of copy bandwidth on an
H200, against 57-82% loading after the wait and releasing late).

Measured on an H100 (bench/quant_gemv.py, bench/results/quant_gemv_h100_*.json, % of copy bandwidth): NVFP4
Qwen3-8B gate|up 37.8 -> 27.0 us (50 -> 70%), o 10.2 -> 8.9, down 25.8 -> 21.7; qkv stays on quant_linear's dot
path (15.6 against 11.6 us): `launch_config` holds the lines.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from blockspec.kernels._triton import HAVE_TRITON, INTERPRET, pdl
from blockspec.kernels.arrivals import ARRIVALS, arrival_counters, can_split
from blockspec.kernels.quant_tiles import E2M1_REGS, FP4_GLOBAL_BIAS, INT4_REGS, e2m1_decode_ptx, int4_decode_ptx

SPAN_BYTES = 64  # weight bytes a row per mma step group: 4 lanes x 16


@dataclass(frozen=True)
class GemvConfig:
    warps: int  # a program: 8 mma columns a warp
    spans: int  # 64-byte spans a loop step
    parts: int  # K parts a weight row is split over (P mma columns a row)
    stream: bool = False  # weights loaded a step ahead, the first step's before the PDL wait (`_stream_kernel`, rows)
    early: bool = False  # (stream, or one K part) dependents released right after the PDL wait, not before the stores
    rows: bool = False  # one row on the rows kernel too (weights as the mma's A operand: 2 bytes of x a weight byte)
    groups: int = 1  # (rows kernel) blocks of rows_block weight rows a program, each span's x loaded once for all
    splits: int = 1  # (rows kernel) programs a block's K is split over; the last to finish adds their float32 sums

    @property
    def block(self) -> int:
        """Tile rows a program: 8 a warp (the GEMV: weight rows x K parts)."""
        return 8 * self.warps

    @property
    def rows_block(self) -> int:
        """Weight rows a program of the rows kernel: 16 a warp, over P parts."""
        return 16 * self.warps // self.parts


WIDE_ROWS = 16384  # from here one K part: many programs already (gate|up, LM heads)
# one row takes the one-part kernel from fewer outputs: Qwen3.6-35B-A3B's in_proj 12288 x 2048 9.8 us against 11.7
# on the dot path, its q|gate|k|v 9216 x 2048 9.3 against 10.6 (H100, bench/quant_gemv.py, weights streamed from
# HBM); Qwen3-8B's q|k|v 6144 x 4096 keeps the dot path (11.6 against 15.2)
GEMV_WIDE_ROWS = 8192
WIDE = GemvConfig(warps=2, spans=4, parts=1)
# narrow layers (Qwen3-8B o_proj / down, 4096 rows): K in 4 parts over 8 warps, two spans a step. One-row NVFP4, us
# (c75ff26, H100 / H200): o 8.55 / 8.4 -> 7.46 / 7.4, down 20.2 / 20.1 -> 19.0 / 18.3 against the 16-warp, 4-span
# launch first measured on the H100 (d60662d), which the 2048-row layers keep (NARROWEST: 35B out_proj 4.4 against 6.3).
# The dispatch now streams these layers (STREAM_NARROW / STREAM_LONG_K, below); NARROW stays a tested launch.
NARROW = GemvConfig(warps=8, spans=2, parts=4)
NARROW_MAX_ROWS = 4224  # up to here: where that first launch's 16-warp programs fit one wave (32 rows x 132 SMs)
# up to 2048 outputs (Qwen3.6-35B-A3B's out_proj and o_proj, 2048 x 4096): K in 8 parts over 16 warps, 4.5 us against
# NARROW's 8.3 (H100, bench/quant_gemv.py --sweep, quant_gemv_narrow_h100_d60662d.json); no spill with the residual
# (110 registers, bench/compile_sm90.py), where 32 warps x 8 parts spilled
NARROWEST = GemvConfig(warps=16, spans=4, parts=8)
NARROWEST_ROWS = 2048
# One row, streamed (`_stream_kernel`: each step's weights loaded while the step before runs its mmas, the first
# step's before the PDL wait, dependents released right after it). H200, bench/quant_gemv.py --stream (launches back
# to back under PDL, weights rotated past the L2; quant_gemv_stream_{nvfp4,int4}_h200_347918d.json), us:
# NVFP4 qkv 6144 x 4096 8.8 against the dot path's 11.3; o 4096 x 4096 5.7 against NARROW's 7.4, int4 5.4 against
# the dot path's 6.9; NVFP4 down 4096 x 12288 15.9 against NARROW's 18.3 (int4 down stays on the dot path: 14.8
# against 15.8, and so does int4 qkv: 8.1 against 8.3, within the noise). gate|up (24576 rows) stays WIDE / INT4_WIDE.
# Past 4224 outputs only up to K = 4096 (STREAM_MID_MAX_K): Qwen3.6-27B's out_proj 5120 x 6144 took 20.9 us against
# the dot path's 14.8 (its down 5120 x 17408 36.3 against 37.5; quant_gemv_dispatch_h200_6127628.json).
STREAM_MID = GemvConfig(warps=4, spans=8, parts=2, stream=True, early=True)
STREAM_NARROW = GemvConfig(warps=8, spans=4, parts=4, stream=True, early=True)
STREAM_LONG_K = GemvConfig(warps=8, spans=2, parts=4, stream=True, early=True)  # K >= 2 N (a down projection)
STREAM_MID_MAX_K = 4096
# One row of a layer of more than NARROWEST_ROWS and fewer than GEMV_WIDE_ROWS outputs with K > STREAM_MID_MAX_K:
# the rows kernel (weights as the mma's A operand: 2 bytes of x a weight byte against the GEMV's 4), streamed, K
# split over two programs where it tiles K (`_fit_split`). The GEMVs' launches of those layers fill the SMs about
# 1.2 times (Qwen3.6-27B's down: 320 programs of 8 warps at 103 registers, 2 resident an SM). H200, bench/quant_gemv.py
# --splits / --stream (quant_gemv_one_row_splits_h200_7525233.json), us: Qwen3-8B down 4096 x 12288 13.9 against
# STREAM_LONG_K's 15.9; Qwen3.6-27B out_proj / o_proj 5120 x 6144 10.8 against the dot path's 14.5, its down 5120 x
# 17408 (no split tiles its 136 spans) 26.7 against the dot path's 37.5. int4 keeps the dot path (27B down 26.5
# against 25.4).
SPLIT_ONE = GemvConfig(warps=8, spans=2, parts=4, stream=True, early=True, rows=True, splits=2)
# One row of a wide layer (>= WIDE_ROWS outputs: gate|up) on the rows kernel, streamed, releasing early. H200,
# bench/quant_gemv.py --stream (quant_gemv_one_row_wide_rows_h200_9e8ce7c.json), us against WIDE: Qwen3.6-27B gate|up
# 34816 x 5120 with SwiGLU 38.7 against 50.8 (4 warps, one K part: 544 programs of 64 rows, all resident), Qwen3-8B
# gate|up 24576 x 4096 with SwiGLU 23.8 against 25.6 (8 warps, K in 4 parts).
ROWS_ONE_WIDE = GemvConfig(warps=8, spans=2, parts=4, stream=True, early=True, rows=True)
ROWS_ONE_WIDE_LONG_K = GemvConfig(warps=4, spans=2, parts=1, stream=True, early=True, rows=True)  # K > 4096, SwiGLU
# One row of every other layer of >= GEMV_WIDE_ROWS outputs, NVFP4 and int4: the rows kernel, K in two parts,
# streamed, dependents released after the stores (early lost 1-2 us on most of these). H200, bench/quant_gemv.py
# --stream (quant_gemv_one_row_rows_h200_30279a5.json), us against the dispatch before: NVFP4 Qwen3.6-27B Gated
# DeltaNet in_proj 16384 x 5120 18.8 against ROWS_ONE_WIDE_LONG_K's 29.6, its q|gate|k|v 14336 x 5120 17.6 against
# WIDE's 23.7, Qwen3.6-35B-A3B in_proj 12288 x 2048 7.5 against 9.4 and q|gate|k|v 9216 x 2048 6.9 against 9.0,
# Qwen3.5-4B in_proj 12288 x 2560 8.5 against 12.0; int4 g128 Qwen3-8B gate|up with SwiGLU 19.4 against INT4_WIDE's
# 24.0 (unfolded 19.3 against the dot path's 22.7), Qwen3.6-27B gate|up with SwiGLU 35.3 against the dot path's 46.9,
# 27B q|gate|k|v 16.8 against 20.8, 35B in_proj / q|gate|k|v 7.3 / 6.9 against 8.7 / 7.9. Qwen3-8B's q|k|v 6144 x
# 4096 keeps its GEMV / dot path (int4 10.4 here against 8.5).
ROWS_ONE = GemvConfig(warps=4, spans=2, parts=2, stream=True, rows=True)
# One row of a down projection (K >= 2 N, K > STREAM_MID_MAX_K) of DOWN_MIN_ROWS to NARROW_MAX_ROWS outputs, NVFP4 and
# int4: the rows kernel, K in 8 parts over 8 warps, 4 spans a step, streamed, no K split (256 programs of 16 rows for
# Qwen3-8B's 4096), where that tiles K; else SPLIT_ONE. H200, bench/quant_gemv.py --stream (quant_gemv_down_rows_one_
# h200_6b02d0f.json), us: Qwen3-8B down 4096 x 12288 NVFP4 12.8 against SPLIT_ONE's 13.8, int4 g128 12.4 against
# 12.9 (SPLIT_ONE took int4 off the dot path's 14.9 in session 40). The 16-warp launch (16, 4, 8) measured 12.6 /
# 12.9 but spills 136-176 bytes a thread under Triton 3.9; this one spills under neither 3.6 nor 3.9. The 27B's
# 5120 x 17408 down keeps SPLIT_ONE (NVFP4) / the dot path (int4: 25.9 against 27.6 streamed).
ROWS_ONE_LONG_K = GemvConfig(warps=8, spans=4, parts=8, stream=True, rows=True)
DOWN_MIN_ROWS = 4096


MAX_ROWS = 16  # two blocks of 8 tokens: a k = 15 verify block
# 2 to MAX_ROWS rows (H100, bench/quant_gemv.py --rows 8,16 --sweep, quant_gemv_rows_h100_*.json): one K part
# from WIDE_ROWS outputs (Qwen3-8B gate|up, 16 rows: 50.3 -> 42.0 us); narrower layers split K over 8 warps
# (8 rows: o 9.7 -> 8.3, qkv 12.8 -> ~11.6, down 25.5 -> 19.0). At 9-16 rows every program of a narrow layer
# reads all 16 rows of x (as much L2 traffic as the weight once K is split), so only long-K layers (down:
# 30.2 -> 25.5) leave the dot path, which measured as fast or faster on qkv and o.
ROWS_WIDE = GemvConfig(warps=4, spans=2, parts=1)
# int4 g128 (H100, bench/quant_gemv.py --schemes int4 --sweep, quant_gemv_int4_h100_*.json): quant_linear's dot path
# decodes int4 cheaply and stays faster on the Qwen3-8B qkv / o / down at 1 and 16 rows (8.6 / 7.0 / 15.0 us against
# the best mma configs' 13.0 / 7.5 / 18.4) and on gate|up at 16 rows (with SwiGLU 37.4 against 39.3). One row of
# gate|up with SwiGLU folded takes the mma GEMV, two spans a step: Qwen3-8B 25.6 us against the dot path and a SwiGLU
# launch's 30.1 (unfolded 25.1 against 25.7: left to the dot path); not from K = 5120 (Qwen3.6-27B: 51.2 against 48.6).
# Since replaced by the rows kernel (ROWS_ONE); a tested launch still.
INT4_WIDE = GemvConfig(warps=2, spans=2, parts=1)
ROWS_FEW = GemvConfig(warps=16, spans=4, parts=8)  # 2-8 rows
ROWS_LONG_K = GemvConfig(warps=8, spans=2, parts=8)  # 9-16 rows, K >= 2 N
# 9-16 rows of Qwen3.6-27B's layers (H100, bench/quant_gemv.py --rows 16 --sweep, quant_gemv_rows16_27b_sweep_h100_
# d60662d.json), us against the dot path / the rules above: their K = 5120 rows measured best on other launches
# than Qwen3-8B's K = 4096 ones (gate|up: one span a step, 78.5 against 103.3 with ROWS_WIDE's two); its out_proj /
# o_proj 5120 x 6144 kept the dot path (23.1, no launch faster) until K was split over programs (SPLIT_ROWS, which
# took its down too)
ROWS_TUNED = {
    # gate|up: 78.5 against 95.1 / 103.3; then two blocks of rows a program (GemvConfig.groups) 65.3 against that
    # launch's 76.7 (quant_gemv_rows16_groups_27b_35b_h100_a89c836.json)
    (34816, 5120): GemvConfig(warps=4, spans=1, parts=4, groups=2),
    (16384, 5120): GemvConfig(warps=8, spans=2, parts=2),  # Gated DeltaNet in_proj: 33.2 against 54.0 / 41.4
    (14336, 5120): GemvConfig(warps=8, spans=2, parts=2),  # attention q|gate|k|v: 32.7 against 42.0 (dot)
}
# 9-16 rows streamed (the rows kernel with STREAM: each step's weights loaded a step ahead, the first step's before
# the PDL wait, dependents released right after it). NVFP4 at 16 rows, H200, bench/quant_gemv.py --rows 16 --stream
# (quant_gemv_rows16_stream_h200_70b61d5.json), us against the dispatch before: Qwen3-8B qkv 6144 x 4096 12.9
# against the dot path's 15.4 (its best swept config 15.7: quant_gemm_nvfp4_rows16_sweep_h200_70b61d5.json), o 4096 x
# 4096 9.5 against 11.3, down 4096 x 12288 23.0 against ROWS_LONG_K's 26.3, gate|up 41.8 against ROWS_WIDE's 45.2
# (with SwiGLU 41.8 against 42.8). int4 stays on the dot path (10.6 / 8.2 / 17.7 / 28.4 against 12.3 / 8.9 / 21.4 /
# 39.6). Past 4224 outputs only up to STREAM_MID_MAX_K, as at one row; from K = 4096 (STREAM_ROWS_MIN_K: shorter
# rows, e.g. Qwen3.6-35B-A3B's K = 2048 projections, were not measured and keep the rules before).
STREAM_ROWS_WIDE = GemvConfig(warps=4, spans=2, parts=1, stream=True, early=True)
STREAM_ROWS_MID = GemvConfig(warps=4, spans=4, parts=4, stream=True, early=True)  # and K >= 2 N (down: 23.2 early)
STREAM_ROWS_NARROW = GemvConfig(warps=8, spans=4, parts=4, stream=True, early=True)
STREAM_ROWS_MIN_K = 4096
# 9-16 rows of a wide layer (gate|up), two blocks of 16 weight rows a program sharing each span's x loads
# (GemvConfig.groups). H100, bench/quant_gemv.py --rows 16 --groups (quant_gemv_rows16_groups_h100_c957a86.json), us:
# Qwen3-8B gate|up 24576 x 4096 NVFP4 33.6 against STREAM_ROWS_WIDE's 40.9 (with SwiGLU 34.2 against 41.0); the
# narrower layers lost (qkv 14.5 against 13.3, o 11.9 against 9.6, down 33.6 against 24.1). Engine (H100, Qwen3-8B
# NVFP4, bench/ab_engine.py): k15 step 5.24 -> 4.95 ms. int4 with SwiGLU (32.1 us against the dot path and its
# SwiGLU launch's 35.9) lost in the engine (k15 4.39 -> 4.46 ms, verify alone 3.96 -> 4.19): int4 keeps the dot path.
# Measured at K = 4096 (GROUPED_MAX_K); Qwen3.6-27B's K = 5120 gate|up keeps its ROWS_TUNED launch.
GROUPED_WIDE = GemvConfig(warps=4, spans=1, parts=2, groups=2)
GROUPED_MAX_K = 4096
# 9-16 rows of Qwen3.6-35B-A3B's K = 2048 projections (H100, same file): Gated DeltaNet in_proj 12288 x 2048 12.5 us
# against the dot path's 16.7, attention q|gate|k|v 9216 x 2048 11.9 against 14.1 (the streamed rows kernel: 12.8 /
# 11.8); between NARROW_MAX_ROWS and WIDE_ROWS outputs, K from GROUPED_MIN_K up to STREAM_ROWS_MIN_K.
GROUPED_MID = GemvConfig(warps=4, spans=2, parts=4, groups=2)
GROUPED_MIN_K = 2048
# 9-16 rows of a layer between NARROW_MAX_ROWS and GEMV_WIDE_ROWS outputs with K past STREAM_MID_MAX_K, NVFP4 and int4:
# two blocks of rows a program, K split over 4 programs (GemvConfig.splits; the last to arrive adds the sums in split
# order). H100, bench/quant_gemv.py --rows 16 --splits (quant_gemv_rows16_splits_h100_1a833f4.json), us against the
# dispatch before: Qwen3.6-27B down 5120 x 17408 NVFP4 36.4 against ROWS_TUNED's 53.6 (int4 34.4 against the dot
# path's 42.4), out_proj / o_proj 5120 x 6144 17.6 against the dot path's 23.0 (int4 16.2 against 17.4). The
# Qwen3-8B layers (4096 outputs or K = 4096) keep their launches: split, qkv / o / down 13.8 / 11.9 / 25.1 against
# 13.3 / 9.8 / 24.0 (int4 on the dot path: 13.2 / 11.5 / 22.2 against 10.8 / 8.5 / 18.0).
SPLIT_ROWS = GemvConfig(warps=4, spans=1, parts=2, groups=2, splits=4)


def _tiles_k(cfg: GemvConfig, k: int) -> bool:
    """Whether cfg's loop steps over whole spans of each K part (64 bytes = 128 weights), nothing masked."""
    return k % (2 * SPAN_BYTES * cfg.parts * cfg.splits * cfg.spans) == 0


def _fit_k(cfg: GemvConfig, k: int) -> GemvConfig | None:
    """cfg with its K parts and spans a step cut (halved) until they tile K (`_tiles_k`), or None."""
    parts = cfg.parts
    while parts >= 1:
        for spans in (cfg.spans, cfg.spans // 2, cfg.spans // 4, 1):
            fitted = replace(cfg, spans=max(spans, 1), parts=parts)
            if _tiles_k(fitted, k):
                return fitted
        parts //= 2
    return None


def launch_config(meta, m: int = 1, gated: bool = False) -> GemvConfig | None:
    """The launch for m rows of the layer, or None where quant_linear's dot path measured faster (H100 / H200,
    bench/quant_gemv.py --sweep / --stream / --groups / --splits): one row by scheme (`_int4_one_row`,
    `_nvfp4_one_row`), 2 to MAX_ROWS NVFP4 rows on the rows kernel (`_nvfp4_rows`), and 9-16 rows of a layer between
    NARROW_MAX_ROWS and GEMV_WIDE_ROWS outputs with K past STREAM_MID_MAX_K split over programs in both schemes
    (SPLIT_ROWS)."""
    if 8 < m <= MAX_ROWS and NARROW_MAX_ROWS < meta.n < GEMV_WIDE_ROWS and meta.k > STREAM_MID_MAX_K \
            and _tiles_k(SPLIT_ROWS, meta.k) and _gated_fit(SPLIT_ROWS, gated):
        return SPLIT_ROWS
    if meta.scheme == "int4":
        return _int4_one_row(meta.n, meta.k, gated) if m == 1 else None
    if m > 1:
        return _nvfp4_rows(meta.n, meta.k, m)
    return _nvfp4_one_row(meta.n, meta.k, gated)


def _int4_one_row(n: int, k: int, gated: bool) -> GemvConfig | None:
    """One int4 row: from GEMV_WIDE_ROWS outputs the rows kernel (ROWS_ONE), a down projection of 4096-4224 outputs
    on it too (`_long_k_one_row`), an o projection and a q|k|v streamed (STREAM_NARROW, STREAM_MID); the rest (the
    narrowest layers, other long-K layers) on the dot path."""
    if _is_down(n, k):
        return _gated_fit(_long_k_one_row(n, k), gated)
    if n >= GEMV_WIDE_ROWS:
        cfg = ROWS_ONE
    elif NARROWEST_ROWS < n <= NARROW_MAX_ROWS and k < 2 * n:  # an o projection
        cfg = STREAM_NARROW
    elif n > NARROW_MAX_ROWS and k <= STREAM_MID_MAX_K:  # a q|k|v
        cfg = STREAM_MID
    else:
        return None
    return _gated_fit(_fit_k(cfg, k), gated)


def _is_down(n: int, k: int) -> bool:
    """Whether an n x k layer is a down projection of ROWS_ONE_LONG_K's measured width (Qwen3-8B's 4096 x 12288)."""
    return DOWN_MIN_ROWS <= n <= NARROW_MAX_ROWS and k >= 2 * n and k > STREAM_MID_MAX_K


def _long_k_one_row(n: int, k: int) -> GemvConfig | None:
    """One row of a layer with K > STREAM_MID_MAX_K on the rows kernel: ROWS_ONE_LONG_K for a down projection it
    tiles as measured, else SPLIT_ONE (split where that tiles K)."""
    return ROWS_ONE_LONG_K if _is_down(n, k) and _tiles_k(ROWS_ONE_LONG_K, k) else _fit_split(SPLIT_ONE, k)


def _nvfp4_one_row(n: int, k: int, gated: bool) -> GemvConfig | None:
    """One NVFP4 row: up to 2048 outputs 8 parts over 16 warps (NARROWEST: 32 warps spilled); from GEMV_WIDE_ROWS
    outputs the rows kernel (`_one_row_wide`); between the two, K > STREAM_MID_MAX_K on the rows kernel
    (`_long_k_one_row`), else the streamed kernel (STREAM_*)."""
    if n <= NARROWEST_ROWS and _tiles_k(NARROWEST, k):
        return NARROWEST
    if n >= GEMV_WIDE_ROWS:
        return _one_row_wide(n, k, gated)
    if k > STREAM_MID_MAX_K and (cfg := _gated_fit(_long_k_one_row(n, k), gated)) is not None:
        return cfg
    if n > NARROW_MAX_ROWS:
        return _gated_fit(_fit_k(STREAM_MID, k), gated) if k <= STREAM_MID_MAX_K else None
    return _gated_fit(_fit_k(STREAM_LONG_K if k >= 2 * n else STREAM_NARROW, k), gated)


def _nvfp4_rows(n: int, k: int, m: int) -> GemvConfig | None:
    """2 to MAX_ROWS NVFP4 rows on the rows kernel: launches of its own for the measured Qwen3.6-27B shapes
    (ROWS_TUNED), streamed or grouped at 9-16 rows (`_rows_streamed_or_grouped`, GROUPED_MID), else by width."""
    if m > MAX_ROWS:
        return None
    if m > 8 and (n, k) in ROWS_TUNED:
        cfg = ROWS_TUNED[(n, k)]
    elif m > 8 and n > NARROWEST_ROWS and k >= STREAM_ROWS_MIN_K:
        cfg = _rows_streamed_or_grouped(n, k)
    elif m > 8 and NARROW_MAX_ROWS < n < WIDE_ROWS and k >= GROUPED_MIN_K:
        cfg = GROUPED_MID
    else:
        cfg = ROWS_WIDE if n >= WIDE_ROWS else ROWS_FEW if m <= 8 else ROWS_LONG_K if k >= 2 * n else None
    return None if cfg is None else _fit_k(cfg, k)


def _one_row_wide(n: int, k: int, gated: bool) -> GemvConfig | None:
    """The launch for one row of an NVFP4 layer of >= GEMV_WIDE_ROWS outputs: a gate|up-wide one (>= WIDE_ROWS) on
    ROWS_ONE_WIDE up to K = STREAM_MID_MAX_K, with SwiGLU past it on ROWS_ONE_WIDE_LONG_K (the launches measured
    for the 8B's and the 27B's gate|up), every other on ROWS_ONE; the next of those (then WIDE) where one does not
    tile K or pair up SwiGLU's rows."""
    first = ROWS_ONE
    if n >= WIDE_ROWS and k <= STREAM_MID_MAX_K:
        first = ROWS_ONE_WIDE
    elif n >= WIDE_ROWS and gated:
        first = ROWS_ONE_WIDE_LONG_K
    for cfg in (_fit_k(first, k), _fit_k(ROWS_ONE, k), WIDE if _tiles_k(WIDE, k) else None):
        if (fitted := _gated_fit(cfg, gated)) is not None:
            return fitted
    return None


def _rows_streamed_or_grouped(n: int, k: int) -> GemvConfig | None:
    """The rows launch for 9-16 rows of an n x k NVFP4 layer of more than NARROWEST_ROWS outputs and K >=
    STREAM_ROWS_MIN_K: streamed, or grouped for a wide layer up to GROUPED_MAX_K; None (the dot path) where none
    measured faster."""
    if n >= WIDE_ROWS:
        return GROUPED_WIDE if k <= GROUPED_MAX_K else STREAM_ROWS_WIDE
    if k >= 2 * n:
        return STREAM_ROWS_MID
    if k > STREAM_MID_MAX_K:
        return None
    return STREAM_ROWS_MID if n > NARROW_MAX_ROWS else STREAM_ROWS_NARROW


def _fit_split(cfg: GemvConfig, k: int) -> GemvConfig | None:
    """cfg where it tiles K, else cfg without its K split (a split halves each program's work; parts and spans
    measured for the layer keep more of the launch than a split does), else None."""
    for fitted in (cfg, replace(cfg, splits=1)):
        if _tiles_k(fitted, k):
            return fitted
    return None


def _gated_fit(cfg: GemvConfig | None, gated: bool) -> GemvConfig | None:
    """cfg, or None where SwiGLU is folded (`gated`) and its tile rows do not pair up as (gate, up) of an output."""
    return None if cfg is None or (gated and cfg.block // cfg.parts % 2) else cfg


# The span asm's operands (pack = 4: four elements of each tensor a call): $0..$7 the accumulators out, $8..$15 in,
# $16 the 4 weight bytes (one register), A = the x pairs $17..$20, the scale pair $21 (and int4's zero pair
# -(128 + z) $25). The one-row kernels pass bytes, not the rows kernel's words (`_span_words`): words cut the
# streamed loops' SASS by a quarter (bench/sass_loops.py) but made the streamed one-row down projection slower,
# 15.7 -> 17.5 us (bench/quant_gemv.py, H100, session 36), while the rows kernel gained from them.
# the two mma steps of 4 decoded bytes t0..t3 into ($0..$3, from $8..$11) and ($4..$7, from $12..$15)
_MMA_PAIR = """\
mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3},
    {$17, $18, $19, $20}, {t0, t2}, {$8, $9, $10, $11};
mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$4, $5, $6, $7},
    {$17, $18, $19, $20}, {t1, t3}, {$12, $13, $14, $15};
}"""
# quant_tiles' E2M1 decode of the 4 bytes in $16 into t0..t3, scaled by the pair $21 (pairs of bytes 0..3)
_E2M1_MMA = "{\n" + E2M1_REGS + e2m1_decode_ptx("$16") + "".join(
    f"fma.rn.bf16x2 t{i}, t{i}, $21, nz;\n" for i in range(4)) + _MMA_PAIR
_INT4_MMA = "{\n" + INT4_REGS + int4_decode_ptx("$16", "$25", "$21") + _MMA_PAIR
_SPAN_CONSTRAINTS = ",".join(["=r"] * 8 + ["r"] * 17)  # + int4's zero pairs: 4 more
# 4 bytes -> their 32-bit word, as the first of 4 int32 elements (`_span_words` zeroes the other three)
_PACK_WORD = "mov.b32 $0, $4;\nmov.b32 $1, $4;\nmov.b32 $2, $4;\nmov.b32 $3, $4;"


def layer_fits(layer, meta) -> bool:
    """A layout the kernels decode: NVFP4 (its e4m3 scales at an even address: the rows kernel reads a lane's two
    groups' as one 16-bit load, `_fp4_scales(ONE_LOAD)`; the one-row kernels would not need it, but one rule keeps
    a layer on one family of kernels), or int4 with bf16 scales (their pairs are the mma's operands) and groups of
    >= 32 weights (each lane's 16 bytes then lie in one group)."""
    return (meta.scheme == "nvfp4" and layer.scales.data_ptr() % 2 == 0) or (
        meta.scheme == "int4" and meta.group >= 32 and layer.scales.dtype == torch.bfloat16)


def applies(x: torch.Tensor, layer, meta, residual, norm_weight, gated: bool) -> GemvConfig | None:
    """The launch where these kernels take the call, else None: 1 to MAX_ROWS bf16 rows on a CUDA GPU, a layer they
    decode (`layer_fits`) of a width they measured faster on (`launch_config`), no bias and no norm fold
    (quant_linear's kernel keeps those); the residual add, or SwiGLU over [gate; up] (`gated`), is folded here."""
    if not (HAVE_TRITON and not INTERPRET and x.is_cuda and x.dtype == torch.bfloat16 and x.shape[0] >= 1
            and layer_fits(layer, meta) and layer.bias is None and norm_weight is None
            and (residual is None or (residual.is_contiguous() and not gated))):
        return None
    cfg = launch_config(meta, x.shape[0], gated)
    if cfg is not None and cfg.splits > 1 and not can_split(x):  # the counters come from an eager launch first
        cfg = _fit_k(replace(cfg, splits=1), meta.k)
    return cfg


if HAVE_TRITON:
    import triton
    import triton.language as tl

    from blockspec.kernels._triton import release_dependents, wait_for_inputs
    from blockspec.kernels.lane_order import lane_cols

    _E2M1_MMA_C = tl.constexpr(_E2M1_MMA)
    _INT4_MMA_C = tl.constexpr(_INT4_MMA)
    _SPAN_CONSTRAINTS_C = tl.constexpr(_SPAN_CONSTRAINTS)
    _PACK_WORD_C = tl.constexpr(_PACK_WORD)
    _FP4_BIAS = tl.constexpr(FP4_GLOBAL_BIAS)

    @triton.jit
    def _x_cols(kb, LANE: tl.constexpr):
        """The x pairs beside a span's weight bytes kb: the same columns, or (LANE: a layer stored in lane order,
        kernels/lane_order.py) their original columns."""
        if LANE:
            kb = lane_cols(kb, 8)
        return kb

    @triton.jit
    def _scale_pairs(sa, sb, BN: tl.constexpr):
        """The e4m3 scales of each lane's two 8-byte groups ([BN, 4] each) -> s * 2^100 as a bf16 pair beside
        every weight byte [BN, 64] int32 (exact: the fma that applies it leaves w * s * 2^-26)."""
        sf = tl.join(sa, sb).to(tl.float8e4nv, bitcast=True).to(tl.float32)  # [BN, 4, 2]
        top = (sf * 1.2676506002282294e30).to(tl.int32, bitcast=True) & -65536  # s * 2^100 as bf16, exact
        s2 = top | ((top >> 16) & 0xFFFF)
        return tl.reshape(tl.broadcast_to(s2[:, :, :, None], [BN, 4, 2, 8]), [BN, 64])

    @triton.jit
    def _fp4_scales(S, row_off, b0, mask=None, ONE_LOAD: tl.constexpr = False):
        """NVFP4: the e4m3 scales of each lane's two 8-byte groups (bytes b0 + 16 t + 8 h of its row), two [BN, 4]
        uint8 tensors; row_off [1, BN] is the rows' first scale. Loaded [t, row] and transposed, which gives the
        scales the lane layout of the weight tile (a [row, t] load would be laid out across the lanes the other way
        and converted through shared memory, a barrier a span). ONE_LOAD: one 16-bit load a pair (the groups are
        adjacent, at an even index: `layer_fits`; rows clamped by the caller, no mask), the rows kernel's: it made
        the 16-row qkv / gate|up 3% faster but the one-row o and gate|up 4-17% slower than two byte loads
        (bench/quant_gemv.py, H100, session 36)."""
        sp = S + row_off + (b0 // 8 + 2 * tl.arange(0, 4))[:, None]
        if ONE_LOAD:
            tl.static_assert(mask is None, "the 16-bit scale load reads clamped rows, without a mask")
            s16 = tl.load(sp.to(tl.pointer_type(tl.uint16)))
            sa = (s16 & 0xFF).to(tl.uint8)
            sb = (s16 >> 8).to(tl.uint8)
        elif mask is None:
            sa = tl.load(sp)
            sb = tl.load(sp + 1)
        else:
            sa = tl.load(sp, mask=mask, other=0)
            sb = tl.load(sp + 1, mask=mask, other=0)
        return tl.trans(sa), tl.trans(sb)

    @triton.jit
    def _int4_words(S, row_off, col0, mask, NG: tl.constexpr, G2: tl.constexpr):
        """int4: the scale|zero word (scale bits | zero << 16) of each lane's 16 bytes from byte col0 + 16 t of its
        row (one group: G2 >= 16 bytes a group), [BN, 4]; row_off [1, BN] is the rows' first word, col0 a scalar
        or [1, BN]. Loaded [t, row] and transposed, as the NVFP4 scales are (`_wide_span`)."""
        g = (col0 + 16 * tl.arange(0, 4)[:, None]) // G2
        if mask is None:  # rows clamped by the caller
            sz = tl.load(S + row_off + g)
        else:
            sz = tl.load(S + row_off + g, mask=mask, other=0)
        return tl.trans(sz)

    @triton.jit
    def _int4_pairs(sz, BN: tl.constexpr):
        """Each lane's int4 scale|zero words [BN, 4] -> the bf16 pairs s and -(128 + z) beside every weight byte
        [BN, 64] int32 (bf16 holds 128 + z exactly for z < 128: the bits 0x4300 + z)."""
        s = sz & 0xFFFF
        z = 0xC300 + ((sz >> 16) & 0xFF)
        s2 = tl.reshape(tl.broadcast_to((s | (s << 16))[:, :, None], [BN, 4, 16]), [BN, 64])
        z2 = tl.reshape(tl.broadcast_to((z | (z << 16))[:, :, None], [BN, 4, 16]), [BN, 64])
        return s2, z2

    @triton.jit
    def _span_words(w):
        """A span's weight bytes [BN, 64] (uint8, as loaded) -> int32 [BN, 64]: element 4 j holds the word of bytes
        4 j .. 4 j + 3, the other three are 0 (constants the compiler folds, so a loop carries one register a word)."""
        words = tl.inline_asm_elementwise(_PACK_WORD_C, "=r,=r,=r,=r,r", [w], dtype=tl.int32, is_pure=True, pack=4)
        return tl.where(tl.arange(0, 64)[None, :] % 4 == 0, words, 0)

    @triton.jit
    def _span_mma(acc1, acc2, w, xp, sa, sb, BN: tl.constexpr, INT4: tl.constexpr = False):
        """acc1, acc2 += the span's products (module docstring); w: the span's weight bytes [BN, 64] uint8; INT4:
        sa holds the lanes' scale|zero words."""
        if INT4:
            s2, z2 = _int4_pairs(sa, BN)
            acc1, acc2 = tl.inline_asm_elementwise(
                _INT4_MMA_C, _SPAN_CONSTRAINTS_C + ",r,r,r,r",
                [acc1, acc2, w, xp, s2, z2], dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
        else:
            acc1, acc2 = tl.inline_asm_elementwise(
                _E2M1_MMA_C, _SPAN_CONSTRAINTS_C,
                [acc1, acc2, w, xp, _scale_pairs(sa, sb, BN)], dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
        return acc1, acc2

    @triton.jit
    def _c_sums(acc1, acc2, BN: tl.constexpr):
        """The accumulators -> C [BN, t, c] of each lane (column 2 t + c of its 8-column block): element 4 i + c of
        a lane's 16 is C register c of its i-th group of 4 bytes; row g (c 0, 1) of acc1 and row g + 8 (c 2, 3)
        of acc2 hold the products, and the 4 groups are summed."""
        lo1, hi1 = tl.split(tl.permute(tl.reshape(acc1, [BN, 4, 4, 2, 2]), [0, 1, 2, 4, 3]))
        lo2, hi2 = tl.split(tl.permute(tl.reshape(acc2, [BN, 4, 4, 2, 2]), [0, 1, 2, 4, 3]))
        return tl.sum(lo1 + hi2, axis=2)

    @triton.jit
    def _with_residual(y, res_ptr, mask, HAS_RES: tl.constexpr):
        """y, or (HAS_RES) the residual at res_ptr plus y rounded as a separate in-place add rounds (y is
        already in the output dtype); the caller stores it back there."""
        if HAS_RES:
            y = (tl.load(res_ptr, mask=mask, other=0.0).to(tl.float32) + y.to(tl.float32)).to(y.dtype)
        return y

    @triton.jit
    def _wide_span(acc1, acc2, QW, x32, S, rows64, n_mask, b0, KB: tl.constexpr, NG: tl.constexpr,
                   BN: tl.constexpr, INT4: tl.constexpr = False, G2: tl.constexpr = 8, LANE: tl.constexpr = False):
        """acc1, acc2 += one 64-byte span of the rows (bytes b0 ..) against x (see the module docstring). n_mask
        None: every row is one to read (the caller points rows past N at a real one; a masked load zeroes its
        registers first, ~1 instruction a word)."""
        kb = tl.arange(0, 64)
        wp = QW + rows64[:, None] * KB + b0 + kb[None, :]
        if n_mask is None:
            w = tl.load(wp)
            row_mask = None
        else:
            w = tl.load(wp, mask=n_mask[:, None], other=0)
            row_mask = n_mask[None, :]
        xp = tl.load(x32 + b0 + _x_cols(kb, LANE))  # x as bf16 pairs, pair i beside weight byte i
        if INT4:
            sa = _int4_words(S, (rows64 * NG)[None, :], b0, row_mask, NG, G2)
            sb = sa
        else:
            sa, sb = _fp4_scales(S, (rows64 * NG)[None, :], b0, row_mask)
        return _span_mma(acc1, acc2, w, tl.broadcast_to(xp[None, :], w.shape), sa, sb, BN, INT4)

    @triton.jit
    def _tile_rows(pid, j, N, B: tl.constexpr, GATED: tl.constexpr):
        """The weight rows that program pid's tile rows j (of B) read, and which are live. GATED (N = 2I rows of
        [gate; up]): the first B / 2 tile rows read gate rows, the last B / 2 the up rows of the same outputs, so
        each warp streams 8 adjacent rows as it does without the fold (interleaving gate and up rows within a warp
        measured ~10% slower on NVFP4 gate|up, bench/quant_gemv.py --gated); `_gated_halves` pairs them."""
        if GATED:
            m = pid * (B // 2) + j % (B // 2)
            return m + (j // (B // 2)) * (N // 2), m < N // 2
        else:
            rows = pid * B + j
            return rows, rows < N

    @triton.jit
    def _gated_halves(y, B: tl.constexpr):
        """Sums y [B, 4, 2] (`_c_sums`) or [B] of tile rows -> (gate, up), each [B / 2, ...]: tile rows j and
        j + B / 2 (`_tile_rows`)."""
        if len(y.shape) == 3:
            return tl.split(tl.permute(tl.reshape(y, [2, B // 2, 4, 2]), [1, 2, 3, 0]))
        else:
            return tl.split(tl.permute(tl.reshape(y, [2, B // 2]), [1, 0]))

    @triton.jit
    def _silu_mul_rounded(gate, up, dtype: tl.constexpr):
        """SiLU(gate) * up from float32 sums: the F.linear outputs rounded to dtype, then silu_mul_ref's roundings."""
        g = gate.to(dtype).to(tl.float32)
        sg = (g / (1.0 + tl.exp(-g))).to(dtype)
        return (sg.to(tl.float32) * up.to(dtype).to(tl.float32)).to(dtype)

    @triton.jit
    def _sums_scaled(y, GS, INT4: tl.constexpr, HAS_GS: tl.constexpr):
        """Sums of the decoded weights -> the layer's: NVFP4 tiles hold w * 2^-26 (and a global scale applies)."""
        if not INT4:
            y = y * _FP4_BIAS
        if HAS_GS:
            y = y * tl.load(GS)
        return y

    @triton.jit
    def _wide_kernel(X, QW, S, GS, Y, N, K: tl.constexpr, HAS_GS: tl.constexpr, BN: tl.constexpr,
                     SPANS: tl.constexpr, HAS_RES: tl.constexpr = False, PDL: tl.constexpr = False,
                     INT4: tl.constexpr = False, G2: tl.constexpr = 8, GATED: tl.constexpr = False,
                     EARLY: tl.constexpr = False, LANE: tl.constexpr = False):
        """One K part (wide layers). Kept as first measured: the parts kernel at P = 1 (its loads written the
        same) compiled to another schedule, ~20% slower on gate|up (bench/quant_gemv.py, H100). INT4: S holds the
        scale|zero words, G2 bytes a group. GATED: SiLU(gate) * up to Y [1, N / 2] (`_tile_rows`). EARLY: dependents
        released right after the wait (as `_stream_kernel`'s), so that the streamed down projection after a one-wave
        gate|up loads its first weights during this launch's tail."""
        pid = tl.program_id(0)
        rows, n_mask = _tile_rows(pid, tl.arange(0, BN), N, BN, GATED)
        rows64 = tl.where(n_mask, rows, 0).to(tl.int64)  # rows past N read row 0; their sums are never stored
        KB: tl.constexpr = K // 2
        NG: tl.constexpr = K // (2 * G2)
        x32 = X.to(tl.pointer_type(tl.int32))
        acc1 = tl.zeros([BN, 64], dtype=tl.float32)
        acc2 = tl.zeros([BN, 64], dtype=tl.float32)
        wait_for_inputs(PDL)
        if EARLY:
            release_dependents(PDL)
        for b0 in range(0, KB, 64 * SPANS):
            for u in tl.static_range(SPANS):
                acc1, acc2 = _wide_span(acc1, acc2, QW, x32, S, rows64, None, b0 + 64 * u, KB, NG, BN, INT4, G2,
                                        LANE)
        y = _sums_scaled(_c_sums(acc1, acc2, BN), GS, INT4, HAS_GS)  # [BN, t, c]: tile column 2 t + c of the 8
        if not EARLY:
            release_dependents(PDL)
        if GATED:
            gate, up = _gated_halves(y, BN)  # [BN / 2, t, c]: output 2 t + c of the 8-row block
            r = tl.arange(0, BN // 2)[:, None, None]
            out = pid * (BN // 2) + (r // 8) * 8 + 2 * tl.arange(0, 4)[None, :, None] + tl.arange(0, 2)[None, None, :]
            keep = ((r % 8) == 0) & (out < N // 2)
            tl.store(Y + out, _silu_mul_rounded(gate, up, Y.dtype.element_ty), mask=keep)
        else:
            r = tl.arange(0, BN)[:, None, None]
            out = pid * BN + (r // 8) * 8 + 2 * tl.arange(0, 4)[None, :, None] + tl.arange(0, 2)[None, None, :]
            keep = ((r % 8) == 0) & (out < N)  # lanes g = 0 store
            tl.store(Y + out, _with_residual(y.to(Y.dtype.element_ty), Y + out, keep, HAS_RES), mask=keep)

    @triton.jit
    def _parts_columns(pid, N, BN: tl.constexpr, P: tl.constexpr, GATED: tl.constexpr):
        """Program pid's BN tile columns (column c: tile row c // P, K part c % P): the weight row each reads, its
        part and whether it is live (`_tile_rows`)."""
        cols = tl.arange(0, BN)
        rows, n_mask = _tile_rows(pid, cols // P, N, BN // P, GATED)
        return rows.to(tl.int64), (cols % P).to(tl.int64), n_mask

    @triton.jit
    def _span_bytes(QW, wrow, part, n_mask, b0, KB: tl.constexpr, P: tl.constexpr, live=None):
        """The weight bytes [BN, 64] of one 64-byte span (bytes b0 .. of each column's K part); none where not
        `live` (a scalar: the span lies in the part)."""
        kb = tl.arange(0, 64)
        KP: tl.constexpr = KB // P  # bytes a part
        ptrs = QW + wrow[:, None] * KB + (part * KP)[:, None] + b0 + kb[None, :]
        if n_mask is None:  # every column's row is one to read, and the span lies in the part (`_stream_kernel`)
            w = tl.load(ptrs)
        else:
            mask = n_mask[:, None]
            if live is not None:
                mask = mask & live
            w = tl.load(ptrs, mask=mask, other=0)
        return w

    @triton.jit
    def _span_x(x32, b0, KB: tl.constexpr, BN: tl.constexpr, P: tl.constexpr, live=None, LANE: tl.constexpr = False):
        """x as bf16 pairs beside the span's weight bytes [BN, 64] (pair i beside byte i), none where not `live`:
        loaded [P, 64] once and broadcast over the rows of each part. Triton moves that broadcast through shared
        memory (2 barriers a span); loading x straight in the tile's lane layout instead (each lane its own 16
        pairs, no barrier) measured 10-90% slower in every one-row kernel (bench/NOTES.md session 37)."""
        kb = _x_cols(tl.arange(0, 64), LANE)
        ptrs = x32 + (tl.arange(0, P) * (KB // P))[:, None] + b0 + kb[None, :]
        if live is None:
            xp = tl.load(ptrs)
        else:
            xp = tl.load(ptrs, mask=live, other=0)
        return tl.reshape(tl.broadcast_to(xp[None, :, :], [BN // P, P, 64]), [BN, 64])

    @triton.jit
    def _span_scales(S, wrow, part, n_mask, b0, KB: tl.constexpr, NG: tl.constexpr, P: tl.constexpr,
                     INT4: tl.constexpr, G2: tl.constexpr, live=None):
        """The scales of each lane's 16 bytes of the span, two [BN, 4] tensors: NVFP4 the e4m3 scales of its two
        8-byte groups (bytes 16 t + 8 h), int4 its scale|zero word (twice); none where not `live`."""
        KP: tl.constexpr = KB // P
        mask = None  # n_mask None: as `_span_bytes`
        if n_mask is not None:
            mask = n_mask[None, :]
            if live is not None:
                mask = mask & live
        if INT4:
            sa = _int4_words(S, (wrow * NG)[None, :], (part * KP)[None, :] + b0, mask, NG, G2)
            sb = sa
        else:
            sa, sb = _fp4_scales(S, (wrow * NG + part * (NG // P))[None, :], b0, mask)
        return sa, sb

    @triton.jit
    def _span_loads(QW, x32, S, wrow, part, n_mask, b0, KB: tl.constexpr, NG: tl.constexpr, BN: tl.constexpr,
                    P: tl.constexpr, INT4: tl.constexpr = False, G2: tl.constexpr = 8, LANE: tl.constexpr = False):
        """What one 64-byte span (bytes b0 .. of each column's K part) reads: the weight bytes, x beside them and
        the scales, in that order (the parts kernel's launches were timed so). Nothing past the part's end is
        read (b0 may be one span beyond)."""
        live = b0 < KB // P
        w = _span_bytes(QW, wrow, part, n_mask, b0, KB, P, live)
        xp = _span_x(x32, b0, KB, BN, P, live, LANE)
        sa, sb = _span_scales(S, wrow, part, n_mask, b0, KB, NG, P, INT4, G2, live)
        return w, xp, sa, sb

    @triton.jit
    def _span_weights(QW, S, wrow, part, n_mask, b0, KB: tl.constexpr, NG: tl.constexpr, P: tl.constexpr,
                      INT4: tl.constexpr, G2: tl.constexpr):
        """One span's weight bytes and scales, never past a part's end: only the layer, which no kernel of a
        step writes, so a kernel may load them before its PDL wait."""
        w = _span_bytes(QW, wrow, part, n_mask, b0, KB, P)
        sa, sb = _span_scales(S, wrow, part, n_mask, b0, KB, NG, P, INT4, G2)
        return w, sa, sb

    @triton.jit
    def _span_ahead(QW, S, wrow, part, n_mask, b0, KB: tl.constexpr, NG: tl.constexpr, P: tl.constexpr,
                    SPANS: tl.constexpr, INT4: tl.constexpr, G2: tl.constexpr):
        """The weights of the SPANS spans of a step from byte b0 (`_span_weights`), a tuple a span."""
        ring = ()
        for u in tl.static_range(SPANS):
            ring = ring + (_span_weights(QW, S, wrow, part, n_mask, b0 + 64 * u, KB, NG, P, INT4, G2),)
        return ring

    @triton.jit
    def _parts_kernel(X, QW, S, GS, Y, N, K: tl.constexpr, HAS_GS: tl.constexpr, BN: tl.constexpr,
                      SPANS: tl.constexpr, P: tl.constexpr, HAS_RES: tl.constexpr = False, PDL: tl.constexpr = False,
                      INT4: tl.constexpr = False, G2: tl.constexpr = 8, GATED: tl.constexpr = False,
                      LANE: tl.constexpr = False):
        # BN tile columns = BN / P tile rows x P parts of K (column c: tile row c // P, part c % P); P divides 8,
        # so the 8 columns of a warp's mma hold whole rows and part(g) = g % P. `_tile_rows` maps tile rows to
        # weight rows (GATED: gate rows, then the up rows)
        pid = tl.program_id(0)
        wrow, part, n_mask = _parts_columns(pid, N, BN, P, GATED)
        KB: tl.constexpr = K // 2
        NG: tl.constexpr = K // (2 * G2)
        x32 = X.to(tl.pointer_type(tl.int32))
        acc1 = tl.zeros([BN, 64], dtype=tl.float32)
        acc2 = tl.zeros([BN, 64], dtype=tl.float32)
        wait_for_inputs(PDL)
        # software-pipelined by one span: the next span's loads are issued before this one's mma
        w, xp, sa, sb = _span_loads(QW, x32, S, wrow, part, n_mask, 0, KB, NG, BN, P, INT4, G2, LANE)
        for b0 in range(0, KB // P, 64 * SPANS):
            for u in tl.static_range(SPANS):
                nw, nxp, nsa, nsb = _span_loads(QW, x32, S, wrow, part, n_mask, b0 + 64 * (u + 1), KB, NG, BN, P,
                                                INT4, G2, LANE)
                acc1, acc2 = _span_mma(acc1, acc2, w, xp, sa, sb, BN, INT4)
                w, xp, sa, sb = nw, nxp, nsa, nsb
        y = _parts_sums(acc1, acc2, GS, BN, P, INT4, HAS_GS)
        release_dependents(PDL)
        _parts_store(y, Y, pid, N, BN, P, HAS_RES, GATED)

    @triton.jit
    def _parts_sums(acc1, acc2, GS, BN: tl.constexpr, P: tl.constexpr, INT4: tl.constexpr, HAS_GS: tl.constexpr):
        """The accumulators of BN tile columns (tile row c // P, K part c % P) -> each tile row's sum [BN / 8,
        8 / P], scaled."""
        y = _c_sums(acc1, acc2, BN)  # [BN, t, e]: C[g][n] with g = c % 8 and n = 2 t + e of c's 8-column block
        # C[g][n] used x of part g % P: right where that is n's part, n % P; keep g = n % P, sum n's P parts
        y = tl.reshape(y, [BN // 8, 8, 8])  # [block, g, n]
        gi = tl.arange(0, 8)[None, :, None]
        ni = tl.arange(0, 8)[None, None, :]
        y = tl.sum(tl.where(gi == ni % P, y, 0.0), axis=1)  # [block, n]
        y = tl.sum(tl.reshape(y, [BN // 8, 8 // P, P]), axis=2)  # [block, tile row of the block]
        return _sums_scaled(y, GS, INT4, HAS_GS)

    @triton.jit
    def _parts_store(y, Y, pid, N, BN: tl.constexpr, P: tl.constexpr, HAS_RES: tl.constexpr, GATED: tl.constexpr):
        """Program pid's tile row sums (`_parts_sums`) -> Y: SwiGLU of its gate and up rows (GATED), or the
        outputs, added into the residual in Y (HAS_RES)."""
        if GATED:
            gate, up = _gated_halves(tl.reshape(y, [BN // P]), BN // P)
            out = pid * (BN // P // 2) + tl.arange(0, BN // P // 2)
            tl.store(Y + out, _silu_mul_rounded(gate, up, Y.dtype.element_ty), mask=out < N // 2)
        else:
            out = pid * (BN // P) + tl.arange(0, BN // 8)[:, None] * (8 // P) + tl.arange(0, 8 // P)[None, :]
            tl.store(Y + out, _with_residual(y.to(Y.dtype.element_ty), Y + out, out < N, HAS_RES), mask=out < N)

    @triton.jit
    def _stream_kernel(X, QW, S, GS, Y, N, K: tl.constexpr, HAS_GS: tl.constexpr, BN: tl.constexpr,
                       SPANS: tl.constexpr, P: tl.constexpr, HAS_RES: tl.constexpr = False, PDL: tl.constexpr = False,
                       INT4: tl.constexpr = False, G2: tl.constexpr = 8, GATED: tl.constexpr = False,
                       EARLY: tl.constexpr = False, LANE: tl.constexpr = False):
        # The parts kernel's tiles and sums, its weights streamed a step of SPANS spans ahead: each step issues the
        # next step's weight loads before its own mmas (SPANS x 16 bytes a lane in flight, x read from L1 beside
        # each span), and the first step's are issued before the PDL wait, while the kernel before this one still
        # runs (bench/pdl_preload.py: a read-only launch chained so reached 90-98% of copy bandwidth on an H200
        # against 57-82% loading after the wait). EARLY: dependents released right after the wait (a launch of
        # one wave: theirs can then load their weights during this one) instead of before the stores.
        pid = tl.program_id(0)
        wrow, part, n_mask = _parts_columns(pid, N, BN, P, GATED)
        wrow = tl.where(n_mask, wrow, 0)  # rows past N read row 0 without masks; their sums are never stored
        KB: tl.constexpr = K // 2
        NG: tl.constexpr = K // (2 * G2)
        STEP: tl.constexpr = 64 * SPANS
        LAST: tl.constexpr = KB // P - STEP  # the last step's first byte
        ring = _span_ahead(QW, S, wrow, part, None, 0, KB, NG, P, SPANS, INT4, G2)
        wait_for_inputs(PDL)
        if EARLY:
            release_dependents(PDL)
        x32 = X.to(tl.pointer_type(tl.int32))
        acc1 = tl.zeros([BN, 64], dtype=tl.float32)
        acc2 = tl.zeros([BN, 64], dtype=tl.float32)
        for b0 in range(0, LAST, STEP):
            ahead = ()  # each span's next-step load beside its mma (all first: more registers, unmeasured)
            for u in tl.static_range(SPANS):
                ahead = ahead + (_span_weights(QW, S, wrow, part, None, b0 + STEP + 64 * u, KB, NG, P, INT4, G2),)
                w, sa, sb = ring[u]
                xp = _span_x(x32, b0 + 64 * u, KB, BN, P, None, LANE)
                acc1, acc2 = _span_mma(acc1, acc2, w, xp, sa, sb, BN, INT4)
            ring = ahead
        for u in tl.static_range(SPANS):
            w, sa, sb = ring[u]
            acc1, acc2 = _span_mma(acc1, acc2, w, _span_x(x32, LAST + 64 * u, KB, BN, P, None, LANE), sa, sb, BN, INT4)
        y = _parts_sums(acc1, acc2, GS, BN, P, INT4, HAS_GS)
        if not EARLY:
            release_dependents(PDL)
        _parts_store(y, Y, pid, N, BN, P, HAS_RES, GATED)


def launch_grid(cfg: GemvConfig, m: int, n: int) -> tuple[int, ...]:
    """The grid `gemv` launches for m rows of n outputs: the rows kernel's (row blocks, K splits), else the GEMV's
    (tiles over K parts,). bench/waves.py counts the programs from it."""
    if m > 1 or cfg.rows:
        return -(-n // (cfg.rows_block * cfg.groups)), cfg.splits
    return (-(-n * cfg.parts // cfg.block),)


def launch_kernel(cfg: GemvConfig, m: int) -> tuple:
    """The kernel `gemv` launches for cfg at m rows and the constexprs of its own beside the common ones: the rows
    kernel's (2-16 rows, or cfg.rows), else the streamed, one-part or parts GEMV. bench/waves.py compiles from it."""
    if m > 1 or cfg.rows:
        return _rows_kernel, dict(P=cfg.parts, TWO=m > 8, STREAM=cfg.stream, EARLY=cfg.early, R=cfg.groups,
                                  SPLITS=cfg.splits)
    if cfg.stream:
        return _stream_kernel, dict(P=cfg.parts, EARLY=cfg.early)
    if cfg.parts == 1:
        return _wide_kernel, dict(EARLY=cfg.early)
    return _parts_kernel, dict(P=cfg.parts)


def gemv(x: torch.Tensor, layer, meta, cfg: GemvConfig, residual: torch.Tensor | None = None, gated: bool = False
         ) -> torch.Tensor:
    """x [M, K] (bf16, contiguous, M <= MAX_ROWS) @ dequantize(layer).T -> [M, N] for an NVFP4 or int4 layer
    (`layer_fits`) with the launch `applies` gave (or a swept one: bench/quant_gemv.py; the kernels need K % (128
    parts spans) == 0); with `residual` ([M, N], contiguous) the result is added into it in place (rounded as a
    separate add) and returned; `gated`: SiLU(gate) * up of the output's [gate; up] halves, [M, N / 2], rounded
    as silu_mul_ref rounds. One row takes the GEMV (or, with cfg.rows, the rows kernel), 2 to 16 the rows kernel."""
    m = x.shape[0]
    if not 1 <= m <= MAX_ROWS or not _tiles_k(cfg, meta.k):
        raise ValueError(f"{m} rows of K = {meta.k} do not fit the mma kernels with {cfg}")
    if (cfg.groups > 1 or cfg.splits > 1) and m == 1 and not cfg.rows:
        raise ValueError(f"{cfg}: groups of weight rows and K splits are the rows kernel's (2 to {MAX_ROWS} rows, or "
                         "rows=True)")
    if gated and (residual is not None or meta.n % 2 or (m == 1 and not cfg.rows and (cfg.block // cfg.parts) % 2)):
        raise ValueError(f"SwiGLU over {meta.n} rows with {cfg} (and a residual: {residual is not None}) does not fit")
    y = residual if residual is not None else \
        torch.empty(m, meta.n // 2 if gated else meta.n, dtype=x.dtype, device=x.device)
    on = pdl(x)
    int4 = meta.scheme == "int4"
    if int4:
        from blockspec.kernels.quant_linear import kernel_operands  # (it imports this module)
        scales = kernel_operands(layer, meta)[2]  # the scale|zero words
    else:
        scales = layer.scales.view(torch.uint8)
    gs = layer.global_scale if meta.has_gs else x
    common = dict(K=meta.k, HAS_GS=meta.has_gs, BN=cfg.block, SPANS=cfg.spans, HAS_RES=residual is not None, PDL=on,
                  INT4=int4, G2=meta.group // 2 if int4 else 8, GATED=gated, LANE=getattr(layer, "lane_order", False),
                  num_warps=cfg.warps, num_stages=1, launch_pdl=on)
    grid = launch_grid(cfg, m, meta.n)
    kernel, own = launch_kernel(cfg, m)
    if kernel is _rows_kernel:
        programs = grid[0]
        ws, cnt, slots = y, y, 0  # (not read without a split)
        if cfg.splits > 1:
            if programs > ARRIVALS or not can_split(x):
                raise ValueError(f"{cfg}: {programs} programs a split (at most {ARRIVALS}), or a graph captured "
                                 "before an eager launch allocated the arrival counters")
            slots = programs * cfg.groups * cfg.rows_block
            ws = torch.empty(cfg.splits * 16 * slots, dtype=torch.float32, device=x.device)
            cnt = arrival_counters(x.device)
        kernel[grid](x, layer.qweight, scales, gs, y, m, meta.n, ws, cnt, slots, **own, **common)
    else:
        kernel[grid](x, layer.qweight, scales, gs, y, meta.n, **own, **common)
    return y


# ---------------------------------------------------------------------------------------------------------------
# 2 to 16 rows (a verify block, a few decode rows): the weights as the mma's A operand, the tokens as B


def _rows_mma_ptx(blocks: int, int4: bool = False) -> str:
    """The rows kernel's asm for `blocks` blocks of 8 tokens: decode the 4 bytes of weight row g ($wl) and of row
    g + 8 ($wh), scale them, and two mmas a block into its C registers. Operands: C of block b $4b..$4b+3 (out),
    then in: the C inputs (same order), wl and wh (4 registers each, the first read: the word of 4 bytes,
    `_span_words`), each block's 4 x pairs (pair e beside byte e), the lo and hi scale pairs (4 registers each,
    the first read); int4: then the lo and hi zero pairs -(128 + z) (likewise)."""
    nacc = 4 * blocks
    wl, wh = 2 * nacc, 2 * nacc + 4
    xs = wh + 4
    sl = xs + 4 * blocks
    sh = sl + 4
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    if int4:
        zl, zh = sh + 4, sh + 8
        body = [INT4_REGS, ".reg .b32 a<4>, b<4>;\n", int4_decode_ptx(f"${wl}", f"${zl}", f"${sl}", "a"),
                int4_decode_ptx(f"${wh}", f"${zh}", f"${sh}", "b")]
    else:
        body = [E2M1_REGS, ".reg .b32 a<4>, b<4>;\n", e2m1_decode_ptx(f"${wl}")]
        body += [f"fma.rn.bf16x2 a{i}, t{i}, ${sl}, nz;\n" for i in range(4)]
        body += [e2m1_decode_ptx(f"${wh}")]
        body += [f"fma.rn.bf16x2 b{i}, t{i}, ${sh}, nz;\n" for i in range(4)]
    for blk in range(blocks):
        d = ", ".join(f"${4 * blk + c}" for c in range(4))
        c_in = ", ".join(f"${nacc + 4 * blk + c}" for c in range(4))
        x = [f"${xs + 4 * blk + j}" for j in range(4)]
        # k pairs (2t, 2t + 8) of the first mma are bytes (0, 1), of the second (2, 3): B is two adjacent x
        # registers as loaded (a register pair, no moves)
        body.append(f"{mma} {{{d}}}, {{a0, b0, a1, b1}}, {{{x[0]}, {x[1]}}}, {{{c_in}}};\n")
        body.append(f"{mma} {{{d}}}, {{a2, b2, a3, b3}}, {{{x[2]}, {x[3]}}}, {{{d}}};\n")
    return "{\n" + "".join(body) + "}"


def _rows_constraints(blocks: int, int4: bool = False) -> str:
    return ",".join(["=r"] * (4 * blocks) + ["r"] * (4 * blocks + 8 + 4 * blocks + (16 if int4 else 8)))


if HAVE_TRITON:
    _ROWS_MMA1 = tl.constexpr(_rows_mma_ptx(1))
    _ROWS_MMA2 = tl.constexpr(_rows_mma_ptx(2))
    _ROWS_CONS1 = tl.constexpr(_rows_constraints(1))
    _ROWS_CONS2 = tl.constexpr(_rows_constraints(2))
    _ROWS_INT4_MMA1 = tl.constexpr(_rows_mma_ptx(1, True))
    _ROWS_INT4_MMA2 = tl.constexpr(_rows_mma_ptx(2, True))
    _ROWS_INT4_CONS1 = tl.constexpr(_rows_constraints(1, True))
    _ROWS_INT4_CONS2 = tl.constexpr(_rows_constraints(2, True))

    @triton.jit
    def _rows_bytes(QW, lo_row, hi_row, part, b0, KB: tl.constexpr, P: tl.constexpr):
        """The bytes of weight rows lo_row and hi_row in one 64-byte span (bytes b0 .. of each tile row's K part), as
        words (`_span_words`). No masks (a masked load zeroes its registers first: ~1 instruction a word): the
        caller clamps rows past N to the last, whose results it does not store."""
        KP: tl.constexpr = KB // P  # bytes a part
        col = (part * KP + b0)[:, None] + tl.arange(0, 64)[None, :]
        lo = tl.load(QW + lo_row[:, None] * KB + col)
        return _span_words(lo), _span_words(tl.load(QW + hi_row[:, None] * KB + col))

    @triton.jit
    def _rows_x(x32, tok, tok_b, part, b0, KB: tl.constexpr, P: tl.constexpr, TWO: tl.constexpr,
                LANE: tl.constexpr = False):
        """The x pairs beside the span's bytes (byte i of a row = x pair i of the token) of tokens tok and (TWO)
        tok_b, [BN, 64] each (tokens past M clamped by the caller)."""
        KP: tl.constexpr = KB // P
        col = (part * KP + b0)[:, None] + _x_cols(tl.arange(0, 64), LANE)[None, :]
        xa = tl.load(x32 + tok[:, None] * KB + col)
        if TWO:
            xb = tl.load(x32 + tok_b[:, None] * KB + col)
        else:
            xb = xa
        return xa, xb

    @triton.jit
    def _rows_scales(S, lo_row, hi_row, part, b0, KB: tl.constexpr, NG: tl.constexpr, P: tl.constexpr,
                     INT4: tl.constexpr, G2: tl.constexpr):
        """The scales of each lane's bytes of both rows, [BN, 4] each, loaded [t, row] and transposed (module
        docstring): NVFP4 the e4m3 scales of its two 8-byte groups (sla, slb of lo_row; sha, shb of hi_row), int4
        each row's scale|zero word (slb, shb unused)."""
        KP: tl.constexpr = KB // P
        if INT4:
            c0 = (part * KP)[None, :] + b0
            sla = _int4_words(S, (lo_row * NG)[None, :], c0, None, NG, G2)
            sha = _int4_words(S, (hi_row * NG)[None, :], c0, None, NG, G2)
            slb = sla
            shb = sha
        else:
            sla, slb = _fp4_scales(S, (lo_row * NG + part * (NG // P))[None, :], b0, ONE_LOAD=True)
            sha, shb = _fp4_scales(S, (hi_row * NG + part * (NG // P))[None, :], b0, ONE_LOAD=True)
        return sla, slb, sha, shb

    @triton.jit
    def _rows_loads(QW, x32, S, lo_row, hi_row, part, tok, tok_b, b0, KB: tl.constexpr, NG: tl.constexpr,
                    P: tl.constexpr, TWO: tl.constexpr, INT4: tl.constexpr = False, G2: tl.constexpr = 8,
                    LANE: tl.constexpr = False):
        """One 64-byte span: the rows' bytes, x beside them, the scales, in that order (the rows kernel's launches
        were timed so)."""
        wl, wh = _rows_bytes(QW, lo_row, hi_row, part, b0, KB, P)
        xa, xb = _rows_x(x32, tok, tok_b, part, b0, KB, P, TWO, LANE)
        sla, slb, sha, shb = _rows_scales(S, lo_row, hi_row, part, b0, KB, NG, P, INT4, G2)
        return wl, wh, xa, xb, sla, slb, sha, shb

    @triton.jit
    def _rows_weights(QW, S, lo_row, hi_row, part, b0, KB: tl.constexpr, NG: tl.constexpr, P: tl.constexpr,
                      INT4: tl.constexpr, G2: tl.constexpr):
        """One span's weight bytes and scales of both rows: only the layer, which no kernel of a step writes, so a
        kernel may load them before its PDL wait."""
        wl, wh = _rows_bytes(QW, lo_row, hi_row, part, b0, KB, P)
        sla, slb, sha, shb = _rows_scales(S, lo_row, hi_row, part, b0, KB, NG, P, INT4, G2)
        return wl, wh, sla, slb, sha, shb

    @triton.jit
    def _rows_mma(acc_a, acc_b, wl, wh, xa, xb, sla, slb, sha, shb, BN: tl.constexpr, TWO: tl.constexpr,
                  INT4: tl.constexpr = False):
        """acc_a (tokens 0-7), acc_b (8-15, with TWO) [BN, 64] += the span's products: the asm takes 4
        elements at a time, a weight word broadcast over them (the first register read) with its 4 x pairs.
        INT4: sla / sha are the rows' scale|zero words."""
        if INT4:
            sl, zl = _int4_pairs(sla, BN)
            sh, zh = _int4_pairs(sha, BN)
            if TWO:
                acc_a, acc_b = tl.inline_asm_elementwise(_ROWS_INT4_MMA2, _ROWS_INT4_CONS2,
                                                         [acc_a, acc_b, wl, wh, xa, xb, sl, sh, zl, zh],
                                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
            else:
                acc_a = tl.inline_asm_elementwise(_ROWS_INT4_MMA1, _ROWS_INT4_CONS1,
                                                  [acc_a, wl, wh, xa, sl, sh, zl, zh], dtype=tl.float32,
                                                  is_pure=True, pack=4)
        else:
            sl = _scale_pairs(sla, slb, BN)
            sh = _scale_pairs(sha, shb, BN)
            if TWO:
                acc_a, acc_b = tl.inline_asm_elementwise(_ROWS_MMA2, _ROWS_CONS2,
                                                         [acc_a, acc_b, wl, wh, xa, xb, sl, sh],
                                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
            else:
                acc_a = tl.inline_asm_elementwise(_ROWS_MMA1, _ROWS_CONS1, [acc_a, wl, wh, xa, sl, sh],
                                                  dtype=tl.float32, is_pure=True, pack=4)
        return acc_a, acc_b

    @triton.jit
    def _rows_span_loop(acc_a, acc_b, QW, x32, S, lo_row, hi_row, part, tok, tok_b, KB: tl.constexpr,
                        NG: tl.constexpr, BN: tl.constexpr, SPANS: tl.constexpr, P: tl.constexpr, TWO: tl.constexpr,
                        INT4: tl.constexpr = False, G2: tl.constexpr = 8, LANE: tl.constexpr = False):
        """acc_a, acc_b += the products of the tile rows' K parts: every span of weight rows lo_row / hi_row
        against x rows tok / tok_b (row indices into x32, KB words a row)."""
        for b0 in range(0, KB // P, 64 * SPANS):
            for u in tl.static_range(SPANS):
                wl, wh, xa, xb, sla, slb, sha, shb = _rows_loads(QW, x32, S, lo_row, hi_row, part, tok, tok_b,
                                                                 b0 + 64 * u, KB, NG, P, TWO, INT4, G2, LANE)
                acc_a, acc_b = _rows_mma(acc_a, acc_b, wl, wh, xa, xb, sla, slb, sha, shb, BN, TWO, INT4)
        return acc_a, acc_b

    @triton.jit
    def _rows_sums(acc, GS, BN: tl.constexpr, P: tl.constexpr, HAS_GS: tl.constexpr, INT4: tl.constexpr = False):
        """One block's C registers -> the sums [group, g, t, hi, e] of weight row g + 8 hi of the program's 16-row
        group and token 2 t + e: element (r, 16 t + 4 j + c) of acc is C register c of the lane's j-th 4 bytes
        (hi = c // 2, e = c % 2); the 4 groups of bytes and the P parts (warps) of a row are summed."""
        RG: tl.constexpr = BN // 8 // P  # groups of 16 weight rows a program
        y = tl.sum(tl.reshape(acc, [RG, P, 8, 4, 4, 2, 2]), axis=4)  # [group, part, g, t, hi, e]
        return _sums_scaled(tl.sum(y, axis=1), GS, INT4, HAS_GS)

    @triton.jit
    def _rows_block(acc, GS, blk, j0, dtype: tl.constexpr, BN: tl.constexpr, P: tl.constexpr,
                    HAS_GS: tl.constexpr, INT4: tl.constexpr, GATED: tl.constexpr):
        """One block's C registers -> (values in dtype, output column, token) of program blk's 16-row groups and
        the block's tokens j0 + 2 t + e (`_rows_values`). What the dense and the MoE rows kernels store."""
        return _rows_values(_rows_sums(acc, GS, BN, P, HAS_GS, INT4), blk, j0, dtype, BN, P, GATED)

    @triton.jit
    def _rows_values(y, blk, j0, dtype: tl.constexpr, BN: tl.constexpr, P: tl.constexpr, GATED: tl.constexpr):
        """A block's sums y [group, g, t, hi, e] -> (values in dtype, output column, token): GATED, SiLU(gate) * up
        [group, g, t, e] of output (blk RG + group) 8 + g (a group's lo rows are the gate rows, its hi rows the up
        rows); else the sums of weight row (blk RG + group) 16 + g + 8 hi, tokens j0 + 2 t + e."""
        RG: tl.constexpr = BN // 8 // P
        gi = tl.arange(0, RG)[:, None, None, None]
        g = tl.arange(0, 8)[None, :, None, None]
        j = j0 + 2 * tl.arange(0, 4)[None, None, :, None] + tl.arange(0, 2)[None, None, None, :]  # [1, 1, t, e]
        if GATED:
            gate, up = tl.split(tl.permute(y, [0, 1, 2, 4, 3]))  # [group, g, t, e]
            return _silu_mul_rounded(gate, up, dtype), (blk * RG + gi) * 8 + g, j
        else:
            row = (blk * RG + gi[:, :, :, :, None]) * 16 + g[:, :, :, :, None] + \
                8 * tl.arange(0, 2)[None, None, None, :, None]
            return y.to(dtype), row, j[:, :, :, None, :]

    @triton.jit
    def _rows_store(acc, Y, GS, pid, tok0, M, N, BN: tl.constexpr, P: tl.constexpr, HAS_GS: tl.constexpr,
                    HAS_RES: tl.constexpr, INT4: tl.constexpr, GATED: tl.constexpr):
        """One block's C registers -> y [M, N] (tokens tok0 ..); GATED: SiLU(gate) * up -> [M, N / 2]."""
        _rows_put(_rows_sums(acc, GS, BN, P, HAS_GS, INT4), Y, pid, tok0, M, N, BN, P, HAS_RES, GATED)

    @triton.jit
    def _rows_put(y, Y, pid, tok0, M, N, BN: tl.constexpr, P: tl.constexpr, HAS_RES: tl.constexpr,
                  GATED: tl.constexpr):
        """One block's sums y [group, g, t, hi, e] -> y [M, N] (`_rows_values`), the residual added."""
        vals, out, tok = _rows_values(y, pid, tok0, Y.dtype.element_ty, BN, P, GATED)
        if GATED:
            tl.store(Y + tok * (N // 2) + out, vals, mask=(out < N // 2) & (tok < M))
        else:
            ptr = Y + tok * N + out
            keep = (out < N) & (tok < M)
            tl.store(ptr, _with_residual(vals, ptr, keep, HAS_RES), mask=keep)

    @triton.jit
    def _split_sums(WS, split, blk, j0, NP, BN: tl.constexpr, P: tl.constexpr):
        """Where a block's sums [group, g, t, hi, e] of K split `split` live in the workspace WS [splits, 16, NP]
        (float32): token j0 + 2 t + e, the program-local slot (blk RG + group) 16 + g + 8 hi of each weight row."""
        RG: tl.constexpr = BN // 8 // P
        gi = tl.arange(0, RG)[:, None, None, None, None]
        g = tl.arange(0, 8)[None, :, None, None, None]
        t = tl.arange(0, 4)[None, None, :, None, None]
        hi = tl.arange(0, 2)[None, None, None, :, None]
        e = tl.arange(0, 2)[None, None, None, None, :]
        return WS + (split * 16 + j0 + 2 * t + e) * NP + (blk * RG + gi) * 16 + g + 8 * hi

    @triton.jit
    def _block_rows(blk, w, g, N, BN: tl.constexpr, P: tl.constexpr, GATED: tl.constexpr):
        """The weight rows (lo, hi) of each tile row of block blk (its 16-row groups: `_rows_kernel`); rows past N
        read the last ones: computed, never stored."""
        if GATED:
            lo_row = tl.minimum(blk * (8 * (BN // 8 // P)) + (w // P) * 8 + g, N // 2 - 1).to(tl.int64)
            hi_row = lo_row + N // 2
        else:
            wrow = blk * (16 * (BN // 8 // P)) + (w // P) * 16 + g
            lo_row = tl.minimum(wrow, N - 1).to(tl.int64)
            hi_row = tl.minimum(wrow + 8, N - 1).to(tl.int64)
        return lo_row, hi_row

    @triton.jit
    def _groups_ahead(QW, S, rows, part, b0, KB: tl.constexpr, NG: tl.constexpr, P: tl.constexpr,
                      SPANS: tl.constexpr, INT4: tl.constexpr, G2: tl.constexpr, R: tl.constexpr):
        """The weights of the SPANS spans of a step from byte b0 for each of the R blocks' rows, a tuple indexed
        span * R + block."""
        ring = ()
        for u in tl.static_range(SPANS):
            for i in tl.static_range(R):
                lo_row, hi_row = rows[i]
                ring = ring + (_rows_weights(QW, S, lo_row, hi_row, part, b0 + 64 * u, KB, NG, P, INT4, G2),)
        return ring

    @triton.jit
    def _groups_step(accs, ring, x32, part, tok, tok_b, b0, KB: tl.constexpr, BN: tl.constexpr,
                     SPANS: tl.constexpr, P: tl.constexpr, TWO: tl.constexpr, INT4: tl.constexpr, R: tl.constexpr,
                     LANE: tl.constexpr = False):
        """One step's products for R blocks (`_groups_ahead`'s weights): each span's x loaded once, its registers
        the mma's B operand for every block."""
        for u in tl.static_range(SPANS):
            xa, xb = _rows_x(x32, tok, tok_b, part, b0 + 64 * u, KB, P, TWO, LANE)
            new = ()
            for i in tl.static_range(R):
                wl, wh, sla, slb, sha, shb = ring[u * R + i]
                acc_a, acc_b = accs[i]
                new = new + (_rows_mma(acc_a, acc_b, wl, wh, xa, xb, sla, slb, sha, shb, BN, TWO, INT4),)
            accs = new
        return accs

    @triton.jit
    def _groups_loop(accs, ring, QW, x32, S, rows, part, tok, tok_b, KB: tl.constexpr, NG: tl.constexpr,
                     BN: tl.constexpr, SPANS: tl.constexpr, P: tl.constexpr, TWO: tl.constexpr, INT4: tl.constexpr,
                     G2: tl.constexpr, R: tl.constexpr, STREAM: tl.constexpr, LANE: tl.constexpr = False):
        """accs (a tuple of R (acc_a, acc_b)) += the R blocks' products over the K part. STREAM: `ring` holds the
        first step's weights (loaded before the PDL wait) and each step issues the next step's before its mmas;
        else each step loads its own, all its weights before its x and mmas."""
        STEP: tl.constexpr = 64 * SPANS
        LAST: tl.constexpr = KB // P - STEP  # the last step's first byte
        if STREAM:
            for b0 in range(0, LAST, STEP):
                ahead = _groups_ahead(QW, S, rows, part, b0 + STEP, KB, NG, P, SPANS, INT4, G2, R)
                accs = _groups_step(accs, ring, x32, part, tok, tok_b, b0, KB, BN, SPANS, P, TWO, INT4, R, LANE)
                ring = ahead
            accs = _groups_step(accs, ring, x32, part, tok, tok_b, LAST, KB, BN, SPANS, P, TWO, INT4, R, LANE)
        else:
            for b0 in range(0, KB // P, STEP):
                step = _groups_ahead(QW, S, rows, part, b0, KB, NG, P, SPANS, INT4, G2, R)
                accs = _groups_step(accs, step, x32, part, tok, tok_b, b0, KB, BN, SPANS, P, TWO, INT4, R, LANE)
        return accs

    @triton.jit
    def _rows_kernel(X, QW, S, GS, Y, M, N, WS, CNT, NP, K: tl.constexpr, HAS_GS: tl.constexpr, BN: tl.constexpr,
                     SPANS: tl.constexpr, P: tl.constexpr, TWO: tl.constexpr, HAS_RES: tl.constexpr = False,
                     PDL: tl.constexpr = False, INT4: tl.constexpr = False, G2: tl.constexpr = 8,
                     GATED: tl.constexpr = False, STREAM: tl.constexpr = False, EARLY: tl.constexpr = False,
                     R: tl.constexpr = 1, SPLITS: tl.constexpr = 1, LANE: tl.constexpr = False):
        # tile row r = 8 w + g (warp w, lane row g) reads K part w % P of the weight rows 16 (w // P) + g (lo) and
        # + 8 (hi) of the block's, and x of token g (and g + 8). GATED (N = 2I rows of [gate; up]): the 16-row
        # group j holds the gate rows of outputs 8 j .. 8 j + 7 as its lo rows and their up rows as its hi rows.
        # STREAM: the weights a step ahead, the first step's loaded before the PDL wait (`_stream_kernel`'s way);
        # EARLY: the dependents released right after the wait. R > 1: the program runs R blocks (pid R ..), each
        # span's x loaded once for all of them (x is 4 bytes a weight byte at 16 rows: NOTES session 29).
        # SPLITS > 1: program (pid, s) takes the K parts s P .. s P + P - 1 of SPLITS P (K split over programs as
        # over warps), stores its float32 sums to WS [SPLITS, 16, NP] and counts its arrival (CNT[pid]); the last
        # to arrive adds the SPLITS sums in split order (deterministic whoever it is), resets CNT[pid] to 0 and
        # stores (skinny_linear's split K): more programs for a narrow layer whose blocks are wide enough to
        # share their x reads.
        pid = tl.program_id(0)
        r = tl.arange(0, BN)
        w = r // 8
        g = r % 8
        PK: tl.constexpr = P * SPLITS  # the K parts of a row over the program's warps and the splits
        split = 0
        if SPLITS > 1:
            split = tl.program_id(1)
        part = (split * P + w % P).to(tl.int64)
        KB: tl.constexpr = K // 2
        NG: tl.constexpr = K // (2 * G2)
        x32 = X.to(tl.pointer_type(tl.int32))
        rows = ()
        accs = ()
        for i in tl.static_range(R):
            rows = rows + (_block_rows(pid * R + i, w, g, N, BN, P, GATED),)
            accs = accs + ((tl.zeros([BN, 64], dtype=tl.float32), tl.zeros([BN, 64], dtype=tl.float32)),)
        ring = ()
        if STREAM:
            ring = _groups_ahead(QW, S, rows, part, 0, KB, NG, PK, SPANS, INT4, G2, R)
        wait_for_inputs(PDL)
        if EARLY:
            release_dependents(PDL)
        tok = tl.minimum(g, M - 1)
        tok_b = tl.minimum(g + 8, M - 1)
        if R == 1 and not STREAM:  # a span's bytes, x, scales, then its mmas: the order these launches were timed in
            lo_row, hi_row = rows[0]
            acc_a, acc_b = accs[0]
            accs = (_rows_span_loop(acc_a, acc_b, QW, x32, S, lo_row, hi_row, part, tok, tok_b, KB, NG, BN, SPANS,
                                    PK, TWO, INT4, G2, LANE),)
        else:
            accs = _groups_loop(accs, ring, QW, x32, S, rows, part, tok, tok_b, KB, NG, BN, SPANS, PK, TWO, INT4, G2,
                                R, STREAM, LANE)
        if not EARLY:
            release_dependents(PDL)
        for i in tl.static_range(R):  # the blocks' token halves: stored, or (SPLITS) their sums to the workspace
            for half in tl.static_range(2 if TWO else 1):
                if SPLITS == 1:
                    _rows_store(accs[i][half], Y, GS, pid * R + i, 8 * half, M, N, BN, P, HAS_GS, HAS_RES, INT4,
                                GATED)
                else:
                    tl.store(_split_sums(WS, split, pid * R + i, 8 * half, NP, BN, P),
                             _rows_sums(accs[i][half], GS, BN, P, HAS_GS, INT4))
        if SPLITS > 1:
            tl.debug_barrier()  # every thread's sums stored before the arrival is counted (release, gpu scope)
            if tl.atomic_add(CNT + pid, 1, sem="acq_rel") != SPLITS - 1:
                return
            for i in tl.static_range(R):
                for half in tl.static_range(2 if TWO else 1):
                    y = tl.load(_split_sums(WS, 0, pid * R + i, 8 * half, NP, BN, P), cache_modifier=".cg")
                    for s in tl.static_range(1, SPLITS):  # split order, whoever arrived last
                        y += tl.load(_split_sums(WS, s, pid * R + i, 8 * half, NP, BN, P), cache_modifier=".cg")
                    _rows_put(y, Y, pid * R + i, 8 * half, M, N, BN, P, HAS_RES, GATED)
            tl.atomic_xchg(CNT + pid, 0)  # ready for the next launch


# ---------------------------------------------------------------------------------------------------------------
# A quantized shared expert read as expert id E by the MoE kernels below


@dataclass(frozen=True)
class Nvfp4Shared:
    """A quantized shared expert (Qwen3-Next, Qwen3.5/3.6-MoE) read by the one-token and the rows kernels as expert
    id E, which every token picks in its last slot: its fused [gate; up] and its down projection
    (models.layers.quant_linear.QuantLinear), laid out as one routed expert's slices are (`shared_fits`)."""

    gate_up: object
    down: object


def shared_fits(shared: Nvfp4Shared, gate_up, down) -> bool:
    """Whether the shared expert's layers hold the routed experts' NVFP4 layout (QuantOperand gate_up / down):
    their shapes, group size, a global scale where they have one, contiguous, no act-order permutation and not in
    the dense kernels' lane order (kernels/lane_order.py: the loader leaves shared experts out of it)."""
    def fits(layer, w) -> bool:
        return (getattr(layer, "scheme", None) == "nvfp4" and layer.group_size == w.meta.group
                and (layer.out_features, layer.in_features) == (w.n, w.k) and getattr(layer, "perm", None) is None
                and not getattr(layer, "lane_order", False)
                and getattr(layer, "bias", None) is None and (layer.global_scale is not None) == w.meta.has_gs
                and layer.qweight.is_contiguous() and layer.scales.is_contiguous()
                and layer.qweight.device == w.qweight.device and _shared_offsets(w, layer) is not None)

    return fits(shared.gate_up, gate_up) and fits(shared.down, down)


def _shared_offsets(w, layer) -> tuple[int, int, int] | None:
    """From the stacked expert tensors (QuantOperand w) to a shared expert layer's weights and scales (in 16
    bytes) and global scale (in elements), which the kernels read as expert E; None where they do not divide
    so."""
    def off(a: torch.Tensor, b: torch.Tensor, unit: int) -> int | None:
        delta = b.data_ptr() - a.data_ptr()
        return None if delta % unit else delta // unit

    offs = (off(w.qweight, layer.qweight, 16), off(w.scales, layer.scales, 16),
            off(w.global_scale, layer.global_scale, 4) if w.global_scale is not None else 0)
    return None if None in offs else offs


def _shared_ok(shared, gate_up, down) -> bool:
    """No shared expert to fold in, or an `Nvfp4Shared` in the experts' layout (`shared_fits`)."""
    return shared is None or (isinstance(shared, Nvfp4Shared) and shared_fits(shared, gate_up, down))


def _offset_args(w, shared_layer) -> tuple[int, int, int]:
    """The kernels' SQW_OFF16, SS_OFF16, SGS_OFF for `shared_layer` (None: no shared expert, zeros)."""
    offsets = (0, 0, 0) if shared_layer is None else _shared_offsets(w, shared_layer)
    if offsets is None:
        raise ValueError("the shared expert's tensors are not 16-byte aligned to the experts' (see shared_fits)")
    return offsets


if HAVE_TRITON:
    @triton.jit
    def _expert_offsets(e, W_STRIDE: tl.constexpr, S_STRIDE: tl.constexpr, SQW_OFF16, SS_OFF16, SGS_OFF,
                        SHARED: tl.constexpr, E: tl.constexpr):
        """Expert e's weights, scales (bytes after the stacked tensors' starts) and global scale (elements);
        SHARED: expert id E is the shared expert, its tensors 16 SQW_OFF16 / 16 SS_OFF16 bytes and SGS_OFF
        elements away (multiples of 16 keep the weight loads 16-byte vectors: an offset of unknown alignment
        made them byte loads, 134 registers a thread instead of 71)."""
        w_off = e * W_STRIDE
        s_off = e * S_STRIDE
        gs_off = e
        if SHARED:
            is_shared = e == E
            # in 64 bits before the multiply: an offset that fits 32 bits (and is passed so) need not times 16
            w_off = tl.where(is_shared, SQW_OFF16.to(tl.int64) * 16, w_off)
            s_off = tl.where(is_shared, SS_OFF16.to(tl.int64) * 16, s_off)
            gs_off = tl.where(is_shared, SGS_OFF.to(tl.int64), gs_off)
        return w_off, s_off, gs_off


# ---------------------------------------------------------------------------------------------------------------
# One token through NVFP4 experts: the wide kernel over each routed expert's stacked weight


def moe_applies(x: torch.Tensor, gate_up, down, shared, biases: bool, clamped: bool) -> bool:
    """One bf16 token on a CUDA GPU through NVFP4 experts (kernels/moe_grouped.QuantOperand with the PTX
    unpacker) whose widths fill whole spans, with no biases or clamped activation, and no shared expert folded in
    or an `Nvfp4Shared` that `shared_fits` (the grouped kernels keep the rest)."""
    return (HAVE_TRITON and not INTERPRET and x.is_cuda and x.dtype == torch.bfloat16 and x.shape[0] == 1
            and MOE_ROWS_MIN_TOKENS > 1 and not (biases or clamped)
            and all(getattr(w, "meta", None) is not None and w.meta.scheme == "nvfp4" and w.fast
                    and w.k % (2 * SPAN_BYTES) == 0 for w in (gate_up, down))
            and _shared_ok(shared, gate_up, down))


def _moe_spans(k: int) -> int:
    """The wide kernel's spans a step for experts of width K (moe_applies: K whole spans)."""
    return _fit_k(WIDE, k).spans


if HAVE_TRITON:
    @triton.jit
    def _moe_kernel(X, IDS, QW, S, GS, SQW_OFF16, SS_OFF16, SGS_OFF, OUT, N_W: tl.constexpr, K: tl.constexpr,
                    W_STRIDE: tl.constexpr, S_STRIDE: tl.constexpr, TOP_K: tl.constexpr, E: tl.constexpr,
                    SHARED: tl.constexpr, HAS_GS: tl.constexpr, GATED: tl.constexpr, X_PER_SLOT: tl.constexpr,
                    BN: tl.constexpr, SPANS: tl.constexpr, PDL: tl.constexpr = False):
        """Program (slot, block): BN rows of the slot's expert (IDS[slot]; SHARED: slot TOP_K is the shared
        expert, id E, see `_expert_offsets`) against x (X, or row `slot` of X with X_PER_SLOT). GATED (gate|up,
        N_W = 2I rows): tile column c reads gate row c // 2 (c even) or up row I + c // 2 (c odd), so a lane's
        two C registers are one output's gate and up, and it writes SiLU(gate) * up to OUT [slots, I], rounded
        as silu_mul_ref; else OUT [slots, N_W]."""
        slot = tl.program_id(0)
        blk = tl.program_id(1)
        wait_for_inputs(PDL)  # before the expert id: the routing launch just before writes IDS
        if SHARED:
            e = tl.where(slot < TOP_K, tl.load(IDS + tl.minimum(slot, TOP_K - 1)), E).to(tl.int64)
        else:
            e = tl.load(IDS + slot).to(tl.int64)
        w_off, s_off, gs_off = _expert_offsets(e, W_STRIDE, S_STRIDE, SQW_OFF16, SS_OFF16, SGS_OFF, SHARED, E)
        cols = tl.arange(0, BN)
        if GATED:
            HALF: tl.constexpr = N_W // 2  # I
            m = blk * (BN // 2) + cols // 2
            n_mask = m < HALF
            rows = m + (cols % 2) * HALF
        else:
            rows = blk * BN + cols
            n_mask = rows < N_W
        KB: tl.constexpr = K // 2
        NG: tl.constexpr = K // 16
        x = X + slot * K if X_PER_SLOT else X
        x32 = x.to(tl.pointer_type(tl.int32))
        qw = QW + w_off
        s = S + s_off
        rows64 = rows.to(tl.int64)
        acc1 = tl.zeros([BN, 64], dtype=tl.float32)
        acc2 = tl.zeros([BN, 64], dtype=tl.float32)
        for b0 in range(0, KB, 64 * SPANS):
            for u in tl.static_range(SPANS):
                acc1, acc2 = _wide_span(acc1, acc2, qw, x32, s, rows64, n_mask, b0 + 64 * u, KB, NG, BN)
        y = _c_sums(acc1, acc2, BN) * _FP4_BIAS  # [BN, t, c]: tile column 2 t + c of the 8 (every lane right)
        if HAS_GS:
            y = y * tl.load(GS + gs_off)
        dtype = OUT.dtype.element_ty
        release_dependents(PDL)
        r = tl.arange(0, BN)[:, None]
        t = tl.arange(0, 4)[None, :]
        if GATED:
            gate, up = tl.split(y)  # [BN, 4]: output m = the block's 4 (r // 8) * 4 + t
            act = _silu_mul_rounded(gate, up, dtype)
            out = blk * (BN // 2) + (r // 8) * 4 + t
            tl.store(OUT + slot * HALF + out, act, mask=((r % 8) == 0) & (out < HALF))
        else:
            r3 = r[:, :, None]
            out = blk * BN + (r3 // 8) * 8 + 2 * t[:, :, None] + tl.arange(0, 2)[None, None, :]
            tl.store(OUT + slot * N_W + out, y.to(dtype), mask=((r3 % 8) == 0) & (out < N_W))


def nvfp4_moe(x: torch.Tensor, ids: torch.Tensor, w, gated: bool, shared: Nvfp4Shared | None = None
              ) -> torch.Tensor:
    """One token's experts through one stacked NVFP4 projection w (QuantOperand): gated, x [1, H] -> SiLU(gate)
    * up [slots, I] for the k experts of ids [1, k] (+ `shared` in slot k); else x [slots, I] (one row a slot)
    -> [slots, H]. The caller checked `moe_applies`."""
    top_k = ids.shape[-1]
    slots = top_k + int(shared is not None)
    n_out = w.n // 2 if gated else w.n
    out = torch.empty(slots, n_out, dtype=x.dtype, device=x.device)
    ids = ids.reshape(-1)
    offsets = _offset_args(w, None if shared is None else shared.gate_up if gated else shared.down)
    on = pdl(x)
    _moe_kernel[(slots, triton.cdiv(w.n, WIDE.block))](
        x, ids if ids.is_contiguous() else ids.contiguous(), w.qweight, w.scales,
        w.global_scale if w.global_scale is not None else w.scales, *offsets, out, N_W=w.n, K=w.k,
        W_STRIDE=w.strides[0], S_STRIDE=w.strides[1], TOP_K=top_k, E=w.experts, SHARED=shared is not None,
        HAS_GS=w.global_scale is not None, GATED=gated, X_PER_SLOT=not gated, BN=WIDE.block,
        SPANS=_moe_spans(w.k), PDL=on, num_warps=WIDE.warps, num_stages=1, launch_pdl=on)
    return out


# ---------------------------------------------------------------------------------------------------------------
# 2 or more tokens through NVFP4 experts: the rows kernel over each work item of the grouped layout

MOE_ROWS_MAX_TOKENS = 64  # a step of up to this many tokens (k + 1 = 16 at batch 4); past it the grouped dot path
# 64 weight rows a program, one K part, 8 tokens a pass. H100, bench/moe_kernels.py --quant nvfp4 --tokens 16 --pool
# 40 (35B-A3B, ~3 tokens an expert): 16 tokens a pass (two mma blocks) 92.5 us a block, 8 a pass 79.4 (the grouped
# dot path 130.7); 2-16 warps, 1-4 spans a step and 2 K parts for either projection within +-5%
MOE_ROWS = GemvConfig(warps=4, spans=2, parts=1)
# One token takes the GEMV (`_moe_kernel`) unless this is 1: then the rows kernel over the one-token layout the
# routing launch writes (work item j = slot j). Dense one-row layers of 16384+ outputs measured faster on the rows
# kernel (ROWS_ONE_WIDE); the experts' one-token launches have not been timed so (bench/moe_kernels.py
# --one-token-rows), so the GEMV keeps them.
MOE_ROWS_MIN_TOKENS = 2


def moe_rows_step(x: torch.Tensor) -> bool:
    """Whether x's step is one the rows kernel takes: MOE_ROWS_MIN_TOKENS to MOE_ROWS_MAX_TOKENS bf16 tokens on a
    CUDA GPU."""
    return (HAVE_TRITON and not INTERPRET and x.is_cuda and x.dtype == torch.bfloat16
            and MOE_ROWS_MIN_TOKENS <= x.shape[0] <= MOE_ROWS_MAX_TOKENS)


def moe_rows_applies(x: torch.Tensor, gate_up, down, shared, biases: bool, clamped: bool) -> bool:
    """A `moe_rows_step` through NVFP4 experts whose widths the rows kernel tiles (MOE_ROWS), with no biases or
    clamped activation, and no shared expert folded in or an `Nvfp4Shared` that `shared_fits` (the grouped
    kernels keep the rest)."""
    return (moe_rows_step(x) and not (biases or clamped)
            and all(getattr(w, "meta", None) is not None and w.meta.scheme == "nvfp4" and w.fast
                    and _fit_k(MOE_ROWS, w.k) is not None for w in (gate_up, down))
            and _shared_ok(shared, gate_up, down))


def moe_step_applies(x: torch.Tensor, gate_up, down, shared, biases: bool, clamped: bool) -> bool:
    """Whether one of these MoE kernels takes x's step: the one-token GEMV (`moe_applies`) or the rows kernel
    (`moe_rows_applies`)."""
    applies = moe_rows_applies if moe_rows_step(x) else moe_applies
    return applies(x, gate_up, down, shared, biases, clamped)


if HAVE_TRITON:
    @triton.jit
    def _moe_rows_kernel(X, QW, S, GS, SQW_OFF16, SS_OFF16, SGS_OFF, OUT, SORTED, ITEM_EXPERT, ITEM_START, ITEM_COUNT,
                         NUM_ITEMS,
                         N_W: tl.constexpr, K: tl.constexpr, W_STRIDE: tl.constexpr, S_STRIDE: tl.constexpr,
                         SLOTS: tl.constexpr, E: tl.constexpr, SHARED: tl.constexpr, HAS_GS: tl.constexpr,
                         GATED: tl.constexpr, BN: tl.constexpr, SPANS: tl.constexpr, P: tl.constexpr,
                         PDL: tl.constexpr = False):
        """Program (item, block): a work item of moe_grouped's layout (an expert and `count` of its pairs, at
        `start` in SORTED) against 16 RG weight rows of that expert, 8 of its tokens a pass (one mma block: a
        verify block gives an expert a few tokens; two blocks a pass measured slower, MOE_ROWS).
        GATED (gate|up, N_W = 2I rows; x = X [T, K] read at each pair's token): a 16-row group holds the gate
        rows of 8 outputs as its rows g and their up rows as g + 8, so a lane's C registers are one output's
        gate and up, and SiLU(gate) * up (rounded as silu_mul_ref) goes to OUT [P, I] at the pair's sorted
        place. Else (down: x = X [P, K], the activations in sorted order) OUT [P, N_W] at the pair's own row
        (pair = token * SLOTS + slot), as the grouped kernels lay them out for the combine. SHARED: expert id E
        is the shared expert (`_expert_offsets`)."""
        item = tl.program_id(0)
        blk = tl.program_id(1)
        wait_for_inputs(PDL)  # before the layout: the routing launch just before writes it
        if item >= tl.load(NUM_ITEMS):
            return
        e = tl.load(ITEM_EXPERT + item).to(tl.int64)
        start = tl.load(ITEM_START + item)
        count = tl.load(ITEM_COUNT + item)
        RG: tl.constexpr = BN // 8 // P
        r = tl.arange(0, BN)
        w = r // 8
        g = r % 8
        grp = blk * RG + w // P  # the tile row's 16-row group
        if GATED:
            HALF: tl.constexpr = N_W // 2
            lo_row = tl.minimum(grp * 8 + g, HALF - 1).to(tl.int64)  # gate row of output 8 grp + g
            hi_row = lo_row + HALF  # its up row
        else:
            lo_row = tl.minimum(grp * 16 + g, N_W - 1).to(tl.int64)
            hi_row = tl.minimum(grp * 16 + g + 8, N_W - 1).to(tl.int64)
        part = (w % P).to(tl.int64)
        KB: tl.constexpr = K // 2
        NG: tl.constexpr = K // 16
        x32 = X.to(tl.pointer_type(tl.int32))
        w_off, s_off, gs_off = _expert_offsets(e, W_STRIDE, S_STRIDE, SQW_OFF16, SS_OFF16, SGS_OFF, SHARED, E)
        qw = QW + w_off
        s = S + s_off
        gs = GS + gs_off
        m0 = 0
        while m0 < count:
            # tokens past the item's read its last pair: computed, never stored
            pos = tl.minimum(start + m0 + g, start + count - 1)
            if GATED:
                tok = (tl.load(SORTED + pos) // SLOTS).to(tl.int64)
            else:
                tok = pos.to(tl.int64)
            acc = tl.zeros([BN, 64], dtype=tl.float32)
            acc, _ = _rows_span_loop(acc, acc, qw, x32, s, lo_row, hi_row, part, tok, tok, KB, NG, BN, SPANS, P,
                                     False)
            release_dependents(PDL)  # the first tile's store; later calls have no effect
            _moe_rows_store(acc, OUT, gs, SORTED, start, count, m0, blk, N_W, BN, P, HAS_GS, GATED)
            m0 += 8

    @triton.jit
    def _moe_rows_store(acc, OUT, GS, SORTED, start, count, j0, blk, N_W: tl.constexpr, BN: tl.constexpr,
                        P: tl.constexpr, HAS_GS: tl.constexpr, GATED: tl.constexpr):
        """One block of 8 tokens (the item's j0 ..): the sums to OUT as _moe_rows_kernel lays it out."""
        vals, out, j = _rows_block(acc, GS, blk, j0, OUT.dtype.element_ty, BN, P, HAS_GS, False, GATED)
        if GATED:
            HALF: tl.constexpr = N_W // 2
            tl.store(OUT + (start + j).to(tl.int64) * HALF + out, vals, mask=(j < count) & (out < HALF))
        else:
            live = j < count
            pair = tl.load(SORTED + start + j, mask=live, other=0).to(tl.int64)
            tl.store(OUT + pair * N_W + out, vals, mask=live & (out < N_W))


def nvfp4_moe_rows(x: torch.Tensor, layout, w, gated: bool, slots: int, tokens: int,
                   shared: Nvfp4Shared | None = None) -> torch.Tensor:
    """The pairs of moe_grouped's `layout` through one stacked NVFP4 projection w (QuantOperand): gated, x [T, H]
    -> SiLU(gate) * up [P, I] in sorted order; else x [P, I] (sorted order) -> [P, H] at each pair's row. P =
    tokens * slots; `shared` is expert id w.experts where the layout has the shared slot. The caller checked
    `moe_rows_applies`."""
    cfg = _fit_k(MOE_ROWS, w.k)
    n_out = w.n // 2 if gated else w.n
    out = torch.empty(tokens * slots, n_out, dtype=x.dtype, device=x.device)
    per_block = cfg.rows_block // 2 if gated else cfg.rows_block  # gated: 8 outputs a 16-row group
    gs = w.global_scale if w.global_scale is not None else w.scales
    sw = None if shared is None else shared.gate_up if gated else shared.down
    offsets = _offset_args(w, sw)
    on = pdl(x)
    _moe_rows_kernel[(layout.max_items, triton.cdiv(n_out, per_block))](
        x, w.qweight, w.scales, gs, *offsets, out,
        layout.sorted_pairs, layout.item_expert, layout.item_start, layout.item_count, layout.num_items,
        N_W=w.n, K=w.k, W_STRIDE=w.strides[0], S_STRIDE=w.strides[1], SLOTS=slots, E=w.experts,
        SHARED=sw is not None, HAS_GS=w.global_scale is not None, GATED=gated, BN=cfg.block, SPANS=cfg.spans,
        P=cfg.parts, PDL=on, num_warps=cfg.warps, num_stages=1, launch_pdl=on)
    return out
