"""Sampled speculative decoding draws from the target's distribution, and seeds reproduce outputs."""

from __future__ import annotations

import itertools

import pytest
import torch
import transformers

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams

from ..conftest import TINY_DFLASH2, save_tiny_drafter, save_tiny_model

VOCAB = 12
PROMPT = [3, 1, 4, 1, 5]
TEMPERATURE = 0.8


def chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value, pooling cells with small expectation into one."""
    small = expected < min_expected
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat.double() / 2))


def save_small_vocab(root) -> tuple:
    """A 12-token target and its random drafter (tests/structured/test_sampled.py uses them too)."""
    target = save_tiny_model(root / "target", "qwen3", seed=4, vocab_size=VOCAB, num_hidden_layers=4)
    cfg = transformers.AutoConfig.from_pretrained(target)
    draft = save_tiny_drafter(root / "draft", cfg, seed=9, mask_token_id=VOCAB - 1, target_layer_ids=[0, 2])
    # DFlash 2: the walk samples among the top 4 of 12 tokens (a gentle selector: q spread over them, not
    # nearly one-hot) and hands verification its q
    draft2 = save_tiny_drafter(root / "draft2", cfg, seed=9, mask_token_id=VOCAB - 1, target_layer_ids=[0, 2],
                               block_size=8, dflash2=TINY_DFLASH2, selector_scale=0.3)
    return target, {"dflash": draft, "dflash2": draft2}


def small_vocab_engine(small_vocab: tuple, method: str) -> Engine:
    """The 12-token target with its DFlash 1 or 2 drafter, k = 4, batches big enough for thousands of requests."""
    target, drafts = small_vocab
    spec = SpeculativeConfig(model=str(drafts[method]), num_speculative_tokens=4)
    return Engine(EngineConfig(model=str(target), device="cpu", speculative=spec, max_num_seqs=512,
                               max_num_batched_tokens=4096))


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    return save_small_vocab(tmp_path_factory.mktemp("smallvocab"))


def exact_joint(target_dir) -> torch.Tensor:
    """p(t1, t2, t3 | PROMPT) at TEMPERATURE, from transformers' model, [V, V, V]."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    seqs = torch.tensor([PROMPT + [a, b] for a, b in itertools.product(range(VOCAB), repeat=2)])
    with torch.no_grad():
        logits = hf(seqs).logits.double() / TEMPERATURE
    p = logits.softmax(-1)
    p1 = p[0, len(PROMPT) - 1]  # the same for every row
    p2 = p.view(VOCAB, VOCAB, -1, VOCAB)[:, 0, len(PROMPT)]  # [t1, t2]
    p3 = p.view(VOCAB, VOCAB, -1, VOCAB)[:, :, len(PROMPT) + 1]  # [t1, t2, t3]
    return p1[:, None, None] * p2[:, :, None] * p3


@pytest.mark.parametrize("method", ["dflash", "dflash2"])
def test_sampled_output_follows_target_distribution(small_vocab, method):
    joint = exact_joint(small_vocab[0])
    engine = small_vocab_engine(small_vocab, method)
    n = 4000
    params = [SamplingParams(temperature=TEMPERATURE, max_tokens=4, seed=i, ignore_eos=True) for i in range(n)]
    outs = engine.generate([PROMPT] * n, params)
    assert sum(o.stats.num_draft_tokens for o in outs) > n  # drafts were verified, not just sampled
    assert sum(o.stats.num_accepted_tokens for o in outs) > n // 10  # and some accepted
    counts = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    for o in outs:
        counts[tuple(o.token_ids[:3])] += 1
    for dims, name in [((1, 2), "t1"), ((0, 2), "t2"), ((0, 1), "t3")]:
        assert chi2_pvalue(counts.sum(dims), n * joint.sum(dims)) > 1e-3, name
    assert chi2_pvalue(counts.sum(0).flatten(), n * joint.sum(0).flatten()) > 1e-3, "(t2, t3)"


@pytest.mark.parametrize("method", ["dflash", "dflash2"])
def test_fixed_seed_reproduces_output(small_vocab, method):
    target, drafts = small_vocab
    spec = SpeculativeConfig(model=str(drafts[method]), num_speculative_tokens=5)
    engine = Engine(EngineConfig(model=str(target), device="cpu", speculative=spec))
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=40, seed=1234, ignore_eos=True)
    first = engine.generate([PROMPT], p)[0].token_ids
    again = engine.generate([PROMPT], p)[0].token_ids
    other = engine.generate([PROMPT], SamplingParams(**{**vars(p), "seed": 99}))[0].token_ids
    assert first == again
    assert first != other
