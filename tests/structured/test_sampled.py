"""Sampled constrained speculative decoding draws from the target's distribution under the grammar:
at each position, the target's probabilities restricted to the tokens the grammar allows there, renormalised.

A 12-token vocabulary (the byte tokenizer's ids 0..11 are the characters !"#$%&'()*+,) and a regex
whose allowed set at the second position depends on the first token. The drafter is random, so
drafts often fall outside the grammar and are rejected by the mask; the committed tokens must still
follow the exact masked law (Pearson chi-square against transformers' probabilities).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from blockspec.engine.sampling_params import SamplingParams
from blockspec.structured.spec import StructuredSpec
from tests.engine.test_sampling import PROMPT, VOCAB, chi2_pvalue, save_small_vocab, small_vocab_engine

TEMPERATURE = 0.9
REGEX = r"""([!"][%&]|[#$]['()])[*+,]+"""  # ids: ! " # $ = 0-3, % & = 4-5, ' ( ) = 6-8, * + , = 9-11


def allowed(prefix: tuple[int, ...]) -> list[int]:
    """The tokens REGEX allows after prefix (of the first two positions) and at the third."""
    if not prefix:
        return [0, 1, 2, 3]
    if len(prefix) == 1:
        return [4, 5] if prefix[0] in (0, 1) else [6, 7, 8]
    return [9, 10, 11]


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    return save_small_vocab(tmp_path_factory.mktemp("structured_vocab"))


def masked_joint(target_dir) -> torch.Tensor:
    """p(t1, t2, t3 | PROMPT) at TEMPERATURE with each position's law restricted to the grammar, [V, V, V]."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    joint = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)

    def law(prefix: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + list(prefix)])).logits[0, -1].double() / TEMPERATURE
        mask = torch.full((VOCAB,), float("-inf"), dtype=torch.float64)
        mask[allowed(prefix)] = 0
        return (logits + mask).softmax(-1)

    p1 = law(())
    for a in allowed(()):
        p2 = law((a,))
        for b in allowed((a,)):
            joint[a, b] = p1[a] * p2[b] * law((a, b))
    return joint


@pytest.mark.parametrize("method", ["dflash", "dflash2"])
def test_sampled_constrained_output_follows_the_masked_target_distribution(small_vocab, method):
    """DFlash 2's drafts are sampled with their own q (verification reads it) and masked by the grammar."""
    joint = masked_joint(small_vocab[0])
    engine = small_vocab_engine(small_vocab, method)
    n = 2000
    grammar = StructuredSpec("regex", REGEX)
    params = [SamplingParams(temperature=TEMPERATURE, max_tokens=4, seed=i, ignore_eos=True, structured=grammar)
              for i in range(n)]
    outs = engine.generate([PROMPT] * n, params)
    assert sum(o.stats.num_draft_tokens for o in outs) > n  # drafts were verified, not just sampled
    assert sum(o.stats.num_accepted_tokens for o in outs) > n // 20  # and some accepted under the grammar
    counts = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    for o in outs:
        t = tuple(o.token_ids[:3])
        assert t[1] in allowed(t[:1]) and t[2] in allowed(t[:2]), t  # never outside the grammar
        counts[t] += 1
    for dims, name in [((1, 2), "t1"), ((0, 2), "t2"), ((0, 1), "t3")]:
        assert chi2_pvalue(counts.sum(dims), n * joint.sum(dims)) > 1e-3, name
    assert chi2_pvalue(counts.sum(0).flatten(), n * joint.sum(0).flatten()) > 1e-3, "(t2, t3)"
    assert chi2_pvalue(counts.sum(2).flatten(), n * joint.sum(2).flatten()) > 1e-3, "(t1, t2)"
