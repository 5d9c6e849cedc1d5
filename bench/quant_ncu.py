"""Where the decode / verify step's quantized GEMMs lose their time (issue 14): each case (scheme, shape, rows) as
the engine dispatches it (quant_linear.quant_linear, SwiGLU folded for gate|up), timed against the floor of any
one launch that reads the same bytes (`_read_kernel`: loads them and nothing else, the best of a few launch
shapes), and, under Nsight Compute, the counters that say why (occupancy, issue activity, stall reasons).
GPU only; JSON to $OUT (else bench/results/), a table last.

  python bench/quant_ncu.py                               # timings: dispatch vs read floor, % of copy bandwidth
  ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
      --section LaunchStats --section WarpStateStats --csv --page raw \\
      python bench/quant_ncu.py --ncu > ncu.csv         # one profiled launch a case (after a warm-up pass)
  python bench/quant_ncu.py --parse ncu.csv               # the counters as a table
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant_gemm as qgm  # noqa: E402
import quant_gemv as qgv  # noqa: E402

from blockspec.kernels import quant_linear as ql  # noqa: E402

SHAPES = {name: (n, k) for name, n, k in qgv.SHAPES}  # the GEMV bench's shapes, SwiGLU folded on its GATED_SHAPES
RESIDUAL = tuple(name for name, _, _, epilogue in qgm.SHAPES if epilogue == "residual")  # o / down add in place
CASES = ("int4:qkv:1,int4:o:1,int4:gate_up:1,int4:down:1,int4:qkv:16,int4:gate_up:16,int4:down:16,"
         "nvfp4:qkv:1,nvfp4:o:1,nvfp4:gate_up:1,nvfp4:down:1,nvfp4:gate_up:16")
READ_SHAPES = ((1, 4, 2), (2, 8, 2), (4, 8, 1), (2, 8, 4), (8, 4, 2))  # (programs an SM, warps, loads in flight)

if torch.cuda.is_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _read_kernel(P, OUT, n_words, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
        """Grid-stride over n_words int32s, UNROLL loads of BLOCK in flight a step; one word a program is written
        (their xor) so nothing is optimised away."""
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK * UNROLL
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for base in range(pid * BLOCK * UNROLL, n_words, step):
            for u in tl.static_range(UNROLL):
                offs = base + u * BLOCK + tl.arange(0, BLOCK)
                acc ^= tl.load(P + offs, mask=offs < n_words, other=0)
        tl.store(OUT + pid, tl.reduce(acc, 0, _xor))

    @triton.jit
    def _xor(a, b):
        return a ^ b


def read_floor_us(nbytes: int) -> tuple[float, str]:
    """The fastest of READ_SHAPES reading nbytes (rotated past the L2 as the GEMMs' weights are)."""
    words = nbytes // 4
    bufs = [torch.empty(words, dtype=torch.int32, device="cuda").random_()
            for _ in range(max(1, -(-qgm.ROTATE_BYTES // nbytes)))]
    out = torch.empty(4096, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    best = (float("inf"), "")
    for per_sm, warps, unroll in READ_SHAPES:
        block = 32 * warps * 4
        grid = min(per_sm * sms, triton.cdiv(words, block * unroll))
        turn = itertools.cycle(bufs)

        def fn(grid=grid, block=block, unroll=unroll, warps=warps, turn=turn):
            _read_kernel[(grid,)](next(turn), out, words, BLOCK=block, UNROLL=unroll,
                                  num_warps=warps)
        us = qgm.bench(fn)
        if us < best[0]:
            best = (us, f"{grid} programs x {warps} warps, {unroll} loads")
    return best


def case_fn(scheme: str, shape: str, m: int):
    """(fn, bytes): one dispatched call a replay on the next weight of the rotation."""
    n, k = SHAPES[shape]
    layer = qgm.random_layer(scheme, n, k)
    layers = qgm.rotation(layer)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    gated = shape in qgv.GATED_SHAPES
    res = torch.zeros(m, n, dtype=x.dtype, device="cuda") if shape in RESIDUAL else None
    turn = itertools.cycle(layers)

    def fn():
        return ql.quant_linear(x, next(turn), residual=res, gated=gated)
    return fn, qgm.bytes_read(layer)


def parse(path: str) -> list[dict]:
    """ncu's raw CSV (one row a kernel, a units row after the header) -> the counters that matter, a dict a kernel."""
    lines = Path(path).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    rows = list(csv.DictReader(lines[start:]))[1:]  # [0] holds the units
    # names as the sections above put them on the raw page (ncu 2025.3, H200)
    picks = {"us": "gpu__time_duration.sum", "dram%": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
             "grid": "launch__grid_size", "block": "launch__block_size", "regs": "launch__registers_per_thread",
             "occ_theory%": "sm__maximum_warps_per_active_cycle_pct",
             "occ%": "sm__warps_active.avg.pct_of_peak_sustained_active",
             "issue/cyc": "smsp__issue_active.avg.per_cycle_active",
             "warps/inst": "smsp__average_warps_active_per_inst_executed.ratio",
             "l1%": "l1tex__throughput.avg.pct_of_peak_sustained_active",
             "smem/blk": "launch__shared_mem_per_block"}
    out = []
    for r in rows:
        d = {"kernel": r.get("Kernel Name", "?")[:28]}
        for key, metric in picks.items():
            v = r.get(metric, "")
            d[key] = v.replace(",", "")
        if d["us"]:
            d["us"] = f"{float(d['us']) / 1000:.2f}"  # ns -> us
        stalls = {name.split("stalled_")[1].split("_per_")[0]: float(v.replace(",", "") or 0)
                  for name, v in r.items() if name and "average_warps_issue_stalled_" in name
                  and name.endswith("_per_issue_active.ratio") and v}
        d["stalls"] = ", ".join(f"{k} {v:.2f}" for k, v in sorted(stalls.items(), key=lambda kv: -kv[1])[:4])
        out.append(d)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=CASES, help="scheme:shape:rows, comma-separated")
    ap.add_argument("--ncu", action="store_true", help="one profiled launch a case, between cudaProfilerStart/Stop")
    ap.add_argument("--parse", help="print ncu's raw CSV (this script's --ncu run) as a table")
    args = ap.parse_args()
    if args.parse:
        table = parse(args.parse)
        keys = list(table[0]) if table else []
        print(" | ".join(keys))
        for d in table:
            print(" | ".join(str(d[k]) for k in keys))
        return
    torch.manual_seed(0)
    cases = [(s, sh, int(m)) for s, sh, m in (c.split(":") for c in args.cases.split(","))]
    fns = [case_fn(*c) for c in cases]
    for fn, _ in fns:  # compile and warm up outside the profiled range
        fn()
    torch.cuda.synchronize()
    if args.ncu:
        torch.cuda.cudart().cudaProfilerStart()
        for (scheme, shape, m), (fn, _) in zip(cases, fns):
            print(f"case {scheme}:{shape}:{m}", file=sys.stderr)
            fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return
    from first_gpu import copy_bandwidth
    bw = copy_bandwidth()
    rows = []
    floors: dict[int, tuple[float, str]] = {}
    for (scheme, shape, m), (fn, nbytes) in zip(cases, fns):
        us = qgm.bench(fn)
        if nbytes not in floors:
            floors[nbytes] = read_floor_us(nbytes)
        floor, how = floors[nbytes]
        rows.append(dict(scheme=scheme, shape=shape, rows=m, bytes=nbytes, us=us, pct_copy=qgm.pct(nbytes, us, bw),
                         floor_us=floor, floor_pct_copy=qgm.pct(nbytes, floor, bw), floor_launch=how,
                         over_floor=us / floor))
        print(rows[-1], flush=True)
    out = Path(os.environ.get("OUT") or "bench/results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant_ncu.json").write_text(json.dumps(dict(
        device=torch.cuda.get_device_name(), commit=os.environ.get("COMMIT", "?"), copy_gbs=bw / 1e9,
        dtype="bfloat16", int4=qgm.SCHEME_VARIANTS["int4"], rows=rows), indent=1))
    print(f"{'case':22} {'MB':>6} {'us':>7} {'%copy':>6} {'floor us':>9} {'%copy':>6} {'x floor':>8}")
    for r in rows:
        print(f"{r['scheme'] + ':' + r['shape'] + ':' + str(r['rows']):22} {r['bytes'] / 1e6:6.1f} {r['us']:7.2f} "
              f"{r['pct_copy']:6.1f} {r['floor_us']:9.2f} {r['floor_pct_copy']:6.1f} {r['over_floor']:8.2f}")


if __name__ == "__main__":
    with torch.inference_mode():  # the kernels take no-grad calls only (kernels/_triton.use_triton)
        main()
