"""CUDA graphs for hybrid (Gated DeltaNet) and MoE targets: the captured path equals the eager one.

GPU only (skips without CUDA). Tiny random qwen3_5, qwen3_5_moe, qwen3_next and qwen3_moe checkpoints:
- bf16: greedy output with CUDA graphs (pipelined, chained steps) equals `--enforce-eager` (the same
  decode step run without capture) token for token, for k = 0 and k = 7 with a random DFlash drafter;
- fp32: the graph path equals the general path (ragged spans, reference recurrence) token for token;
- the same two checks for NVFP4 (compressed-tensors) hybrids, whose decode steps take the fused path with the
  quantized projections on quant_linear's kernels (layers.linear.folded_linear).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams
from tests.conftest import save_tiny_drafter
from tests.tiny_hybrid import save_tiny_hybrid

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_moe")
PROMPTS = ["hello world", "a" * 37, "The quick brown fox jumps over", "def f(n):\n    return"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("graphs_gpu")
    out = {}
    for family in FAMILIES:
        target = save_tiny_hybrid(root / family, family, num_layers=4)
        cfg = AutoConfig.from_pretrained(target)
        drafter = save_tiny_drafter(root / f"{family}_draft", getattr(cfg, "text_config", cfg),
                                    target_layer_ids=[0, 2])
        out[family] = (target, drafter)
    return out


def generate(target, drafter, k: int, dtype: str, eager: bool, general: bool = False) -> list[list[int]]:
    spec = SpeculativeConfig(model=str(drafter), num_speculative_tokens=k) if k else SpeculativeConfig()
    engine = Engine(EngineConfig(model=str(target), device="cuda", dtype=dtype, max_num_seqs=4,
                                 enforce_eager=eager, speculative=spec, gpu_memory_utilization=0.3))
    if general:
        engine.runner.decode = None
        engine._set_lookahead()
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    engine.release()
    return [o.token_ids for o in outs]


def graphs_and_eager_bf16(target, drafter, k: int) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens with CUDA graphs and with --enforce-eager (the same decode step uncaptured), in bf16."""
    return (generate(target, drafter, k, "bfloat16", eager=False),
            generate(target, drafter, k, "bfloat16", eager=True))


def graphs_and_general_fp32(target, drafter) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens (k = 7) with CUDA graphs and on the general path, in float32."""
    return (generate(target, drafter, 7, "float32", eager=False),
            generate(target, drafter, 7, "float32", eager=True, general=True))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("k", [0, 7])
def test_graphs_equal_eager_bf16(checkpoints, family, k):
    graphs, eager = graphs_and_eager_bf16(*checkpoints[family], k)
    assert graphs == eager


@pytest.mark.parametrize("family", FAMILIES)
def test_graphs_equal_general_path_fp32(checkpoints, family):
    graphs, general = graphs_and_general_fp32(*checkpoints[family])
    assert graphs == general


QUANTIZED = ("qwen3_5", "qwen3_next")  # a dense and an MoE hybrid


@pytest.fixture(scope="module")
def quantized(checkpoints, tmp_path_factory) -> dict:
    pytest.importorskip("compressed_tensors")
    from tests.loader.quant_helpers import write_ct_checkpoint

    root = tmp_path_factory.mktemp("graphs_gpu_nvfp4")
    return {f: (write_ct_checkpoint(checkpoints[f][0], root / f, "nvfp4")[0], checkpoints[f][1]) for f in QUANTIZED}


@pytest.mark.parametrize("family", QUANTIZED)
def test_quantized_hybrid_graphs_equal_eager_bf16(quantized, family):
    graphs, eager = graphs_and_eager_bf16(*quantized[family], 7)
    assert graphs == eager


@pytest.mark.parametrize("family", QUANTIZED)
def test_quantized_hybrid_graphs_equal_general_path_fp32(quantized, family):
    graphs, general = graphs_and_general_fp32(*quantized[family])
    assert graphs == general
