"""Gated DeltaNet decode / verify kernels (blockspec/kernels/gated_deltanet.py) on the GPU, against fla-core's
fused_recurrent_gated_delta_rule on the same inputs. GPU only; prints a table last and writes
$OUT/gdn_kernels.json (bench/results/ when OUT is unset).

Shapes: Qwen3.6-27B (48 value heads, 16 key heads), Qwen3.5-4B and Qwen3.5-35B-A3B (32 / 16), head dims 128,
bf16 activations, float32 state; N rows in {1, 4, 16}, L tokens in {1, 16}. Variants:
  decode       L = 1, output + state written to the row's spare slot (the decode graphs' slot pairs)
  decode+norm  the same with the GatedRMSNorm folded into the epilogue (compare: decode + norm)
  verify       L = 16, outputs only (the chunk kernel);  verify+ckpt: also the state after every token (the
               recurrent kernel);  verify+norm: fused norm;  verify/rec: the recurrent kernel without checkpoints
  commit       L = 16, counts in [1, L], state written, no outputs (chunk kernel);  commit/rec: recurrent
  conv_*       the causal conv update (decode: output + window; verify: output; commit: window only)
  norm         gated_rms_norm alone on [N * L, H, Dv] float32 outputs
  fla          fused_recurrent_gated_delta_rule, gating and sigmoid in kernel, initial state a contiguous
               [N, H, Dk, Dv] slice (no slot gather), final state returned when the variant writes one;
  fla+slots    the same plus the gather / scatter through the slot pool that using it in the graphs costs.

Timing: each call is captured R times into one CUDA graph (launch overhead excluded, as in the decode graphs),
each of the R calls on its own state pool so the states stream from DRAM, not L2 (R * pool >= 256 MB);
median over --iters replays, divided by R. GB/s counts the state traffic only (read once, written once,
checkpoints L times). `--sweep` also times the recurrent and chunk kernels' (BLOCK_V, num_warps) alternatives
(variants verify / commit: the chunk kernel, verify/rec / commit/rec: the recurrent one); `--chunk-sweep` the
chunk kernel's only, with its dot precisions.

  python bench/gdn_kernels.py [--sweep] [--iters 100]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from blockspec.kernels import gated_deltanet as gdn
from blockspec.kernels.gated_deltanet import (
    causal_conv_update,
    gated_rms_norm,
    gdn_recurrent,
    gdn_recurrent_ref,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # first_gpu.py sits beside this script
from first_gpu import copy_bandwidth  # noqa: E402

SHAPES = {  # name: (value heads, key heads, Dk, Dv)
    "qwen3.6-27b": (48, 16, 128, 128),
    "qwen3.5-4b": (32, 16, 128, 128),
    "qwen3.5-35b-a3b": (32, 16, 128, 128),
}
ROWS = (1, 4, 16)
LENGTHS = (1, 16)
SWEEP = [(bv, w) for bv in (4, 8, 16, 32, 64) for w in (1, 2, 4, 8) if 8 <= 128 * bv // (32 * w) <= 64]
CHUNK_SWEEP = [(bv, w, dot) for bv in (16, 32, 64, 128) for w in (4, 8) for dot in ("tf32", "tf32x3")]
POOL_BYTES = 256 << 20  # rotate pools until the working set is well past the 50 MB L2
DEVICE = "cuda"


def fla_recurrent():
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except Exception as exc:  # missing, or Triton failing to initialise
        print(f"fla-core not importable ({type(exc).__name__}: {exc}): skipping its rows", flush=True)
        return None
    return fused_recurrent_gated_delta_rule


def time_graph(calls: list[Callable[[], object]], iters: int) -> tuple[float, str]:
    """Median microseconds per call: all calls captured into one CUDA graph, replayed `iters` times.
    Falls back to timing the calls eagerly (launches included) when capture fails."""
    for c in calls:  # compile, allocate, initialise outside the capture
        c()
    torch.cuda.synchronize()
    mode = "graph"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in calls:
                c()
        run = graph.replay
    except Exception as exc:  # any capture failure: time eagerly instead
        print(f"  capture failed ({type(exc).__name__}: {str(exc)[:120]}): eager timing", flush=True)
        torch.cuda.synchronize()
        mode = "eager"

        def run():
            for c in calls:
                c()
    for _ in range(3):
        run()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 1000 * statistics.median(times) / len(calls), mode


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


class Case:
    """One (shape, N, L): shared activations, R state pools of 2N + 1 slots (read, spare, scratch)."""

    def __init__(self, shape: str, n: int, length: int) -> None:
        heads, hk, dk, dv = SHAPES[shape]
        self.shape, self.n, self.length, self.heads, self.hk, self.dk, self.dv = shape, n, length, heads, hk, dk, dv
        dev, bf = DEVICE, torch.bfloat16
        g = torch.Generator(device=dev).manual_seed(n * 100 + length)

        def rand(*shape_: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape_, generator=g, device=dev) * scale).to(bf)

        self.q, self.k = rand(n, length, hk, dk), rand(n, length, hk, dk)
        self.v, self.z = rand(n, length, heads, dv), rand(n, length, heads, dv)
        self.a, self.b = rand(n, length, heads), rand(n, length, heads, scale=2.0)
        self.A_log = (torch.rand(heads, generator=g, device=dev) * 2).to(bf)
        self.dt_bias = rand(heads, scale=0.5)
        self.norm_weight = (torch.rand(dv, generator=g, device=dev) + 0.5).to(bf)
        self.read = torch.arange(n, device=dev)
        self.spare = self.read + n
        self.counts = torch.randint(1, length + 1, (n,), generator=g, device=dev)
        self.state_bytes = n * heads * dk * dv * 4  # one state per row
        slots = 2 * n + 1
        n_pools = max(2, min(48, math.ceil(POOL_BYTES / (slots * heads * dk * dv * 4))))
        self.pools = [torch.randn(slots, heads, dk, dv, generator=g, device=dev) * 0.1 for _ in range(n_pools)]
        self.ckpt = torch.empty(n, length, heads, dk, dv, device=dev)
        conv_dim = 2 * hk * dk + heads * dv
        self.x = rand(n, length, conv_dim)
        self.conv_weight = rand(conv_dim, 4, scale=0.5)
        self.conv_pools = [rand(slots, 3, conv_dim) for _ in range(n_pools)]

    def args(self, pool: torch.Tensor) -> tuple:
        return self.q, self.k, self.v, self.a, self.b, self.A_log, self.dt_bias, pool, self.read

    def launch(self, pool: torch.Tensor, counts=None, write_slots=None, compute_output: bool = True,
               **config) -> torch.Tensor | None:
        """The kernel launch itself, with `config` (block_v, num_warps, chunk) overriding the dispatch."""
        return gdn._gdn_recurrent_triton(self.q if compute_output else None, *self.args(pool)[1:], counts,
                                         write_slots, None, compute_output, None, None, 1e-6, **config)

    def variants(self) -> dict[str, tuple[Callable[[torch.Tensor], object], int]]:
        """name: (call on one pool, state bytes it moves)."""
        s, n, length = self.state_bytes, self.n, self.length
        out: dict[str, tuple[Callable, int]] = {}
        if length == 1:
            out["decode"] = (lambda p: gdn_recurrent(*self.args(p), write_slots=self.spare), 2 * s)
            out["decode+norm"] = (lambda p: gdn_recurrent(*self.args(p), write_slots=self.spare, z=self.z,
                                                          norm_weight=self.norm_weight), 2 * s)
        else:
            out["verify"] = (lambda p: gdn_recurrent(*self.args(p)), s)
            out["verify+ckpt"] = (lambda p: gdn_recurrent(*self.args(p), checkpoints=self.ckpt), s * (1 + length))
            out["verify+norm"] = (lambda p: gdn_recurrent(*self.args(p), z=self.z, norm_weight=self.norm_weight), s)
            out["commit"] = (lambda p: gdn_recurrent(None, *self.args(p)[1:], counts=self.counts,
                                                     write_slots=self.spare, compute_output=False), 2 * s)
            out["verify/rec"] = (lambda p: self.launch(p, chunk=False), s)
            out["commit/rec"] = (lambda p: self.launch(p, counts=self.counts, write_slots=self.spare,
                                                       compute_output=False, chunk=False), 2 * s)
        o = torch.randn(n * length, self.heads, self.dv, device=DEVICE)
        zf = self.z.view(n * length, self.heads, self.dv)
        out["norm"] = (lambda p: gated_rms_norm(o, zf, self.norm_weight, 1e-6), 0)
        return out

    def conv_variants(self) -> dict[str, Callable[[torch.Tensor], object]]:
        if self.length == 1:
            return {"conv_decode": lambda c: causal_conv_update(self.x, c, self.read, self.conv_weight,
                                                                write_slots=self.spare)}
        return {"conv_verify": lambda c: causal_conv_update(self.x, c, self.read, self.conv_weight),
                "conv_commit": lambda c: causal_conv_update(self.x, c, self.read, self.conv_weight, counts=self.counts,
                                                            write_slots=self.spare, compute_output=False)}

    def fla_variants(self, fla) -> dict[str, tuple[Callable[[torch.Tensor], object], int]]:
        write = self.length == 1  # decode returns the final state; verify does not

        def plain(p):
            return fla(self.q, self.k, self.v, g=self.a, beta=self.b, initial_state=p[: self.n],
                       output_final_state=write, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                       A_log=self.A_log, dt_bias=self.dt_bias, use_beta_sigmoid_in_kernel=True)

        def slots(p):
            o, final = fla(self.q, self.k, self.v, g=self.a, beta=self.b, initial_state=p[self.read],
                           output_final_state=write, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                           A_log=self.A_log, dt_bias=self.dt_bias, use_beta_sigmoid_in_kernel=True)
            if write:
                p[self.spare] = final
            return o

        moved = self.state_bytes * (2 if write else 1)
        return {"fla": (plain, moved), "fla+slots": (slots, moved)}


def check(case: Case, fla) -> dict:
    """Kernel against the reference (and fla) on this case's inputs, and commit == verify checkpoints."""
    res = {}
    p_k, p_r = case.pools[0].clone(), case.pools[0].clone()
    write = case.spare if case.length == 1 else None
    ck_k = torch.zeros_like(case.ckpt)
    ck_r = torch.zeros_like(case.ckpt)
    o_k = gdn_recurrent(*case.args(p_k), write_slots=write, checkpoints=ck_k)
    o_r = gdn_recurrent_ref(*case.args(p_r), write_slots=write, checkpoints=ck_r)
    res["out_rel_err"] = rel_err(o_k, o_r)
    res["ckpt_rel_err"] = rel_err(ck_k, ck_r)
    if write is not None:
        res["state_rel_err"] = rel_err(p_k[write], p_r[write])
    o_n = gdn_recurrent(*case.args(case.pools[0]), z=case.z, norm_weight=case.norm_weight)
    o_nr = gdn_recurrent_ref(*case.args(case.pools[0].clone()), z=case.z, norm_weight=case.norm_weight)
    res["fused_norm_rel_err"] = rel_err(o_n, o_nr)
    if case.length > 1:
        pool = case.pools[0].clone()
        gdn_recurrent(None, *case.args(pool)[1:], counts=case.counts, write_slots=case.spare, compute_output=False)
        rows = torch.arange(case.n, device=DEVICE)
        # the chunk kernel's committed state against the recurrent kernel's state after the same token
        res["commit_vs_checkpoint_rel_err"] = rel_err(pool[case.spare], ck_k[rows, case.counts - 1])
        res["chunk_vs_recurrent_out_rel_err"] = rel_err(gdn_recurrent(*case.args(case.pools[0])),
                                                        case.launch(case.pools[0], chunk=False))
        want = gdn_recurrent_ref(*case.args(case.pools[0].clone()))
        for dot in ("tf32", "tf32x3", "ieee"):  # each precision's error against the float32 reference
            p = case.pools[0].clone()
            res[f"chunk_{dot}_out_rel_err"] = rel_err(case.launch(p, chunk=True, dot=dot), want)
            case.launch(p, counts=case.counts, write_slots=case.spare, compute_output=False, chunk=True, dot=dot)
            res[f"chunk_{dot}_commit_rel_err"] = rel_err(p[case.spare], ck_r[rows, case.counts - 1])
    if fla is not None:
        o_f, final = fla(case.q, case.k, case.v, g=case.a, beta=case.b, initial_state=case.pools[0][: case.n],
                         output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                         A_log=case.A_log, dt_bias=case.dt_bias, use_beta_sigmoid_in_kernel=True)
        res["fla_out_rel_err"] = rel_err(o_k, o_f)
        res["fla_state_rel_err"] = rel_err(ck_k[:, -1], final)
    return res


