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

from blockspec.kernels.decode_inputs import ROW_INPUTS

# Integer inputs of a decode step: name -> length per sequence row (q: tokens per row, m: max blocks).
# The host writes the first group (kernels/decode_inputs.py: ROW_INPUTS, in this order); the
# decode-inputs kernel derives the rest on the device.
SECTIONS = {
    "anchor": 1,  # position of the last committed token
    "token": 1,  # that token
    "ctx_pos0": 1,  # first context position the previous step committed (drafter input)
    "ctx_count": 1,  # how many
    "ctx_row0": 1,  # their first row in the feature buffer
    "state_slot": 1,  # hybrids: the recurrent-state slot the row reads (it commits into slot ^ 1)
    "num_drafts": 1,
    "tables": "m",  # block table row (scratch block for padding and finished rows)
    "tokens": "q",  # anchor, d_1..d_k per row (the draft graph writes the drafts in place)
    "positions": "q",
    "slots": "q",  # KV slot of each verified position (scratch for padding)
    "seq_lens": 1,  # target: anchor + q (queries at the end, causal)
    "kv_start": 1,  # zeros
    "draft_seq_lens": 1,  # drafter: anchor + num_drafts + 1 (non-causal over the exact block)
    "draft_kv_start": 1,  # drafter context window start
    "draft_tokens": "q",  # anchor, MASK * k
    "ctx_rows": "q",  # rows of the feature buffer committed by the previous step (context to project)
    "ctx_positions": "q",
    "ctx_slots": "q",  # scratch where a row has fewer committed positions
}
HOST_SECTIONS = ROW_INPUTS
assert tuple(SECTIONS)[: len(HOST_SECTIONS)] == HOST_SECTIONS, "host-written sections lead the layout"


def capture_graph(fn: Callable[..., object], *args: object, pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm fn(*args) up twice on a side stream (lazy allocations, Triton compiles happen outside the capture),
    then capture one call: the graph and the output tensors it will refresh on every replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn(*args)
    return graph, out


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

    def host_size(self, bp: int) -> int:
        """Elements of the host-written prefix of bucket bp's layout."""
        return sum(self._sizes(bp)[: len(HOST_SECTIONS)])

    def host_views(self, staging: torch.Tensor, bp: int) -> dict[str, torch.Tensor]:
        """The host-written sections of bucket bp laid over a staging tensor (same layout as the device)."""
        sizes = self._sizes(bp)[: len(HOST_SECTIONS)]
        parts = dict(zip(HOST_SECTIONS, torch.split(staging[: sum(sizes)], sizes)))
        parts["tables"] = parts["tables"].view(bp, self.max_blocks)
        return parts

    def upload(self, bp: int, staging: torch.Tensor, first: str = "anchor") -> DecodeViews:
        """One asynchronous copy of the host-written sections from `first` on (staging is pinned on GPU)."""
        v = self.views(bp)
        start = sum(self._sizes(bp)[: HOST_SECTIONS.index(first)])
        end = self.host_size(bp)
        v.flat[start:end].copy_(staging[start:end], non_blocking=True)
        return v

    def output(self, name: str, bp: int) -> object:
        """What the captured graph (name, bp) returns (its static output tensors)."""
        return self._graphs[(name, bp)][1]

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
                self._graphs[(name, bp)] = capture_graph(fn, v, pool=self._pool)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        log(f"captured {len(self._graphs)} CUDA graphs (batch sizes {self.buckets}, {self.q_len} tokens per "
            f"sequence) in {elapsed:.1f} s")
        return elapsed
