"""CUDA graphs with the DFlash 2 drafter and the MTP head: the captured decode path equals the eager one.

GPU only (skips without CUDA). A tiny random Qwen3 target with a DFlash 2 drafter (sliding-window layers,
convolutions, the selector's walk inside the drafter graph) and a tiny Qwen3.5 hybrid with an MTP head:
- bf16: greedy output with CUDA graphs (pipelined, chained steps) equals `--enforce-eager`;
- fp32: the graph path equals the general path (ragged, eager, host metadata) token for token;
- DFlash 2 sampling (the walk samples inside the graph, its q feeds the verification): seeded requests
  give the same tokens with graphs as eagerly.
"""

from __future__ import annotations

import json

import pytest
import torch

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams
from tests.tiny_hybrid import save_tiny_hybrid
from tests.tiny_mtp import add_mtp_head

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = ["hello world", "a" * 37, "The quick brown fox jumps over", "def f(n):\n    return"]


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    path = save_tiny_hybrid(tmp_path_factory.mktemp("mtp_gpu") / "qwen3_5", "qwen3_5", num_layers=4)
    add_mtp_head(path, "qwen3_5")
    return path


def setups(tiny_models, tiny_drafter2, mtp_target) -> dict:
    mtp = SpeculativeConfig.from_json(json.dumps({"method": "mtp", "num_speculative_tokens": 3}))
    return {"dflash2": (tiny_models["qwen3"], SpeculativeConfig(model=str(tiny_drafter2), num_speculative_tokens=7)),
            "mtp": (mtp_target, mtp)}


def generate(target, spec, dtype: str, eager: bool, general: bool = False, sampled: bool = False) -> list[list[int]]:
    engine = Engine(EngineConfig(model=str(target), device="cuda", dtype=dtype, max_num_seqs=4, enforce_eager=eager,
                                 speculative=spec, gpu_memory_utilization=0.3))
    if general:
        engine.runner.decode = None
        engine._set_lookahead()
    params = [SamplingParams(temperature=0.8 if sampled else 0, seed=i, max_tokens=64, ignore_eos=True)
              for i in range(len(PROMPTS))]
    outs = engine.generate(PROMPTS, params)
    engine.release()
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("proposer", ["dflash2", "mtp"])
def test_graphs_equal_eager_bf16(tiny_models, tiny_drafter2, mtp_target, proposer):
    target, spec = setups(tiny_models, tiny_drafter2, mtp_target)[proposer]
    assert generate(target, spec, "bfloat16", eager=False) == generate(target, spec, "bfloat16", eager=True)


@pytest.mark.parametrize("proposer", ["dflash2", "mtp"])
def test_graphs_equal_general_path_fp32(tiny_models, tiny_drafter2, mtp_target, proposer):
    target, spec = setups(tiny_models, tiny_drafter2, mtp_target)[proposer]
    assert generate(target, spec, "float32", eager=False) == generate(target, spec, "float32", eager=True,
                                                                      general=True)


def test_sampled_dflash2_graphs_equal_eager(tiny_models, tiny_drafter2, mtp_target):
    target, spec = setups(tiny_models, tiny_drafter2, mtp_target)["dflash2"]
    assert generate(target, spec, "float32", eager=False, sampled=True) == \
        generate(target, spec, "float32", eager=True, sampled=True)
