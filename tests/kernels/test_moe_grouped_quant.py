"""The grouped MoE kernels on quantized experts (weights dequantized in registers by kernels/quant_tiles.py)
against the dequantize-then-matmul reference (layers.moe.experts_reference on QuantExperts.dequantize()), for
every layout and its variants, 1 and 16 tokens, top-k 2 to 8; biases and GPT-OSS's clamped SwiGLU on bf16 and
MXFP4 experts; and SparseMoeBlock's fused path with quantized experts (shared expert on and off) against its
reference path. On a GPU, or on CPU under TRITON_INTERPRET=1 (tiny shapes).
"""

from __future__ import annotations

import pytest
import torch

from blockspec.kernels._triton import kernel_device
from blockspec.kernels.moe_grouped import GemmConfig, fused_supported, moe_experts, quant_operand
from blockspec.models.layers import moe
from blockspec.models.layers.moe import GatedActivation, SparseMoeBlock, experts_reference
from blockspec.models.layers.quant_linear import E8M0_BIAS, QuantExperts, QuantLinear
from blockspec.runner.decode_graphs import capture_graph
from tests.kernels.test_moe_grouped import random_routing, rel_err
from tests.kernels.test_skinny_linear import _interpreter_like_gpu

DEVICE = kernel_device()
kernel = pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU, or Triton with TRITON_INTERPRET=1")
GPT_OSS = GatedActivation(limit=7.0)


@pytest.fixture(autouse=True)
def _gpu_like(monkeypatch):
    """Inference only; bf16 rounding and tl.dot as on a GPU in the interpreter."""
    if DEVICE == "cpu":
        _interpreter_like_gpu(monkeypatch)
    with torch.no_grad():
        yield


@torch.no_grad()
def fill_random(experts: QuantExperts, seed: int = 0) -> QuantExperts:
    """Random codes over each format's range, scales sized so that every projection has unit-ish outputs."""
    g = torch.Generator().manual_seed(seed)
    for holder in (experts.gate_up_proj, experts.down_proj):
        k = holder.in_features
        qw, s = holder.qweight, holder.scales
        if holder.scheme in ("int4", "nvfp4", "mxfp4"):
            qw.copy_(torch.randint(0, 256, qw.shape, generator=g, dtype=torch.int32))
        elif holder.scheme == "int8":
            qw.copy_(torch.randint(-128, 128, qw.shape, generator=g, dtype=torch.int32))
        else:  # fp8: every code bar NaN
            bits = torch.randint(0, 256, qw.shape, generator=g, dtype=torch.int32).to(torch.uint8)
            qw.view(torch.uint8).copy_(torch.where((bits & 0x7F) == 0x7F, bits & 0xF0, bits))
        if holder.scheme == "nvfp4":  # e4m3 codes from subnormal up to 448, bar NaN; a global scale per expert
            s.view(torch.uint8).copy_(torch.randint(1, 127, s.shape, generator=g, dtype=torch.int32))
            holder.global_scale.copy_((torch.rand(holder.num_experts, generator=g) + 0.5) * 0.5 * k ** -0.5 / 40)
        elif holder.scheme == "mxfp4":  # 2^-8 .. 2^-4 per 32
            s.copy_(torch.randint(E8M0_BIAS - 8, E8M0_BIAS - 3, s.shape, generator=g, dtype=torch.int32))
        else:
            unit = {"int4": 0.3, "int8": 0.02, "fp8": 0.01}[holder.scheme]
            s.copy_((torch.rand(s.shape, generator=g) + 0.5) * unit * k ** -0.5)
        if holder.zeros is not None:
            if holder.scheme == "int4":
                holder.zeros.copy_(torch.full(holder.zeros.shape, 8) if holder.symmetric else
                                   torch.randint(0, 16, holder.zeros.shape, generator=g, dtype=torch.int32))
            else:
                holder.zeros.copy_(torch.randint(-20, 21, holder.zeros.shape, generator=g, dtype=torch.int32))
    for bias in (experts.gate_up_proj_bias, experts.down_proj_bias):
        if bias is not None:
            bias.copy_(torch.randn(bias.shape, generator=g) * 0.3)
    return experts


