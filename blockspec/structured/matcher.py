"""One sequence's position in its grammar: which tokens may come next, at the next position and along drafts.

The matcher holds the state after the sequence's committed output. For a verify step it walks a copy
of that state along the drafts (advance, then roll back), so the target's k + 1 verified positions
each get the mask of the grammar state they would continue from; then the engine advances it by
exactly the committed tokens.
"""

from __future__ import annotations

import numpy as np
import torch
import xgrammar as xgr

ALL_ALLOWED = -1  # int32 with every bit set: a bitmask word that allows all 32 of its tokens


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarMatcher:
    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int) -> None:
        self._m = xgr.GrammarMatcher(compiled)  # unlimited rollback: a verify step walks up to k drafts
        self.vocab_size = vocab_size

    @property
    def done(self) -> bool:
        """The grammar took its stop token: nothing constrains the sequence any more (ignore_eos)."""
        return self._m.is_terminated()

    @property
    def complete(self) -> bool:
        """The output so far is a whole sentence of the grammar (a stop token may come next)."""
        return self._m.is_completed()

    def advance(self, token: int) -> None:
        """Commit one token; the masks guarantee that the grammar accepts it."""
        if not self.done and not self._m.accept_token(token):
            raise RuntimeError(f"the grammar rejected committed token {token}: its mask was not applied")

    def allowed(self) -> torch.Tensor:
        """The next position's bitmask [words] (int32, bit t of word t // 32 set: token t allowed)."""
        out = torch.full((bitmask_words(self.vocab_size),), ALL_ALLOWED, dtype=torch.int32)
        if not self.done:
            self._m.fill_next_token_bitmask(out[None])
        return out

    def fill_verify(self, drafts: list[int], out: torch.Tensor) -> int:
        """Fill out [len(drafts) + 1, words] (CPU int32) with the masks of the positions that follow
        the committed output and each draft prefix; return how many drafts the grammar accepts.

        Positions after the first draft the grammar rejects (or after a stop token) stay as they are
        (all allowed): verification cannot accept past that draft, so their mask is never used.
        """
        if self.done:
            return len(drafts)
        words = out.numpy().view(np.uint32)
        self._m.fill_next_token_bitmask(out, 0)
        walked = 0
        for i, token in enumerate(drafts):
            if not 0 <= token < self.vocab_size or not (words[i, token >> 5] >> (token & 31)) & 1:
                break
            self._m.accept_token(token)
            walked += 1
            if self._m.is_terminated():
                break
            self._m.fill_next_token_bitmask(out, i + 1)
        if walked:
            self._m.rollback(walked)
        return walked
