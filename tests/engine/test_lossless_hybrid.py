"""Greedy speculative decoding is lossless on hybrid (Gated DeltaNet) targets.

Tiny random Qwen3.5 (dense) and Qwen3-Next (MoE, packed projections) checkpoints, CPU fp32: greedy
output with k in {1, 7, 15} drafts per step equals greedy autoregressive output token for token,
over a ragged batch with chunked prefill, a KV cache small enough to force preemption, and both
ways of rolling the recurrent state back (replay / per-position checkpoints). Drafts come from the
synthetic proposer (the AR output, corrupted at a chosen rate) so that acceptance lengths vary over
the whole range and every rollback depth is exercised; one run uses a random DFlash drafter.
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
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SMALL_KV = 8 * 16 * 1 * 2 * 2 * 16 * 4  # 8 blocks of one attention layer's K/V: forces preemption


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hybrid_engine")
    return {f: save_tiny_hybrid(root / f, f, num_layers=4) for f in ("qwen3_5", "qwen3_next")}


def run_all(engine: Engine, prompts=PROMPTS) -> tuple[dict[str, list[int]], list[float]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(**vars(GREEDY)))
    done, taus = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
                taus.append(out.stats.tau)
    return done, taus


@pytest.fixture(scope="module")
def ar_reference(hybrids) -> dict:
    refs = {}
    for family, path in hybrids.items():
        engine = Engine(EngineConfig(model=str(path), device="cpu"))
        refs[family] = {f"r{i}": run_all(engine, [p])[0]["r0"] for i, p in enumerate(PROMPTS)}
    return refs


def _assert_all_released(engine: Engine) -> None:
    assert engine.allocator.num_free == engine.allocator.num_blocks
    assert engine.allocator.num_free_slots == engine.allocator.num_slots


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("k,accept_prob,mode", [(1, 0.7, "replay"), (7, 0.8, "replay"), (15, 0.9, "replay"),
                                                (7, 0.8, "checkpoint"), (15, 0.9, "checkpoint")])
def test_greedy_speculative_equals_autoregressive(hybrids, ar_reference, monkeypatch, family, k, accept_prob, mode):
    monkeypatch.setenv("BLOCKSPEC_GDN_ROLLBACK", mode)
    # Chunked prefill, and room for several verify blocks at once so the small KV cache runs out.
    budget = max(20, 3 * (k + 1))
    engine = Engine(EngineConfig(model=str(hybrids[family]), device="cpu", max_num_batched_tokens=budget,
                                 max_model_len=96, kv_cache_memory=SMALL_KV))
    engine.enable_synthetic_drafts(ar_reference[family], accept_prob, k)
    preempted = []
    preempt = engine.scheduler._preempt
    monkeypatch.setattr(engine.scheduler, "_preempt", lambda seq, out: (preempted.append(seq), preempt(seq, out)))
    outs, taus = run_all(engine)
    assert outs == ar_reference[family]
    assert max(taus) > 1.5  # drafts were really accepted
    assert preempted  # and sequences were recomputed from a fresh state slot
    _assert_all_released(engine)


def test_batched_equals_alone_with_every_draft_right(hybrids, ar_reference):
    """All drafts right (k + 1 tokens per step) in a batch whose spans start at different offsets."""
    engine = Engine(EngineConfig(model=str(hybrids["qwen3_5"]), device="cpu"))
    engine.enable_synthetic_drafts(ar_reference["qwen3_5"], 1.0, 15)
    outs, taus = run_all(engine)
    assert outs == ar_reference["qwen3_5"]
    assert min(taus) > 8


def test_dflash_drafter_on_a_hybrid_target(hybrids, ar_reference, tmp_path):
    """A (random) DFlash drafter reading a hybrid target's context features: still lossless."""
    drafter = save_tiny_drafter(tmp_path / "draft", AutoConfig.from_pretrained(hybrids["qwen3_5"]).text_config,
                                target_layer_ids=[0, 2])
    spec = SpeculativeConfig(model=str(drafter), num_speculative_tokens=7)
    engine = Engine(EngineConfig(model=str(hybrids["qwen3_5"]), device="cpu", speculative=spec,
                                 max_num_batched_tokens=24))
    assert run_all(engine)[0] == ar_reference["qwen3_5"]
    _assert_all_released(engine)


def test_abort_releases_the_state_slot(hybrids):
    engine = Engine(EngineConfig(model=str(hybrids["qwen3_5"]), device="cpu", max_num_seqs=2))
    engine.add_request("a", "hello", SamplingParams(**vars(GREEDY)))
    engine.add_request("b", "world", SamplingParams(**vars(GREEDY)))
    engine.step()
    assert engine.allocator.num_free_slots == 0
    assert engine.abort_request("a")
    assert engine.allocator.num_free_slots == 1
    engine.add_request("c", "again", SamplingParams(**vars(GREEDY)))
    while engine.has_unfinished_requests():
        engine.step()
    _assert_all_released(engine)


def test_start_up_report_names_the_state(hybrids, monkeypatch, caplog):
    monkeypatch.setenv("BLOCKSPEC_GDN_ROLLBACK", "checkpoint")
    with caplog.at_level("INFO", logger="blockspec"):
        engine = Engine(EngineConfig(model=str(hybrids["qwen3_5"]), device="cpu", max_num_seqs=4))
    assert any("recurrent state: 4 sequences x 2 slots" in r.getMessage() for r in caplog.records)
    target = engine.runner.target
    base = target.state_bytes_per_seq(0)
    # 3 DeltaNet layers: conv window (3 x 128 fp32) + state (4 x 16 x 16 fp32) each
    assert base == 3 * (3 * 128 * 4 + 4 * 16 * 16 * 4)
    assert target.state_bytes_per_seq(16) == base + 3 * 16 * 4 * 16 * 16 * 4
    engine.enable_synthetic_drafts({}, 1.0, 15)  # checkpoint mode: slots re-made with k + 1 states
    # a slot pair per sequence plus the scratch pair, 16 prefix-cache snapshots, and 16 checkpoints for each
    # of the 4 rows
    assert engine.state_bytes == (2 * 4 + 2 + 16) * base + 4 * 3 * 16 * 4 * 16 * 16 * 4
