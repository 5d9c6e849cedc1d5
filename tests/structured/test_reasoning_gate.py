"""With a reasoning parser, a constrained request's grammar starts after the reasoning-end token.

Real xgrammar matchers over the byte tokenizer extended with `<think>` and `</think>` as single
tokens. The tiny random qwen3 target emits id 272 (an id its byte tokenizer leaves unused) early in
its greedy output for every prompt of the lossless tests, so a tokenizer that names id 272 `</think>`
makes a model that thinks for a few tokens and then ends its thought: the end token falls in the
middle of DFlash verify blocks, at their bonus position and in the first output token.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams
from blockspec.errors import ConfigError
from blockspec.structured.compiler import GrammarCompiler
from blockspec.structured.matcher import ALL_ALLOWED, bitmask_words
from blockspec.structured.reasoning_gate import ReasoningGatedGrammar
from blockspec.structured.reasoning_tags import ReasoningTokens, reasoning_tokens
from blockspec.structured.spec import StructuredSpec
from tests.conftest import VOCAB, write_tokenizer
from tests.engine import test_lossless as unconstrained
from tests.structured.structured_cases import EMAIL, END, PROMPTS, SPECS, START, write_think_tokenizer
from tests.structured.test_lossless import check_follows

EOS = 258
REGEX = StructuredSpec("regex", r"(ab|ac)d+")


@pytest.fixture(scope="module")
def think_tokenizer(tmp_path_factory) -> Path:
    return write_think_tokenizer(tmp_path_factory.mktemp("think_tok"))


@pytest.fixture(scope="module")
def compiler(think_tokenizer) -> GrammarCompiler:
    return GrammarCompiler(AutoTokenizer.from_pretrained(think_tokenizer), VOCAB, [EOS])


def ids(text: str) -> list[int]:
    return [ord(c) - ord("!") for c in text]


def all_allowed(rows: int) -> torch.Tensor:
    return torch.full((rows, bitmask_words(VOCAB)), ALL_ALLOWED, dtype=torch.int32)


# ---- the tags and the prompt ----------------------------------------------------------------------------


def test_tag_ids_come_from_the_tokenizer(think_tokenizer, tmp_path):
    tok = AutoTokenizer.from_pretrained(think_tokenizer)
    assert tok.encode("a<think>b</think>", add_special_tokens=False) == [ids("a")[0], START, ids("b")[0], END]
    assert reasoning_tokens(tok, "qwen3") == ReasoningTokens(START, END)
    assert reasoning_tokens(tok, "deepseek_r1") == ReasoningTokens(START, END)
    write_tokenizer(tmp_path)  # </think> is several byte tokens there: no gate
    assert reasoning_tokens(AutoTokenizer.from_pretrained(tmp_path), "qwen3") is None
    with pytest.raises(ConfigError, match="qwen3"):
        reasoning_tokens(tok, "granite")


@pytest.mark.parametrize("prompt, ended", [
    ([1, 2, 3], False),  # no tags: the model opens its thought itself
    ([1, START, 2], False),  # the template opened the thought (Qwen3.5/3.6)
    ([1, START, 4, 4, END, 4, 4], True),  # enable_thinking=false: an empty thought closed in the prompt
    ([START, 2, END, 1, START, 4], False),  # an earlier turn's thought ended, a new one is open
    ([2, END], True),
])
def test_the_last_tag_of_the_prompt_decides(prompt, ended):
    assert ReasoningTokens(START, END).ended_in(prompt) is ended
    assert ReasoningTokens(None, END).ended_in([t for t in prompt if t != START]) is (END in prompt)


# ---- masks along a verify block -------------------------------------------------------------------------


def stepwise_masks(compiler: GrammarCompiler, tokens: list[int]) -> list[torch.Tensor]:
    """The grammar's masks from its start along tokens: one per position, len(tokens) + 1."""
    m = compiler.matcher(REGEX)
    out = [m.allowed()]
    for t in tokens:
        m.advance(t)
        out.append(m.allowed())
    return out


