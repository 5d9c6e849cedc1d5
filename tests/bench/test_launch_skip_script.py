"""bench/launch_skip.py end to end on the CPU (tiny configs): each variant built in its own process with its launches
made no-ops, the step times read back from hybrid_gpu.py's JSON, the table last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import launch_skip  # noqa: E402

from blockspec.models import llama  # noqa: E402


def test_variants_run_and_are_compared(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    proc = subprocess.run([sys.executable, str(BENCH / "launch_skip.py"), "--variants", "base,rope", "--",
                           "--device", "cpu", "--tiny", "--tokens", "8", "--runs", "1", "--context", "32",
                           "--models", "8b", "--skip-equality"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((tmp_path / "launch_skip.json").read_text())
    assert set(res["variants"]) == {"base", "rope"} and res["commit"] and res["settings"]["tiny"]
    assert not list(tmp_path.glob("*/"))  # the variants' own runs stay in a temporary folder
    for row in res["variants"].values():
        assert row["error"] is None and all(row[k] > 0 for k in ("ar_ms", "k15_ms", "verify_ms")), row
    lines = proc.stdout.rstrip().splitlines()
    assert lines[-2].startswith("base") and lines[-1].startswith("rope") and "(" in lines[-1]


def test_skip_makes_the_chosen_launches_no_ops(monkeypatch):
    """rope: rope_qk as the decoder calls it does nothing; norm: a GPU norm of decode rows returns its input (on the
    CPU the norm still runs)."""
    from blockspec.models.layers import norm

    monkeypatch.setattr(llama, "rope_qk", llama.rope_qk)
    monkeypatch.setattr(norm.RMSNorm, "forward", norm.RMSNorm.forward)
    launch_skip.skip({"rope", "norm"})
    qkv = torch.randn(2, 48)
    before = qkv.clone()
    assert llama.rope_qk(qkv, torch.zeros(2, dtype=torch.long), None, None, 2, 1, 16) is None
    assert torch.equal(qkv, before)
    x = torch.randn(3, 8) * 5
    out = norm.RMSNorm(8)(x)
    assert torch.allclose(out.float().pow(2).mean(-1), torch.ones(3), atol=1e-3)  # CPU: normed as before
