"""Constrained speculative decoding is lossless: greedy DFlash output under a grammar equals greedy
autoregressive output under the same grammar, token for token, and follows the grammar.

The grammar's mask applies at every verify position (drafts before it taken as accepted), so a draft
outside the grammar is rejected there and the bonus token is the target's argmax under the mask.
CPU, fp32: tiny random targets with a random drafter (drafts mostly outside the grammar), the
synthetic proposer (drafts from the known constrained output: high acceptance, so accept and
rollback run hard), and the embedded SmolLM2 with its shipped drafter (real acceptance).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams
from blockspec.structured.spec import StructuredSpec
from tests.engine import test_lossless as unconstrained
from tests.structured.structured_cases import EMAIL, PERSON, PROMPTS, SPECS


def constrained(kind: str, max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured=SPECS[kind])


def check_follows(kind: str, text: str, finished_by_stop: bool) -> None:
    """A complete output is a sentence of its grammar (a cut one only a prefix, not checked here)."""
    if not finished_by_stop:
        return
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(EMAIL, text), text
    elif kind == "choice":
        assert text in SPECS["choice"].value
    else:
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text), text


@pytest.fixture(scope="module")
def ar_reference(tiny_models) -> dict[str, dict[str, list[int]]]:
    engine = Engine(EngineConfig(model=str(tiny_models["qwen3"]), device="cpu"))
    ref = {}
    for kind in SPECS:
        outs = engine.generate(PROMPTS, constrained(kind))
        for out in outs:
            check_follows(kind, out.text, out.finish_reason == "stop")
        ref[kind] = {f"r{i}": out.token_ids for i, out in enumerate(outs)}
    return ref


@pytest.mark.parametrize("k", [4, 15])
def test_constrained_dflash_equals_constrained_autoregressive(tiny_models, tiny_drafter, ar_reference, k):
    spec = SpeculativeConfig(model=str(tiny_drafter), num_speculative_tokens=k)
    engine = Engine(EngineConfig(model=str(tiny_models["qwen3"]), device="cpu", speculative=spec,
                                 max_num_batched_tokens=24))
    for kind in SPECS:
        assert unconstrained.run_all(engine, PROMPTS, constrained(kind)) == ar_reference[kind], kind
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_high_acceptance_constrained_equals_autoregressive(tiny_models, ar_reference):
    """Drafts from the known constrained output (90% kept, the rest random: mostly outside the grammar)."""
    engine = Engine(EngineConfig(model=str(tiny_models["qwen3"]), device="cpu", max_num_batched_tokens=20))
    for kind in ("json_schema", "regex", "lark"):
        engine.enable_synthetic_drafts(ar_reference[kind], 0.9, 8)
        assert unconstrained.run_all(engine, PROMPTS, constrained(kind)) == ar_reference[kind], kind
        counters = engine.spec_counters  # drafts were really accepted under the grammar
        assert counters.num_accepted_tokens > 0.3 * counters.num_draft_tokens, kind


def test_mixed_batch_keeps_unconstrained_rows_unchanged(tiny_models, tiny_drafter):
    """A constrained sequence in the batch changes nothing for the others (same tokens as alone)."""
    spec = SpeculativeConfig(model=str(tiny_drafter), num_speculative_tokens=5)
    engine = Engine(EngineConfig(model=str(tiny_models["qwen3"]), device="cpu", speculative=spec))
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    alone = engine.generate(PROMPTS[:2], free)
    mixed = engine.generate(PROMPTS[:2] + PROMPTS[:2], [free, free, constrained("regex"), constrained("choice")])
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    assert mixed[3].text in SPECS["choice"].value and mixed[3].finish_reason == "stop"


def test_embedded_model_with_its_drafter(default_model):
    """SmolLM2-135M + the shipped DFlash drafter: a JSON schema, greedy, DFlash == AR, valid and accepted."""
    from blockspec.loader.default_model import default_drafter_dir

    messages = [{"role": "user", "content": "Describe a person named Alice who is 30 years old as JSON."}]
    params = SamplingParams(temperature=0, max_tokens=40, structured=StructuredSpec("json_schema", PERSON))
    spec = SpeculativeConfig(model=str(default_drafter_dir()), num_speculative_tokens=15)
    engine = Engine(EngineConfig(model=str(default_model), device="cpu", speculative=spec, max_model_len=512))
    prompt = engine.apply_chat_template(messages)
    dflash = engine.generate([prompt], params)[0]
    engine.set_num_speculative_tokens(0)
    ar = engine.generate([prompt], params)[0]
    assert dflash.token_ids == ar.token_ids
    assert ar.finish_reason == "stop"
    jsonschema.validate(json.loads(ar.text), PERSON)
    assert dflash.stats.tau > 2.0


def test_the_grammar_wins_over_min_tokens(tiny_models, tiny_drafter):
    """min_tokens masks the stop token, but a complete grammar allows nothing else: the grammar ends it."""
    spec = SpeculativeConfig(model=str(tiny_drafter), num_speculative_tokens=4)
    engine = Engine(EngineConfig(model=str(tiny_models["qwen3"]), device="cpu", speculative=spec))
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=10, structured=SPECS["choice"])
    out = engine.generate(PROMPTS[:1], params)[0]
    assert out.text in SPECS["choice"].value and out.finish_reason == "stop"
