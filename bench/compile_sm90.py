"""Compile Triton kernels for sm_90 on a machine without a GPU: catches frontend and type errors (a reassigned
argument that specialised to a constant, a branch whose two sides disagree) before device time is spent.

Triton's CUDA backend ships its own ptxas, so `triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`
runs anywhere. Use the device's Triton (3.6 on the lent H100/H200):
    pip download --no-deps triton==3.6.0 -d /tmp/t36 && pip install --no-deps --target /tmp/t36site /tmp/t36/*.whl
    PYTHONPATH=/tmp/t36site:. python bench/compile_sm90.py
Each case names the kernel and its constexprs as the wrappers launch them; prints one line a case with the
registers and stack bytes a thread of the compiled cubin (`cuobjdump -res-usage`; spills live on the stack),
exits 1 on any failure (a case marked `no_spill` fails if it has a stack). Add a case when a kernel's signature
or a compile-time branch changes.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from blockspec.kernels import deterministic_linear as dl  # noqa: E402
from blockspec.kernels import gated_deltanet as gdn  # noqa: E402
from blockspec.kernels import grouped_conv as gc  # noqa: E402
from blockspec.kernels import moe_grouped as mg  # noqa: E402
from blockspec.kernels import paged_attention as pa  # noqa: E402
from blockspec.kernels import quant_gemv as qv  # noqa: E402
from blockspec.kernels import quant_linear as ql  # noqa: E402
from blockspec.kernels import rms_norm as rn  # noqa: E402
from blockspec.kernels import selector_walk as sw  # noqa: E402
from blockspec.kernels import skinny_linear as sl  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def build(fn, types: dict[str, str], consts: dict, div16: tuple[str, ...] = (), num_warps: int = 4,
          num_stages: int = 3):
    """The compiled kernel for sm_90, constexprs left out of `consts` at their defaults (PDL off)."""
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default and p.name not in consts},
              **consts}
    sig = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=TARGET,
                          options={"num_warps": num_warps, "num_stages": num_stages})


def compile_case(fn, types: dict[str, str], consts: dict, div16: tuple[str, ...] = (), num_warps: int = 4,
                 num_stages: int = 3, no_spill: bool = False, ptx_has: tuple[str, ...] = ()) -> tuple[int, int] | None:
    """Compile one case; (registers, stack bytes) a thread of the cubin Triton built (spills live on the stack),
    or None where Triton's cuobjdump is not bundled. `ptx_has`: instructions the PTX must contain (the PDL wait,
    the release)."""
    kernel = build(fn, types, consts, div16, num_warps, num_stages)
    missing = [i for i in ptx_has if i not in kernel.asm["ptx"]]
    if missing:
        raise AssertionError(f"the PTX lacks {missing}")
    usage = resources(kernel.asm["cubin"])
    if no_spill and usage is not None and usage[1]:
        raise AssertionError(f"spills: {usage[1]} stack bytes a thread ({usage[0]} registers)")
    return usage


def cuobjdump(cubin: bytes, *flags: str) -> str | None:
    """Triton's bundled cuobjdump over a cubin (its report), or None where it is not bundled."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        Path(path).write_bytes(cubin)
        return subprocess.run([str(tool), *flags, path], capture_output=True, text=True, check=True).stdout


def resources(cubin: bytes) -> tuple[int, int] | None:
    report = cuobjdump(cubin, "-res-usage")
    if report is None:
        return None
    regs, stack = re.search(r"REG:(\d+)", report), re.search(r"STACK:(\d+)", report)
    return int(regs.group(1)), int(stack.group(1))


