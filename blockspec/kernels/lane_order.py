"""NVFP4 layers stored in the mma kernels' lane order: each 128-weight block of a row's K permuted at load.

Why: the 1-16-row mma kernels (quant_gemv) give lane t of a weight row the 16 bytes 16 t .. 16 t + 15 of each
64-byte span and load beside them the x pairs of the same K columns, 64 contiguous bytes of x a lane; so each of a
lane's four 16-byte x loads has a token's 4 lanes in two 128-byte lines. At 16 rows x is 4 bytes a weight byte and
those lines are what it costs: stored in lane order, lane t's 16 bytes are the original bytes 8 s .. 8 s + 7 and
32 + 8 s .. 32 + 8 s + 7 (s = t xor 3) and its two scale groups s and 4 + s, so its x pairs sit in two runs of 32
bytes and a token's 4 lanes read 64 bytes of one line a load. The kernels load weights and scales as before and x
at the original columns (`lane_cols`). Qwen3-8B NVFP4 on an H200 (bench/quant_gemv.py --x-line, NOTES session
42), 16 rows: q|k|v 12.5 -> 9.3 us, o 9.2 -> 7.7, gate|up 32.0 -> 30.5, down unchanged.

A lane-order layer holds the NVFP4 layout of W[:, pi] for a permutation pi of K within each block of 128 weights
(`source_columns`): every reader of its bytes maps stored column j to original column pi(j) for x (and a folded
norm weight), and dequantize() puts the columns back (`restore_columns`), so the reference path, the oracles and
the prefill path see W itself. s = t xor 3 rather than t keeps the lanes' scale loads from looking contiguous to
Triton, which would lay them out along t and convert them through shared memory (and, unlike 3 t mod 4, compiles
the one-row K-split launch without a spill under Triton 3.9).
"""

from __future__ import annotations

import os

import torch

from blockspec.errors import ConfigError
from blockspec.kernels._triton import HAVE_TRITON, INTERPRET

BLOCK = 128  # weights a permuted block: one 64-byte span of the mma kernels
_SPAN_BYTES = BLOCK // 2
_GROUPS = BLOCK // 16  # NVFP4 scale groups a block


def _lane_group(t: torch.Tensor) -> torch.Tensor:
    return t ^ 3


def source_bytes() -> torch.Tensor:
    """For each stored byte q of a 64-byte span, the original byte it holds (int64 [64])."""
    q = torch.arange(_SPAN_BYTES)
    return 8 * _lane_group(q // 16) + q % 8 + 32 * ((q // 8) % 2)


def source_groups() -> torch.Tensor:
    """For each stored scale group u of a span (8 bytes each), the original group it holds (int64 [8])."""
    u = torch.arange(_GROUPS)
    return _lane_group(u // 2) + 4 * (u % 2)


def source_columns(k: int) -> torch.Tensor:
    """pi: for each stored weight column j of a K-wide row, the original column it holds (int64 [k])."""
    j = torch.arange(k)
    q = source_bytes()[(j % BLOCK) // 2]
    return j - j % BLOCK + 2 * q + j % 2


def fits(layer) -> bool:
    """A layer the lane order applies to: a dense NVFP4 QuantLinear without an act-order permutation, K a multiple
    of 128 (the mma kernels' span), its bytes and scales [N, K / 2] and [N, K / 16] and contiguous."""
    if getattr(layer, "scheme", None) != "nvfp4" or getattr(layer, "lane_order", False) \
            or getattr(layer, "perm", None) is not None:
        return False
    q, s, k = layer.qweight, layer.scales, layer.in_features
    return (k % BLOCK == 0 and q.dim() == 2 and tuple(s.shape) == (q.shape[0], k // 16) and q.shape[1] == k // 2
            and q.is_contiguous() and s.is_contiguous())


@torch.no_grad()
def to_lane_order(layer) -> None:
    """Permute a layer's weight bytes and scales in place into lane order and mark it (a temporary of the layer's
    size meanwhile, small beside the model)."""
    if not fits(layer):
        raise ValueError(f"{type(layer).__name__} ({getattr(layer, 'scheme', None)}) does not take the lane order")
    q, s = layer.qweight, layer.scales
    n = q.shape[0]
    q.copy_(q.view(n, -1, _SPAN_BYTES).index_select(-1, source_bytes().to(q.device)).view(q.shape))
    s8 = s.view(torch.uint8)
    s8.copy_(s8.view(n, -1, _GROUPS).index_select(-1, source_groups().to(s.device)).view(s8.shape))
    layer.lane_order = True


def order_model(model: torch.nn.Module) -> int:
    """Store a loaded model's dense NVFP4 layers on a GPU in lane order (QuantLinear-like modules: a `lane_order`
    attribute, `fits`), bar a shared expert's, which the MoE kernels read as one more routed expert in the experts'
    own order; returns how many. BLOCKSPEC_LANE_ORDER=off keeps the checkpoint's order (bench/env_variants.py
    times both). The engine calls it after loading, except with --deterministic, whose one launch a layer is
    quant_linear's dot path: lane order only helps the 1-16-row mma kernels."""
    switch = os.environ.get("BLOCKSPEC_LANE_ORDER", "on")
    if switch not in ("on", "off"):
        raise ConfigError(f"BLOCKSPEC_LANE_ORDER={switch!r}: use on or off")
    if switch == "off" or not HAVE_TRITON or INTERPRET:
        return 0
    shared = {id(m) for block in model.modules() if getattr(block, "shared_expert", None) is not None
              for m in block.shared_expert.modules()}
    done = 0
    for module in model.modules():
        if hasattr(module, "lane_order") and id(module) not in shared and fits(module) and module.qweight.is_cuda:
            to_lane_order(module)
            done += 1
    return done


def restore_columns(w: torch.Tensor) -> torch.Tensor:
    """A lane-order layer's dequantized weight [..., N, K] with its columns back in the original order."""
    return w.index_select(-1, torch.argsort(source_columns(w.shape[-1])).to(w.device))


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def lane_cols(c, RUN: tl.constexpr):
        """The original column of stored column c, for the kernels' x (and norm weight) loads. RUN: the units of c
        a lane's run holds, 8 where c counts bytes (x pairs: the mma kernels) and 16 where it counts weights (x
        elements); a block is 8 runs. `source_columns` in Triton, contiguous in runs, so x loads stay vectors."""
        # (c // (8 RUN)) 8 RUN + RUN s + c % RUN + 4 RUN h, s = 3 - t (t xor 3): written with divisions, remainders
        # and a subtraction from a constant so that Triton's axis analysis still sees runs of RUN contiguous columns
        # (an xor, or c minus its remainder, reads as no contiguity at all: scalar x loads in another layout, which
        # the rows kernel's lane mapping cannot take)
        return ((c // (8 * RUN)) * (8 * RUN) + RUN * (3 - (c // (2 * RUN)) % 4) + c % RUN
                + 4 * RUN * ((c // RUN) % 2))
