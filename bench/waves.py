"""How many times each dispatched 4-bit mma launch fills the SMs, offline (no GPU): registers and shared memory of
the kernel compiled for sm_90 (bench/compile_sm90.py), the programs a launch makes, the programs an SM holds.

Why: a one-row launch of ~1.2 waves runs its last programs nearly alone. Qwen3.6-27B's down took 37.5 us on every
launch until that was seen (320 programs, 2 resident an SM: NOTES session 37); K split over two programs took it to
26.7. A table of waves says which shapes to sweep before device time is spent.

    PYTHONPATH=/tmp/t36site:. python bench/waves.py --rows 1,16 [--shapes qkv,down] [--schemes nvfp4] [--sms 132]

Per SM (sm_90): 64 warps, 32 programs, 65,536 registers (a warp's rounded up to 256), 228 KB of shared memory (1 KB
a program reserved). Waves = programs / (resident an SM x SMs); "tail" is the last wave's share of a full one
(0.2 means its programs run ~alone). Launches quant_linear's dot path takes are listed as "dot" and not counted.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from compile_sm90 import build, resources  # noqa: E402
from quant_gemv import GATED_SHAPES, SHAPES  # noqa: E402

from blockspec.kernels import quant_gemv as qv  # noqa: E402
from blockspec.kernels.quant_linear import QuantMeta  # noqa: E402

TYPES = {"X": "*bf16", "QW": "*u8", "S": "*u8", "GS": "*fp32", "Y": "*bf16", "N": "i32", "M": "i32", "WS": "*fp32",
         "CNT": "*i32", "NP": "i32"}
# Qwen3.5-122B-A10B's attention o_proj and Gated DeltaNet out_proj (hidden 3072, 8192 wide)
EXTRA_SHAPES = [("122b_o_proj", 3072, 8192)]


def launch(cfg: qv.GemvConfig, m: int, n: int, k: int, int4: bool, gated: bool, res: bool):
    """(kernel, constexprs, programs) as quant_gemv.gemv launches cfg."""
    common = dict(K=k, HAS_GS=not int4, BN=cfg.block, SPANS=cfg.spans, HAS_RES=res, PDL=True, INT4=int4,
                  G2=64 if int4 else 8, GATED=gated)
    kernel, own = qv.launch_kernel(cfg, m)
    return kernel, {**common, **own}, math.prod(qv.launch_grid(cfg, m, n))


def resident(warps: int, regs: int, shared: int) -> int:
    """Programs of `warps` warps an sm_90 SM holds at once."""
    per_warp = math.ceil(regs * 32 / 256) * 256
    return max(0, min(32, 64 // warps, 65536 // (per_warp * warps), (228 * 1024) // (shared + 1024)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--schemes", default="nvfp4")
    ap.add_argument("--shapes", default=None, help="names from bench/quant_gemv.py's SHAPES (+ 122b_o_proj)")
    ap.add_argument("--sms", type=int, default=132, help="H100 SXM / H200: 132")
    args = ap.parse_args()
    shapes = [s for s in SHAPES + EXTRA_SHAPES if args.shapes is None or s[0] in args.shapes.split(",")]
    print(f"{'scheme':6} {'shape':13} {'N':>6} {'K':>6} {'M':>3} {'launch':44} {'regs':>4} {'smem':>6} {'/SM':>3} "
          f"{'progs':>5} {'waves':>5} {'tail':>4}")
    for scheme in args.schemes.split(","):
        int4 = scheme == "int4"
        for name, n, k in shapes:
            if name == "lm_head":
                continue
            gated = name in GATED_SHAPES
            res = not gated and n < k  # a down / o projection adds the residual
            for m in map(int, args.rows.split(",")):
                group = 128 if int4 else 16
                meta = QuantMeta(scheme, n, k, group, k // group, 1, False, int4, not int4)
                cfg = qv.launch_config(meta, m, gated)
                head = f"{scheme:6} {name:13} {n:6} {k:6} {m:3}"
                if cfg is None:
                    print(f"{head} {'dot':44}")
                    continue
                fn, consts, programs = launch(cfg, m, n, k, int4, gated, res)
                types = {**TYPES, "S": "*i32"} if int4 else TYPES  # int4: the scale|zero words
                kernel = build(fn, types, consts, div16=("X", "QW", "S", "Y"), num_warps=cfg.warps, num_stages=1)
                usage = resources(kernel.asm["cubin"])
                regs = usage[0] if usage else kernel.n_regs
                shared = kernel.metadata.shared
                per_sm = resident(cfg.warps, regs, shared)
                waves = programs / (per_sm * args.sms) if per_sm else math.inf
                tail = waves - math.floor(waves) if waves > 1 and waves != math.floor(waves) else 1.0
                label = (f"w{cfg.warps} s{cfg.spans} p{cfg.parts}" + (" stream" if cfg.stream else "")
                         + (" rows" if cfg.rows or m > 1 else "") + (f" R{cfg.groups}" if cfg.groups > 1 else "")
                         + (f" K/{cfg.splits}" if cfg.splits > 1 else ""))
                print(f"{head} {label:44} {regs:4} {shared:6} {per_sm:3} {programs:5} {waves:5.2f} {tail:4.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
