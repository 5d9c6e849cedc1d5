"""`blockspec train-drafter` end to end on a tiny random target: data through the engine, training,
export; the exported drafter serves (losslessly) in blockspec and loads in the reference package."""

from __future__ import annotations

import json
import time

import pytest
import torch
import transformers

from blockspec.cli import main
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams

dflash_model = pytest.importorskip("dflash.model", reason="test-only oracle: pip install --no-deps dflash")

WORDS = ["red", "blue", "green", "gold", "grey", "pink", "teal", "navy", "rose", "lime"]


@pytest.fixture(scope="module")
def trained(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Name a {w} thing."}) for w in WORDS * 2))
    out = root / "drafter"
    args = ["train-drafter", "--target", str(tiny_models["llama"]), "--out", str(out), "--prompts", str(prompts),
            "--num-samples", "16", "--response-len", "24", "--gen-batch", "16", "--max-prompt-len", "48",
            "--num-layers", "1", "--block-size", "8", "--epochs", "20", "--batch-size", "4", "--num-anchors", "8",
            "--lr", "3e-2", "--eval-prompts", "2", "--eval-max-tokens", "16", "--device", "cpu"]
    assert main(args) == 0
    return {"out": out, "args": args, "target": tiny_models["llama"]}


def test_outputs_and_falling_loss(trained):
    out = trained["out"]
    for name in ("config.json", "model.safetensors", "README.md", "train_summary.json", "train_state.pt"):
        assert (out / name).is_file(), name
    assert len(list((out / "data").glob("shard-*.safetensors"))) == 1
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert len(losses) >= 8 and losses[-1] < 0.5 * losses[0]
    evals = [r["eval"] for r in log if "eval" in r]
    assert evals and evals[-1]["k"] == 7 and len(evals[-1]["acceptance_per_position"]) == 7
    assert evals[-1]["tau"] > 1.5 > evals[0]["tau"]  # learning shows up as acceptance in the engine
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["training"]["steps"] == 80 and summary["data"]["samples"] == 16
    assert "Held-out evaluation" in (out / "README.md").read_text()


def test_export_serves_losslessly_in_blockspec(trained):
    common = dict(model=str(trained["target"]), device="cpu")
    ar = Engine(EngineConfig(**common))
    sp = Engine(EngineConfig(**common, speculative=SpeculativeConfig(model=str(trained["out"]))))
    assert sp.num_speculative_tokens == 7
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompt = ar.apply_chat_template([{"role": "user", "content": "Name a red thing."}])
    a, s = ar.generate([prompt], params)[0], sp.generate([prompt], params)[0]
    assert a.token_ids == s.token_ids
    assert s.stats.tau >= 1.0


def test_export_loads_in_reference(trained):
    ref = dflash_model.DFlashDraftModel.from_pretrained(trained["out"], dtype=torch.float32)
    cfg = json.loads((trained["out"] / "config.json").read_text())
    assert ref.block_size == 8 and ref.mask_token_id == cfg["dflash_config"]["mask_token_id"]
    assert list(ref.target_layer_ids) == cfg["dflash_config"]["target_layer_ids"]


def test_resume_reuses_data_and_state(trained, capsys):
    out = trained["out"]
    before = (out / "data" / "shard-00000.safetensors").stat().st_mtime_ns
    assert main([*trained["args"], "--resume"]) == 0
    assert (out / "data" / "shard-00000.safetensors").stat().st_mtime_ns == before
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["training"]["steps"] == 80  # already finished: nothing more to train
    assert "drafter written to" in capsys.readouterr().out


def _arg(args: list[str], flag: str, value: str) -> list[str]:
    i = args.index(flag)
    return [*args[:i + 1], value, *args[i + 2:]]


def test_init_from_continues_from_a_trained_drafter(trained, tmp_path):
    """--init-from starts from the drafter's weights and config: the first loss is already the trained
    drafter's (far below a fresh start's), and the config (layers, block, mask token) is carried over."""
    out = tmp_path / "tuned"
    args = _arg(_arg(trained["args"], "--out", str(out)), "--epochs", "1")
    args = _arg(_arg(args, "--lr", "1e-9"), "--num-layers", "1")  # the drafter's own: all its layers
    args += ["--data-dir", str(trained["out"] / "data"), "--init-from", str(trained["out"])]
    assert main(args) == 0

    def losses(d):
        return [json.loads(line)["loss"] for line in (d / "train_log.jsonl").read_text().splitlines()
                if "loss" in json.loads(line)]

    assert losses(out)[0] < 0.5 * losses(trained["out"])[0]
    old, new = (json.loads((d / "config.json").read_text()) for d in (trained["out"], out))
    assert new == old
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["init_from"] == str(trained["out"])
    assert "Starting from the weights of the drafter" in (out / "README.md").read_text()


def test_init_from_a_directory_without_a_drafter_is_refused(trained, tmp_path, capsys):
    args = _arg(trained["args"], "--out", str(tmp_path / "x"))
    args += ["--data-dir", str(trained["out"] / "data"), "--init-from", str(tmp_path)]
    assert main(args) != 0
    assert "has no config.json" in capsys.readouterr().err


def test_dflash2_training_exports_what_the_reference_loads(trained, tmp_path, monkeypatch):
    """--arch dflash2 on the same data: the selector's K-way loss falls, and the export is a DFlash2DraftModel
    checkpoint the `dflash` package loads with every tensor as trained, which serves losslessly here."""
    out = tmp_path / "d2"
    args = _arg(_arg(trained["args"], "--out", str(out)), "--epochs", "6")
    args += ["--data-dir", str(trained["out"] / "data"), "--arch", "dflash2", "--selector-top-k", "4",
             "--selector-rank", "8"]
    assert main(args) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4,
            "block_size": 8}.items() <= cfg["dflash_config"].items()
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    selector = [r["selector_loss"] for r in log if "selector_loss" in r]
    assert len(selector) >= 2 and selector[-1] < selector[0]
    assert "DFlash 2" in (out / "README.md").read_text()

    ref = dflash_model.DFlash2DraftModel.from_pretrained(out, dtype=torch.float32)
    sp = Engine(EngineConfig(model=str(trained["target"]), device="cpu", speculative=SpeculativeConfig(model=str(out))))
    ours = sp.runner.proposer
    assert ours.method == "dflash2" and sp.num_speculative_tokens == 7
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():  # fused q|k|v and gate|up against z-lab's separate projections
        if "qkv_proj" in name or "gate_up_proj" in name:
            continue
        torch.testing.assert_close(p, ref_params[name].detach(), rtol=0, atol=0)
    ar = Engine(EngineConfig(model=str(trained["target"]), device="cpu"))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompt = ar.apply_chat_template([{"role": "user", "content": "Name a teal thing."}])
    got = sp.generate([prompt], params)[0]
    assert got.token_ids == ar.generate([prompt], params)[0].token_ids
    assert got.stats.tau > 1.2  # the trained drafter's drafts are accepted: the lossless check is not vacuous

    # the reference loop (DFlash2DraftModel.propose) on the exported weights: the same tokens, and the same
    # tokens committed by every verify step (so the same drafts were proposed and accepted)
    target = transformers.AutoModelForCausalLM.from_pretrained(trained["target"], dtype=torch.float32).eval()
    ids = sp.encode(prompt)
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)  # its stats time with CUDA events
    with torch.no_grad():
        want = dflash_model.dflash_generate(ref.eval(), target, torch.tensor([ids]), max_new_tokens=30,
                                            stop_token_ids=None, temperature=0.0, return_stats=True)
    assert got.token_ids == want.output_ids[0, len(ids):].tolist()
    assert (got.stats.steps, got.stats.decode_tokens) == (len(want.acceptance_lengths),
                                                          sum(want.acceptance_lengths))


