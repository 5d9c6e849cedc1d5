"""Turning target logits into next-token distributions, per row, and drawing from them.

Rows are the positions of a verify block, padded to [R, K+1, V]. Every row carries its sequence's
parameters, so one batch can mix greedy and sampled requests. Random draws come from each request's
own generator (a fixed seed reproduces the output whatever else is in the batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.device import upload
from blockspec.engine.sampling_params import SamplingParams


@dataclass
class RowParams:
    """Per-sequence sampling parameters as device tensors, shape [R] (or [R, 1] where noted)."""

    greedy: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    needs_sort: bool  # host-side flags, so the hot path never reads tensors back
    needs_min_p: bool

    @classmethod
    def build(cls, params: list[SamplingParams], device: torch.device) -> RowParams:
        def t(values: list, dtype: torch.dtype) -> torch.Tensor:
            return upload(values, dtype, device)

        return cls(
            greedy=t([p.greedy for p in params], torch.bool),
            temperature=t([max(p.temperature, 1e-5) for p in params], torch.float32),
            top_k=t([p.top_k for p in params], torch.int64),
            top_p=t([p.top_p for p in params], torch.float32),
            min_p=t([p.min_p for p in params], torch.float32),
            needs_sort=any(p.top_k > 0 or p.top_p < 1 for p in params if not p.greedy),
            needs_min_p=any(p.min_p > 0 for p in params if not p.greedy),
        )


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    params: list[SamplingParams],
) -> torch.Tensor:
    """OpenAI presence/frequency and HF repetition penalties on logits [R, P, V].

    counts [R, P, V]: occurrences of each token among the output tokens before each position
    (drafts earlier in the block included); prompt_mask [R, V]: tokens present in the prompt.
    """
    dev = logits.device
    presence = upload([p.presence_penalty for p in params], torch.float32, dev)[:, None, None]
    frequency = upload([p.frequency_penalty for p in params], torch.float32, dev)[:, None, None]
    repetition = upload([p.repetition_penalty for p in params], torch.float32, dev)[:, None, None]
    seen = (counts > 0) | prompt_mask[:, None, :]
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised, logits)
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def probabilities(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on logits [R, P, V] -> probabilities [R, P, V] (float32)."""
    logits = logits.float() / rows.temperature[:, None, None]
    vocab = logits.shape[-1]
    if rows.needs_sort:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)
        k = torch.where(rows.top_k > 0, rows.top_k, vocab)[:, None, None]
        drop = (rank >= k).expand_as(sorted_logits).clone()
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        drop |= (sorted_probs.cumsum(-1) - sorted_probs) >= rows.top_p[:, None, None]
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    if rows.needs_min_p:
        floor = rows.min_p[:, None, None] * probs.amax(-1, keepdim=True)
        probs = torch.where(probs < floor, 0.0, probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws a token with probability p."""
    return (probs / noise).argmax(-1)


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, top: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw-model log-probabilities: of the chosen tokens [N], and the top-n ids/values [N, top]."""
    lp = logits.float().log_softmax(-1)
    chosen = lp.gather(-1, tokens[:, None])[:, 0]
    values, ids = lp.topk(top, dim=-1) if top > 0 else (lp[:, :0], tokens[:, None][:, :0])
    return chosen, ids, values
