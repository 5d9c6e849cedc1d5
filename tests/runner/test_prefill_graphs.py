"""The short-prefill path's padding (runner/prefill_graphs.py), checked on the CPU: the padded forward the CUDA
graphs capture, run eagerly, gives the general path's output (fp32 tiny Qwen3 with a random DFlash drafter,
k = 0 and 7): the same greedy tokens and the same log-probabilities of every token to 1e-4, for prompts of 1 to
300 tokens (buckets 32 to 512) and for turns whose prefix is cached, so the padded rows sit after a hit's
cached context."""

from __future__ import annotations

import pytest

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams
from blockspec.runner.prefill_graphs import PrefillGraphs, graph_prefill_supported
from tests.tiny_hybrid import save_tiny_hybrid

PREFIX = list(range(5, 5 + 230))
TURNS = [PREFIX + [7, 8, 9], [3], PREFIX + list(range(40, 100)), list(range(11, 139)), PREFIX + [1] * 33]


def run(model, drafter, k: int, padded: bool) -> tuple[list[list[int]], list[list[list[float]]], int]:
    spec = SpeculativeConfig(model=str(drafter), num_speculative_tokens=k) if k else SpeculativeConfig()
    engine = Engine(EngineConfig(model=str(model), device="cpu", dtype="float32", max_num_seqs=2, speculative=spec))
    if padded:
        engine.runner.prefill = PrefillGraphs(engine.runner, 512, engine.max_model_len, use_graphs=False)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=4, detokenize=False)
    tokens, logprobs = [], []
    for i, prompt in enumerate(TURNS):  # one at a time: the later turns hit the prefix cache
        engine.add_request(f"t{i}", prompt, params)
        lps: list[list[float]] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                lps.extend([lp.logprob, *(v for _, v in lp.top)] for lp in out.new_logprobs or [])
                if out.finished:
                    tokens.append(out.token_ids)
        logprobs.append(lps)
    assert engine.prefix_cache_stats.hits > 0
    replays = engine.runner.prefill.replays if padded else 0
    engine.release()
    return tokens, logprobs, replays


@pytest.mark.parametrize("family,k", [("qwen3", 0), ("qwen3", 7), ("qwen3_moe", 0)])
def test_padded_prefill_equals_general_path(tiny_models, tiny_drafter, tmp_path, family, k):
    """The MoE target: padding rows route to experts of their own, real rows' routing and outputs untouched."""
    model = tiny_models["qwen3"] if family == "qwen3" else save_tiny_hybrid(tmp_path / family, family, num_layers=4)
    tokens, logprobs, replays = run(model, tiny_drafter, k, padded=True)
    want_tokens, want_logprobs, _ = run(model, tiny_drafter, k, padded=False)
    assert replays == len(TURNS) - 1  # the 1-token prompt is a decode step (the decode graphs' path)
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs):
        assert len(got) == len(want) == 6
        for a, b in zip(got, want):
            assert a == pytest.approx(b, abs=1e-4)


def test_flag_maps_and_refuses_enforce_eager(tiny_models):
    """--prefill-cuda-graphs reaches EngineConfig and is on by default, off by default under --enforce-eager and
    --deterministic; asked for with --enforce-eager (no graphs at all) it is refused, not ignored; on the CPU the
    engine builds no graphs and says nothing is wrong."""
    from blockspec.cli import build_parser, engine_config_from_args
    from blockspec.errors import ConfigError

    def config_of(*flags: str) -> EngineConfig:
        args = build_parser().parse_args(["generate", "hi", "--model", str(tiny_models["qwen3"]), "--no-draft",
                                          *flags])
        return engine_config_from_args(args)

    assert config_of().uses_prefill_graphs()
    assert not config_of("--no-prefill-cuda-graphs").uses_prefill_graphs()
    assert not config_of("--enforce-eager").uses_prefill_graphs()
    assert not config_of("--deterministic").uses_prefill_graphs()
    assert config_of("--deterministic", "--prefill-cuda-graphs").uses_prefill_graphs()
    config_of("--enforce-eager").validate()  # the default yields to --enforce-eager without a word
    config = config_of("--prefill-cuda-graphs")
    assert config.prefill_cuda_graphs
    config.enforce_eager = True
    with pytest.raises(ConfigError, match="--enforce-eager"):
        config.validate()
    engine = Engine(EngineConfig(model=str(tiny_models["qwen3"]), device="cpu", dtype="float32",
                                 prefill_cuda_graphs=True))
    assert engine.runner.prefill is None
    engine.release()


def test_which_targets_take_graphs(tiny_models, tmp_path):
    """Dense and MoE targets do (rows independent outside the KV cache); Gated DeltaNet hybrids do not."""
    def target(path):
        engine = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", max_num_seqs=1))
        model = engine.runner.target
        engine.release()
        return model

    assert graph_prefill_supported(target(tiny_models["qwen3"]))
    assert graph_prefill_supported(target(save_tiny_hybrid(tmp_path / "moe", "qwen3_moe", num_layers=2)))
    assert not graph_prefill_supported(target(save_tiny_hybrid(tmp_path / "hybrid", "qwen3_5", num_layers=4)))
