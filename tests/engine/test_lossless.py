"""Greedy speculative decoding is lossless: identical tokens to greedy autoregressive decoding.

Runs on CPU in fp32 with ragged batches, chunked prefill and a KV cache small enough to force
preemption. Drafts come from the DFlash drafter (random weights: few acceptances) and from the
synthetic proposer (known continuations, high acceptance), which drives accept and rollback hard.
"""

from __future__ import annotations

import pytest

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams

PROMPTS = ["hello world", "a" * 37, "The quick brown fox jumps over", "x", "def f(n):\n    return"]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def run_all(engine: Engine, prompts, params=GREEDY) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(**vars(params)))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return done


@pytest.fixture(scope="module")
def ar_reference(tiny_models) -> dict[str, list[int]]:
    engine = Engine(EngineConfig(model=str(tiny_models["qwen3"]), device="cpu"))
    return {f"r{i}": run_all(engine, [p])["r0"] for i, p in enumerate(PROMPTS)}


@pytest.mark.parametrize("k", [1, 4, 15])
def test_dflash_greedy_equals_autoregressive(tiny_models, tiny_drafter, ar_reference, k):
    spec = SpeculativeConfig(model=str(tiny_drafter), num_speculative_tokens=k)
    engine = Engine(EngineConfig(model=str(tiny_models["qwen3"]), device="cpu", speculative=spec,
                                 max_num_batched_tokens=24))
    assert run_all(engine, PROMPTS) == ar_reference
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_dflash2_greedy_equals_autoregressive(tiny_models, tiny_drafter2, ar_reference):
    """A DFlash 2 drafter (convolutions, candidate selector, sliding-window layers) through chunked prefill,
    a ragged batch and the decode path: greedy output is the target's."""
    spec = SpeculativeConfig(model=str(tiny_drafter2), num_speculative_tokens=7)
    engine = Engine(EngineConfig(model=str(tiny_models["qwen3"]), device="cpu", speculative=spec,
                                 max_num_batched_tokens=24))
    assert run_all(engine, PROMPTS) == ar_reference
    assert engine.allocator.num_free == engine.allocator.num_blocks


@pytest.mark.parametrize("k,accept_prob", [(1, 0.7), (4, 0.8), (15, 0.9), (15, 1.0)])
def test_high_acceptance_greedy_equals_autoregressive(tiny_models, ar_reference, k, accept_prob):
    # ~40 KV blocks for 5 sequences of up to 100 tokens: the scheduler has to preempt and recompute.
    engine = Engine(EngineConfig(model=str(tiny_models["qwen3"]), device="cpu", max_num_batched_tokens=20,
                                 kv_cache_memory=40 * 16 * 6 * 2 * 2 * 16 * 4))
    engine.enable_synthetic_drafts(ar_reference, accept_prob, k)
    outs = {}
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, SamplingParams(**vars(GREEDY)))
    taus = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.token_ids
                taus.append(out.stats.tau)
    assert outs == ar_reference
    assert min(taus) > 1.3  # drafts were really accepted
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_each_sequence_in_a_batch_equals_its_output_alone(tiny_models, tiny_drafter):
    """Ragged batch (different prompt lengths, sampled and greedy mixed) vs one at a time."""
    spec = SpeculativeConfig(model=str(tiny_drafter), num_speculative_tokens=7)
    engine = Engine(EngineConfig(model=str(tiny_models["qwen3"]), device="cpu", speculative=spec))
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=25, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=20, seed=5, max_tokens=33, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)]
    prompts = PROMPTS[:4]
    batch = engine.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, batch):
        alone = engine.generate([prompt], p)[0]
        assert alone.token_ids == out.token_ids
        assert alone.text == out.text


def test_stats_are_consistent(tiny_models, ar_reference):
    engine = Engine(EngineConfig(model=str(tiny_models["qwen3"]), device="cpu"))
    engine.enable_synthetic_drafts(ar_reference, 1.0, 4)
    engine.add_request("r0", PROMPTS[0], SamplingParams(**vars(GREEDY)))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    st = final.stats
    assert st.completion_tokens == 48
    assert st.decode_tokens == 47  # the first token comes from the prefill
    assert st.tau == pytest.approx(st.decode_tokens / st.steps)
    assert st.tau > 4  # every draft right: k + 1 per step except the clipped last one
    assert len(st.accepted_per_position) == 4 and st.accepted_per_position[0] >= st.accepted_per_position[3]
    assert st.prompt_tokens == len(engine.encode(PROMPTS[0]))
    assert st.prefill_time > 0 and st.decode_time > 0 and st.decode_tok_s > 0


@pytest.mark.parametrize("synthetic", [False, True])
def test_padded_decode_batches_stay_lossless(tiny_models, tiny_drafter, ar_reference, synthetic):
    """The CUDA-graph layout (batches padded to bucket sizes on a scratch block), exercised on CPU."""
    spec = SpeculativeConfig(model=str(tiny_drafter), num_speculative_tokens=5)
    engine = Engine(EngineConfig(model=str(tiny_models["qwen3"]), device="cpu", speculative=spec))
    if synthetic:
        engine.enable_synthetic_drafts(ar_reference, 0.8, 5)
    engine.runner.decode.graphs.pad = True  # 5 sequences run as a batch of 8
    assert run_all(engine, PROMPTS) == ar_reference
    assert engine.allocator.num_free == engine.allocator.num_blocks
