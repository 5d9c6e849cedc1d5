"""Fused RMSNorm(+residual), SwiGLU and q/k-norm+rotary kernels against their PyTorch references."""

from __future__ import annotations

import pytest
import torch

from blockspec.kernels._triton import kernel_device
from blockspec.kernels.activation import silu_mul, silu_mul_ref
from blockspec.kernels.rms_norm import rms_norm, rms_norm_ref
from blockspec.kernels.rotary import rope_qk, rope_qk_ref
from blockspec.models.layers.rotary import RotaryEmbedding

DEVICE = kernel_device()
kernels = pytest.mark.skipif(DEVICE is None, reason="Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1)")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_rope_reference_matches_rotary_module():
    """The fused reference (norm + rotate in place) equals the module path it replaces."""
    t, nq, nk, d = 7, 4, 2, 16
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(t, (nq + 2 * nk) * d, generator=g)
    pos = torch.randint(0, 100, (t,), generator=g)
    rot = RotaryEmbedding(d, 128, 10000.0)
    qw, kw = torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5
    expected_q = qkv[:, : nq * d].view(t, nq, d)
    expected_k = qkv[:, nq * d:(nq + nk) * d].view(t, nk, d)
    eq, ek = rms_norm_ref(expected_q, qw, 1e-6)[0], rms_norm_ref(expected_k, kw, 1e-6)[0]
    eq, ek = rot(pos, eq, ek)
    fused = qkv.clone()
    rope_qk_ref(fused, pos, rot.cos, rot.sin, nq, nk, d, qw, kw, 1e-6)
    torch.testing.assert_close(fused[:, : nq * d].view(t, nq, d), eq)
    torch.testing.assert_close(fused[:, nq * d:(nq + nk) * d].view(t, nk, d), ek)
    torch.testing.assert_close(fused[:, (nq + nk) * d:], qkv[:, (nq + nk) * d:])  # v untouched


