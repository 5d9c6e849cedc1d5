"""The candidate-selector walk kernel against its definition (spec/dflash2.walk_slots), on a GPU or under
TRITON_INTERPRET=1: greedy paths, sampled paths with their q, rows of both kinds in one call, K and rank that
are not powers of two; and the selector's own walk dispatching to it."""

from __future__ import annotations

import pytest
import torch

from blockspec.kernels._triton import kernel_device
from blockspec.kernels.selector_walk import selector_walk
from blockspec.spec.dflash2 import CandidateSelector, walk_slots

DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU, or Triton with TRITON_INTERPRET=1")
VOCAB = 97


def inputs(rows: int, slots: int, k: int, rank: int, dtype: torch.dtype, seed: int = 0) -> dict:
    """Top-K logits in descending order and distinct candidate ids per slot, as torch.topk gives them; codebooks
    and context large enough that the pairwise term reorders the candidates."""
    g = torch.Generator().manual_seed(seed)
    unary = torch.randn(rows, slots, k, generator=g).sort(dim=-1, descending=True).values
    candidates = torch.stack([torch.randperm(VOCAB, generator=g)[:k] for _ in range(rows * slots)])
    tensors = {
        "unary": unary, "candidates": candidates.view(rows, slots, k),
        "context": torch.randn(rows, slots, rank, generator=g),
        "anchors": torch.randint(0, VOCAB, (rows,), generator=g),
        "predecessor_codebook": torch.randn(VOCAB, rank, generator=g) / rank ** 0.25,
        "successor_codebook": torch.randn(VOCAB, rank, generator=g) / rank ** 0.25,
    }
    return {name: (t.to(dtype) if t.is_floating_point() else t).to(DEVICE) for name, t in tensors.items()}


@pytest.mark.parametrize("k,rank", [(16, 32), (5, 24)])
def test_greedy_walk_is_the_definition(k, rank):
    args = inputs(3, 7, k, rank, torch.float32)
    path, q = selector_walk(**args)
    want, _ = walk_slots(**args)
    assert q is None and path.dtype == want.dtype
    assert torch.equal(path, want)
    # the pairwise term mattered: some slot did not take its top logit
    assert not torch.equal(path, args["candidates"][..., 0])


@pytest.mark.parametrize("k,rank", [(16, 32), (5, 24)])
def test_sampled_walk_is_the_definition(k, rank):
    """Row 0 greedy (temperature 0), the others sampled: the same draws from the same noise, the same q."""
    args = inputs(4, 7, k, rank, torch.float32, seed=1)
    g = torch.Generator().manual_seed(2)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.5]).to(DEVICE)
    noise = torch.empty(4, 7, k).exponential_(generator=g).to(DEVICE)
    noise[0] = 1.0
    path, q = selector_walk(**args, temperature=temperature, noise=noise)
    want, want_q = walk_slots(**args, temperature=temperature, noise=noise)
    assert torch.equal(path, want)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-6)
    assert torch.equal(path[0], walk_slots(**args)[0][0])  # the greedy row as in a greedy call


def test_bf16_rounds_as_the_definition():
    """bf16 scores: the kernel rounds the product, the pairwise sum and the score as the definition does, so
    paths agree but where the definition's matmul, summed in another order, flips a last-bit near-tie."""
    args = inputs(8, 7, 16, 64, torch.bfloat16, seed=3)
    path, _ = selector_walk(**args)
    want, _ = walk_slots(**args)
    assert (path == want).float().mean() >= 0.9


def test_the_selector_walks_with_the_kernel():
    torch.manual_seed(4)
    sel = CandidateSelector(VOCAB, 32, 16, 8).to(DEVICE)
    hidden, logits = torch.randn(2, 7, 32, device=DEVICE), torch.randn(2, 7, VOCAB, device=DEVICE)
    anchors = torch.tensor([3, 5], device=DEVICE)
    with torch.no_grad():
        path, candidates, q = sel.walk(hidden, logits, anchors)
        unary, cands = torch.topk(logits, 8, dim=-1)
        context = hidden @ sel.hidden_projection.weight.t()
        want, _ = walk_slots(unary, cands, context, anchors, sel.predecessor_codebook.weight,
                             sel.successor_codebook.weight)
    assert q is None and torch.equal(candidates, cands) and torch.equal(path, want)
