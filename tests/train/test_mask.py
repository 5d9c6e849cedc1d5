"""The DFlash training mask against a brute-force reading of its definition (DESIGN.md §1)."""

from __future__ import annotations

import pytest
import torch

from blockspec.train.mask import BlockAttention, block_mask_mod, dense_block_mask


def brute_force_mask(anchors: list[list[int]], ctx_len: int, block: int) -> torch.Tensor:
    """Query (block i, offset j) sees context key t iff t < anchor_i, and block key (i', j') iff i' == i."""
    n, a = len(anchors), len(anchors[0])
    out = torch.zeros(n, 1, a * block, ctx_len + a * block, dtype=torch.bool)
    for b in range(n):
        for q in range(a * block):
            qi = q // block
            for kv in range(ctx_len + a * block):
                if kv < ctx_len:
                    out[b, 0, q, kv] = kv < anchors[b][qi]
                else:
                    out[b, 0, q, kv] = (kv - ctx_len) // block == qi
    return out


CASES = [([[3, 5, 9]], 12, 4), ([[0, 2], [7, 7]], 10, 3), ([[1, 4, 6, 11], [0, 0, 0, 0]], 13, 5)]


@pytest.mark.parametrize("anchors,ctx_len,block", CASES)
def test_dense_mask_matches_brute_force(anchors, ctx_len, block):
    got = dense_block_mask(torch.tensor(anchors), ctx_len, block)
    assert torch.equal(got, brute_force_mask(anchors, ctx_len, block))


@pytest.mark.parametrize("anchors,ctx_len,block", CASES)
def test_flex_mask_mod_matches_brute_force(anchors, ctx_len, block):
    from torch.nn.attention.flex_attention import create_mask

    a = torch.tensor(anchors)
    n, q = a.shape[0], a.shape[1] * block
    got = create_mask(block_mask_mod(a, ctx_len, block), n, 1, q, ctx_len + q, device="cpu")
    assert torch.equal(got, brute_force_mask(anchors, ctx_len, block))


def test_every_query_sees_its_own_block_and_nothing_after_its_anchor():
    anchors = torch.tensor([[0, 4, 8]])
    m = dense_block_mask(anchors, 10, 4)[0, 0]
    assert m.any(dim=-1).all()  # no empty row, padding anchors included
    assert not m[4:8, 4:10].any()  # block 1 (anchor 4) sees context 0..3 only


def test_flex_attention_matches_dense_sdpa():
    """The GPU path (flex_attention, BlockMask) computes the same attention as the CPU reference."""
    torch.manual_seed(0)
    anchors = torch.tensor([[2, 5, 9], [0, 3, 3]])
    ctx_len, block, heads, kv_heads, d = 12, 4, 4, 2, 8
    q = torch.randn(2, heads, 3 * block, d)
    k = torch.randn(2, kv_heads, ctx_len + 3 * block, d)
    v = torch.randn(2, kv_heads, ctx_len + 3 * block, d)
    dense = BlockAttention(anchors, ctx_len, block, "sdpa")(q, k, v, d**-0.5)
    flex = BlockAttention(anchors, ctx_len, block, "flex", compiled=False)(q, k, v, d**-0.5)
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
