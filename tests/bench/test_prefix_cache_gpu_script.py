"""bench/prefix_cache_gpu.py's dry run: the GPU flow on tiny configs on the CPU (the hybrid, whose hits need
state snapshots), JSON and table included."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import prefix_cache_gpu  # noqa: E402


def test_dry_run_measures_hits_and_writes_json(tmp_path, capsys):
    prefix_cache_gpu.main(["--dry-run", "--models", "27b", "--turns", "2", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "prefix_cache_gpu.json").read_text())
    assert res["commit"] and res["device"] == "cpu" and res["settings"]["prefix_tokens"] == 96
    (m,) = res["models"]
    assert "error" not in m, m.get("error")
    cached, plain = m["cached"], m["uncached"]
    assert cached["shared_prefix"]["second_cached_tokens"] == 96 and plain["shared_prefix"]["second_cached_tokens"] == 0
    assert [r["cached_tokens"] for r in cached["conversation"]] == [0, 32]
    assert [r["prompt_tokens"] for r in plain["conversation"]] == [r["prompt_tokens"] for r in cached["conversation"]]
    assert m["hit_tokens_equal_uncached"] is True and m["ttft_ratio"] > 0 and m["decode_tok_s_ratio"] > 0
    out = capsys.readouterr().out.rstrip().splitlines()
    assert out[-1].startswith("| Qwen3.6-27B (tiny) |") and out[-3].startswith("| model |")
