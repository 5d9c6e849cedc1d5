"""bench/env_variants.py end to end on the CPU: two variants of hybrid_gpu.py's tiny flow that differ by an
environment variable, the table against the first last."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import env_variants  # noqa: E402


def test_parse_variant():
    assert env_variants.parse_variant("base:") == ("base", {})
    assert env_variants.parse_variant("e:A=x,y;B=1") == ("e", {"A": "x,y", "B": "1"})
    with pytest.raises(SystemExit):
        env_variants.parse_variant(":A=1")
    with pytest.raises(SystemExit):
        env_variants.parse_variant("e:A")


@pytest.mark.skipif(shutil.which("git") is None or not (env_variants.ab_engine.REPO / ".git").exists(),
                    reason="needs a git checkout")
def test_tiny_cpu_variants(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("BLOCKSPEC_ENV_VARIANTS_TEST", raising=False)
    res = env_variants.main(["--variant", "base:", "--variant", "early:BLOCKSPEC_ENV_VARIANTS_TEST=a,b",
                             "--out", str(tmp_path), "--", "--device", "cpu", "--tiny", "--tokens", "8",
                             "--runs", "1", "--context", "32", "--models", "coder30b", "--skip-equality"])
    (row,) = res["variants"]["early"]["rows"]
    assert "error" not in row, row
    assert res["variants"]["early"]["env"] == {"BLOCKSPEC_ENV_VARIANTS_TEST": "a,b"}
    assert all(v > 0 for v in row["ar_tok_s"] + row["k15_ms"])
    assert json.loads((tmp_path / "env_variants.json").read_text())["variants"] == res["variants"]
    assert (tmp_path / "base0" / "hybrid_gpu.json").exists() and (tmp_path / "early0" / "hybrid_gpu.json").exists()
    assert "BLOCKSPEC_ENV_VARIANTS_TEST" not in __import__("os").environ
    out = capsys.readouterr().out.rstrip().splitlines()
    assert out[-1].startswith("| Qwen3-Coder-30B-A3B (tiny) |") and out[-4] == "new early / base base"
