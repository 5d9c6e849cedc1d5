"""--deterministic for MoE blocks (models/deterministic.moe_residual): the same function as the block, and on the
GPU the same bits for a token alone or among others (the fixed routing tile and expert GEMM tiles). Under
TRITON_INTERPRET=1 the fp32 check runs the Triton branch; the bit checks need the GPU's MMA (the interpreter's
tl.dot is NumPy's matmul, whose blocking follows the shape)."""

from __future__ import annotations

import pytest
import torch

from blockspec.kernels._triton import kernel_device
from blockspec.kernels.moe_grouped import fused_supported
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


# ---- quantized experts (QuantExperts): the stacks dequantized in fixed 16-row tiles -----------------------------

QUANT = {  # name: (scheme, gate_up group, down group, symmetric, GPT-OSS's biases and clamped SwiGLU)
    "int4_g32_asym": ("int4", 32, 32, False, False),
    "nvfp4": ("nvfp4", 16, 16, True, False),
    "fp8_channel": ("fp8", 0, 0, True, False),
    "mxfp4_gpt_oss": ("mxfp4", 32, 32, True, True),
}


def quant_block(name: str, dtype: torch.dtype, device: str, hidden: int = 64, experts: int = 8, top_k: int = 2,
                inter: int = 32) -> tuple[SparseMoeBlock, RMSNorm]:
    """A SparseMoeBlock whose experts are quantized (random codes, as the grouped kernels' tests fill them)."""
    from blockspec.models.layers.moe import GatedActivation
    from blockspec.models.layers.quant_linear import QuantExperts
    from tests.kernels.test_moe_grouped_quant import fill_random

    scheme, g_gu, g_dn, sym, gpt_oss = QUANT[name]
    act = GatedActivation(limit=7.0) if gpt_oss else GatedActivation()
    torch.manual_seed(0)
    moe = SparseMoeBlock(hidden, experts, top_k, inter, True, bias=gpt_oss, activation=act)
    norm = RMSNorm(hidden, 1e-6)
    for p in (*moe.parameters(), *norm.parameters()):
        p.data.normal_(0, 0.05)
    norm.weight.data += 1
    moe, norm = moe.to(device, dtype), norm.to(device, dtype)
    # built in the model dtype and moved by device only: a dtype cast would turn the float8 tensors into bf16
    moe.experts = fill_random(QuantExperts(scheme, experts, hidden, inter, g_gu, g_dn, symmetric=sym, bias=gpt_oss,
                                           activation=act, dtype=dtype)).to(device)
    return moe, norm


@pytest.mark.parametrize("name", list(QUANT))
@pytest.mark.parametrize("tokens", [1, 17])
def test_quantized_moe_residual_is_the_block(name, tokens):
    """fp32: h + block(norm(h)) with quantized experts (GPT-OSS's biases and clamp on MXFP4 too), through the
    fixed-tile kernels where Triton runs, else row by row through the experts' reference."""
    moe, norm = quant_block(name, torch.float32, DEVICE)
    h = torch.randn(tokens, 64, device=DEVICE)
    with torch.inference_mode():
        want = h + moe(norm(h))
        got = deterministic.moe_residual(h.clone(), norm, moe)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(QUANT))
def test_quantized_experts_a_token_has_the_same_bits_alone_and_among_others(name, monkeypatch):
    """bf16: each row of a 16- and a 40-token step equals that row alone (one token on 16-row tiles too). Under
    TRITON_INTERPRET=1 with bf16 made to round as on the GPU (the tiles' shapes are fixed, so NumPy's matmul
    blocks them alike), on the GPU as is, on CPU row by row."""
    if DEVICE == "cpu":
        from tests.kernels.interpreter_bf16 import interpreter_like_gpu

        interpreter_like_gpu(monkeypatch)
    moe, norm = quant_block(name, torch.bfloat16, DEVICE)
    h = torch.randn(40, 64, device=DEVICE, dtype=torch.bfloat16)
    with torch.inference_mode():
        if kernel_device() is not None:  # the grouped kernels read every layout here (not the row-by-row fallback)
            assert fused_supported(h, moe.experts.gate_up_proj, moe.experts.down_proj)
        alone = torch.cat([deterministic.moe_residual(h[i:i + 1].clone(), norm, moe) for i in (0, 7, 15, 20, 39)])
        full = deterministic.moe_residual(h.clone(), norm, moe)
        assert torch.equal(full[[0, 7, 15, 20, 39]], alone)
        block = deterministic.moe_residual(h[5:21].clone(), norm, moe)
        assert torch.equal(block[[2, 10, 15]], alone[1:4])
