"""bench/sass_loops.py --against on the CPU: a case compiled from this tree and from a revision's blockspec/ (under
this tree's bench/), compared line by line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia", reason="Triton's CUDA backend is not installed")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "sass_loops.py"


def git_ok() -> bool:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True).returncode == 0


@pytest.mark.skipif(not git_ok(), reason="needs the git checkout")
def test_a_kernel_against_its_own_commit_is_identical():
    """HEAD's blockspec/ against this tree's: the RMSNorm kernel is the same source, so the same SASS."""
    if subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "blockspec/kernels/rms_norm.py"], cwd=REPO).returncode:
        pytest.skip("rms_norm.py has uncommitted changes")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--against", "HEAD", "rms_norm PDL early"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert "HEAD -> here" in lines[0]
    assert len(lines) == 2 and lines[1].startswith("rms_norm PDL early") and "identical SASS" in lines[1]


def test_without_cases_it_prints_its_use():
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "--against" in proc.stdout


def test_the_gemv_loop_order_shows_its_loads_barriers_and_mmas():
    """The one-part GEMV's loop, one `order` line: its global loads (L), its mmas (M) and the trips of x's broadcast
    through shared memory (S: barriers and shared loads, which loading x in the tile's lane layout removed and
    which measured faster: bench/NOTES.md session 37)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "quant_gemv nvfp4 K=4096 HAS_GS=True HAS_RES=False"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cases = proc.stdout.split("quant_gemv nvfp4 K=4096")[1:]
    assert len(cases) == 1
    orders = [line.split()[1] for line in cases[0].splitlines() if line.strip().startswith("order")]
    assert len(orders) == 1 and all(letter in orders[0] for letter in "LMS")
    assert set(orders[0]) == set("LMS")
