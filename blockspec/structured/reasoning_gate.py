"""Structured output of a reasoning model: the model thinks freely, the grammar starts after `</think>`.

As in vLLM, with a reasoning parser set, a constrained request's grammar only applies to what follows
the reasoning-end token; the thought itself is unconstrained. Whether the reasoning has already ended
is read from the prompt's tokens (the last of the start and end tokens decides: Qwen3's
`enable_thinking=false` renders `<think>\\n\\n</think>` in the generation prompt, Qwen3.5/3.6 open
`<think>` there; with neither, the model is expected to open its thought itself). In a DFlash verify
block the end token may be one of the drafts: the positions up to and including it stay unmasked,
the ones after it take the grammar's masks from its start state, walked along the drafts after the
end token only. The end token's id comes from the tokenizer (reasoning_tags.py).
"""

from __future__ import annotations

import torch

from blockspec.structured.matcher import ALL_ALLOWED, GrammarMatcher, bitmask_words


class ReasoningGatedGrammar:
    """A sequence's grammar behind its reasoning: the GrammarMatcher interface the engine uses, with
    every position allowed until the end token is committed, and the grammar's masks after it."""

    def __init__(self, matcher: GrammarMatcher, end_id: int, ended: bool) -> None:
        self.matcher = matcher
        self.end_id = end_id
        self.reasoning_ended = ended

    @property
    def done(self) -> bool:
        return self.reasoning_ended and self.matcher.done

    @property
    def complete(self) -> bool:
        return self.reasoning_ended and self.matcher.complete

    def advance(self, token: int) -> None:
        if self.reasoning_ended:
            self.matcher.advance(token)
        elif token == self.end_id:
            self.reasoning_ended = True  # the end token itself is reasoning: the grammar starts after it

    def allowed(self) -> torch.Tensor:
        if self.reasoning_ended:
            return self.matcher.allowed()
        return torch.full((bitmask_words(self.matcher.vocab_size),), ALL_ALLOWED, dtype=torch.int32)

    def fill_verify(self, drafts: list[int], out: torch.Tensor) -> int:
        """As GrammarMatcher.fill_verify; while reasoning, the positions up to the first drafted end token
        keep `out` as it is (all allowed) and the grammar's walk starts right after that draft."""
        if self.reasoning_ended:
            return self.matcher.fill_verify(drafts, out)
        if self.end_id not in drafts:
            return len(drafts)
        j = drafts.index(self.end_id)  # position j verifies draft j; position j + 1 is the grammar's first
        return j + 1 + self.matcher.fill_verify(drafts[j + 1:], out[j + 1:])