def test_dflash2_from_a_dflash1_drafter_carries_its_shared_weights(trained, tmp_path):
    """--arch dflash2 --init-from a DFlash 1 drafter: the DFlash 2 drafter keeps the source's layers, target
    layers and mask token, takes every shared tensor from it, and starts its convolutions as the identity,
    so its first loss is already near the trained drafter's (far below a fresh DFlash 2 start's)."""
    from safetensors.torch import load_file

    out = tmp_path / "up"
    args = _arg(_arg(trained["args"], "--out", str(out)), "--epochs", "1")
    args = _arg(args, "--lr", "1e-9")
    args += ["--data-dir", str(trained["out"] / "data"), "--init-from", str(trained["out"]), "--arch", "dflash2",
             "--selector-top-k", "4", "--selector-rank", "8"]
    assert main(args) == 0
    old, new = (json.loads((d / "config.json").read_text()) for d in (trained["out"], out))
    assert new["architectures"] == ["DFlash2DraftModel"] and new["num_hidden_layers"] == old["num_hidden_layers"]
    assert {k: new["dflash_config"][k] for k in old["dflash_config"]} == old["dflash_config"]
    before, after = (load_file(str(d / "model.safetensors")) for d in (trained["out"], out))
    for name, tensor in before.items():
        torch.testing.assert_close(after[name].float(), tensor.float(), rtol=0, atol=1e-3)
    assert any("candidate_selector" in name for name in after)
    projections = [t for name, t in after.items() if name.endswith("conv.kernel_projection.weight")]
    assert projections and all(float(t.abs().max()) < 1e-6 for t in projections)  # exactly the identity

    def first_loss(d):
        return next(json.loads(line)["loss"] for line in (d / "train_log.jsonl").read_text().splitlines()
                    if "loss" in json.loads(line))

    fresh = tmp_path / "fresh"
    args = _arg(_arg(args, "--out", str(fresh)), "--init-from", str(tmp_path / "none"))
    args = args[:args.index("--init-from")] + args[args.index("--init-from") + 2:]
    assert main(args) == 0
    assert first_loss(out) < 0.5 * first_loss(fresh)
    assert "DFlash 1 drafter" in (out / "README.md").read_text()


