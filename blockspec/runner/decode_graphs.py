"""Static buffers and CUDA graphs for uniform decode/verify steps.

A decode step of a batch padded to bucket size Bp has fixed shapes: Bp x (k+1) tokens for the target
verify pass and Bp blocks of k+1 for the drafter. All of a step's integer inputs live in one device
buffer with a fixed layout per bucket, filled by a single asynchronous host-to-device copy; the drafter
block pass and the target pass are each one graph replay per step (or plain eager calls with
--enforce-eager). Padded rows point at a scratch KV block that no sequence owns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Integer inputs of a decode step: name -> length per sequence row (q: tokens per row, m: max blocks).
SECTIONS = {
    "tokens": "q",  # anchor, d_1..d_k per row (the draft graph writes the drafts in place)
    "positions": "q",
    "slots": "q",  # KV slot of each verified position (scratch for padding)
    "tables": "m",  # block table row
    "seq_lens": 1,  # target: anchor + q (queries at the end, causal)
    "kv_start": 1,  # zeros
    "draft_seq_lens": 1,  # drafter: anchor + num_drafts + 1 (non-causal over the exact block)
    "draft_kv_start": 1,  # drafter context window start
    "draft_tokens": "q",  # anchor, MASK * k
    "num_drafts": 1,
    "ctx_rows": "q",  # rows of the feature buffer committed by the previous step (context to project)
    "ctx_positions": "q",
    "ctx_slots": "q",  # scratch where a row has fewer committed positions
}


@dataclass
class DecodeViews:
    """Views of the shared input buffer for one bucket (fixed addresses: graphs capture them)."""

    batch: int
    q_len: int
    flat: torch.Tensor  # the whole region, filled by one copy
    parts: dict[str, torch.Tensor]

    def __getattr__(self, name: str) -> torch.Tensor:
        parts = self.__dict__.get("parts", {})
        if name in parts:
            return parts[name]
        raise AttributeError(name)


class DecodeGraphs:
    def __init__(self, device: torch.device, max_batch: int, q_len: int, max_blocks: int, use_graphs: bool) -> None:
        self.device = device
        self.q_len = q_len
        self.max_blocks = max_blocks
        self.use_graphs = use_graphs and device.type == "cuda"
        self.pad = self.use_graphs  # pad batches to bucket sizes (tests may turn it on without graphs)
        self.buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch] + [max_batch]
        self.buffer = torch.zeros(self._total(max_batch), dtype=torch.int64, device=device)
        self._views: dict[int, DecodeViews] = {}
        self._graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, object]] = {}
        self._pool = None

    @staticmethod
    def section_names() -> list[str]:
        return list(SECTIONS)

    def _sizes(self, bp: int) -> list[int]:
        per_row = {"q": self.q_len, "m": self.max_blocks}
        return [bp * per_row.get(n, n) for n in SECTIONS.values()]

    def _total(self, bp: int) -> int:
        return sum(self._sizes(bp))

    def bucket(self, batch: int) -> int:
        if not self.pad:
            return batch
        return next(b for b in self.buckets if b >= batch)

    def views(self, bp: int) -> DecodeViews:
        if bp not in self._views:
            parts = dict(zip(SECTIONS, torch.split(self.buffer[: self._total(bp)], self._sizes(bp))))
            parts["tables"] = parts["tables"].view(bp, self.max_blocks)
            self._views[bp] = DecodeViews(bp, self.q_len, self.buffer[: self._total(bp)], parts)
        return self._views[bp]

    def upload(self, bp: int, host: dict[str, list[int]]) -> DecodeViews:
        """One pinned, asynchronous copy of the step's integers (every section, in SECTIONS order)."""
        v = self.views(bp)
        src = torch.tensor([x for name in SECTIONS for x in host[name]], dtype=torch.int64)
        if self.device.type == "cuda":
            src = src.pin_memory()
        v.flat.copy_(src, non_blocking=True)
        return v

    def run(self, name: str, bp: int, fn: Callable[[DecodeViews], object]) -> object:
        """Replay the captured graph of (name, bucket), or call fn eagerly."""
        if not self.use_graphs:
            return fn(self.views(bp))
        graph, out = self._graphs[(name, bp)]
        graph.replay()
        return out

    @torch.inference_mode()
    def capture(self, fns: dict[str, Callable[[DecodeViews], object]], fill_dummy: Callable[[DecodeViews], None],
                log: Callable[[str], None]) -> float:
        """Capture every (function, bucket) pair, largest bucket first so the pool is sized once."""
        if not self.use_graphs:
            return 0.0
        start = time.perf_counter()
        self._graphs.clear()
        self._pool = torch.cuda.graph_pool_handle()
        for bp in sorted(self.buckets, reverse=True):
            v = self.views(bp)
            for name, fn in fns.items():
                fill_dummy(v)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        fn(v)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    out = fn(v)
                self._graphs[(name, bp)] = (graph, out)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        log(f"captured {len(self._graphs)} CUDA graphs (batch sizes {self.buckets}, {self.q_len} tokens per "
            f"sequence) in {elapsed:.1f} s")
        return elapsed
