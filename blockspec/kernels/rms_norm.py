"""RMSNorm, optionally fused with the residual add before it: one pass instead of about eight kernels.

Rounding follows the reference exactly: the residual sum is rounded to the activation dtype, the
normalisation runs in float32, the result is rounded before the weight multiply.
"""

from __future__ import annotations

import torch

from blockspec.kernels._triton import HAVE_TRITON, pdl, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from blockspec.kernels._triton import release_dependents, wait_for_inputs

    @triton.jit
    def _rms_norm_kernel(X, R, W, Y, RO, n, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_for_inputs(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(X + row * n + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(R + row * n + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(RO.dtype.element_ty)
            tl.store(RO + row * n + cols, x, mask=mask)
        release_dependents(PDL)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, 0) / n
        y = (xf * tl.rsqrt(var + eps)).to(Y.dtype.element_ty)
        w = tl.load(W + cols, mask=mask, other=0.0)
        tl.store(Y + row * n + cols, (y.to(tl.float32) * w.to(tl.float32)).to(Y.dtype.element_ty), mask=mask)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (normed, new residual); new residual = x + residual when a residual is given."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * y, residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not use_triton(x) or x.dtype != weight.dtype:
        return rms_norm_ref(x, weight, eps, residual)
    n = x.shape[-1]
    x2 = x.contiguous().view(-1, n)
    y = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if residual is not None else None
    r2 = residual.contiguous().view(-1, n) if residual is not None else x2
    on = pdl(x)
    _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, y, res_out if res_out is not None else y, n, eps,
                                     HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n), PDL=on,
                                     num_warps=4, launch_pdl=on)
    return y.view_as(x), (res_out.view_as(x) if res_out is not None else None)
