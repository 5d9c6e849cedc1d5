"""Pipelined decoding (the next step chained on the device before this one is read) changes nothing.

On CPU the chain runs eagerly, step after step, through the same host bookkeeping and the same
decode-inputs reference the GPU path uses; outputs must equal plain decoding token for token while
sequences finish at different steps, stop on EOS and join mid-run.
"""

from __future__ import annotations

import pytest

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams

PROMPTS = ["hello world", "a" * 37, "The quick brown fox jumps over", "x", "def f(n):\n    return"]


def engine_for(tiny_models, tiny_drafter, k: int, pipelined: bool) -> Engine:
    spec = SpeculativeConfig(model=str(tiny_drafter), num_speculative_tokens=k) if k else SpeculativeConfig()
    engine = Engine(EngineConfig(model=str(tiny_models["qwen3"]), device="cpu", speculative=spec))
    engine.runner.decode.pipelined = pipelined
    engine._set_lookahead()
    return engine


def run(engine: Engine, base: int | None = None) -> dict[str, list[int]]:
    """Ragged lengths, one request stopping on EOS, one joining after a few steps."""
    if base is None:
        base = 20 + 4 * engine.num_speculative_tokens  # chaining stops 2 (k + 1) tokens before max_tokens
    for i, p in enumerate(PROMPTS[:4]):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=base + 9 * i, ignore_eos=i != 2))
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == 6:
            engine.add_request("late", PROMPTS[4], SamplingParams(temperature=0, max_tokens=33, ignore_eos=True))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return done


@pytest.mark.parametrize("k", [0, 3, 15])
def test_pipelined_decode_equals_plain_decode(tiny_models, tiny_drafter, k):
    plain = run(engine_for(tiny_models, tiny_drafter, k, pipelined=False))
    engine = engine_for(tiny_models, tiny_drafter, k, pipelined=True)
    assert run(engine) == plain
    decode = engine.runner.decode
    assert decode.chained_used > 10 and decode.chained_dropped >= 1
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_pipelined_decode_equals_autoregressive(tiny_models, tiny_drafter):
    """Greedy DFlash through chained steps is still exactly greedy AR."""
    ar = run(engine_for(tiny_models, tiny_drafter, 0, pipelined=False), base=44)
    assert run(engine_for(tiny_models, tiny_drafter, 6, pipelined=True), base=44) == ar


def test_abort_and_preemption_while_a_step_is_chained(tiny_models, tiny_drafter, monkeypatch):
    """A request aborted between steps leaves a dead row in the chained step; a KV cache too small for
    every lookahead block forces preemption and recompute. The survivors' tokens stay exact."""
    def engine(pipelined: bool) -> Engine:
        spec = SpeculativeConfig(model=str(tiny_drafter), num_speculative_tokens=3)
        # 18 blocks of 16 positions for 4 sequences needing ~27 (plus lookahead): not all fit at once
        per_block = 16 * 2 * 2 * 16 * 4 * (6 + 2)  # K and V, 2 heads of 16, fp32; 6 target + 2 drafter layers
        e = Engine(EngineConfig(model=str(tiny_models["qwen3"]), device="cpu", speculative=spec,
                                kv_cache_memory=18 * per_block, max_model_len=256))
        e.runner.decode.pipelined = pipelined
        e._set_lookahead()
        return e

    def run_with_abort(e: Engine) -> dict[str, list[int]]:
        for i, p in enumerate(PROMPTS[:4]):
            e.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=70, ignore_eos=True))
        done, steps = {}, 0
        while e.has_unfinished_requests():
            steps += 1
            if steps == 30:
                assert e.abort_request("r3")
            for out in e.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
        return done

    from blockspec.engine.scheduler import Scheduler

    preempted = []
    preempt = Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt", lambda self, seq, out: preempted.append(seq) or preempt(self, seq, out))
    plain = run_with_abort(engine(False))
    e = engine(True)
    preempted.clear()
    assert run_with_abort(e) == plain and "r3" not in plain
    assert preempted
    assert e.runner.decode.chained_used > 0
    assert e.allocator.num_free == e.allocator.num_blocks