# name: (scheme, H, I, gate_up group, down group, symmetric); int8 "per channel" is one group per row
VARIANTS = {
    "int4_g32_asym": ("int4", 64, 32, 32, 32, False),
    "int4_g64_sym": ("int4", 128, 64, 64, 64, True),
    "int4_g128_asym": ("int4", 128, 128, 128, 128, False),
    "int8_channel_asym": ("int8", 64, 32, 64, 32, False),
    "int8_g32_sym": ("int8", 64, 32, 32, 32, True),
    "fp8_channel": ("fp8", 64, 32, 0, 0, True),
    "fp8_block": ("fp8", 128, 64, 128, 128, True),  # the down projection's K (64) is a partial block
    "nvfp4": ("nvfp4", 64, 32, 16, 16, True),
    "mxfp4": ("mxfp4", 64, 32, 32, 32, True),
}


def make_quant_experts(variant: str, e: int, dtype: torch.dtype, bias: bool = False,
                       activation: GatedActivation = moe.SILU, seed: int = 0) -> QuantExperts:
    scheme, h, i, g_gu, g_d, sym = VARIANTS[variant]
    experts = QuantExperts(scheme, e, h, i, g_gu, g_d, symmetric=sym, bias=bias, activation=activation, dtype=dtype)
    return fill_random(experts, seed).to(DEVICE)


def reference(experts: QuantExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Dequantize every expert to x's dtype, then the unquantized experts' reference."""
    gate_up, down = experts.dequantize(x.dtype)
    return experts_reference(x, gate_up, down, weights, ids, experts.activation, experts.gate_up_proj_bias,
                             experts.down_proj_bias)


def configs(t: int, h: int, i: int) -> tuple[GemmConfig, GemmConfig] | None:
    """Under the interpreter one N tile per expert (its cost is per program); on a GPU the real heuristic."""
    if DEVICE != "cpu":
        return None
    return GemmConfig(16, max(16, i), 64, 4, 1), GemmConfig(16, max(16, h), 64, 4, 1)


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    else:
        assert rel_err(got, want) < 1e-2


@kernel
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (16, 16, 8)])
def test_quantized_experts_match_the_dequantized_reference(variant, t, e, k):
    dtype = torch.float32
    experts = make_quant_experts(variant, e, dtype, seed=t)
    h = experts.gate_up_proj.in_features
    weights, ids = random_routing(t, e, k, dtype, seed=t)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    assert fused_supported(x, experts.gate_up_proj, experts.down_proj)
    got = moe_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids,
                      configs=configs(t, h, experts.intermediate_size))
    _check(got, reference(experts, x, weights, ids), dtype)


@kernel
@pytest.mark.parametrize("variant,t,k", [("int4_g32_asym", 1, 4), ("nvfp4", 16, 8), ("fp8_block", 16, 2),
                                         ("int8_channel_asym", 1, 8)])
def test_bf16_activations(variant, t, k):
    dtype = torch.bfloat16
    experts = make_quant_experts(variant, 8, dtype, seed=k)
    h = experts.gate_up_proj.in_features
    weights, ids = random_routing(t, 8, k, dtype, seed=k)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(2)).to(dtype=dtype, device=DEVICE)
    got = moe_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids,
                      configs=configs(t, h, experts.intermediate_size))
    _check(got, reference(experts, x, weights, ids), dtype)


@kernel
@pytest.mark.parametrize("t", [1, 3])
def test_default_launch_config(t):
    """The heuristic's own tiles (several N tiles per expert, BLOCK_K < K, int4 g32 groups inside a tile)."""
    experts = make_quant_experts("int4_g128_asym", 4, torch.float32)
    weights, ids = random_routing(t, 4, 2, torch.float32, seed=5)
    x = torch.randn(t, 128, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    got = moe_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids)
    _check(got, reference(experts, x, weights, ids), torch.float32)


@kernel
@pytest.mark.parametrize("layout", ["bf16", "mxfp4"])
@pytest.mark.parametrize("t", [1, 16])
def test_biases_and_clamped_swiglu(layout, t):
    """GPT-OSS experts: per-expert biases and the clamped SwiGLU in the kernels' epilogues (a limit small
    enough that the clamps bite)."""
    dtype, e, k = torch.float32, 8, 4
    act = GatedActivation(limit=0.5)
    experts = make_quant_experts("mxfp4", e, dtype, bias=True, activation=act, seed=t)
    weights, ids = random_routing(t, e, k, dtype, seed=t)
    x = (torch.randn(t, 64, generator=torch.Generator().manual_seed(4)) * 2).to(DEVICE)
    want = reference(experts, x, weights, ids)
    if layout == "bf16":  # the dequantized stacks as plain tensors: the unquantized kernels, same epilogue
        gate_up, down = experts.dequantize(dtype)
        got = moe_experts(x, gate_up, down, weights, ids, configs=configs(t, 64, 32),
                          gate_up_bias=experts.gate_up_proj_bias, down_bias=experts.down_proj_bias,
                          limit=act.limit, alpha=act.alpha)
    else:
        got = moe_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, configs=configs(t, 64, 32),
                          gate_up_bias=experts.gate_up_proj_bias, down_bias=experts.down_proj_bias,
                          limit=act.limit, alpha=act.alpha)
    _check(got, want, dtype)
    unclamped = experts_reference(x, *experts.dequantize(dtype), weights, ids, moe.SILU,
                                  experts.gate_up_proj_bias, experts.down_proj_bias)
    assert rel_err(got, unclamped) > 0.05  # the activation mattered


