"""--deterministic on the Gated DeltaNet hybrids, CPU bf16 (where rounding does depend on the step's rows): greedy
DFlash (a random drafter) at k = 0, 7, 15, alone and in a batch of 8, equals greedy decoding alone token for token,
for Qwen3.5 dense (a SwiGLU MLP in every layer) and Qwen3-Next (packed projections, MoE with a gated shared
expert; k = 7 on Qwen3-Next only); deep acceptance from synthetic drafts with both rollback modes, preemption and
prefix-cache snapshots; and in fp32 the deterministic path computes the same model as the regular one."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams
from tests.conftest import save_tiny_drafter
from tests.tiny_hybrid import save_tiny_hybrid

PROMPTS = ["hello world", "a" * 37, "The quick brown fox jumps over", "x", "def f(n):\n    return", "zz top",
           "1 2 3 4", "qwerty"]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
FAMILIES = ("qwen3_5", "qwen3_next")
SMALL_KV = 8 * 16 * 1 * 2 * 2 * 16 * 2  # 8 blocks of one attention layer's bf16 K/V: forces preemption


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Each family's tiny target (4 layers: DeltaNet x3, gated attention) and a random DFlash drafter for it."""
    root = tmp_path_factory.mktemp("det_hybrid")
    out = {}
    for family in FAMILIES:
        target = save_tiny_hybrid(root / family, family, num_layers=4)
        cfg = AutoConfig.from_pretrained(target)
        drafter = save_tiny_drafter(root / f"{family}_draft", getattr(cfg, "text_config", cfg), target_layer_ids=[0, 2])
        out[family] = target, drafter
    return out


def engine(target: Path, drafter: Path | None, k: int, **config) -> Engine:
    spec = SpeculativeConfig(model=str(drafter), num_speculative_tokens=k) if k else SpeculativeConfig()
    return Engine(EngineConfig(model=str(target), device="cpu", dtype="bfloat16", speculative=spec,
                               deterministic=True, **{"max_num_batched_tokens": 24, **config}))


@pytest.fixture(scope="module")
def alone(hybrids) -> dict[str, list[list[int]]]:
    """Greedy decoding, one request at a time."""
    out = {}
    for family, (target, _) in hybrids.items():
        eng = engine(target, None, 0)
        out[family] = [eng.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    return out


# k = 7 (several verify blocks a step) on Qwen3-Next only: the blocks' state handling is the Gated DeltaNet layer
# both families share, and the tiny Qwen3-Next's layers hold every kind of Qwen3.5's (dense SwiGLU MLPs between
# its MoE layers), with the projections packed
@pytest.mark.parametrize("k,family", [(0, "qwen3_5"), (0, "qwen3_next"), (7, "qwen3_next"), (15, "qwen3_5"),
                                      (15, "qwen3_next")])
def test_dflash_at_batch_1_and_8_equals_greedy_alone(hybrids, alone, family, k):
    target, drafter = hybrids[family]
    eng = engine(target, drafter, k)
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == alone[family]
    if k:
        assert [eng.generate([p], GREEDY)[0].token_ids for p in PROMPTS[:3]] == alone[family][:3]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["replay", "checkpoint"])
def test_deep_acceptance_preemption_and_snapshots(hybrids, alone, monkeypatch, family, mode):
    """Synthetic drafts (the greedy output, corrupted at 20%): commits at every depth of a k = 7 block, on a KV
    cache small enough to preempt (recompute from a fresh slot), 24-token prefill chunks and prefix-cache
    snapshots every block (prompts sharing prefixes resume from them), all in a batch of 8."""
    monkeypatch.setenv("BLOCKSPEC_GDN_ROLLBACK", mode)
    target, _ = hybrids[family]
    eng = engine(target, None, 0, max_num_batched_tokens=24, max_model_len=96, kv_cache_memory=SMALL_KV,
                 mamba_cache_mode="all")
    prompts = PROMPTS + [PROMPTS[1] + " b", PROMPTS[2] + " dog"]
    want = alone[family] + [engine(target, None, 0).generate([p], GREEDY)[0].token_ids for p in prompts[8:]]
    eng.enable_synthetic_drafts({f"r{i}": w for i, w in enumerate(want)}, 0.8, 7)
    preempted = []
    preempt = eng.scheduler._preempt
    monkeypatch.setattr(eng.scheduler, "_preempt", lambda seq, out: (preempted.append(seq), preempt(seq, out)))
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(**vars(GREEDY)))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert [done[f"r{i}"] for i in range(len(prompts))] == want
    assert preempted


@pytest.mark.parametrize("family", [*FAMILIES, "qwen3_5_moe"])
def test_fp32_output_is_the_models(hybrids, tmp_path, family):
    """In fp32 the deterministic path computes the same model as the regular CPU path (the lossless tests' oracle):
    zero-centred norms, gated attention, the conv and delta rule in their per-token form, the shared expert."""
    target = hybrids[family][0] if family in hybrids else save_tiny_hybrid(tmp_path / family, family, num_layers=4)

    def greedy(det: bool) -> list[list[int]]:
        eng = Engine(EngineConfig(model=str(target), device="cpu", deterministic=det, max_num_batched_tokens=24))
        return [o.token_ids for o in eng.generate(PROMPTS[:4], GREEDY)]
    assert greedy(True) == greedy(False)