def test_init_from_with_more_layers_than_the_drafter_is_refused(trained, tmp_path, capsys):
    args = _arg(_arg(trained["args"], "--out", str(tmp_path / "x")), "--num-layers", "2")
    args += ["--data-dir", str(trained["out"] / "data"), "--init-from", str(trained["out"])]
    assert main(args) != 0
    assert "--num-layers 2: the --init-from drafter has 1 layers" in capsys.readouterr().err


def test_dflash1_from_a_dflash2_drafter_is_refused(trained, tmp_path, capsys):
    d2 = tmp_path / "d2"
    d2.mkdir()
    (d2 / "config.json").write_text(json.dumps({"architectures": ["DFlash2DraftModel"]}))
    args = _arg(trained["args"], "--out", str(tmp_path / "x"))
    args += ["--data-dir", str(trained["out"] / "data"), "--init-from", str(d2), "--arch", "dflash"]
    assert main(args) != 0
    assert "cannot start from the DFlash 2 drafter" in capsys.readouterr().err


def test_init_from_keeps_the_first_layers_asked_for(trained, tmp_path):
    """--num-layers below the source drafter's: its first layers start the new drafter, the rest are not read."""
    from safetensors.torch import load_file

    two = tmp_path / "two"
    base = [*trained["args"], "--data-dir", str(trained["out"] / "data")]
    assert main(_arg(_arg(_arg(base, "--out", str(two)), "--num-layers", "2"), "--epochs", "1")) == 0
    one = tmp_path / "one"
    args = _arg(_arg(_arg(base, "--out", str(one)), "--epochs", "1"), "--lr", "1e-9")
    assert main([*args, "--init-from", str(two), "--arch", "dflash2", "--selector-top-k", "4",
                 "--selector-rank", "8"]) == 0
    cfg = json.loads((one / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and len(cfg["layer_types"]) == 1
    before, after = (load_file(str(d / "model.safetensors")) for d in (two, one))
    assert not any(name.startswith("layers.1.") for name in after)
    for name, tensor in before.items():
        if not name.startswith("layers.1."):
            torch.testing.assert_close(after[name].float(), tensor.float(), rtol=0, atol=1e-3)
