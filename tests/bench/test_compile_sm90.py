"""bench/compile_sm90.py on the CPU: the changed Triton kernels compile for sm_90 (Triton's CUDA backend and its
ptxas need no GPU), so a frontend or type error shows here rather than on the lent GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia", reason="Triton's CUDA backend is not installed")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "compile_sm90.py"


def test_kernels_compile_for_sm90():
    spec = importlib.util.spec_from_file_location("compile_sm90", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main() == 0
