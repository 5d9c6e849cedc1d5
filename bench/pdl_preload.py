"""Can a launch's weight reads start before its PDL wait and hide the gap between kernels (issue 14, AR step)?

The 4-bit GEMMs of a decode step are each 1.3-1.8x the fastest launch that only reads their bytes, and that read
floor is itself 50-90% of copy bandwidth for 9-53 MB (bench/quant_ncu.py): every launch pays a ramp at its start
and a tail at its end. Weights do not depend on the previous kernel, so a launch under programmatic dependent
launch (PDL) could load them before `wait_for_inputs`, while the kernel before it finishes. This measures that
ceiling on a kernel that only reads (no GEMM), chained as the step chains its launches, before any GEMM is
rewritten:

- chain: the same read launch back to back in one CUDA graph (weights rotated past the L2), per launch: no PDL,
  PDL with nothing before the wait (today's kernels), PDL with the first PRE of each program's loads before it;
  release late (before the store, as the kernels do) or early (at the start).
- pairs: a small latency-bound kernel (~32 programs spinning a few us, standing in for attention / merge / norms)
  then a read, per pair: the read preloading its whole share during the small kernel needs that kernel to
  release its dependents early.

GPU only. JSON to $OUT (else bench/results/), a table last.

  python bench/pdl_preload.py
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant_gemm as qgm  # noqa: E402

from blockspec.kernels._triton import pdl  # noqa: E402

SIZES_MB = {"o": 8.9, "qkv": 13.4, "down": 26.7, "gate_up": 53.5}  # Qwen3-8B int4 g128 layers (quant_ncu)
WARPS = 4
BLOCK = 32 * WARPS * 4  # int32 words a load: 16 bytes a lane
PER_SM = 2
PRES = (0, 2, 4, 8, 16)  # loads a program issues before its wait (capped at its share)
SPIN_PROGRAMS = 32

if torch.cuda.is_available():
    import triton
    import triton.language as tl

    from blockspec.kernels._triton import release_dependents, wait_for_inputs

    @triton.jit
    def _chain_read_kernel(P, OUT, STEPS: tl.constexpr, BLOCK: tl.constexpr, PRE: tl.constexpr,
                           PDL: tl.constexpr, EARLY: tl.constexpr):
        """Program pid reads STEPS loads of BLOCK words from its own contiguous share, PRE of them before the
        wait; OUT[pid] (written by the launch before) is read after it, as a GEMM reads x."""
        pid = tl.program_id(0)
        if EARLY:
            release_dependents(PDL)
        base = P + pid.to(tl.int64) * (STEPS * BLOCK)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for s in tl.static_range(PRE):
            acc ^= tl.load(base + s * BLOCK + offs)
        wait_for_inputs(PDL)
        prev = tl.load(OUT + pid)
        for s in range(PRE, STEPS):
            acc ^= tl.load(base + s * BLOCK + offs)
        if not EARLY:
            release_dependents(PDL)
        tl.store(OUT + pid, tl.reduce(acc, 0, _xor) ^ prev)

    @triton.jit
    def _spin_kernel(OUT, ITERS, PDL: tl.constexpr, EARLY: tl.constexpr):
        """A few microseconds of dependent float math in a few programs, reading and writing OUT[pid]: a stand-in
        for the step's latency-bound kernels (attention, merge, norms, rope) that read almost nothing."""
        pid = tl.program_id(0)
        if EARLY:
            release_dependents(PDL)
        wait_for_inputs(PDL)
        v = tl.load(OUT + pid).to(tl.float32) * 1e-9 + tl.arange(0, 128).to(tl.float32)
        for _ in range(ITERS):
            v = v * 0.999 + 0.5
        if not EARLY:
            release_dependents(PDL)
        tl.store(OUT + pid, tl.sum(v).to(tl.int32, bitcast=True))

    @triton.jit
    def _xor(a, b):
        return a ^ b


