"""The tags of each `--reasoning-parser` and their token ids in a tokenizer (kept free of torch and the
grammar engine, for the command line).

The server's text parser splits the output at the tags; the engine's reasoning gate (reasoning_gate.py)
needs the end tag as one token of the vocabulary, as vLLM's reasoning parsers do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from blockspec.errors import ConfigError

# The tags each --reasoning-parser splits the output at (the server's text parser reads the same table).
REASONING_TAGS = {"qwen3": ("<think>", "</think>"), "deepseek_r1": ("<think>", "</think>")}


def check_reasoning_parser(name: str | None) -> None:
    if name is not None and name not in REASONING_TAGS:
        raise ConfigError(f"--reasoning-parser {name!r} is not supported: use one of {', '.join(REASONING_TAGS)}")


@dataclass(frozen=True)
class ReasoningTokens:
    """The single-token ids of a parser's tags in one tokenizer (start may be missing, end may not)."""

    start_id: int | None
    end_id: int

    def ended_in(self, token_ids: Sequence[int]) -> bool:
        """Whether these tokens (a prompt) leave the model after its reasoning: the last tag decides."""
        for token in reversed(token_ids):
            if token == self.end_id:
                return True
            if token == self.start_id:
                return False
        return False


def reasoning_tokens(tokenizer, parser: str) -> ReasoningTokens | None:
    """The parser's tag ids in the tokenizer's vocabulary; None where the end tag is not one token
    (the gate cannot see it end: the grammar then applies from the first output token)."""
    check_reasoning_parser(parser)
    start_tag, end_tag = REASONING_TAGS[parser]
    vocab = tokenizer.get_vocab()
    end_id = vocab.get(end_tag)
    return None if end_id is None else ReasoningTokens(vocab.get(start_tag), end_id)
