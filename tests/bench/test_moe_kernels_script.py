"""bench/moe_kernels.py --quant's dry run: the GPU flow (quantized block, routing draws, fused vs reference check,
bytes of the layouts, JSON and table) on a tiny shape on the CPU, under TRITON_INTERPRET=1 only (its kernels run in
Triton's interpreter)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from blockspec.kernels._triton import INTERPRET

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import moe_kernels  # noqa: E402


@pytest.mark.skipif(not INTERPRET, reason="the dry run needs TRITON_INTERPRET=1")
def test_quant_dry_run_checks_the_fused_path_and_writes_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(moe_kernels, "DEVICE", moe_kernels.DEVICE)  # main() switches them to the CPU's
    monkeypatch.setattr(moe_kernels, "DTYPE", moe_kernels.DTYPE)
    moe_kernels.main(["--quant", "int4", "--dry-run", "--tokens", "1", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "moe_kernels_int4.json").read_text())
    assert res["device"] == "cpu" and res["experts"] == "int4"
    (row,) = res["results"][0]["rows"]
    assert row["tokens"] == 1 and row["fused_rel_err"] < 1e-4
    assert row["fused_eager_us"] > 0 and row["reference_us"] > 0
    # int4 g128 experts: 4 bits per weight plus a bf16 scale and a zero byte per 128 (the dry run's fp32 scales)
    shape = moe_kernels.TINY
    per_expert = 3 * shape["hidden"] * shape["inter"] * (0.5 + 5 / 128)
    assert row["bytes"] > row["distinct_experts"] * per_expert
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("tiny ")
