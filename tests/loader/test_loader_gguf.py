"""GGUF reading on tiny files written the way llama.cpp writes them, checked against the HF originals."""

import gguf
import numpy as np
import pytest
import torch

from blockspec.loader.errors import ModelLoadError
from blockspec.loader.gguf_loader import gguf_config, gguf_tensor_specs, iter_gguf_tensors, unpermute_qk
from tests.loader.loader_helpers import hf_model, llama_cpp_permute, write_gguf

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def llama(tiny_models):
    return hf_model(tiny_models["llama"])


def test_unpermute_inverts_llama_cpp_permutation():
    weight = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    permuted = llama_cpp_permute(weight, 3)
    assert not np.array_equal(permuted, weight)
    assert torch.equal(unpermute_qk(torch.from_numpy(permuted), 3), torch.from_numpy(weight))
    bias = np.arange(24, dtype=np.float32)
    assert torch.equal(unpermute_qk(torch.from_numpy(llama_cpp_permute(bias, 3)), 3), torch.from_numpy(bias))


def test_llama_f32_round_trip_is_exact(tmp_path, llama):
    state = llama.state_dict()
    path = write_gguf(tmp_path / "tiny.gguf", state, llama.config)
    ours = dict(iter_gguf_tensors(path))
    assert set(ours) == set(state)
    for name, tensor in state.items():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1])
def test_llama_quantized_round_trip(tmp_path, llama, qtype):
    state = llama.state_dict()
    path = write_gguf(tmp_path / f"tiny-{qtype.name}.gguf", state, llama.config, qtype=qtype)
    ours = dict(iter_gguf_tensors(path, dtype=torch.float32))
    step = {Q.Q8_0: 1 / 127, Q.Q4_1: 1 / 15}[qtype]  # quantization step relative to a block's range
    for name, tensor in state.items():
        got = ours[name]
        assert got.shape == tensor.shape and got.dtype == torch.float32
        bound = step * 2 * tensor.abs().max().item() + 1e-6
        assert (got - tensor).abs().max().item() <= bound, name
        # The per-row error would be of the order of the weights themselves if Q/K rows were shuffled.
        assert torch.nn.functional.cosine_similarity(got.flatten(), tensor.flatten(), dim=0) > 0.99, name


def test_llama_matches_transformers_gguf_loading(tmp_path, llama):
    """transformers dequantizes and un-permutes the same file: our tensors must be identical."""
    from transformers import AutoModelForCausalLM

    path = write_gguf(tmp_path / "tiny.gguf", llama.state_dict(), llama.config, qtype=Q.Q8_0)
    oracle = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).state_dict()
    ours = dict(iter_gguf_tensors(path))
    assert set(ours) == set(oracle)
    for name, tensor in ours.items():
        assert torch.equal(tensor, oracle[name]), name


def test_llama_config_matches_hf(tmp_path, llama):
    path = write_gguf(tmp_path / "tiny.gguf", llama.state_dict(), llama.config)
    ours = gguf_config(path)
    cfg = llama.config
    assert ours["architectures"] == ["LlamaForCausalLM"] and ours["model_type"] == "llama"
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "eos_token_id",
    ):
        assert ours[key] == getattr(cfg, key), key
    assert ours["rope_theta"] == cfg.rope_parameters["rope_theta"]
    assert ours["tie_word_embeddings"] is False
    assert ours["torch_dtype"] == "bfloat16"


def test_tied_gguf_has_no_lm_head(tmp_path, tiny_models):
    model = hf_model(tiny_models["llama_tied"])
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    path = write_gguf(tmp_path / "tied.gguf", state, model.config)
    assert gguf_config(path)["tie_word_embeddings"] is True
    assert "lm_head.weight" not in dict(gguf_tensor_specs(path))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_is_not_permuted(tmp_path, tiny_models, arch):
    model = hf_model(tiny_models[arch])
    state = model.state_dict()
    path = write_gguf(tmp_path / f"{arch}.gguf", state, model.config, arch=arch)
    config = gguf_config(path)
    assert config["model_type"] == arch
    assert config["architectures"] == [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]]
    ours = dict(iter_gguf_tensors(path))
    assert set(ours) == set(state)  # qwen2 q/k/v biases, qwen3 q/k norms included
    for name, tensor in state.items():
        assert torch.equal(ours[name], tensor), name


def test_specs_announce_what_iteration_yields(tmp_path, llama):
    path = write_gguf(tmp_path / "tiny.gguf", llama.state_dict(), llama.config, qtype=Q.Q4_1)
    specs = gguf_tensor_specs(path)
    yielded = [(name, tuple(t.shape)) for name, t in iter_gguf_tensors(path, dtype=torch.bfloat16)]
    assert specs == yielded


def test_unsupported_architecture(tmp_path, llama):
    path = write_gguf(tmp_path / "gemma.gguf", llama.state_dict(), llama.config, arch="gemma3")
    with pytest.raises(ModelLoadError, match="architecture 'gemma3' is not supported"):
        gguf_config(path)
    with pytest.raises(ModelLoadError, match="not supported"):
        next(iter_gguf_tensors(path))


def test_unsupported_tensor_type(tmp_path, llama):
    state = dict(llama.state_dict())
    path = tmp_path / "int.gguf"

    def add_int_tensor(writer):
        writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.int8))

    state.pop("model.layers.0.input_layernorm.weight")
    write_gguf(path, state, llama.config, extra=add_int_tensor)
    with pytest.raises(ModelLoadError, match="I8 cannot be dequantized"):
        next(iter_gguf_tensors(path))


def test_unknown_tensor_name(tmp_path, llama):
    path = write_gguf(
        tmp_path / "extra.gguf",
        llama.state_dict(),
        llama.config,
        extra=lambda w: w.add_tensor("blk.0.attn_sinks.weight", np.ones(4, dtype=np.float32)),
    )
    with pytest.raises(ModelLoadError, match="attn_sinks"):
        gguf_tensor_specs(path)


def test_corrupt_and_missing_files(tmp_path, llama):
    with pytest.raises(ModelLoadError, match="does not exist"):
        gguf_config(tmp_path / "nope.gguf")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf at all" * 100)
    with pytest.raises(ModelLoadError, match="corrupt or not a GGUF"):
        gguf_config(garbage)
    good = write_gguf(tmp_path / "tiny.gguf", llama.state_dict(), llama.config)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="corrupt"):
        list(iter_gguf_tensors(truncated))


def test_llama3_rope_freqs_become_rope_scaling(tmp_path, llama):
    from blockspec.loader.gguf_loader import _llama3_divisors

    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    theta, head_dim = llama.config.rope_parameters["rope_theta"], llama.config.head_dim
    freqs = _llama3_divisors(scaling, head_dim, theta).astype(np.float32)
    path = write_gguf(
        tmp_path / "l3.gguf", llama.state_dict(), llama.config, extra=lambda w: w.add_tensor("rope_freqs.weight", freqs)
    )
    assert gguf_config(path)["rope_scaling"] == {"rope_type": "llama3", **scaling}
    assert "rope_freqs.weight" not in {name for name, _ in gguf_tensor_specs(path)}
    odd = tmp_path / "odd.gguf"
    write_gguf(odd, llama.state_dict(), llama.config, extra=lambda w: w.add_tensor("rope_freqs.weight", freqs[::-1]))
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        gguf_config(odd)


def test_missing_metadata(tmp_path):
    path = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="llama.embedding_length is missing"):
        gguf_config(path)
