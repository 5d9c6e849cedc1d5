"""Logit processing against brute-force references; exponential-race sampling is unbiased."""

from __future__ import annotations

import torch

from blockspec.engine.sampler import RowParams, apply_penalties, probabilities, sample_from
from blockspec.engine.sampling_params import SamplingParams


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row at a time, the textbook way."""
    x = logits.double() / p.temperature
    if p.top_k > 0:
        kth = x.topk(p.top_k).values[-1]
        x = torch.where(x < kth, float("-inf"), x)
    probs = x.softmax(-1)
    if p.top_p < 1:
        order = probs.argsort(descending=True)
        keep = torch.zeros_like(probs, dtype=torch.bool)
        total = 0.0
        for i in order.tolist():
            keep[i] = True
            total += float(probs[i])
            if total >= p.top_p:
                break
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum()
    if p.min_p > 0:
        probs = torch.where(probs < p.min_p * probs.max(), 0.0, probs)
        probs = probs / probs.sum()
    return probs


def test_probabilities_match_reference():
    g = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.3, top_p=0.8),
              SamplingParams(temperature=1.0, top_k=20, top_p=0.5), SamplingParams(temperature=0.9, min_p=0.1),
              SamplingParams(temperature=1.0)]
    logits = torch.randn(len(params), 3, 64, generator=g) * 3
    got = probabilities(logits, RowParams.build(params, torch.device("cpu")))
    for r, p in enumerate(params):
        for pos in range(3):
            torch.testing.assert_close(got[r, pos].double(), reference_probs(logits[r, pos], p), atol=1e-6, rtol=1e-5)


def test_penalties_match_definitions():
    logits = torch.tensor([[[2.0, -1.0, 0.5, 3.0]]])
    counts = torch.tensor([[[2.0, 1.0, 0.0, 0.0]]])
    prompt = torch.tensor([[False, False, False, True]])
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    out = apply_penalties(logits, counts, prompt, [p])
    expected = torch.tensor([2.0 / 2 - 0.5 - 0.5, -1.0 * 2 - 0.25 - 0.5, 0.5, 3.0 / 2])
    torch.testing.assert_close(out[0, 0], expected)


def test_exponential_race_is_unbiased():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    g = torch.Generator().manual_seed(1)
    n = 40000
    noise = torch.empty(n, 4).exponential_(generator=g)
    counts = torch.bincount(sample_from(probs.expand(n, 4), noise), minlength=4).double() / n
    torch.testing.assert_close(counts, probs.double(), atol=0.01, rtol=0)