def read_buffers(mb: float) -> tuple[list[torch.Tensor], int, int]:
    """Rotation of buffers of ~mb MB (past the L2), the grid and each program's loads."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = PER_SM * sms
    steps = max(1, round(mb * 1e6 / 4 / grid / BLOCK))
    words = grid * steps * BLOCK
    copies = max(1, -(-qgm.ROTATE_BYTES // (4 * words)))
    return [torch.empty(words, dtype=torch.int32, device="cuda").random_() for _ in range(copies)], grid, steps


def read_fn(bufs, out, grid, steps, pre, on, early):
    turn = itertools.cycle(bufs)

    def fn():
        _chain_read_kernel[(grid,)](next(turn), out, STEPS=steps, BLOCK=BLOCK, PRE=min(pre, steps), PDL=on,
                                    EARLY=early, num_warps=WARPS, launch_pdl=on)
    return fn


def spin_fn(out, iters, on, early):
    def fn():
        _spin_kernel[(SPIN_PROGRAMS,)](out, iters, PDL=on, EARLY=early, num_warps=4, launch_pdl=on)
    return fn


def main() -> None:
    from first_gpu import copy_bandwidth
    bw = copy_bandwidth()
    out = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    on = pdl(out)
    if not on:
        raise SystemExit("PDL is off here (needs sm_90+ and Triton >= 3.4): nothing to measure")
    rows = []
    for name, mb in SIZES_MB.items():
        bufs, grid, steps = read_buffers(mb)
        nbytes = 4 * bufs[0].numel()
        variants = [("no PDL", 0, False, False)] + [(f"PDL pre {p}", p, True, False) for p in PRES if p <= steps] + \
            [("PDL early, pre 0", 0, True, True), (f"PDL early, pre {min(16, steps)}", 16, True, True)]
        for label, pre, pdl_on, early in variants:
            us = qgm.bench(read_fn(bufs, out, grid, steps, pre, pdl_on, early))
            rows.append(dict(test="chain", layer=name, bytes=nbytes, variant=label, us=us,
                             pct_copy=qgm.pct(nbytes, us, bw), loads_a_program=steps))
            print(rows[-1], flush=True)
    # pairs: a small kernel, then a read of o_proj's size (its share preloaded or not)
    bufs, grid, steps = read_buffers(SIZES_MB["o"])
    nbytes = 4 * bufs[0].numel()
    for iters in (0, 2000):
        spin_alone = qgm.bench(spin_fn(out, iters, True, False))
        for spin_early, pre in ((False, 0), (False, steps), (True, 0), (True, steps)):
            spin, read = spin_fn(out, iters, True, spin_early), read_fn(bufs, out, grid, steps, pre, True, False)

            def pair(spin=spin, read=read):
                spin()
                read()
            us = qgm.bench(pair)
            rows.append(dict(test="pair", layer="o", bytes=nbytes, spin_iters=iters, spin_alone_us=spin_alone,
                             variant=f"spin {'early' if spin_early else 'late'} release, read pre {pre}",
                             us=us, read_us=us - spin_alone, read_pct_copy=qgm.pct(nbytes, us - spin_alone, bw)))
            print(rows[-1], flush=True)
    dest = Path(os.environ.get("OUT") or "bench/results")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "pdl_preload.json").write_text(json.dumps(dict(
        device=torch.cuda.get_device_name(), commit=os.environ.get("COMMIT", "?"), copy_gbs=bw / 1e9,
        warps=WARPS, block_words=BLOCK, programs_per_sm=PER_SM, rows=rows), indent=1))
    print(f"{'test':6} {'layer':8} {'MB':>6} {'variant':36} {'us':>7} {'%copy':>6}")
    for r in rows:
        pct = r.get("pct_copy", r.get("read_pct_copy"))
        extra = f"  (spin {r['spin_alone_us']:.2f} us alone, read {r['read_us']:.2f})" if r["test"] == "pair" else ""
        print(f"{r['test']:6} {r['layer']:8} {r['bytes'] / 1e6:6.1f} {r['variant']:36} {r['us']:7.2f} {pct:6.1f}"
              + extra)


if __name__ == "__main__":
    main()
