"""CUDA graphs for one sequence's short prefill (runner/prefill_graphs.py): the graph path equals the eager one.

GPU only (skips without CUDA). Tiny random Llama / Qwen2 / Qwen3 targets with a random DFlash drafter, in fp32
(the paged kernel the graphs use and the eager path's SDPA agree to far below the logit gaps): greedy output
with `--prefill-cuda-graphs` equals `--enforce-eager` token for token, over prompts of 1 to 300 tokens and over
turns that hit the prefix cache (a shared prefix plus a new turn: the hit's prefill is one graph replay), for
k = 0 and 7.
"""

from __future__ import annotations

import pytest
import torch

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PREFIX = list(range(5, 5 + 230))
TURNS = [PREFIX + [7, 8, 9], PREFIX + list(range(40, 100)), [3], list(range(11, 311)), PREFIX + [1] * 33]


def run(model, drafter, k: int, eager: bool) -> tuple[list[list[int]], int]:
    spec = SpeculativeConfig(model=str(drafter), num_speculative_tokens=k) if k else SpeculativeConfig()
    engine = Engine(EngineConfig(model=str(model), device="cuda", dtype="float32", max_num_seqs=4,
                                 enforce_eager=eager, speculative=spec, gpu_memory_utilization=0.3,
                                 prefill_cuda_graphs=not eager))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = [engine.generate([prompt], params)[0].token_ids for prompt in TURNS]  # one at a time: hits
    replays = engine.runner.prefill.replays if engine.runner.prefill is not None else 0
    hits = engine.prefix_cache_stats.hits
    engine.release()
    assert hits > 0, "the shared-prefix turns should hit the prefix cache"
    return outs, replays


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("k", [0, 7])
def test_prefill_graphs_equal_eager(tiny_models, tiny_drafter, family, k):
    if family != "qwen3" and k:
        pytest.skip("the tiny drafter is built for the qwen3 target")
    graphs, replays = run(tiny_models[family], tiny_drafter, k, eager=False)
    eager, none = run(tiny_models[family], tiny_drafter, k, eager=True)
    assert replays == len(TURNS) - 1 and none == 0  # the 1-token prompt is a decode step (decode graphs)
    assert graphs == eager
