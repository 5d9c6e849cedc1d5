"""Acceptance of drafted tokens against the target's distributions: greedy and lossless sampling.

All functions work on padded batches and stay on the device (no host reads): row r has
`num_drafts[r]` real drafts out of K, and K+1 target positions. They return, per row, the number
of accepted drafts `a` and a token row whose first a+1 entries are the committed tokens
(the accepted drafts followed by the target's own token at position a).
"""

from __future__ import annotations

import torch

from blockspec.engine.sampler import sample_from


def _accept_prefix(accept: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    k = accept.shape[1]
    valid = torch.arange(k, device=accept.device)[None, :] < num_drafts[:, None]
    return (accept & valid).to(torch.int32).cumprod(1).sum(1)


def verify_greedy(target_argmax: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """target_argmax [R, K+1], drafts [R, K] -> (accepted [R], tokens [R, K+1])."""
    accepted = _accept_prefix(drafts == target_argmax[:, :-1], num_drafts)
    return accepted, target_argmax  # on the accepted prefix the drafts equal the target's argmax


def verify_sampled(
    target_probs: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling (Leviathan et al.; Chen et al.), lossless for any draft q.

    target_probs [R, K+1, V]; drafts [R, K]; uniforms [R, K] in [0, 1); noise [R, V] ~ Exp(1);
    draft_probs [R, K, V] or None for greedy drafts, whose q is one-hot at the drafted token.
    Draft i is accepted with probability min(1, p(d_i) / q(d_i)); at the first rejection the token is
    drawn from norm(max(p - q, 0)); if every draft is accepted, from p at position K.
    """
    r, k = drafts.shape
    rows = torch.arange(r, device=drafts.device)
    p_d = target_probs[:, :k].gather(-1, drafts[..., None])[..., 0]
    q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs.gather(-1, drafts[..., None])[..., 0]
    accepted = _accept_prefix(uniforms * q_d < p_d, num_drafts)
    p_a = target_probs[rows, accepted.long()]  # [R, V]
    rejected = accepted < num_drafts
    if draft_probs is None:
        d_a = drafts.gather(1, accepted.clamp(max=max(k - 1, 0))[:, None].long()) if k else None
        q_a = torch.zeros_like(p_a) if d_a is None else torch.zeros_like(p_a).scatter_(1, d_a, 1.0)
    else:
        q_a = draft_probs[rows, accepted.clamp(max=max(k - 1, 0)).long()] if k else torch.zeros_like(p_a)
    residual = (p_a - q_a).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    # p - q can vanish in floating point when p and q coincide; p itself is then the right law.
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p_a)
    dist = torch.where(rejected[:, None], residual, p_a)
    bonus = sample_from(dist, noise)
    tokens = torch.cat([drafts, drafts.new_zeros(r, 1)], dim=1)
    tokens.scatter_(1, accepted[:, None].long(), bonus[:, None])
    return accepted, tokens
