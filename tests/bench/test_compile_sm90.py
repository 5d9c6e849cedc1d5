"""bench/compile_sm90.py on the CPU: the changed Triton kernels compile for sm_90 (Triton's CUDA backend and its
ptxas need no GPU), so a frontend or type error shows here rather than on the lent GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia", reason="Triton's CUDA backend is not installed")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "compile_sm90.py"


def compile_sm90():
    spec = importlib.util.spec_from_file_location("compile_sm90", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kernels_compile_for_sm90():
    assert compile_sm90().main() == 0


def test_quant_gemv_weight_words_meet_their_bytes_x_and_scales_in_one_layout():
    """quant_gemv's asm reads a span's weights as bytes packed 4 a register (one-row kernels) or as 32-bit words
    (the rows kernel, `_span_words`: the word in the first of each 4 elements) beside the x pairs and scales of the
    same 4 elements: right only where each thread's 4 packed elements are 4 consecutive columns from a multiple of
    4, in the one layout every operand of the asm shares, and the layout the words were packed in. Checked on the
    compiled kernels, whose layouts Triton chooses."""
    import re

    cs = compile_sm90()
    picked = [c for c in cs.cases() if c[0].startswith("quant_gemv") and ("stream" in c[0] or "K=12288" in c[0]
                                                                           or "moe" in c[0])]
    assert len(picked) >= 8
    for label, (fn, types, consts), opts in picked:
        ttgir = cs.build(fn, types, consts, opts.get("div16", ()), opts.get("num_warps", 4),
                         opts.get("num_stages", 3)).asm["ttgir"]
        layouts = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, re.M))
        seen = set()
        for line in ttgir.splitlines():
            if "elementwise_inline_asm" not in line or not ("mma.sync" in line or "mov.b32 $0, $4" in line):
                continue
            operands = re.findall(r"tensor<\d+x64x(?:i8|i32|f32), (#\w+)>", line)
            assert operands and len(set(operands)) == 1, (label, operands)
            seen.add(operands[0])
            layout = layouts[operands[0]]
            size = [int(v) for v in re.search(r"sizePerThread = \[(\d+), (\d+)\]", layout).groups()]
            assert size[1] % 4 == 0 and "order = [1, 0]" in layout, (label, layout)
        assert len(seen) == 1, (label, seen)  # the words packed in the layout the mma asm reads them in
