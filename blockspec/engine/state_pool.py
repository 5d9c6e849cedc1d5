"""Recurrent-state slots for hybrid models: one pair per running sequence, taken and released with its KV blocks.

A Gated DeltaNet layer keeps a fixed-size state per sequence instead of a growing KV cache. The
model holds a pair of slots for each of `max_num_seqs` sequences (allocated here, before the KV cache
is planned, so the planner sees them; why a pair: models/layers/recurrent_state.py);
`SlotBlockAllocator` hands a sequence a pair the first time it gets blocks
(admission) and takes it back whenever its blocks are freed (finish, abort, preemption), so the
scheduler needs no change: it already brackets every sequence's life with `admit` and `free`.
The scheduler admits at most `max_num_seqs` sequences, so a slot is always free at admission.
With prefix caching the same allocator keeps the state snapshots that let a hybrid start on a
cached prefix (engine/state_snapshots.py).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

from blockspec.engine.block_hash import block_hashes
from blockspec.engine.kv_cache import BlockAllocator, PrefixHit
from blockspec.engine.sequence import Sequence
from blockspec.engine.state_snapshots import StateSnapshots
from blockspec.models.layers.recurrent_state import SLOTS_PER_SEQUENCE, rollback_mode

if TYPE_CHECKING:
    from blockspec.engine.engine import Engine

log = logging.getLogger("blockspec")


class SlotBlockAllocator(BlockAllocator):
    """KV blocks plus one recurrent-state slot per sequence, and the state snapshots of cached prefixes.

    With prefix caching a hit must also restore the Gated DeltaNet state at its position, so a hybrid
    resumes from the deepest matched block boundary that has a snapshot (engine/state_snapshots.py).
    Snapshots are planned for prefill chunks at every `snapshot_interval` tokens of the prompt and at
    its last full blocks (where the next turn of a conversation, or the same prompt again, resumes).
    """

    def __init__(self, num_blocks: int, block_size: int, num_slots: int, enable_caching: bool = False,
                 snapshots: StateSnapshots | None = None, snapshot_interval: int = 0) -> None:
        super().__init__(num_blocks, block_size, enable_caching)
        self.num_slots = num_slots
        self._free_slots: deque[int] = deque(range(num_slots))
        self.snapshots = snapshots if enable_caching and snapshot_interval else None
        self.snapshot_interval = snapshot_interval

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def _claim_slot(self, seq: Sequence) -> None:
        if seq.state_slot is None:
            seq.state_slot = SLOTS_PER_SEQUENCE * self._free_slots.popleft()

    def ensure(self, seq: Sequence, num_positions: int) -> bool:
        if seq.state_slot is None and not self._free_slots:
            return False
        if not super().ensure(seq, num_positions):
            return False
        self._claim_slot(seq)
        return True

    def admit(self, seq: Sequence, hit: PrefixHit, num_positions: int) -> bool:
        if seq.state_slot is None and not self._free_slots:
            return False
        if not super().admit(seq, hit, num_positions):
            return False
        self._claim_slot(seq)
        if hit.snapshot is not None and self.snapshots is not None:
            seq.restore_snapshot = hit.snapshot  # the runner loads it into the slot before the step
            self.snapshots.touch(hit.snapshot)
        return True

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        seq.restore_snapshot = None
        if seq.state_slot is not None:
            self._free_slots.append(seq.state_slot // SLOTS_PER_SEQUENCE)
            seq.state_slot = None

    # ---- snapshots ----------------------------------------------------------------------------

    def _usable(self, seq: Sequence, blocks: list[int]) -> PrefixHit:
        """The deepest prefix of the matched blocks whose end has a state snapshot (none: no hit)."""
        if self.snapshots is not None:
            for j in range(len(blocks), 0, -1):
                entry = self.snapshots.find(seq.block_hashes[j - 1])
                if entry is not None:
                    return PrefixHit(blocks[:j], self.block_size, entry)
        return PrefixHit(block_size=self.block_size)

    def snapshot_points(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Positions in (start, end] where a prefill chunk saves its state: multiples of the interval inside
        the prompt, and the prompt's last full-block boundaries (its own end for the next turn, one block
        short of it for the same prompt again: a hit leaves at least one token to compute)."""
        bs, n = self.block_size, len(seq.prompt_ids)
        tails = {n // bs * bs, (n - 1) // bs * bs}
        first = start // bs * bs + bs
        return [p for p in range(first, min(end, n) + 1, bs) if p % self.snapshot_interval == 0 or p in tails]

    def plan_step(self, items: list) -> None:
        """Reserve snapshot entries for the prefill chunks about to run (recorded in item.snapshots)."""
        snaps = self.snapshots
        if snaps is None:
            return
        snaps.abandon()  # a step that raised never registered its reservations
        for item in items:
            if item.num_drafts or item.num_new < 2:  # verify blocks and single tokens: no snapshots
                continue
            seq, start = item.seq, item.seq.num_computed
            points = self.snapshot_points(seq, start, start + item.num_new)[-snaps.capacity:]  # the deepest
            keys = block_hashes(seq, points[-1] // self.block_size, self.block_size) if points else []
            for p in points:
                key = keys[p // self.block_size - 1]
                if snaps.has(key):
                    continue
                entry = snaps.reserve(key)
                if entry is None:
                    break
                item.snapshots.append((p - start, entry))

    def step_done(self, seqs: list[Sequence]) -> None:
        super().step_done(seqs)
        if self.snapshots is not None:
            self.snapshots.commit()

    def reset_cache(self) -> None:
        super().reset_cache()
        if self.snapshots is not None:
            self.snapshots.clear()


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
                                               checkpoints_per_slot(engine.num_speculative_tokens),
                                               engine.config.num_state_snapshots())
    return engine.state_bytes


def resize_for_k(engine: Engine, k: int) -> None:
    """Checkpoint mode keeps k + 1 states per slot: re-make the slots when k changes (no sequence running)."""
    target = engine.runner.target
    if has_recurrent_state(target) and checkpoints_per_slot(k) != checkpoints_per_slot(engine.num_speculative_tokens):
        engine.state_bytes = target.allocate_state(engine.config.max_num_seqs, checkpoints_per_slot(k),
                                                   engine.config.num_state_snapshots())


def block_allocator(engine: Engine, num_blocks: int) -> BlockAllocator:
    """The engine's allocator: with state slots (and snapshots) for hybrid targets, plain KV blocks otherwise."""
    cfg = engine.config
    if has_recurrent_state(engine.runner.target):
        snapshots = StateSnapshots(cfg.num_state_snapshots())
        return SlotBlockAllocator(num_blocks, cfg.block_size, cfg.max_num_seqs, cfg.enable_prefix_caching, snapshots,
                                  cfg.snapshot_interval())
    return BlockAllocator(num_blocks, cfg.block_size, cfg.enable_prefix_caching)


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
    cfg = engine.config
    snapshots = cfg.num_state_snapshots()
    cached = (f" + {snapshots} prefix-cache snapshots (every {cfg.snapshot_interval()} prompt tokens and at prompt "
              f"ends; --mamba-cache-snapshots, --mamba-block-size) = {snapshots * per_seq / 2**20:.1f} MiB"
              if snapshots else "")
    return (f"recurrent state: {cfg.max_num_seqs} sequences x 2 slots (current + next) + a scratch "
            f"pair, {per_seq / 2**20:.1f} MiB each ({len(target.state_layers)} Gated DeltaNet layers, {how})"
            f"{cached}; {engine.state_bytes / 2**20:.1f} MiB in all")
