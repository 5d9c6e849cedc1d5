"""What a weight prefetch into L2 buys one GEMM (kernels/l2_prefetch.py), on the GPU.

For each projection of a Qwen3-8B layer, each weight format and row count, the GEMM's time (CUDA events, median of
--reps) after the L2 was flushed by a 256 MB write:
  cold       the GEMM alone (what a decode step's GEMM meets after the previous layer's ~100 MB)
  idle_<us>  the same after a main-stream sleep of <us> (attention's HBM-idle phase, modelled; no prefetch)
  pf_<us>    the sleep with the prefetch forked onto a side stream when it starts (what the layers do)
  warm       the GEMM right after itself (as much of it in L2 as fits)
and checks that a prefetched GEMM's output equals the cold one's. Prints a table, JSON to $OUT (or bench/results).
    python bench/l2_prefetch.py [--schemes int4,nvfp4,bf16] [--rows 1,16] [--sleep-us 4,10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from blockspec.kernels import l2_prefetch  # noqa: E402
from blockspec.models.layers.quant_linear import QuantLinear  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}  # (N, K)
GROUP = {"int4": 128, "nvfp4": 16}


def layer_for(scheme: str, n: int, k: int) -> torch.nn.Module:
    if scheme == "bf16":
        layer = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        torch.nn.init.normal_(layer.weight, std=0.02)
        return layer
    return QuantLinear(scheme, k, n, GROUP[scheme], dtype=torch.bfloat16, device="cuda")


def run(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, layer.weight) if isinstance(layer, torch.nn.Linear) else layer(x)


def cycles_per_us() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(2_000_000)
    end.record()
    torch.cuda.synchronize()
    return 2_000_000 / (start.elapsed_time(end) * 1e3)


def timed(layer, x, flush: torch.Tensor, mode: str, sleep_cycles: int, side: torch.cuda.Stream, reps: int
          ) -> tuple[float, torch.Tensor]:
    """Median microseconds of one GEMM in `mode`, and its last output."""
    times, out = [], None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        flush.add_(1)
        if mode == "warm":
            run(layer, x)
        elif mode.startswith(("idle", "pf")):
            if mode.startswith("pf"):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for t in l2_prefetch.weight_tensors(layer):
                        l2_prefetch.prefetch_tensor(t.reshape(-1).view(torch.uint8))
            torch.cuda._sleep(sleep_cycles)
        start.record()
        out = run(layer, x)
        end.record()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times), out


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemes", default="int4,nvfp4,bf16")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--sleep-us", default="4,10")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=os.environ.get("OUT", str(Path(__file__).parent / "results")))
    args = ap.parse_args()
    torch.manual_seed(0)
    assert l2_prefetch.available(torch.empty(1, device="cuda")), "prefetch unavailable (needs sm_90+, Triton)"
    cpu = cycles_per_us()
    flush = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    sleeps = [float(s) for s in args.sleep_us.split(",")]
    modes = ["cold"] + [f"{p}_{s:g}" for s in sleeps for p in ("idle", "pf")] + ["warm"]
    rows_out, equal = [], True
    for scheme in args.schemes.split(","):
        for name, (n, k) in SHAPES.items():
            layer = layer_for(scheme, n, k)
            nbytes = sum(t.numel() * t.element_size() for t in l2_prefetch.weight_tensors(layer))
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                for _ in range(3):
                    run(layer, x)
                rec = {"scheme": scheme, "layer": name, "n": n, "k": k, "rows": m, "bytes": nbytes}
                ref = None
                for mode in modes:
                    sleep = float(mode.split("_")[1]) if "_" in mode else 0.0
                    us, out = timed(layer, x, flush, mode, int(sleep * cpu), side, args.reps)
                    rec[f"{mode}_us"] = round(us, 2)
                    if mode == "cold":
                        ref = out
                    elif mode.startswith("pf"):
                        equal &= bool(torch.equal(out, ref))
                rows_out.append(rec)
                del x
            del layer
    dev = torch.cuda.get_device_name()
    commit = os.environ.get("COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                        text=True).stdout.strip()
    res = {"commit": commit, "device": dev, "dtype": "bfloat16 activations", "torch": torch.__version__,
           "l2_bytes": torch.cuda.get_device_properties(0).L2_cache_size, "sm_cycles_per_us": round(cpu, 1),
           "reps": args.reps, "prefetched_outputs_equal": equal, "rows": rows_out}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = "h200" if "H200" in dev else "h100" if "H100" in dev else "gpu"
    (out_dir / f"l2_prefetch_{tag}_{commit}.json").write_text(json.dumps(res, indent=1))
    print(f"{dev}  L2 {res['l2_bytes'] >> 20} MB  outputs equal: {equal}")
    print(f"{'scheme':6} {'layer':8} {'rows':>4} {'MB':>6} " + " ".join(f"{m:>9}" for m in modes))
    for r in rows_out:
        print(f"{r['scheme']:6} {r['layer']:8} {r['rows']:>4} {r['bytes'] / 1e6:6.1f} "
              + " ".join(f"{r[f'{m}_us']:9.2f}" for m in modes))


if __name__ == "__main__":
    main()
