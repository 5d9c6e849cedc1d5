"""The grouped dynamic causal convolution kernel against its definition (spec/dflash2.grouped_conv_ref), on a GPU
or under TRITON_INTERPRET=1: rows of several blocks (no tap crosses a block boundary), 2 and 3 taps, the
strided dynamic view the prepare side passes, and GroupedDynamicConv dispatching to it."""

from __future__ import annotations

import pytest
import torch

from blockspec.kernels._triton import kernel_device
from blockspec.kernels.grouped_conv import grouped_conv_triton
from blockspec.spec.dflash2 import GroupedDynamicConv, grouped_conv_ref

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU, or Triton with TRITON_INTERPRET=1")


def block_index(blocks: int, size: int) -> torch.Tensor:
    return torch.arange(size).repeat(blocks).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("taps", [2, 3])
def test_kernel_is_the_definition(taps, dtype):
    g = torch.Generator().manual_seed(taps)
    h, group, t = 96, 16, 3 * 8
    x = torch.randn(t, h, generator=g).to(dtype).to(DEVICE)
    both = torch.randn(t, 2, taps, h // group, generator=g).to(dtype).to(DEVICE)  # prepare's view: [:, 0]
    base = torch.randn(taps, h, generator=g).to(dtype).to(DEVICE)
    idx = block_index(3, 8)
    got = grouped_conv_triton(x, both[:, 0], base, group, idx)
    want = grouped_conv_ref(x, both[:, 0], base, group, idx)
    # fp32: an fp32 multiply-add contracted or not moves the last bit; bf16: the CPU definition rounds addcmul's
    # product before the add where CUDA (and the kernel) round once
    rel = float((got.float() - want.float()).norm() / want.float().norm())
    assert rel < (1e-6 if dtype == torch.float32 else 2e-2)
    # every block on its own: no tap reaches into the block before
    alone = grouped_conv_triton(x[8:16].contiguous(), both[8:16, 0], base, group, idx[:8])
    assert torch.equal(alone, got[8:16])


def test_the_module_takes_the_kernel():
    torch.manual_seed(5)
    conv = GroupedDynamicConv(64, 2, 16).to(DEVICE)
    with torch.no_grad():
        conv.base_kernel.normal_()
        x, y = torch.randn(16, 64, device=DEVICE), torch.randn(16, 64, device=DEVICE)
        idx = block_index(2, 8)
        out, post = conv.prepare(x, idx)
        fin = conv.finish(y, post, idx)
        dynamic = conv.kernel_projection(x).view(16, 2, 2, 4)
        torch.testing.assert_close(out, grouped_conv_ref(x, dynamic[:, 0], conv.base_kernel[0], 16, idx))
        torch.testing.assert_close(fin, grouped_conv_ref(y, dynamic[:, 1], conv.base_kernel[1], 16, idx))
