"""Weights pulled into L2 while HBM sits idle, ahead of the GEMM that reads them.

A decode step at batch 1 alternates GEMMs that stream weights at full HBM bandwidth with kernels that read almost
nothing from it: rope, decode attention and its split merge, RMSNorms, the Gated DeltaNet recurrence (~10-14 us a
Qwen3-8B layer at context 1024). With 4-bit weights a layer's GEMMs read only ~100 MB, so those idle microseconds
are a large share of the step. A prefetch launched on a side stream when such a phase starts moves the next
GEMMs' weights into L2 (50 MB on an H100) during it, and the GEMM then reads them from L2.

The kernel issues `cp.async.bulk.prefetch.L2` (sm_90+): one instruction a 16-byte-aligned chunk, handed to the
SM's bulk-copy unit; the thread moves on, so a few programs queue megabytes and exit. Nothing is written, so the
side stream needs no ordering against the main one beyond its fork point (the weights do not change while a step
runs). Older GPUs, the interpreter and CPU tensors get no prefetch (`available`).
"""

from __future__ import annotations

import functools
import os

import torch

from blockspec.device import cuda_capability
from blockspec.kernels._triton import HAVE_TRITON, INTERPRET

CHUNK_BYTES = 32 * 1024  # one bulk prefetch instruction: the chunks spread a tensor over many SMs' copy units
CHUNKS_PER_PROGRAM = 32  # a warp's lanes, one chunk each: 1 MB a program


def enabled() -> bool:
    """BLOCKSPEC_L2_PREFETCH=0 turns the prefetches off (A/B measurements)."""
    return os.environ.get("BLOCKSPEC_L2_PREFETCH", "1") != "0"


@functools.cache
def _capable(index: int) -> bool:
    return cuda_capability(torch.device("cuda", index)) >= (9, 0)


def available(t: torch.Tensor) -> bool:
    """Whether prefetches run for tensors like t: a CUDA tensor on sm_90+, Triton compiled (not interpreted)."""
    return (HAVE_TRITON and not INTERPRET and t.is_cuda and enabled()
            and _capable(t.device.index if t.device.index is not None else torch.cuda.current_device()))


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr):
        # base: the tensor's address as an int64 (a CUDA graph replays it as captured: weights stay put).
        # Chunk sizes are multiples of 16 (the instruction's rule): nbytes is rounded down by the caller.
        offs = (tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)).to(tl.int64) * CHUNK
        size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32)
        size = tl.where(size > 0, size, 0)
        tl.inline_asm_elementwise(
            "{\n.reg .pred p;\nsetp.gt.s32 p, $2, 0;\n@p cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.b32 $0, 0;\n}",
            "=r,l,r", [base + offs, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_tensor(t: torch.Tensor) -> None:
    """Queue t's bytes for L2 on the current stream (a no-op where `available` is False)."""
    nbytes = (t.numel() * t.element_size()) & ~15
    if nbytes == 0 or not available(t) or t.data_ptr() % 16:
        return
    per = CHUNK_BYTES * CHUNKS_PER_PROGRAM
    _prefetch_kernel[(triton.cdiv(nbytes, per),)](t.data_ptr(), nbytes, CHUNK=CHUNK_BYTES,
                                                   PER_PROGRAM=CHUNKS_PER_PROGRAM, num_warps=1)


# ---- the side stream --------------------------------------------------------------------------------------
# Prefetches run only inside CUDA-graph captures: there the fork and join are two graph edges, free at replay;
# eagerly every fork would cost host time for a step that is launch-bound anyway. capture_graph joins after the
# captured call (runner/decode_graphs.py), which a capture requires of every forked stream.

_side: dict[int, torch.cuda.Stream] = {}


def budget_bytes(device: torch.device) -> int:
    """Bytes queued a phase: half the L2 (BLOCKSPEC_L2_PREFETCH_MB overrides), so that what a GEMM finds there
    is not pushed out by the prefetch itself and the other kernels' traffic before the GEMM reads it."""
    mb = os.environ.get("BLOCKSPEC_L2_PREFETCH_MB")
    if mb is not None:
        return int(float(mb) * (1 << 20))
    return torch.cuda.get_device_properties(device).L2_cache_size // 2


def weight_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """What a projection's GEMM streams, scales first (every program of a quantized GEMM reads them; the weight
    rows are read in program order, so a budget cut keeps the rows the first wave reads). A plain layer's
    `weight`, or a quantized layer's (models/layers/quant_linear.py) scales, zeros and packed weights."""
    qweight = getattr(module, "qweight", None)
    if qweight is None:
        weight = getattr(module, "weight", None)
        return [weight] if isinstance(weight, torch.Tensor) else []
    packed = getattr(module, "scale_zero", None)  # int4 with 16-bit scales: scales and zeros are views of it
    scales = [packed] if packed is not None else [getattr(module, "scales", None), getattr(module, "zeros", None)]
    return [t for t in scales if t is not None] + [qweight]


def prefetch_ahead(modules: list[torch.nn.Module], like: torch.Tensor) -> None:
    """Fork a side stream from like's stream and queue the modules' weights for L2, within the budget; the
    caller's stream goes on at once (call this where it starts a phase that reads little from HBM)."""
    if not (available(like) and torch.cuda.is_current_stream_capturing()):
        return
    index = like.device.index if like.device.index is not None else torch.cuda.current_device()
    side = _side.get(index)
    if side is None:
        side = _side[index] = torch.cuda.Stream(like.device)
    side.wait_stream(torch.cuda.current_stream(like.device))
    left = budget_bytes(like.device)
    with torch.cuda.stream(side):
        for module in modules:
            for t in weight_tensors(module):
                if left <= 0:
                    return
                if not t.is_contiguous():
                    continue
                flat = t.reshape(-1).view(torch.uint8)
                prefetch_tensor(flat[:left])
                left -= flat.numel()


def join() -> None:
    """Every device's current stream waits for its side stream (a capture must end with its forks joined)."""
    for index, side in _side.items():
        torch.cuda.current_stream(torch.device("cuda", index)).wait_stream(side)
