"""Decode / verify attention (kernels/paged_attention.py) on the GPU: the launch the wrappers pick against the
earlier one (8 splits, 64-key tiles, 4 warps), and with --sweep every splits x (key tile, warps), per model shape.

Shapes (query heads, KV heads, head_dim): SmolLM2-135M, Qwen3-8B, Qwen3-Coder-30B-A3B, Qwen3.6-27B, Qwen3.6-35B-A3B,
Qwen3.5-4B; q_len 1 (decode) and 16 (a k = 15 verify block);
batch 1 and 8; contexts 1024 and 8192 keys. bf16, page 16, causal.

Timing: R calls captured in one CUDA graph, each on its own KV cache so the keys stream from DRAM and not the
50 MB L2 (R * cache >= 256 MB); median of --iters replays / R. Each variant is checked against
paged_attention_ref first (relative error printed). Prints a table last (the default launch's us, the earlier
launch's, the best swept one and its config) and writes $OUT/attention_sweep.json.

  python bench/attention_sweep.py [--iters 50] [--sweep] [--models coder-30b,qwen3.6-27b]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helpers beside this script
from gdn_kernels import time_graph  # noqa: E402
from hybrid_gpu import commit  # noqa: E402

from blockspec.kernels import paged_attention as pa  # noqa: E402

SHAPES = {  # name: (query heads, KV heads, head_dim)
    "smollm2": (9, 3, 64),
    "qwen3-8b": (32, 8, 128),
    "coder-30b": (32, 4, 128),
    "qwen3.6-27b": (24, 4, 256),
    "qwen3.6-35b": (16, 2, 256),
    "qwen3.5-4b": (16, 4, 256),
}
PAGE = 16
OLD = {"splits": 8, "tile": (64, 4)}
SPLITS = (8, 16, 32, 64)
TILES = ((64, 4), (64, 8), (32, 8), (32, 4))
POOL_BYTES = 256 << 20


def case(heads: int, kv: int, hd: int, batch: int, q_len: int, ctx: int, copies: int):
    """copies KV caches of `batch` sequences of ctx keys each (pages shuffled), and the queries."""
    blocks = batch * (-(-ctx // PAGE))
    g = torch.Generator(device="cuda").manual_seed(0)
    caches = [(torch.randn(blocks + 1, PAGE, kv, hd, device="cuda", generator=g, dtype=torch.bfloat16),
               torch.randn(blocks + 1, PAGE, kv, hd, device="cuda", generator=g, dtype=torch.bfloat16))
              for _ in range(copies)]
    table = torch.randperm(blocks, device="cuda", generator=g).view(batch, -1).to(torch.int32)
    seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch * q_len, heads, hd, device="cuda", generator=g, dtype=torch.bfloat16)
    return q, caches, table, seq_lens, torch.zeros_like(seq_lens)


def measure(name: str, batch: int, q_len: int, ctx: int, args) -> dict:
    heads, kv, hd = SHAPES[name]
    kv_bytes = 2 * batch * ctx * kv * hd * 2
    copies = max(1, min(64, POOL_BYTES // kv_bytes))
    q, caches, table, seq_lens, kv_start = case(heads, kv, hd, batch, q_len, ctx, copies)
    k0, v0 = caches[0]
    ref = pa.paged_attention_ref(q.float(), k0.float(), v0.float(), table, seq_lens, kv_start, q_len, hd**-0.5, True)

    def run(splits: int | None, tile: tuple[int, int] | None):
        def fn(i: int) -> torch.Tensor:
            kc, vc = caches[i]
            return pa.paged_attention(q, kc, vc, table, seq_lens, kv_start, q_len, hd**-0.5, True,
                                      num_splits=splits, tile=tile)
        err = float((fn(0).float() - ref).norm() / ref.norm())
        if err > 2e-2:
            raise AssertionError(f"{name} b{batch} q{q_len} ctx{ctx} splits {splits} tile {tile}: rel err {err}")
        return time_graph([lambda i=i: fn(i) for i in range(copies)], args.iters)[0], err

    row = {"model": name, "batch": batch, "q_len": q_len, "context": ctx, "kv_bytes": kv_bytes}
    row["default_us"], row["default_err"] = run(None, None)
    splits = pa.default_launch(q.device, batch, kv, q_len, heads // kv, hd)[1]
    row["default_config"] = {"splits": splits, "tile": pa._decode_tile(q_len * heads // kv)}
    row["old_us"], _ = run(OLD["splits"], OLD["tile"])
    sweep = [] if not args.sweep else [
        {"splits": s, "tile": t, "us": run(s, t)[0]} for s, t in itertools.product(SPLITS, TILES)]
    row["sweep"] = sweep
    best = min(sweep, key=lambda r: r["us"]) if sweep else None
    row["best"] = best
    row["default_GBps"] = kv_bytes / row["default_us"] / 1e3
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="also time every splits x (key tile, warps) variant "
                    "(minutes: each variant compiles)")
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--q-lens", default="1,16", help="queries a sequence: 1 (decode), 16 (a k = 15 verify block)")
    ap.add_argument("--out", default=os.environ.get("OUT", str(Path(__file__).parent / "results")))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_sweep.py needs a CUDA GPU")
    rows = []
    with torch.inference_mode():
        for name in args.models.split(","):
            for batch, q_len, ctx in itertools.product((1, 8), [int(v) for v in args.q_lens.split(",")], (1024, 8192)):
                rows.append(measure(name, batch, q_len, ctx, args))
                torch.cuda.empty_cache()
    result = {"commit": commit(), "device": torch.cuda.get_device_name(), "dtype": "bfloat16", "page": PAGE,
              "iters": args.iters, "old_launch": OLD, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_sweep.json").write_text(json.dumps(result, indent=1))
    print(f"{result['device']}  commit {result['commit']}  bf16, causal, page {PAGE}; us per call (median)")
    print("| model | batch | q_len | context | default us (splits, tile) | earlier us | earlier / default "
          "| best swept |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        cfg = r["default_config"]
        best = f"{r['best']['us']:.1f} ({r['best']['splits']}, {tuple(r['best']['tile'])})" if r["best"] else "-"
        print(f"| {r['model']} | {r['batch']} | {r['q_len']} | {r['context']} | {r['default_us']:.1f} "
              f"({cfg['splits']}, {cfg['tile']}) | {r['old_us']:.1f} | {r['old_us'] / r['default_us']:.2f} | {best} |")


if __name__ == "__main__":
    main()
