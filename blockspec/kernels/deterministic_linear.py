"""Batch-invariant GEMM for --deterministic: each output row's arithmetic is the same whatever else is in the call.

    y = epilogue(x @ W.T + bias)      (epilogues: plain, SwiGLU over a stacked [gate; up] W, residual add)

The fast GEMMs pick their kernel and tiles from the number of rows M (the skinny kernel's one-row path vs
its tl.dot path, cuBLAS's heuristics and split-K), so a row computed alone, inside a k+1 verify block or
inside a prefill chunk is rounded differently, and greedy output drifts with k and the batch. Here the
weight is the A operand (BLOCK_N weight rows x BLOCK_K) and the rows of x are the B operand in fixed
BLOCK_M = 16 tiles; the K loop runs sequentially with one tile config chosen from the weight's shape alone
(`launch_config` takes no M), no split-K. A tensor-core dot computes each output element from its own
row and column only, so a row's result does not depend on its position in the tile or on the other rows
(padding rows are zero and only produce their own, discarded, columns). The epilogues round exactly as
skinny_linear_ref does, identically for every M.

`deterministic_linear_ref` is the definition and the CPU path: each row is its own matrix-vector product in
float32, so it is row-invariant too (slow for long prefills on CPU: a correctness mode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockspec.kernels._triton import HAVE_TRITON, use_triton

BLOCK_M = 16  # rows of x per program: the smallest tensor-core tile, fixed for every M

if HAVE_TRITON:
    import triton
    import triton.language as tl

    # M is a run-time value the kernel must not be specialised on (Triton compiles separate variants for
    # integers equal to 1 or divisible by 16): one compiled kernel serves every row count.
    @triton.jit(do_not_specialize=["M"])
    def _deterministic_linear_kernel(X, W, B, Y, M, N_OUT, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                                     GATED: tl.constexpr, HAS_RES: tl.constexpr, DOT_PRECISION: tl.constexpr,
                                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # Program (n, m): output columns n * BLOCK_N.. of rows m * BLOCK_M..; the accumulator is [BLOCK_N,
        # BLOCK_M] (weight rows x activation rows). With GATED it also reads the up rows N_OUT + n of W.
        dtype = Y.dtype.element_ty
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N_OUT
        m_mask = offs_m < M
        x_rows = X + offs_m[:, None].to(tl.int64) * K
        g_rows = W + offs_n[:, None].to(tl.int64) * K
        u_rows = W + (offs_n[:, None] + N_OUT).to(tl.int64) * K
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            k_mask = ks < K
            xt = tl.trans(tl.load(x_rows + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0))
            w_mask = n_mask[:, None] & k_mask[None, :]
            wg = tl.load(g_rows + ks[None, :], mask=w_mask, other=0.0)
            acc_g = tl.dot(wg, xt, acc_g, input_precision=DOT_PRECISION)
            if GATED:
                wu = tl.load(u_rows + ks[None, :], mask=w_mask, other=0.0)
                acc_u = tl.dot(wu, xt, acc_u, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            acc_g += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            if GATED:
                acc_u += tl.load(B + N_OUT + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        y = acc_g.to(dtype)  # the F.linear output
        if GATED:  # silu_mul_ref: F.silu rounds, then the multiply rounds again
            g = y.to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(dtype)
            y = (s.to(tl.float32) * acc_u.to(dtype).to(tl.float32)).to(dtype)
        out_mask = n_mask[:, None] & m_mask[None, :]
        y_ptrs = Y + offs_m[None, :].to(tl.int64) * N_OUT + offs_n[:, None]
        if HAS_RES:
            r = tl.load(y_ptrs, mask=out_mask, other=0.0)
            y = (r.to(tl.float32) + y.to(tl.float32)).to(dtype)
        tl.store(y_ptrs, y, mask=out_mask)


def launch_config(n_out: int, k: int, gated: bool) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) from the weight's shape only: never from the row count, so a
    weight reduces every row in the same order (BLOCK_K fixes the order along K). One config for now: 32
    weight rows a program (>= 128 programs on 4096-wide outputs: the decode GEMV streams W from every SM)."""
    del n_out, k, gated  # the signature says what a config may depend on
    return 32, 128, 4, 4


def _round_epilogue(y: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None, n_out: int, gated: bool,
                    residual: torch.Tensor | None) -> torch.Tensor:
    """float32 accumulators [M, N(*2)] -> the kernel's rounded output (bias, SwiGLU, residual add)."""
    if bias is not None:
        y = y + bias.float()
    if gated:
        g, u = y[:, :n_out].to(dtype), y[:, n_out:].to(dtype)
        y = (F.silu(g.float()).to(dtype).float() * u.float()).to(dtype)
    else:
        y = y.to(dtype)
    if residual is None:
        return y
    return residual.copy_((residual.float() + y.float()).to(dtype))


def deterministic_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                             gated: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The definition (and CPU path): every row its own float32 matrix-vector product, then the epilogue.
    With `residual` it is updated in place and returned, as skinny_linear does."""
    n_out = weight.shape[0] // 2 if gated else weight.shape[0]
    w = weight.float()
    acc = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    for i in range(x.shape[0]):  # one fixed-shape product per row: no row count enters its arithmetic
        acc[i] = torch.mv(w, x[i].float())
    return _round_epilogue(acc, x.dtype, bias, n_out, gated, residual)


def _fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool,
          residual: torch.Tensor | None) -> bool:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1] or (gated and weight.shape[0] % 2):
        return False
    n_out = weight.shape[0] // 2 if gated else weight.shape[0]

    def fits(t: torch.Tensor | None, shape: tuple[int, ...]) -> bool:
        return t is None or (t.shape == shape and t.dtype == x.dtype and t.is_contiguous() and t.device == x.device)

    return (x.is_contiguous() and weight.is_contiguous() and x.dtype == weight.dtype
            and fits(bias, (weight.shape[0],)) and fits(residual, (x.shape[0], n_out)))


def deterministic_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                                gated: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """Launch without the dispatch (the tests call it on CPU tensors under TRITON_INTERPRET=1)."""
    m, k = x.shape
    n_out = weight.shape[0] // 2 if gated else weight.shape[0]
    out = residual if residual is not None else torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_n, block_k, num_warps, num_stages = launch_config(n_out, k, gated)
    _deterministic_linear_kernel[(triton.cdiv(n_out, block_n), triton.cdiv(m, BLOCK_M))](
        x, weight, bias if bias is not None else x, out, m, n_out, K=k, HAS_BIAS=bias is not None, GATED=gated,
        HAS_RES=residual is not None, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return out


def deterministic_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                         gated: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel where it runs (CUDA, or the interpreter), else the row-by-row reference. Either way a
    row's output depends on that row and the weights only."""
    if use_triton(x) and _fits(x, weight, bias, gated, residual):
        return deterministic_linear_triton(x, weight, bias, gated=gated, residual=residual)
    if x.is_cuda:
        raise ValueError(f"deterministic_linear: operands the kernel cannot take (x {tuple(x.shape)} {x.dtype}, "
                         f"weight {tuple(weight.shape)} {weight.dtype}, contiguous: {x.is_contiguous()})")
    return deterministic_linear_ref(x, weight, bias, gated=gated, residual=residual)
