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

--quant nvfp4|int4|fp8: the experts (and the shared expert) in that layout instead of bf16 (QuantExperts /
QuantLinear with random codes): NVFP4 as the Qwen3.6-35B-A3B NVFP4 checkpoints store it, int4 g128 asymmetric
(GPTQ / AutoRound), fp8 with 128x128 block scales. The grouped kernels dequantize the experts in registers;
the quantized shared expert runs on its own QuantLinear path. Bytes are the layouts' (packed weights, scales,
zeros, global scales) of the touched experts, the shared expert and the bf16 router. Default shape 35b,
tokens 1,16, paths fused,fused_routed,fused_eager,reference ("grouped" has no quantized operands).

--dry-run: the same flow on the CPU under TRITON_INTERPRET=1 (set by the script), a tiny shape, eager
timings by the wall clock, no copy bandwidth: it checks the script, not the kernels' speed.

CUDA events, medians after warm-up. Prints a table last; JSON to --out, else $OUT, else bench/results/
(moe_kernels.json, or moe_kernels_<quant>.json).

  python bench/moe_kernels.py [--shapes 35b,coder30b] [--tokens 1,4,16,64,256,512,1024] [--sweep]
  (the sweep compiles ~80 kernels per shape: run it as its own invocation, e.g. --sweep --paths fused)
  python bench/moe_kernels.py --quant nvfp4          # then --quant int4, --quant fp8
  python bench/moe_kernels.py --quant nvfp4 --dry-run --out /tmp/m
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path

if __name__ == "__main__" and "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # read when blockspec.kernels is imported: before the imports below

import torch  # noqa: E402

from blockspec.kernels import moe_grouped as mg  # noqa: E402
from blockspec.kernels import quant_gemv  # noqa: E402
from blockspec.kernels._triton import INTERPRET  # noqa: E402
from blockspec.models.layers.moe import FUSED_MAX_TOKENS, SparseMoeBlock  # noqa: E402
from blockspec.models.layers.quant_linear import QuantExperts, QuantLinear, quantized_tensor_bytes  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # first_gpu.py sits beside this script
from first_gpu import copy_bandwidth  # noqa: E402

SHAPES = {  # hidden, experts, top-k, intermediate, shared intermediate, renormalize
    "35b": dict(name="Qwen3.6-35B-A3B", hidden=2048, experts=256, top_k=8, inter=512, shared=512, renorm=True),
    "coder30b": dict(name="Qwen3-Coder-30B-A3B", hidden=2048, experts=128, top_k=8, inter=768, shared=0,
                     renorm=True),
}
# the dry run's: int4 g128 needs K >= 128
TINY = dict(name="tiny (dry run)", hidden=128, experts=8, top_k=4, inter=128, shared=128, renorm=True)
# layout -> (group size of both projections, symmetric): as the checkpoints of that kind store their experts
QUANT = {"nvfp4": (16, True), "int4": (128, False), "fp8": (128, True)}
CALLS = 8  # block calls per timed graph, each with its own routing draw
DEVICE = "cuda"  # the dry run sets "cpu"
# the dry run sets float32: the interpreter's bf16 tl.dot is not a GPU's (tests/kernels patch it, the script does not)
DTYPE = torch.bfloat16
PROFILE = False  # --profile


def build_block(shape: dict) -> SparseMoeBlock:
    with torch.device(DEVICE):
        block = SparseMoeBlock(shape["hidden"], shape["experts"], shape["top_k"], shape["inter"], shape["renorm"],
                               shape["shared"])
    return block.to(DTYPE).eval()


