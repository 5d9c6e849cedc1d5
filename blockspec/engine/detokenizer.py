"""Incremental detokenization: text deltas that never split a multi-byte character.

Decoding a growing window (a few tokens of left context, then the new ones) rather than single
tokens keeps tokenizers that attach spaces or merge bytes across tokens correct.
"""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        # The Rust tokenizer directly: the transformers wrapper costs ~10x the decode itself, twice per token.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if backend is not None and not getattr(
            tokenizer, "clean_up_tokenization_spaces", False) else None
        self.skip_special_tokens = skip_special_tokens
        tail = prompt_ids[-(_CONTEXT_TOKENS + 1):]
        self.ids: list[int] = list(tail)
        self.prefix_offset = max(len(tail) - _CONTEXT_TOKENS, 0)
        self.read_offset = len(tail)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (may be empty while a character is split)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is still held back (a dangling partial character) at the end of a request."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
