"""`blockspec generate`: output shapes, and one clear line (no traceback) for every bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from blockspec.cli import main

from .conftest import save_tiny_drafter


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json(capsys, tiny_models, tiny_drafter):
    code, out, _ = run(capsys, "generate", "hello", "--model", str(tiny_models["qwen3"]), "--draft", str(tiny_drafter),
                       "--num-speculative-tokens", "4", "--max-tokens", "12", "--device", "cpu", "--json", "--raw")
    assert code == 0
    result = json.loads(out)
    assert set(result) >= {"text", "token_ids", "stats"}
    assert len(result["token_ids"]) == 12 or result["finish_reason"] == "stop"
    stats = result["stats"]
    assert set(stats) >= {"tau", "accepted_per_position", "steps", "prompt_tokens", "completion_tokens",
                          "decode_tok_s"}
    assert len(stats["accepted_per_position"]) == 4 and stats["completion_tokens"] == len(result["token_ids"])


def test_generate_text_and_summary(capsys, tiny_models):
    code, out, err = run(capsys, "generate", "hi", "--model", str(tiny_models["llama"]), "--max-tokens", "8",
                         "--device", "cpu", "--temperature", "0.7", "--seed", "3", "--top-p", "0.9", "--top-k", "50")
    assert code == 0 and out.strip()
    assert "tok/s" in err and "tau" in err


def test_default_model_uses_the_shipped_drafter(capsys):
    """No --model and no --draft: the embedded SmolLM2 with its trained drafter, losslessly."""
    code, out, err = run(capsys, "generate", "Write a Python function that adds two numbers.", "--max-tokens", "24",
                         "--device", "cpu", "--json")
    assert code == 0 and "no default drafter" not in err
    spec = json.loads(out)
    assert len(spec["stats"]["accepted_per_position"]) == 15 and spec["stats"]["tau"] > 1.0
    code, out, _ = run(capsys, "generate", "Write a Python function that adds two numbers.", "--max-tokens", "24",
                       "--device", "cpu", "--json", "--no-draft")
    plain = json.loads(out)
    assert code == 0 and plain["stats"]["accepted_per_position"] == []
    assert plain["token_ids"] == spec["token_ids"]  # greedy speculation is lossless on CPU fp32


@pytest.fixture
def broken_dirs(tmp_path, tiny_models):
    unknown = tmp_path / "unknown"
    shutil.copytree(tiny_models["qwen3"], unknown)
    cfg = json.loads((unknown / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (unknown / "config.json").write_text(json.dumps(cfg))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_models["qwen3"], corrupt)
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 3])
    from transformers import AutoConfig

    wrong = save_tiny_drafter(tmp_path / "wrong_draft", AutoConfig.from_pretrained(tiny_models["qwen3"]),
                              target_layer_ids=[1, 40])
    return {"unknown": unknown, "corrupt": corrupt, "wrong_draft": wrong}


@pytest.mark.parametrize("case,extra,needle", [
    ("unknown", [], "not supported"),
    ("missing", [], "not found"),
    ("corrupt", [], "model.safetensors"),
    ("wrong_draft", [], "target_layer_ids"),
    ("too_long", ["--max-model-len", "16"], "max_model_len"),
    ("no_memory", ["--kv-cache-memory", "1KiB"], "--kv-cache-memory"),
    ("bad_dtype", ["--dtype", "int3"], "--dtype"),
])
def test_bad_input_gives_one_clear_line(capsys, tiny_models, broken_dirs, case, extra, needle):
    model = {"unknown": broken_dirs["unknown"], "corrupt": broken_dirs["corrupt"],
             "missing": "/nonexistent/model"}.get(case, tiny_models["qwen3"])
    args = ["generate", "x" * 40, "--model", str(model), "--device", "cpu", "--raw", *extra]
    if case == "wrong_draft":
        args += ["--draft", str(broken_dirs["wrong_draft"])]
    code, out, err = run(capsys, *args)
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


def test_no_traceback_from_the_real_command(tiny_models):
    cmd = [sys.executable, "-m", "blockspec.cli", "generate", "hi", "--model", "/nope", "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error:") and "Traceback" not in proc.stderr


def test_generate_deterministic(capsys, tiny_models, tiny_drafter):
    """--deterministic through `generate`: the same greedy tokens as without a drafter (CPU)."""
    common = ["generate", "hello", "--model", str(tiny_models["qwen3"]), "--max-tokens", "12", "--device", "cpu",
              "--dtype", "bfloat16", "--json", "--raw", "--deterministic"]
    code, out, _ = run(capsys, *common, "--draft", str(tiny_drafter), "--num-speculative-tokens", "7")
    code_ar, out_ar, _ = run(capsys, *common)
    assert code == code_ar == 0
    assert json.loads(out)["token_ids"] == json.loads(out_ar)["token_ids"]
