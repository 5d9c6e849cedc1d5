"""The paged decode/verify and ragged prefill attention kernels against their references on random inputs,
with and without GPT-OSS's attention sinks and sliding window (the references against a per-head loop)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from blockspec.kernels import paged_attention as pa
from blockspec.kernels._triton import kernel_device
from blockspec.kernels.paged_attention import (
    paged_attention,
    paged_attention_ref,
    ragged_paged_attention,
    ragged_paged_attention_ref,
    split_count,
)
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
    (1, 1, 32, 8, 128), (1, 16, 32, 8, 128), (3, 16, 9, 3, 64), (4, 8, 16, 16, 64), (2, 1, 14, 2, 64),
    (1, 16, 24, 4, 256)])  # the last: Qwen3.6-27B's verify, 96 rows a KV head in three row tiles
@pytest.mark.parametrize("causal", [True, False])
def test_triton_matches_reference(batch, q_len, heads, kv_heads, head_dim, causal):
    for seed in range(2):
        q, kc, vc, tables, seq_lens, kv_start = random_case(DEVICE, torch.bfloat16, batch, q_len, heads, kv_heads,
                                                             head_dim, max_len=1200, seed=seed)
        if causal:
            kv_start.zero_()
        # without grad the kernel runs (with grad, paged_attention takes the reference); the interpreter only
        # covers the small cases of the sink/window test below
        with torch.no_grad() if DEVICE == "cuda" else contextlib.nullcontext():
            out = paged_attention(q, kc, vc, tables, seq_lens, kv_start, q_len, head_dim**-0.5, causal)
        ref = paged_attention_ref(q, kc, vc, tables, seq_lens, kv_start, q_len, head_dim**-0.5, causal)
        err = (out.float() - ref.float()).norm() / ref.float().norm()
        assert err < 1e-2, err
        assert torch.isfinite(out).all()


def test_split_count_fills_the_gpu(monkeypatch):
    """Few programs (batch 1, a few KV heads, decode or verify rows) take up to 64 splits (two programs an SM);
    many programs and the CPU keep 8."""
    monkeypatch.setattr(pa, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    assert split_count(cuda, 4) == 64  # Qwen3-Coder-30B decode: 4 KV heads
    assert split_count(cuda, 24) == 11  # 24 programs: 264 / 24
    assert split_count(cuda, 128) == 8  # batch 16 x 8 KV heads already fills it
    assert split_count(cuda, 12, rows=96) == 22  # a 27B verify block: 4 KV heads x 3 row tiles
    assert split_count(cuda, 8, rows=128) == 32  # a Coder-30B verify block (4 KV heads x 2 row tiles): capped
    assert split_count(cuda, 8, rows=8) == 33  # the same programs as decode rows
    assert split_count(torch.device("cpu"), 4) == 8


@pytest.mark.skipif(DEVICE is None, reason="Triton kernel needs a CUDA GPU (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("splits", [1, 32, 64])
def test_many_splits_match_reference(splits):
    """32 or 64 splits over contexts of 1 to 70 keys leave most splits empty (-inf partials the merge must weigh 0);
    over 300 keys every split holds one 64-key tile or none; decode rows (q_len 1) as the decode path runs."""
    if DEVICE == "cpu" and splits == 32:
        # the same programs as 64 splits (empty splits, one tile or none a split), half as many
        pytest.skip("32 splits run on the GPU (the suite's time under TRITON_INTERPRET=1)")
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    for max_len, seed in ((3, 0), (70, 1), (300, 2)):
        q, kc, vc, tables, seq_lens, kv_start = random_case(DEVICE, dtype, 2, 1, 8, 2, 128, max_len=max_len,
                                                             seed=seed)
        kv_start.zero_()
        with torch.no_grad():
            out = paged_attention(q, kc, vc, tables, seq_lens, kv_start, 1, 128**-0.5, True, num_splits=splits)
        ref = paged_attention_ref(q, kc, vc, tables, seq_lens, kv_start, 1, 128**-0.5, True)
        assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 1e-2


@pytest.mark.skipif(DEVICE is None, reason="Triton kernel needs a CUDA GPU (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("causal", [True, False])
def test_row_tiles_match_reference(causal):
    """Rows of one KV head beyond one tile (6 queries x 6 heads of head_dim 256: tiles of 32 rows, the second
    partly padding) run as several programs and merge like one."""
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    q, kc, vc, tables, seq_lens, kv_start = random_case(DEVICE, dtype, 2, 6, 12, 2, 256, max_len=70, seed=3)
    if causal:
        kv_start.zero_()
    with torch.no_grad():
        out = paged_attention(q, kc, vc, tables, seq_lens, kv_start, 6, 256**-0.5, causal)
    ref = paged_attention_ref(q, kc, vc, tables, seq_lens, kv_start, 6, 256**-0.5, causal)
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 1e-2


@pytest.mark.skipif(DEVICE is None, reason="Triton kernel needs a CUDA GPU (or TRITON_INTERPRET=1)")
def test_strided_q_and_output_gate_match_reference():
    """Qwen3.5 gated attention on the decode path: q and the gate as strided views of one fused projection
    ([q | gate] per head), the kernel reading q by strides and gating its output in the merge launch; equal to
    the reference on contiguous q times sigmoid(gate), and to the ungated kernel output times sigmoid(gate)."""
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    batch, q_len, heads, kv_heads, d = 2, 3, 8, 2, 64
    _, kc, vc, tables, seq_lens, kv_start = random_case(DEVICE, dtype, batch, q_len, heads, kv_heads, d, max_len=90,
                                                         seed=5)
    kv_start.zero_()
    g = torch.Generator(device="cpu").manual_seed(6)
    fused = torch.randn(batch * q_len, heads, 2 * d, generator=g).to(DEVICE, dtype)
    q, gate = fused.chunk(2, dim=-1)
    assert not q.is_contiguous()
    with torch.no_grad():
        out = paged_attention(q, kc, vc, tables, seq_lens, kv_start, q_len, d**-0.5, True, gate=gate)
        plain = paged_attention(q, kc, vc, tables, seq_lens, kv_start, q_len, d**-0.5, True)
    ref = paged_attention_ref(q.contiguous(), kc, vc, tables, seq_lens, kv_start, q_len, d**-0.5, True)
    want = ref * torch.sigmoid(gate)
    assert float((out.float() - want.float()).norm() / want.float().norm()) < 1e-2
    torch.testing.assert_close(out, plain * torch.sigmoid(gate))  # rounded as the ops (sigmoid's last bits aside)


@pytest.mark.skipif(DEVICE is None, reason="Triton kernel needs a CUDA GPU (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("window", [None, 40])
def test_merge_reads_only_the_splits_with_keys(monkeypatch, window):
    """Splits past a short context store nothing and the merge reads only the ones with keys: with the partial
    buffers poisoned (NaN), every output is still finite and equal to the reference, with sinks, the output gate
    and a sliding window (whose earlier tiles no split holds)."""
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    d, heads, kv_heads = (16, 8, 2) if DEVICE == "cpu" else (128, 32, 4)
    q, kc, vc, tables, seq_lens, _ = random_case(DEVICE, dtype, 3, 1, heads, kv_heads, d, max_len=200, seed=7)
    zeros = torch.zeros_like(seq_lens)
    gate = torch.randn_like(q)
    sinks = torch.randn(heads, device=DEVICE)
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: empty_like(*a, **k).fill_(float("nan")))
    with torch.no_grad():
        out = paged_attention(q, kc, vc, tables, seq_lens, zeros, 1, d**-0.5, True, num_splits=64, sinks=sinks,
                              window=window, gate=gate)
    monkeypatch.undo()
    ref = paged_attention_ref(q, kc, vc, tables, seq_lens, zeros, 1, d**-0.5, True, sinks, window) * torch.sigmoid(gate)
    assert torch.isfinite(out).all()
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 1e-2


def attend_one(keys: torch.Tensor, values: torch.Tensor, q: torch.Tensor, scale: float,
               sink: torch.Tensor | None) -> torch.Tensor:
    """One query head over its visible keys [n, D]; a sink is one more logit whose value is zero."""
    scores = keys @ q * scale
    if sink is None:
        return scores.softmax(0) @ values
    return torch.cat([scores, sink.reshape(1)]).softmax(0)[:-1] @ values


@pytest.mark.parametrize("q_len", [1, 5])
def test_sinks_and_window_reference_matches_per_head_definition(q_len):
    """Query at position p sees keys in (p - window, p]; the sink joins each head's softmax."""
    heads, kv_heads, d, window = 6, 2, 8, 7
    q, kc, vc, tables, seq_lens, _ = random_case("cpu", torch.float32, 2, q_len, heads, kv_heads, d, max_len=60)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(9))
    zeros = torch.zeros_like(seq_lens)
    ours = paged_attention_ref(q, kc, vc, tables, seq_lens, zeros, q_len, d**-0.5, True, sinks, window)
    for b in range(2):
        n = int(seq_lens[b])
        keys, values = kc[tables[b]].flatten(0, 1)[:n], vc[tables[b]].flatten(0, 1)[:n]
        for i in range(q_len):
            p = n - q_len + i
            lo = max(0, p - window + 1)
            for h in range(heads):
                kv = h // (heads // kv_heads)
                want = attend_one(keys[lo:p + 1, kv], values[lo:p + 1, kv], q[b * q_len + i, h], d**-0.5, sinks[h])
                torch.testing.assert_close(ours[b * q_len + i, h], want, rtol=1e-5, atol=1e-5)


