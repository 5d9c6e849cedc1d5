"""Sweep the skinny GEMM's tl.dot path (2-16 rows: verify blocks, drafter blocks) over launch configs for the
Qwen3-8B shapes, against what a verify block runs now (cuBLAS, with the fused norm / SwiGLU kernels and the
residual as an in-place addmm). GPU only; prints a table and writes $OUT/tune_skinny.json.

Each timing is a CUDA-graph replay of one call (triton.testing.do_bench_cudagraph), so launch overhead is
not counted, as inside the decode graphs. The ideal is the weight bytes over the measured copy bandwidth.

  python bench/tune_skinny.py [--rows 16]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

from blockspec.kernels.activation import silu_mul
from blockspec.kernels.rms_norm import rms_norm
from blockspec.kernels.skinny_linear import _skinny_linear_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))  # first_gpu.py sits beside this script
from first_gpu import copy_bandwidth  # noqa: E402

# name, weight rows, K, epilogue
SHAPES = [("qkv", 6144, 4096, "plain"), ("o", 4096, 4096, "residual"), ("gate_up", 24576, 4096, "gated"),
          ("down", 4096, 12288, "residual"), ("lm_head", 151936, 4096, "plain"), ("draft_fc", 4096, 20480, "plain")]
CONFIGS = [c for c in itertools.product((16, 32, 64), (128, 256), (4, 8), (3, 5))
           if not (c[0] == 16 and c[2] == 8)]


def prologue(x, nw, epilogue):
    """The verify block's input norm (its own kernel); a residual projection's input is not normed."""
    return rms_norm(x, nw, 1e-6)[0] if epilogue != "residual" else x


def current_path(x, w, nw, res, epilogue):
    def fn():
        h = prologue(x, nw, epilogue)
        if epilogue == "residual":
            return res.addmm_(h, w.t())
        y = F.linear(h, w)
        return silu_mul(y) if epilogue == "gated" else y
    return fn


def dot_path(x, w, nw, res, epilogue, cfg):
    bn, bk, warps, stages = cfg
    m, k = x.shape
    n_out = w.shape[0] // 2 if epilogue == "gated" else w.shape[0]
    out = res if epilogue == "residual" else torch.empty(m, n_out, dtype=x.dtype, device=x.device)

    def fn():
        h = prologue(x, nw, epilogue)
        _skinny_linear_kernel[(triton.cdiv(n_out, bn),)](
            h, w, h, h, out, m, n_out, 0.0, K=k, HAS_BIAS=False, HAS_NORM=False, GATED=epilogue == "gated",
            HAS_RES=epilogue == "residual", USE_DOT=True, DOT_PRECISION="tf32", BLOCK_M=16, BLOCK_N=bn,
            BLOCK_K=bk, num_warps=warps, num_stages=stages)
        return out
    return fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16)
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    table = []
    with torch.inference_mode():
        for name, n, k, epilogue in SHAPES:
            w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
            x = torch.randn(args.rows, k, dtype=torch.bfloat16, device="cuda")
            nw = torch.ones(k, dtype=torch.bfloat16, device="cuda")
            n_out = n // 2 if epilogue == "gated" else n
            res = torch.zeros(args.rows, n_out, dtype=torch.bfloat16, device="cuda")
            ideal_us = 1e6 * w.numel() * 2 / bw
            ref = current_path(x, w, nw, res.clone(), epilogue)
            cur_us = 1000 * triton.testing.do_bench_cudagraph(ref, rep=30)
            want = current_path(x, w, nw, torch.zeros_like(res), epilogue)().float()
            rows = []
            for cfg in CONFIGS:
                fn = dot_path(x, w, nw, torch.zeros_like(res), epilogue, cfg)
                try:
                    got = fn().float()
                except triton.runtime.errors.OutOfResources:
                    continue
                if epilogue != "residual":
                    err = float((got - want).norm() / want.norm())
                else:
                    err = 0.0  # in place: accumulated over the calls above
                rows.append((1000 * triton.testing.do_bench_cudagraph(fn, rep=30), cfg, err))
            rows.sort()
            best_us, best_cfg, best_err = rows[0]
            table.append({"shape": name, "n": n, "k": k, "rows": args.rows, "epilogue": epilogue,
                          "ideal_us": round(ideal_us, 2), "current_us": round(cur_us, 2),
                          "best_dot_us": round(best_us, 2), "best_config": best_cfg, "rel_err": round(best_err, 5),
                          "all": [[round(t, 2), list(c)] for t, c, _ in rows]})
            print(f"{name:9s} ideal {ideal_us:7.1f} us  current {cur_us:7.1f}  best dot {best_us:7.1f} "
                  f"{best_cfg} (top 3: {[(round(t, 1), c) for t, c, _ in rows[:3]]})", flush=True)
            del w, x, res
            torch.cuda.empty_cache()
    out = {"device": torch.cuda.get_device_name(), "commit": os.environ.get("COMMIT", "?"),
           "copy_bandwidth_GBs": round(bw / 1e9, 1), "dtype": "bfloat16", "shapes": table}
    path = Path(os.environ.get("OUT", ".")) / "tune_skinny.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"{'shape':9s} {'ideal':>8s} {'current':>8s} {'dot':>8s}  config")
    for r in table:
        print(f"{r['shape']:9s} {r['ideal_us']:8.1f} {r['current_us']:8.1f} {r['best_dot_us']:8.1f}  "
              f"{r['best_config']}")


if __name__ == "__main__":
    main()
