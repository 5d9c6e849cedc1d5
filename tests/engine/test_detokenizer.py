"""Incremental detokenization: the deltas add up to the full decode, multi-byte characters included."""

from __future__ import annotations

from transformers import AutoTokenizer

from blockspec.engine.detokenizer import IncrementalDetokenizer


def test_deltas_concatenate_to_full_decode(tiny_models):
    tok = AutoTokenizer.from_pretrained(tiny_models["qwen3"])
    text = "héllo wörld — ✓ 日本語 ok"
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("prompt: ", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(t) for t in ids]
    assert "".join(deltas) + detok.flush() == text
    assert all("\ufffd" not in d for d in deltas)  # split UTF-8 sequences are held back, not emitted


def test_real_tokenizer_spaces(default_model):
    tok = AutoTokenizer.from_pretrained(default_model)
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("x = 1\n", add_special_tokens=False))
    assert "".join(detok.add(t) for t in ids) + detok.flush() == text


def test_fast_path_decodes_like_the_tokenizer(default_model):
    """The Rust backend shortcut gives the transformers tokenizer's text, special tokens and bytes included."""
    import torch

    tok = AutoTokenizer.from_pretrained(default_model)
    detok = IncrementalDetokenizer(tok, [])
    assert detok._backend is not None
    ids = torch.randint(0, tok.vocab_size, (300,), generator=torch.Generator().manual_seed(0)).tolist() + [0, 1, 2]
    for skip in (True, False):
        detok.skip_special_tokens = skip
        assert detok._decode(ids) == tok.decode(ids, skip_special_tokens=skip)
