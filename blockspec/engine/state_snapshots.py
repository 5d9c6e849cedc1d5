"""Which recurrent-state snapshot entry holds the state at the end of which cached block (host side).

A hybrid target's Gated DeltaNet layers cannot start at an arbitrary cached position the way
attention can: they need the recurrent and convolution state as of that position. So while a prompt
is prefilled, the pass also saves its state at chosen block boundaries into snapshot entries (the
tensors live beside the state slots, models/layers/recurrent_state.LayerState), and a later prompt
with the same prefix resumes from the deepest boundary that has both its KV blocks cached and a
snapshot. An entry is keyed like the block that ends at its position (the hash chain names the
whole prefix). A fixed number of entries is shared least recently used; an entry being written in
the current step is registered only after the step, so no sequence can start from it before it holds
the state.
"""

from __future__ import annotations

from collections import OrderedDict

from blockspec.engine.block_hash import BlockHash


class StateSnapshots:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entry: dict[BlockHash, int] = {}
        self._lru: OrderedDict[int, BlockHash | None] = OrderedDict((e, None) for e in range(capacity))
        self._writing: dict[int, BlockHash] = {}  # entries the current step writes, not yet findable
        self.saved = 0  # snapshots registered (for tests and the start-up numbers)

    def __len__(self) -> int:
        return len(self._entry)

    def find(self, key: BlockHash) -> int | None:
        return self._entry.get(key)

    def has(self, key: BlockHash) -> bool:
        return key in self._entry or key in self._writing.values()

    def touch(self, entry: int) -> None:
        self._lru.move_to_end(entry)

    def reserve(self, key: BlockHash) -> int | None:
        """An entry for the current step to write the state for `key` into (the least recently used one
        not being written already), or None when every entry is being written this step."""
        entry = next((e for e in self._lru if e not in self._writing), None)
        if entry is None:
            return None
        old = self._lru[entry]
        if old is not None:
            del self._entry[old]
        self._lru[entry] = None
        self._lru.move_to_end(entry)
        self._writing[entry] = key
        return entry

    def commit(self) -> None:
        """The step ran: its entries now hold their states and may be found."""
        for entry, key in self._writing.items():
            self._entry[key] = entry
            self._lru[entry] = key
            self.saved += 1
        self._writing.clear()

    def abandon(self) -> None:
        """Forget reservations of a step that never ran (their entries stay empty)."""
        self._writing.clear()

    def clear(self) -> None:
        self._entry.clear()
        self._writing.clear()
        for entry in self._lru:
            self._lru[entry] = None
