"""bench/ab_engine.py end to end on the CPU: the base tree exported from git, both runs of hybrid_gpu.py's tiny
flow, the side-by-side table last."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import ab_engine  # noqa: E402


@pytest.mark.skipif(shutil.which("git") is None or not (ab_engine.REPO / ".git").exists(),
                    reason="needs a git checkout")
def test_tiny_cpu_ab(tmp_path, capsys):
    base = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=ab_engine.REPO, check=True).stdout.strip()
    res = ab_engine.main(["--base", "HEAD", "--out", str(tmp_path), "--", "--device", "cpu", "--tiny", "--in-process",
                          "--tokens", "8", "--runs", "1", "--context", "32", "--models", "coder30b", "--skip-equality"])
    assert res["base"] == base and res["new"].startswith(base)
    (row,) = res["rows"]
    assert "error" not in row, row
    assert all(v > 0 for v in row["ar_tok_s"] + row["k15_ms"] + row["verify_ms"])
    assert json.loads((tmp_path / "ab_engine.json").read_text())["rows"] == res["rows"]
    for side in ("new", "base"):
        assert json.loads((tmp_path / side / "hybrid_gpu.json").read_text())["commit"].startswith(base)
    out = capsys.readouterr().out.rstrip().splitlines()
    assert out[-1].startswith("| Qwen3-Coder-30B-A3B (tiny) |") and out[-3].startswith("| model |")


def test_rounds_compare_medians():
    """--rounds: each tree's figures are the medians of its runs (a missing figure, e.g. graph times of an eager or
    older tree, stays out of the median), and the graph replays are compared beside the requests."""
    def run(tok_s: float, k15: float, graphs: dict | None) -> dict:
        model = {"key": "8b", "model": "Qwen3-8B", "ar": {"tok_s": tok_s}, "ar_fraction": tok_s / 500,
                 "k15": {"uniform": {"step_ms": k15}}, "verify": {"uniform": {"step_ms": 4.0, "fraction": 0.3}}}
        if graphs is not None:
            model["graphs_ms"] = graphs
        return {"models": [model]}

    new = ab_engine.median_of_rounds([run(300.0, 5.0, {"ar_target": 3.0, "k15_draft": 0.6, "k15_target": 4.0}),
                                      run(310.0, 4.0, {"ar_target": 2.0, "k15_draft": 0.5, "k15_target": 3.9}),
                                      run(350.0, 4.5, None)])
    base = ab_engine.median_of_rounds([run(320.0, 5.5, None)])
    (row,) = ab_engine.compare(new, base)
    assert row["ar_tok_s"] == [310.0, 320.0] and row["k15_ms"] == [4.5, 5.5]
    assert row["ar_graph_ms"] == [2.5, None] and row["k15_graphs_ms"] == [0.55 + 3.95, None]
    assert "2.500" not in ab_engine.table([row], "new", "base")  # a pair with a missing side prints "-"
