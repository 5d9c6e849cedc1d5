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
