"""Fixed-split paged attention (--deterministic): the reference against paged_attention_ref, the kernel against
the reference, and one query's output bit-identical alone (decode), inside a k+1 verify block at different
positions, inside a prefill chunk, beside another sequence, and with different split counts in the grid; plain
causal attention and GPT-OSS's (sinks, a sliding window, both). On a GPU, or on CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from blockspec.kernels._triton import kernel_device
from blockspec.kernels.paged_attention import fixed_split_attention, fixed_split_attention_ref, paged_attention_ref
from tests.kernels.interpreter_bf16 import interpreter_like_gpu

DEVICE = kernel_device()
kernel = pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU, or Triton with TRITON_INTERPRET=1")
HEADS, KV_HEADS, D, PAGE = 4, 2, 16, 16
SPLIT = 128  # two 64-key tiles a split: contexts of ~300 tokens cross three splits
# GPT-OSS's options: a window of 150 keys reaches across a split boundary and skips whole tiles and splits
VARIANTS = {"causal": {}, "sinks": {"sinks": True}, "window": {"window": 150}, "sinks+window": {"sinks": True,
                                                                                              "window": 150}}


def options(variant: str, device: str) -> dict:
    """fixed_split_attention's sinks / window keywords for a variant (sinks: one learned logit a head)."""
    opts = dict(VARIANTS[variant])
    if opts.pop("sinks", False):
        opts["sinks"] = torch.tensor([0.5, -1.0, 2.0, 8.0], device=device)  # the last outweighs most rows' keys
    return opts


@pytest.fixture(autouse=True)
def bf16_as_on_the_gpu(monkeypatch):
    if DEVICE == "cpu":
        interpreter_like_gpu(monkeypatch)


def cache(device: str, dtype: torch.dtype, length: int = 320, seed: int = 0):
    """One sequence's keys and values in shuffled pages, and its block table."""
    g = torch.Generator().manual_seed(seed)
    pages = -(-length // PAGE)
    k = torch.randn(pages + 3, PAGE, KV_HEADS, D, generator=g).to(device, dtype)
    v = torch.randn(pages + 3, PAGE, KV_HEADS, D, generator=g).to(device, dtype)
    table = (torch.randperm(pages + 3, generator=g)[:pages]).to(device)
    q = torch.randn(length, HEADS, D, generator=g).to(device, dtype)  # a query for every position
    return q, k, v, table


def attend(q_all, k, v, table, seq_ends: list[int], q_len: int, width: int | None = None, fn=fixed_split_attention,
           **kw):
    """Sequences (the same cache) ending at seq_ends, each with its last q_len queries; the block table
    padded to `width` pages (more splits in the grid)."""
    width = width or table.shape[0]
    tables = torch.zeros(len(seq_ends), width, dtype=table.dtype, device=table.device)
    tables[:, : table.shape[0]] = table
    q = torch.cat([q_all[end - q_len:end] for end in seq_ends])
    seq_lens = torch.tensor(seq_ends, device=table.device)
    with torch.inference_mode():
        return fn(q, k, v, tables, seq_lens, q_len, D**-0.5, **kw)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_reference_is_causal_paged_attention(variant):
    """The oracle: paged_attention_ref, whose sinks and window the fast kernels are tested against."""
    q_all, k, v, table = cache("cpu", torch.float32)
    opts = options(variant, "cpu")
    ours = attend(q_all, k, v, table, [300, 177], 5, fn=fixed_split_attention_ref, **opts)
    want = attend(q_all, k, v, table, [300, 177], 5,
                  fn=lambda q, kc, vc, t, n, ql, s, **kw: paged_attention_ref(q, kc, vc, t, n, torch.zeros_like(n), ql,
                                                                              s, causal=True, **kw), **opts)
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)


@kernel
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(dtype, variant):
    if DEVICE == "cpu" and variant in ("sinks", "window"):
        # the window is the partials kernel's branch (WINDOWED), the sinks the merge kernel's (HAS_SINKS): "causal"
        # and "sinks+window" take both sides of each kernel's branch, the two alone are combinations of them
        pytest.skip("sinks-only and window-only variants run on the GPU (the suite's time under TRITON_INTERPRET=1)")
    q_all, k, v, table = cache(DEVICE, dtype)
    opts = options(variant, DEVICE)
    for ends, q_len in (([300, 129], 1), ([300, 200], 8), ([290], 40)):
        got = attend(q_all, k, v, table, ends, q_len, split_tokens=SPLIT, **opts)
        want = attend(q_all, k, v, table, ends, q_len, fn=fixed_split_attention_ref, **opts)
        # float32: the GPU's tl.dot multiplies in TF32 (10-bit mantissa: ~5e-4 here), the interpreter exactly
        tol = (1e-5 if DEVICE == "cpu" else 2e-3) if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@kernel
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_is_bit_identical_alone_in_a_verify_block_and_in_a_prefill_chunk(dtype, variant):
    if DEVICE == "cpu" and dtype == torch.float32:
        pytest.skip("the interpreter's float32 tl.dot is NumPy's matmul, whose BLAS blocking (and so a row's "
                    "rounding) follows the matrix's shape; the GPU's MMA does not")
    if DEVICE == "cpu" and variant in ("sinks", "window"):
        # as in test_kernel_matches_reference: "causal" and "sinks+window" take both sides of each kernel's branch
        pytest.skip("sinks-only and window-only variants run on the GPU (the suite's time under TRITON_INTERPRET=1)")
    q_all, k, v, table = cache(DEVICE, dtype)
    opts = dict(options(variant, DEVICE), split_tokens=SPLIT)
    pos = 200  # the query at position 200: its keys span two splits and part of a third (its window: 51..200)
    alone = attend(q_all, k, v, table, [pos + 1], 1, **opts)[0]
    for index in (0, 3, 7):  # a k+1 = 8 verify block with the query at different rows
        block = attend(q_all, k, v, table, [pos + 8 - index], 8, **opts)
        assert torch.equal(block[index], alone)
    chunk = attend(q_all, k, v, table, [pos + 100], 110, **opts)  # prefill chunk 190..299
    assert torch.equal(chunk[pos - 190], alone)
    early = attend(q_all, k, v, table, [pos + 100], 299, **opts)  # a chunk from position 1: no tile skipped
    assert torch.equal(early[pos - 1], alone)
    beside = attend(q_all, k, v, table, [97, pos + 1], 1, **opts)  # another, shorter sequence first
    assert torch.equal(beside[1], alone)
    wider = attend(q_all, k, v, table, [pos + 1], 1, width=table.shape[0] + 24, **opts)  # more splits
    assert torch.equal(wider[0], alone)