def quantize_block(block: SparseMoeBlock, shape: dict, scheme: str) -> SparseMoeBlock:
    """The block's experts and shared expert replaced by random codes in `scheme`'s layout (DTYPE scales)."""
    group, sym = QUANT[scheme]
    h, i, s = shape["hidden"], shape["inter"], shape["shared"]
    block.experts = QuantExperts(scheme, shape["experts"], h, i, group, group, symmetric=sym,
                                 dtype=DTYPE, device=DEVICE)
    if s:
        se = block.shared_expert
        se.gate_up_proj = QuantLinear(scheme, h, 2 * s, group, symmetric=sym, shard_sizes=[s, s], dtype=DTYPE,
                                      device=DEVICE)
        se.down_proj = QuantLinear(scheme, s, h, group, symmetric=sym, dtype=DTYPE, device=DEVICE)
    return block.eval()


def routing_draws(t: int, e: int, k: int, n: int, seed: int, pool: int | None = None
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n uniform random routings: k distinct experts per token, weights summing to one. With `pool`, each draw's
    tokens pick from one random set of `pool` experts: a block touching about as many experts as the engine's
    verify blocks do (hybrid_gpu.py reports ~40 a layer for the 35B-A3B shape, ~18 for Coder-30B), where the
    grid is mostly idle programs and a fixed cost per launch shows that uniform routing hides."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    out = []
    for _ in range(n):
        if pool is None:
            ids = torch.rand(t, e, device=DEVICE, generator=g).argsort(dim=-1)[:, :k].contiguous()
        else:
            if not k <= pool <= e:
                raise SystemExit(f"--pool {pool}: needs top-k ({k}) <= pool <= experts ({e})")
            chosen = torch.rand(e, device=DEVICE, generator=g).argsort()[:pool]
            ids = chosen[torch.rand(t, pool, device=DEVICE, generator=g).argsort(dim=-1)[:, :k]].contiguous()
        w = torch.rand(t, k, device=DEVICE, generator=g) + 0.1
        out.append(((w / w.sum(-1, keepdim=True)).to(DTYPE), ids))
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
    if DEVICE == "cpu":  # the dry run: the wall clock
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6 / per_call)
        return statistics.median(times)
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
    for _ in range(3 if DEVICE == "cuda" else 1):
        fn()
    if DEVICE == "cuda":
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


def kernel_times(fn: Callable[[], object], calls: int = 20) -> dict[str, float] | None:
    """GPU microseconds a call of each kernel `fn` launches (torch profiler, eager; run with BLOCKSPEC_PDL=0, or a
    kernel's time includes its wait for the one before), or None where the profiler is not available."""
    try:
        from torch.profiler import ProfilerActivity, profile
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 (a diagnostic; the timings do not depend on it)
        return None
    times: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_type.name == "CUDA" and ev.device_time_total > 0:
            times[ev.key[:60]] = round(ev.device_time_total / calls, 2)
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def weight_bytes(shape: dict, distinct: float, block: SparseMoeBlock | None = None) -> float:
    """Bytes a step must read: the touched experts, the shared expert, the router (and the shared gate); with
    a quantized `block`, its layouts' bytes per expert and the quantized shared expert's."""
    h, i, s = shape["hidden"], shape["inter"], shape["shared"]
    router = DTYPE.itemsize * (shape["experts"] * h + (h if s else 0))
    if block is not None and isinstance(block.experts, QuantExperts):
        per_expert = quantized_tensor_bytes(block.experts) / shape["experts"]
        shared = quantized_tensor_bytes(block.shared_expert) if s else 0
        return distinct * per_expert + shared + router
    return DTYPE.itemsize * (distinct * 3 * i * h + 3 * s * h) + router


def run_block(block: SparseMoeBlock, shape: dict, t: int, reps: int, paths: list[str], pool: int | None = None
              ) -> dict:
    e, k, h = shape["experts"], shape["top_k"], shape["hidden"]
    draws = routing_draws(t, e, k, CALLS, seed=t, pool=pool)
    distinct = statistics.mean(float(ids.unique().numel()) for _, ids in draws)
    nbytes = weight_bytes(shape, distinct, block)
    x = torch.randn(t, h, device=DEVICE, dtype=DTYPE)
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
                    if PROFILE:
                        row["fused_kernels_us"] = kernel_times(use("fused", True))
                        print(f"  T={t:5d} kernels (us a call): {row['fused_kernels_us']}", flush=True)
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
                if DEVICE == "cuda":
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
SWEEP_ROW = [mg.GemmConfig(1, bn, bk, w, 3) for bn, bk, w in itertools.product((2, 4, 8, 16), (128, 256, 512), (4, 8))]


