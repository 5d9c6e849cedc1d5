"""--deterministic for MoE blocks (models/deterministic.moe_residual): the same function as the block, and on the
GPU the same bits for a token alone or among others (the fixed routing tile and expert GEMM tiles). Under
TRITON_INTERPRET=1 the fp32 check runs the Triton branch; the bit checks need the GPU's MMA (the interpreter's
tl.dot is NumPy's matmul, whose blocking follows the shape)."""

from __future__ import annotations

import pytest
import torch

from blockspec.kernels._triton import kernel_device
from blockspec.models import deterministic
from blockspec.models.layers.moe import SparseMoeBlock
from blockspec.models.layers.norm import RMSNorm

DEVICE = kernel_device() or "cpu"


def block(dtype: torch.dtype, device: str, hidden: int = 256, experts: int = 16, top_k: int = 4,
          inter: int = 128) -> tuple[SparseMoeBlock, RMSNorm]:
    torch.manual_seed(0)
    moe = SparseMoeBlock(hidden, experts, top_k, inter, True)
    norm = RMSNorm(hidden, 1e-6)
    for p in (*moe.parameters(), *norm.parameters()):
        p.data.normal_(0, 0.05)
    norm.weight.data += 1
    return moe.to(device, dtype), norm.to(device, dtype)


@pytest.mark.parametrize("tokens", [1, 3, 37])
def test_moe_residual_is_the_block(tokens):
    """fp32: h + block(norm(h)), through the kernels where Triton runs (GPU or interpreter), else row by row."""
    moe, norm = block(torch.float32, DEVICE)
    h = torch.randn(tokens, 256, device=DEVICE)
    with torch.inference_mode():
        want = h + moe(norm(h))
        got = deterministic.moe_residual(h.clone(), norm, moe)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bit-identity of the kernels needs a CUDA GPU")
def test_a_token_has_the_same_bits_alone_and_among_others_gpu():
    """bf16 on the GPU: each row of a 1-, 16- and 37-token step equals that row computed alone, where the regular
    fused path takes the one-row reduction for one token and 16-row tiles for more."""
    moe, norm = block(torch.bfloat16, "cuda")
    h = torch.randn(37, 256, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([deterministic.moe_residual(h[i:i + 1].clone(), norm, moe) for i in range(37)])
        for n in (16, 37):
            assert torch.equal(deterministic.moe_residual(h[:n].clone(), norm, moe), alone[:n])
        assert torch.equal(deterministic.moe_residual(h[20:36].clone(), norm, moe), alone[20:36])
