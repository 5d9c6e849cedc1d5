"""Why a prefix-cache hit's prefill waits on the host, in parts (issue 16): host time per operation of the eager
prefill, and the GPU time of the attention options for T new tokens over L cached keys.

A hit on the Qwen3-8B shape (6,000 cached + 200 new tokens) runs ~500 kernels in ~12 ms of GPU time, but its TTFT
is 24-32 ms: the GPU idles between launches (prefix_cache_gpu.py --profile). This measures, on the GPU machine:
  - host microseconds per call (no sync; the median of 200 calls) of each operation kind the prefill issues;
  - GPU milliseconds of the attention choices for one layer: gather + flash SDPA (today) and the paged
    Triton kernel at 1-8 key splits (what a CUDA-graph prefill could run), with their max difference.
Prints a table last; writes prefix_hit_parts.json to --out (default $OUT, else bench/results).

Usage (repository root, on the GPU machine): python bench/prefix_hit_parts.py [--new 200] [--cached 6000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

from blockspec.kernels.activation import silu_mul  # noqa: E402
from blockspec.kernels.paged_attention import paged_attention  # noqa: E402
from blockspec.kernels.rms_norm import rms_norm  # noqa: E402
from blockspec.models.layers.attention import tail_prefill_attention  # noqa: E402


def host_us(fn, calls: int = 200) -> float:
    """Median host time of one call, the GPU kept busy enough that launches never wait on it."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) % 20 == 0:
            torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def gpu_ms(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@torch.inference_mode()  # as the engine runs: the kernels' wrappers take the PyTorch references under autograd
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new", type=int, default=200)
    ap.add_argument("--cached", type=int, default=6000)
    ap.add_argument("--out", default=os.environ.get("OUT", str(BENCH / "results")))
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    t, hidden, heads, kv_heads, hd, inter, page = args.new, 4096, 32, 8, 128, 12288, 16
    seq = args.cached + args.new
    x = torch.randn(t, hidden, device=dev, dtype=dt)
    w_qkv = torch.randn((heads + 2 * kv_heads) * hd, hidden, device=dev, dtype=dt) * 0.02
    w_gu = torch.randn(2 * inter, hidden, device=dev, dtype=dt) * 0.02
    norm_w = torch.ones(hidden, device=dev, dtype=dt)
    gu = torch.randn(t, 2 * inter, device=dev, dtype=dt)
    blocks = -(-seq // page) + 4
    k_cache = torch.randn(blocks, page, kv_heads, hd, device=dev, dtype=dt)
    v_cache = torch.randn(blocks, page, kv_heads, hd, device=dev, dtype=dt)
    table = torch.randperm(blocks, device=dev)[: -(-seq // page)].to(torch.int32)
    slots = (table.long()[:, None] * page + torch.arange(page, device=dev)).flatten()[:seq][None]
    q = torch.randn(t, heads, hd, device=dev, dtype=dt)
    scale = hd ** -0.5
    seq_lens = torch.tensor([seq], device=dev, dtype=torch.int32)
    kv_start = torch.zeros(1, device=dev, dtype=torch.int32)

    host = {
        "F.linear qkv [200 x 4096 -> 6144]": host_us(lambda: F.linear(x, w_qkv)),
        "F.linear gate_up [-> 24576]": host_us(lambda: F.linear(x, w_gu)),
        "rms_norm (Triton, + empty_like)": host_us(lambda: rms_norm(x, norm_w, 1e-6)),
        "rms_norm with residual": host_us(lambda: rms_norm(x, norm_w, 1e-6, residual=x)),
        "silu_mul (Triton)": host_us(lambda: silu_mul(gu)),
        "torch add": host_us(lambda: x + x),
        "gather_kv (index)": host_us(lambda: k_cache.view(-1, kv_heads, hd)[slots]),
        "tail_prefill_attention (2 gathers + flash)": host_us(
            lambda: tail_prefill_attention(q, k_cache, v_cache, slots, scale)),
        "paged_attention (Triton + merge), 1 split": host_us(
            lambda: paged_attention(q, k_cache, v_cache, table[None], seq_lens, kv_start, t, scale, True,
                                    num_splits=1)),
    }
    ref = tail_prefill_attention(q, k_cache, v_cache, slots, scale)
    gpu = {"gather + flash (tail_prefill_attention)": [gpu_ms(lambda: tail_prefill_attention(q, k_cache, v_cache, slots,
                                                                                  scale)), 0.0]}
    for splits in (1, 2, 4, 8):
        out = paged_attention(q, k_cache, v_cache, table[None], seq_lens, kv_start, t, scale, True,
                              num_splits=splits).reshape(t, -1)
        gpu[f"paged Triton, {splits} split(s)"] = [
            gpu_ms(lambda s=splits: paged_attention(q, k_cache, v_cache, table[None], seq_lens, kv_start, t,
                                                    scale, True, num_splits=s)),
            (out.float() - ref.float()).abs().max().item()]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=BENCH.parent).stdout.strip() or os.environ.get("COMMIT", "unknown")
    except OSError:
        commit = os.environ.get("COMMIT", "unknown")
    result = {"commit": os.environ.get("COMMIT", commit), "device": torch.cuda.get_device_name(), "dtype": "bfloat16",
              "settings": {"new_tokens": t, "cached_tokens": args.cached, "shape": "Qwen3-8B"},
              "host_us_per_call": {k: round(v, 1) for k, v in host.items()},
              "attention_gpu_ms_one_layer": {k: [round(v[0], 4), v[1]] for k, v in gpu.items()}}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "prefix_hit_parts.json").write_text(json.dumps(result, indent=1))
    print("| operation | host us / call |\n|---|---|")
    for k, v in host.items():
        print(f"| {k} | {v:.1f} |")
    print("\n| attention, one layer | GPU ms | max abs diff vs today |\n|---|---|---|")
    for k, (ms, diff) in gpu.items():
        print(f"| {k} | {ms:.4f} | {diff:.2e} |")


if __name__ == "__main__":
    main()
