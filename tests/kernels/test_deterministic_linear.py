"""The batch-invariant GEMM (--deterministic): the kernel against its reference, and each row bit-identical
whether computed alone, at another position among 16 rows, or inside a longer prefill chunk. On a GPU, or on
CPU under TRITON_INTERPRET=1 (bit-identity there is necessary, not sufficient: the GPU tests in
tests/engine/test_deterministic_gpu.py check the engine end to end)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blockspec.kernels._triton import kernel_device
from blockspec.kernels.deterministic_linear import (
    deterministic_linear,
    deterministic_linear_ref,
    deterministic_linear_triton,
)
from tests.kernels.interpreter_bf16 import interpreter_like_gpu

DEVICE = kernel_device()
kernel = pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU, or Triton with TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def bf16_as_on_the_gpu(monkeypatch):
    if DEVICE == "cpu":
        interpreter_like_gpu(monkeypatch)

# (n weight rows, k): k not a multiple of BLOCK_K, n not a multiple of BLOCK_N
SHAPES = [(48, 160), (64, 96)]


def operands(m: int, n: int, k: int, dtype: torch.dtype, device: str, *, bias: bool, gated: bool,
             residual: bool, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)

    n_out = n // 2 if gated else n
    return dict(x=rand(m, k), weight=rand(n, k, scale=k ** -0.5), bias=rand(n, scale=0.1) if bias else None,
                gated=gated, residual=rand(m, n_out, scale=0.5) if residual else None)


def run(fn, ops: dict) -> torch.Tensor:
    ops = dict(ops)
    if ops["residual"] is not None:
        ops["residual"] = ops["residual"].clone()
    return fn(ops.pop("x"), ops.pop("weight"), ops.pop("bias"), **ops)


def test_reference_is_the_linear_epilogues():
    """fp32, exact enough: the reference is F.linear, silu(gate) * up, + residual."""
    ops = operands(5, 40, 24, torch.float32, "cpu", bias=True, gated=True, residual=True)
    y = F.linear(ops["x"], ops["weight"], ops["bias"])
    want = ops["residual"] + F.silu(y[:, :20]) * y[:, 20:]
    torch.testing.assert_close(run(deterministic_linear_ref, ops), want, atol=1e-5, rtol=1e-5)


def test_reference_rows_do_not_depend_on_the_batch():
    ops = operands(9, 48, 160, torch.bfloat16, "cpu", bias=False, gated=False, residual=False)
    full = deterministic_linear_ref(ops["x"], ops["weight"])
    for i in (0, 4, 8):
        assert torch.equal(deterministic_linear_ref(ops["x"][i:i + 1], ops["weight"]), full[i:i + 1])


@kernel
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias,gated,residual", [(False, False, False), (True, True, False), (False, False, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(n, k, bias, gated, residual, dtype):
    ops = operands(19, n, k, dtype, DEVICE, bias=bias, gated=gated, residual=residual)
    got = run(deterministic_linear_triton, ops)
    want = run(deterministic_linear_ref, ops)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias,gated,residual", [(False, False, False), (True, True, False), (True, False, True)])
def test_a_row_is_bit_identical_alone_among_16_and_in_a_prefill_chunk(dtype, bias, gated, residual):
    n, k = SHAPES[0]
    chunk = operands(37, n, k, dtype, DEVICE, bias=bias, gated=gated, residual=residual)  # a prefill chunk
    row = 21
    full = run(deterministic_linear_triton, chunk)

    def sub(rows: list[int]) -> dict:
        ops = dict(chunk, x=chunk["x"][rows].contiguous())
        ops["residual"] = None if chunk["residual"] is None else chunk["residual"][rows].contiguous()
        return ops

    alone = run(deterministic_linear_triton, sub([row]))
    others = [r for r in range(37) if r != row]
    for position in (0, 7, 15):  # a 16-row verify block with the row at different positions
        rows = others[:position] + [row] + others[position:15]
        block = run(deterministic_linear_triton, sub(rows))
        assert torch.equal(block[position], alone[0])
    assert torch.equal(full[row], alone[0])
    assert torch.equal(run(deterministic_linear_triton, sub(list(range(17)))), full[:17])  # 17 rows: two tiles


@kernel
def test_dispatch_takes_the_kernel_and_updates_the_residual_in_place():
    ops = operands(3, 48, 160, torch.float32, DEVICE, bias=False, gated=False, residual=True)
    res = ops["residual"].clone()
    with torch.inference_mode():
        out = deterministic_linear(ops["x"], ops["weight"], residual=res)
    assert out is res
    assert torch.equal(res, run(deterministic_linear_triton, ops))