@kernel
def test_quantized_experts_forward_takes_the_kernels(monkeypatch):
    """QuantExperts.forward: the kernels for few tokens (backend auto), the reference loop for prefill-sized
    steps and for backend "reference"; act-order experts (perm) are not read by the kernels."""
    calls = []
    orig = moe.moe_experts
    monkeypatch.setattr(moe, "moe_experts", lambda *a, **kw: calls.append(a[0].shape[0]) or orig(*a, **kw))
    monkeypatch.setattr(moe, "FUSED_MAX_TOKENS", 4)
    experts = make_quant_experts("int4_g32_asym", 8, torch.float32)
    for t, backend, fused in [(4, "auto", True), (5, "auto", False), (2, "reference", False), (6, "fused", True)]:
        experts.backend = backend
        calls.clear()
        weights, ids = random_routing(t, 8, 2, torch.float32, seed=t)
        x = torch.randn(t, 64, generator=torch.Generator().manual_seed(t)).to(DEVICE)
        _check(experts(x, weights, ids), reference(experts, x, weights, ids), torch.float32)
        assert calls == ([t] if fused else []), (t, backend)
    experts.gate_up_proj.perm = torch.arange(64, device=DEVICE).flip(0)
    assert quant_operand(experts.gate_up_proj, torch.float32) is None
    assert not fused_supported(x, experts.gate_up_proj, experts.down_proj)