def sweep(case: Case, iters: int, recurrent: bool = True) -> list[dict]:
    """The recurrent kernel's launch configurations on this case (decode, or verify and commit), and the chunk
    kernel's on a verify block."""
    rows = []
    fns = {"decode": dict(write_slots=case.spare)} if case.length == 1 else {
        "verify/rec": dict(), "commit/rec": dict(counts=case.counts, write_slots=case.spare, compute_output=False)}
    todo = [(name, dict(kw, chunk=False), [(bv, w, None) for bv, w in SWEEP]) for name, kw in fns.items()
            if recurrent]
    if gdn._chunked(case.length, None):
        todo += [("verify", dict(chunk=True), CHUNK_SWEEP),
                 ("commit", dict(counts=case.counts, write_slots=case.spare, compute_output=False, chunk=True),
                  CHUNK_SWEEP)]
    for name, kw, configs in todo:
        for bv, warps, dot in configs:
            def call(p, bv=bv, warps=warps, kw=kw, dot=dot):
                return case.launch(p, block_v=bv, num_warps=warps, **kw, **({"dot": dot} if dot else {}))
            try:
                us, _ = time_graph([lambda p=p: call(p) for p in case.pools], iters)
            except Exception as exc:  # out of resources etc.: skip the config
                print(f"  sweep {name} BV={bv} w={warps} {dot}: {type(exc).__name__}", flush=True)
                continue
            rows.append(dict(variant=name, block_v=bv, num_warps=warps, dot=dot, us=round(us, 2)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--sweep", action="store_true", help="also time the kernels' launch configs")
    ap.add_argument("--chunk-sweep", action="store_true", help="also time the chunk kernel's launch configs only")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--rows", nargs="*", type=int, default=list(ROWS))
    ap.add_argument("--lengths", nargs="*", type=int, default=list(LENGTHS))
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    fla = fla_recurrent()
    results, sweeps, checks, done = [], [], [], {}
    with torch.inference_mode():
        for shape in args.shapes:
            for n in args.rows:
                for length in args.lengths:
                    key = (SHAPES[shape], n, length)
                    if key in done:  # the same dimensions as another model: reuse its figures
                        results += [{**r, "shape": shape, "same_as": done[key]} for r in results
                                    if r["shape"] == done[key] and r["n"] == n and r["L"] == length]
                        continue
                    done[key] = shape
                    case = Case(shape, n, length)
                    heur = (gdn._chunk_launch_config(n, case.heads, case.dv) if gdn._chunked(length, None)
                            else gdn._launch_config(n, case.heads, case.dk, case.dv, length))
                    print(f"{shape} N={n} L={length}: {len(case.pools)} pools, heuristic config {heur}", flush=True)
                    checks.append(dict(shape=shape, n=n, L=length, **check(case, fla)))
                    print(f"  check {checks[-1]}", flush=True)
                    timed = dict(case.variants())
                    if fla is not None:
                        timed.update(case.fla_variants(fla))
                    for name, (fn, moved) in timed.items():
                        us, mode = time_graph([lambda p=p, fn=fn: fn(p) for p in case.pools], args.iters)
                        gbs = moved / us / 1e3 if moved else None
                        results.append(dict(shape=shape, n=n, L=length, variant=name, us=round(us, 2), mode=mode,
                                            state_MB=round(moved / 1e6, 2),
                                            GBs=round(gbs, 1) if gbs else None,
                                            pct_copy_bw=round(100 * gbs * 1e9 / bw, 1) if gbs else None))
                        print(f"  {name:12s} {us:8.2f} us  {gbs or 0:7.1f} GB/s ({mode})", flush=True)
                    for name, fn in case.conv_variants().items():
                        us, mode = time_graph([lambda c=c, fn=fn: fn(c) for c in case.conv_pools], args.iters)
                        results.append(dict(shape=shape, n=n, L=length, variant=name, us=round(us, 2), mode=mode))
                        print(f"  {name:12s} {us:8.2f} us ({mode})", flush=True)
                    if args.sweep or args.chunk_sweep:
                        rows = sweep(case, args.iters, recurrent=args.sweep)
                        for r in rows:
                            on = gdn._chunked(length, None) == (r["variant"] in ("verify", "commit"))
                            r.update(shape=shape, n=n, L=length,
                                     heuristic=on and list(heur) == [r["block_v"], r["num_warps"]])
                        sweeps += rows
                        for v in {r["variant"] for r in rows}:
                            best = min((r for r in rows if r["variant"] == v), key=lambda r: r["us"])
                            print(f"  sweep {v}: best BV={best['block_v']} w={best['num_warps']} {best['us']} us",
                                  flush=True)
                    del case
                    torch.cuda.empty_cache()
    out = {"device": torch.cuda.get_device_name(), "commit": os.environ.get("COMMIT", "?"),
           "copy_bandwidth_GBs": round(bw / 1e9, 1), "dtype": "bfloat16", "state_dtype": "float32",
           "fla": fla is not None, "results": results, "checks": checks, "sweep": sweeps}
    path = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results") / "gdn_kernels.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"\nwrote {path}; copy bandwidth {bw / 1e9:.0f} GB/s")
    if sweeps:
        print(f"{'shape':16s} {'N':>3s} {'L':>3s} {'variant':10s} {'best':>21s} {'us':>8s} {'heuristic us':>13s}")
        for key in sorted({(r["shape"], r["n"], r["L"], r["variant"]) for r in sweeps}):
            rows = [r for r in sweeps if (r["shape"], r["n"], r["L"], r["variant"]) == key]
            best = min(rows, key=lambda r: r["us"])
            h = next((r["us"] for r in rows if r["heuristic"]), float("nan"))
            cfg = f"BV={best['block_v']} w={best['num_warps']}" + (f" {best['dot']}" if best.get("dot") else "")
            print(f"{key[0]:16s} {key[1]:3d} {key[2]:3d} {key[3]:10s} {cfg:>21s} {best['us']:8.2f} {h:13.2f}")
    print(f"{'shape':16s} {'N':>3s} {'L':>3s} {'variant':12s} {'us':>8s} {'GB/s':>7s} {'%bw':>5s}")
    for r in results:
        if "same_as" in r:
            continue
        gbs = f"{r['GBs']:7.1f}" if r.get("GBs") else f"{'-':>7s}"
        pct = f"{r['pct_copy_bw']:5.1f}" if r.get("pct_copy_bw") else f"{'-':>5s}"
        print(f"{r['shape']:16s} {r['n']:3d} {r['L']:3d} {r['variant']:12s} {r['us']:8.2f} {gbs} {pct}")


if __name__ == "__main__":
    main()
