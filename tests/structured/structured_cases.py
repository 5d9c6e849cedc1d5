"""The grammars and prompts the constrained-decoding tests share (importable without the server's
dependencies, so the GPU tests collect in a bare device image)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer
from transformers import AutoTokenizer

from blockspec.structured.spec import StructuredSpec
from tests.conftest import write_tokenizer

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"]}
EMAIL = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
SPECS = {
    "json_schema": StructuredSpec("json_schema", PERSON),
    "regex": StructuredSpec("regex", EMAIL),
    "choice": StructuredSpec("choice", ["yes", "no", "maybe \"so\""]),
    "json_object": StructuredSpec("json_object"),
    "lark": StructuredSpec("grammar", 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9][0-9]?/'),
}
PROMPTS = ["hello world", "The quick brown fox jumps over", "x", "def f(n):\n    return"]

END, START = 272, 273  # </think>, <think>: the tiny qwen3 target emits 272 early and never 273 for PROMPTS


def write_think_tokenizer(out: Path, end_id: int = END, start_id: int = START) -> Path:
    """The byte tokenizer with `</think>` and `<think>` as single (not special) tokens at the given ids,
    reserved tokens filling the ids between its specials and them."""
    write_tokenizer(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    names = {end_id: "</think>", start_id: "<think>"}
    for i in range(tok.get_vocab_size(), max(names) + 1):
        name = names.get(i, f"<|reserved_{i}|>")
        assert tok.add_tokens([AddedToken(name, special=False, normalized=False)]) == 1
        assert tok.token_to_id(name) == i
    fast = AutoTokenizer.from_pretrained(out)
    fast._tokenizer = tok
    fast.save_pretrained(out)
    return out
