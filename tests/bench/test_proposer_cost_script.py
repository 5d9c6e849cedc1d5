"""bench/proposer_cost_gpu.py's tiny CPU mode end to end: every proposer's engine, timings, JSON, table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import proposer_cost_gpu  # noqa: E402


def test_tiny_cpu_flow(tmp_path, capsys):
    proposer_cost_gpu.main(["--device", "cpu", "--tiny", "--tokens", "4", "--runs", "1", "--context", "20",
                            "--mtp", "1,2", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "proposer_cost.json").read_text())
    assert set(res["proposers"]) == {"dflash", "dflash2", "mtp"}
    for name, ks in (("dflash", [15]), ("dflash2", [7]), ("mtp", [1, 2])):
        r = res["proposers"][name]
        assert "error" not in r, r
        assert r["ar"]["step_ms"] > 0 and r["proposer_weight_bytes"] > 0
        for k in ks:
            assert r[f"k{k}"]["over_ar"] > 0 and r[f"k{k}"]["steps"] >= 1
    table = capsys.readouterr().out.strip().splitlines()
    assert table[-1].startswith("| mtp | 2 |") and "k-step / AR step" in table[1]
