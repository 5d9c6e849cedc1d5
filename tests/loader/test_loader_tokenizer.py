"""Tokenizer, chat template override and eos ids, from local files only."""

import json
import shutil

import pytest
from transformers import PreTrainedTokenizerFast

from blockspec.loader.errors import ModelLoadError
from blockspec.loader.tokenizer import load_eos_token_ids, load_tokenizer, read_chat_template

MESSAGES = [{"role": "user", "content": "hi"}]


def test_loads_fast_tokenizer_with_its_template(tiny_models):
    tok = load_tokenizer(tiny_models["qwen3"])
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert tok.decode(tok.encode("héllo wörld")) == "héllo wörld"
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_from_another_directory(tiny_models, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    tok = load_tokenizer(tmp_path, tokenizer=str(tiny_models["llama"]))
    assert tok.eos_token == "<|im_end|>"


def test_chat_template_override(tiny_models, tmp_path):
    literal = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    tok = load_tokenizer(tiny_models["llama"], chat_template=literal)
    assert tok.apply_chat_template(MESSAGES, tokenize=False) == "[user] hi"
    path = tmp_path / "template.jinja"
    path.write_text("{{ messages[0]['content'] | upper }}")
    tok = load_tokenizer(tiny_models["llama"], chat_template=str(path))
    assert tok.apply_chat_template(MESSAGES, tokenize=False) == "HI"


def test_bad_chat_template_value():
    with pytest.raises(ModelLoadError, match="neither an existing file nor Jinja"):
        read_chat_template("/no/such/template.jinja")
    assert read_chat_template("x" * 5000 + "{{ y }}").endswith("{{ y }}")  # too long to be a file name


def test_no_network_for_unknown_names(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # any attempt would fail slowly or differently
    with pytest.raises(ModelLoadError, match="cannot load a tokenizer from SomeOrg/missing-model"):
        load_tokenizer(tmp_path, tokenizer="SomeOrg/missing-model")
    with pytest.raises(ModelLoadError, match="pass --tokenizer"):
        load_tokenizer(tmp_path)


def test_eos_ids_prefer_generation_config(tiny_models, tmp_path):
    shutil.copytree(tiny_models["llama"], tmp_path / "m")
    model_dir = tmp_path / "m"
    tok = load_tokenizer(model_dir)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, im_end, 7]}))
    assert load_eos_token_ids(model_dir, tok) == [7, im_end]
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert load_eos_token_ids(model_dir, tok) == [5, im_end]  # the tokenizer's eos always stops
    (model_dir / "generation_config.json").unlink()
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "eos_token_id": [3, 4]}))
    assert load_eos_token_ids(model_dir, tok) == [3, 4, im_end]
    (model_dir / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": 9}}))
    assert load_eos_token_ids(model_dir, tok) == [9, im_end]


def test_corrupt_generation_config(tiny_models, tmp_path):
    shutil.copytree(tiny_models["llama"], tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text("{oops")
    tok = load_tokenizer(tmp_path / "m")
    with pytest.raises(ModelLoadError, match="cannot parse .*generation_config.json"):
        load_eos_token_ids(tmp_path / "m", tok)
