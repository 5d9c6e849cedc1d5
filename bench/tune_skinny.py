"""Sweep the skinny GEMM's launch configs for a model's projection shapes: the tl.dot path (2-16 rows:
verify and drafter blocks) or, with --rows 1, the one-row reduction path (autoregressive decode), against
what skinny_linear dispatches now and against cuBLAS (with the fused norm / SwiGLU kernels and the residual
as an in-place addmm). GPU only; prints a table and writes $OUT/tune_skinny_<model>_m<rows>.json.

Each timing is a CUDA-graph replay (triton.testing.do_bench_cudagraph), so launch overhead is not counted, as
inside the decode graphs. The ideal is the weight bytes over the measured copy bandwidth. By default each timed
graph calls the projection on enough copies of its weight (in turn) to exceed the L2 cache several times, as a
decode step streams every layer's weights once: replaying one call on one weight timed L2 for every weight that
fits it (the MoE models' 17-40 MB projections). --warm keeps the one-weight timing.

  python bench/tune_skinny.py [--model 8b|27b|4b|35b|coder30b] [--rows 16] [--warm]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

from blockspec.kernels.activation import silu_mul
from blockspec.kernels.arrivals import arrival_counters
from blockspec.kernels.rms_norm import rms_norm
from blockspec.kernels.skinny_linear import _launch_config, _skinny_linear_kernel, skinny_linear, split_k

sys.path.insert(0, str(Path(__file__).resolve().parent))  # first_gpu.py sits beside this script
from first_gpu import copy_bandwidth  # noqa: E402

# name, weight rows, K, epilogue (gated: rows of the stacked [gate; up])
SHAPES = {
    "8b": [("qkv", 6144, 4096, "plain"), ("o", 4096, 4096, "residual"), ("gate_up", 24576, 4096, "gated"),
           ("down", 4096, 12288, "residual"), ("lm_head", 151936, 4096, "plain"),
           ("draft_fc", 4096, 20480, "plain")],
    # Qwen3.6-27B: Gated DeltaNet [qkv | z] and out_proj, gated attention's q|gate|k|v and o, the MLP, the head
    "27b": [("gdn_qkvz", 16384, 5120, "plain"), ("gdn_out", 5120, 6144, "residual"),
            ("attn_qkv", 14336, 5120, "plain"), ("gate_up", 34816, 5120, "gated"), ("down", 5120, 17408, "residual"),
            ("lm_head", 248320, 5120, "plain"), ("draft_fc", 5120, 25600, "plain")],
    "4b": [("gdn_qkvz", 12288, 2560, "plain"), ("gdn_out", 2560, 4096, "residual"), ("attn_qkv", 10240, 2560, "plain"),
           ("gate_up", 18432, 2560, "gated"), ("down", 2560, 9216, "residual"), ("lm_head", 248320, 2560, "plain")],
    "35b": [("gdn_qkvz", 12288, 2048, "plain"), ("gdn_out", 2048, 4096, "residual"), ("attn_qkv", 9216, 2048, "plain"),
            ("router", 256, 2048, "plain"), ("lm_head", 248320, 2048, "plain")],
    # Qwen3-Coder-30B-A3B (qwen3_moe): attention q|k|v and o, the router, the head
    "coder30b": [("qkv", 5120, 2048, "plain"), ("o", 2048, 4096, "residual"), ("router", 128, 2048, "plain"),
                 ("lm_head", 151936, 2048, "plain")],
}
# (BLOCK_N, BLOCK_K, warps, stages, K split): the dot path also with its K split over 2-8 programs a tile (4 warps;
# where the split leaves whole BLOCK_K steps and no SwiGLU), the one-row path unsplit
DOT_CONFIGS = [(*c, 1) for c in itertools.product((16, 32, 64), (128, 256), (4, 8), (3, 5))
               if not (c[0] == 16 and c[2] == 8)]
DOT_CONFIGS += [(bn, bk, 4, st, sk)
                for bn, bk, st, sk in itertools.product((16, 32, 64), (128, 256), (3, 5), (2, 4, 8))]
ROW_CONFIGS = [(*c, 1) for c in itertools.product((4, 8, 16), (256, 512, 1024), (4, 8), (3,))]


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


def dispatched(x, w, nw, res, epilogue):
    """What the decode layers call: skinny_linear with the norm folded (its own dispatch and configs)."""
    def fn():
        if epilogue == "residual":
            return skinny_linear(x, w, residual=res)
        return skinny_linear(x, w, norm_weight=nw, eps=1e-6, gated=epilogue == "gated")
    return fn


def splits_fit(cfg, k: int, epilogue: str) -> bool:
    """A K split leaves whole BLOCK_K steps and takes no SwiGLU (the kernel's rule)."""
    bn, bk, _, _, sk = cfg
    return sk == 1 or (epilogue != "gated" and k % (sk * bk) == 0)


def dot_path(x, w, nw, res, epilogue, cfg):
    bn, bk, warps, stages, sk = cfg
    m, k = x.shape
    one_row = m == 1
    n_out = w.shape[0] // 2 if epilogue == "gated" else w.shape[0]
    out = res if epilogue == "residual" else torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(n_out, bn)
    ws = torch.empty(tiles * sk * 16 * bn, dtype=torch.float32, device=x.device) if sk > 1 else x
    cnt = arrival_counters(x.device) if sk > 1 else x

    def fn():
        h = x if one_row else prologue(x, nw, epilogue)  # one row: the norm folds into the kernel
        norm = one_row and epilogue != "residual"
        _skinny_linear_kernel[(tiles * sk,)](
            h, w, h, nw if norm else h, out, m, n_out, 1e-6, w, out, n_out, 0, h, ws, cnt, K=k, HAS_BIAS=False,
            HAS_NORM=norm, GATED=epilogue == "gated", HAS_RES=epilogue == "residual", USE_DOT=not one_row,
            DOT_PRECISION="tf32", BLOCK_M=1 if one_row else 16, BLOCK_N=bn, BLOCK_K=bk, PAIR=False, NORM_OUT=False,
            SPLIT_K=sk, num_warps=warps, num_stages=stages)
        return out
    return fn


def dispatched_config(m: int, n_out: int, k: int, epilogue: str) -> tuple[int, ...]:
    """The config skinny_linear launches for this shape, its K split last."""
    bn, bk, warps, stages = _launch_config(m, n_out, k, epilogue == "gated")
    sk = split_k(m, n_out, k, bn, bk) if epilogue != "gated" and m > 1 else 1
    return bn, bk, warps, stages, sk


def rotating(fns: list[Callable[[], torch.Tensor]]) -> Callable[[], torch.Tensor]:
    """The calls on each weight copy, in turn (a graph of them streams each copy from HBM, not L2)."""
    def fn():
        for f in fns:
            out = f()
        return out
    return fn


def time_us(fn: Callable[[], torch.Tensor], calls: int) -> float:
    return 1000 * triton.testing.do_bench_cudagraph(fn, rep=30) / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--model", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--only", default=None, help="comma-separated shape names")
    ap.add_argument("--warm", action="store_true", help="one weight, replayed: L2-resident where it fits")
    args = ap.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    shapes = [s for s in SHAPES[args.model] if args.only is None or s[0] in args.only.split(",")]
    configs = ROW_CONFIGS if args.rows == 1 else DOT_CONFIGS
    torch.manual_seed(0)
    bw = copy_bandwidth()
    table = []
    with torch.inference_mode():
        for name, n, k, epilogue in shapes:
            w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
            copies = 1 if args.warm else max(1, min(16, -(-4 * l2 // (w.numel() * 2))))
            weights = [w] + [w.clone() for _ in range(copies - 1)]
            x = torch.randn(args.rows, k, dtype=torch.bfloat16, device="cuda")
            nw = torch.ones(k, dtype=torch.bfloat16, device="cuda")
            n_out = n // 2 if epilogue == "gated" else n
            res = torch.zeros(args.rows, n_out, dtype=torch.bfloat16, device="cuda")
            ideal_us = 1e6 * w.numel() * 2 / bw
            cur_us = time_us(rotating([current_path(x, wc, nw, res.clone(), epilogue) for wc in weights]), copies)
            ours_us = time_us(rotating([dispatched(x, wc, nw, res.clone(), epilogue) for wc in weights]), copies)
            want = current_path(x, w, nw, torch.zeros_like(res), epilogue)().float()
            rows = []
            for cfg in configs:
                if not splits_fit(cfg, k, epilogue):
                    continue
                fn = dot_path(x, w, nw, torch.zeros_like(res), epilogue, cfg)
                try:
                    got = fn().float()
                except triton.runtime.errors.OutOfResources:
                    continue
                if epilogue != "residual" and args.rows > 1:
                    err = float((got - want).norm() / want.norm())
                else:
                    err = 0.0  # in place: accumulated over the calls above
                timed = rotating([dot_path(x, wc, nw, torch.zeros_like(res), epilogue, cfg) for wc in weights])
                rows.append((time_us(timed, copies), cfg, err))
            rows.sort()
            best_us, best_cfg, best_err = rows[0]
            table.append({"shape": name, "n": n, "k": k, "rows": args.rows, "epilogue": epilogue, "copies": copies,
                          "ideal_us": round(ideal_us, 2), "current_us": round(cur_us, 2),
                          "dispatched_us": round(ours_us, 2),
                          "dispatched_config": dispatched_config(args.rows, n_out, k, epilogue),
                          "best_dot_us": round(best_us, 2), "best_config": best_cfg, "rel_err": round(best_err, 5),
                          "all": [[round(t, 2), list(c)] for t, c, _ in rows]})
            print(f"{name:9s} ideal {ideal_us:7.1f} us  cuBLAS {cur_us:7.1f}  ours {ours_us:7.1f}  best {best_us:7.1f} "
                  f"{best_cfg} (top 3: {[(round(t, 1), c) for t, c, _ in rows[:3]]})", flush=True)
            del w, x, res, weights
            torch.cuda.empty_cache()
    out = {"device": torch.cuda.get_device_name(), "commit": os.environ.get("COMMIT", "?"),
           "copy_bandwidth_GBs": round(bw / 1e9, 1), "dtype": "bfloat16", "shapes": table}
    out["model"], out["rows"], out["l2_resident"] = args.model, args.rows, args.warm
    path = Path(os.environ.get("OUT", ".")) / f"tune_skinny_{args.model}_m{args.rows}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"{'shape':9s} {'ideal':>8s} {'cuBLAS':>8s} {'ours':>8s} {'best':>8s}  best config / dispatched config")
    for r in table:
        print(f"{r['shape']:9s} {r['ideal_us']:8.1f} {r['current_us']:8.1f} {r['dispatched_us']:8.1f} "
              f"{r['best_dot_us']:8.1f}  {r['best_config']} / {r['dispatched_config']}")


if __name__ == "__main__":
    main()
