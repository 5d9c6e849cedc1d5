"""MoE block microbenchmark (GPU): the fused Triton path against torch's grouped GEMM and the reference loop.

Shapes: Qwen3.6-35B-A3B (hidden 2048, 256 experts, top-8, expert intermediate 512, shared expert 512, folded into
the grouped launches) and Qwen3-Coder-30B-A3B (hidden 2048, 128 experts, top-8, intermediate 768, no shared).
For each token count T, uniform random routing (distinct experts per token) through the block's
`route_override` hook, a different draw for each call inside a timed graph so that the experts are not left in
L2 by the previous call (the engine runs 40-48 such layers per step). Reported per whole block (router GEMM
included): microseconds, the distinct experts touched, their bytes (plus router and shared weights) and the
effective GB/s = bytes / time, next to the copy bandwidth.

Paths:
- fused: the block on the Triton kernels (backend "fused"), timed as a CUDA-graph replay (as in the engine).
- fused_routed: the same with the block's own routing (router + top-k kernel, random x): one launch fewer.
- fused_eager: fused, launched eagerly (launch overhead included).
- grouped: backend "grouped" (torch._grouped_mm), graph replay where capture works, else eager.
- reference: backend "reference" (loop over experts; host syncs, so eager only), up to T = 256.
--sweep also times each grouped GEMM alone over launch configs (gate_up, down) per T, to tune gemm_config.

CUDA events, medians after warm-up. Prints a table last; JSON to $OUT/moe_kernels.json (else bench/results/).

  python bench/moe_kernels.py [--shapes 35b,coder30b] [--tokens 1,4,16,64,256,512,1024] [--sweep]
  (the sweep compiles ~80 kernels per shape: run it as its own invocation, e.g. --sweep --paths fused)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path

import torch

from blockspec.kernels import moe_grouped as mg
from blockspec.models.layers.moe import FUSED_MAX_TOKENS, SparseMoeBlock

sys.path.insert(0, str(Path(__file__).resolve().parent))  # first_gpu.py sits beside this script
from first_gpu import copy_bandwidth  # noqa: E402

SHAPES = {  # hidden, experts, top-k, intermediate, shared intermediate, renormalize
    "35b": dict(name="Qwen3.6-35B-A3B", hidden=2048, experts=256, top_k=8, inter=512, shared=512, renorm=True),
    "coder30b": dict(name="Qwen3-Coder-30B-A3B", hidden=2048, experts=128, top_k=8, inter=768, shared=0,
                     renorm=True),
}
CALLS = 8  # block calls per timed graph, each with its own routing draw
DEVICE = "cuda"
BYTES = 2  # bf16


def build_block(shape: dict) -> SparseMoeBlock:
    with torch.device(DEVICE):
        block = SparseMoeBlock(shape["hidden"], shape["experts"], shape["top_k"], shape["inter"], shape["renorm"],
                               shape["shared"])
    return block.to(torch.bfloat16).eval()


def routing_draws(t: int, e: int, k: int, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n uniform random routings: k distinct experts per token, weights summing to one."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.rand(t, e, device=DEVICE, generator=g).argsort(dim=-1)[:, :k].contiguous()
        w = torch.rand(t, k, device=DEVICE, generator=g) + 0.1
        out.append(((w / w.sum(-1, keepdim=True)).to(torch.bfloat16), ids))
    return out


class Cycle:
    """A route_override returning the next precomputed draw on each call (graph-safe: static tensors)."""

    def __init__(self, draws: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.draws, self.i = draws, 0

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.draws[self.i % len(self.draws)]
        self.i += 1
        return d


def median_us(fn: Callable[[], object], reps: int, per_call: int = 1) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / per_call)
    return statistics.median(times)


def graph_us(fn: Callable[[], object], calls: int, reps: int) -> float:
    """Median microseconds per call of `calls` calls captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(3):
        graph.replay()
    us = median_us(graph.replay, reps, calls)
    del graph
    return us


def eager_us(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return median_us(fn, reps)


def count_launches(fn: Callable[[], object]) -> int | None:
    """Kernels one call launches (torch profiler), or None where the profiler is not available."""
    try:
        from torch.profiler import ProfilerActivity, profile
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for ev in prof.events() if ev.device_type.name == "CUDA" and "Memcpy" not in ev.name
                   and "Memset" not in ev.name)
    except Exception:  # noqa: BLE001 (a diagnostic; the timings do not depend on it)
        return None


