"""Prefix-cache keys: every full KV block named by the hash chain of the token ids up to its end.

A block's K/V (the target's and the drafter's context K/V alike) depend on every token before
and inside it, so a block's key is hash(parent block's key, its own token ids): two sequences
share a key only when they share the whole prefix. One engine serves one model with one drafter,
and the engine drops every key when the drafter's use changes (Engine.set_num_speculative_tokens),
so nothing but the tokens needs to enter the key. SHA-256 as in vLLM's default: a collision would
silently hand one prompt another's K/V.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence as Tokens
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from blockspec.engine.sequence import Sequence

BlockHash = bytes
ROOT_HASH: BlockHash = hashlib.sha256(b"blockspec prefix cache").digest()  # the parent of every first block


def hash_block(parent: BlockHash, tokens: Tokens[int]) -> BlockHash:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def block_hashes(seq: Sequence, num_blocks: int, block_size: int) -> list[BlockHash]:
    """The keys of seq's first `num_blocks` full blocks (computed once per block and kept on the sequence,
    which only ever appends tokens)."""
    hashes = seq.block_hashes
    while len(hashes) < num_blocks:
        j = len(hashes)
        hashes.append(hash_block(hashes[-1] if hashes else ROOT_HASH,
                                 seq.token_ids(j * block_size, (j + 1) * block_size)))
    return hashes
