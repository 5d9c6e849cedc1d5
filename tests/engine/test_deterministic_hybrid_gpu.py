"""--deterministic on the GPU for the Gated DeltaNet hybrids (issue 17), through the Engine as serve builds it (CUDA
graphs for decode and verify, the eager general path for prefill and mixed steps): greedy DFlash with a random
drafter at k = 0, 7, 15 equals greedy decoding, at batch 1 and batch 8, bit for bit in bf16. A tiny Qwen3.5 (dense
MLP in every layer) and a tiny Qwen3.5-MoE (routed experts and a gated shared expert), each DeltaNet x3 + gated
attention. GPU only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.test_deterministic_gpu import TINY_PROMPTS, outputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def tiny_hybrid(root: Path, family: str) -> tuple[Path, Path]:
    """The family's tiny target and a random DFlash drafter reading its layers 0 and 2."""
    from transformers import AutoConfig

    from tests.conftest import save_tiny_drafter
    from tests.tiny_hybrid import save_tiny_hybrid

    target = save_tiny_hybrid(root / "target", family, num_layers=4)
    cfg = AutoConfig.from_pretrained(target)
    drafter = save_tiny_drafter(root / "drafter", getattr(cfg, "text_config", cfg), target_layer_ids=[0, 2])
    return target, drafter


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def hybrid(request, tmp_path_factory) -> tuple[Path, Path, list[list[int]]]:
    """(target, drafter, greedy AR output of every prompt alone)."""
    from blockspec.engine.sampling_params import SamplingParams

    target, drafter = tiny_hybrid(tmp_path_factory.mktemp(f"det_{request.param}_gpu"), request.param)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    return target, drafter, outputs(target, None, 0, TINY_PROMPTS, params, batch=1)


@pytest.mark.parametrize("k", [0, 7, 15])
def test_tiny_hybrid_dflash_equals_greedy_at_batch_1_and_8(hybrid, k):
    from blockspec.engine.sampling_params import SamplingParams

    target, drafter, alone = hybrid
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    assert outputs(target, drafter, k, TINY_PROMPTS, params, batch=1) == alone
    assert outputs(target, drafter, k, TINY_PROMPTS, params, batch=8) == alone
    # chunked prefill (16-token chunks: prompts cut into them beside other sequences' chunks and verify blocks)
    assert outputs(target, drafter, k, TINY_PROMPTS, params, batch=8, max_num_batched_tokens=16) == alone


def test_tiny_hybrid_eager_equals_graphs(hybrid):
    """The uniform decode/verify path (DecodeStateMetadata) in CUDA graphs and eagerly: the same bits."""
    from blockspec.engine.sampling_params import SamplingParams

    target, drafter, _ = hybrid
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    graphs = outputs(target, drafter, 15, TINY_PROMPTS, params, batch=8)
    assert outputs(target, drafter, 15, TINY_PROMPTS, params, batch=8, enforce_eager=True) == graphs
