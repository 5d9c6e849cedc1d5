"""SparseMoeBlock's dispatch: the fused Triton path (CUDA, or CPU under TRITON_INTERPRET=1) against the reference
path it replaces for decode / verify steps, the routing hooks, and the unchanged CPU path.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blockspec.kernels import moe_grouped as mg
from blockspec.kernels._triton import INTERPRET, kernel_device
from blockspec.models.layers import moe
from blockspec.models.layers.moe import SparseMoeBlock, experts_forward, experts_reference, route
from tests.kernels.test_skinny_linear import _interpreter_like_gpu

DEVICE = kernel_device()
kernel = pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU, or Triton with TRITON_INTERPRET=1")


@pytest.fixture
def gpu_like(monkeypatch):
    """The interpreter as a GPU computes (bf16 rounding, tl.dot), with one N tile per expert there (its cost is
    per program)."""
    if DEVICE == "cpu":
        _interpreter_like_gpu(monkeypatch)
        orig = mg.gemm_config

        def wide(tokens, n, k, items, gated, quantized=False):
            cfg = orig(tokens, n, k, items, gated, quantized=quantized)
            return mg.GemmConfig(cfg.block_m, max(16, mg._next_pow2(n)), cfg.block_k, cfg.num_warps, 1)
        monkeypatch.setattr(mg, "gemm_config", wide)


def make_block(h: int, e: int, k: int, i: int, shared: int, dtype: torch.dtype, device: str | None = DEVICE,
               seed: int = 0, renormalize: bool = True) -> SparseMoeBlock:
    torch.manual_seed(seed)
    block = SparseMoeBlock(h, e, k, i, renormalize, shared_intermediate_size=shared)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5)
        block.gate.weight.mul_(4)  # well separated router logits
    return block.to(device=device, dtype=dtype).eval()


def reference_copy(block: SparseMoeBlock) -> SparseMoeBlock:
    ref = SparseMoeBlock(block.gate.in_features, block.experts.num_experts, block.top_k,
                         block.experts.intermediate_size, block.renormalize,
                         block.shared_expert.intermediate_size if block.shared_expert is not None else 0)
    ref = ref.to(device=block.gate.weight.device, dtype=block.gate.weight.dtype).eval()
    ref.load_state_dict(block.state_dict())
    ref.experts.backend = "reference"
    ref.record_routing = True
    return ref


def by_hand(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The reference path written out: route, experts_reference, + sigmoid(gate) * shared."""
    weights, ids = route(F.linear(x, block.gate.weight), block.top_k, block.renormalize)
    out = experts_reference(x, block.experts.gate_up_proj, block.experts.down_proj, weights, ids)
    if block.shared_expert is not None:
        out = out + torch.sigmoid(F.linear(x, block.shared_expert_gate.weight)) * block.shared_expert(x)
    return out


def test_cpu_path_unchanged():
    """Where Triton does not run (here: grad enabled, or CPU without the interpreter) the block is the
    reference path, bit for bit."""
    block = make_block(32, 8, 2, 16, 16, torch.float32, device="cpu")
    x = torch.randn(5, 32)
    with torch.enable_grad():
        torch.testing.assert_close(block(x), by_hand(block, x), rtol=0, atol=0)
    if not INTERPRET:
        with torch.no_grad():
            torch.testing.assert_close(block(x), by_hand(block, x), rtol=0, atol=0)


SHARED = {"none": 0, "folded": 32, "separate": 48}  # shared intermediate size (routed: 32)


@kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shared", list(SHARED))
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (2, 16, 4), (16, 64, 8), (48, 16, 4)])
def test_block_fused_matches_reference_path(t, e, k, shared, dtype, gpu_like):
    if DEVICE == "cpu" and dtype == torch.bfloat16 and (t, shared) not in ((1, "folded"), (16, "folded"), (48, "none")):
        pytest.skip("a few bf16 cases under the interpreter")
    block = make_block(64, e, k, 32, SHARED[shared], dtype, seed=t + e)
    ref = reference_copy(block)
    block.record_routing = True
    x = torch.randn(t, 64, generator=torch.Generator().manual_seed(t)).to(dtype=dtype, device=DEVICE)
    with torch.no_grad():
        got, want = block(x), ref(x)
    assert block.last_ids.dtype == torch.int32  # the fused path ran (the reference routes with torch.topk)
    assert got.shape == x.shape and got.dtype == dtype
    same = (block.last_ids.long().sort(-1).values == ref.last_ids.sort(-1).values).all(-1)
    if dtype == torch.float32:
        assert same.all()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    else:  # the two router GEMMs round bf16 logits differently: compare the tokens routed alike
        assert same.float().mean() >= 0.75
        err = (got[same].float() - want[same].float()).norm() / want[same].float().norm()
        assert err < 2e-2


@kernel
def test_three_dim_input(gpu_like):
    block = make_block(32, 8, 2, 16, 16, torch.float32)
    x = torch.randn(2, 3, 32, device=DEVICE)
    with torch.no_grad():
        got = block(x)
        assert got.shape == x.shape
        torch.testing.assert_close(got, by_hand(block, x.view(6, 32)).view(2, 3, 32), rtol=1e-4, atol=1e-5)


