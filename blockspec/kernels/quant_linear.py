"""Weight-only quantized linear layers (W4A16 / W8A16 / FP8 / NVFP4) with the weights dequantized in registers.

    y = epilogue(prologue(x) @ dequantize(layer).T + bias)

with skinny_linear's folds around the GEMM (a decoder layer's small ops, each a launch of its own otherwise): an
RMSNorm prologue, a SwiGLU epilogue over the [gate; up] halves of the weight rows, a residual add in place.

Decode is bound by streaming the weight, so a quantized weight is read packed and turned into the activation
dtype tile by tile inside the GEMM: the bytes read are the packed weight plus its scales, 2-4x fewer than bf16.
Layouts (a weight of logical shape [N, K] = [out, in]; `QuantLinear` in models/layers/quant_linear.py holds them):

- "int4":  qweight uint8 [N, K/2], element k even in the low nibble; scales [N, K/G] (activation dtype);
           zeros uint8 [N, K/G] (symmetric formats store 8); w = (q - z) * s; G in {32, 64, 128}. With 16-bit
           scales the kernels read `scale_zero` int32 [N, K/G] (scale bits | zero << 16) in their place: the
           layer holds it from construction (scales and zeros are views of it), never packed per call.
- "int8":  qweight int8 [N, K]; scales [N, K/G] (G may equal K: per channel); zeros int8 [N, K/G] or None.
- "fp8":   qweight float8_e4m3fn [N, K]; scales float32 [N, 1] (per channel) or [ceil(N/128), ceil(K/128)].
- "nvfp4": qweight uint8 [N, K/2] of E2M1 codes (sign | e1 e0 | m, low nibble = even k); scales float8_e4m3fn
           [N, K/16]; global_scale float32 scalar tensor; w = e2m1 * scale * global_scale.

`dequantize` is the definition (the oracle, and what the loader uses to check a checkpoint); `quant_linear_ref`
is rms_norm_ref + dequantize + F.linear + silu_mul_ref + the add. `quant_linear` is the entry point:
- 1-16 rows (decode, speculative verify): one Triton kernel per projection, the norm, SwiGLU and add inside. The
  weight tile is dequantized to bf16 in registers and multiplied on tensor cores (`tl.dot`, rows padded to 8 or
  16), with the K loop split across the warps of a program (a batched dot, summed once at the end) so that even a
  4096-wide projection has enough warps in flight. For int4 and NVFP4 on a GPU the unpacking is a few PTX
  instructions per pair of weights (`_unpack_int4_fast` / `_unpack_e2m1_fast`): with Triton's own integer ops the
  dequantization costs ~8 instructions per weight (NVFP4: ~24), more than an H100 can issue while streaming 4-bit
  weights at full bandwidth (~7 per weight at 80% of it). One row of int8 / fp8 (1 byte per weight, half the
  element rate) and of NVFP4 (measured faster) takes a reduction path like skinny_linear's (`_M1_PATH`).
- 1-16 rows of an NVFP4 or int4 layer with no bias or norm fold (the residual add or SwiGLU is folded), at the
  widths where they measured faster (quant_gemv.launch_config): kernels/quant_gemv.py, the packed weights straight
  from registers into mma.sync (`gemv_takes`).
- 17 to PREFILL_DEQUANT_MIN_M - 1 rows: the same kernel with 32-64-row tiles (Hopper: wgmma), the norm a kernel
  of its own before it.
- more rows (prefill): the whole weight is dequantized to the activation dtype once per call, then cuBLAS; the
  norm and SwiGLU are kernels of their own.
- --deterministic (models/deterministic.py): `deterministic_quant_linear`, the dot path with one config a layer
  (`deterministic_config`: the 16-row tile, from the format, shape and SwiGLU fold only) for every row count,
  prefill included, compiled once for all M; `deterministic_quant_linear_ref` (row by row) is its definition.
float32 accumulation throughout. Native Blackwell FP4 / FP8 tensor-core GEMMs have one dispatch point
(`_native_blackwell`), a stub that falls through to the W4A16 path for now. The per-scheme register tiles (and the
PTX unpackers) live in kernels/quant_tiles.py, shared with the grouped MoE kernels (kernels/moe_grouped.py),
which also read "mxfp4" through `quant_meta`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from blockspec.device import cuda_capability
from blockspec.kernels import quant_gemv
from blockspec.kernels._triton import HAVE_TRITON, INTERPRET, pdl, use_triton
from blockspec.kernels.activation import silu_mul, silu_mul_ref
from blockspec.kernels.deterministic_linear import deterministic_linear, deterministic_linear_ref
from blockspec.kernels.lane_order import restore_columns
from blockspec.kernels.quant_tiles import FP4_GLOBAL_BIAS
from blockspec.kernels.rms_norm import rms_norm, rms_norm_ref
from blockspec.models.layers.quant_linear import (
    FP8_BLOCK,
    LAYOUTS,
    MXFP4_GROUP,
    NVFP4_GROUP,
    SCHEMES,
    packs_scale_zero,
)
from blockspec.models.layers.quant_linear import dequantize as layout_dequantize

PREFILL_DEQUANT_MIN_M = 1024  # rows: from here dequantize + cuBLAS beats the in-register tl.dot GEMM (to tune)
# the one-row kernel per scheme
_M1_PATH = {"int4": "dot", "nvfp4": "reduce", "mxfp4": "dot", "int8": "reduce", "fp8": "reduce"}
_NUM_SMS = 132  # H100 / H200
_MIN_PROGRAMS = 2 * _NUM_SMS
_TARGET_WARPS = 8 * _NUM_SMS  # warps that hide the dequantizing dot path's ALU chains and load latency
# 9-16 rows of a wide int4 layer of K <= 4096 (slices of 128) run two slices over two warps, not four: Qwen3-8B gate|up
# 26.5 against 29.2 us (H100, bench/quant_gemm.py --sweep, NOTES session 31); engine (H200): verify 4.17 -> 4.00 ms,
# k15 step 4.30 -> 4.26 (ab_engine_8b_int4_two_slices_h200_2e26943.json). LM heads (vocabulary-sized: a drafter's 15
# rows) keep four: alone 150.7 against 166.9 us with two on an H200, but with them in the rule the H100 engine's k15
# step got slower twice (4.48 -> 4.50 ms in session 31, 4.47 -> 4.53 in session 32:
# ab_engine_8b_int4_two_slices_heads_h100_eba22a3.json).
_VOCAB_ROWS = 65536


# ---------------------------------------------------------------------------------------------------------------
# The reference (the layouts are defined in models/layers/quant_linear.py)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def dequantize(scheme: str, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               global_scale: torch.Tensor | None, group_size: int | None, out_features: int, in_features: int,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The quantized weight as a dense [out_features, in_features] tensor of `dtype`: the layouts' one
    definition (models/layers/quant_linear.dequantize), after checking the tensors hold [N, K]. group_size
    is read for int4 / int8 only (None or <= 0 means one group per row); fp8 takes its granularity from the
    scales' shape, NVFP4's groups are 16."""
    n, k = out_features, in_features
    if scheme in ("int4", "int8"):
        _check(tuple(qweight.shape) == ((n, k // 2) if scheme == "int4" else (n, k)),
               f"{scheme} qweight {tuple(qweight.shape)} does not hold [{n}, {k}]")
        g = group_size if group_size and group_size > 0 else k
        _check(k % g == 0 and tuple(scales.shape) == (n, k // g), f"{scheme} scales {tuple(scales.shape)} "
               f"do not match [{n}, {k}] in groups of {g}")
        if zeros is None and scheme == "int4":  # the definition reads a zero point for every int4 group
            zeros = torch.zeros(scales.shape, dtype=torch.uint8, device=scales.device)
        return layout_dequantize(scheme, qweight, scales, zeros, None, g, dtype)
    if scheme == "fp8":
        _check(tuple(qweight.shape) == (n, k), f"fp8 qweight {tuple(qweight.shape)} is not [{n}, {k}]")
        blocks = tuple(scales.shape) != (n, 1)
        _check(not blocks or tuple(scales.shape) == (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)),
               f"fp8 scales {tuple(scales.shape)} are neither per channel nor 128x128 blocks of [{n}, {k}]")
        return layout_dequantize(scheme, qweight, scales, None, None, FP8_BLOCK if blocks else 0, dtype)
    if scheme == "nvfp4":
        _check(k % NVFP4_GROUP == 0 and tuple(qweight.shape) == (n, k // 2)
               and tuple(scales.shape) == (n, k // NVFP4_GROUP), f"nvfp4 qweight {tuple(qweight.shape)} / scales "
               f"{tuple(scales.shape)} do not match [{n}, {k}]")
        if global_scale is None:
            global_scale = torch.ones((), device=scales.device)
        return layout_dequantize(scheme, qweight, scales, None, global_scale, NVFP4_GROUP, dtype)
    raise ValueError(f"unknown quantization scheme {scheme!r} (one of {SCHEMES})")


@dataclass
class QuantWeights:
    """The attributes the kernels read from a layer (QuantLinear exposes the same), as a plain record: what
    the tests and bench/quant_gemm.py build their random layers as. int4 with 16-bit scales gets its packed
    `scale_zero` at construction, as a QuantLinear holds it (the record's scales and zeros stay its own
    tensors: do not write into them afterwards)."""
    scheme: str
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    global_scale: torch.Tensor | None
    group_size: int | None
    out_features: int
    in_features: int
    bias: torch.Tensor | None = None
    scale_zero: torch.Tensor | None = None
    lane_order: bool = False  # NVFP4 bytes in the mma kernels' lane order (kernels/lane_order.to_lane_order)

    def __post_init__(self) -> None:
        if (self.scale_zero is None and self.zeros is not None and self.scales.shape == self.zeros.shape
                and packs_scale_zero(self.scheme, self.scales.dtype)):
            self.scale_zero = packed_scale_zero(self.scales, self.zeros)

    def to(self, device: torch.device | str) -> QuantWeights:
        return QuantWeights(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()})


def dequantize_layer(layer, dtype: torch.dtype) -> torch.Tensor:
    """dequantize() over a QuantLinear-like module's attributes (columns in their original order: lane_order)."""
    w = dequantize(layer.scheme, layer.qweight, layer.scales, layer.zeros, layer.global_scale, layer.group_size,
                   layer.out_features, layer.in_features, dtype)
    return restore_columns(w) if getattr(layer, "lane_order", False) else w


def quant_linear_ref(x: torch.Tensor, layer, residual: torch.Tensor | None = None, *,
                     norm_weight: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False) -> torch.Tensor:
    """The reference, the unfused modules' ops: rms_norm_ref (with a norm weight), dequantize to x's dtype and
    F.linear, silu_mul_ref over the [gate; up] halves (gated); with a residual, residual += y in place
    (returned)."""
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps)[0]
    y = F.linear(x, dequantize_layer(layer, x.dtype), layer.bias)
    if gated:
        y = silu_mul_ref(y)
    if residual is None:
        return y
    return residual.copy_(residual + y)


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from blockspec.kernels._triton import release_dependents, wait_for_inputs

    # the per-scheme tiles, shared with the MoE kernels
    from blockspec.kernels.lane_order import lane_cols
    from blockspec.kernels.quant_tiles import _dequant_tile, _int4_tile, _tile_scales

    @triton.jit
    def _accumulate(acc, w, xv, USE_DOT: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """acc += one K step's products of a dequantized weight tile w [SPLIT, BN, BK] and x [SPLIT, BM, BK] (dot
        path: acc [BN, BM], or [SPLIT, BN, BM] summed after the loop) or x [SPLIT, BK] (one row: acc [SPLIT, BN,
        BK], reduced across K after the loop)."""
        if USE_DOT:
            if SPLIT == 1:
                acc = tl.dot(tl.reshape(w, [BLOCK_N, BLOCK_K]), tl.trans(tl.reshape(xv, [BLOCK_M, BLOCK_K])), acc,
                             input_precision=DOT_PRECISION)
            else:
                acc = tl.dot(w, tl.permute(xv, [0, 2, 1]), acc, input_precision=DOT_PRECISION)
        else:
            acc += w.to(tl.float32) * xv.to(tl.float32)[:, None, :]
        return acc

    @triton.jit
    def _accumulate_group_scaled(acc, w, xv, s, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """The dot path's acc += s * (Wd_s @ x_s^T) for int4 tiles Wd of q - z whose slices each lie in one group
        (POST_SCALE): the group scale s [SPLIT, BN, 1] multiplies each row's dot product once instead of every
        weight before it."""
        if SPLIT == 1:
            part = tl.dot(tl.reshape(w, [BLOCK_N, BLOCK_K]), tl.trans(tl.reshape(xv, [BLOCK_M, BLOCK_K])),
                          input_precision=DOT_PRECISION)
            acc += part * tl.reshape(s, [BLOCK_N, 1]).to(tl.float32)
        else:
            part = tl.dot(w, tl.permute(xv, [0, 2, 1]), input_precision=DOT_PRECISION)
            acc += part * s.to(tl.float32)
        return acc

    @triton.jit
    def _step_weights(QW, S, Z, rows, n_mask, k0, z_row, SPLIT: tl.constexpr, SCHEME: tl.constexpr, K: tl.constexpr,
                      G: tl.constexpr, NG: tl.constexpr, SCALE_ROW_DIV: tl.constexpr, HAS_ZERO: tl.constexpr,
                      PER_ROW: tl.constexpr, POST_SCALE: tl.constexpr, FAST: tl.constexpr, TILE: tl.constexpr,
                      EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
        """One K step's weight tile [SPLIT, BN, BK] and what _step_accumulate scales its products by: the
        dequantized tile (and no scale), or (POST_SCALE) the int4 tile's q - z and its slices' group scales."""
        if POST_SCALE:  # a static branch: each launch compiles one of the two (they return different types)
            scale, z = _tile_scales(S, Z, rows, n_mask, k0, SPLIT, SCHEME, K, G, NG, SCALE_ROW_DIV, HAS_ZERO, PER_ROW,
                                    BLOCK_K)
            kk = k0 + tl.arange(0, SPLIT) * BLOCK_K
            w = _int4_tile(QW, scale, z, rows, n_mask, kk, K, G, BLOCK_K, EVEN_K, FAST, TILE, False)
        else:
            w = _dequant_tile(QW, S, Z, rows, n_mask, k0, z_row, SPLIT, SCHEME, K, G, NG, SCALE_ROW_DIV, HAS_ZERO,
                              PER_ROW, BLOCK_K, EVEN_K, FAST, TILE)
            scale = 1.0
        return w, scale

    @triton.jit
    def _step_accumulate(acc, w, xv, s, USE_DOT: tl.constexpr, POST_SCALE: tl.constexpr, SPLIT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
        if POST_SCALE:
            acc = _accumulate_group_scaled(acc, w, xv, s, SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
        else:
            acc = _accumulate(acc, w, xv, USE_DOT, SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
        return acc

    @triton.jit
    def _x_tile(x_rows, m_mask, ks, K: tl.constexpr, EVEN_K: tl.constexpr):
        """The dot path's x tile [SPLIT, BM, BK] at columns ks [SPLIT, BK] of rows x_rows [1, BM, 1] (0 outside)."""
        mask = m_mask[None, :, None]
        if not EVEN_K:
            mask = mask & (ks < K)[:, None, :]
        return tl.load(x_rows + ks[:, None, :], mask=mask, other=0.0)

    @triton.jit
    def _linear_out(acc, S, GS, B, rows, n_mask, rstd, USE_DOT: tl.constexpr, SPLIT: tl.constexpr,
                    PER_ROW: tl.constexpr, HAS_GS: tl.constexpr, GS_FACTOR: tl.constexpr, HAS_RSTD: tl.constexpr,
                    HAS_BIAS: tl.constexpr):
        """The accumulator of weight rows `rows` -> their F.linear output [BM, BN] in float32: the sum over the
        slices (or across K), the per-row scale, the global scale (and the fast NVFP4 tiles' 2^26), the one-row
        norm's rstd, the bias."""
        if USE_DOT:
            if SPLIT == 1:
                y = tl.trans(acc)
            else:
                y = tl.trans(tl.sum(acc, axis=0))
        else:
            y = tl.sum(tl.sum(acc, axis=2), axis=0)[None, :]  # [1, BN]
        if PER_ROW:
            y = y * tl.load(S + rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_GS:
            y = y * tl.load(GS).to(tl.float32)
        if GS_FACTOR != 1.0:
            y = y * GS_FACTOR
        if HAS_RSTD:
            y = y * rstd
        if HAS_BIAS:
            y += tl.load(B + rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        return y

    @triton.jit
    def _quant_linear_kernel(X, QW, S, Z, GS, B, NW, Y, M, N, eps, SCHEME: tl.constexpr, K: tl.constexpr,
                             G: tl.constexpr, NG: tl.constexpr, SCALE_ROW_DIV: tl.constexpr, HAS_ZERO: tl.constexpr,
                             PER_ROW: tl.constexpr, HAS_GS: tl.constexpr, GS_FACTOR: tl.constexpr,
                             HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, GATED: tl.constexpr,
                             HAS_RES: tl.constexpr, USE_DOT: tl.constexpr, FAST: tl.constexpr,
                             DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr = False,
                             POST_SCALE: tl.constexpr = False, LANE: tl.constexpr = False):
        # Program (pid_n, pid_m) owns BLOCK_N output columns of BLOCK_M rows. Each step of the K loop covers
        # SPLIT * BLOCK_K columns of the weight: slice s = [k0 + s * BLOCK_K, + BLOCK_K). The dot path computes
        # the weight-as-A product acc[s] += W_s @ x_s^T as one batched dot (the warps split over the slices)
        # and sums the slices after the loop; the one-row reduction path (USE_DOT = False, SPLIT = 1)
        # accumulates products elementwise and reduces across K once at the end (skinny_linear's lesson).
        # K is constexpr: a handful per model, compile-time trip counts and masks.
        # The folds around the GEMM, as skinny_linear's (rounded as the unfused ops, quant_linear_ref, bar the norm):
        # - HAS_NORM: RMSNorm of x (weight NW) as the prologue, as norm(x) @ W.T == rstd * ((x * NW) @ W.T): the
        #   loop feeds x * NW (one multiply in x's dtype, rounded once where rms_norm_ref rounds x * rstd and then
        #   * NW: equal to bf16 precision) and rstd scales the accumulator. The dot path sums each row's squares
        #   in float32 in an unrolled pass over x after the loop (x is L2-resident; the weights stream from the
        #   start). x * NW adds ~12% to a step's instructions at 1 row, 16% at 16 (sm_90 PTX: paired multiplies
        #   on the mma operand's registers); the first version (x * rstd * NW in float32, rounded as the
        #   reference) added 52% and 90% on this path near the issue limit, and measured slower than the
        #   launches it saved (H200, bench/NOTES.md session 11). The one-row reduction path gathers the squares
        #   on the way as skinny_linear's does (a separate pass there stalled every program).
        # - GATED: output column n is silu(gate) * up of weight rows n (gate) and N + n (up): two dequantized
        #   tiles and two accumulators a step; N is the output width, the weight has 2N rows.
        # - HAS_RES: Y is the residual, read, added to and written back.
        # LANE: the layer is stored in the mma kernels' lane order (kernels/lane_order.py): x and the norm weight
        # are read at each stored column's original column.
        dtype = Y.dtype.element_ty
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n_mask = offs_n < N
        m_mask = offs_m < M
        rows = offs_n.to(tl.int64)
        rows_u = rows + N  # GATED: the up rows
        wait_for_inputs(PDL)
        EVEN_K: tl.constexpr = K % (BLOCK_K * SPLIT) == 0
        TILE: tl.constexpr = X.dtype.element_ty if USE_DOT or FAST else tl.float32
        z_row = tl.zeros([BLOCK_N], dtype=tl.int32)
        z_row_u = tl.zeros([BLOCK_N], dtype=tl.int32)
        if PER_ROW and HAS_ZERO and SCHEME == "int8":
            z_row = tl.load(Z + rows, mask=n_mask, other=0).to(tl.int32)
            if GATED:
                z_row_u = tl.load(Z + rows_u, mask=n_mask, other=0).to(tl.int32)
        x_rows = X + offs_m[None, :, None].to(tl.int64) * K  # [1, BM, 1]: the dot path's rows of x
        if USE_DOT:
            if SPLIT == 1:
                acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            else:
                acc = tl.zeros([SPLIT, BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([SPLIT, BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros_like(acc)
        ss = tl.zeros([SPLIT, BLOCK_K], dtype=tl.float32)  # one-row norm: x^2, summed across K after the loop
        for k0 in range(0, K, BLOCK_K * SPLIT):
            kk = k0 + tl.arange(0, SPLIT) * BLOCK_K
            w, ws = _step_weights(QW, S, Z, rows, n_mask, k0, z_row, SPLIT, SCHEME, K, G, NG, SCALE_ROW_DIV, HAS_ZERO,
                                  PER_ROW, POST_SCALE, FAST, TILE, EVEN_K, BLOCK_K)
            ks = kk[:, None] + tl.arange(0, BLOCK_K)[None, :]  # [S, BK]
            if LANE:  # (K a multiple of 128: in range exactly where ks is)
                ks = lane_cols(ks, 16)
            if USE_DOT:
                xv = _x_tile(x_rows, m_mask, ks, K, EVEN_K)
            elif EVEN_K:  # one row
                xv = tl.load(X + ks)
            else:
                xv = tl.load(X + ks, mask=ks < K, other=0.0)
            if HAS_NORM:  # x * NW in float32, rounded once (on the dot path LLVM makes it a paired bf16 multiply)
                if EVEN_K:
                    nw = tl.load(NW + ks).to(tl.float32)
                else:
                    nw = tl.load(NW + ks, mask=ks < K, other=0.0).to(tl.float32)
                xf = xv.to(tl.float32)
                if USE_DOT:
                    xv = (xf * nw[:, None, :]).to(dtype)
                else:
                    ss += xf * xf
                    xv = (xf * nw).to(dtype)
            acc = _step_accumulate(acc, w, xv, ws, USE_DOT, POST_SCALE, SPLIT, BLOCK_M, BLOCK_N, BLOCK_K,
                                   DOT_PRECISION)
            if GATED:
                wu, wus = _step_weights(QW, S, Z, rows_u, n_mask, k0, z_row_u, SPLIT, SCHEME, K, G, NG, SCALE_ROW_DIV,
                                        HAS_ZERO, PER_ROW, POST_SCALE, FAST, TILE, EVEN_K, BLOCK_K)
                acc_u = _step_accumulate(acc_u, wu, xv, wus, USE_DOT, POST_SCALE, SPLIT, BLOCK_M, BLOCK_N, BLOCK_K,
                                         DOT_PRECISION)

        rstd = 1.0
        if HAS_NORM and USE_DOT:
            ss_m = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in tl.static_range(0, K, BLOCK_K * SPLIT):
                ks = (k0 + tl.arange(0, SPLIT) * BLOCK_K)[:, None] + tl.arange(0, BLOCK_K)[None, :]
                xf = _x_tile(x_rows, m_mask, ks, K, EVEN_K).to(tl.float32)
                ss_m += tl.sum(tl.sum(xf * xf, axis=2), axis=0)
            rstd = tl.rsqrt(ss_m / K + eps)[:, None]
        elif HAS_NORM:
            rstd = tl.rsqrt(tl.sum(tl.sum(ss, axis=1), axis=0) / K + eps)
        y = _linear_out(acc, S, GS, B, rows, n_mask, rstd, USE_DOT, SPLIT, PER_ROW, HAS_GS, GS_FACTOR, HAS_NORM,
                        HAS_BIAS)
        if GATED:
            yu = _linear_out(acc_u, S, GS, B, rows_u, n_mask, rstd, USE_DOT, SPLIT, PER_ROW, HAS_GS, GS_FACTOR,
                             HAS_NORM, HAS_BIAS)
        y = y.to(dtype)  # the F.linear output
        if GATED:  # silu_mul_ref: F.silu rounds, then the multiply by the rounded up projection rounds again
            g = y.to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(dtype)
            y = (s.to(tl.float32) * yu.to(dtype).to(tl.float32)).to(dtype)
        release_dependents(PDL)
        out_mask = m_mask[:, None] & n_mask[None, :]
        y_ptrs = Y + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        if HAS_RES:
            r = tl.load(y_ptrs, mask=out_mask, other=0.0)
            y = (r.to(tl.float32) + y.to(tl.float32)).to(dtype)
        tl.store(y_ptrs, y, mask=out_mask)

    @triton.jit
    def _dequant_kernel(QW, S, Z, GS, W, N, SCHEME: tl.constexpr, K: tl.constexpr, G: tl.constexpr,
                        NG: tl.constexpr, SCALE_ROW_DIV: tl.constexpr, HAS_ZERO: tl.constexpr, PER_ROW: tl.constexpr,
                        HAS_GS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LANE: tl.constexpr = False):
        """The whole weight as W [N, K] (W's dtype), for the prefill path (then cuBLAS). Bound by writing W:
        the plain float32 dequantizers are fast enough here. LANE: each stored column written to its original
        column (kernels/lane_order.py)."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        rows = offs_n.to(tl.int64)
        z_row = tl.zeros([BLOCK_N], dtype=tl.int32)
        if PER_ROW and HAS_ZERO and SCHEME == "int8":
            z_row = tl.load(Z + rows, mask=n_mask, other=0).to(tl.int32)
        w = _dequant_tile(QW, S, Z, rows, n_mask, tl.program_id(1) * BLOCK_K, z_row, 1, SCHEME, K, G, NG,
                          SCALE_ROW_DIV, HAS_ZERO, PER_ROW, BLOCK_K, K % BLOCK_K == 0, False, tl.float32)
        w = tl.reshape(w, [BLOCK_N, BLOCK_K])
        if PER_ROW:
            w = w * tl.load(S + rows, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        if HAS_GS:
            w = w * tl.load(GS).to(tl.float32)
        ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = n_mask[:, None] & (ks < K)[None, :]
        if LANE:
            ks = lane_cols(ks, 16)
        tl.store(W + rows[:, None] * K + ks[None, :], w.to(W.dtype.element_ty), mask=mask)


    # --deterministic: the same kernel compiled once for every row count (Triton would otherwise compile variants
    # for M equal to 1 or divisible by 16), as kernels/deterministic_linear.py's
    _deterministic_quant_kernel = triton.jit(do_not_specialize=["M"])(_quant_linear_kernel.fn)


# ---------------------------------------------------------------------------------------------------------------
# Host side


@dataclass(frozen=True)
class QuantMeta:
    """What the kernels need to know about a layer's format (constexprs, bar the tensors)."""
    scheme: str
    n: int
    k: int
    group: int  # along K (int4 / int8: G; fp8 blocks: 128; per-row schemes: K; nvfp4: 16)
    n_groups: int  # scales.shape[1]
    scale_row_div: int  # 128 for fp8 block scales, else 1
    per_row: bool  # one scale per output row, applied to the accumulator
    has_zero: bool
    has_gs: bool


@dataclass(frozen=True)
class LaunchConfig:
    use_dot: bool
    block_m: int
    block_n: int
    block_k: int
    split: int
    num_warps: int
    num_stages: int


def _next_pow2(v: int) -> int:
    return 1 << max(v - 1, 0).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def quant_meta(layer) -> QuantMeta | None:
    """The layer's format as the kernels index it, or None where they do not cover it (the reference runs).
    MXFP4 (GPT-OSS experts) is read by the grouped MoE kernels, which call this on one expert's tensors."""
    scheme, n, k = layer.scheme, layer.out_features, layer.in_features
    qw, s, z, gs = layer.qweight, layer.scales, layer.zeros, layer.global_scale
    packed = scale_zero_of(layer)  # int4 with 16-bit scales: what the kernels read (s, z are views then)
    if scheme not in LAYOUTS or s.dim() != 2 or not qw.is_contiguous():
        return None
    if packed is not None:
        if not packed.is_contiguous() or packed.shape != s.shape:
            return None
    elif not s.is_contiguous() or (z is not None and not z.is_contiguous()):
        return None
    if scheme == "int4":
        g = layer.group_size if layer.group_size and layer.group_size > 0 else k
        if (not _pow2(g) or g < 16 or k % g or tuple(qw.shape) != (n, k // 2) or qw.dtype != torch.uint8
                or tuple(s.shape) != (n, k // g) or z is None or z.shape != s.shape):
            return None
        return QuantMeta(scheme, n, k, g, k // g, 1, False, True, False)
    if scheme == "int8":
        g = layer.group_size if layer.group_size and layer.group_size > 0 else k
        if (k % g or tuple(qw.shape) != (n, k) or qw.dtype != torch.int8 or tuple(s.shape) != (n, k // g)
                or (z is not None and z.shape != s.shape) or (g != k and (not _pow2(g) or g < 16))):
            return None
        return QuantMeta(scheme, n, k, g, k // g, 1, g == k, z is not None, False)
    if scheme == "fp8":
        if tuple(qw.shape) != (n, k) or qw.dtype != torch.float8_e4m3fn:
            return None
        if tuple(s.shape) == (n, 1):
            return QuantMeta(scheme, n, k, k, 1, 1, True, False, False)
        if tuple(s.shape) == (_cdiv(n, FP8_BLOCK), _cdiv(k, FP8_BLOCK)):
            return QuantMeta(scheme, n, k, FP8_BLOCK, s.shape[1], FP8_BLOCK, False, False, False)
        return None
    if scheme == "mxfp4":
        if (k % MXFP4_GROUP or tuple(qw.shape) != (n, k // 2) or qw.dtype != torch.uint8
                or tuple(s.shape) != (n, k // MXFP4_GROUP) or s.dtype != torch.uint8):
            return None
        return QuantMeta(scheme, n, k, MXFP4_GROUP, k // MXFP4_GROUP, 1, False, False, False)
    if (k % NVFP4_GROUP or tuple(qw.shape) != (n, k // 2) or qw.dtype != torch.uint8
            or tuple(s.shape) != (n, k // NVFP4_GROUP) or s.dtype != torch.float8_e4m3fn):
        return None
    return QuantMeta(scheme, n, k, NVFP4_GROUP, k // NVFP4_GROUP, 1, False, False, gs is not None)


def fast_unpack(meta: QuantMeta, dtype: torch.dtype) -> bool:
    """Whether the PTX unpackers apply: int4 with bf16 / fp16 activations, NVFP4 and MXFP4 with bf16 (the E2M1
    trick needs bf16's exponent range), on a GPU (the interpreter cannot run inline assembly)."""
    if INTERPRET:
        return False
    return (meta.scheme == "int4" and dtype in (torch.bfloat16, torch.float16)) or (
        meta.scheme in ("nvfp4", "mxfp4") and dtype == torch.bfloat16)


def _max_split(k: int, block_k: int, cap: int) -> int:
    """The largest power of two <= cap slices of block_k that K fills."""
    split = 1
    while split * 2 <= cap and split * 2 * block_k <= k:
        split *= 2
    return split


def _balance(programs: int) -> float:
    """Fraction of the SMs' time used when `programs` equal programs share _NUM_SMS SMs."""
    return programs / (_cdiv(programs, _NUM_SMS) * _NUM_SMS)


def launch_config(meta: QuantMeta, m: int, gated: bool = False, post_scale: bool = True) -> LaunchConfig:
    """The launch for m rows of the layer: `_launch_config`'s. With `gated` (the SwiGLU folded in: each program
    dequantizes a gate tile and the matching up tile) the config of the unfused [gate; up] GEMM over the same
    meta.n = 2I weight rows, with half its BLOCK_N where that leaves a valid tile (>= 16 rows for the mma; the
    32-64-row tiles keep their 64: narrower ones dequantize each weight once per warp): as many programs over
    the I output columns, each streaming the weight bytes (and holding the tile registers) of one unfused
    program. An int4 layer that scales its groups after the dot (post_scale_wanted; `post_scale` False: never)
    takes K slices of at most one group."""
    cfg = _launch_config(meta, m)
    if post_scale and cfg.use_dot and cfg.block_m <= 16 and cfg.block_k > meta.group and post_scale_wanted(meta, m):
        cfg = replace(cfg, block_k=meta.group)  # K > 4096: 128-wide slices, each in one group
    if not gated or m > 16:
        return cfg
    return replace(cfg, block_n=max(16 if cfg.use_dot else 4, cfg.block_n // 2))


def _launch_config(meta: QuantMeta, m: int) -> LaunchConfig:
    """A hand heuristic (CUDA graphs are captured after warm-up, so no autotuning), first reasoned from sm_90
    SASS instruction counts per weight, then corrected where `bench/quant_gemm.py --sweep` on an H100 (Qwen3-8B
    qkv / o / down, weights rotated past the L2) measured better: NVFP4 one row on the reduction path (BLOCK_N
    8, BLOCK_K 512, 4 warps) and 2-16 rows as two 2-warp slices of 128; int4 slices of 128 up to K = 4096.
    - m == 1 on the reduction path (int8 / fp8, _M1_PATH): skinny_linear's one-row config, BLOCK_N 4-16 rows
      by >= 2 programs per SM, BLOCK_K 512, 8 warps from 8192-element tiles.
    - m <= 16 (dot path): rows padded to 8 (m <= 8: mma n = 8, half the x fragments of 16) or 16.
      SPLIT = num_warps = 4 slices of K per step (one per warp) so that a 4096-wide projection still runs
      ~8 warps per SM: each warp's dequantization is a chain of dependent ALU instructions. BLOCK_K 256 per
      slice, 3 stages (loop and scale overhead per weight, int4 / NVFP4 at 8 rows: 3.5 / 4.5 instructions
      per weight vs 4.0 / 4.9 at 128; 16 rows 4.0 vs 4.4 for int4, <= 96 KB of shared memory: 2 programs per
      SM; not for 8-bit weights at 16 rows, 128 KB). BLOCK_N 32 (two 16-row mma tiles per warp: half the
      x-fragment traffic per weight) where N still gives enough warps and an even spread over the SMs
      (gate_up, LM head), else 16.
    - m > 16 (verify batches, short prefill): 32-64-row tiles, BLOCK_N 64, BLOCK_K 64, 4 warps, no split:
      Hopper's wgmma takes the dequantized tile from registers with one warp per 16 weight rows (7 instructions
      per weight). Narrower tiles put mma v2's warps along the rows of x, each dequantizing the same weights
      (19 per weight with BLOCK_N 32). Fewer programs than SMs on 4096-wide projections below 128 rows.
    """
    n, k = meta.n, meta.k
    # int8 with groups along K gave wrong sums on the reduction path on an H100 (the dot path is right), and so
    # did int4 at BLOCK_N 4 / BLOCK_K 1024 (not at 8 / 512): only per-row int8, fp8 and NVFP4 (right at every
    # swept config) take it until that is found
    if m == 1 and meta.scheme == "nvfp4" and k >= 512:  # quant_gemm.py --sweep (H100): 12.1 / 10.5 / 25.9 us
        return LaunchConfig(False, 1, 8, 512, 1, 4, 3)    # on qkv / o / down
    if m == 1 and _M1_PATH[meta.scheme] == "reduce" and (meta.per_row or meta.scheme == "fp8"):
        block_k = min(512, max(64, _next_pow2(k)))
        block_n = next((b for b in (16, 8) if _cdiv(n, b) >= _MIN_PROGRAMS), 4)
        return LaunchConfig(False, 1, block_n, block_k, 1, 8 if block_n * block_k >= 8192 else 4, 3)
    if m <= 16:
        if meta.scheme == "nvfp4":  # two slices of 128, two warps: 2x faster than four of 256 at 16 rows (sweep)
            block_k = 128 if k >= 128 else max(32, _next_pow2(k))
            split = _max_split(k, block_k, 2)
            return LaunchConfig(True, 8 if m <= 8 else 16, 16, block_k, split, split, 4)
        # 4-bit: slices of 128 up to K = 4096 (qkv / o at 1 and 16 rows: 10-30% faster than 256), 256 beyond
        wide = k >= 2048 and (m <= 8 or meta.scheme == "int4")  # 8-bit tiles at 16 rows: 128 KB
        block_k = (128 if meta.scheme == "int4" and k <= 4096 else 256) if wide else \
            (128 if k >= 128 else max(32, _next_pow2(k)))
        split = _max_split(k, block_k, 4)
        p32 = _cdiv(n, 32)
        block_n = 32 if p32 * split >= _TARGET_WARPS and _balance(p32) >= 0.9 else 16
        if meta.scheme == "int4" and m > 8 and block_n == 32 and k <= 4096 and n < _VOCAB_ROWS:
            split = min(split, 2)  # a verify block's wide int4 layer (gate|up): two slices, two warps
        return LaunchConfig(True, 8 if m <= 8 else 16, block_n, block_k, split, split, 3 if wide else 4)
    return LaunchConfig(True, 32 if m <= 32 else 64, 64, 64 if k >= 64 else 32, 1, 4, 3)


def _native_blackwell(x: torch.Tensor, layer, residual: torch.Tensor | None) -> torch.Tensor | None:
    """Dispatch point for native Blackwell (sm_100 / 110 / 120 / 121) block-scaled FP4 / FP8 tensor-core GEMMs
    (tcgen05 / mma with e2m1 or e4m3 operands and ue4m3 / ue8m0 scales): there the activations would be
    quantized on the fly and the weights never dequantized. Not written yet: returns None, and the caller
    falls through to the W4A16 / W8A16 kernels, which run on Blackwell too."""
    if x.is_cuda and layer.scheme in ("nvfp4", "fp8"):
        major, _ = cuda_capability(x.device)
        if major in (10, 11, 12):
            return None  # TODO(issue 14): native FP4 / FP8 GEMM here
    return None


def _kernels_take(x: torch.Tensor, layer) -> bool:
    """The support check bar x's width: activations the kernels run on, the layer on their device, a bias they
    index."""
    if not (use_triton(x) and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.dim() >= 1
            and layer.qweight.device == x.device):
        return False
    return layer.bias is None or (tuple(layer.bias.shape) == (layer.out_features,) and layer.bias.is_contiguous())


def _supported_meta(x: torch.Tensor, layer) -> QuantMeta | None:
    """The layer's QuantMeta where the Triton kernels apply to this activation / layer pair, else None."""
    if not _kernels_take(x, layer) or x.shape[-1] != layer.in_features:
        return None
    return quant_meta(layer)


def gemv_takes(x: torch.Tensor, layer, *, gated: bool = False) -> bool:
    """Whether quant_linear runs x's rows ([M, K]) of the layer, SwiGLU folded where `gated`, on the 1-16-row mma
    kernels (kernels/quant_gemv.py). There SwiGLU rides in the epilogue for free; the dot path's SwiGLU fold
    measured slower than a SwiGLU launch after its GEMM (bench/quant_gemm.py --folds), so callers fold it only
    here."""
    meta = _supported_meta(x, layer)
    return (meta is not None and x.dim() == 2 and x.is_contiguous() and not (gated and meta.n % 2)
            and quant_gemv.applies(x, layer, meta, None, None, gated) is not None)


def quant_supported(x: torch.Tensor, layer) -> bool:
    """Whether the Triton kernels apply to this activation / layer pair."""
    return _supported_meta(x, layer) is not None


def quant_gemm_supported(x: torch.Tensor, layer) -> bool:
    """Whether quant_linear runs the layer as one GEMM launch, the folds inside, for rows like x's: the kernels
    take x's dtype and device and the layer's format, and x has 1 to PREFILL_DEQUANT_MIN_M - 1 rows. x's width
    is not checked: a decoder layer asks with its residual stream for projections of other input widths too."""
    rows = x.numel() // x.shape[-1] if x.dim() >= 1 and x.shape[-1] else 0
    return 0 < rows < PREFILL_DEQUANT_MIN_M and _kernels_take(x, layer) and quant_meta(layer) is not None


def packed_scale_zero(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """int4 16-bit scales and uint8 zeros as one int32 a group (scale bits | zero << 16): one 4-byte load a
    group, wide enough for cp.async (see _group_scales)."""
    bits = scales.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    return bits | (zeros.to(torch.int32) << 16)


def scale_zero_of(layer) -> torch.Tensor | None:
    """The packed int4 scale|zero tensor the layer holds (QuantLinear / QuantExpertWeights / QuantWeights
    build it when they are made: models/layers/quant_linear._QuantTensors), or None."""
    return getattr(layer, "scale_zero", None)


def kernel_operands(layer, meta: QuantMeta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight, scales, zeros) as the kernels take them: float8 tensors as uint8 views (decoded by bitcast),
    a missing zeros tensor replaced by the scales (never read), int4 with 16-bit scales reading its scales
    and zeros from one int32 tensor in place of the zeros (the scales then only give their dtype). That
    tensor is the layer's `scale_zero`; a duck-typed layer without one gets it packed for this call."""
    qw = layer.qweight.view(torch.uint8) if meta.scheme == "fp8" else layer.qweight
    s = layer.scales.view(torch.uint8) if meta.scheme == "nvfp4" else layer.scales
    if meta.scheme == "int4" and packs_scale_zero("int4", s.dtype):
        packed = scale_zero_of(layer)
        return qw, s, packed if packed is not None else packed_scale_zero(layer.scales, layer.zeros)
    return qw, s, layer.zeros if layer.zeros is not None else s


def bytes_read(layer, meta: QuantMeta | None = None) -> int:
    """Bytes one pass of the kernels over the layer's weight streams: the packed weight, the scales (int4
    with 16-bit scales: its scale|zero int32s instead of scales and zeros), zeros where they are read, the
    global scale and the bias. What rooflines divide by."""
    meta = meta or quant_meta(layer)
    if meta is None:
        raise ValueError(f"the kernels do not read this {layer.scheme} layer")
    qw, s, z = kernel_operands(layer, meta)
    tensors = [qw, z] if meta.scheme == "int4" and z.dtype == torch.int32 else \
        [qw, s] + ([z] if meta.has_zero and z is not s else [])
    if meta.has_gs:
        tensors.append(layer.global_scale)
    if layer.bias is not None:
        tensors.append(layer.bias)
    return sum(t.numel() * t.element_size() for t in tensors)


POST_SCALE_MIN_N = 12288  # weight rows from which 9-16-row int4 tiles scale groups after the dot (measured below)


def post_scale_wanted(meta: QuantMeta, m: int) -> bool:
    """Whether m rows of this layer take POST_SCALE (below): int4 groups of >= 128, 9-16 rows (verify blocks), wide
    layers. bench/int4_post_scale.py on an H200 (us, per weight -> post-scale): 16 rows gate|up 24576 x 4096 30.8 ->
    28.7, Qwen3.6-27B q|gate|k|v 14336 x 5120 32.4 -> 27.3 (128-wide slices); but qkv 6144 x 4096 10.8 -> 11.2, and
    one row qkv 8.2 -> 8.9, gate|up 22.8 -> 23.0: no gain where the dequantization is not the bound.
    BLOCKSPEC_INT4_POST_SCALE=0 turns it off, =all takes it wherever it applies (A/B runs)."""
    mode = os.environ.get("BLOCKSPEC_INT4_POST_SCALE", "1")
    if mode == "0" or meta.scheme != "int4" or meta.group < 128:
        return False
    return mode == "all" or (8 < m <= 16 and meta.n >= POST_SCALE_MIN_N)


def post_scale_applies(meta: QuantMeta, cfg: LaunchConfig) -> bool:
    """Whether the dot path can scale int4 groups after their dot products (POST_SCALE): every K slice lies in one
    group (G >= BLOCK_K, both powers of two), so the tile is q - z, exact, and one multiply per output and slice
    replaces one per weight (the decode's second bf16x2 fma and the per-byte scale operands). Decode and verify
    tiles only (<= 16 rows: a 32-64-row tile has as many outputs as weights a step, nothing to save)."""
    return meta.scheme == "int4" and cfg.use_dot and cfg.block_m <= 16 and meta.group >= cfg.block_k


def _gemm_triton(x: torch.Tensor, layer, meta: QuantMeta, residual: torch.Tensor | None,
                 cfg: LaunchConfig | None = None, fast: bool | None = None, *, norm_weight: torch.Tensor | None = None,
                 eps: float = 0.0, gated: bool = False, kernel=None, post_scale: bool | None = None) -> torch.Tensor:
    """Launch the GEMM on a contiguous 2-D x without the support checks (tests call it on CPU tensors under
    TRITON_INTERPRET=1; bench/quant_gemm.py passes its own cfg). norm_weight: RMSNorm folded in as the
    prologue; gated: SwiGLU over the [gate; up] halves of the layer's rows as the epilogue (meta.n / 2 outputs).
    kernel: the compiled variant (--deterministic passes its copy unspecialised on M). post_scale: int4 groups
    scaled after their dot products (None: where post_scale_wanted and post_scale_applies)."""
    m = x.shape[0]
    n_out = meta.n // 2 if gated else meta.n
    cfg = cfg or launch_config(meta, m, gated)
    fast = fast_unpack(meta, x.dtype) if fast is None else fast
    if post_scale is None:
        post_scale = post_scale_applies(meta, cfg) and post_scale_wanted(meta, m)
    out = residual if residual is not None else torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    gs_factor = FP4_GLOBAL_BIAS if (meta.scheme in ("nvfp4", "mxfp4") and fast) else 1.0
    gs = layer.global_scale if meta.has_gs else x
    dot_precision = "ieee" if x.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(n_out, cfg.block_n), triton.cdiv(m, cfg.block_m) if cfg.use_dot else 1)
    on = pdl(x)
    (kernel or _quant_linear_kernel)[grid](
        x, *kernel_operands(layer, meta), gs, layer.bias if layer.bias is not None else x,
        norm_weight if norm_weight is not None else x, out, m, n_out, eps,
        SCHEME=meta.scheme, K=meta.k, G=meta.group, NG=meta.n_groups, SCALE_ROW_DIV=meta.scale_row_div,
        HAS_ZERO=meta.has_zero, PER_ROW=meta.per_row, HAS_GS=meta.has_gs, GS_FACTOR=gs_factor,
        HAS_BIAS=layer.bias is not None, HAS_NORM=norm_weight is not None, GATED=gated,
        HAS_RES=residual is not None, USE_DOT=cfg.use_dot, FAST=fast, DOT_PRECISION=dot_precision,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=cfg.split, PDL=on,
        POST_SCALE=post_scale, LANE=getattr(layer, "lane_order", False), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, launch_pdl=on)
    return out


def dequantize_triton(layer, dtype: torch.dtype, meta: QuantMeta | None = None) -> torch.Tensor:
    """dequantize() as one Triton kernel over the whole weight (the prefill path's first half)."""
    meta = meta or quant_meta(layer)
    w = torch.empty(meta.n, meta.k, dtype=dtype, device=layer.qweight.device)
    block_n, block_k = 32, 128 if meta.k >= 128 else max(32, _next_pow2(meta.k))
    gs = layer.global_scale if meta.has_gs else w
    _dequant_kernel[(triton.cdiv(meta.n, block_n), triton.cdiv(meta.k, block_k))](
        *kernel_operands(layer, meta), gs, w, meta.n,
        SCHEME=meta.scheme, K=meta.k, G=meta.group, NG=meta.n_groups, SCALE_ROW_DIV=meta.scale_row_div,
        HAS_ZERO=meta.has_zero, PER_ROW=meta.per_row, HAS_GS=meta.has_gs, BLOCK_N=block_n, BLOCK_K=block_k,
        LANE=getattr(layer, "lane_order", False), num_warps=4)
    return w


def _prefill(x: torch.Tensor, layer, meta: QuantMeta, residual: torch.Tensor | None) -> torch.Tensor:
    """Many rows: dequantize once to x's dtype, then cuBLAS (the residual add in its epilogue where it can)."""
    w = dequantize_triton(layer, x.dtype, meta)
    if residual is not None and layer.bias is None:
        return residual.addmm_(x, w.t())
    y = F.linear(x, w, layer.bias)
    return y if residual is None else residual.add_(y)


def _fits(t: torch.Tensor | None, shape: tuple[int, ...], x: torch.Tensor) -> bool:
    """An operand the kernels index as given: that shape, x's dtype and device, contiguous."""
    return t is None or (tuple(t.shape) == shape and t.dtype == x.dtype and t.is_contiguous() and t.device == x.device)


def quant_linear(x: torch.Tensor, layer, *, residual: torch.Tensor | None = None,
                 norm_weight: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False) -> torch.Tensor:
    """y = x @ W.T + bias for a quantized layer (module attributes: scheme, qweight, scales, zeros,
    global_scale, group_size, out_features, in_features, bias), with the ops around a decoder's projections
    folded in as skinny_linear folds them: `norm_weight` (x's width and dtype) applies RMSNorm (eps) to x first,
    `gated` returns silu(gate) * up of the output's [gate; up] halves, `residual` ([rows, outputs], x's dtype)
    gets the result added in place and is returned. Triton on a GPU (or under TRITON_INTERPRET=1), the reference
    (quant_linear_ref) elsewhere (CPU, grad, formats or operands the kernels do not cover). Up to 16 rows (decode,
    verify) are one launch with all three folded; 17 to PREFILL_DEQUANT_MIN_M - 1 rows take the norm as its own
    kernel first (a 32-64-row tile would recompute it for every program); prefill rows run the norm, the
    dequantize + cuBLAS GEMM and SwiGLU as separate kernels."""
    meta = _supported_meta(x, layer)
    n_out = meta.n // 2 if meta is not None and gated else layer.out_features
    if (meta is None or (gated and meta.n % 2) or not _fits(norm_weight, (meta.k,), x)
            or not _fits(residual, (*x.shape[:-1], n_out), x)):
        return quant_linear_ref(x, layer, residual, norm_weight=norm_weight, eps=eps, gated=gated)
    if norm_weight is None and not gated:
        native = _native_blackwell(x, layer, residual)
        if native is not None:
            return native
    lead = x.shape[:-1]
    x2 = x.reshape(-1, meta.k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    m = x2.shape[0]
    res2 = residual.view(m, n_out) if residual is not None else None
    if m == 0:
        return residual if residual is not None else x.new_empty(*lead, n_out)
    if norm_weight is not None and m > 16:
        x2, norm_weight = rms_norm(x2, norm_weight, eps)[0], None
    gemv = quant_gemv.applies(x2, layer, meta, res2, norm_weight, gated)  # 1-16 rows of an NVFP4 / int4 layer
    if gemv is not None:
        y = quant_gemv.gemv(x2, layer, meta, gemv, res2, gated)
    elif m < PREFILL_DEQUANT_MIN_M:
        y = _gemm_triton(x2, layer, meta, res2, norm_weight=norm_weight, eps=eps, gated=gated)
    elif gated:
        y = silu_mul(_prefill(x2, layer, meta, None))
        if res2 is not None:
            y = res2.add_(y)
    else:
        y = _prefill(x2, layer, meta, res2)
    return residual if residual is not None else y.view(*lead, n_out)


# ---------------------------------------------------------------------------------------------------------------
# --deterministic (models/deterministic.py): each row's arithmetic the same whatever shares its call

DETERMINISTIC_BLOCK_M = 16  # rows of x a program: the smallest tensor-core tile, for every row count


def deterministic_config(meta: QuantMeta, gated: bool = False) -> LaunchConfig:
    """A layer's one launch in --deterministic mode, from its format and shape (and the SwiGLU fold) alone, never
    from the row count: the dot path's config for a 16-row tile, taken for one decode row, a verify block and
    a long prefill alike. A row's K is then always reduced in the same order: SPLIT slices of BLOCK_K inside
    the program, summed in one fixed order after the loop, nothing split across programs."""
    cfg = launch_config(meta, DETERMINISTIC_BLOCK_M, gated, post_scale=False)  # one rounding for every row count
    if not (cfg.use_dot and cfg.block_m == DETERMINISTIC_BLOCK_M):
        raise AssertionError(f"the 16-row config of {meta.scheme} is not a 16-row dot tile: {cfg}")
    return cfg


def deterministic_quant_linear_ref(x: torch.Tensor, layer, *, gated: bool = False,
                                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """The definition (and CPU path): the weight dequantized to x's dtype, as quant_linear_ref does, then every
    row its own float32 matrix-vector product and the kernel's epilogue (deterministic_linear_ref): no row
    count enters a row's arithmetic. x already permuted for act-order layers."""
    return deterministic_linear_ref(x, dequantize_layer(layer, x.dtype), layer.bias, gated=gated, residual=residual)


def deterministic_quant_linear_triton(x: torch.Tensor, layer, *, gated: bool = False,
                                      residual: torch.Tensor | None = None,
                                      meta: QuantMeta | None = None) -> torch.Tensor:
    """Launch without the dispatch's checks (contiguous 2-D x; tests call it on CPU under TRITON_INTERPRET=1): the
    quant kernel's dot path with `deterministic_config`, one compiled variant for every M, no norm fold."""
    meta = meta or quant_meta(layer)
    if x.shape[0] == 0:
        return residual if residual is not None else x.new_empty(0, meta.n // 2 if gated else meta.n)
    return _gemm_triton(x, layer, meta, residual, deterministic_config(meta, gated), gated=gated,
                        kernel=_deterministic_quant_kernel, post_scale=False)


def deterministic_quant_linear(x: torch.Tensor, layer, *, gated: bool = False,
                               residual: torch.Tensor | None = None) -> torch.Tensor:
    """layer(x) for a 2-D x (SwiGLU over [gate; up] with `gated`; added into `residual` in place with it), a row's
    bits independent of the other rows: the kernel where Triton runs and reads the layout; a layout it does not
    read dequantized to x's dtype for the bf16 batch-invariant GEMM (slower, still row-invariant); on CPU the
    row-by-row reference. Never the dequantize-then-cuBLAS prefill path, whose kernel follows the row count."""
    perm = getattr(layer, "perm", None)
    if perm is not None:  # act-order: the columns gathered, each row on its own
        x = x.index_select(-1, perm)
    if not x.is_contiguous():
        x = x.contiguous()
    meta = _supported_meta(x, layer) if x.dim() == 2 else None
    if meta is not None and not (gated and meta.n % 2) and \
            _fits(residual, (x.shape[0], meta.n // 2 if gated else meta.n), x):
        return deterministic_quant_linear_triton(x, layer, gated=gated, residual=residual, meta=meta)
    if use_triton(x):
        return deterministic_linear(x, dequantize_layer(layer, x.dtype).contiguous(), layer.bias, gated=gated,
                                    residual=residual)
    return deterministic_quant_linear_ref(x, layer, gated=gated, residual=residual)