def test_end_token_in_the_middle_of_a_block(compiler):
    """Positions up to and including the drafted end token are free; after it, the grammar's masks from
    its start, walked only along the drafts after the end token."""
    gate = ReasoningGatedGrammar(compiler.matcher(REGEX), END, ended=False)
    drafts = ids("xy") + [END] + ids("acd")
    masks = all_allowed(len(drafts) + 1)
    assert gate.fill_verify(drafts, masks) == len(drafts)
    assert torch.equal(masks[:3], all_allowed(3))  # x, y and the end token itself are reasoning
    expected = stepwise_masks(compiler, ids("acd"))
    for i, mask in enumerate(expected):
        assert torch.equal(masks[3 + i], mask), i
    # The walk changed nothing: still reasoning, the grammar at its start.
    assert not gate.reasoning_ended and torch.equal(gate.matcher.allowed(), expected[0])


def test_a_draft_outside_the_grammar_after_the_end_token(compiler):
    gate = ReasoningGatedGrammar(compiler.matcher(REGEX), END, ended=False)
    drafts = [END] + ids("az") + ids("d")
    masks = all_allowed(len(drafts) + 1)
    assert gate.fill_verify(drafts, masks) == 2  # the end token and a; z is outside the grammar
    assert torch.equal(masks[1], stepwise_masks(compiler, [])[0])
    assert torch.equal(masks[2], stepwise_masks(compiler, ids("a"))[1])
    assert torch.equal(masks[3:], all_allowed(2))  # never used: verification stops at z


def test_no_end_token_leaves_the_block_free_and_the_end_token_opens_the_grammar(compiler):
    gate = ReasoningGatedGrammar(compiler.matcher(REGEX), END, ended=False)
    masks = all_allowed(5)
    assert gate.fill_verify(ids("zzzz"), masks) == 4
    assert torch.equal(masks, all_allowed(5))
    for t in ids("zz!") + [START, EOS]:  # none of these is in the grammar: reasoning is free
        gate.advance(t)
    assert not gate.done and not gate.complete and torch.equal(gate.allowed(), all_allowed(1)[0])
    gate.advance(END)
    assert gate.reasoning_ended and torch.equal(gate.allowed(), stepwise_masks(compiler, [])[0])
    with pytest.raises(RuntimeError, match="rejected"):
        gate.advance(ids("z")[0])
    for t in ids("abd"):
        gate.advance(t)
    assert gate.complete
    gate.advance(EOS)
    assert gate.done


def test_a_prompt_that_ended_the_reasoning_constrains_from_the_first_token(compiler):
    gate = ReasoningGatedGrammar(compiler.matcher(REGEX), END, ended=True)
    masks = all_allowed(3)
    assert gate.fill_verify(ids("ab"), masks) == 2
    assert all(torch.equal(masks[i], m) for i, m in enumerate(stepwise_masks(compiler, ids("ab"))))


# ---- end to end: DFlash under the gate equals AR under the gate -----------------------------------------

KINDS = ("regex", "json_schema", "choice")


def engine(tiny_models, think_tokenizer, reasoning: str | None = "qwen3", **kwargs) -> Engine:
    return Engine(EngineConfig(model=str(tiny_models["qwen3"]), tokenizer=str(think_tokenizer), device="cpu",
                               reasoning_parser=reasoning, **kwargs))


def constrained(kind: str, max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured=SPECS[kind])


@pytest.fixture(scope="module")
def free_reference(tiny_models, think_tokenizer) -> dict[str, list[int]]:
    """Unconstrained greedy output: the thought of every prompt, ended by the first END."""
    return unconstrained.run_all(engine(tiny_models, think_tokenizer, None), PROMPTS,
                                 SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))


