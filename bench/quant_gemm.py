"""Quantized GEMM microbenchmark (issue 14): the kernels of blockspec/kernels/quant_linear.py on the Qwen3-8B
projection shapes, 1 and 16 rows, every scheme, against bf16 skinny_linear and cuBLAS on the same logical shape.
GPU only. Prints a table last and writes quant_gemm.json to $OUT (else bench/results/).

Each timing is a CUDA-graph replay of one call (triton.testing.do_bench_cudagraph): launch overhead is not
counted, as inside the decode graphs. Successive calls read successive copies of the weight (ROTATE_BYTES in
all, > 3x the L2), so no call finds its weight in L2, as in a decode step.
"bytes" is what the kernel must read: the packed weight plus its scales
and zeros (activations and output are ~0.1% of it); GB/s = bytes / time, and "%copy" compares that with the
device-to-device copy bandwidth measured in the same run (read + write bytes per second, first_gpu.py). The
decode target is >= 80% for int4 g128 and NVFP4 at 1 row, and 16 rows not much slower than 1.

  python bench/quant_gemm.py                        # the table (default launch configs)
  python bench/quant_gemm.py --sweep                # + launch-config sweep (int4, nvfp4 by default)
  python bench/quant_gemm.py --sweep --schemes int4 --shapes o,down --rows 1
  python bench/quant_gemm.py --prefill 64,256,1024,4096   # tl.dot GEMM vs dequantize + cuBLAS (PREFILL_DEQUANT_MIN_M)
  python bench/quant_gemm.py --folds --schemes int4,nvfp4 --rows 1,4,16   # folded norm / SwiGLU / add vs launches
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

from blockspec.kernels import quant_linear as ql
from blockspec.kernels.activation import silu_mul
from blockspec.kernels.rms_norm import rms_norm
from blockspec.kernels.skinny_linear import skinny_linear

sys.path.insert(0, str(Path(__file__).resolve().parent))  # first_gpu.py sits beside this script
from first_gpu import copy_bandwidth  # noqa: E402

# name, N (out), K (in), epilogue as the decode layers run it (o / down add into the residual stream)
SHAPES = [("qkv", 6144, 4096, "plain"), ("o", 4096, 4096, "residual"), ("gate_up", 24576, 4096, "plain"),
          ("down", 4096, 12288, "residual"), ("lm_head", 151936, 4096, "plain")]
# gate|up with SwiGLU folded into the epilogue (GATED: the decoder's launch), only when named in --shapes
GATED_SHAPES = [("gate_up_swiglu", 24576, 4096, "gated")]
DEVICE = "cuda"  # the dry run of this script on CPU (TRITON_INTERPRET=1) sets "cpu"
SCHEME_VARIANTS = {  # scheme: the format as Qwen3-8B checkpoints of that kind store it
    "int4": dict(group=128),  # GPTQ / AWQ g128, asymmetric
    "nvfp4": dict(),
    "int8": dict(group=None),  # per channel, symmetric (no zeros)
    "fp8": dict(block=True),  # 128x128 block scales (Qwen3-8B-FP8)
}


def random_layer(scheme: str, n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> ql.QuantWeights:
    """Random codes on the GPU; scales sized so the dequantized weights have std ~0.02 (like a trained model)."""
    dev = DEVICE
    opts = SCHEME_VARIANTS[scheme]
    if scheme == "int4":
        g = opts["group"]
        return ql.QuantWeights(scheme, torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev),
                          torch.full((n, k // g), 0.004, dtype=dtype, device=dev),
                          torch.randint(6, 10, (n, k // g), dtype=torch.uint8, device=dev), None, g, n, k)
    if scheme == "int8":
        return ql.QuantWeights(scheme, torch.randint(-128, 128, (n, k), dtype=torch.int8, device=dev),
                          torch.full((n, 1), 0.0003, dtype=dtype, device=dev), None, None, None, n, k)
    if scheme == "fp8":
        w = (torch.randn(n, k, device=dev) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        return ql.QuantWeights(scheme, w, torch.full((-(-n // 128), -(-k // 128)), 0.0003, device=dev), None, None, 128,
                          n, k)
    codes = torch.randint(0x30, 0x3C, (n, k // 16), dtype=torch.uint8, device=dev)  # e4m3 0.5 .. 1.5
    return ql.QuantWeights(scheme, torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev),
                      codes.view(torch.float8_e4m3fn), None, torch.tensor(0.01, device=dev), 16, n, k)


def bytes_read(layer: ql.QuantWeights) -> int:
    """What the kernels stream (int4: packed weights + one int32 scale|zero a group, not scales and zeros)."""
    return ql.bytes_read(layer)


def bench(fn) -> float:
    """Microseconds per CUDA-graph replay."""
    return 1000 * triton.testing.do_bench_cudagraph(fn, rep=30)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


ROTATE_BYTES = 160 * 2**20  # > 3x the H100 / H200 L2 (50 MB): each timed call reads its weight from HBM


def rotation(layer: ql.QuantWeights) -> list[ql.QuantWeights]:
    """The layer and copies of it, ROTATE_BYTES in all: a graph replaying one weight would find it in L2
    (a 13 MB int4 projection fits), while the decode step streams every weight once."""
    copies = max(1, -(-ROTATE_BYTES // bytes_read(layer))) if DEVICE == "cuda" else 1
    fields = [f.name for f in dataclasses.fields(layer)]
    return [layer] + [ql.QuantWeights(**{k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                        for k, v in ((k, getattr(layer, k)) for k in fields)})
                      for _ in range(copies - 1)]


def quant_fn(x, layers, epilogue, res, cfg=None, fast=None):
    """One call per invocation, each on the next weight of the rotation (fixed per call once graph-captured)."""
    meta = ql.quant_meta(layers[0])
    turn = itertools.cycle(layers)

    def fn():
        return ql._gemm_triton(x, next(turn), meta, res if epilogue == "residual" else None, cfg, fast,
                               gated=epilogue == "gated")
    return fn


def check(x, layer, epilogue, cfg=None, fast=None) -> float:
    """Relative error of one launch against quant_linear_ref (a fresh residual, so in-place adds do not pile up)."""
    res = torch.zeros(x.shape[0], layer.out_features, dtype=x.dtype, device=x.device)
    got = quant_fn(x, [layer], epilogue, res, cfg, fast)()
    return rel_err(got, ql.quant_linear_ref(x, layer, gated=epilogue == "gated"))


def baselines(x, w, epilogue, res) -> tuple[float, float]:
    """(bf16 skinny_linear us, cuBLAS us) for the bf16 weight of the same shape (rotated like the quantized
    ones when it would fit in L2)."""
    ws = itertools.cycle([w] + [w.clone() for _ in range(max(0, -(-ROTATE_BYTES // (w.numel() * 2)) - 1))]
                         if DEVICE == "cuda" else [w])
    if epilogue == "residual":
        skinny = bench(lambda: skinny_linear(x, next(ws), residual=res))
        cublas = bench(lambda: res.addmm_(x, next(ws).t()))
    else:
        skinny = bench(lambda: skinny_linear(x, next(ws)))
        cublas = bench(lambda: F.linear(x, next(ws)))
    return skinny, cublas


# the dot path with its warps along the weight rows (SPLIT 1: one K slice a step, the x tile shared by every warp of
# the program; 64-row tiles go to wgmma): (BLOCK_N, BLOCK_K, warps, stages)
ROWS_WARPS = [(32, 128, 2, 4), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3), (128, 64, 8, 4),
              (128, 128, 8, 3), (128, 128, 4, 3)]


def sweep_configs(m: int, warps_along_rows: bool = False) -> list[ql.LaunchConfig]:
    """~30 configs per shape (each costs a compile of 1-2 s): the dot path's (BLOCK_N, SPLIT = warps) pairs that
    keep >= 4 warps per SM on a 4096-wide projection, two K blocks, 3-4 stages; and, for one row, the
    reduction path around skinny_linear's one-row configs. warps_along_rows: ROWS_WARPS instead.
    9-16 rows add tiles of 64-128 weight rows (K blocks of 64-128, no spill: bench/compile_sm90.py, sm_90): each
    warp's x fragments of its K slice then serve 4-8x more weight bytes than at BLOCK_N 16, where x is 4 bytes
    from shared memory a weight byte (NOTES session 29: the 16-row GEMMs' suspected limit)."""
    bm = 8 if m <= 8 else 16
    if warps_along_rows:
        return [ql.LaunchConfig(True, bm, bn, bk, 1, warps, stages) for bn, bk, warps, stages in ROWS_WARPS]
    cfgs = []
    for (bn, split), bk, stages in itertools.product(((16, 2), (16, 4), (16, 8), (32, 2), (32, 4), (32, 8), (64, 2)),
                                                     (128, 256), (3, 4)):
        smem = (stages - 1) * split * bk * (2 * bm + bn)  # x tiles + weight bytes (<= 1 per weight) in flight
        if smem <= 200 * 1024:
            cfgs.append(ql.LaunchConfig(True, bm, bn, bk, split, split, stages))
    if m > 8:
        for (bn, split), bk in itertools.product(((64, 4), (64, 8), (128, 2), (128, 4)), (64, 128)):
            if bn * bk <= 8192:
                cfgs.append(ql.LaunchConfig(True, bm, bn, bk, split, split, 3))
    if m == 1:
        for bn, bk, warps in ((4, 1024, 4), (8, 512, 4), (8, 512, 8), (8, 1024, 8), (16, 256, 4), (16, 512, 8)):
            cfgs.append(ql.LaunchConfig(False, 1, bn, bk, 1, warps, 3))
    return cfgs


def pct(nbytes: int, us: float, bw: float) -> float:
    return round(100 * nbytes / (us * 1e-6) / bw, 1)


def measure(name, n, k, epilogue, m, scheme, x, res, bf16, bw) -> tuple[dict, list[ql.QuantWeights]]:
    """One table row: the default launch config, the plain-Triton dequantizer beside the PTX one, bf16 baselines."""
    layer = random_layer(scheme, n, k)
    nbytes, meta = bytes_read(layer), ql.quant_meta(layer)
    cfg, fast = ql.launch_config(meta, m, epilogue == "gated"), ql.fast_unpack(meta, x.dtype)
    err = check(x, layer, epilogue)
    layers = rotation(layer)
    us = bench(quant_fn(x, layers, epilogue, res))
    plain_us = bench(quant_fn(x, layers, epilogue, res, fast=False)) if fast else us
    skinny_us, cublas_us = bf16
    row = {"shape": name, "n": n, "k": k, "rows": m, "scheme": scheme, "us": round(us, 2), "bytes": nbytes,
           "GBs": round(nbytes / us / 1e3, 1), "pct_copy": pct(nbytes, us, bw), "plain_dequant_us": round(plain_us, 2),
           "bf16_skinny_us": round(skinny_us, 2), "cublas_us": round(cublas_us, 2),
           "bf16_pct_copy": pct(n * k * 2, skinny_us, bw), "fast_unpack": fast, "config": asdict(cfg),
           "rel_err": round(err, 5), "weight_copies": len(layers)}
    print(f"{name:8s} m={m:<3d} {scheme:6s} {us:8.1f} us {row['GBs']:7.1f} GB/s {row['pct_copy']:5.1f}% (plain "
          f"dequant {plain_us:7.1f}; bf16 skinny {skinny_us:7.1f}, cuBLAS {cublas_us:7.1f}) err {err:.1e} {cfg}",
          flush=True)
    return row, layers


def sweep(row: dict, layers: list[ql.QuantWeights], x, res, epilogue, bw, deadline: float,
          warps_along_rows: bool = False) -> dict | None:
    """Time every sweep config on this shape (until the deadline); the best and the full list."""
    layer = layers[0]
    fast = ql.fast_unpack(ql.quant_meta(layer), x.dtype)
    results = []
    for c in sweep_configs(x.shape[0], warps_along_rows):
        if time.time() > deadline:
            print("   sweep budget spent", flush=True)
            break
        try:
            e = check(x, layer, epilogue, c, fast)
            t = bench(quant_fn(x, layers, epilogue, res, c, fast))
        except (triton.runtime.errors.OutOfResources, RuntimeError) as exc:
            print(f"   skip {c}: {type(exc).__name__}", flush=True)
            continue
        results.append((t, asdict(c), e))
        print(f"   {t:8.1f} us {c} err {e:.1e}", flush=True)
    if not results:
        return None
    results.sort(key=lambda r: r[0])
    best_us, best_cfg, best_err = results[0]
    print(f"   sweep best {best_us:.1f} us ({pct(row['bytes'], best_us, bw)}%) {best_cfg} err {best_err:.1e}; "
          f"default {row['us']:.1f}", flush=True)
    return {"shape": row["shape"], "rows": row["rows"], "scheme": row["scheme"], "fast_unpack": fast,
            "default_us": row["us"], "best_us": round(best_us, 2), "best_config": best_cfg,
            "best_pct_copy": pct(row["bytes"], best_us, bw),
            "all": [[round(t, 2), c, round(e, 5)] for t, c, e in results]}


def prefill_row(name: str, n: int, k: int, m: int, scheme: str) -> dict:
    """tl.dot GEMM (dequantizing tiles) vs dequantize-the-whole-weight + cuBLAS at m rows."""
    x = torch.randn(m, k, dtype=torch.bfloat16, device=DEVICE)
    layer = random_layer(scheme, n, k)
    meta = ql.quant_meta(layer)
    cfg = ql.launch_config(meta, m)
    dot_us = bench(lambda: ql._gemm_triton(x, layer, meta, None, cfg))
    deq_us = bench(lambda: ql._prefill(x, layer, meta, None))
    print(f"prefill {name:8s} m={m:<5d} {scheme:6s} tl.dot {dot_us:9.1f} us  dequant+cuBLAS {deq_us:9.1f} us",
          flush=True)
    return {"shape": name, "rows": m, "scheme": scheme, "dot_us": round(dot_us, 1),
            "dequant_cublas_us": round(deq_us, 1), "config": asdict(cfg)}


# the decoder's projections with the small ops quant_linear folds into them (issue 14): qkv takes the input norm,
# gate_up the post-attention norm and SwiGLU, o_proj / down the residual add
FOLD_SHAPES = [("qkv", 6144, 4096, "norm"), ("gate_up", 24576, 4096, "norm+swiglu"), ("o", 4096, 4096, "residual"),
               ("down", 4096, 12288, "residual")]


def folds_row(name: str, n: int, k: int, fold: str, m: int, scheme: str) -> dict:
    """One projection with its ops folded into the GEMM against the same ops as launches of their own (one graph
    each: the gaps between the launches count, as in a decode step); gate_up also with SwiGLU folded and the norm
    its own launch, to tell the two folds' costs apart."""
    layers = rotation(random_layer(scheme, n, k))
    meta, eps = ql.quant_meta(layers[0]), 1e-6
    x = torch.randn(m, k, dtype=torch.bfloat16, device=DEVICE) * 3 + 1
    nw = torch.rand(k, dtype=torch.bfloat16, device=DEVICE) + 0.5
    res = torch.zeros(m, n, dtype=torch.bfloat16, device=DEVICE)
    nxt = itertools.cycle(layers).__next__
    norm = fold != "residual"
    gated = fold == "norm+swiglu"
    fns = {"folded": lambda: ql._gemm_triton(x, nxt(), meta, res if not norm else None,
                                             norm_weight=nw if norm else None, eps=eps, gated=gated)}
    if fold == "residual":
        fns["unfused"] = lambda: res.add_(ql._gemm_triton(x, nxt(), meta, None))
    elif fold == "norm":
        fns["unfused"] = lambda: ql._gemm_triton(rms_norm(x, nw, eps)[0], nxt(), meta, None)
    else:
        fns["unfused"] = lambda: silu_mul(ql._gemm_triton(rms_norm(x, nw, eps)[0], nxt(), meta, None))
        fns["swiglu_only"] = lambda: ql._gemm_triton(rms_norm(x, nw, eps)[0], nxt(), meta, None, gated=True)
    got = ql._gemm_triton(x, layers[0], meta, None, norm_weight=nw if norm else None, eps=eps, gated=gated)
    err = rel_err(got, ql.quant_linear_ref(x, layers[0], norm_weight=nw if norm else None, eps=eps, gated=gated))
    row = {"shape": name, "rows": m, "scheme": scheme, "fold": fold, "rel_err": round(err, 5),
           **{f"{key}_us": round(bench(fn), 2) for key, fn in fns.items()}}
    print(f"folds {name:8s} m={m:<3d} {scheme:6s} {fold:12s} " + " ".join(
        f"{key} {row[f'{key}_us']:7.1f} us" for key in fns) + f" err {err:.1e}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16", help="comma-separated row counts")
    ap.add_argument("--schemes", default=",".join(ql.SCHEMES))
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES), help="comma-separated; gate_up_swiglu: "
                    "gate|up with SwiGLU in the epilogue")
    ap.add_argument("--sweep", action="store_true", help="also sweep launch configs (int4 / nvfp4 unless --schemes)")
    ap.add_argument("--sweep-budget", type=float, default=420.0, help="seconds after which sweeping stops")
    ap.add_argument("--warps-along-rows", action="store_true", help="sweep ROWS_WARPS (warps along the weight rows, "
                    "SPLIT 1) instead of the default set")
    ap.add_argument("--prefill", default="", help="row counts for the tl.dot vs dequantize + cuBLAS comparison")
    ap.add_argument("--folds", action="store_true", help="only the folded decoder ops vs their own launches, per "
                    "shape (--rows, --schemes)")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",") if r]
    schemes = [s for s in args.schemes.split(",") if s]
    sweep_schemes = schemes if "--schemes" in sys.argv else ["int4", "nvfp4"]
    shapes = [s for s in SHAPES + GATED_SHAPES if s[0] in args.shapes.split(",")]
    torch.manual_seed(0)
    bw = copy_bandwidth()
    deadline = time.time() + args.sweep_budget
    table, sweeps, prefill, folds = [], [], [], []
    with torch.inference_mode():
        for name, n, k, fold in FOLD_SHAPES if args.folds else []:
            for m, scheme in itertools.product(rows, schemes):
                folds.append(folds_row(name, n, k, fold, m, scheme))
        for name, n, k, epilogue in [] if args.folds else shapes:
            w = torch.randn(n, k, dtype=torch.bfloat16, device=DEVICE) * 0.02
            for m in rows:
                x = torch.randn(m, k, dtype=torch.bfloat16, device=DEVICE)
                res = torch.zeros(m, n, dtype=torch.bfloat16, device=DEVICE)
                bf16 = baselines(x, w, epilogue, res)
                for scheme in schemes:
                    row, layers = measure(name, n, k, epilogue, m, scheme, x, res, bf16, bw)
                    table.append(row)
                    if args.sweep and scheme in sweep_schemes:
                        result = sweep(row, layers, x, res, epilogue, bw, deadline, args.warps_along_rows)
                        if result:
                            sweeps.append(result)
            del w
            torch.cuda.empty_cache()
        for m in [int(r) for r in args.prefill.split(",") if r]:
            for name, n, k, _ in [s for s in SHAPES if s[0] in ("o", "gate_up")]:
                for scheme in schemes:
                    prefill.append(prefill_row(name, n, k, m, scheme))
    out = {"device": torch.cuda.get_device_name(), "commit": os.environ.get("COMMIT", "?"),
           "copy_bandwidth_GBs": round(bw / 1e9, 1), "prefill_dequant_min_m": ql.PREFILL_DEQUANT_MIN_M,
           "table": table, "sweeps": sweeps, "prefill": prefill, "folds": folds}
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).resolve().parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "quant_gemm.json").write_text(json.dumps(out, indent=1))
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s; {torch.cuda.get_device_name()}")
    print(f"{'shape':8s} {'m':>3s} {'scheme':6s} {'us':>8s} {'MB':>7s} {'GB/s':>7s} {'%copy':>6s} {'plain':>8s} "
          f"{'bf16 skinny':>11s} {'cuBLAS':>8s} {'bf16 %copy':>10s} {'err':>8s}")
    for r in table:
        print(f"{r['shape']:8s} {r['rows']:3d} {r['scheme']:6s} {r['us']:8.1f} {r['bytes'] / 1e6:7.1f} {r['GBs']:7.1f} "
              f"{r['pct_copy']:6.1f} {r['plain_dequant_us']:8.1f} {r['bf16_skinny_us']:11.1f} {r['cublas_us']:8.1f} "
              f"{r['bf16_pct_copy']:10.1f} {r['rel_err']:8.1e}")
    for s in sweeps:
        print(f"sweep {s['shape']:8s} m={s['rows']:<3d} {s['scheme']:6s} default {s['default_us']:7.1f} best "
              f"{s['best_us']:7.1f} us ({s['best_pct_copy']}%) {s['best_config']}")
    for p in prefill:
        print(f"prefill {p['shape']:8s} m={p['rows']:<5d} {p['scheme']:6s} tl.dot {p['dot_us']:9.1f} "
              f"dequant+cuBLAS {p['dequant_cublas_us']:9.1f}")


if __name__ == "__main__":
    main()
