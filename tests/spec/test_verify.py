"""Acceptance rules, checked exactly on small distributions."""

from __future__ import annotations

import torch

from blockspec.spec.verify import verify_greedy, verify_sampled


def test_greedy_accepts_the_agreeing_prefix_only():
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4]])
    drafts = torch.tensor([[5, 6, 0], [5, 6, 7], [1, 2, 3]])
    accepted, tokens = verify_greedy(target, drafts, torch.tensor([3, 2, 0]))
    assert accepted.tolist() == [2, 2, 0]
    assert tokens[0, :3].tolist() == [5, 6, 7]  # two drafts and the target's bonus


def _first_two_tokens(target_probs, draft_probs, drafts_fn, n, seed):
    """Empirical law of the first two committed tokens under verify_sampled."""
    g = torch.Generator().manual_seed(seed)
    v = target_probs.shape[-1]
    drafts = drafts_fn(n, g)
    uniforms = torch.rand(n, 2, generator=g)
    noise = torch.empty(n, v).exponential_(generator=g)
    dp = None if draft_probs is None else draft_probs.expand(n, 2, v)
    accepted, tokens = verify_sampled(target_probs.expand(n, 3, v), drafts, torch.full((n,), 2), uniforms, noise, dp)
    return accepted, tokens


def test_rejection_sampling_is_lossless_for_sampled_drafts():
    # Position-independent p for clarity: the first committed token must follow p exactly.
    p = torch.tensor([0.1, 0.6, 0.2, 0.1])
    q = torch.tensor([0.4, 0.1, 0.1, 0.4])
    n = 60000

    def drafts_fn(count, g):
        return torch.multinomial(q.expand(count, 4), 2, replacement=True, generator=g)

    accepted, tokens = _first_two_tokens(p.expand(3, 4), q.expand(2, 4), drafts_fn, n, 0)
    first = torch.bincount(tokens[:, 0], minlength=4).double() / n
    torch.testing.assert_close(first, p.double(), atol=0.01, rtol=0)
    # Acceptance of the first draft happens with probability sum(min(p, q)).
    assert abs((accepted >= 1).double().mean() - torch.minimum(p, q).sum()) < 0.01


def test_rejection_sampling_is_lossless_for_greedy_drafts():
    p = torch.tensor([0.1, 0.6, 0.2, 0.1])
    n = 60000

    def drafts_fn(count, g):
        return torch.full((count, 2), 2)  # the drafter always proposes token 2 (one-hot q)

    accepted, tokens = _first_two_tokens(p.expand(3, 4), None, drafts_fn, n, 1)
    first = torch.bincount(tokens[:, 0], minlength=4).double() / n
    torch.testing.assert_close(first, p.double(), atol=0.01, rtol=0)
    assert abs((accepted >= 1).double().mean() - 0.2) < 0.01
    # Second token, given the first was accepted, again follows p.
    second = tokens[accepted >= 1, 1]
    torch.testing.assert_close(torch.bincount(second, minlength=4).double() / len(second), p.double(),
                               atol=0.02, rtol=0)
