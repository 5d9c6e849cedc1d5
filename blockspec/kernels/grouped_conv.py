"""DFlash 2's grouped dynamic causal convolution as one kernel: each row of a block mixed with the rows before it
in the same block, tap j weighted per channel by a learned base plus a per-group offset predicted for the row.

spec/dflash2.grouped_conv_ref is the definition (and the CPU path): per tap a shift, a mask, a multiply, an add
and an addcmul, ~8 launches a convolution and four convolutions a drafter layer. Here one program covers one
row and a block of channels, rounding as the definition does in the activation dtype: per tap, the base
product rounded and added (rounded), then the dynamic product added with one rounding (addcmul's).
"""

from __future__ import annotations

import torch

from blockspec.kernels._triton import HAVE_TRITON, pdl

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from blockspec.kernels._triton import release_dependents, wait_for_inputs

    @triton.jit
    def _grouped_conv_kernel(X, DYN, BASE, BIDX, OUT, H, stride_dt, stride_dj, TAPS: tl.constexpr,
                             GROUP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_for_inputs(PDL)
        dtype = OUT.dtype.element_ty
        t = tl.program_id(0).to(tl.int64)
        cs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cs < H
        pos = tl.load(BIDX + t)
        out = tl.zeros([BLOCK], dtype=tl.float32).to(dtype)
        for j in tl.static_range(TAPS):
            inside = mask & (tl.zeros([BLOCK], dtype=tl.int64) + pos >= j)  # no tap across the block's start
            v = tl.load(X + (t - j) * H + cs, mask=inside, other=0.0).to(tl.float32)
            base = tl.load(BASE + j * H + cs, mask=mask, other=0.0).to(dtype).to(tl.float32)  # .to(x.dtype)
            dyn = tl.load(DYN + t * stride_dt + j * stride_dj + cs // GROUP, mask=mask, other=0.0).to(tl.float32)
            out = (out.to(tl.float32) + (base * v).to(dtype).to(tl.float32)).to(dtype)
            out = (out.to(tl.float32) + dyn * v).to(dtype)
        release_dependents(PDL)
        tl.store(OUT + t * H + cs, out, mask=mask)


def grouped_conv_triton(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int,
                        block_index: torch.Tensor) -> torch.Tensor:
    """grouped_conv_ref's contract for a contiguous 2-D x [T, H]; dynamic [T, taps, G] may be a strided view
    (the prepare side's half of the projection), its last dimension contiguous."""
    t, h = x.shape
    out = torch.empty_like(x)
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(h))
    on = pdl(x)
    _grouped_conv_kernel[(t, triton.cdiv(h, block))](
        x, dynamic, base.contiguous(), block_index.contiguous(), out, h, dynamic.stride(0), dynamic.stride(1),
        TAPS=base.shape[0], GROUP=group_size, BLOCK=block, PDL=on, num_warps=4, launch_pdl=on)
    return out
