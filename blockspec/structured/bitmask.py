"""The grammar masks of a verify batch, and applying them to the target's logits.

Rows are the padded [R, K+1] verified positions of acceptance (runner/acceptance.py). Rows without a
grammar, and positions no grammar decides, allow every token. The masks are filled on the host
(the grammar engine runs there), copied to the logits' device once, and turn disallowed logits into
-inf, so greedy acceptance takes the argmax under the grammar and sampling draws from the masked,
renormalised distribution.
"""

from __future__ import annotations

import torch

from blockspec.engine.sequence import Sequence
from blockspec.structured.matcher import ALL_ALLOWED, bitmask_words


def verify_bitmask(seqs: list[Sequence], tokens_in: torch.Tensor, num_drafts: list[int],
                   vocab_size: int) -> torch.Tensor | None:
    """[R, K+1, words] int32 on the host, or None when no row has a grammar.

    tokens_in [R, K+1] = anchor, d_1..d_K (device); only the rows with a grammar read their drafts back.
    """
    rows = [r for r, seq in enumerate(seqs) if seq.grammar is not None and not seq.grammar.done]
    if not rows:
        return None
    k1 = tokens_in.shape[1]
    drafts = tokens_in[rows, 1:].tolist() if k1 > 1 else [[] for _ in rows]  # the drafts' one host read
    masks = torch.full((len(seqs), k1, bitmask_words(vocab_size)), ALL_ALLOWED, dtype=torch.int32)
    for r, row_drafts in zip(rows, drafts):
        seqs[r].grammar.fill_verify(row_drafts[: num_drafts[r]], masks[r])
    return masks


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Unpack [..., words] int32 bitmasks into [..., vocab_size] booleans on device."""
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (bitmask.to(device)[..., None] >> shifts) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [R, P, V] with the tokens the masks [R, P, words] disallow set to -inf."""
    allowed = allowed_tokens(bitmask, logits.shape[-1], logits.device)
    return torch.where(allowed, logits, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
