"""Recurrent-state slots for hybrid models: one pair per running sequence, taken and released with its KV blocks.

A Gated DeltaNet layer keeps a fixed-size state per sequence instead of a growing KV cache. The
model holds a pair of slots for each of `max_num_seqs` sequences (allocated here, before the KV cache
is planned, so the planner sees them; why a pair: models/layers/recurrent_state.py);
`SlotBlockAllocator` hands a sequence a pair the first time it gets blocks
(admission) and takes it back whenever its blocks are freed (finish, abort, preemption), so the
scheduler needs no change: it already brackets every sequence's life with `ensure` and `free`.
The scheduler admits at most `max_num_seqs` sequences, so a slot is always free at admission.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

from blockspec.engine.kv_cache import BlockAllocator
from blockspec.engine.sequence import Sequence
from blockspec.models.layers.recurrent_state import SLOTS_PER_SEQUENCE, rollback_mode

if TYPE_CHECKING:
    from blockspec.engine.engine import Engine

log = logging.getLogger("blockspec")


class SlotBlockAllocator(BlockAllocator):
    """KV blocks plus one recurrent-state slot per sequence."""

    def __init__(self, num_blocks: int, block_size: int, num_slots: int) -> None:
        super().__init__(num_blocks, block_size)
        self.num_slots = num_slots
        self._free_slots: deque[int] = deque(range(num_slots))

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def ensure(self, seq: Sequence, num_positions: int) -> bool:
        if seq.state_slot is None and not self._free_slots:
            return False
        if not super().ensure(seq, num_positions):
            return False
        if seq.state_slot is None:
            seq.state_slot = SLOTS_PER_SEQUENCE * self._free_slots.popleft()
        return True

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        if seq.state_slot is not None:
            self._free_slots.append(seq.state_slot // SLOTS_PER_SEQUENCE)
            seq.state_slot = None


def has_recurrent_state(model) -> bool:
    return bool(getattr(model, "has_recurrent_state", False))


def checkpoints_per_slot(num_speculative_tokens: int) -> int:
    """Extra states kept per slot and layer: k + 1 in checkpoint mode (none when replaying, or k = 0)."""
    return num_speculative_tokens + 1 if num_speculative_tokens and rollback_mode() == "checkpoint" else 0


def allocate_state(engine: Engine) -> int:
    """Give a hybrid target its state slots (max_num_seqs of them); returns their bytes (0 otherwise).

    k is the engine's current num_speculative_tokens; `enable_synthetic_drafts` re-sizes through
    `resize_for_k` when it changes k.
    """
    target = engine.runner.target
    if not has_recurrent_state(target):
        engine.state_bytes = 0
        return 0
    engine.state_bytes = target.allocate_state(engine.config.max_num_seqs,
                                               checkpoints_per_slot(engine.num_speculative_tokens))
    return engine.state_bytes


def resize_for_k(engine: Engine, k: int) -> None:
    """Checkpoint mode keeps k + 1 states per slot: re-make the slots when k changes (no sequence running)."""
    target = engine.runner.target
    if has_recurrent_state(target) and checkpoints_per_slot(k) != checkpoints_per_slot(engine.num_speculative_tokens):
        engine.state_bytes = target.allocate_state(engine.config.max_num_seqs, checkpoints_per_slot(k))


def block_allocator(engine: Engine, num_blocks: int) -> BlockAllocator:
    """The engine's allocator: with state slots for hybrid targets, plain KV blocks otherwise."""
    if has_recurrent_state(engine.runner.target):
        return SlotBlockAllocator(num_blocks, engine.config.block_size, engine.config.max_num_seqs)
    return BlockAllocator(num_blocks, engine.config.block_size)


def state_report(engine: Engine) -> str | None:
    """One start-up line on the recurrent state (None for attention-only models)."""
    target = engine.runner.target
    if not has_recurrent_state(target):
        return None
    k = engine.num_speculative_tokens
    ckpt = checkpoints_per_slot(k)
    per_seq = target.state_bytes_per_seq(0)
    how = (f"{ckpt} per-position checkpoints (k + 1) per sequence" if ckpt
           else "verify blocks roll back by replaying accepted tokens" if k else "no speculation")
    return (f"recurrent state: {engine.config.max_num_seqs} sequences x 2 slots (current + next) + a scratch "
            f"pair, {per_seq / 2**20:.1f} MiB each ({len(target.state_layers)} Gated DeltaNet layers, {how}) "
            f"= {engine.state_bytes / 2**20:.1f} MiB")
