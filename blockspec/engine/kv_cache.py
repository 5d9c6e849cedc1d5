"""Paged KV-cache bookkeeping: fixed-size blocks handed out from a free list.

The cache tensors themselves belong to the model runner; this module only decides which blocks a
sequence owns. The drafter's context cache shares the target's block tables (one slot per token
position in both), so one allocator serves both.
"""

from __future__ import annotations

from collections import deque

from blockspec.engine.sequence import Sequence


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks if self.num_blocks else 0.0

    def blocks_needed(self, seq: Sequence, num_positions: int) -> int:
        """Blocks `seq` lacks to hold positions [0, num_positions)."""
        return max(0, -(-num_positions // self.block_size) - len(seq.block_table))

    def ensure(self, seq: Sequence, num_positions: int) -> bool:
        """Grow `seq`'s block table to cover num_positions; False (and no change) if blocks run out."""
        need = self.blocks_needed(seq, num_positions)
        if need > len(self._free):
            return False
        seq.block_table.extend(self._free.popleft() for _ in range(need))
        return True

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []
