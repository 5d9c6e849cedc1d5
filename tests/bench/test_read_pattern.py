"""bench/read_pattern.py's read-only kernels read every word of the layer once, in the rows kernel's pattern and
in the tiled layout: run in Triton's interpreter on the CPU (a subprocess, so TRITON_INTERPRET=1 is set before
Triton is imported)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CHECK = """
import sys, torch
sys.path.insert(0, "bench")
import read_pattern as rp
for warps, spans, parts in ((4, 2, 2), (8, 2, 4), (4, 1, 1)):
    n, row_bytes = 64, 64 * spans * parts * 3  # three steps a part
    assert rp.launch_fits(n, row_bytes, warps, spans, parts)
    buf = torch.randint(-2**31, 2**31 - 1, (n * row_bytes // 4,), dtype=torch.int32,
                        generator=torch.Generator().manual_seed(warps + spans + parts))
    want = rp._xor_all(buf)
    for tiles, programs in ((False, 0), (True, 0), (False, 3), (True, 1)):  # a program a block, or looping
        case = (n, row_bytes, warps, spans, parts, tiles, programs)
        assert rp.pattern_xor(buf, *case) == want, case
        buf[5 + 64 * tiles] ^= 1 << 7  # one word changed: the kernel's xor moves with it
        assert rp.pattern_xor(buf, *case) == want ^ (1 << 7), case
        buf[5 + 64 * tiles] ^= 1 << 7
print("ok")
"""


def test_pattern_kernels_read_every_word_once() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_launch_fits_whole_blocks_and_steps() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    import read_pattern as rp

    assert rp.launch_fits(24576, 2048, 8, 2, 4)  # the 8B's gate|up on ROWS_ONE_WIDE's shape
    assert not rp.launch_fits(24576, 2048 + 64, 8, 2, 4)
    assert not rp.launch_fits(24576 + 8, 2048, 8, 2, 4)
