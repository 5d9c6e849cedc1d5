"""The matcher's masks along drafts are the masks of the grammar state after each draft prefix."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from blockspec.structured.bitmask import allowed_tokens, apply_bitmask
from blockspec.structured.compiler import GrammarCompiler
from blockspec.structured.matcher import ALL_ALLOWED, bitmask_words
from blockspec.structured.spec import StructuredSpec
from tests.conftest import VOCAB, write_tokenizer

EOS = 258
SPEC = StructuredSpec("regex", r"(ab|ac)d+")


@pytest.fixture(scope="module")
def compiler(tmp_path_factory) -> GrammarCompiler:
    root = tmp_path_factory.mktemp("bytetok")
    write_tokenizer(root)
    return GrammarCompiler(AutoTokenizer.from_pretrained(root), VOCAB, [EOS])


def ids(text: str) -> list[int]:
    """Byte tokenizer ids of printable ASCII: ids follow the byte-level alphabet, '!' = 0."""
    return [ord(c) - ord("!") for c in text]


def allowed_ids(mask: torch.Tensor) -> set[int]:
    return set(allowed_tokens(mask, VOCAB, torch.device("cpu")).nonzero().flatten().tolist())


def test_masks_along_drafts_equal_stepwise_masks(compiler):
    drafts = ids("acdd")
    walker = compiler.matcher(SPEC)
    masks = torch.full((len(drafts) + 1, bitmask_words(VOCAB)), ALL_ALLOWED, dtype=torch.int32)
    assert walker.fill_verify(drafts, masks) == len(drafts)
    stepper = compiler.matcher(SPEC)
    for i in range(len(drafts) + 1):
        assert torch.equal(masks[i], stepper.allowed()), i
        if i < len(drafts):
            stepper.advance(drafts[i])
    assert allowed_ids(masks[0]) == set(ids("a"))
    assert allowed_ids(masks[1]) == set(ids("bc"))
    assert allowed_ids(masks[4]) == set(ids("d")) | {EOS}  # complete: the stop token may come
    # The walk was rolled back: the matcher is still at the start.
    assert torch.equal(walker.allowed(), masks[0])


def test_a_rejected_draft_ends_the_walk(compiler):
    m = compiler.matcher(SPEC)
    m.advance(ids("a")[0])
    masks = torch.full((4, bitmask_words(VOCAB)), ALL_ALLOWED, dtype=torch.int32)
    assert m.fill_verify(ids("bxd"), masks) == 1  # b is fine, x is outside the grammar
    assert allowed_ids(masks[1]) == set(ids("d"))
    assert allowed_ids(masks[2]) == set(range(VOCAB))  # never used: verification stops at x
    assert allowed_ids(masks[3]) == set(range(VOCAB))
    assert allowed_ids(m.allowed()) == set(ids("bc"))


def test_the_stop_token_ends_the_grammar(compiler):
    m = compiler.matcher(SPEC)
    for t in ids("abd"):
        m.advance(t)
    assert m.complete and not m.done
    m.advance(EOS)
    assert m.done
    assert allowed_ids(m.allowed()) == set(range(VOCAB))  # ignore_eos: nothing constrains any more
    with pytest.raises(RuntimeError, match="rejected"):
        compiler.matcher(SPEC).advance(ids("d")[0])


def test_compiled_grammars_are_cached(compiler):
    first = compiler.compile(StructuredSpec("json_schema", {"type": "object"}))
    assert compiler.compile(StructuredSpec("json_schema", {"type": "object"})) is first


def test_apply_bitmask_sets_disallowed_logits_to_minus_inf():
    torch.manual_seed(0)
    vocab = 70
    allowed = torch.rand(2, 3, vocab) < 0.3
    words = torch.zeros(2, 3, bitmask_words(vocab), dtype=torch.int64)
    for t in range(vocab):
        words[..., t // 32] |= allowed[..., t].long() << (t % 32)
    bitmask = words.to(torch.int32)  # bit 31 set wraps to a negative int32, as the grammar engine writes it
    logits = torch.randn(2, 3, vocab)
    out = apply_bitmask(logits, bitmask)
    assert torch.equal(out, torch.where(allowed, logits, float("-inf")))
