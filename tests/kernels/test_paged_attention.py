"""The paged decode/verify attention kernel against its references on random inputs."""

from __future__ import annotations

import pytest
import torch

from blockspec.kernels._triton import kernel_device
from blockspec.kernels.paged_attention import paged_attention, paged_attention_ref
from blockspec.models.layers.attention import AttentionMetadata, paged_attention_reference

DEVICE = kernel_device()


def random_case(device, dtype, batch, q_len, heads, kv_heads, head_dim, page=16, max_len=300, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    seq_lens = torch.randint(q_len, max_len, (batch,), generator=g)
    max_blocks = -(-max_len // page)
    num_blocks = batch * max_blocks + 1
    perm = torch.randperm(num_blocks - 1, generator=g)
    tables = perm[: batch * max_blocks].view(batch, max_blocks)
    k_cache = torch.randn(num_blocks, page, kv_heads, head_dim, generator=g).to(device, dtype)
    v_cache = torch.randn(num_blocks, page, kv_heads, head_dim, generator=g).to(device, dtype)
    q = torch.randn(batch * q_len, heads, head_dim, generator=g).to(device, dtype)
    kv_start = torch.stack([torch.randint(0, int(n) - q_len + 1, (1,), generator=g)[0] for n in seq_lens])
    return q, k_cache, v_cache, tables.to(device), seq_lens.to(device), kv_start.to(device)


def test_reference_matches_gather_reference():
    """The uniform-batch reference agrees with the general masked-gather attention (causal, no window)."""
    q_len, heads, kv_heads, d, page = 4, 6, 2, 16, 16
    q, kc, vc, tables, seq_lens, _ = random_case("cpu", torch.float32, 3, q_len, heads, kv_heads, d, page)
    zeros = torch.zeros_like(seq_lens)
    ours = paged_attention_ref(q, kc, vc, tables, seq_lens, zeros, q_len, d**-0.5, causal=True)
    lmax = int(seq_lens.max())
    pos = torch.arange(lmax)
    kv_slots = tables[:, pos // page] * page + pos % page
    query_pos = seq_lens[:, None] - q_len + torch.arange(q_len)[None]
    mask = (pos[None, None, :] <= query_pos[:, :, None]) & (pos[None, None, :] < seq_lens[:, None, None])
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long),
                             query_index=torch.arange(3 * q_len).view(3, q_len),
                             query_unpad=torch.arange(3 * q_len), kv_slots=kv_slots, mask=mask[:, None])
    ref = paged_attention_reference(q, kc, vc, meta, d**-0.5).view_as(ours)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_matches_per_head_definition(causal):
    """Query head h reads KV head h // group; keys from kv_start on (and up to the query with causal)."""
    q_len, heads, kv_heads, d, page = 3, 6, 2, 8, 16
    q, kc, vc, tables, seq_lens, kv_start = random_case("cpu", torch.float32, 2, q_len, heads, kv_heads, d, page)
    ours = paged_attention_ref(q, kc, vc, tables, seq_lens, kv_start, q_len, d**-0.5, causal)
    for b in range(2):
        n, start = int(seq_lens[b]), int(kv_start[b])
        keys = kc[tables[b]].flatten(0, 1)[:n]
        values = vc[tables[b]].flatten(0, 1)[:n]
        for i in range(q_len):
            last = n - q_len + i if causal else n - 1
            for h in range(heads):
                kv = h // (heads // kv_heads)
                w = (keys[start:last + 1, kv] @ q[b * q_len + i, h] * d**-0.5).softmax(0)
                torch.testing.assert_close(ours[b * q_len + i, h], w @ values[start:last + 1, kv],
                                           rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(DEVICE is None, reason="Triton kernel needs a CUDA GPU (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("batch,q_len,heads,kv_heads,head_dim", [
    (1, 1, 32, 8, 128), (1, 16, 32, 8, 128), (3, 16, 9, 3, 64), (4, 8, 16, 16, 64), (2, 1, 14, 2, 64)])
@pytest.mark.parametrize("causal", [True, False])
def test_triton_matches_reference(batch, q_len, heads, kv_heads, head_dim, causal):
    for seed in range(2):
        q, kc, vc, tables, seq_lens, kv_start = random_case(DEVICE, torch.bfloat16, batch, q_len, heads, kv_heads,
                                                             head_dim, max_len=1200, seed=seed)
        if causal:
            kv_start.zero_()
        out = paged_attention(q, kc, vc, tables, seq_lens, kv_start, q_len, head_dim**-0.5, causal)
        ref = paged_attention_ref(q, kc, vc, tables, seq_lens, kv_start, q_len, head_dim**-0.5, causal)
        err = (out.float() - ref.float()).norm() / ref.float().norm()
        assert err < 1e-2, err
        assert torch.isfinite(out).all()



def window_case(device, dtype, batch, q_len, heads, kv_heads, head_dim, seed=0):
    """A case with a short block per row (q_start: its first query's position) and a sliding window."""
    q, kc, vc, tables, seq_lens, kv_start = random_case(device, dtype, batch, q_len, heads, kv_heads, head_dim,
                                                         max_len=600, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    shorter = torch.randint(0, q_len, (batch,), generator=g).to(seq_lens.device)
    q_start = seq_lens - q_len  # the row's block ends `shorter` keys before seq_len: drop those keys
    return q, kc, vc, tables, seq_lens - shorter, kv_start.zero_(), q_start


@pytest.mark.parametrize("causal", [True, False])
def test_window_and_q_start_match_per_head_definition(causal):
    """Sliding window: query at p sees keys k with p - k < W (and k - p < W without causal); with q_start the
    queries sit at q_start + i whatever seq_len is (a block shorter than q_len)."""
    q_len, heads, kv_heads, d, window = 4, 4, 2, 8, 37
    q, kc, vc, tables, seq_lens, kv_start, q_start = window_case("cpu", torch.float32, 3, q_len, heads, kv_heads, d)
    ours = paged_attention_ref(q, kc, vc, tables, seq_lens, kv_start, q_len, d**-0.5, causal, window, q_start)
    for b in range(3):
        n = int(seq_lens[b])
        keys = kc[tables[b]].flatten(0, 1)[:n]
        values = vc[tables[b]].flatten(0, 1)[:n]
        for i in range(q_len):
            p = int(q_start[b]) + i
            last = min(p, n - 1) if causal else n - 1
            if last < p - window + 1:
                continue  # a padding query past the block's end sees nothing
            first = max(0, p - window + 1)
            for h in range(heads):
                kv = h // (heads // kv_heads)
                w = (keys[first:last + 1, kv] @ q[b * q_len + i, h] * d**-0.5).softmax(0)
                torch.testing.assert_close(ours[b * q_len + i, h], w @ values[first:last + 1, kv],
                                           rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(DEVICE is None, reason="Triton kernel needs a CUDA GPU (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("causal", [True, False])
def test_triton_window_matches_reference(causal):
    q_len, heads, kv_heads, d = 8, 8, 2, 64
    for window in (5, 70):
        q, kc, vc, tables, seq_lens, kv_start, q_start = window_case(DEVICE, torch.bfloat16, 3, q_len, heads,
                                                                     kv_heads, d, seed=window)
        out = paged_attention(q, kc, vc, tables, seq_lens, kv_start, q_len, d**-0.5, causal, window=window,
                              q_start=q_start)
        ref = paged_attention_ref(q, kc, vc, tables, seq_lens, kv_start, q_len, d**-0.5, causal, window, q_start)
        real = torch.cat([torch.arange(b * q_len, b * q_len + int(seq_lens[b] - q_start[b])) for b in range(3)])
        err = (out[real].float() - ref[real].float()).norm() / ref[real].float().norm()
        assert err < 1e-2, err
