"""bench/waves.py on the CPU: the occupancy arithmetic and one dispatched shape compiled for sm_90."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia", reason="Triton's CUDA backend is not installed")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import waves  # noqa: E402

from blockspec.kernels import quant_gemv as qv  # noqa: E402


def test_programs_an_sm_holds():
    """The limits of sm_90 a launch meets first: registers (a warp's rounded up to 256), warps, shared memory."""
    assert waves.resident(8, 103, 4096) == 2  # STREAM_LONG_K: 27B down's 320 programs are 1.2 waves on 132 SMs
    assert waves.resident(2, 71, 512) == 14  # WIDE
    assert waves.resident(2, 16, 0) == 32  # at most 32 programs
    assert waves.resident(32, 32, 0) == 2  # 64 warps
    assert waves.resident(4, 32, 100 * 1024) == 2  # 228 KB, 1 KB a program reserved


def test_programs_a_launch_makes():
    """As quant_gemv.gemv launches them: the GEMV's tiles over K parts, the rows kernel's row blocks times splits."""
    fn, consts, programs = waves.launch(qv.STREAM_LONG_K, 1, 5120, 17408, int4=False, gated=False, res=True)
    assert fn is qv._stream_kernel and programs == 320 and consts["P"] == 4
    fn, consts, programs = waves.launch(qv.SPLIT_ONE, 1, 4096, 12288, int4=False, gated=False, res=True)
    assert fn is qv._rows_kernel and programs == 256 and consts["SPLITS"] == 2 and not consts["TWO"]
    assert waves.launch(qv.WIDE, 1, 24576, 4096, int4=False, gated=True, res=False)[2] == 1536


def test_the_table_for_one_shape():
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "waves.py"), "--rows", "1", "--shapes", "down"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = proc.stdout.strip().splitlines()[-1].split()
    assert row[:5] == ["nvfp4", "down", "4096", "12288", "1"] and "rows" in row and "K/2" not in row
    assert int(row[-3]) == 256  # programs (ROWS_ONE_LONG_K: 16 rows each)
