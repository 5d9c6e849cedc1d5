"""quant_gemv's blocks kernel (int4, 1-16 rows: tokens as the mma's A operand, each lane's 16 weight bytes as B straight
from one load) against what the dispatch runs today (quant_linear.quant_linear), on the Qwen3-8B int4 g128 shapes,
with the SwiGLU folded for gate|up and the residual add for o / down as the decoder runs them (issue 14). GPU only.
Timings as bench/quant_gemm.py takes them (CUDA-graph replays, weights rotated past the L2). JSON to $OUT (else
bench/results/), a table last.

  python bench/int4_blocks.py                       # 1, 8 and 16 rows, a few launches each
  python bench/int4_blocks.py --rows 16 --shapes gate_up --configs 4,1,1,2:8,2,2,2
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

from blockspec.kernels import quant_gemv as qv  # noqa: E402
from blockspec.kernels import quant_linear as ql  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "27b_qgkv": (14336, 5120), "27b_gate_up": (34816, 5120)}
GATED = ("gate_up", "27b_gate_up")
RESIDUAL = ("o", "down")
CONFIGS = "4,1,1,1:4,2,1,1:4,1,1,2:4,2,1,2:8,1,1,1:8,2,2,1:8,2,2,2:8,1,4,1:16,2,4,1"


def dispatch_fn(x, layers, res, gated: bool):
    """The engine's call, one a replay on the next weight of the rotation."""
    turn = itertools.cycle(layers)
    return lambda: ql.quant_linear(x, next(turn), residual=res, gated=gated)


def blocks_fn(x, layers, meta, cfg: qv.BlocksConfig, res, gated: bool):
    turn = itertools.cycle(layers)
    return lambda: qv.blocks_gemv(x, next(turn), meta, cfg, residual=res, gated=gated)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--configs", default=CONFIGS, help="warps,spans,parts,reps launches, colon-separated")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfgs = [qv.BlocksConfig(*map(int, c.split(","))) for c in args.configs.split(":")]
    table = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        layer = qgm.random_layer("int4", n, k)
        layers = qgm.rotation(layer)
        meta = ql.quant_meta(layer)
        gated = name in GATED
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            res = torch.zeros(m, n, dtype=x.dtype, device="cuda") if name in RESIDUAL else None
            ref = ql.quant_linear_ref(x, layer, gated=gated)
            base_us = qgm.bench(dispatch_fn(x, layers, res, gated))
            row = dict(shape=name, n=n, k=k, rows=m, gated=gated, residual=res is not None, dispatch_us=base_us,
                       configs=[])
            for cfg in cfgs:
                if not qv.blocks_fit(meta, cfg, m, gated):
                    continue
                got = qv.blocks_gemv(x, layer, meta, cfg, gated=gated)
                err = qgm.rel_err(got, ref)
                us = qgm.bench(blocks_fn(x, layers, meta, cfg, res, gated))
                row["configs"].append(dict(cfg=[cfg.warps, cfg.spans, cfg.parts, cfg.reps], us=us, rel_err=err))
                print(f"  {name} {m} {cfg}: {us:.2f} us, err {err:.2e}", flush=True)
            ok = [c for c in row["configs"] if c["rel_err"] < 1e-2]
            row["best"] = min(ok, key=lambda c: c["us"]) if ok else None
            row["wrong"] = [c["cfg"] for c in row["configs"] if c["rel_err"] >= 1e-2]
            table.append(row)
        del layers
    out = Path(os.environ.get("OUT") or "bench/results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "int4_blocks.json").write_text(json.dumps(dict(
        device=torch.cuda.get_device_name(), commit=os.environ.get("COMMIT", "?"), dtype="bfloat16",
        scheme="int4 g128", rows=table), indent=1))
    print(f"{'shape':10} {'rows':>4} {'dispatch us':>11} {'blocks us':>9} {'ratio':>6}  (warps spans parts reps)")
    for r in table:
        b = r["best"]
        print(f"{r['shape']:10} {r['rows']:4} {r['dispatch_us']:11.2f} {b['us'] if b else float('nan'):9.2f} "
              f"{(b['us'] / r['dispatch_us']) if b else float('nan'):6.2f}  {b['cfg'] if b else '-'}"
              + (f"  WRONG {r['wrong']}" if r["wrong"] else ""))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
