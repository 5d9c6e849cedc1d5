"""The NVFP4 mma kernels (blockspec/kernels/quant_gemv.py: the one-row GEMV, the 2-16-row kernel) against
quant_linear's dot path for the same rows on the Qwen3-8B projection shapes (issue 14), and where the dispatch
draws its lines (quant_gemv.launch_config). GPU only. Timings as bench/quant_gemm.py takes them (CUDA-graph
replays, weights rotated past the L2, % of the copy bandwidth measured in the same run). Prints a table last;
JSON to $OUT (else bench/results/).

  python bench/quant_gemv.py                  # one row
  python bench/quant_gemv.py --rows 1,8,16    # + verify blocks
  python bench/quant_gemv.py --sweep          # + launch configs (warps, spans a step, K parts) per shape
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant_gemm as qgm  # noqa: E402
from first_gpu import copy_bandwidth  # noqa: E402

from blockspec.kernels import quant_gemv  # noqa: E402
from blockspec.kernels import quant_linear as ql  # noqa: E402

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("down", 4096, 12288), ("gate_up", 24576, 4096),
          ("27b_gate_up", 2 * 17408, 5120), ("lm_head", 151936, 4096),
          # Qwen3.6-35B-A3B: a Gated DeltaNet layer's in_proj (q|k|v|z) and out_proj, an attention layer's q|gate|k|v
          ("35b_in_proj", 12288, 2048), ("35b_out_proj", 2048, 4096), ("35b_qkv", 9216, 2048),
          # Qwen3.6-27B's attention q|gate|k|v, Qwen3.5-4B's Gated DeltaNet in_proj
          ("27b_qkv", 14336, 5120), ("4b_in_proj", 12288, 2560)]


def gemv_fn(x, layers, cfg: quant_gemv.GemvConfig | None = None):
    """One call a replay on the next weight of the rotation (cfg: the dispatch's, else forced)."""
    turn = itertools.cycle(layers)
    meta = ql.quant_meta(layers[0])
    m = x.shape[0]
    cfg = cfg or quant_gemv.launch_config(meta, m) or (quant_gemv.WIDE if m == 1 else quant_gemv.ROWS)
    return lambda: quant_gemv.nvfp4_gemv(x, next(turn), meta, cfg)


SWEEP = [quant_gemv.GemvConfig(w, s, p) for w in (2, 4, 8, 16, 32) for s in (2, 4, 8) for p in (1, 2, 4, 8)
         if 64 * p < 32 * w or (w, p) == (2, 1)]  # x loaded in the lane layout (no barrier) + today's default
SWEEP_ROWS = [quant_gemv.GemvConfig(w, s, p) for w in (4, 8, 16) for s in (1, 2, 4) for p in (1, 2, 4, 8)
              if p <= w]


def sweep(x, layer, layers, ref, k) -> dict:
    best = None
    for cfg in SWEEP if x.shape[0] == 1 else SWEEP_ROWS:
        if k % (128 * cfg.spans * cfg.parts):
            continue
        err = qgm.rel_err(gemv_fn(x, [layer], cfg)(), ref)
        if err > 2e-2:
            print(f"  {cfg}: WRONG rel err {err:.3g}", flush=True)
            continue
        us = qgm.bench(gemv_fn(x, layers, cfg))
        print(f"  {cfg}: {us:.1f} us", flush=True)
        if best is None or us < best["us"]:
            best = dict(us=us, warps=cfg.warps, spans=cfg.spans, parts=cfg.parts)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--rows", default="1", help="rows of x (comma-separated): 1 the GEMV, 2-16 the rows kernel")
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    rows = []
    for name, n, k in [s for s in SHAPES if s[0] in args.shapes.split(",")]:
        layer = qgm.random_layer("nvfp4", n, k)
        layers = qgm.rotation(layer)
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ref = ql.quant_linear_ref(x, layer)
            err = qgm.rel_err(gemv_fn(x, [layer])(), ref)
            dot = qgm.bench(qgm.quant_fn(x, layers, "plain", None))
            gemv = qgm.bench(gemv_fn(x, layers))
            nbytes = qgm.bytes_read(layer)
            rows.append(dict(shape=name, n=n, k=k, m=m, bytes=nbytes, dot_us=dot, gemv_us=gemv, rel_err=err,
                             dot_pct=qgm.pct(nbytes, dot, bw), gemv_pct=qgm.pct(nbytes, gemv, bw),
                             dispatched=quant_gemv.launch_config(ql.quant_meta(layer), m) is not None))
            if args.sweep:
                rows[-1]["best"] = sweep(x, layer, layers, ref, k)
            print(rows[-1], flush=True)
        del layers
    out = Path(os.environ.get("OUT", "bench/results")) / "quant_gemv.json"
    out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), commit=os.environ.get("COMMIT", "?"),
                                   copy_gbs=bw / 1e9, dtype="bfloat16", scheme="nvfp4", rows=rows), indent=1))
    print(f"{'shape':12} {'N':>6} {'K':>6} {'M':>3} {'dot us':>7} {'%copy':>6} {'mma us':>8} {'%copy':>6} {'err':>7}"
          "  taken")
    for r in rows:
        print(f"{r['shape']:12} {r['n']:6} {r['k']:6} {r['m']:3} {r['dot_us']:7.1f} {r['dot_pct']:6.1f} "
              f"{r['gemv_us']:8.1f} "
              f"{r['gemv_pct']:6.1f} {r['rel_err']:7.1e}  {'mma' if r['dispatched'] else 'dot'}"
              + (f"  best {r['best']['us']:.1f} us ({qgm.pct(r['bytes'], r['best']['us'], bw):.1f}%): "
                 f"warps {r['best']['warps']} spans {r['best']['spans']} "
                 f"parts {r['best']['parts']}" if r.get("best") else ""))


if __name__ == "__main__":
    main()
