"""Fused RMSNorm(+residual), SwiGLU and q/k-norm+rotary kernels against their PyTorch references."""

from __future__ import annotations

import pytest
import torch

from blockspec.kernels.activation import silu_mul, silu_mul_ref
from blockspec.kernels.rms_norm import rms_norm, rms_norm_ref
from blockspec.kernels.rotary import rope_qk, rope_qk_ref
from blockspec.models.layers.rotary import RotaryEmbedding

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton kernels need a CUDA GPU")


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


@cuda
@pytest.mark.parametrize("n", [576, 4096, 5120])
def test_rms_norm_kernel(n):
    x = torch.randn(37, n, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
    y, _ = rms_norm(x, w, 1e-6)
    assert rel_err(y, rms_norm_ref(x, w, 1e-6)[0]) < 1e-2
    y, res = rms_norm(x, w, 1e-6, r)
    ry, rres = rms_norm_ref(x, w, 1e-6, r)
    assert rel_err(y, ry) < 1e-2 and torch.equal(res, rres)


@cuda
def test_silu_mul_kernel():
    x = torch.randn(19, 2 * 12288, device="cuda", dtype=torch.bfloat16)
    assert rel_err(silu_mul(x), silu_mul_ref(x)) < 1e-2


@cuda
@pytest.mark.parametrize("nq,nk,d,norm", [(32, 8, 128, True), (9, 3, 64, False)])
def test_rope_kernel(nq, nk, d, norm):
    t = 33
    qkv = torch.randn(t, (nq + 2 * nk) * d, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 4000, (t,), device="cuda")
    rot = RotaryEmbedding(d, 4096, 1e6).cuda()
    qw = torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5 if norm else None
    kw = torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5 if norm else None
    ours, ref = qkv.clone(), qkv.clone()
    rope_qk(ours, pos, rot.cos, rot.sin, nq, nk, d, qw, kw, 1e-6)
    rope_qk_ref(ref, pos, rot.cos, rot.sin, nq, nk, d, qw, kw, 1e-6)
    assert rel_err(ours, ref) < 1e-2
