"""bench/draft_quant.py's flow on tiny configs (CPU): one hybrid_gpu.py run per drafter format, one row each."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import draft_quant  # noqa: E402


def test_tiny_rows_per_drafter_format(tmp_path):
    rows = draft_quant.main(["--device", "cpu", "--tiny", "--quants", "nvfp4", "--drafts", "none,rtn4",
                             "--rtn-group-size", "32", "--out", str(tmp_path), "--",
                             "--tokens", "4", "--runs", "1", "--context", "16"])
    assert [r["draft"] for r in rows] == ["none", "rtn4"]
    assert all("error" not in r for r in rows), rows
    plain, rounded = rows
    assert rounded["drafter_own_lm_head"] and not plain["drafter_own_lm_head"]
    assert 0 < rounded["drafter_GB"] < plain["drafter_GB"] + rounded["drafter_GB"]
    assert all(r["k15_ms"] > 0 and r["ar_ms"] > 0 for r in rows)
    assert (tmp_path / "draft_quant.json").is_file()