def weight_bytes(shape: dict, distinct: float) -> float:
    """Bytes a step must read: the touched experts, the shared expert, the router (and the shared gate)."""
    h, i, s = shape["hidden"], shape["inter"], shape["shared"]
    return BYTES * (distinct * 3 * i * h + 3 * s * h + shape["experts"] * h + (h if s else 0))


def run_block(block: SparseMoeBlock, shape: dict, t: int, reps: int, paths: list[str]) -> dict:
    e, k, h = shape["experts"], shape["top_k"], shape["hidden"]
    draws = routing_draws(t, e, k, CALLS, seed=t)
    distinct = statistics.mean(float(ids.unique().numel()) for _, ids in draws)
    nbytes = weight_bytes(shape, distinct)
    x = torch.randn(t, h, device=DEVICE, dtype=torch.bfloat16)
    row: dict = {"tokens": t, "distinct_experts": round(distinct, 1), "bytes": int(nbytes)}

    def use(backend: str, override: bool) -> Callable[[], torch.Tensor]:
        block.experts.backend = backend
        block.route_override = Cycle(draws) if override else None
        return lambda: block(x)

    with torch.inference_mode():
        # correctness on the first draw: fused against the reference loop
        block.route_override = Cycle(draws[:1])
        block.experts.backend = "reference"
        want = block(x).float()
        block.route_override = Cycle(draws[:1])
        block.experts.backend = "fused"
        got = block(x).float()
        row["fused_rel_err"] = round(float((got - want).norm() / want.norm()), 5)
        for path in paths:
            try:
                if path == "fused":
                    us = graph_us(use("fused", True), CALLS, reps)
                    row["fused_launches"] = count_launches(use("fused", True))
                elif path == "fused_routed":
                    us = graph_us(use("fused", False), CALLS, reps)
                    row["fused_routed_launches"] = count_launches(use("fused", False))
                elif path == "fused_eager":
                    us = eager_us(use("fused", True), reps)
                elif path == "grouped":
                    try:
                        us = graph_us(use("grouped", True), CALLS, reps)
                        row["grouped_mode"] = "graph"
                    except Exception as exc:  # noqa: BLE001
                        row["grouped_mode"] = f"eager ({type(exc).__name__})"
                        torch.cuda.synchronize()
                        us = eager_us(use("grouped", True), reps)
                elif path == "reference":
                    if t > 256:
                        continue
                    us = eager_us(use("reference", True), max(5, reps // 4))
                else:
                    raise ValueError(path)
            except Exception as exc:  # noqa: BLE001 (report and go on with the other paths)
                row[f"{path}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                torch.cuda.synchronize()
                continue
            row[f"{path}_us"] = round(us, 2)
            row[f"{path}_GBs"] = round(nbytes / us / 1e3, 1)
            print(f"  T={t:5d} {path:13s} {us:9.1f} us  {nbytes / us / 1e3:7.1f} GB/s", flush=True)
    block.route_override = None
    block.experts.backend = "auto"
    return row


# T is not a compile-time constant of the kernels: each config compiles once per shape (~1 s), then times per T
SWEEP_DOT = [mg.GemmConfig(16, bn, bk, w, 3)
             for bn, bk, w in itertools.product((16, 32, 64, 128), (64, 128, 256), (4, 8))]
SWEEP_ROW = [mg.GemmConfig(1, bn, bk, w, 3) for bn, bk, w in itertools.product((4, 8, 16, 32), (256, 512), (4, 8))]


def sweep(block: SparseMoeBlock, shape: dict, t: int, reps: int) -> dict:
    """Each grouped GEMM alone, over launch configs, for one routing draw (graph replay of CALLS launches)."""
    e, k, h, i = shape["experts"], shape["top_k"], shape["hidden"], shape["inter"]
    weights, ids = routing_draws(t, e, k, 1, seed=1000 + t)[0]
    shared = block._folded_shared()
    slots = k + int(shared is not None)
    x = torch.randn(t, h, device=DEVICE, dtype=torch.bfloat16)
    out: dict = {}
    with torch.inference_mode():
        layout = mg.moe_align(ids, e, shared is not None)
        act = torch.randn(t * slots, i, device=DEVICE, dtype=torch.bfloat16)
        y = torch.empty(t * slots, h, device=DEVICE, dtype=torch.bfloat16)
        gu, dn = block.experts.gate_up_proj, block.experts.down_proj
        for gated in (True, False):
            name = "gate_up" if gated else "down"
            n_out, kk = (i, h) if gated else (h, i)
            default = mg.gemm_config(t, n_out, kk, layout.max_items, gated)
            results = []
            for cfg in [default] + (SWEEP_ROW if t == 1 else SWEEP_DOT):
                def fn(cfg=cfg, gated=gated):
                    if gated:
                        mg._grouped_gemm(x, gu, None, shared.gate if shared else None, shared.up if shared else None,
                                         act, layout, slots, e, True, cfg)
                    else:
                        mg._grouped_gemm(act, dn, None, shared.down if shared else None, None, y, layout, slots, e,
                                         False, cfg)
                try:
                    results.append((graph_us(fn, CALLS, reps), cfg))
                except Exception:  # noqa: BLE001 (out of resources and the like: skip that config)
                    torch.cuda.synchronize()
            default_us = results[0][0]
            best_us, best = min(results, key=lambda r: r[0])
            ranked = sorted(results, key=lambda r: r[0])
            out[name] = {"default": astuple(default), "default_us": round(default_us, 2), "best": astuple(best),
                         "best_us": round(best_us, 2), "top5": [[round(u, 2), astuple(c)] for u, c in ranked[:5]]}
            print(f"  sweep T={t:4d} {name:7s} default {default_us:7.1f} us {astuple(default)}  "
                  f"best {best_us:7.1f} us {astuple(best)}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="35b,coder30b")
    ap.add_argument("--tokens", default="1,4,16,64,256,512,1024")
    ap.add_argument("--paths", default="fused,fused_routed,fused_eager,grouped,reference")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sweep", action="store_true", help="also sweep the grouped GEMMs' launch configs")
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write); fused path up to FUSED_MAX_TOKENS={FUSED_MAX_TOKENS} "
          "under backend auto", flush=True)
    paths = args.paths.split(",")
    tokens = [int(v) for v in args.tokens.split(",")]
    results = []
    for key in args.shapes.split(","):
        shape = SHAPES[key]
        print(f"{shape['name']}: {shape}", flush=True)
        block = build_block(shape)
        rows = []
        for t in tokens:
            row = run_block(block, shape, t, args.reps, paths)
            row["ideal_us"] = round(row["bytes"] / bw * 1e6, 2)
            if args.sweep and t <= 256:
                row["sweep"] = sweep(block, shape, t, max(10, args.reps // 3))
            rows.append(row)
        results.append({"shape": key, **shape, "rows": rows})
        del block
        torch.cuda.empty_cache()
    out = {"device": torch.cuda.get_device_name(), "commit": os.environ.get("COMMIT", "?"),
           "torch": torch.__version__, "copy_bandwidth_GBs": round(bw / 1e9, 1), "calls_per_graph": CALLS,
           "results": results}
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).resolve().parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "moe_kernels.json").write_text(json.dumps(out, indent=1))

    cols = [p for p in paths if p != "fused_eager"] + (["fused_eager"] if "fused_eager" in paths else [])
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s; us per MoE block (graph replay unless noted), effective GB/s")
    head = f"{'shape':9s} {'T':>5s} {'experts':>7s} {'MB':>7s} {'ideal':>7s} " + " ".join(f"{c:>13s}" for c in cols)
    print(head + f" {'GB/s fused':>10s} {'launches':>8s}")
    for res in results:
        for r in res["rows"]:
            cells = " ".join(f"{r.get(f'{c}_us', float('nan')):13.1f}" for c in cols)
            print(f"{res['shape']:9s} {r['tokens']:5d} {r['distinct_experts']:7.1f} {r['bytes'] / 1e6:7.1f} "
                  f"{r['ideal_us']:7.1f} {cells} {r.get('fused_GBs', float('nan')):10.1f} "
                  f"{str(r.get('fused_routed_launches')):>8s}")


if __name__ == "__main__":
    main()
