"""load_weights into HF-named models, model path resolution and the one-time GGUF conversion."""

import json
import logging

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from blockspec.loader import gguf_convert, safetensors_loader
from blockspec.loader.errors import ModelLoadError
from blockspec.loader.weights import load_weights, resolve_model_path
from tests.loader.loader_helpers import fresh_model, hf_model, write_gguf


def assert_same_weights(model, reference):
    ref = reference.state_dict()
    got = model.state_dict()
    assert set(got) == set(ref)
    for name, tensor in ref.items():
        assert torch.equal(got[name].float(), tensor.float()), name


def copy_config(src, dst, **changes):
    dst.mkdir(exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_round_trip_sharded(tiny_models, tmp_path, arch):
    state = load_file(tiny_models[arch] / "model.safetensors")
    names = sorted(state)
    save_file({n: state[n] for n in names[::2]}, tmp_path / "a.safetensors")
    save_file({n: state[n] for n in names[1::2]}, tmp_path / "b.safetensors")
    weight_map = {n: ("a" if i % 2 == 0 else "b") + ".safetensors" for i, n in enumerate(names)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    copy_config(tiny_models[arch], tmp_path)
    model = fresh_model(tmp_path)
    load_weights(model, tmp_path, "cpu", torch.float32)
    assert_same_weights(model, hf_model(tiny_models[arch]))


def test_casts_to_dtype(tiny_models):
    model = fresh_model(tiny_models["llama"], dtype=torch.bfloat16)
    load_weights(model, tiny_models["llama"], "cpu", torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert_same_weights(model, hf_model(tiny_models["llama"]).to(torch.bfloat16))


def test_vlm_checkpoint(tiny_models, tmp_path, monkeypatch, caplog):
    """Wrapper prefixes are stripped; vision and MTP tensors are skipped without being read."""
    state = load_file(tiny_models["llama"] / "model.safetensors")
    wrapped = {}
    for name, tensor in state.items():
        if name.startswith("model.layers.0."):
            wrapped["language_model." + name] = tensor  # language_model.model.* (older VLMs)
        elif name.startswith("model."):
            wrapped["model.language_model." + name[len("model.") :]] = tensor
        else:
            wrapped["language_model." + name] = tensor  # language_model.lm_head.weight
    wrapped["model.visual.blocks.0.attn.qkv.weight"] = torch.ones(4, 4)
    wrapped["vision_tower.patch_embed.weight"] = torch.ones(4)
    wrapped["mtp.layers.0.mlp.up_proj.weight"] = torch.ones(4)
    save_file(wrapped, tmp_path / "model.safetensors")
    copy_config(tiny_models["llama"], tmp_path)

    skipped: list[str] = []
    real_iter = safetensors_loader.iter_safetensors

    def spy(model_dir, device, skip=None):
        for name, tensor in real_iter(model_dir, device, skip=skip):
            assert not skip(name)
            yield name, tensor
        skipped.extend(n for n in wrapped if skip(n))

    monkeypatch.setattr("blockspec.loader.weights.iter_safetensors", spy)
    model = fresh_model(tmp_path)
    with caplog.at_level(logging.WARNING):
        load_weights(model, tmp_path, "cpu", torch.float32)
    assert_same_weights(model, hf_model(tiny_models["llama"]))
    assert sorted(skipped) == sorted(n for n in wrapped if any(k in n for k in ("visual", "vision", "mtp")))
    assert not caplog.records  # skipped tensors are not "unknown"


def test_unknown_tensors_warn_in_one_line(tiny_models, tmp_path, caplog):
    state = load_file(tiny_models["llama"] / "model.safetensors")
    state.update({f"model.layers.0.self_attn.rotary_emb.extra{i}": torch.zeros(2) for i in range(7)})
    save_file(state, tmp_path / "model.safetensors")
    copy_config(tiny_models["llama"], tmp_path)
    with caplog.at_level(logging.WARNING, logger="blockspec.loader.weights"):
        load_weights(fresh_model(tmp_path), tmp_path, "cpu", torch.float32)
    [record] = caplog.records
    assert "ignored 7 checkpoint tensors" in record.getMessage() and "\n" not in record.getMessage()


def test_missing_parameters_raise(tiny_models, tmp_path):
    state = load_file(tiny_models["llama"] / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"], state["model.norm.weight"]
    save_file(state, tmp_path / "model.safetensors")
    copy_config(tiny_models["llama"], tmp_path)
    with pytest.raises(
        ModelLoadError, match=r"2 model parameters are not in the checkpoint .*model.layers.1.mlp.up_proj"
    ):
        load_weights(fresh_model(tmp_path), tmp_path, "cpu", torch.float32)


def test_shape_mismatch_raises(tiny_models, tmp_path):
    state = load_file(tiny_models["llama"] / "model.safetensors")
    state["model.norm.weight"] = torch.ones(3)
    save_file(state, tmp_path / "model.safetensors")
    copy_config(tiny_models["llama"], tmp_path)
    with pytest.raises(ModelLoadError, match=r"model.norm.weight \(3,\) does not fit the model"):
        load_weights(fresh_model(tmp_path), tmp_path, "cpu", torch.float32)


def test_tied_embeddings(tiny_models, tmp_path):
    src = tiny_models["llama_tied"]
    assert "lm_head.weight" not in load_file(src / "model.safetensors")
    tied = fresh_model(src)  # transformers shares one Parameter between embed_tokens and lm_head
    load_weights(tied, src, "cpu", torch.float32)
    assert_same_weights(tied, hf_model(src))
    # A model that keeps a separate lm_head gets it filled from the embedding when config.json ties them.
    untied = fresh_model(src, tie_word_embeddings=False)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    load_weights(untied, src, "cpu", torch.float32)
    assert torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)
    # Without the tie in config.json, a missing lm_head is an error, not a silent copy.
    save_file(load_file(src / "model.safetensors"), tmp_path / "model.safetensors")
    copy_config(src, tmp_path, tie_word_embeddings=False)
    with pytest.raises(ModelLoadError, match="lm_head.weight"):
        load_weights(fresh_model(src, tie_word_embeddings=False), tmp_path, "cpu", torch.float32)


def test_resolve_directories_and_errors(tiny_models, tmp_path):
    assert resolve_model_path(str(tiny_models["llama"])) == tiny_models["llama"]
    (tmp_path / "weights.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"no config.json in .*it holds weights.gguf: pass that file"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(ModelLoadError, match="not found: pass a local Hugging Face model directory or a .gguf file"):
        resolve_model_path("SomeOrg/some-model")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelLoadError, match="neither a directory nor a .gguf file"):
        resolve_model_path(str(tmp_path / "notes.txt"))


@pytest.fixture()
def tiny_gguf(tiny_models, tmp_path):
    model = hf_model(tiny_models["llama"])
    return write_gguf(
        tmp_path / "tiny-llama.gguf", model.state_dict(), model.config, qtype=gguf.GGMLQuantizationType.Q8_0
    )


def test_gguf_file_is_converted_once(tiny_gguf, tiny_models, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    cache = tmp_path / "cache"
    out = resolve_model_path(str(tiny_gguf), cache_dir=cache)
    assert out.parent == cache / "gguf" and out.name.startswith("tiny-llama-")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert list(cache.joinpath("gguf").iterdir()) == [out]  # no temporary leftovers
    # transformers reads the converted directory; its bf16 weights are our dequantized tensors.
    converted = AutoModelForCausalLM.from_pretrained(out)
    assert converted.dtype == torch.bfloat16
    oracle = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    assert_same_weights(converted, oracle.to(torch.bfloat16))
    # load_weights reads it like any HF directory.
    model = fresh_model(out, dtype=torch.bfloat16)
    load_weights(model, out, "cpu", torch.bfloat16)
    assert_same_weights(model, converted)
    # A second resolve does no work.
    monkeypatch.setattr(gguf_convert, "_write_hf_dir", lambda *a: pytest.fail("converted twice"))
    assert resolve_model_path(str(tiny_gguf), cache_dir=cache) == out


def test_interrupted_conversion_leaves_no_cache(tiny_gguf, tmp_path, monkeypatch):
    real_iter = gguf_convert.iter_gguf_tensors

    def crash_midway(*args, **kwargs):
        for i, item in enumerate(real_iter(*args, **kwargs)):
            if i == 5:
                raise KeyboardInterrupt
            yield item

    monkeypatch.setattr(gguf_convert, "iter_gguf_tensors", crash_midway)
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        resolve_model_path(str(tiny_gguf), cache_dir=cache)
    assert list((cache / "gguf").iterdir()) == []
    monkeypatch.setattr(gguf_convert, "iter_gguf_tensors", real_iter)
    out = resolve_model_path(str(tiny_gguf), cache_dir=cache)
    assert (out / "model.safetensors").is_file()


def test_changed_gguf_gets_a_new_cache_entry(tiny_gguf, tmp_path):
    cache = tmp_path / "cache"
    first = resolve_model_path(str(tiny_gguf), cache_dir=cache)
    tiny_gguf.write_bytes(tiny_gguf.read_bytes() + b"\0" * 64)  # size (and mtime) change
    assert resolve_model_path(str(tiny_gguf), cache_dir=cache) != first


class FusedQKV(torch.nn.Module):
    """A model that stores q/k/v in one parameter: checkpoint names never equal its parameter names."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(12, 4))
        self.norm = torch.nn.Parameter(torch.zeros(4))

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        rows = {"attn.q_proj.weight": 0, "attn.k_proj.weight": 4, "attn.v_proj.weight": 8}
        with torch.no_grad():
            if name in rows:
                self.qkv[rows[name] : rows[name] + 4].copy_(tensor)
            elif name == "final_norm.weight":
                self.norm.copy_(tensor)
            else:
                return False
        return True


def test_fused_parameters_count_as_loaded(tmp_path):
    state = {f"attn.{p}_proj.weight": torch.randn(4, 4) for p in "qkv"}
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"1 model parameters .*\(e.g. norm\)"):
        load_weights(FusedQKV(), tmp_path, "cpu", torch.float32)
    save_file({**state, "final_norm.weight": torch.ones(4)}, tmp_path / "model.safetensors")
    model = FusedQKV()
    load_weights(model, tmp_path, "cpu", torch.float32)
    assert torch.equal(model.qkv, torch.cat([state[f"attn.{p}_proj.weight"] for p in "qkv"]))
