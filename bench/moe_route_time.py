"""Time a MoE block's routing + grouping for a verify block (GPU): the single-program launch at several warp
counts against two launches (routing one token a program, then the align kernel), on the Qwen3.6-35B-A3B
(256 experts + shared, hidden 2048) and Qwen3-Coder-30B-A3B (128 experts) shapes. Microseconds a call from a
CUDA graph of 200 calls (random logits), median of 5 replays; prints a table, JSON to $OUT (or --out).

    python bench/moe_route_time.py [--tokens 16] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from blockspec.kernels import moe_grouped as mg  # noqa: E402

SHAPES = {"35b": (256, 8, 2048, True), "coder30b": (128, 8, 2048, False)}


def time_us(fn, reps: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(times)


def shape_rows(name: str, e: int, k: int, h: int, shared: bool, t: int) -> list[dict]:
    logits = torch.randn(t, e, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    gate = torch.randn(1, h, device="cuda", dtype=torch.bfloat16) * 0.02 if shared else None

    def one() -> tuple:
        return mg.moe_route_align(logits, k, True, x, gate)

    def two() -> None:
        _, ids, _ = mg.moe_route(logits, k, True, x, gate, block_t=1)
        mg.moe_align(ids, e, shared)

    want = one()

    def same_as_want(got: tuple) -> bool:
        return torch.equal(got[1], want[1]) and torch.equal(got[3].sorted_pairs, want[3].sorted_pairs)

    rows = []
    knob = "ROUTE_ONE_TOKEN_WARPS" if t == 1 else "ROUTE_ALIGN_WARPS"
    default = getattr(mg, knob)
    for warps in (1, 2, 4) if t == 1 else (4, 8, 16):
        setattr(mg, knob, warps)
        rows.append({"shape": name, "tokens": t, "path": f"one launch, {warps} warps", "equal": same_as_want(one()),
                     "us": round(time_us(one), 2)})
    setattr(mg, knob, default)
    if t > 1 and e > mg.ROUTE_ALIGN_MAX_EXPERTS:  # past the one-launch limit: what the one launch would take
        limit = mg.ROUTE_ALIGN_MAX_EXPERTS
        mg.ROUTE_ALIGN_MAX_EXPERTS = e
        try:
            rows.append({"shape": name, "tokens": t, "path": f"one launch past the limit, {mg.ROUTE_ALIGN_WARPS} "
                         "warps", "equal": same_as_want(one()), "us": round(time_us(one), 2)})
        finally:
            mg.ROUTE_ALIGN_MAX_EXPERTS = limit
    rows.append({"shape": name, "tokens": t, "path": "route (1 token a program) + align", "equal": True,
                 "us": round(time_us(two), 2)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    rows = [r for name, shape in SHAPES.items() for r in shape_rows(name, *shape, args.tokens)]
    out = {"commit": os.environ.get("COMMIT", "unknown"), "device": torch.cuda.get_device_name(), "rows": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"moe_route_time_t{args.tokens}.json").write_text(json.dumps(out, indent=1))
    print(f"{out['device']}  commit {out['commit']}  tokens {args.tokens}")
    print("| shape | path | us a call | same layout |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['path']} | {r['us']} | {r['equal']} |")


if __name__ == "__main__":
    main()
