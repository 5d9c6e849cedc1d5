"""CUDA graphs for one sequence's short prefill: a prefix-cache hit's new turn, a short prompt.

An eager prefill launches ~500 kernels for a Qwen3-8B-shaped target, and on the hosts these GPUs come with
each costs 15-40 us of Python and driver time: a 6,000-token hit with a 200-token turn ran ~12 ms of kernels
in a 24-34 ms TTFT, the GPU idle two thirds of it. Agents send exactly these requests every turn. So one
sequence's prefill of up to 512 new tokens replays a graph captured for the next bucket of tokens (32, 64, ...
512), as a decode step does: the same target forward over the paged cache, its attention the paged kernel that
reads keys through the block table (graph-safe for any context length; on that hit within ~30% of flash
attention's GPU time, far below the host time it saves).

Padding: a bucket of P rows holds the T real tokens first. Queries sit at positions start .. start + P - 1
(seq_len = start + P), so every real query sees exactly its own causal prefix; the P - T padding rows write
their K/V into the scratch block, and the block table points every position past the real tokens at it.
Their outputs are never read. MoE blocks route every token on its own, so padding rows only add expert work.
Models whose layers keep recurrent state (Gated DeltaNet hybrids) stay on the eager path: a padded row would
advance the state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from blockspec.models.layers.attention import AttentionMetadata, DecodeMetadata, forward_context
from blockspec.runner.decode_graphs import capture_graph

if TYPE_CHECKING:
    from blockspec.engine.scheduler import ScheduledSeq
    from blockspec.runner.model_runner import ModelRunner

PREFILL_BUCKETS = (32, 64, 128, 256, 512)


@dataclass
class PrefillInputs:
    """One bucket's views of the input buffer (fixed addresses: the graph reads them)."""

    flat: torch.Tensor
    tokens: torch.Tensor  # [P]
    positions: torch.Tensor  # [P]
    slots: torch.Tensor  # [P] KV slot of each row (scratch for padding)
    table: torch.Tensor  # [1, max_blocks]
    seq_len: torch.Tensor  # [1] start + P
    kv_start: torch.Tensor  # [1] zero


def graph_prefill_supported(target: torch.nn.Module) -> bool:
    """Whether every layer of the target computes each row on its own, with no state carried between rows
    outside the paged KV cache (see the module docstring)."""
    return bool(getattr(target, "prefill_graph_safe", False)) and not getattr(target, "has_recurrent_state", False)


class PrefillGraphs:
    """use_graphs=False runs the same padded forward eagerly (any device): what the CPU tests check the padding
    against, the graphs being captures of exactly that function."""

    def __init__(self, runner: ModelRunner, max_tokens: int, max_model_len: int, use_graphs: bool = True) -> None:
        self.r = runner
        self.use_graphs = use_graphs
        self.buckets = [b for b in PREFILL_BUCKETS if b <= max_tokens]
        self.max_blocks = -(-(max_model_len + PREFILL_BUCKETS[-1]) // runner.block_size)
        top = self.buckets[-1] if self.buckets else 0
        cuda = runner.device.type == "cuda"
        self.buffer = torch.zeros(3 * top + self.max_blocks + 2, dtype=torch.int64, device=runner.device)
        self.staging = torch.zeros(self.buffer.shape[0], dtype=torch.int64, pin_memory=cuda)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, object]] = {}
        self._layer_ids: tuple[int, ...] = runner.needs.layer_ids
        # the staging buffer's last upload (chunked prefills may not sync between steps)
        self._copied = torch.cuda.Event() if cuda else None
        self.replays = 0

    def _split(self, flat: torch.Tensor, p: int) -> PrefillInputs:
        tokens, positions, slots, table, seq_len, kv_start = torch.split(
            flat[: 3 * p + self.max_blocks + 2], [p, p, p, self.max_blocks, 1, 1])
        return PrefillInputs(flat[: 3 * p + self.max_blocks + 2], tokens, positions, slots, table.view(1, -1),
                             seq_len, kv_start)

    def bucket(self, items: list[ScheduledSeq]) -> int | None:
        """The bucket one step takes, or None for the eager path (several sequences, drafts, too many tokens)."""
        if (self.use_graphs and not self._graphs) or len(items) != 1 or items[0].num_drafts:
            return None
        n = items[0].num_new
        return next((b for b in self.buckets if b >= n), None)

    def _forward(self, v: PrefillInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        meta = AttentionMetadata(slot_mapping=v.slots,
                                 decode=DecodeMetadata(v.table, v.seq_len, v.kv_start, v.tokens.shape[0]))
        with forward_context(meta):
            return self.r.target(v.tokens, v.positions, self._layer_ids)

    def _fill(self, staging: PrefillInputs, p: int, table: list[int], start: int, tokens: list[int]) -> None:
        r, bs, t = self.r, self.r.block_size, len(tokens)
        scratch = r.scratch_block
        rows = torch.arange(p)
        staging.tokens[:t] = torch.tensor(tokens)
        staging.tokens[t:] = 0
        staging.positions.copy_(torch.clamp(start + rows, max=start + max(t, 1) - 1))  # padding repeats the last
        real_blocks = -(-(start + t) // bs)
        staging.table.fill_(scratch)
        staging.table[0, :real_blocks] = torch.tensor(table[:real_blocks])
        pos = start + rows[:t]
        staging.slots[:t] = staging.table[0, pos // bs] * bs + pos % bs
        staging.slots[t:] = scratch * bs + rows[t:] % bs
        staging.seq_len.fill_(start + p)
        staging.kv_start.zero_()

    def run(self, items: list[ScheduledSeq], p: int, tokens: list[int]
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Replay bucket p's graph for the one prefilling sequence: (hidden [T, H], captured layers [T, F] or
        None, the step's token ids [T]), all views of the graph's buffers valid until the next replay."""
        seq = items[0].seq
        t = len(tokens)
        staging = self._split(self.staging, p)
        if self._copied is not None:
            self._copied.synchronize()
        self._fill(staging, p, seq.block_table, seq.num_computed, tokens)
        v = self._split(self.buffer, p)
        v.flat.copy_(staging.flat, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if self.use_graphs:
            graph, (hidden, features) = self._graphs[p]
            graph.replay()
        else:
            hidden, features = self._forward(v)
        self.replays += 1
        return hidden[:t], (features[:t] if features is not None else None), v.tokens[:t]

    @torch.inference_mode()
    def capture(self, layer_ids: tuple[int, ...], log: Callable[[str], None]) -> float:
        """Capture every bucket, largest first (one memory pool), on all-padding inputs. A capture that fails
        leaves short prefills on the eager path (logged), never a failed start-up."""
        self._graphs.clear()
        self._layer_ids = tuple(layer_ids)
        if not self.buckets or not self.use_graphs:
            return 0.0
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        try:
            for p in sorted(self.buckets, reverse=True):
                v = self._split(self.buffer, p)
                staging = self._split(self.staging, p)
                self._fill(staging, p, [], 0, [])
                v.flat.copy_(staging.flat)
                self._graphs[p] = capture_graph(self._forward, v, pool=pool)
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            self._graphs.clear()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            log(f"prefill CUDA graphs not captured ({type(exc).__name__}: {str(exc)[:200]}): short prefills run "
                "eagerly")
            return time.perf_counter() - start
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        log(f"captured {len(self._graphs)} prefill CUDA graphs (one sequence, up to {self.buckets[-1]} new tokens: "
            f"buckets {self.buckets}) in {elapsed:.1f} s")
        return elapsed
