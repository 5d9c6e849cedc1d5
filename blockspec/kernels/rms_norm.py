"""RMSNorm, optionally fused with the residual add before it: one pass instead of about eight kernels.

Rounding follows the reference exactly: the residual sum is rounded to the activation dtype, the
normalisation runs in float32, the result is rounded before the weight multiply. The zero-centred form
(Qwen3-Next, Qwen3.5: scale 1 + weight) scales in float32 and rounds once, as its module does.
"""

from __future__ import annotations

import torch

from blockspec.kernels._triton import HAVE_TRITON, pdl, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from blockspec.kernels._triton import release_dependents, wait_for_inputs

    @triton.jit
    def _rms_norm_kernel(X, R, W, Y, RO, n, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                         ZERO_CENTERED: tl.constexpr = False, EARLY: tl.constexpr = False):
        if EARLY:  # `releases_early`: the next launch may start before this one's inputs are ready
            release_dependents(PDL)
        wait_for_inputs(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(X + row * n + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(R + row * n + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(RO.dtype.element_ty)
            tl.store(RO + row * n + cols, x, mask=mask)
        if not EARLY:
            release_dependents(PDL)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, 0) / n
        w = tl.load(W + cols, mask=mask, other=0.0)
        if ZERO_CENTERED:
            y = xf * tl.rsqrt(var + eps) * (1.0 + w.to(tl.float32))
        else:
            y = (xf * tl.rsqrt(var + eps)).to(Y.dtype.element_ty).to(tl.float32) * w.to(tl.float32)
        tl.store(Y + row * n + cols, y.to(Y.dtype.element_ty), mask=mask)


def releases_early(rows: int) -> bool:
    """Whether a norm of `rows` rows before a quantized projection (layers/linear.folded_linear) lets that GEMM
    start before the norm's own wait (`_rms_norm_kernel`'s EARLY): its programs are then resident early, and the
    streamed ones load their first weights during the launch before the norm. Only 2 to 16 rows (verify and drafter
    blocks). Qwen3-8B NVFP4 on an H100, batch-1 graph replays: the k = 15 target graph
    4.165 -> 4.107 ms, the one-row AR graph 3.145 -> 3.220 (bench/results/early_release_8b_nvfp4_h100_1e3f9ff.json).
    Before other consumers it lost, so rms_norm leaves it to its caller: the k = 15 graphs of dense bf16 Qwen3-8B
    7.532 -> 7.770 ms, of Qwen3.6-35B-A3B NVFP4 (its MoE and Gated DeltaNet norms) 5.883 -> 6.060
    (bench/results/ab_engine_{8b_bf16,27b_35b_nvfp4}_early_release_h100_330860a.json; with this rule 7.952 -> 7.698
    and 6.166 -> 5.973, ab_engine_{8b_bf16,35b_nvfp4}_norm_rule_h100_330860a.json)."""
    return 2 <= rows <= 16


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (normed, new residual); new residual = x + residual when a residual is given."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    if zero_centered:
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (y * (1.0 + weight.float())).to(x.dtype), residual
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * y, residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             zero_centered: bool = False, release_early: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`zero_centered`: scale by 1 + weight (ZeroCenteredRMSNorm's arithmetic), one program a row.
    `release_early`: let the caller's next launch start before this one's PDL wait (where `releases_early` says
    that measured faster for that launch)."""
    if not use_triton(x) or x.dtype != weight.dtype:
        return rms_norm_ref(x, weight, eps, residual, zero_centered)
    n = x.shape[-1]
    x2 = x.contiguous().view(-1, n)
    y = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if residual is not None else None
    r2 = residual.contiguous().view(-1, n) if residual is not None else x2
    on = pdl(x)
    _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, y, res_out if res_out is not None else y, n, eps,
                                     HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n), PDL=on,
                                     ZERO_CENTERED=zero_centered, EARLY=release_early, num_warps=4,
                                     launch_pdl=on)
    return y.view_as(x), (res_out.view_as(x) if res_out is not None else None)
