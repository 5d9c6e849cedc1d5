"""int4 group scales after the dot product (quant_linear's POST_SCALE) against per-weight scaling, same process.

Why: at 1-16 rows the int4 dot path is bound by its dequantization instructions, not by HBM (the 8B gate|up streams
50 MB in ~25 us on an H200, half its bandwidth). Scaling each weight costs a bf16x2 fma per pair plus building the
per-byte scale operands; with every 128-wide K slice inside one group (g128 checkpoints) the tile can hold q - z
(exact) and the group scale can multiply each row's dot product once instead. This times both launches on the
Qwen3-8B / Qwen3.6-27B projection shapes (int4 g128, asymmetric), weights rotated past L2 as bench/quant_gemm.py
does, checks each against the reference, and prints a table last; JSON to $OUT (else bench/results/).

  python bench/int4_post_scale.py [--rows 1,8,16] [--shapes qkv,o,gate_up,down,lm_head,27b_qgkv]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

import quant_gemm as qg  # noqa: E402

from blockspec.kernels import quant_linear as ql  # noqa: E402

SHAPES = {name: (n, k, epi) for name, n, k, epi in qg.SHAPES}
SHAPES.update({"27b_qgkv": (14336, 5120, "plain"), "27b_gate_up": (34816, 5120, "plain"),
               "draft_head_35b": (248320, 2048, "plain")})


def row(name: str, m: int, bw: float) -> dict:
    n, k, epi = SHAPES[name]
    layer = qg.random_layer("int4", n, k)
    layers = qg.rotation(layer)
    meta = ql.quant_meta(layer)
    cfg = ql.launch_config(meta, m, post_scale=False)  # the per-weight launch, as it was before POST_SCALE
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    res = torch.zeros(m, n, dtype=torch.bfloat16, device="cuda")
    out = {"shape": name, "n": n, "k": k, "rows": m, "cfg": vars(cfg), "bytes": qg.bytes_read(layer)}
    variants = {"per_weight": (cfg, False)}
    if ql.post_scale_applies(meta, cfg):
        variants["post_scale"] = (cfg, True)
    if meta.group < cfg.block_k:  # K > 4096 takes 256-wide slices: post-scale needs them within a group
        variants["post_scale_bk128"] = (replace(cfg, block_k=meta.group), True)
    ref = ql.quant_linear_ref(x, layer)
    def launcher(c: ql.LaunchConfig, post: bool):
        turn = itertools.cycle(layers)  # each captured call reads the next copy, as quant_gemm.quant_fn
        return lambda: ql._gemm_triton(x, next(turn), meta, res if epi == "residual" else None, c, None,
                                       post_scale=post)

    for label, (c, post) in variants.items():
        fn = launcher(c, post)
        got = ql._gemm_triton(x, layer, meta, None, c, None, post_scale=post)
        us = qg.bench(fn)
        out[label] = {"us": us, "pct_copy": qg.pct(out["bytes"], us, bw), "rel_err": qg.rel_err(got, ref)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down,27b_qgkv,27b_gate_up,draft_head_35b")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(BENCH / "results"))
    args = ap.parse_args()
    bw = qg.copy_bandwidth()
    rows = []
    for name in args.shapes.split(","):
        for m in (int(r) for r in args.rows.split(",")):
            rows.append(row(name, m, bw))
            print(json.dumps(rows[-1]), flush=True)
    res = {"commit": os.environ.get("COMMIT", "unknown"), "device": torch.cuda.get_device_name(),
           "copy_bandwidth_GBps": bw / 1e9, "dtype": "bfloat16", "scheme": "int4 g128 asymmetric", "rows": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "int4_post_scale.json").write_text(json.dumps(res, indent=1))
    print(f"{res['device']}, copy {bw / 1e9:.0f} GB/s, commit {res['commit']}")
    print("| shape | rows | per weight us (%copy) | post-scale us (%copy) | bk128 post-scale us | max rel err |")
    print("|---|---|---|---|---|---|")
    def cell(r: dict, key: str) -> str:
        v = r.get(key)
        return f"{v['us']:.1f} ({v['pct_copy']:.0f}%)" if v else "-"

    for r in rows:
        err = max(r[k]["rel_err"] for k in ("per_weight", "post_scale", "post_scale_bk128") if k in r)
        print(f"| {r['shape']} {r['n']}x{r['k']} | {r['rows']} | {cell(r, 'per_weight')} | {cell(r, 'post_scale')} | "
              f"{cell(r, 'post_scale_bk128')} | {err:.1e} |")


if __name__ == "__main__":
    main()
