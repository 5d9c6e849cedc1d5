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