def cases() -> list[tuple[str, tuple, dict]]:
    out = []
    bf16 = {n: "*bf16" for n in ("X", "W", "B", "NW", "Y", "W2", "Y2", "XN")}
    skinny = {**bf16, "M": "i32", "N_OUT": "i32", "eps": "fp32", "N2": "i32", "TILES1": "i32", "WS": "*fp32",
              "CNT": "*i32"}
    base = dict(K=2048, HAS_BIAS=False, HAS_NORM=True, GATED=False, HAS_RES=False, DOT_PRECISION="tf32")
    for dot in (False, True):
        tile = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128) if dot else dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024)
        for pair, norm_out in ((False, False), (True, False), (False, True)):
            out.append((f"skinny_linear dot={dot} pair={pair} norm_out={norm_out}",
                        (sl._skinny_linear_kernel, skinny, dict(base, USE_DOT=dot, PAIR=pair, NORM_OUT=norm_out,
                                                                 **tile)),
                        dict(div16=("X", "W", "Y", "N_OUT"))))
    out.append(("skinny_linear gated + residual + bias",
                (sl._skinny_linear_kernel, skinny, dict(base, HAS_BIAS=True, GATED=True, HAS_RES=True, USE_DOT=False,
                                                         PAIR=False, NORM_OUT=False, BLOCK_M=1, BLOCK_N=8,
                                                         BLOCK_K=1024)), {}))
    pdl_ptx = ("griddepcontrol.wait", "griddepcontrol.launch_dependents")  # wait_for_inputs, release_dependents
    for split, n_k in ((2, (2048, 4096)), (8, (128, 2048))):  # a residual projection and an MoE router, K split
        bn, bk, warps, stages = sl._launch_config(16, *n_k)
        out.append((f"skinny_linear split_k={split} N={n_k[0]}", (sl._skinny_linear_kernel, skinny, dict(
            base, K=n_k[1], HAS_NORM=False, HAS_RES=split == 2, USE_DOT=True, PAIR=False, NORM_OUT=False, BLOCK_M=16,
            BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, PDL=True)),
            dict(num_warps=warps, num_stages=stages, no_spill=True, ptx_has=pdl_ptx + ("atom.",))))
    for dot in (False, True):  # programmatic dependent launch: the wait and the release
        tile = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128) if dot else dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024)
        out.append((f"skinny_linear PDL dot={dot}", (sl._skinny_linear_kernel, skinny, dict(
            base, USE_DOT=dot, PAIR=False, NORM_OUT=False, PDL=True, **tile)),
            dict(div16=("X", "W", "Y", "N_OUT"), ptx_has=pdl_ptx)))
    quant = {n: "*u8" for n in ("QW", "S", "Z")}
    quant.update(X="*bf16", GS="*fp32", B="*bf16", NW="*bf16", Y="*bf16", M="i32", N="i32", eps="fp32")
    for scheme, dot, tile in (("int4", True, dict(BLOCK_M=8, BLOCK_N=16, BLOCK_K=128, SPLIT=4)),
                              ("nvfp4", False, dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=512, SPLIT=1))):
        types = dict(quant, S="*bf16" if scheme == "int4" else "*u8", Z="*i32" if scheme == "int4" else "*u8")
        out.append((f"quant_linear PDL {scheme} dot={dot}", (ql._quant_linear_kernel, types, dict(
            SCHEME=scheme, K=4096, G=128 if scheme == "int4" else 16, NG=32 if scheme == "int4" else 256,
            SCALE_ROW_DIV=1, HAS_ZERO=scheme == "int4", PER_ROW=False, HAS_GS=scheme == "nvfp4", GS_FACTOR=1.0,
            HAS_BIAS=False, HAS_NORM=False, GATED=False, HAS_RES=True, USE_DOT=dot, FAST=True, DOT_PRECISION="tf32",
            PDL=True, **tile)),
            dict(div16=("X", "QW", "S", "Y"), ptx_has=pdl_ptx)))
    # the decoder's folds on Qwen3-8B's int4 g128 / NVFP4 shapes (qkv: norm; gate_up: norm + SwiGLU), as quant_linear
    # launches them: the dot path at 1 and 16 rows, NVFP4's one-row reduction path, 64-row tiles (SwiGLU only);
    # NVFP4 in the lane order its GPU layers load in, bar the norm folds (no model folds a norm into a quantized
    # projection, models/layers/linear.folded_linear; lane order adds 8 spilled bytes to the 16-row qkv fold)
    folds = [(m, "qkv", 6144, True, False) for m in (1, 16)] + [(m, "gate_up", 24576, True, True) for m in (1, 16)]
    for scheme, (m, label, n, norm, gated) in itertools.product(("int4", "nvfp4"),
                                                                folds + [(64, "gate_up", 24576, False, True)]):
        group = 128 if scheme == "int4" else 16
        meta = ql.QuantMeta(scheme, n, 4096, group, 4096 // group, 1, False, scheme == "int4", scheme == "nvfp4")
        cfg = ql.launch_config(meta, m, gated)
        types = dict(quant, S="*bf16" if scheme == "int4" else "*u8", Z="*i32" if scheme == "int4" else "*u8")
        out.append((f"quant_linear {scheme} {label} m={m} norm={norm} gated={gated} dot={cfg.use_dot}", (
            ql._quant_linear_kernel, types, dict(
                SCHEME=scheme, K=4096, G=group, NG=4096 // group, SCALE_ROW_DIV=1, HAS_ZERO=meta.has_zero,
                PER_ROW=False, HAS_GS=meta.has_gs, GS_FACTOR=1.0, HAS_BIAS=False, HAS_NORM=norm, GATED=gated,
                HAS_RES=False, USE_DOT=cfg.use_dot, FAST=True, DOT_PRECISION="tf32", BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=cfg.split, PDL=True,
                LANE=scheme == "nvfp4" and not norm)),
            dict(div16=("X", "QW", "S", "Y", "NW"), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                 no_spill=True, ptx_has=pdl_ptx)))
    # --deterministic: the quantized GEMM's one config a layer (the 16-row dot tile), compiled unspecialised on M
    det_quant = (("int4", 128, dict(S="*bf16", Z="*i32"), False), ("nvfp4", 16, dict(S="*u8", Z="*u8"), False),
                 ("int8", 4096, dict(QW="*i8", S="*bf16", Z="*bf16"), True), ("fp8", 128, dict(S="*fp32", Z="*fp32"),
                                                                              False))
    for (scheme, group, tensors, per_row), (gated, res) in itertools.product(
            det_quant, ((False, False), (True, False), (False, True))):
        if scheme in ("int8", "fp8") and gated:
            continue
        n = 24576 if gated else 4096
        meta = ql.QuantMeta(scheme, n, 4096, group, -(-4096 // group), 128 if scheme == "fp8" else 1, per_row,
                            scheme == "int4", scheme == "nvfp4")
        cfg = ql.deterministic_config(meta, gated)
        out.append((f"deterministic quant_linear {scheme} gated={gated} residual={res}", (
            ql._deterministic_quant_kernel, dict(quant, **tensors), dict(
                SCHEME=scheme, K=4096, G=group, NG=meta.n_groups, SCALE_ROW_DIV=meta.scale_row_div,
                HAS_ZERO=meta.has_zero, PER_ROW=per_row, HAS_GS=meta.has_gs, GS_FACTOR=1.0, HAS_BIAS=False,
                HAS_NORM=False, GATED=gated, HAS_RES=res, USE_DOT=True, FAST=scheme in ("int4", "nvfp4"),
                DOT_PRECISION="tf32", BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                SPLIT=cfg.split)),
            dict(div16=("X", "QW", "S", "Y"), num_warps=cfg.num_warps, num_stages=cfg.num_stages)))
    walk = {"UNARY": "*bf16", "CAND": "*i64", "CTX": "*bf16", "ANCHOR": "*i64", "PRED": "*bf16", "SUCC": "*bf16",
            "TEMP": "*fp32", "NOISE": "*fp32", "PATH": "*i64", "Q": "*fp32", "P": "i32"}
    for sampling, rank in ((False, 64), (True, 256)):  # the selector walk: SmolLM2's drafter, z-lab's rank 256
        out.append((f"selector_walk sampling={sampling} rank={rank}", (sw._walk_kernel, walk, dict(
            K=16, RANK=rank, BLOCK_K=16, BLOCK_R=rank, SAMPLING=sampling, PDL=True)),
            dict(num_warps=4 if 16 * rank >= 4096 else 1, no_spill=True, ptx_has=pdl_ptx)))
    gemv = {"X": "*bf16", "QW": "*u8", "S": "*u8", "GS": "*fp32", "Y": "*bf16", "N": "i32", "WS": "*fp32",
            "CNT": "*i32", "NP": "i32"}
    for k, has_gs, cfg, res in ((4096, True, qv.WIDE, False), (5120, False, qv.WIDE, True),
                                (12288, True, qv.NARROW, True), (4096, True, qv.NARROWEST, True)):
        kern, extra = (qv._wide_kernel, {}) if cfg.parts == 1 else (qv._parts_kernel, dict(P=cfg.parts))
        out.append((f"quant_gemv nvfp4 K={k} HAS_GS={has_gs} HAS_RES={res} {cfg}", (kern, gemv, dict(
            K=k, HAS_GS=has_gs, BN=cfg.block, SPANS=cfg.spans, HAS_RES=res, PDL=True, LANE=True, **extra)),
            dict(div16=("X", "QW", "S", "Y"), num_warps=cfg.warps, num_stages=1, no_spill=True,
                 ptx_has=pdl_ptx + ("mma.sync.aligned.m16n8k16",))))
    gemv_int4 = {**gemv, "S": "*i32"}  # int4: the scale|zero words
    # int4 (G = 128 and 32) and SwiGLU folded (gate|up), both kernels
    # (and the one-part kernel releasing its dependents right after its wait: gate|up's launches, EARLY)
    for int4, group, gated, k, cfg in ((True, 128, False, 4096, qv.WIDE), (True, 32, True, 4096, qv.WIDE),
                                       (True, 128, False, 12288, qv.NARROW), (False, 16, True, 4096, qv.WIDE),
                                       (True, 128, True, 4096, qv.NARROW),
                                       (False, 16, True, 4096, replace(qv.WIDE, early=True)),
                                       (True, 128, True, 4096, replace(qv.INT4_WIDE, early=True))):
        kern, extra = (qv._wide_kernel, dict(EARLY=cfg.early)) if cfg.parts == 1 else \
            (qv._parts_kernel, dict(P=cfg.parts))
        out.append((f"quant_gemv int4={int4} G={group} GATED={gated} K={k} {cfg}", (
            kern, gemv_int4 if int4 else gemv, dict(K=k, HAS_GS=not int4, BN=cfg.block, SPANS=cfg.spans, PDL=True,
                                                    INT4=int4, G2=group // 2, GATED=gated, LANE=not int4,
                                                    **extra)),
            dict(div16=("X", "QW", "S", "Y"), num_warps=cfg.warps, num_stages=1, no_spill=True,
                 ptx_has=pdl_ptx + ("mma.sync.aligned.m16n8k16",))))
    # the streamed one-row kernel (weights a step ahead, the first step before the PDL wait)
    for int4, gated, res, k, cfg in ((False, False, True, 4096, qv.GemvConfig(8, 4, 4, True)),
                                     (False, True, False, 4096, qv.GemvConfig(2, 4, 1, True, True)),
                                     (True, True, False, 4096, qv.GemvConfig(2, 4, 1, True)),
                                     (True, False, True, 12288, qv.GemvConfig(8, 4, 4, True, True))):
        out.append((f"quant_gemv stream int4={int4} GATED={gated} HAS_RES={res} K={k} {cfg}", (
            qv._stream_kernel, gemv_int4 if int4 else gemv, dict(
                K=k, HAS_GS=not int4, BN=cfg.block, SPANS=cfg.spans, P=cfg.parts, HAS_RES=res, PDL=True, INT4=int4,
                G2=64 if int4 else 8, GATED=gated, EARLY=cfg.early, LANE=not int4)),
            dict(div16=("X", "QW", "S", "Y"), num_warps=cfg.warps, num_stages=1, no_spill=True,
                 ptx_has=pdl_ptx + ("mma.sync.aligned.m16n8k16",))))
    rows = {**gemv, "M": "i32"}
    for int4, gated, res, k, two, cfg in ((False, True, False, 4096, True, qv.GemvConfig(4, 2, 1, True, True)),
                                          (False, False, True, 12288, True, qv.GemvConfig(8, 2, 8, True)),
                                          (True, False, False, 4096, False, qv.GemvConfig(16, 4, 8, True, True)),
                                          (True, True, False, 4096, True, qv.GemvConfig(4, 2, 1, True))):
        out.append((f"quant_gemv rows stream int4={int4} GATED={gated} HAS_RES={res} K={k} TWO={two} {cfg}", (
            qv._rows_kernel, {**(gemv_int4 if int4 else gemv), "M": "i32"}, dict(
                K=k, HAS_GS=not int4, BN=cfg.block, SPANS=cfg.spans, P=cfg.parts, TWO=two, HAS_RES=res, PDL=True,
                INT4=int4, G2=64 if int4 else 8, GATED=gated, STREAM=True, EARLY=cfg.early, LANE=not int4)),
            dict(div16=("X", "QW", "S", "Y"), num_warps=cfg.warps, num_stages=1, no_spill=True,
                 ptx_has=pdl_ptx + ("mma.sync.aligned.m16n8k16",))))
    # R blocks a program sharing each span's x loads (GemvConfig.groups; swept by bench/quant_gemv.py --groups), and K
    # split over programs (GemvConfig.splits: float32 sums to a workspace, the last program to arrive adds them). R = 4
    # sits at the register limit: 248 registers with Triton 3.6 (the lent GPUs'), 8 bytes of spill with 3.9, so only
    # R <= 2 must not spill here
    for int4, gated, res, k, cfg in ((False, True, False, 4096, qv.GROUPED_WIDE),
                                     (False, False, False, 2048, qv.GROUPED_MID),
                                     (False, True, False, 4096, qv.GemvConfig(4, 1, 1, True, True, groups=2)),
                                     (False, True, False, 4096, qv.GemvConfig(4, 2, 1, groups=2)),
                                     (False, False, False, 4096, qv.GemvConfig(4, 1, 4, True, True, groups=2)),
                                     (False, False, True, 12288, qv.GemvConfig(4, 1, 4, True, True, groups=2)),
                                     (False, False, False, 4096, qv.GemvConfig(4, 1, 4, groups=4)),
                                     (True, True, False, 4096, qv.GemvConfig(4, 1, 1, True, True, groups=2)),
                                     (False, False, True, 12288, qv.GemvConfig(4, 1, 4, groups=2, splits=2)),
                                     (False, False, True, 12288,
                                      qv.GemvConfig(4, 1, 4, True, True, groups=2, splits=4)),
                                     (False, False, False, 4096, qv.GemvConfig(4, 1, 2, groups=2, splits=2)),
                                     (False, True, False, 4096, qv.GemvConfig(4, 1, 2, groups=2, splits=2)),
                                     (False, False, True, 4096, qv.GemvConfig(8, 2, 4, True, True, splits=2)),
                                     (True, False, True, 12288, qv.GemvConfig(4, 1, 4, groups=2, splits=2)),
                                     (False, False, True, 17408, qv.SPLIT_ROWS),  # Qwen3.6-27B's down, dispatched
                                     (True, False, True, 17408, qv.SPLIT_ROWS),
                                     (False, False, False, 6144, qv.SPLIT_ROWS)):
        out.append((f"quant_gemv rows R={cfg.groups} splits={cfg.splits} int4={int4} GATED={gated} HAS_RES={res} "
                    f"K={k} {cfg}", (
            qv._rows_kernel, {**(gemv_int4 if int4 else gemv), "M": "i32"}, dict(
                K=k, HAS_GS=not int4, BN=cfg.block, SPANS=cfg.spans, P=cfg.parts, TWO=True, HAS_RES=res, PDL=True,
                INT4=int4, G2=64 if int4 else 8, GATED=gated, STREAM=cfg.stream, EARLY=cfg.early, R=cfg.groups,
                SPLITS=cfg.splits, LANE=not int4)),
            dict(div16=("X", "QW", "S", "Y"), num_warps=cfg.warps, num_stages=1, no_spill=cfg.groups <= 2,
                 ptx_has=pdl_ptx + ("mma.sync.aligned.m16n8k16",)
                 + (("atom.global.gpu.acq_rel.add",) if cfg.splits > 1 else ()))))
    # one row on the rows kernel as dispatched: ROWS_ONE_LONG_K (Qwen3-8B's down, NVFP4 and int4; the residual
    # added), SPLIT_ONE (Qwen3.6-27B's out_proj and down; Llama-3-8B's down), ROWS_ONE_WIDE* (the 8B's and the 27B's
    # gate|up with SwiGLU) and ROWS_ONE (the 27B's and the 35B's in_proj and q|gate|k|v; int4's gate|up with SwiGLU)
    for k, cfg, gated, int4 in ((12288, qv.ROWS_ONE_LONG_K, False, False), (12288, qv.ROWS_ONE_LONG_K, False, True),
                                (14336, qv.SPLIT_ONE, False, False), (6144, qv.SPLIT_ONE, False, False),
                                (17408, qv._fit_split(qv.SPLIT_ONE, 17408), False, False),
                                (4096, qv.ROWS_ONE_WIDE, True, False), (5120, qv.ROWS_ONE_WIDE_LONG_K, True, False),
                                (5120, qv.ROWS_ONE, False, False), (2048, qv.ROWS_ONE, False, False),
                                (4096, qv.ROWS_ONE, True, True), (5120, qv.ROWS_ONE, True, True),
                                (14336, qv.SPLIT_ONE, False, True)):
        out.append((f"quant_gemv rows one row{' int4' if int4 else ''}{' gated' if gated else ''} K={k} {cfg}", (
            qv._rows_kernel, {**gemv_int4, "M": "i32"} if int4 else rows, dict(
                K=k, HAS_GS=not int4, BN=cfg.block, SPANS=cfg.spans, P=cfg.parts, TWO=False,
                HAS_RES=not gated, PDL=True, INT4=int4, G2=64 if int4 else 8, GATED=gated,
                STREAM=cfg.stream, EARLY=cfg.early, R=cfg.groups, SPLITS=cfg.splits, LANE=not int4)),
            dict(div16=("X", "QW", "S", "Y"), num_warps=cfg.warps, num_stages=1, no_spill=True,
                 ptx_has=pdl_ptx + ("mma.sync.aligned.m16n8k16",)
                 + (("atom.global.gpu.acq_rel.add",) if cfg.splits > 1 else ()))))
    tuned = [(k, True, cfg, n < k) for (n, k), cfg in qv.ROWS_TUNED.items()]  # Qwen3.6-27B; down adds the residual
    for k, two, cfg, res in ((4096, False, qv.ROWS_FEW, False), (12288, True, qv.ROWS_LONG_K, True),
                             (4096, True, qv.ROWS_WIDE, True), (5120, False, qv._fit_k(qv.ROWS_FEW, 5120), False),
                             *tuned):
        out.append((f"quant_gemv rows K={k} TWO={two} HAS_RES={res} {cfg}", (qv._rows_kernel, rows, dict(
            K=k, HAS_GS=True, BN=cfg.block, SPANS=cfg.spans, P=cfg.parts, TWO=two, HAS_RES=res, PDL=True,
            R=cfg.groups, LANE=True)),
            dict(div16=("X", "QW", "S", "Y"), num_warps=cfg.warps, num_stages=1, no_spill=True,
                 ptx_has=pdl_ptx + ("mma.sync.aligned.m16n8k16",))))
    for int4, group, gated, k, two, cfg in ((True, 128, False, 12288, True, qv.ROWS_LONG_K),
                                            (True, 64, True, 4096, True, qv.ROWS_WIDE),
                                            (True, 128, False, 4096, False, qv.ROWS_FEW),
                                            (False, 16, True, 4096, True, qv.ROWS_WIDE)):
        out.append((f"quant_gemv rows int4={int4} G={group} GATED={gated} K={k} TWO={two} {cfg}", (
            qv._rows_kernel, {**(gemv_int4 if int4 else gemv), "M": "i32"}, dict(
                K=k, HAS_GS=not int4, BN=cfg.block, SPANS=cfg.spans, P=cfg.parts, TWO=two, PDL=True, INT4=int4,
                G2=group // 2, GATED=gated, LANE=not int4)),
            dict(div16=("X", "QW", "S", "Y"), num_warps=cfg.warps, num_stages=1, no_spill=True,
                 ptx_has=pdl_ptx + ("mma.sync.aligned.m16n8k16",))))
    moe = {"X": "*bf16", "IDS": "*i64", "QW": "*u8", "S": "*u8", "GS": "*fp32", "SQW_OFF16": "i64", "SS_OFF16": "i64",
           "SGS_OFF": "i64", "OUT": "*bf16"}
    # 35B-A3B's NVFP4 experts, one token, with and without the shared expert as slot k
    for gated, n_w, k, shared in ((True, 1024, 2048, True), (False, 2048, 512, True), (True, 1024, 2048, False)):
        out.append((f"quant_gemv moe gated={gated} SHARED={shared}", (qv._moe_kernel, moe, dict(
            N_W=n_w, K=k, W_STRIDE=n_w * k // 2, S_STRIDE=n_w * k // 16, TOP_K=8, E=256, SHARED=shared, HAS_GS=True,
            GATED=gated, X_PER_SLOT=not gated, BN=8 * qv.WIDE.warps, SPANS=qv._moe_spans(k), PDL=True)),
            dict(div16=("X", "QW", "S", "OUT"), num_warps=qv.WIDE.warps, num_stages=1, no_spill=True,
                 ptx_has=pdl_ptx + ("mma.sync.aligned.m16n8k16",))))
    moe_rows = {"X": "*bf16", "QW": "*u8", "S": "*u8", "GS": "*fp32", "SQW_OFF16": "i64", "SS_OFF16": "i64",
                "SGS_OFF": "i64", "OUT": "*bf16", "SORTED": "*i32",
                "ITEM_EXPERT": "*i32", "ITEM_START": "*i32", "ITEM_COUNT": "*i32", "NUM_ITEMS": "*i32"}
    for gated, n_w, k, shared in ((True, 1024, 2048, True), (False, 2048, 512, True), (True, 2048, 3072, False),
                                  (False, 3072, 1024, False)):  # 35B-A3B's and 122B-A10B's NVFP4 experts
        cfg = qv._fit_k(qv.MOE_ROWS, k)
        out.append((f"quant_gemv moe rows gated={gated} K={k} SHARED={shared}", (qv._moe_rows_kernel, moe_rows, dict(
            N_W=n_w, K=k, W_STRIDE=n_w * k // 2, S_STRIDE=n_w * k // 16, SLOTS=9 if shared else 8, E=256,
            SHARED=shared, HAS_GS=True, GATED=gated, BN=cfg.block, SPANS=cfg.spans, P=cfg.parts, PDL=True)),
            dict(div16=("X", "QW", "S", "OUT"), num_warps=cfg.warps, num_stages=1, no_spill=True,
                 ptx_has=pdl_ptx + ("mma.sync.aligned.m16n8k16",))))
    conv = {"X": "*bf16", "DYN": "*bf16", "BASE": "*bf16", "BIDX": "*i64", "OUT": "*bf16", "H": "i32",
            "stride_dt": "i32", "stride_dj": "i32"}
    out.append(("grouped_conv PDL", (gc._grouped_conv_kernel, conv, dict(TAPS=2, GROUP=16, BLOCK=1024, PDL=True)),
                dict(no_spill=True, ptx_has=pdl_ptx)))
    out.append(("rms_norm PDL", (rn._rms_norm_kernel, {"X": "*bf16", "R": "*bf16", "W": "*bf16", "Y": "*bf16",
                                                       "RO": "*bf16", "n": "i32", "eps": "fp32"},
                                 dict(HAS_RES=True, BLOCK=4096, PDL=True)), dict(ptx_has=pdl_ptx)))
    out.append(("rms_norm PDL early (2-16 rows)", (rn._rms_norm_kernel, {
        "X": "*bf16", "R": "*bf16", "W": "*bf16", "Y": "*bf16", "RO": "*bf16", "n": "i32", "eps": "fp32"},
        dict(HAS_RES=True, BLOCK=4096, PDL=True, EARLY=True)), dict(ptx_has=pdl_ptx)))
    merge = {n: "i32" for n in pa._merge_splits_kernel.arg_names}
    merge.update(Part="*fp32", M="*fp32", L="*fp32", Out="*bf16", SINKS="*bf16", GATE="*bf16", SEQ_LENS="*i32",
                 KV_START="*i32", Q_START="*i32")
    for head_dim, gate, sinks in ((128, False, False), (256, True, False), (64, False, True)):
        label = f"merge_splits head_dim={head_dim} gate={gate} sinks={sinks}{' early' if head_dim == 128 else ''}"
        out.append((label, (pa._merge_splits_kernel, merge, dict(
            GROUP=8, HEAD_DIM=head_dim, BLOCK_M=16, BLOCK_N=64, CHUNK=pa._MERGE_CHUNK, WINDOWED=sinks,
            HAS_Q_START=False, HAS_SINKS=sinks, HAS_GATE=gate, PDL=True, EARLY=head_dim == 128)),
            dict(num_warps=pa._merge_warps(head_dim), no_spill=True, ptx_has=pdl_ptx, div16=(
                "Part", "Out", "GATE", "stride_ob", "stride_oh", "stride_os", "stride_om", "stride_t", "stride_h",
                "stride_gt", "stride_gh"))))
    paged = {n: "i32" for n in pa._paged_attention_kernel.arg_names}
    paged.update(Q="*bf16", K="*bf16", V="*bf16", Out="*fp32", M="*fp32", L="*fp32", BT="*i32", SEQ_LENS="*i32",
                 KV_START="*i32", Q_START="*i32", scale="fp32")
    # what a launch's JIT specialises on: the pointers and the strides of the caches, q, the block table and the
    # partials are multiples of 16 (without it the cases compiled to 255 registers where the launches take 64-216)
    paged_div = ("Q", "K", "V", "Out", "M", "L", "BT", "stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh",
                 "stride_vb", "stride_vs", "stride_vh", "stride_bt", "stride_ob", "stride_oh", "stride_os", "stride_om")
    for split_tiles in (0, 8):
        out.append((f"paged_attention SPLIT_TILES={split_tiles}", (pa._paged_attention_kernel, paged, dict(
            GROUP=8, HEAD_DIM=256, PAGE=16, BLOCK_M=16, BLOCK_N=64, CAUSAL=True, WINDOWED=False, HAS_Q_START=False,
            ROW_TILES=1, SPLIT_TILES=split_tiles)), dict(num_stages=2, div16=paged_div)))
    out.append(("paged_attention SPLIT_TILES=8 windowed (GPT-OSS --deterministic)", (pa._paged_attention_kernel, paged,
                dict(GROUP=8, HEAD_DIM=64, PAGE=16, BLOCK_M=pa._det_block_m(64), BLOCK_N=64, CAUSAL=True,
                     WINDOWED=True, HAS_Q_START=False, ROW_TILES=1, SPLIT_TILES=8)),
                dict(num_stages=2, div16=paged_div)))
    for head_dim, block_m, rows in ((64, 128, 48), (128, 16, 8), (128, 64, 128), (256, 16, 6), (256, 32, 96)):
        block_n, warps = pa._decode_tile(rows)  # the default path's tiles
        out.append((f"paged_attention head_dim={head_dim} BLOCK_M={block_m}", (pa._paged_attention_kernel, paged, dict(
            GROUP=8, HEAD_DIM=head_dim, PAGE=16, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=True, WINDOWED=False,
            HAS_Q_START=False, ROW_TILES=1, SPLIT_TILES=0)), dict(num_stages=2, num_warps=warps, div16=paged_div,
                                                                  no_spill=True)))
    # batch-1 decode rows as launched under PDL (`decode_releases_early`): Qwen3-8B (4 heads a KV head), Qwen3.6-27B
    for head_dim, rows in ((128, 4), (256, 6)):
        block_n, warps = pa._decode_tile(rows)
        out.append((f"paged_attention decode rows head_dim={head_dim} PDL early", (pa._paged_attention_kernel, paged,
                    dict(GROUP=rows, HEAD_DIM=head_dim, PAGE=16, BLOCK_M=16, BLOCK_N=block_n, CAUSAL=True,
                         WINDOWED=False, HAS_Q_START=False, ROW_TILES=1, SPLIT_TILES=0, PDL=True, EARLY=True)),
                    dict(num_stages=2, num_warps=warps, div16=paged_div, no_spill=True, ptx_has=pdl_ptx)))
    ragged = {n: "i32" for n in pa._ragged_attention_kernel.arg_names}
    ragged.update(Q="*bf16", K="*bf16", V="*bf16", Out="*bf16", SINKS="*bf16", QUERY_INDEX="*i32", QUERY_POS="*i32",
                  KV_SLOTS="*i32", scale="fp32")
    ragged_div = ("Q", "K", "V", "Out", "QUERY_INDEX", "QUERY_POS", "KV_SLOTS", *(
        n for n in pa._ragged_attention_kernel.arg_names if n.startswith("stride")))
    for head_dim, group in ((64, 3), (128, 8), (256, 6)):  # SmolLM2, Qwen3-Coder, Qwen3.6-27B: 64-row tiles
        block_n, warps = pa._ragged_tile(head_dim)
        out.append((f"ragged_attention head_dim={head_dim} GROUP={group}", (pa._ragged_attention_kernel, ragged, dict(
            GROUP=group, HEAD_DIM=head_dim, BLOCK_Q=64 // group, BLOCK_M=64, BLOCK_N=block_n, WINDOWED=False,
            HAS_SINKS=False)), dict(num_stages=2, num_warps=warps, no_spill=True, div16=ragged_div)))
    fixed = {n: "i32" for n in pa._merge_fixed_splits_kernel.arg_names}
    fixed.update(Part="*fp32", M="*fp32", L="*fp32", Out="*bf16", SEQ_LENS="*i32", SINKS="*bf16")
    for sinks in (False, True):  # GPT-OSS's sinks join the merge
        out.append((f"merge_fixed_splits sinks={sinks}", (pa._merge_fixed_splits_kernel, fixed, dict(
            SPLIT=512, GROUP=4, HEAD_DIM=128, BLOCK_M=64, HAS_SINKS=sinks)), dict(num_warps=1)))
    grouped = {n: "*bf16" for n in ("A", "W", "WU", "SW", "SWU", "OUT", "QS", "QZ", "QGS", "BIAS")}
    grouped.update({n: "*i32" for n in ("SORTED", "ITEM_EXPERT", "ITEM_START", "ITEM_COUNT", "NUM_ITEMS", "IDS")})
    grouped.update(P="i32")
    scan = dict(grouped)  # a Qwen3.6-35B-A3B verify block, bf16: its pairs found by each program (no align launch)
    for gated, (n, k) in ((True, (512, 2048)), (False, (2048, 512))):
        cfg = mg.gemm_config(16, n, k, mg.max_items(16, 9, 257), gated)
        out.append((f"grouped_gemm scan gated={gated}", (mg._grouped_gemm_kernel, scan, dict(
            N_OUT=n, K=k, SLOTS=9, E=256, GATED=gated, SHARED=True, USE_DOT=True, DOT_PRECISION="tf32",
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SCHEME="none", G=1, NG=1, SCALE_ROW_DIV=1,
            HAS_ZERO=False, PER_ROW=False, HAS_GS=False, GS_FACTOR=1.0, FAST=False, W_STRIDE=0, S_STRIDE=0,
            Z_STRIDE=0, HAS_BIAS=False, CLAMPED=False, LIMIT=0.0, ALPHA=1.702, SCAN=True, TOP_K=8, PB=256, PDL=True)),
            dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, no_spill=True, ptx_has=pdl_ptx)))
    grouped.update(W="*u8", QS="*u8", QZ="*u8")
    for t in (1, 16):  # GPT-OSS experts: MXFP4 with biases and the clamped SwiGLU (gate_up)
        cfg = mg.gemm_config(t, 2880, 2880, mg.max_items(t, 4, 128), True, quantized=True)
        out.append((f"grouped_gemm mxfp4 bias T={t}", (mg._grouped_gemm_kernel, grouped, dict(
            N_OUT=2880, K=2880, SLOTS=4, E=128, GATED=True, SHARED=False, USE_DOT=cfg.use_dot, DOT_PRECISION="tf32",
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SCHEME="mxfp4", G=32, NG=90,
            SCALE_ROW_DIV=1, HAS_ZERO=False, PER_ROW=False, HAS_GS=False, GS_FACTOR=2.0 ** 26, FAST=True,
            W_STRIDE=5760 * 1440, S_STRIDE=5760 * 90, Z_STRIDE=5760 * 90, HAS_BIAS=True, CLAMPED=True, LIMIT=7.0,
            ALPHA=1.702, PDL=t == 1)), dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                             ptx_has=pdl_ptx if t == 1 else ())))
    route = {n: "*bf16" for n in ("L", "X", "WS", "W_OUT", "SW_OUT")}
    route.update({n: "*i32" for n in ("IDS_OUT", "SORTED", "ITEM_EXPERT", "ITEM_START", "ITEM_COUNT", "NUM_ITEMS")})
    route.update(T="i32", P="i32")
    for t, shared in ((1, False), (16, False), (16, True)):  # a decode token, a verify block (128 experts)
        slots = 8 + int(shared)
        out.append((f"route_align T={t} shared={shared}", (mg._route_align_kernel, route, dict(
            E=128, EP=128, TOP_K=8, KP=8, H=2048, RENORM=True, SHARED=shared, BLOCK_T=t, BLOCK_H=256, SLOTS=slots,
            NB=256 if shared else 128, CHUNK=mg.CHUNK, BLOCK_P=mg.BLOCK_P, ONE_TOKEN=t == 1, ONE_BLOCK=t > 1,
            PDL=True)), dict(num_warps=4, no_spill=True, ptx_has=pdl_ptx,
                             div16=("L", "X", "WS", "W_OUT", "SW_OUT", "IDS_OUT", "SORTED", "ITEM_EXPERT"))))
    chunk = {n: "i64" if n.startswith("s") and n[1] in "qkvabz" and "_" in n else "*bf16"
             for n in gdn._gdn_chunk_kernel.arg_names}
    chunk.update(SSM="*fp32", OUT="*fp32", READ="*i64", WRITE="*i64", COUNTS="*i64", scale="fp32", eps="fp32")
    for n_rows, heads in ((1, 32), (1, 48), (4, 32)):  # a 16-token verify block and its commit, as bf16 launches
        bv, warps = gdn._chunk_launch_config(n_rows, heads, 128)
        for out_on in (True, False):
            norm = out_on and gdn.verify_fuses_norm(n_rows, 16, heads, 128)
            out.append((f"gdn_chunk BV={bv} warps={warps} {'verify' if out_on else 'commit'} norm={norm}", (
                gdn._gdn_chunk_kernel, chunk, dict(
                    L=16, LP=16, H=heads, GROUP=heads // 16, DK=128, DV=128, BK=128, BV=bv, HAS_COUNTS=not out_on,
                    HAS_WRITE=not out_on, HAS_OUT=out_on, HAS_NORM=norm, ROUND_WN=norm, LEVELS=4,
                    DOT=gdn._chunk_dot(torch.bfloat16), PDL=True)),
                # whole heads on 4 warps spill a little (8-72 bytes) and still timed best (8 warps: 37.2 vs 29.8 us)
                dict(num_warps=warps, ptx_has=pdl_ptx, no_spill=bv < 128)))
    det = {n: "*bf16" for n in ("X", "W", "B", "Y")} | {"M": "i32", "N_OUT": "i32"}
    for gated, res in ((False, False), (True, False), (False, True)):
        out.append((f"deterministic_linear gated={gated} residual={res}", (dl._deterministic_linear_kernel, det, dict(
            K=4096, HAS_BIAS=False, GATED=gated, HAS_RES=res, DOT_PRECISION="tf32", BLOCK_M=16, BLOCK_N=32,
            BLOCK_K=128)), dict(div16=("X", "W", "Y"), num_stages=4)))
    return out


def main() -> int:
    failed = 0
    for label, (fn, types, consts), opts in cases():
        try:
            usage = compile_case(fn, types, consts, **opts)
            regs = f"  ({usage[0]} registers, {usage[1]} stack bytes)" if usage else ""
            print(f"ok    {label}{regs}")
        except Exception as exc:  # report every case, then fail
            failed += 1
            print(f"FAIL  {label}: {type(exc).__name__}: {str(exc)[-1500:]}")
    print(f"triton {triton.__version__}, sm_90: {len(cases()) - failed} compiled, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
