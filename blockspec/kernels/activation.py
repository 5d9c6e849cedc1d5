"""SwiGLU on a fused [gate | up] projection: silu(gate) * up in one kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockspec.kernels._triton import HAVE_TRITON, pdl, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from blockspec.kernels._triton import release_dependents, wait_for_inputs

    @triton.jit
    def _silu_mul_kernel(X, Y, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_for_inputs(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(X + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(X + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
        release_dependents(PDL)
        tl.store(Y + row * inter + cols, (g / (1 + tl.exp(-g)) * u).to(Y.dtype.element_ty), mask=mask)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if not use_triton(gate_up):
        return silu_mul_ref(gate_up)
    inter = gate_up.shape[-1] // 2
    x = gate_up.contiguous().view(-1, 2 * inter)
    y = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    block = 1024
    on = pdl(x)
    _silu_mul_kernel[(x.shape[0], triton.cdiv(inter, block))](x, y, inter, BLOCK=block, PDL=on, num_warps=4,
                                                              launch_pdl=on)
    return y.view(*gate_up.shape[:-1], inter)
