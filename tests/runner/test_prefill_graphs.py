"""The short-prefill path's padding (runner/prefill_graphs.py), checked on the CPU: the padded forward the CUDA
graphs capture, run eagerly, gives the general path's greedy output token for token (fp32 tiny Qwen3 with a
random DFlash drafter, k = 0 and 7): prompts of 1 to 300 tokens (buckets 32 to 512, one filling its bucket
exactly) and turns whose prefix is cached, so the padded rows sit after a hit's cached context."""

from __future__ import annotations

import pytest

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams
from blockspec.runner.prefill_graphs import PrefillGraphs

PREFIX = list(range(5, 5 + 230))
TURNS = [PREFIX + [7, 8, 9], [3], PREFIX + list(range(40, 100)), list(range(11, 139)), PREFIX + [1] * 33]


def run(model, drafter, k: int, padded: bool) -> tuple[list[list[int]], int]:
    spec = SpeculativeConfig(model=str(drafter), num_speculative_tokens=k) if k else SpeculativeConfig()
    engine = Engine(EngineConfig(model=str(model), device="cpu", dtype="float32", max_num_seqs=2, speculative=spec))
    if padded:
        engine.runner.prefill = PrefillGraphs(engine.runner, 512, engine.max_model_len, use_graphs=False)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = [engine.generate([prompt], params)[0].token_ids for prompt in TURNS]  # one at a time: later ones hit
    assert engine.prefix_cache_stats.hits > 0
    replays = engine.runner.prefill.replays if padded else 0
    engine.release()
    return outs, replays


@pytest.mark.parametrize("k", [0, 7])
def test_padded_prefill_equals_general_path(tiny_models, tiny_drafter, k):
    padded, replays = run(tiny_models["qwen3"], tiny_drafter, k, padded=True)
    general, _ = run(tiny_models["qwen3"], tiny_drafter, k, padded=False)
    assert replays == len(TURNS) - 1  # the 1-token prompt is a decode step (the decode graphs)
    assert padded == general