def _fixed_routing(t: int, e: int, k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    ids = (torch.arange(t)[:, None] * 3 + torch.arange(k)[None, :]) % e  # shared experts across tokens
    w = torch.linspace(0.2, 1.0, k).expand(t, k)
    return (w / w.sum(-1, keepdim=True)).contiguous().to(device), ids.to(device)


@pytest.mark.parametrize("path", ["reference", "fused"])
def test_route_override_and_record_routing(path, gpu_like):
    if path == "fused" and DEVICE is None:
        pytest.skip("needs a CUDA GPU, or Triton with TRITON_INTERPRET=1")
    device = DEVICE if path == "fused" else "cpu"
    t, e, k = 6, 8, 2
    block = make_block(32, e, k, 16, 16, torch.float32, device=device)
    if path == "reference":
        block.experts.backend = "reference"
    assert block.route_override is None and block.record_routing is False and block.last_ids is None
    x = torch.randn(t, 32, device=device)
    weights, ids = _fixed_routing(t, e, k, device)
    seen = []

    def override(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert logits.shape == (t, e)
        seen.append(logits)
        return weights, ids

    with torch.no_grad():
        block(x)
        assert block.last_ids is None  # not recorded unless asked
        block.route_override = override
        block.record_routing = True
        got = block(x)
        want = experts_reference(x, block.experts.gate_up_proj, block.experts.down_proj, weights, ids)
        want = want + torch.sigmoid(F.linear(x, block.shared_expert_gate.weight)) * block.shared_expert(x)
    assert len(seen) == 1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert block.last_ids is ids
    block.route_override = None
    with torch.no_grad():
        block(x)
    assert block.last_ids is not ids and torch.equal(block.last_ids.long(),
                                                     route(F.linear(x, block.gate.weight), k, True)[1])


def test_recorded_routing_is_kept_per_token_count():
    """A CUDA graph keeps refreshing the ids tensor it captured; an eager forward of another size (a
    prefill between decode steps) moves `last_ids` but must leave the captured size's entry alone."""
    block = make_block(32, 8, 2, 16, 16, torch.float32, device="cpu")
    block.experts.backend = "reference"
    block.record_routing = True
    with torch.no_grad():
        block(torch.randn(16, 32))
        verify_ids = block.last_ids
        block(torch.randn(40, 32))
    assert block.last_ids.shape[0] == 40 and block.ids_by_tokens[16] is verify_ids
    assert sorted(block.ids_by_tokens) == [16, 40]


@kernel
def test_dispatch_rule(monkeypatch, gpu_like):
    """auto: fused up to FUSED_MAX_TOKENS tokens, torch's path above; reference / grouped never fused;
    fused at any size."""
    calls = []
    orig = moe.moe_experts

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return orig(*args, **kwargs)

    monkeypatch.setattr(moe, "moe_experts", spy)
    monkeypatch.setattr(moe, "FUSED_MAX_TOKENS", 4)
    block = make_block(32, 8, 2, 16, 0, torch.float32)
    with torch.no_grad():
        for t, backend, fused in [(4, "auto", True), (5, "auto", False), (2, "reference", False),
                                  (2, "grouped", False), (9, "fused", True)]:
            block.experts.backend = backend
            calls.clear()
            x = torch.randn(t, 32, device=DEVICE)
            torch.testing.assert_close(block(x), by_hand(block, x), rtol=1e-4, atol=1e-5)
            assert calls == ([t] if fused else []), (t, backend)
        calls.clear()
        weights, ids = _fixed_routing(3, 8, 2, DEVICE)
        got = experts_forward(x[:3], block.experts.gate_up_proj, block.experts.down_proj, weights, ids, "fused")
        assert calls == [3]
        torch.testing.assert_close(got, experts_reference(x[:3], block.experts.gate_up_proj,
                                                          block.experts.down_proj, weights, ids),
                                   rtol=1e-4, atol=1e-5)


@kernel
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("shared", [0, 16, 8], ids=["routed", "folded-shared", "own-shared"])
def test_forward_residual_is_the_add(t, shared, gpu_like):
    """forward_residual folds the residual add into the combine launch: the same bits as residual + forward,
    in bf16 where the two roundings could differ."""
    block = make_block(32, 8, 2, 16, shared, torch.bfloat16)
    block.experts.backend = "fused"
    x = torch.randn(t, 32, device=DEVICE, dtype=torch.bfloat16)
    res = torch.randn(t, 32, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(block.forward_residual(x, res), res + block(x))


@kernel
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("shared", [0, 16], ids=["routed", "folded-shared"])
def test_forward_norm_residual_is_norm_then_block(t, shared, gpu_like):
    """The post-attention half with the norm folded into the router GEMM (which also writes the normed rows the
    experts read): h + block(rms_norm(h)), the norm as the separate kernel computes it (up to the last bit of
    the variance) and the same experts chosen."""
    from blockspec.kernels.rms_norm import rms_norm
    from blockspec.models.layers.norm import RMSNorm

    block = make_block(32, 8, 2, 16, shared, torch.bfloat16)
    block.experts.backend = "fused"
    norm = RMSNorm(32, 1e-6).to(device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(32))
        h = torch.randn(t, 32, device=DEVICE, dtype=torch.bfloat16)
        block.record_routing = True
        got = block.forward_norm_residual(h, norm)
        got_ids = block.last_ids.clone()
        want = h + block(rms_norm(h, norm.kernel_weight(), norm.eps)[0])
        assert torch.equal(got_ids, block.last_ids)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