@pytest.fixture(scope="module")
def gated_reference(tiny_models, think_tokenizer, free_reference) -> dict[str, dict[str, list[int]]]:
    """AR output under each grammar behind the reasoning: the free thought, END, then the grammar."""
    ar = engine(tiny_models, think_tokenizer)
    tok = ar.tokenizer
    ref = {}
    for kind in KINDS:
        ref[kind] = unconstrained.run_all(ar, PROMPTS, constrained(kind))
        for rid, out in ref[kind].items():
            end = free_reference[rid].index(END)
            assert out[:end + 1] == free_reference[rid][:end + 1], (kind, rid)  # the thought is free
            answer = out[end + 1:]
            finished = answer[-1:] == [EOS]
            check_follows(kind, tok.decode(answer, skip_special_tokens=True), finished)
            if kind == "regex" and not finished:
                assert re.fullmatch(EMAIL, tok.decode(answer)) is None  # a cut answer, never a whole one
    return ref


def test_every_prompt_ends_its_thought_early(free_reference):
    ends = [free_reference[f"r{i}"].index(END) for i in range(len(PROMPTS))]
    assert ends == [19, 11, 27, 1]  # d1 of a block, mid-block, bonus position, first verify block (k = 8)


@pytest.mark.parametrize("k", [4, 15])
def test_dflash_under_the_gate_equals_autoregressive(tiny_models, think_tokenizer, tiny_drafter, gated_reference, k):
    dflash = engine(tiny_models, think_tokenizer, max_num_batched_tokens=24,
                    speculative=SpeculativeConfig(model=str(tiny_drafter), num_speculative_tokens=k))
    for kind in KINDS:
        assert unconstrained.run_all(dflash, PROMPTS, constrained(kind)) == gated_reference[kind], kind


@pytest.mark.parametrize("keep", [1.0, 0.9])
def test_end_token_drafted_mid_block_equals_autoregressive(tiny_models, think_tokenizer, gated_reference, keep):
    """Drafts from the known gated output: whole blocks with the end token inside are accepted, the
    tokens after it under the grammar's masks (a mask applied before the end would change the thought,
    a grammar advanced with the end token would reject it)."""
    synthetic = engine(tiny_models, think_tokenizer, max_num_batched_tokens=20)
    for kind in KINDS:
        synthetic.enable_synthetic_drafts(gated_reference[kind], keep, 8)
        assert unconstrained.run_all(synthetic, PROMPTS, constrained(kind)) == gated_reference[kind], kind
        counters = synthetic.spec_counters
        assert counters.num_accepted_tokens > (0.8 if keep == 1.0 else 0.3) * counters.num_draft_tokens, kind


def test_prompt_that_ended_the_reasoning_is_constrained_from_the_start(tiny_models, think_tokenizer, tiny_drafter):
    """`<think>\\n\\n</think>\\n\\n` closing the prompt (Qwen3 with enable_thinking=false): the output is what
    the grammar gives without any reasoning parser, DFlash and AR alike."""
    prompts = [p + "<think>\n\n</think>\n\n" for p in PROMPTS]
    plain = unconstrained.run_all(engine(tiny_models, think_tokenizer, None), prompts, constrained("regex"))
    ar = unconstrained.run_all(engine(tiny_models, think_tokenizer), prompts, constrained("regex"))
    dflash = engine(tiny_models, think_tokenizer,
                    speculative=SpeculativeConfig(model=str(tiny_drafter), num_speculative_tokens=7))
    assert ar == plain and unconstrained.run_all(dflash, prompts, constrained("regex")) == plain
    assert all(END not in out for out in plain.values())


def test_a_thought_that_never_ends_is_unconstrained(tiny_models, think_tokenizer, tiny_drafter, free_reference):
    """The prompt opens a thought and the model does not end it within max_tokens: the output is the
    free greedy output (no grammar ever applied), with DFlash too."""
    prompt = PROMPTS[2]  # its thought ends at output token 27
    dflash = engine(tiny_models, think_tokenizer,
                    speculative=SpeculativeConfig(model=str(tiny_drafter), num_speculative_tokens=7))
    out = dflash.generate([prompt], constrained("json_schema", max_tokens=20))[0]
    assert out.token_ids == free_reference["r2"][:20] and out.finish_reason == "length"