def sweep(block: SparseMoeBlock, shape: dict, t: int, reps: int, pool: int | None = None) -> dict:
    """Each grouped GEMM alone, over launch configs (graph replay of CALLS launches, each routed by its own draw:
    with one draw for all, a step's experts stayed in L2 from the launch before and the sweep timed L2)."""
    e, k, h, i = shape["experts"], shape["top_k"], shape["hidden"], shape["inter"]
    x = torch.randn(t, h, device=DEVICE, dtype=DTYPE)
    shared = block._folded_shared(x)
    slots = k + int(shared is not None)
    out: dict = {}
    with torch.inference_mode():
        layouts = [mg.moe_align(ids, e, shared is not None)
                   for _, ids in routing_draws(t, e, k, CALLS, seed=1000 + t, pool=pool)]
        turn = itertools.count()
        layout = layouts[0]
        act = torch.randn(t * slots, i, device=DEVICE, dtype=DTYPE)
        y = torch.empty(t * slots, h, device=DEVICE, dtype=DTYPE)
        gu, dn = block.experts.gate_up_proj, block.experts.down_proj
        for gated in (True, False):
            name = "gate_up" if gated else "down"
            n_out, kk = (i, h) if gated else (h, i)
            default = mg.gemm_config(t, n_out, kk, layout.max_items, gated)
            results = []
            for cfg in [default] + (SWEEP_ROW if t == 1 else SWEEP_DOT):
                def fn(cfg=cfg, gated=gated):
                    layout = layouts[next(turn) % CALLS]
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


