"""Stop conditions: EOS ids, stop token ids, stop strings, max_tokens, min_tokens, abort."""

from __future__ import annotations

import pytest

from blockspec.config import EngineConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams
from blockspec.errors import RequestError


@pytest.fixture(scope="module")
def engine(tiny_models):
    return Engine(EngineConfig(model=str(tiny_models["qwen3"]), device="cpu", max_model_len=256))


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 40, "ignore_eos": True, **kw})


def test_max_tokens_and_stop_token_ids(engine):
    base = engine.generate(["hello"], greedy())[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 40
    stop_at = base.token_ids[5]
    first = base.token_ids.index(stop_at)
    out = engine.generate(["hello"], greedy(stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert out.token_ids == base.token_ids[:first + 1]
    # min_tokens masks the stop token until enough tokens are out
    late = engine.generate(["hello"], greedy(stop_token_ids=[stop_at], min_tokens=first + 2))[0]
    assert stop_at not in late.token_ids[:first + 2]


def test_eos_stops_unless_ignored(engine):
    base = engine.generate(["hello"], greedy())[0]
    eos = base.token_ids[3]
    engine.eos_ids.append(eos)
    try:
        out = engine.generate(["hello"], greedy(ignore_eos=False))[0]
        assert out.finish_reason == "stop" and out.stop_reason is None
        assert out.token_ids[-1] == eos and len(out.token_ids) <= 4
        assert len(engine.generate(["hello"], greedy(ignore_eos=True))[0].token_ids) == 40
    finally:
        engine.eos_ids.pop()


def test_stop_string_cuts_text(engine):
    base = engine.generate(["hello"], greedy())[0]
    stop = base.text[6:9]
    out = engine.generate(["hello"], greedy(stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[:base.text.index(stop)]
    kept = engine.generate(["hello"], greedy(stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.text == base.text[:base.text.index(stop) + len(stop)]


def test_abort_frees_blocks(engine):
    engine.add_request("long", "x" * 50, greedy(max_tokens=100))
    engine.step()
    assert engine.allocator.num_free < engine.allocator.num_blocks
    assert engine.abort_request("long")
    assert engine.allocator.num_free == engine.allocator.num_blocks
    assert not engine.has_unfinished_requests()
    assert not engine.abort_request("long")


def test_too_long_prompt_is_refused_with_numbers(engine):
    with pytest.raises(RequestError, match="exceeds max_model_len 256"):
        engine.add_request("big", "y" * 200, greedy(max_tokens=100))
    with pytest.raises(RequestError, match="max_model_len is 256"):
        engine.add_request("huge", "y" * 300, greedy())
    assert not engine.has_unfinished_requests()
