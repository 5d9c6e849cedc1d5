"""Per-sequence recurrent state of hybrid models: the step metadata and the per-layer state tensors.

Gated DeltaNet layers carry, for every running sequence, the last (kernel - 1) inputs of their
causal convolution and a [heads, key_dim, value_dim] delta-rule matrix. Each sequence owns one
*slot* of those tensors from admission to finish, abort or preemption (engine/state_pool.py hands
the slots out); the runner describes a step's spans and slots in a `StateMetadata` attached to the
step's AttentionMetadata.

Rolling back a verify block: the committed count is only known after acceptance, so speculative
spans (verify blocks) never advance their slot during the pass. Two ways to land on the state of
the last accepted position afterwards, chosen with BLOCKSPEC_GDN_ROLLBACK:
- "replay" (default): keep the block's per-token inputs and re-run the recurrence over the accepted
  prefix at commit (one state read + write per layer; no extra memory beyond the inputs);
- "checkpoint": store the state after every position of the block (k + 1 states per sequence and
  layer) and copy the accepted one at commit.
The convolution state needs neither: it is a window of the block's inputs, kept until commit.

Each sequence owns a *pair* of physical slots (2i, 2i + 1) and `Sequence.state_slot` names the one
holding its current state. The CUDA-graph decode path (runner/decode_step.py) reads that slot and
writes the committed state into the other one, then the host flips `state_slot`: a pipelined step
that is launched and then dropped (its sequence finished or the batch changed) has only written the
spare slot, so nothing needs undoing. The general path reads and writes `state_slot` in place. One
more pair past the sequences' is the scratch pair that padded rows of a decode batch point at.
Checkpoints (checkpoint mode) are kept per row of a step, not per slot.

Prefix caching adds *snapshot entries* beside the slots: a prefill pass saves the state after chosen
tokens of its spans into them (`StateMetadata.snapshots`, planned by engine/state_pool.py), and a
sequence that starts on a cached prefix has its slot loaded from one before it runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch

from blockspec.errors import ConfigError

ROLLBACK_MODES = ("replay", "checkpoint")


def rollback_mode() -> str:
    mode = os.environ.get("BLOCKSPEC_GDN_ROLLBACK", "replay")
    if mode not in ROLLBACK_MODES:
        raise ConfigError(f"BLOCKSPEC_GDN_ROLLBACK={mode!r}: use one of {', '.join(ROLLBACK_MODES)}")
    return mode


@dataclass
class StateMetadata:
    """One step's sequences as spans of the flat batch, with their state slots.

    starts/lengths: each sequence's contiguous run of tokens in the flat batch, in batch order.
    has_state: False for a sequence's first chunk (start from zeros, not from the slot).
    speculative: verify blocks, whose slot only advances at commit (by the committed count).
    snapshots: per span, (tokens into the span, snapshot entry) after which the pass saves the state
               (non-speculative spans only; empty lists when nothing is saved).
    Device index tensors are built once per step, on first use, and shared by all layers.
    """

    starts: list[int]
    lengths: list[int]
    slots: list[int]
    has_state: list[bool]
    speculative: list[bool]
    device: torch.device
    snapshots: list[list[tuple[int, int]]] | None = None
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def for_items(cls, items: list, offsets: list[int], device: torch.device) -> StateMetadata:
        """From the runner's scheduled items (ScheduledSeq) and their flat offsets."""
        slots = [item.seq.state_slot for item in items]
        if any(s is None for s in slots):
            raise RuntimeError("a sequence reached a hybrid model without a state slot: the engine's "
                               "allocator (engine/state_pool.py) assigns one at admission")
        snapshots = [list(getattr(i, "snapshots", ())) for i in items]
        return cls(starts=list(offsets), lengths=[i.num_new + i.num_drafts for i in items], slots=slots,
                   has_state=[i.seq.num_computed > 0 for i in items], speculative=[i.num_drafts > 0 for i in items],
                   device=device, snapshots=snapshots if any(snapshots) else None)

    @property
    def num_seqs(self) -> int:
        return len(self.slots)

    def tensor(self, key: str, build) -> torch.Tensor:
        """A cached device tensor built from host lists by `build()` (called once per step)."""
        if key not in self._cache:
            self._cache[key] = self._device(*build())
        return self._cache[key]

    def pieces(self, b: int) -> list[tuple[int, int, int | None]]:
        """Span b cut at its snapshot points: (first token, end token, snapshot entry saved at the end or None),
        offsets within the span; one piece when it saves nothing."""
        cuts = sorted(self.snapshots[b]) if self.snapshots else []
        out, start = [], 0
        for offset, entry in cuts:
            out.append((start, offset, entry))
            start = offset
        if start < self.lengths[b]:
            out.append((start, self.lengths[b], None))
        return out

    def piece_rounds(self) -> list[PieceRound]:
        """The pieces as rounds (round r: the r-th piece of every span that has one), for kernels that take
        one ragged batch per call; device tensors built once per step and shared by all layers."""
        if "piece_rounds" not in self._cache:
            pieces = [self.pieces(b) for b in range(self.num_seqs)]
            rounds = []
            for r in range(max(len(p) for p in pieces)):
                spans = [b for b in range(self.num_seqs) if r < len(pieces[b])]
                cuts = [pieces[b][r] for b in spans]
                saves = [(i, entry) for i, (_, _, entry) in enumerate(cuts) if entry is not None]
                tokens = [self.starts[b] + i for b, (a, e, _) in zip(spans, cuts) for i in range(a, e)]
                lengths = [e - a for a, e, _ in cuts]
                rounds.append(PieceRound(
                    tokens=self._device(tokens), spans=self._device(spans),
                    cu_seqlens=self._device(list(accumulate(lengths, initial=0))), longest=max(lengths),
                    saved=self._device([i for i, _ in saves]) if saves else None,
                    entries=self._device([e for _, e in saves]) if saves else None))
            self._cache["piece_rounds"] = rounds
        return self._cache["piece_rounds"]

    def _device(self, values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        host = torch.tensor(values, dtype=dtype)
        return host.to(self.device, non_blocking=True) if self.device.type == "cuda" else host

    def spans(self, speculative: bool | None = None) -> list[int]:
        """Batch indices of the (non-)speculative spans; all of them for None."""
        return [b for b in range(self.num_seqs) if speculative is None or self.speculative[b] == speculative]

    @property
    def slot_t(self) -> torch.Tensor:
        return self.tensor("slots", lambda: (self.slots, torch.int64))

    @property
    def has_state_t(self) -> torch.Tensor:
        return self.tensor("has_state", lambda: (self.has_state, torch.bool))

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self.tensor("cu_seqlens", lambda: (list(accumulate(self.lengths, initial=0)), torch.int64))

    def conv_layout(self, width: int) -> tuple[list[int], list[int]]:
        """Rows of the extended conv input buffer: each span's `width` previous inputs, then its new ones.

        Returns (source rows, span bases): row r of the buffer is row source[r] of
        cat([previous inputs of all spans, flattened], new inputs); span b starts at bases[b].
        """
        key = ("conv_layout", width)
        if key not in self._cache:
            rows, bases, b_count = [], [], self.num_seqs
            for b, (s, n) in enumerate(zip(self.starts, self.lengths)):
                bases.append(len(rows))
                rows.extend(b * width + j for j in range(width))
                rows.extend(b_count * width + s + i for i in range(n))
            self._cache[key] = (rows, bases)
        return self._cache[key]


@dataclass
class PieceRound:
    """One round of `StateMetadata.piece_rounds`: the flat token rows of its pieces, the spans they belong to,
    their cu_seqlens and longest length, and which of them end at a snapshot (row in the round, entry)."""

    tokens: torch.Tensor
    spans: torch.Tensor
    cu_seqlens: torch.Tensor
    longest: int
    saved: torch.Tensor | None
    entries: torch.Tensor | None


SLOTS_PER_SEQUENCE = 2  # the current state and the one a decode step commits into


def physical_slots(max_num_seqs: int) -> int:
    """State slots of a pool for `max_num_seqs` sequences: a pair each, plus the scratch pair."""
    return SLOTS_PER_SEQUENCE * (max_num_seqs + 1)


def scratch_slot(max_num_seqs: int) -> int:
    """The first slot of the scratch pair (padded decode rows read it and write its partner)."""
    return SLOTS_PER_SEQUENCE * max_num_seqs


class LayerState:
    """One Gated DeltaNet layer's state slots (pairs per sequence, see above) and per-row checkpoints."""

    def __init__(self, num_slots: int, conv_dim: int, conv_width: int, heads: int, key_dim: int, value_dim: int,
                 dtype: torch.dtype, state_dtype: torch.dtype, device: torch.device, checkpoints: int,
                 checkpoint_rows: int | None = None, snapshots: int = 0) -> None:
        self.conv = torch.zeros(num_slots, conv_width, conv_dim, dtype=dtype, device=device)
        self.ssm = torch.zeros(num_slots, heads, key_dim, value_dim, dtype=state_dtype, device=device)
        rows = num_slots if checkpoint_rows is None else checkpoint_rows
        self.checkpoints = (torch.zeros(rows, checkpoints, heads, key_dim, value_dim, dtype=state_dtype,
                                        device=device) if checkpoints else None)
        # prefix-cache snapshot entries: the same state, saved at block boundaries of cached prompts
        self.snap_conv = torch.zeros(snapshots, conv_width, conv_dim, dtype=dtype, device=device)
        self.snap_ssm = torch.zeros(snapshots, heads, key_dim, value_dim, dtype=state_dtype, device=device)
        self.pending: Any = None  # what the last pass kept of its speculative spans, until commit

    @property
    def nbytes(self) -> int:
        tensors = [self.conv, self.ssm, self.snap_conv, self.snap_ssm]
        tensors += [self.checkpoints] if self.checkpoints is not None else []
        return sum(t.numel() * t.element_size() for t in tensors)

    def restore(self, slots: torch.Tensor, entries: torch.Tensor) -> None:
        """Load snapshot entries into state slots (sequences starting on a cached prefix)."""
        self.conv[slots] = self.snap_conv[entries]
        self.ssm[slots] = self.snap_ssm[entries]


def state_dtype_of(name: str | None, dtype: torch.dtype) -> torch.dtype:
    """The delta-rule state dtype: the config's `mamba_ssm_dtype`, else float32 (never below it).

    Released Qwen3.5/3.6 checkpoints say float32; a bf16 state loses the small per-token updates.
    """
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    return names.get(name or "float32", torch.float32) if dtype != torch.float32 else torch.float32


def bytes_per_sequence(layers: list, dtype: torch.dtype, checkpoints: int) -> int:
    """One sequence's state across `layers` (GatedDeltaNet modules): what a decode step reads, plus
    `checkpoints` extra delta-rule states per layer (checkpoint mode)."""
    total = 0
    elem = torch.tensor([], dtype=dtype).element_size()
    for layer in layers:
        sdt = torch.tensor([], dtype=state_dtype_of(layer.state_dtype_name, dtype)).element_size()
        matrix = layer.num_v_heads * layer.head_k_dim * layer.head_v_dim * sdt
        total += (layer.conv_kernel - 1) * layer.conv_dim * elem + matrix * (1 + checkpoints)
    return total


def pool_size(plain: int, with_checkpoints: int, max_num_seqs: int, snapshots: int = 0) -> int:
    """The whole pool `allocate_state` makes, from one sequence's state bytes without and with its
    checkpoints (bytes_per_sequence): a slot pair per sequence and the scratch pair, plus the
    checkpoints of max_num_seqs rows, plus the prefix cache's snapshot entries. The planner
    (bench/plan.py) sizes it from config values alone."""
    return (physical_slots(max_num_seqs) + snapshots) * plain + max_num_seqs * (with_checkpoints - plain)


@dataclass
class DecodeStateMetadata:
    """A uniform decode/verify batch on the CUDA-graph path: N rows of q_len tokens each.

    read_slots: [N] the slot each row's state is read from; write_slots: [N] its pair partner, which
    receives the committed state (during the pass when q_len == 1, at `commit_decode` otherwise).
    Fixed shapes for a given (N, q_len), so the pass and its commit can be captured in CUDA graphs.
    `pending` collects, per Gated DeltaNet layer, the verify block's inputs that the commit replays.
    """

    read_slots: torch.Tensor
    write_slots: torch.Tensor
    q_len: int
    pending: list[tuple[Any, tuple[torch.Tensor, ...]]] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return self.read_slots.shape[0]

    @property
    def speculative(self) -> bool:
        return self.q_len > 1