def main(argv: list[str] | None = None) -> None:
    global DEVICE, DTYPE, PROFILE
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=None, help="35b,coder30b (default; --quant: 35b)")
    ap.add_argument("--tokens", default=None, help="1,4,16,64,256,512,1024 (default; --quant: 1,16)")
    ap.add_argument("--paths", default=None,
                    help="fused,fused_routed,fused_eager,grouped,reference (default; --quant: no grouped)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sweep", action="store_true", help="also sweep the grouped GEMMs' launch configs (bf16)")
    ap.add_argument("--quant", choices=sorted(QUANT), help="experts and shared expert in this layout")
    ap.add_argument("--pool", type=int, default=None,
                    help="route each call's tokens among this many random experts (default: all, uniform)")
    ap.add_argument("--profile", action="store_true",
                    help="with the fused_eager path: GPU time per kernel of a call (run with BLOCKSPEC_PDL=0)")
    ap.add_argument("--no-scan", action="store_true",
                    help="group every step's pairs with the align kernel (moe_grouped.SCAN_MAX_PAIRS = 0), as "
                         "before the grouped GEMMs scanned a small step's ids themselves")
    ap.add_argument("--one-token-rows", action="store_true",
                    help="NVFP4 experts: one token on quant_gemv's rows kernel (MOE_ROWS_MIN_TOKENS = 1) instead of "
                         "its one-token GEMV")
    ap.add_argument("--dry-run", action="store_true", help="CPU under TRITON_INTERPRET=1, a tiny shape")
    ap.add_argument("--out", default=None, help="directory for the JSON (else $OUT, else bench/results/)")
    args = ap.parse_args(argv)
    quant = args.quant
    PROFILE = args.profile
    if args.no_scan:
        mg.SCAN_MAX_PAIRS = 0
    if args.one_token_rows:
        quant_gemv.MOE_ROWS_MIN_TOKENS = 1
    if args.dry_run:
        if not INTERPRET:
            raise SystemExit("--dry-run runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1 (the "
                             "script does when run directly)")
        DEVICE, DTYPE = "cpu", torch.float32
    shapes = [TINY] if args.dry_run else [SHAPES[k] for k in (args.shapes or ("35b" if quant else "35b,coder30b"))
                                            .split(",")]
    tokens = [int(v) for v in (args.tokens or ("1,16" if quant or args.dry_run else "1,4,16,64,256,512,1024"))
              .split(",")]
    paths = (args.paths or ("fused_eager,reference" if args.dry_run else
                            "fused,fused_routed,fused_eager,reference" if quant else
                            "fused,fused_routed,fused_eager,grouped,reference")).split(",")
    reps = 2 if args.dry_run else args.reps
    torch.manual_seed(0)
    bw = copy_bandwidth() if DEVICE == "cuda" else None
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write); " if bw else "dry run on the CPU; ", end="")
    print(f"fused path up to FUSED_MAX_TOKENS={FUSED_MAX_TOKENS} under backend auto; experts "
          f"{quant or 'bf16'}", flush=True)
    results = []
    for shape in shapes:
        key = next((k for k, v in SHAPES.items() if v is shape), "tiny")
        print(f"{shape['name']}: {shape}", flush=True)
        block = build_block(shape)
        if quant:
            block = quantize_block(block, shape, quant)
        rows = []
        for t in tokens:
            row = run_block(block, shape, t, reps, paths, args.pool)
            row["ideal_us"] = round(row["bytes"] / bw * 1e6, 2) if bw else None
            if args.sweep and not quant and t <= 256:
                row["sweep"] = sweep(block, shape, t, max(10, reps // 3), args.pool)
            rows.append(row)
        results.append({"shape": key, **shape, "rows": rows})
        del block
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    out = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
           "commit": os.environ.get("COMMIT", "?"), "torch": torch.__version__, "experts": quant or "bf16",
           "copy_bandwidth_GBs": round(bw / 1e9, 1) if bw else None, "calls_per_graph": CALLS, "pool": args.pool,
           "scan_max_pairs": mg.SCAN_MAX_PAIRS, "moe_rows_min_tokens": quant_gemv.MOE_ROWS_MIN_TOKENS,
           "results": results}
    out_dir = Path(args.out or os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    name = ("moe_kernels" + (f"_{quant}" if quant else "") + (f"_pool{args.pool}" if args.pool else "")
            + ("_noscan" if args.no_scan else "") + ("_onerows" if args.one_token_rows else ""))
    (out_dir / f"{name}.json").write_text(json.dumps(out, indent=1))

    cols = [p for p in paths if p != "fused_eager"] + (["fused_eager"] if "fused_eager" in paths else [])
    print(f"\nexperts {quant or 'bf16'}; us per MoE block (graph replay unless noted), effective GB/s")
    head = f"{'shape':9s} {'T':>5s} {'experts':>7s} {'MB':>7s} {'ideal':>7s} " + " ".join(f"{c:>13s}" for c in cols)
    print(head + f" {'GB/s fused':>10s} {'launches':>8s} {'rel_err':>8s}")
    for res in results:
        for r in res["rows"]:
            cells = " ".join(f"{r.get(f'{c}_us', float('nan')):13.1f}" for c in cols)
            ideal = r["ideal_us"] if r["ideal_us"] is not None else float("nan")
            print(f"{res['shape']:9s} {r['tokens']:5d} {r['distinct_experts']:7.1f} {r['bytes'] / 1e6:7.1f} "
                  f"{ideal:7.1f} {cells} {r.get('fused_GBs', float('nan')):10.1f} "
                  f"{str(r.get('fused_routed_launches')):>8s} {r['fused_rel_err']:8.1e}")


if __name__ == "__main__":
    main()