def ragged_case(spans: list[tuple[int, int]], heads: int, kv_heads: int, d: int, page: int = 16, seed: int = 0):
    """Sequences (context already cached, new tokens) over scattered blocks, described as the runner's general
    path does: padded query index and positions, the slot of every key position, the unpad index."""
    g = torch.Generator().manual_seed(seed)
    lmax = max(c + n for c, n in spans)
    per_seq = -(-lmax // page)
    num_blocks = len(spans) * per_seq + 1
    tables = torch.randperm(num_blocks, generator=g)[: len(spans) * per_seq].view(len(spans), per_seq)
    kc, vc = (torch.randn(num_blocks, page, kv_heads, d, generator=g) for _ in range(2))
    q = torch.randn(sum(n for _, n in spans), heads, d, generator=g)
    qmax = max(n for _, n in spans)
    index, pos, slots, unpad, off = [], [], [], [], 0
    for b, (c, n) in enumerate(spans):
        index.append([off + i for i in range(n)] + [off] * (qmax - n))
        pos.append([c + i for i in range(n)] + [c] * (qmax - n))
        seq_slots = [int(tables[b, p // page]) * page + p % page for p in range(c + n)]
        slots.append(seq_slots + [0] * (lmax - len(seq_slots)))
        unpad += [b * qmax + i for i in range(n)]
        off += n
    return q, kc, vc, *(torch.tensor(x) for x in (index, pos, slots, unpad))


SPANS = [(0, 21), (33, 5), (10, 1), (70, 3)]  # a fresh prefill, prefill chunks after cached context, decodes


@pytest.mark.parametrize("window,with_sinks", [(None, False), (None, True), (6, False), (6, True)])
def test_ragged_reference_matches_per_head_definition(window, with_sinks):
    heads, kv_heads, d = 6, 2, 8
    q, kc, vc, index, pos, slots, unpad = ragged_case(SPANS, heads, kv_heads, d)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(4)) if with_sinks else None
    ours = ragged_paged_attention_ref(q, kc, vc, index, pos, slots, unpad, d**-0.5, sinks, window)
    flat_k, flat_v = kc.view(-1, kv_heads, d), vc.view(-1, kv_heads, d)
    tok = 0
    for b, (c, n) in enumerate(SPANS):
        for i in range(n):
            p = c + i
            seen = slots[b, 0 if window is None else max(0, p - window + 1):p + 1]
            for h in range(heads):
                kv = h // (heads // kv_heads)
                want = attend_one(flat_k[seen, kv], flat_v[seen, kv], q[tok, h], d**-0.5,
                                  None if sinks is None else sinks[h])
                torch.testing.assert_close(ours[tok, h], want, rtol=1e-5, atol=1e-5)
            tok += 1


def test_ragged_reference_without_sinks_or_window_is_the_gather_reference():
    heads, kv_heads, d = 4, 2, 16
    q, kc, vc, index, pos, slots, unpad = ragged_case(SPANS, heads, kv_heads, d, seed=2)
    key = torch.arange(slots.shape[1])
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), query_index=index, query_unpad=unpad,
                             kv_slots=slots, mask=(key[None, None, :] <= pos[:, :, None])[:, None])
    want = paged_attention_reference(q, kc, vc, meta, d**-0.5).view_as(q)
    torch.testing.assert_close(ragged_paged_attention_ref(q, kc, vc, index, pos, slots, unpad, d**-0.5), want,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(DEVICE is None, reason="Triton kernel needs a CUDA GPU (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("q_len,heads,kv_heads,window", [(1, 8, 2, 7), (5, 4, 2, 7), (8, 4, 2, None)])
def test_triton_sinks_and_window_match_reference(q_len, heads, kv_heads, window):
    """Decode (q_len 1) and verify blocks: the window skips whole tiles, the sink joins the split merge."""
    d = 16 if DEVICE == "cpu" else 64
    max_len = 100 if DEVICE == "cpu" else 1200
    q, kc, vc, tables, seq_lens, _ = random_case(DEVICE, torch.float32 if DEVICE == "cpu" else torch.bfloat16, 2,
                                                 q_len, heads, kv_heads, d, max_len=max_len, seed=3)
    zeros = torch.zeros_like(seq_lens)
    sinks = torch.randn(heads, device=DEVICE)
    for s in (None, sinks):
        with torch.no_grad():  # the kernels are inference-only: with grad the references run
            out = paged_attention(q, kc, vc, tables, seq_lens, zeros, q_len, d**-0.5, True, sinks=s, window=window)
        ref = paged_attention_ref(q, kc, vc, tables, seq_lens, zeros, q_len, d**-0.5, True, s, window)
        err = (out.float() - ref.float()).norm() / ref.float().norm()
        assert err < (1e-5 if DEVICE == "cpu" else 1e-2), err


@pytest.mark.skipif(DEVICE is None, reason="Triton kernel needs a CUDA GPU (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("heads,kv_heads,window", [(6, 2, 6), (8, 1, None), (4, 4, 3)])
def test_triton_ragged_matches_reference(heads, kv_heads, window):
    d = 16 if DEVICE == "cpu" else 64
    spans = SPANS if DEVICE == "cpu" else [(0, 700), (1000, 300), (40, 1), (129, 17)]
    q, kc, vc, index, pos, slots, unpad = (t.to(DEVICE) for t in ragged_case(spans, heads, kv_heads, d, seed=5))
    if DEVICE == "cuda":
        q, kc, vc = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
    sinks = torch.randn(heads, device=DEVICE)
    for s in (None, sinks):
        with torch.no_grad():
            out = ragged_paged_attention(q, kc, vc, index, pos, slots, unpad, d**-0.5, s, window)
        ref = ragged_paged_attention_ref(q, kc, vc, index, pos, slots, unpad, d**-0.5, s, window)
        err = (out.float() - ref.float()).norm() / ref.float().norm()
        assert err < (1e-5 if DEVICE == "cpu" else 1e-2), err


def window_case(device, dtype, batch, q_len, heads, kv_heads, head_dim, max_len=600, seed=0):
    """A case with a short block per row (q_start: its first query's position), as DFlash 2 drafter blocks
    that draft fewer than q_len - 1 tokens: seq_len ends at the block's last real query."""
    q, kc, vc, tables, seq_lens, kv_start = random_case(device, dtype, batch, q_len, heads, kv_heads, head_dim,
                                                         max_len=max_len, seed=seed)
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
    ours = paged_attention_ref(q, kc, vc, tables, seq_lens, kv_start, q_len, d**-0.5, causal, window=window,
                               q_start=q_start)
    for b in range(3):
        n = int(seq_lens[b])
        keys = kc[tables[b]].flatten(0, 1)[:n]
        values = vc[tables[b]].flatten(0, 1)[:n]
        for i in range(q_len):
            p = int(q_start[b]) + i
            last = min(p, n - 1) if causal else min(p + window - 1, n - 1)
            if last < p - window + 1:
                continue  # a padding query past the block's end sees nothing
            first = max(0, p - window + 1)
            for h in range(heads):
                kv = h // (heads // kv_heads)
                want = attend_one(keys[first:last + 1, kv], values[first:last + 1, kv], q[b * q_len + i, h],
                                  d**-0.5, None)
                torch.testing.assert_close(ours[b * q_len + i, h], want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(DEVICE is None, reason="Triton kernel needs a CUDA GPU (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("causal", [True, False])
def test_triton_window_and_q_start_match_reference(causal):
    """DFlash 2's use: short blocks (q_start) under a sliding window, causal and not; with a sink as well."""
    q_len, heads, kv_heads = 8, 8, 2
    d, max_len, dtype = (16, 100, torch.float32) if DEVICE == "cpu" else (64, 600, torch.bfloat16)
    for window in (5, 70):
        q, kc, vc, tables, seq_lens, kv_start, q_start = window_case(DEVICE, dtype, 3, q_len, heads, kv_heads, d,
                                                                     max_len=max_len, seed=window)
        for s in (None, torch.randn(heads, device=DEVICE)):
            with torch.no_grad():
                out = paged_attention(q, kc, vc, tables, seq_lens, kv_start, q_len, d**-0.5, causal, sinks=s,
                                      window=window, q_start=q_start)
            ref = paged_attention_ref(q, kc, vc, tables, seq_lens, kv_start, q_len, d**-0.5, causal, s, window,
                                      q_start)
            real = torch.cat([torch.arange(b * q_len, b * q_len + int(seq_lens[b] - q_start[b])) for b in range(3)])
            err = (out[real].float() - ref[real].float()).norm() / ref[real].float().norm()
            assert err < (1e-5 if DEVICE == "cpu" else 1e-2), err
