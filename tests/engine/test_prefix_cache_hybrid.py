"""Prefix caching on Gated DeltaNet hybrids (tiny Qwen3.5 with a DFlash drafter, tiny Qwen3-Next; fp32, CPU).

A hit resumes from the recurrent-state snapshot saved at the deepest cached block boundary: the next
turn of a conversation resumes at the end of the previous prompt, a prompt sharing a system prompt
at the last snapshot inside it. Greedy output with the cache equals the output without, also when
sequences run together in a KV cache small enough to preempt them.
"""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams
from tests.conftest import save_tiny_drafter
from tests.engine.test_prefix_cache import SYSTEM, run_together
from tests.tiny_hybrid import save_tiny_hybrid

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
WITH_LOGPROBS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hybrid_prefix")
    paths = {f: save_tiny_hybrid(root / f, f, num_layers=4) for f in ("qwen3_5", "qwen3_next")}
    text = AutoConfig.from_pretrained(paths["qwen3_5"]).text_config
    paths["draft"] = save_tiny_drafter(root / "draft", text, target_layer_ids=[0, 2])
    return paths


def engine_for(hybrids, family: str, **overrides) -> Engine:
    spec = SpeculativeConfig(model=str(hybrids["draft"]), num_speculative_tokens=7) if family == "qwen3_5" \
        else SpeculativeConfig()
    return Engine(EngineConfig(model=str(hybrids[family]), device="cpu", speculative=spec, mamba_block_size=32,
                               **overrides))


def with_logprobs(engine: Engine, prompt: list[int]):
    engine.add_request("lp", prompt, WITH_LOGPROBS)
    values, final = [], None
    while final is None:
        for out in engine.step():
            values += [lp.logprob for lp in out.new_logprobs or ()]
            final = out if out.finished else None
    return final, values


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_hits_resume_from_snapshots_with_identical_greedy_output(hybrids, family):
    cached, plain = engine_for(hybrids, family), engine_for(hybrids, family, enable_prefix_caching=False)
    turn1 = cached.encode(SYSTEM + "Q: first?")
    first = cached.generate([turn1], GREEDY)[0]
    assert first.token_ids == plain.generate([turn1], GREEDY)[0].token_ids
    turn2 = turn1 + first.token_ids + cached.encode(" Q: and then?")
    other = cached.encode(SYSTEM[:70] + "a different question")
    for prompt, hit in ((turn2, len(turn1) // 16 * 16),  # the previous prompt's end
                        (other, 64),  # the last snapshot (every 32 tokens) inside the 70 shared tokens
                        (turn1[:33], 32)):  # one token left: the step takes the uniform decode path
        (got, got_lps), (want, want_lps) = with_logprobs(cached, prompt), with_logprobs(plain, prompt)
        assert got.stats.cached_tokens == hit
        assert got.token_ids == want.token_ids
        # the tiny model's state decays fast, so tokens alone would hardly notice a wrong state: the numbers do
        assert got_lps == pytest.approx(want_lps, rel=1e-4, abs=1e-5)
    assert cached.allocator.snapshots.saved > 0


def test_under_pressure_with_preemption(hybrids, monkeypatch):
    requests = [(SYSTEM + "Q: one", GREEDY), (SYSTEM + "Q: two", GREEDY), (SYSTEM[:50] + "elsewhere", GREEDY),
                (SYSTEM + "Q: one", GREEDY), (SYSTEM + "Q: gone", GREEDY)]
    plain = engine_for(hybrids, "qwen3_next", enable_prefix_caching=False)
    want = {f"r{i}": plain.generate([p], params)[0].token_ids for i, (p, params) in enumerate(requests[:-1])}
    one_block = 16 * 1 * 2 * 2 * 16 * 4  # one attention layer's K and V for 16 tokens
    engine = engine_for(hybrids, "qwen3_next", max_num_batched_tokens=40, max_model_len=112,
                        kv_cache_memory=10 * one_block)
    preempted = []
    preempt = engine.scheduler._preempt
    monkeypatch.setattr(engine.scheduler, "_preempt", lambda seq, out: (preempted.append(seq), preempt(seq, out)))
    assert run_together(engine, requests, abort_after={"r4": 4}) == want
    assert preempted and engine.prefix_cache_stats.hits > 0
    assert engine.allocator.num_free_slots == engine.allocator.num_slots


def test_no_snapshots_no_hits(hybrids):
    engine = engine_for(hybrids, "qwen3_next", mamba_cache_mode="none")
    engine.generate([SYSTEM + "Q: one"], GREEDY)
    assert engine.generate([SYSTEM + "Q: two"], GREEDY)[0].stats.cached_tokens == 0
    assert engine.allocator.num_cached > 0  # attention blocks are cached, but no state to resume from
