"""Where a batch-1 decode step spends its GPU time: per-kernel times inside the captured graphs, and
the GEMV efficiency of each projection shape (issue 5's profiling run, before tuning kernels).

For the Qwen3-8B shape (random bf16 weights; AR and k = 15 with the 5-layer drafter) and, with
--smol, the embedded SmolLM2-135M: replays each captured graph under torch.profiler and sums the
kernels by name (time per replay, launches per replay), next to the graph's wall time per replay
(the difference is the gap between kernels). Then times each linear shape at M = 1 and M = 16,
cuBLAS and (when present) blockspec's skinny Triton kernel, as achieved bandwidth.
Prints tables last and writes profile_decode.json under $OUT (or --out).

Usage: python bench/profile_decode.py [--smol DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from first_gpu import QWEN3_8B, copy_bandwidth, drafter_config, replay_ms, write_dir  # noqa: E402
from gpu_decode import engine  # noqa: E402

REPLAYS = 20


def kernel_table(eng: Engine, name: str) -> dict:
    """Per-kernel GPU time of one replay of graph `name` at batch 1, and the replay's wall time."""
    graphs = eng.runner.decode.graphs
    wall_us = 1000 * replay_ms(eng, name, REPLAYS)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graphs.run(name, 1, None)
        torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            per[ev.name][0] += ev.device_time_total / REPLAYS
            per[ev.name][1] += 1 / REPLAYS
    rows = sorted(([k[:90], round(v[0], 2), round(v[1], 2)] for k, v in per.items()), key=lambda r: -r[1])
    busy = sum(r[1] for r in rows)
    return {"graph": name, "wall_us": round(wall_us, 1), "kernel_us": round(busy, 1),
            "launches": round(sum(r[2] for r in rows), 1), "kernels": rows}


def replay_sequence(eng: Engine, name: str) -> list[list]:
    """The kernels of one replay of graph `name` at batch 1 in launch order, [name, us] each: per-op times
    (which skinny GEMM is which) that kernel_table's sums by name hide. The replay reads the graph's input
    buffers as the last real step left them, so a MoE layer routes that step's tokens."""
    eng.runner.decode.graphs.run(name, 1, None)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        eng.runner.decode.graphs.run(name, 1, None)
        torch.cuda.synchronize()
    evs = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0]
    evs.sort(key=lambda ev: ev.time_range.start)
    return [[ev.name[:60], round(ev.device_time_total, 2)] for ev in evs]


def steps_table(fn, steps: int) -> dict:
    """Per-kernel GPU time per step of whatever `fn` runs (real engine steps: their own routing, host gaps
    and all), summed by kernel name over the run and divided by its `steps`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            per[ev.name][0] += ev.device_time_total / steps
            per[ev.name][1] += 1 / steps
    rows = sorted(([k[:90], round(v[0], 2), round(v[1], 2)] for k, v in per.items()), key=lambda r: -r[1])
    return {"steps": steps, "kernel_us": round(sum(r[1] for r in rows), 1),
            "launches": round(sum(r[2] for r in rows), 1), "kernels": rows}


def model_tables(model_dir: Path, draft: Path | None, dummy: bool, prompt: list[int]) -> list[dict]:
    out = []
    for k, d in ((0, None), (15, draft)):
        if k and d is None:
            continue
        eng = engine(model_dir, d, k, dummy, 2048)
        eng.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        for name in (("target",) if k == 0 else ("target", "draft")):
            out.append({"k": k} | kernel_table(eng, name))
        eng.release()
        del eng
    return out


def time_linear(fn, reps: int = 50) -> float:
    """Microseconds per call, from a CUDA graph of `reps` calls (no launch overhead)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / reps)
    return 1e6 * best


@torch.no_grad()  # the Triton kernels serve inference only: with grad on, skinny_linear is the reference
def gemv_table(bw: float) -> list[dict]:
    try:
        from blockspec.kernels.skinny_linear import skinny_linear
    except ImportError:
        skinny_linear = None
    h, i, v = 4096, 12288, 151936
    shapes = {"8b qkv": (6144, h), "8b o": (h, h), "8b gate_up": (2 * i, h), "8b down": (h, i),
              "8b lm_head": (v, h), "smol qkv": (960, 576), "smol o": (576, 576), "smol gate_up": (3072, 576),
              "smol down": (576, 1536), "smol lm_head": (49152, 576)}
    rows = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        nw = torch.rand(k, device="cuda", dtype=torch.bfloat16)
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"shape": name, "m": m, "n": n, "k": k, "ideal_us": round(1e6 * 2 * n * k / bw, 2)}
            row |= time_shape(x, w, nw, skinny_linear)
            rows.append(row)
    return rows


def time_shape(x: torch.Tensor, w: torch.Tensor, nw: torch.Tensor, skinny_linear) -> dict:
    row = {"cublas_us": round(time_linear(lambda: F.linear(x, w)), 2)}
    if skinny_linear is not None:
        row["skinny_us"] = round(time_linear(lambda: skinny_linear(x, w)), 2)
        row["skinny_norm_us"] = round(time_linear(lambda: skinny_linear(x, w, norm_weight=nw, eps=1e-6)), 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smol", type=Path, required=True,
                    help="SmolLM2 model directory (real weights; its tokenizer serves the 8B shape too)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    bw = copy_bandwidth()
    work = Path(tempfile.mkdtemp())
    q8 = write_dir(work / "qwen3-8b", QWEN3_8B, tokenizer_from=args.smol)
    q8_draft = write_dir(work / "qwen3-8b-draft", drafter_config(QWEN3_8B, 5, [1, 9, 17, 25, 33], 151669))
    prompt = torch.randint(100, 30000, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    result = {"commit": os.environ.get("COMMIT", "unknown"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "dtype": "bfloat16", "batch": 1, "context": 512,
              "copy_bandwidth_GBs": round(bw / 1e9, 1), "gemv": gemv_table(bw),
              "qwen3_8b": model_tables(q8, q8_draft, True, prompt)}
    result["smollm2"] = model_tables(args.smol, None, False, [1, 2, 3] * 60)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "profile_decode.json").write_text(json.dumps(result, indent=1))
    print(f"{result['device']}  commit {result['commit']}  copy {result['copy_bandwidth_GBs']} GB/s")
    for key in ("qwen3_8b", "smollm2"):
        for t in result.get(key, []):
            print(f"\n-- {key} k={t['k']} graph {t['graph']}: wall {t['wall_us']} us, kernels {t['kernel_us']} us, "
                  f"{t['launches']} launches")
            for name, us, count in t["kernels"][:14]:
                print(f"   {us:9.1f} us {count:6.1f}x  {name}")
    print("\nshape           m      n      k   ideal  cublas  skinny  skinny+norm (us)")
    for r in result["gemv"]:
        print(f"{r['shape']:14s} {r['m']:2d} {r['n']:6d} {r['k']:6d} {r['ideal_us']:7.1f} {r['cublas_us']:7.1f} "
              f"{r.get('skinny_us', float('nan')):7.1f} {r.get('skinny_norm_us', float('nan')):7.1f}")


if __name__ == "__main__":
    main()
