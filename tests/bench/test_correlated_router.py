"""bench/correlated_router.py: the correlated router's definition, and its Triton launch against it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from correlated_router import correlated_router, correlated_router_ref  # noqa: E402

from blockspec.kernels._triton import kernel_device  # noqa: E402

DEVICE = kernel_device()


def test_correlated_router_shares_experts():
    logits = torch.randn(16, 32)
    for share, keep in ((0.5, 4), (0.0, 0), (1.0, 8), (0.3, 2)):
        route = correlated_router(8, 32, share, renormalize=True)
        weights, ids = route(logits)
        assert route.keep == keep and ids.dtype == torch.int64 and ids.shape == weights.shape == (16, 8)
        assert all(len(set(row)) == 8 for row in ids.tolist())  # k distinct experts per token
        rows = [set(row) for row in ids.tolist()]
        assert all(len(a & b) >= keep for a, b in zip(rows, rows[1:]))
        assert torch.allclose(weights.sum(-1), torch.ones(16))
        probs = F.softmax(logits, -1)
        got = probs.gather(1, ids)
        assert torch.allclose(weights, got / got.sum(-1, keepdim=True))
    first, _ = correlated_router(8, 32, 0.5, True)(logits[:1])
    assert first.shape == (1, 8)


def test_correlated_router_refuses_uneven_lanes():
    with pytest.raises(ValueError, match="divisible"):
        correlated_router(8, 30, 0.5, True)


@pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU, or Triton with TRITON_INTERPRET=1")
@pytest.mark.parametrize("t,e,k,share,renorm,dtype", [(16, 128, 8, 0.5, True, torch.bfloat16),
                                                      (16, 256, 8, 0.5, True, torch.float32),
                                                      (5, 32, 4, 0.0, False, torch.float32),
                                                      (9, 64, 8, 1.0, True, torch.float32),
                                                      (33, 64, 8, 0.3, True, torch.bfloat16)])
def test_kernel_matches_definition(t, e, k, share, renorm, dtype):
    from correlated_router import correlated_router_triton, keep_of

    g = torch.Generator().manual_seed(t)
    logits = torch.randn(t, e, generator=g).to(dtype=dtype, device=DEVICE)
    with torch.no_grad():
        w, ids = correlated_router_triton(logits, k, keep_of(k, share), renorm)
    want_w, want_ids = correlated_router_ref(logits, k, keep_of(k, share), renorm)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)
