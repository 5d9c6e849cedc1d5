"""Hybrid (Gated DeltaNet) and MoE targets on the uniform decode path equal the general path.

The decode path (runner/decode_step.py: fixed shapes, state slot pairs, in-step commit of the verify
block, chained steps) and the general path (runner/model_runner.py: ragged spans, commit after
acceptance) must give the same tokens, token for token, on CPU in fp32: greedy with k in {0, 3, 15}
through chained steps that are used and dropped (EOS, a late join, an abort), both rollback modes,
and seeded sampling (the step re-commits with the host's acceptance).
"""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams
from tests.conftest import save_tiny_drafter
from tests.tiny_hybrid import save_tiny_hybrid

PROMPTS = ["hello world", "a" * 37, "The quick brown fox jumps over", "x", "def f(n):\n    return"]


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("decode_hybrid")
    return {f: save_tiny_hybrid(root / f, f, num_layers=4) for f in ("qwen3_5", "qwen3_next", "qwen3_moe")}


@pytest.fixture(scope="module")
def drafters(tmp_path_factory, targets) -> dict:
    """Random DFlash drafters (low acceptance, but chained steps need a real drafter)."""
    root = tmp_path_factory.mktemp("decode_hybrid_drafters")
    out = {}
    for family, path in targets.items():
        cfg = AutoConfig.from_pretrained(path)
        out[family] = save_tiny_drafter(root / family, getattr(cfg, "text_config", cfg), target_layer_ids=[0, 2])
    return out


def make(path, k: int, decode_path: bool, references: dict | None = None, drafter=None) -> Engine:
    """k drafts per step from `drafter`, or synthetic ones from `references` (high acceptance, never chained)."""
    spec = SpeculativeConfig(model=str(drafter), num_speculative_tokens=k) if k and drafter else SpeculativeConfig()
    engine = Engine(EngineConfig(model=str(path), device="cpu", max_num_seqs=8, speculative=spec))
    if k and drafter is None:
        engine.enable_synthetic_drafts(references or {}, 0.75, k)
    if not decode_path:
        engine.runner.decode = None
    else:
        engine.runner.decode.pipelined = True  # chain steps on CPU too (eagerly), as CUDA graphs do
    engine._set_lookahead()
    return engine


def run(engine: Engine, sampled: bool = False, abort_at: int | None = None) -> dict[str, list[int]]:
    """Ragged lengths, one request able to stop on EOS, one joining late, optionally one aborted."""
    def params(i: int) -> SamplingParams:
        if sampled:
            return SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=40 + 7 * i, ignore_eos=True)
        return SamplingParams(temperature=0, max_tokens=84 + 7 * i, ignore_eos=i != 2)  # k=15 chains 32 from the end

    for i, p in enumerate(PROMPTS[:4]):
        engine.add_request(f"r{i}", p, params(i))
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == 5:
            engine.add_request("late", PROMPTS[4], params(4))
        if steps == abort_at:
            assert engine.abort_request("r1")
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert engine.allocator.num_free == engine.allocator.num_blocks
    if hasattr(engine.allocator, "num_free_slots"):
        assert engine.allocator.num_free_slots == engine.allocator.num_slots
    return done


@pytest.fixture(scope="module")
def references(targets) -> dict:
    """Greedy AR through the general path: the synthetic proposer's source and the oracle."""
    return {f: run(make(p, 0, decode_path=False)) for f, p in targets.items()}


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "qwen3_moe"])
@pytest.mark.parametrize("k", [0, 3, 15])
def test_chained_decode_path_equals_general_path(targets, drafters, references, family, k):
    """Greedy with a DFlash drafter through chained steps: used ones, and ones dropped by the late join."""
    general = run(make(targets[family], k, decode_path=False, drafter=drafters[family]))
    assert general == references[family]  # lossless, the oracle
    engine = make(targets[family], k, decode_path=True, drafter=drafters[family])
    assert run(engine) == general
    decode = engine.runner.decode
    assert decode.chained_used > 5 and decode.chained_dropped >= 1


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_deep_acceptance_on_the_decode_path(targets, references, family):
    """Synthetic drafts accepted at every depth (k = 15): every rollback point of the commit."""
    engine = make(targets[family], 15, decode_path=True, references=references[family])
    assert run(engine) == references[family]


@pytest.mark.parametrize("mode", ["replay", "checkpoint"])
def test_rollback_modes_and_abort(targets, references, monkeypatch, mode):
    monkeypatch.setenv("BLOCKSPEC_GDN_ROLLBACK", mode)
    refs = references["qwen3_5"]
    general = run(make(targets["qwen3_5"], 7, decode_path=False, references=refs), abort_at=9)
    decode = run(make(targets["qwen3_5"], 7, decode_path=True, references=refs), abort_at=9)
    assert decode == general and "r1" not in decode
    assert {r: t for r, t in decode.items()} == {r: refs[r] for r in decode}


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_seeded_sampling_recommits_the_host_acceptance(targets, references, family):
    """Sampled steps decide acceptance on the host after the step committed its greedy guess: the
    re-commit must leave exactly the state the general path reaches."""
    refs = references[family]
    general = run(make(targets[family], 5, decode_path=False, references=refs), sampled=True)
    assert run(make(targets[family], 5, decode_path=True, references=refs), sampled=True) == general
