"""PagedAttention's paths agree: masked gather (reference), uniform decode kernel, fresh-prefill SDPA."""

from __future__ import annotations

import pytest
import torch

from blockspec.models.layers.attention import (
    AttentionMetadata,
    DecodeMetadata,
    PagedAttention,
    forward_context,
    paged_attention_reference,
    tail_prefill_attention,
)


def _layer(num_blocks=8, page=16, heads=4, kv_heads=2, d=16):
    layer = PagedAttention(heads, kv_heads, d, d**-0.5)
    layer.k_cache = torch.zeros(num_blocks, page, kv_heads, d)
    layer.v_cache = torch.zeros(num_blocks, page, kv_heads, d)
    return layer


def test_fresh_prefill_equals_masked_gather():
    g = torch.Generator().manual_seed(0)
    t, heads, kv_heads, d, page = 37, 4, 2, 16, 16
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (heads, kv_heads, kv_heads))
    blocks = [5, 1, 6]
    slots = torch.tensor([blocks[i // page] * page + i % page for i in range(t)])
    pos = torch.arange(t)
    common = dict(slot_mapping=slots, query_index=torch.arange(t)[None], query_unpad=torch.arange(t),
                  kv_slots=slots[None], mask=(pos[None, :] <= pos[:, None])[None, None])
    outs = []
    for fresh in (False, True):
        layer = _layer()
        with forward_context(AttentionMetadata(**common, fresh_prefill=fresh)):
            outs.append(layer(q, k, v))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_decode_metadata_equals_masked_gather():
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, d, page, ctx, q_len = 4, 2, 16, 16, 30, 5
    layer = _layer()
    blocks = [2, 7, 4]
    past = torch.randn(ctx, kv_heads, d, generator=g), torch.randn(ctx, kv_heads, d, generator=g)
    all_slots = torch.tensor([blocks[i // page] * page + i % page for i in range(ctx + q_len)])
    layer.k_cache.view(-1, kv_heads, d)[all_slots[:ctx]] = past[0]
    layer.v_cache.view(-1, kv_heads, d)[all_slots[:ctx]] = past[1]
    q, k, v = (torch.randn(q_len, h, d, generator=g) for h in (heads, kv_heads, kv_heads))
    new = all_slots[ctx:]
    total = ctx + q_len
    pos = torch.arange(total)
    qpos = torch.arange(ctx, total)
    gather = AttentionMetadata(slot_mapping=new, query_index=torch.arange(q_len)[None], query_unpad=torch.arange(q_len),
                               kv_slots=all_slots[None], mask=(pos[None, :] <= qpos[:, None])[None, None])
    decode = AttentionMetadata(slot_mapping=new, decode=DecodeMetadata(
        torch.tensor([blocks]), torch.tensor([total]), torch.tensor([0]), q_len))
    outs = []
    for meta in (gather, decode):
        with forward_context(meta):
            outs.append(layer(q, k, v))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_tail_prefill_equals_masked_gather():
    """A sequence's last T tokens over its cached context (prefix hit, later chunk): the bottom-right causal
    SDPA the GPU takes equals the masked gather (the CPU path), including one query and a whole-sequence tail."""
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, d, page = 4, 2, 16, 16
    blocks = [3, 0, 5, 2]
    for ctx, t in ((40, 9), (40, 1), (0, 23)):
        n = ctx + t
        kc, vc = torch.randn(8, page, kv_heads, d, generator=g), torch.randn(8, page, kv_heads, d, generator=g)
        q = torch.randn(t, heads, d, generator=g)
        slots = torch.tensor([blocks[i // page] * page + i % page for i in range(n)])
        pos = torch.arange(ctx, n)
        meta = AttentionMetadata(slot_mapping=slots[ctx:], query_index=torch.arange(t)[None],
                                 query_unpad=torch.arange(t), kv_slots=slots[None],
                                 mask=(torch.arange(n)[None, :] <= pos[:, None])[None, None])
        want = paged_attention_reference(q, kc, vc, meta, d**-0.5)
        got = tail_prefill_attention(q, kc, vc, slots[None], d**-0.5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention's forward needs a CUDA GPU")
def test_tail_prefill_flash_route_matches_reference_gpu():
    """On the GPU (bf16) a hit's attention takes aten's flash forward on q as a strided view of the fused q|k|v
    rows, grouped KV heads and bottom-right causal alignment included: equal to the fp32 masked gather."""
    g = torch.Generator(device="cuda").manual_seed(3)
    heads, kv_heads, d, page, ctx, t = 8, 2, 128, 16, 300, 37
    n = ctx + t
    kc = torch.randn(40, page, kv_heads, d, generator=g, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(40, page, kv_heads, d, generator=g, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(40, generator=g, device="cuda")[: -(-n // page)]
    slots = (table[:, None] * page + torch.arange(page, device="cuda")).flatten()[:n]
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, : heads * d].view(t, heads, d)
    pos = torch.arange(ctx, n, device="cuda")
    meta = AttentionMetadata(slot_mapping=slots[ctx:], query_index=torch.arange(t, device="cuda")[None],
                             query_unpad=torch.arange(t, device="cuda"), kv_slots=slots[None],
                             mask=(torch.arange(n, device="cuda")[None, :] <= pos[:, None])[None, None])
    want = paged_attention_reference(q.float(), kc.float(), vc.float(), meta, d**-0.5)
    with torch.inference_mode():
        got = tail_prefill_attention(q, kc, vc, slots[None], d**-0.5)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
