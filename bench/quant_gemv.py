"""The mma kernels (blockspec/kernels/quant_gemv.py: the one-row GEMV, the 2-16-row kernel) against quant_linear's
dot path for the same rows, NVFP4 and int4 g128, on the Qwen3-8B projection shapes and the hybrids' (issue 14), and
where the dispatch draws its lines (quant_gemv.launch_config). GPU only. Timings as bench/quant_gemm.py takes them
(CUDA-graph replays, weights rotated past the L2, % of the copy bandwidth measured in the same run). --gated times
the gate|up shapes with SwiGLU: folded into the mma kernels' epilogue against the dot path plus the SwiGLU launch
the decoder ran before. Prints a table last; JSON to $OUT (else bench/results/).

  python bench/quant_gemv.py                          # one row, NVFP4 and int4
  python bench/quant_gemv.py --rows 1,8,16 --gated    # + verify blocks, + SwiGLU folded
  python bench/quant_gemv.py --sweep                  # + launch configs (warps, spans a step, K parts) per shape
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant_gemm as qgm  # noqa: E402
from first_gpu import copy_bandwidth  # noqa: E402

from blockspec.kernels import lane_order, quant_gemv, quant_tiles  # noqa: E402
from blockspec.kernels import quant_linear as ql  # noqa: E402
from blockspec.kernels.activation import silu_mul  # noqa: E402

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("down", 4096, 12288), ("gate_up", 24576, 4096),
          ("27b_gate_up", 2 * 17408, 5120), ("lm_head", 151936, 4096),
          # Qwen3.6-35B-A3B: a Gated DeltaNet layer's in_proj (q|k|v|z) and out_proj, an attention layer's q|gate|k|v
          ("35b_in_proj", 12288, 2048), ("35b_out_proj", 2048, 4096), ("35b_qkv", 9216, 2048),
          # Qwen3.6-27B's attention q|gate|k|v, Qwen3.5-4B's Gated DeltaNet in_proj and down
          ("27b_qkv", 14336, 5120), ("4b_in_proj", 12288, 2560), ("4b_down", 2560, 9216),
          # Qwen3.6-27B's down, Gated DeltaNet in_proj (q|k|v|z) and out_proj (= its attention o_proj's shape)
          ("27b_down", 5120, 17408), ("27b_in_proj", 16384, 5120), ("27b_out_proj", 5120, 6144)]


GATED_SHAPES = ("gate_up", "27b_gate_up")  # [gate; up] projections (SwiGLU after them)


def gemv_fn(x, layers, cfg: quant_gemv.GemvConfig | None = None, gated: bool = False):
    """One call a replay on the next weight of the rotation (cfg: the dispatch's, else forced)."""
    turn = itertools.cycle(layers)
    meta = ql.quant_meta(layers[0])
    m = x.shape[0]
    cfg = cfg or quant_gemv.launch_config(meta, m, gated) or \
        (quant_gemv.WIDE if m == 1 else quant_gemv._fit_k(quant_gemv.ROWS_FEW, meta.k))
    return lambda: quant_gemv.gemv(x, next(turn), meta, cfg, gated=gated)


def dot_fn(x, layers, gated: bool):
    """quant_linear's dot path as the decoder runs it (`QuantLinear.forward_gated`): gated, the SwiGLU launch after
    it -- the decoder folds SwiGLU only into the mma kernels (`quant_linear.gemv_takes`), never into the dot path's
    epilogue, so timing that epilogue here would compare against a launch the engine does not make."""
    plain = qgm.quant_fn(x, layers, "plain", None)
    return (lambda: silu_mul(plain())) if gated else plain


SWEEP = [quant_gemv.GemvConfig(w, s, p) for w in (2, 4, 8, 16, 32) for s in (2, 4, 8) for p in (1, 2, 4, 8)
         if 64 * p <= 32 * w]  # x (64 P pairs a span) loaded in the lane layout: no more elements than threads
SWEEP_ROWS = [quant_gemv.GemvConfig(w, s, p) for w in (4, 8, 16) for s in (1, 2, 4) for p in (1, 2, 4, 8)
              if p <= w]


# the streamed one-row kernel (weights a step ahead, the first step before the PDL wait): its dependents released
# before the stores; the best of these is timed again releasing them right after the wait (`early`)
SWEEP_STREAM = [quant_gemv.GemvConfig(w, s, p, stream=True) for w in (2, 4, 8, 16) for s in (2, 4, 8)
                for p in (1, 2, 4, 8) if 64 * p <= 32 * w and s * p <= 16]
SWEEP_STREAM_ROWS = [quant_gemv.GemvConfig(w, s, p, stream=True) for w in (4, 8, 16) for s in (1, 2, 4)
                     for p in (1, 2, 4, 8) if p <= w and s * p <= 16]
# one row on the rows kernel (weights as the mma's A operand: 2 bytes of x a weight byte against the GEMV's 4),
# plain and streamed; 2-warp and one-span launches for more programs an SM (Qwen3.6-27B gate|up: (2, 2, 1) 86
# registers, 11 an SM, 0.75 waves; (4, 1, 1) 60 registers, 8 an SM, 0.52; bench/waves.py's arithmetic, Triton 3.6);
# beside (16, 4, 8) (the 8B's down: 12.9 us NVFP4, 13.0 int4 on the H200, but 128 registers and 136-176 spilled
# bytes under Triton 3.9, 0-8 under 3.6) the same K parts without a spill in either: (16, 2, 8) 84-127 registers,
# (8, 4, 8) 126-203
SWEEP_ROWS_AT_ONE = [quant_gemv.GemvConfig(w, s, p, stream=st, rows=True) for w, s, p in
                     ((2, 2, 1), (4, 1, 1), (4, 2, 1), (4, 2, 2), (8, 2, 2), (8, 2, 4), (16, 4, 8), (16, 2, 8),
                      (8, 4, 8))
                     for st in (False, True)]
# 2-16 rows, R blocks of weight rows a program sharing each span's x loads (GemvConfig.groups): the launches that
# compile without spills for sm_90 (bench/compile_sm90.py: R = 2 plain up to 2 spans a step, streamed 1; R = 4 plain
# 1), 192-248 registers; the best streamed one is timed again releasing early
SWEEP_GROUPS = [quant_gemv.GemvConfig(w, s, p, stream=st, groups=r) for r, s, st in
                ((2, 1, False), (2, 2, False), (2, 1, True), (4, 1, False)) for w in (4, 8) for p in (1, 2, 4)]
# 2-16 rows, K split over 2-4 programs (GemvConfig.splits): wider blocks (R = 2, fewer K parts) that read each x
# span for more weight rows, with as many programs as the narrow layers' one-block launches (NOTES session 30: at
# 16 rows x is read ~3.6x the weight bytes from L2 on Qwen3-8B's down); compiled for sm_90 without spills (R = 4
# with K split: 249 registers, Triton 3.6)
SWEEP_SPLITS = [quant_gemv.GemvConfig(w, s, p, stream=st, early=st, groups=r, splits=k) for k in (2, 4)
                for w, s, p, st, r in ((4, 1, 4, False, 2), (4, 1, 2, False, 2), (4, 2, 4, False, 2),
                                       (4, 1, 1, False, 2), (4, 1, 4, True, 2), (8, 2, 4, True, 1),
                                       (4, 1, 4, False, 1), (4, 1, 4, False, 4), (4, 1, 2, False, 4))]


if torch.cuda.is_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _x_free(x32, b0, KB: tl.constexpr, BN: tl.constexpr, P: tl.constexpr, live=None, LANE: tl.constexpr = False):
        """--no-x: the pairs (1, 1) in place of x beside a span's bytes, no load (the results are wrong)."""
        return tl.full([BN, 64], 0x3F803F80, tl.int32)

    @triton.jit
    def _rows_x_free(x32, tok, tok_b, part, b0, KB: tl.constexpr, P: tl.constexpr, TWO: tl.constexpr,
                     LANE: tl.constexpr = False):
        """--no-x on the rows kernel: the pairs (1, 1) for both token blocks, no load (the results are wrong)."""
        xa = (tok * 0).to(tl.int32)[:, None] + tl.full([1, 64], 0x3F803F80, tl.int32)
        return xa, xa

    _ROWS_X = quant_gemv._rows_x  # the kernel's own x loads, for --x-one-token and --x-line

    @triton.jit
    def _rows_x_one_token(x32, tok, tok_b, part, b0, KB: tl.constexpr, P: tl.constexpr, TWO: tl.constexpr,
                          LANE: tl.constexpr = False):
        """--x-one-token on the rows kernel: every row's x loaded as the kernel loads it, but the first block's
        tokens all from token 0 and the second's (9-16 rows) from token 1 (the zero is b0 >> 30, which the compiler
        cannot fold in the loop: the same loads, while the bytes they ask of the L2 shrink to two tokens'; the
        address arithmetic is simpler, 0-30 registers fewer under Triton 3.6). The results are wrong."""
        zero = b0 >> 30
        return _ROWS_X(x32, tok * zero, tok_b * zero + 1, part, b0, KB, P, TWO, LANE)

    @triton.jit
    def _rows_x_line(x32, tok, tok_b, part, b0, KB: tl.constexpr, P: tl.constexpr, TWO: tl.constexpr,
                     LANE: tl.constexpr = False):
        """--x-line on the rows kernel: x loaded at the lane order's columns (kernels/lane_order.py: a token's 4
        lanes read 64 bytes of one 128-byte line a 16-byte load, not lane t's 64 contiguous bytes, whose four loads
        each touch two lines a token) beside weights in checkpoint order. The same loads, registers and L2 bytes,
        wrong results: whether the L1 lines an x load touches are what x costs at 9-16 rows (NOTES session 42)."""
        return _ROWS_X(x32, tok, tok_b, part, b0, KB, P, TWO, True)


def _decode_shifts(src: str) -> str:
    """--decode shifts: the E2M1 decode of a load-time bit order in which each pair of codes is one shift and a
    mask away (4 pairs: a mask, two shift + mask, three shifts + three masks), run on today's order: the right
    instruction count and dependences, the wrong values."""
    m = "0x81C081C0"
    return (f"mov.b32 nz, 0x80008000;\nand.b32 t0, {src}, {m};\nshl.b32 t1, {src}, 3;\nand.b32 t1, t1, {m};\n"
            f"shl.b32 t2, {src}, 6;\nand.b32 t2, t2, {m};\nshr.b32 lo, {src}, 4;\nand.b32 lo, lo, 0x00C000C0;\n"
            f"shr.b32 hi, {src}, 5;\nand.b32 hi, hi, 0x01000100;\nor.b32 t3, lo, hi;\nshl.b32 hi, {src}, 1;\n"
            f"and.b32 hi, hi, 0x80008000;\nor.b32 t3, t3, hi;\n")


def _decode_none(src: str) -> str:
    """--decode none: no decode at all (the bytes go to the scaling fma as they are): the bound on what any decode
    could save."""
    return "mov.b32 nz, 0x80008000;\n" + "".join(f"mov.b32 t{i}, {src};\n" for i in range(4))


DECODES = {"shifts": _decode_shifts, "none": _decode_none}


def sweep(x, layer, layers, ref, k, gated: bool, stream: bool = False, check: bool = True,
          groups: bool = False, splits: bool = False) -> dict | None:
    """The fastest correct launch of the sweep (us and its GemvConfig's fields), or None."""
    best_us, best_cfg = None, None
    one = x.shape[0] == 1
    if splits:  # one row: on the rows kernel (rows=True), where K splits live
        configs = [replace(c, rows=True) for c in SWEEP_SPLITS] if one else SWEEP_SPLITS
    elif groups:  # one row: on the rows kernel (rows=True), x loaded once for R blocks (the GEMV loads it per row)
        configs = [replace(c, rows=True) for c in SWEEP_GROUPS] if one else SWEEP_GROUPS
    else:
        configs = (SWEEP_STREAM + SWEEP_ROWS_AT_ONE if one else SWEEP_STREAM_ROWS) if stream else \
            SWEEP if one else SWEEP_ROWS
    for cfg in configs + ([None] if (stream or groups) and not splits else []):
        if cfg is None:  # the best streamed launch again, releasing its dependents early
            if best_cfg is None or not best_cfg.stream:
                break
            cfg = replace(best_cfg, early=True)
        if not quant_gemv._tiles_k(cfg, k) or (gated and one and not cfg.rows and cfg.block // cfg.parts % 2):
            continue
        err = qgm.rel_err(gemv_fn(x, [layer], cfg, gated)(), ref) if check else 0.0
        if err > 2e-2:
            print(f"  {cfg}: WRONG rel err {err:.3g}", flush=True)
            continue
        us = qgm.bench(gemv_fn(x, layers, cfg, gated))
        print(f"  {cfg}: {us:.1f} us", flush=True)
        if best_us is None or us < best_us:
            best_us, best_cfg = us, cfg
    return None if best_cfg is None else dict(us=best_us, **asdict(best_cfg))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--schemes", default="nvfp4,int4", help="nvfp4 and / or int4 (g128, asymmetric)")
    ap.add_argument("--rows", default="1", help="rows of x (comma-separated): 1 the GEMV, 2-16 the rows kernel")
    ap.add_argument("--gated", action="store_true", help="the gate|up shapes with SwiGLU too")
    x_mode = ap.add_mutually_exclusive_group()  # each replaces the rows kernel's x loads
    x_mode.add_argument("--x-one-token", action="store_true", help="the rows kernel loading x as it does, but every "
                    "token's from token 0's row (wrong results; the dispatched column too): whether x costs at 9-16 "
                    "rows by its bytes from L2 (then this is as fast as --no-x) or by its loads and registers (then as "
                    "slow as the kernel)")
    x_mode.add_argument("--x-line", action="store_true", help="the rows kernel loading each token's x 64 bytes "
                        "of one 128-byte line a load, not two lines, beside weights in checkpoint order (the same "
                        "loads and L2 bytes, in another order: wrong results, the dispatched column too): whether "
                        "the L1 lines x touches are its cost")
    x_mode.add_argument("--no-x", action="store_true", help="the streamed, parts and rows kernels without their x "
                    "loads (constant pairs, wrong results; the dispatched column too): how much of their time the x "
                    "beside every weight byte costs (the L1 question of NOTES session 28)")
    ap.add_argument("--natural-order", action="store_true", help="NVFP4 layers in their checkpoint order, not the "
                    "lane order the engine puts a GPU model's dense NVFP4 layers in (kernels/lane_order.py)")
    ap.add_argument("--dot-orders", action="store_true", help="only quant_linear's dot path (the launch NVFP4 layers "
                    "take at 17-1023 rows, and at 1-16 where the mma kernels do not apply) on each NVFP4 shape in "
                    "checkpoint order and in lane order, in alternating rounds in one process, each checked "
                    "against the reference (any --rows; NOTES session 42's open question)")
    ap.add_argument("--stream", action="store_true", help="+ the streamed launches (weights a step ahead, the "
                    "first step's before the PDL wait): quant_gemv._stream_kernel at one row, the rows kernel's "
                    "at 2-16; and one row on the rows kernel, plain and streamed")
    ap.add_argument("--groups", action="store_true", help="+ the rows kernel running 2-4 blocks of weight rows a "
                    "program, each span's x loaded once for all (GemvConfig.groups; NOTES sessions 29-30), at one "
                    "row with rows=True")
    ap.add_argument("--splits", action="store_true", help="+ the rows kernel with K split over 2-4 programs "
                    "(GemvConfig.splits; NOTES session 30), at one row with rows=True: more, shorter programs where a "
                    "layer's launch fills the SMs 1.2 times (Qwen3.6-27B's down: 320 programs, 2 resident an SM)")
    ap.add_argument("--decode", choices=("ptx", *DECODES), default="ptx", help="timing only (wrong results): the "
                    "mma kernels' E2M1 decode replaced by a cheaper one (NOTES session 38)")
    args = ap.parse_args()
    if args.decode != "ptx":  # before any kernel compiles: the asm strings are built at import
        quant_tiles.e2m1_decode_ptx = DECODES[args.decode]
        importlib.reload(quant_gemv)
    if args.no_x:  # before any kernel that reads it compiles
        quant_gemv._span_x = _x_free
        quant_gemv._rows_x = _rows_x_free
    elif args.x_one_token:
        quant_gemv._rows_x = _rows_x_one_token
    elif args.x_line:
        quant_gemv._rows_x = _rows_x_line
    torch.manual_seed(0)
    bw = copy_bandwidth()
    if args.dot_orders:
        return dot_orders(args, bw)
    rows = []
    for scheme in args.schemes.split(","):
        for name, n, k in [s for s in SHAPES if s[0] in args.shapes.split(",")]:
            layer = qgm.random_layer(scheme, n, k)
            if not (args.natural_order or args.x_line) and lane_order.fits(layer):  # as the engine stores them
                lane_order.to_lane_order(layer)
            layers = qgm.rotation(layer)
            meta = ql.quant_meta(layer)
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
                plain = ql.quant_linear_ref(x, layer)
                for gated in (False, True) if args.gated and name in GATED_SHAPES else (False,):
                    ref = silu_mul(plain) if gated else plain
                    err = qgm.rel_err(gemv_fn(x, [layer], gated=gated)(), ref)
                    dot = qgm.bench(dot_fn(x, layers, gated))
                    gemv = qgm.bench(gemv_fn(x, layers, gated=gated))
                    nbytes = qgm.bytes_read(layer)
                    rows.append(dict(scheme=scheme, shape=name, n=n, k=k, m=m, gated=gated, bytes=nbytes, dot_us=dot,
                                     gemv_us=gemv, rel_err=err, dot_pct=qgm.pct(nbytes, dot, bw),
                                     gemv_pct=qgm.pct(nbytes, gemv, bw),
                                     dispatched=quant_gemv.launch_config(meta, m, gated) is not None))
                    if args.sweep:
                        rows[-1]["best"] = sweep(x, layer, layers, ref, k, gated)
                    if args.stream:
                        rows[-1]["stream"] = sweep(x, layer, layers, ref, k, gated, stream=True, check=not args.no_x)
                        rows[-1]["x_free"] = args.no_x
                    if args.groups:
                        rows[-1]["groups"] = sweep(x, layer, layers, ref, k, gated, groups=True)
                    if args.splits:
                        rows[-1]["splits"] = sweep(x, layer, layers, ref, k, gated, splits=True)
                    print(rows[-1], flush=True)
            del layers
    out = Path(os.environ.get("OUT", "bench/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant_gemv.json").write_text(json.dumps(dict(
        device=torch.cuda.get_device_name(), commit=os.environ.get("COMMIT", "?"), copy_gbs=bw / 1e9,
        dtype="bfloat16", decode=args.decode, x=x_loads(args), natural_order=args.natural_order,
        schemes=args.schemes, int4=qgm.SCHEME_VARIANTS["int4"], rows=rows),
        indent=1))
    print(f"{'scheme':6} {'shape':12} {'N':>6} {'K':>6} {'M':>3} {'swiglu':>6} {'dot us':>7} {'%copy':>6} "
          f"{'mma us':>8} {'%copy':>6} {'err':>7}  taken")
    for r in rows:
        print(f"{r['scheme']:6} {r['shape']:12} {r['n']:6} {r['k']:6} {r['m']:3} {'yes' if r['gated'] else '':>6} "
              f"{r['dot_us']:7.1f} {r['dot_pct']:6.1f} {r['gemv_us']:8.1f} {r['gemv_pct']:6.1f} {r['rel_err']:7.1e}  "
              f"{'mma' if r['dispatched'] else 'dot'}"
              + "".join(swept(key, r[key], r["bytes"], bw) for key in ("best", "stream", "groups", "splits")
                        if r.get(key)))


def dot_orders(args, bw: float) -> None:
    """--dot-orders: the dot path's time on checkpoint-order and lane-order copies of each NVFP4 shape, medians of
    3 alternating rounds, and the lane-order result's error against the reference."""
    rows = []
    for name, n, k in [s for s in SHAPES if s[0] in args.shapes.split(",")]:
        natural = qgm.random_layer("nvfp4", n, k)
        lane = ql.QuantWeights(**{f: (v.clone() if isinstance(v, torch.Tensor) else v)
                                  for f, v in vars(natural).items()})
        lane_order.to_lane_order(lane)
        rotations = {"natural": qgm.rotation(natural), "lane": qgm.rotation(lane)}
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            err = qgm.rel_err(qgm.quant_fn(x, [lane], "plain", None)(), ql.quant_linear_ref(x, natural))
            times = {o: [] for o in rotations}
            for _ in range(3):
                for order, layers in rotations.items():
                    times[order].append(qgm.bench(qgm.quant_fn(x, layers, "plain", None)))
            med = {o: sorted(t)[1] for o, t in times.items()}
            rows.append(dict(shape=name, n=n, k=k, m=m, bytes=qgm.bytes_read(natural), natural_us=med["natural"],
                             lane_us=med["lane"], lane_err=err, rounds=times))
            print(rows[-1], flush=True)
        del rotations
    out = Path(os.environ.get("OUT", "bench/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant_gemv_dot_orders.json").write_text(json.dumps(dict(
        device=torch.cuda.get_device_name(), commit=os.environ.get("COMMIT", "?"), copy_gbs=bw / 1e9,
        dtype="bfloat16", what="quant_linear's dot path, NVFP4 in checkpoint and lane order", rows=rows), indent=1))
    print(f"{'shape':12} {'N':>6} {'K':>6} {'M':>4} {'natural us':>10} {'lane us':>8} {'lane/nat':>8} {'lane err':>8}")
    for r in rows:
        print(f"{r['shape']:12} {r['n']:6} {r['k']:6} {r['m']:4} {r['natural_us']:10.1f} {r['lane_us']:8.1f} "
              f"{r['lane_us'] / r['natural_us']:8.2f} {r['lane_err']:8.1e}")


def x_loads(args) -> str:
    """How the kernels' x loads ran (the JSON's "x")."""
    return "none" if args.no_x else "one token" if args.x_one_token else "one line" if args.x_line else "loaded"


def swept(key: str, c: dict, nbytes: int, bw: float) -> str:
    """A sweep's best launch (`sweep`'s dict) for the table's last column."""
    return (f"  {key} {c['us']:.1f} us ({qgm.pct(nbytes, c['us'], bw):.1f}%): "
            + (f"K over {c['splits']} " if c["splits"] > 1 else "") + (f"R {c['groups']} " if c["groups"] > 1 else "")
            + f"warps {c['warps']} spans {c['spans']} parts {c['parts']}"
            + "".join(f" {flag}" for flag, on in (("streamed", c["stream"]), ("early", c["early"]),
                                                  ("rows kernel", c["rows"])) if on))


if __name__ == "__main__":
    main()
