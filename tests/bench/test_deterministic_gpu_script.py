"""bench/deterministic_gpu.py's tiny CPU mode end to end: equality with and without --deterministic and the cost
runs, on tiny random configs (bf16 on CPU), in seconds; the JSON it writes and the table it prints last."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import deterministic_gpu  # noqa: E402


def test_tiny_cpu_run_writes_json_and_table(tmp_path, capsys):
    results = deterministic_gpu.main(["--tiny", "--device", "cpu", "--prompts", "2", "--tokens", "6", "--runs", "1",
                                      "--context", "16", "--cost-tokens", "4", "--max-model-len", "64",
                                      "--out", str(tmp_path)])
    written = json.loads((tmp_path / "deterministic_gpu.json").read_text())
    assert written["commit"] and written["device"] == "cpu" and written["dtype"] == "bfloat16"
    eq = written["equality"]
    assert "tiny random" in eq["model"] and any("tiny random" in n for n in written["notes"])
    on = eq["modes"]["on"]["cells"]
    assert set(on) == {f"k{k}_b{b}" for k in (0, 7, 15) for b in (1, 8)}
    assert all(cell["equal"] == 1.0 for cell in on.values())  # the mode's promise, on CPU too
    assert on["k0_b1"]["median_first_difference"] is None
    for mode in ("off", "on"):
        for k in ("k0", "k15"):
            assert written["cost"]["modes"][mode][k]["step_ms"] > 0
    assert set(written["cost"]["cost"]) == {"k0_step", "k15_step"}
    assert results["cost"] == written["cost"]
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith(("note:", "  k15 step ms"))
    assert "k15_b8" in out