def quantized_block(variant: str, e: int, k: int, shared: int, seed: int = 0,
                    dtype: torch.dtype = torch.float32) -> SparseMoeBlock:
    """A SparseMoeBlock whose experts are quantized (and its shared expert's projections too, int4 g32 / NVFP4
    as the checkpoints quantize them), router and shared gate left in `dtype`."""
    scheme, h, i, *_ = VARIANTS[variant]
    torch.manual_seed(seed)
    block = SparseMoeBlock(h, e, k, i, True, shared_intermediate_size=shared)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(e, h, generator=gen) * h ** -0.5 * 4)
        if shared:
            block.shared_expert_gate.weight.copy_(torch.randn(1, h, generator=gen) * h ** -0.5)
    block = block.to(dtype)  # before the quantized modules go in: .to(dtype) would cast their float8 tensors
    block.experts = make_quant_experts(variant, e, dtype, seed=seed).cpu()
    if shared:
        lin_scheme, group = ("nvfp4", 16) if scheme == "nvfp4" else ("int4", 32)
        se = block.shared_expert
        for name, (k_in, n_out) in {"gate_up_proj": (h, 2 * shared), "down_proj": (shared, h)}.items():
            layer = QuantLinear(lin_scheme, k_in, n_out, group, symmetric=False, dtype=dtype,
                                shard_sizes=[shared, shared] if name == "gate_up_proj" else None)
            with torch.no_grad():
                layer.qweight.copy_(torch.randint(0, 256, layer.qweight.shape, generator=gen, dtype=torch.int32))
                if lin_scheme == "int4":
                    layer.zeros.copy_(torch.randint(0, 16, layer.zeros.shape, generator=gen, dtype=torch.int32))
                    layer.scales.fill_(0.3 * k_in ** -0.5)
                else:
                    layer.global_scale.fill_(0.02)
            setattr(se, name, layer)
    return block.to(DEVICE).eval()


@kernel
@pytest.mark.parametrize("shared", [0, 32], ids=["no_shared", "shared"])
@pytest.mark.parametrize("variant,t,k", [("int4_g32_asym", 1, 2), ("nvfp4", 16, 4), ("fp8_channel", 5, 8)])
def test_block_fused_path_matches_its_reference_path(variant, t, k, shared, monkeypatch):
    """SparseMoeBlock with quantized experts: the fused path (routing kernel, grouped quantized GEMMs, the
    shared expert on its own QuantLinear path) against the same block on the reference path."""
    if DEVICE == "cpu" and variant == "nvfp4" and not shared:
        # under the interpreter NVFP4 runs with the shared expert; the block without one runs with INT4 (1 token)
        # and FP8 (5 tokens, the dot path as NVFP4's 16)
        pytest.skip("NVFP4 without a shared expert runs on the GPU (the suite's time under TRITON_INTERPRET=1)")
    block = quantized_block(variant, 8, k, shared, seed=t)
    h = block.gate.in_features
    calls = []
    orig = moe.moe_experts
    monkeypatch.setattr(moe, "moe_experts", lambda *a, **kw: calls.append(a[0].shape[0]) or orig(*a, **kw))
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(DEVICE)
    residual = torch.randn(t, h, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    got = block(x)
    got_res = block.forward_residual(x, residual)
    assert calls == [t, t]
    block.experts.backend = "reference"
    want = block(x)
    assert calls == [t, t]
    _check(got, want, torch.float32)
    _check(got_res, residual + want, torch.float32)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", ["nvfp4", "int4_g128_asym", "fp8_block", "mxfp4"])
def test_cuda_graph_captures_the_quantized_block(variant):
    """The block with quantized experts (bf16, the PTX unpackers where they apply) captured in a CUDA graph at
    1 and 16 tokens, replayed on new inputs: no host sync inside (the capture used to be refused), each replay
    equal to an eager call, and close to the reference path."""
    torch.manual_seed(0)
    block = quantized_block(variant, 32, 4, 32, seed=1, dtype=torch.bfloat16)
    block.record_routing = True
    h = block.gate.in_features
    for t in (1, 16):
        static_x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        graph, static_out = capture_graph(block, static_x)
        for seed in range(2):
            torch.manual_seed(100 + seed)
            static_x.copy_(torch.randn(t, h, device="cuda", dtype=torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            replayed = static_out.clone()
            assert torch.equal(replayed, block(static_x.clone()))
            ids = block.last_ids.clone()
            block.experts.backend = "reference"
            want = block(static_x.clone())
            same = (ids.long().sort(-1).values == block.last_ids.long().sort(-1).values).all(-1)
            block.experts.backend = "auto"
            assert same.float().mean() >= 0.75
            assert rel_err(replayed[same], want[same]) < 2e-2, (variant, t, seed)
