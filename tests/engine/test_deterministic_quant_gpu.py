"""--deterministic on the GPU for quantized targets and GPT-OSS (issue 17), through the Engine as serve builds it
(bf16, CUDA graphs): greedy DFlash at k = 0, 7, 15 equals greedy decoding, at batch 1 and in batches of 8, bit for
bit. A tiny random Qwen3 quantized by compressed-tensors itself (int4 with asymmetric groups, NVFP4: every
projection through the quantized kernel's fixed 16-row config), a tiny NVFP4 Qwen3-MoE, and a tiny random GPT-OSS
(sinks, sliding-window layers, biased projections and experts, clamped SwiGLU) with bf16 and with MXFP4 experts,
each with a random drafter. GPU only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from blockspec.engine.sampling_params import SamplingParams
from tests.engine.test_deterministic_gpu import TINY_PROMPTS, outputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PARAMS = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def dflash_equals_greedy(target: Path, drafter: Path, k: int, **config) -> None:
    """Greedy alone (k = 0, batch 1) == DFlash at k, batch 1 and batch 8 (and batch 8 with 16-token prefill chunks)."""
    alone = outputs(target, None, 0, TINY_PROMPTS, PARAMS, batch=1, **config)
    assert outputs(target, drafter, k, TINY_PROMPTS, PARAMS, batch=1, **config) == alone
    assert outputs(target, drafter, k, TINY_PROMPTS, PARAMS, batch=8, **config) == alone
    assert outputs(target, drafter, k, TINY_PROMPTS, PARAMS, batch=8, max_num_batched_tokens=16, **config) == alone


@pytest.fixture(scope="module")
def quantized_qwen3(tiny_models, tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("compressed_tensors")
    from tests.loader.quant_helpers import write_ct_checkpoint

    root = tmp_path_factory.mktemp("det_quant_gpu")
    return {fmt: write_ct_checkpoint(tiny_models["qwen3"], root / fmt, fmt)[0] for fmt in ("int4_asym_g32", "nvfp4")}


@pytest.mark.parametrize("k", [0, 7, 15])
@pytest.mark.parametrize("fmt", ["int4_asym_g32", "nvfp4"])
def test_tiny_quantized_qwen3_dflash_equals_greedy_at_batch_1_and_8(quantized_qwen3, tiny_drafter, fmt, k):
    dflash_equals_greedy(quantized_qwen3[fmt], tiny_drafter, k)


@pytest.mark.parametrize("k", [0, 7, 15])
def test_tiny_quantized_qwen3_moe_dflash_equals_greedy_at_batch_1_and_8(tmp_path_factory, k):
    """NVFP4 experts (and projections) in the fixed expert tiles: one token on 16-row tiles too."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoConfig

    from tests.conftest import save_tiny_drafter
    from tests.loader.quant_helpers import write_ct_checkpoint
    from tests.tiny_hybrid import save_tiny_hybrid

    root = tmp_path_factory.mktemp("det_quant_moe_gpu")
    src = save_tiny_hybrid(root / "src", "qwen3_moe", num_layers=4)
    drafter = save_tiny_drafter(root / "drafter", AutoConfig.from_pretrained(src), target_layer_ids=[0, 2])
    dflash_equals_greedy(write_ct_checkpoint(src, root / "nvfp4", "nvfp4")[0], drafter, k)


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory) -> dict[str, Path]:
    from tests.tiny_gpt_oss import save_tiny_gpt_oss_pair

    return save_tiny_gpt_oss_pair(tmp_path_factory.mktemp("det_gpt_oss_gpu"))


@pytest.mark.parametrize("k", [0, 7, 15])
@pytest.mark.parametrize("layout", ["bf16", "mxfp4"])
def test_tiny_gpt_oss_dflash_equals_greedy_at_batch_1_and_8(tiny_gpt_oss, layout, k):
    """The tiny model's window is 8 keys: the sliding layers mask inside every verify block and prefill chunk."""
    dflash_equals_greedy(tiny_gpt_oss[layout], tiny_gpt_oss["drafter"], k)


def test_tiny_quantized_qwen3_eager_equals_graphs(quantized_qwen3, tiny_drafter):
    """The CUDA graphs replay the same kernels with the same configs as eager steps."""
    target = quantized_qwen3["int4_asym_g32"]
    graphs = outputs(target, tiny_drafter, 15, TINY_PROMPTS, PARAMS, batch=8)
    assert outputs(target, tiny_drafter, 15, TINY_PROMPTS, PARAMS, batch=8, enforce_eager=True) == graphs
