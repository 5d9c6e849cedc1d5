"""Whether the 4-bit GEMV kernels' access pattern, not their work, caps them (issue 14). The rows kernel
(`quant_gemv._rows_kernel`) reads, each step, SPANS 64-byte spans of each of its BN weight rows in each of P K parts:
BN x P separate runs of STEP = 64 SPANS bytes, a row (K / 2 bytes) or a part apart, so HBM serves many short runs
at once. Three read-only kernels read the same bytes, every weight rotated past the L2 as the GEMVs' are:
  - `rows`: the rows kernel's pattern (programs of BN rows, P parts, the next step's loads issued before the step's
    own are consumed, as the streamed kernels do);
  - `tiles`: the same programs, steps and loads, the bytes laid out so each program's step is one contiguous run of
    BN x P x STEP bytes (a layout the loader could write at load);
  - `flat`: a grid-stride read of the whole buffer (bench/quant_ncu.py's read floor, the best of its launches).
If `rows` reads far slower than `tiles`, the layout is a lever for the one-row GEMVs (measured at ~50% of copy
against a ~90% floor for the gate|up's bytes, NOTES session 27); if not, the kernels' own work is.

  python bench/read_pattern.py                        # Qwen3-8B's NVFP4 layers, the rows launches below
  python bench/read_pattern.py --shapes gate_up --launches 8x2x4

GPU only; JSON to $OUT (else bench/results/), a table last.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant_gemv as qgv  # noqa: E402
from quant_gemm import ROTATE_BYTES, bench  # noqa: E402

from blockspec.kernels import quant_gemv as qv  # noqa: E402

SHAPES = {name: (n, k // 2) for name, n, k in qgv.SHAPES}  # the GEMV bench's layers: (rows, bytes a 4-bit row)
# (warps, spans a step, K parts) of the rows kernel: its dispatched one-row launches and the 16-warp one (session 40)
LAUNCHES = ",".join(f"{c.warps}x{c.spans}x{c.parts}" for c in (qv.ROWS_ONE_WIDE, qv.ROWS_ONE, qv.ROWS_ONE_WIDE_LONG_K)
                    ) + ",16x4x8"

try:  # the kernels run on a GPU, or on the CPU under TRITON_INTERPRET=1 (tests/bench/test_read_pattern.py)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
if triton is not None:

    @triton.jit
    def _step_ptrs(W, pid, step, TILES: tl.constexpr, ROW_WORDS: tl.constexpr, PART_WORDS: tl.constexpr,
                   BN: tl.constexpr, P: tl.constexpr, STEP_WORDS: tl.constexpr, STEPS: tl.constexpr):
        """The int32 words of one step of block pid: [BN P, STEP_WORDS], a lane's 4 words contiguous."""
        t = tl.arange(0, BN * P)
        j = tl.arange(0, STEP_WORDS)
        if TILES:  # the step's BN x P runs one after another
            base = (tl.cast(pid, tl.int64) * STEPS + step) * (BN * P * STEP_WORDS)
            return W + base + (t * STEP_WORDS)[:, None] + j[None, :]
        row = tl.cast(pid, tl.int64) * BN + t // P
        part = t % P
        return W + (row * ROW_WORDS + part * PART_WORDS + step * STEP_WORDS)[:, None] + j[None, :]

    @triton.jit
    def _pattern_kernel(W, OUT, n_blocks, TILES: tl.constexpr, ROW_WORDS: tl.constexpr, BN: tl.constexpr,
                        P: tl.constexpr, STEP_WORDS: tl.constexpr):
        """xor of every word the program reads (one word stored, so no load is optimised away): the blocks pid,
        pid + programs, ... (one each where there are as many programs as blocks, as in the rows kernel)."""
        pid = tl.program_id(0)
        PART_WORDS: tl.constexpr = ROW_WORDS // P
        STEPS: tl.constexpr = PART_WORDS // STEP_WORDS
        acc = tl.zeros([BN * P, STEP_WORDS], dtype=tl.int32)
        for blk in range(pid, n_blocks, tl.num_programs(0)):
            ahead = tl.load(_step_ptrs(W, blk, 0, TILES, ROW_WORDS, PART_WORDS, BN, P, STEP_WORDS, STEPS))
            for step in range(1, STEPS):
                cur = ahead
                ahead = tl.load(_step_ptrs(W, blk, step, TILES, ROW_WORDS, PART_WORDS, BN, P, STEP_WORDS, STEPS))
                acc ^= cur
            acc ^= ahead
        tl.store(OUT + pid, tl.xor_sum(tl.xor_sum(acc, 1), 0))


def launch_fits(n: int, row_bytes: int, warps: int, spans: int, parts: int) -> bool:
    """Whether the launch tiles the layer as the rows kernel would: whole blocks of 16 warps / P rows, whole steps."""
    bn = 16 * warps // parts
    return n % bn == 0 and row_bytes % (parts * 64 * spans) == 0