@kernels
@pytest.mark.parametrize("n", [576, 4096, 5120])
def test_rms_norm_kernel(n):
    x = torch.randn(37, n, device=DEVICE, dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.rand(n, device=DEVICE, dtype=torch.bfloat16) + 0.5
    y, _ = rms_norm(x, w, 1e-6)
    assert rel_err(y, rms_norm_ref(x, w, 1e-6)[0]) < 1e-2
    y, res = rms_norm(x, w, 1e-6, r)
    ry, rres = rms_norm_ref(x, w, 1e-6, r)
    assert rel_err(y, ry) < 1e-2 and torch.equal(res, rres)


@kernels
def test_silu_mul_kernel():
    x = torch.randn(19, 2 * 12288, device=DEVICE, dtype=torch.bfloat16)
    assert rel_err(silu_mul(x), silu_mul_ref(x)) < 1e-2


@kernels
@pytest.mark.parametrize("nq,nk,d,norm", [(32, 8, 128, True), (9, 3, 64, False)])
def test_rope_kernel(nq, nk, d, norm):
    t = 33
    qkv = torch.randn(t, (nq + 2 * nk) * d, device=DEVICE, dtype=torch.bfloat16)
    pos = torch.randint(0, 4000, (t,), device=DEVICE)
    rot = RotaryEmbedding(d, 4096, 1e6).to(DEVICE)
    qw = torch.rand(d, device=DEVICE, dtype=torch.bfloat16) + 0.5 if norm else None
    kw = torch.rand(d, device=DEVICE, dtype=torch.bfloat16) + 0.5 if norm else None
    ours, ref = qkv.clone(), qkv.clone()
    rope_qk(ours, pos, rot.cos, rot.sin, nq, nk, d, qw, kw, 1e-6)
    rope_qk_ref(ref, pos, rot.cos, rot.sin, nq, nk, d, qw, kw, 1e-6)
    assert rel_err(ours, ref) < 1e-2


@kernels
@pytest.mark.parametrize("norm", [True, False])
def test_rope_kernel_writes_the_kv_cache(norm):
    """With caches, key heads land in their slot after norm + rotation, value heads as they are."""
    t, nq, nk, d, blocks, page = 5, 4, 2, 64, 6, 4
    qkv = torch.randn(t, (nq + 2 * nk) * d, device=DEVICE, dtype=torch.bfloat16)
    pos = torch.tensor([3, 7, 8, 20, 1], device=DEVICE)
    slots = torch.tensor([0, 9, 13, 22, 5], device=DEVICE)
    rot = RotaryEmbedding(d, 64, 1e4).to(DEVICE)
    qw = torch.rand(d, device=DEVICE, dtype=torch.bfloat16) + 0.5 if norm else None
    kw = torch.rand(d, device=DEVICE, dtype=torch.bfloat16) + 0.5 if norm else None
    caches = [torch.zeros(blocks, page, nk, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(4)]
    ours, ref = qkv.clone(), qkv.clone()
    rope_qk(ours, pos, rot.cos, rot.sin, nq, nk, d, qw, kw, 1e-6, caches[0], caches[1], slots)
    rope_qk_ref(ref, pos, rot.cos, rot.sin, nq, nk, d, qw, kw, 1e-6, caches[2], caches[3], slots)
    assert rel_err(ours, ref) < 1e-2
    assert rel_err(caches[0], caches[2]) < 1e-2 and torch.equal(caches[1], caches[3])
    flat_k = caches[0].view(-1, nk * d)
    torch.testing.assert_close(flat_k[slots], ours[:, nq * d:(nq + nk) * d])  # the rotated keys, exactly
    untouched = torch.ones(blocks * page, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert not flat_k[untouched.to(DEVICE)].any()


def test_rope_heads_reference_matches_gated_attention():
    """rope_heads_ref on the gated attention's fused q|k|v rows (q interleaved with its gate per head,
    zero-centred q/k norms, rotary on a quarter of each head) equals the module ops it replaces (fp32)."""
    from blockspec.kernels.rotary import NORM_ZERO_CENTERED, rope_heads_ref
    from blockspec.models.qwen3_next import ZeroCenteredRMSNorm

    t, nq, nk, d = 5, 4, 2, 32
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(t, (2 * nq + 2 * nk) * d, generator=g)
    pos = torch.randint(0, 60, (t,), generator=g)
    rot = RotaryEmbedding(d, 64, 1e4, rotary_dim=d // 4)
    qn, kn = ZeroCenteredRMSNorm(d), ZeroCenteredRMSNorm(d)
    with torch.no_grad():
        qn.weight.normal_(0, 0.3, generator=g)
        kn.weight.normal_(0, 0.3, generator=g)
    q, gate = qkv[:, : 2 * nq * d].view(t, nq, 2 * d).chunk(2, dim=-1)
    k = qkv[:, 2 * nq * d:(2 * nq + nk) * d].view(t, nk, d)
    eq, ek = rot(pos, qn(q), kn(k))
    fused = qkv.clone()
    rope_heads_ref(fused, pos, rot.cos, rot.sin, nq, nk, d, 2 * d, 2 * nq * d, (2 * nq + nk) * d,
                   NORM_ZERO_CENTERED, qn.weight, kn.weight, 1e-6)
    fq, fgate = fused[:, : 2 * nq * d].view(t, nq, 2 * d).chunk(2, dim=-1)
    torch.testing.assert_close(fq, eq)
    torch.testing.assert_close(fused[:, 2 * nq * d:(2 * nq + nk) * d].view(t, nk, d), ek)
    assert torch.equal(fgate, gate) and torch.equal(fused[:, (2 * nq + nk) * d:], qkv[:, (2 * nq + nk) * d:])


@kernels
@pytest.mark.parametrize("norm,rot_div,store", [(2, 4, True), (1, 1, False), (0, 2, True)])
def test_rope_heads_kernel(norm, rot_div, store):
    """The kernel against its reference: strided query heads, partial rotary, each norm, the cache write."""
    from blockspec.kernels.rotary import rope_heads, rope_heads_ref

    t, nq, nk, d, blocks, page = 6, 4, 2, 64, 5, 4
    qkv = torch.randn(t, (2 * nq + 2 * nk) * d, device=DEVICE, dtype=torch.bfloat16)
    pos = torch.randint(0, 60, (t,), device=DEVICE)
    slots = torch.randperm(blocks * page, device=DEVICE)[:t]
    rot = RotaryEmbedding(d, 64, 1e4, rotary_dim=d // rot_div).to(DEVICE)
    qw = torch.randn(d, device=DEVICE, dtype=torch.bfloat16) * 0.3 + (1.0 if norm == 1 else 0.0)
    kw = torch.randn(d, device=DEVICE, dtype=torch.bfloat16) * 0.3 + (1.0 if norm == 1 else 0.0)
    caches = [torch.zeros(blocks, page, nk, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(4)]
    args = (pos, rot.cos, rot.sin, nq, nk, d, 2 * d, 2 * nq * d, (2 * nq + nk) * d, norm, qw, kw, 1e-6)
    ours, ref = qkv.clone(), qkv.clone()
    rope_heads(ours, *args, *((caches[0], caches[1], slots) if store else ()))
    rope_heads_ref(ref, *args, *((caches[2], caches[3], slots) if store else ()))
    assert rel_err(ours, ref) < 1e-2
    if store:
        assert rel_err(caches[0], caches[2]) < 1e-2 and torch.equal(caches[1], caches[3])
