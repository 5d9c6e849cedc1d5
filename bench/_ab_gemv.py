"""Temporary A/B: quant_gemv at f12a230 against today's, gate|up and LM head NVFP4 shapes, same process."""
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _gemv_f12a230 as old  # noqa: E402
import quant_gemm as qgm  # noqa: E402

from blockspec.kernels import quant_gemv as new  # noqa: E402
from blockspec.kernels import quant_linear as ql  # noqa: E402

for name, n, k in (("gate_up", 24576, 4096), ("lm_head", 151936, 4096), ("35b", 34816, 5120)):  # one part
    layer = qgm.random_layer("nvfp4", n, k)
    layers = qgm.rotation(layer)
    meta = ql.quant_meta(layer)
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    for rep in range(1):
        t1, t2 = itertools.cycle(layers), itertools.cycle(layers)
        a = qgm.bench(lambda: old.nvfp4_gemv(x, next(t1), meta))
        b = qgm.bench(lambda: new.nvfp4_gemv(x, next(t2), meta, new.WIDE))
        c = qgm.bench(lambda: new.nvfp4_gemv(x, next(t2), meta, new.GemvConfig(4, 4, 1)))
        print(name, rep, f"f12a230 {a:.1f} us  today {b:.1f} us  today w4 {c:.1f} us", flush=True)