def pattern_fn(bufs, out, n: int, row_bytes: int, warps: int, spans: int, parts: int, tiles: bool,
               programs: int = 0):
    """One launch a call over the next buffer of the rotation: a program a block of rows, or (programs > 0) that
    many programs looping over the blocks (the GEMVs' residency: their registers hold 3-5 programs an SM)."""
    bn = 16 * warps // parts
    blocks = n // bn
    grid = min(blocks, programs) if programs else blocks
    turn = itertools.cycle(bufs)

    def fn():
        _pattern_kernel[(grid,)](next(turn), out, blocks, TILES=tiles, ROW_WORDS=row_bytes // 4, BN=bn, P=parts,
                                 STEP_WORDS=16 * spans, num_warps=warps)
    return fn


def pattern_xor(buf: torch.Tensor, n: int, row_bytes: int, warps: int, spans: int, parts: int, tiles: bool,
                programs: int = 0) -> int:
    """The xor of every word the pattern kernel read: equal to the buffer's whenever it read each word once."""
    bn = 16 * warps // parts
    out = torch.zeros(n // bn, dtype=torch.int32, device=buf.device)
    pattern_fn([buf], out, n, row_bytes, warps, spans, parts, tiles, programs)()
    return _xor_all(out)


def _xor_all(t: torch.Tensor) -> int:
    return int(np.bitwise_xor.reduce(t.flatten().cpu().numpy()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qkv,o,gate_up,down,27b_gate_up")
    ap.add_argument("--launches", default=LAUNCHES, help="warpsxspansxparts of the rows kernel, comma-separated")
    ap.add_argument("--resident", default="0,3", help="programs an SM, comma-separated (0: a program a block)")
    args = ap.parse_args()
    from first_gpu import copy_bandwidth
    from quant_ncu import read_floor_us
    bw = copy_bandwidth()
    launches = [tuple(int(v) for v in s.split("x")) for s in args.launches.split(",")]
    residents = [int(v) for v in args.resident.split(",")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name in args.shapes.split(","):
        n, row_bytes = SHAPES[name]
        nbytes = n * row_bytes
        words = nbytes // 4
        bufs = [torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, device="cuda")
                for _ in range(max(1, -(-ROTATE_BYTES // nbytes)))]
        out = torch.empty(max(4096, n), dtype=torch.int32, device="cuda")
        whole = _xor_all(bufs[0])
        flat, flat_cfg = read_floor_us(nbytes)
        row = dict(shape=name, n=n, row_bytes=row_bytes, bytes=nbytes, flat_us=flat, flat_launch=flat_cfg,
                   flat_pct=round(100 * nbytes / (flat * 1e-6) / bw, 1), launches=[])
        for warps, spans, parts in launches:
            if not launch_fits(n, row_bytes, warps, spans, parts):
                continue
            for resident in residents:
                entry = dict(warps=warps, spans=spans, parts=parts, programs_an_sm=resident)
                for tiles in (False, True):
                    key = "tiles" if tiles else "rows"
                    args_ = (n, row_bytes, warps, spans, parts, tiles, resident * sms)
                    if pattern_xor(bufs[0], *args_) != whole:
                        raise SystemExit(f"{name} {warps}x{spans}x{parts} {key}: did not read every word once")
                    us = bench(pattern_fn(bufs, out, *args_))
                    entry[f"{key}_us"] = us
                    entry[f"{key}_pct"] = round(100 * nbytes / (us * 1e-6) / bw, 1)
                row["launches"].append(entry)
                print(f"  {name} {warps}x{spans}x{parts} ({resident or 'all'} an SM): rows {entry['rows_us']:.2f} us, "
                      f"tiles {entry['tiles_us']:.2f}", flush=True)
        rows.append(row)
    out_dir = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    result = dict(device=torch.cuda.get_device_name(), commit=os.environ.get("COMMIT", "?"),
                  copy_gbs=round(bw / 1e9, 1), rows=rows)
    (out_dir / "read_pattern.json").write_text(json.dumps(result, indent=1))
    print(f"{'shape':<12} {'MB':>6} {'flat us':>8} {'%copy':>6}  "
          "launch (warps x spans x parts / programs an SM): rows us / % | tiles us / %")
    for r in rows:
        cells = "  ".join(f"{e['warps']}x{e['spans']}x{e['parts']}/{e['programs_an_sm'] or 'all'}: "
                          f"{e['rows_us']:.1f} / {e['rows_pct']:.0f} | "
                          f"{e['tiles_us']:.1f} / {e['tiles_pct']:.0f}" for e in r["launches"])
        print(f"{r['shape']:<12} {r['bytes'] / 1e6:6.1f} {r['flat_us']:8.2f} {r['flat_pct']:6.1f}  {cells}")


if __name__ == "__main__":
    main()
