"""Generation in several engine processes writes the same shards as one engine does."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from blockspec.config import EngineConfig
from blockspec.engine.engine import Engine
from blockspec.errors import ConfigError
from blockspec.train.data import GenerationConfig, generate_data, shard_path
from blockspec.train.parallel_data import GeneratorSpec, generate_parallel, split_shards
from blockspec.train.prompts import TrainPrompt

PROMPTS = [TrainPrompt(f"p{i}", "test", [{"role": "user", "content": t}]) for i, t in
           enumerate(["one two", "abc", "hello there", "x", "red green blue"])]


def test_split_gives_every_nth_shard():
    assert split_shards([0, 1, 2, 3, 4], 2) == [[0, 2, 4], [1, 3]]
    assert split_shards([7], 3) == [[7]]


def test_two_processes_write_what_one_engine_writes(tiny_models, tmp_path):
    model = str(tiny_models["llama"])
    cfg = GenerationConfig(num_samples=14, response_len=10, temperature=0.9, shard_size=4, self_prompts=0.5,
                           self_prompt_len=8)
    one, two = tmp_path / "one", tmp_path / "two"
    engine = Engine(EngineConfig(model=model, device="cpu", max_num_seqs=4, max_model_len=96, seed=0))
    generate_data(engine, PROMPTS, cfg, one)
    engine.release()
    spec = GeneratorSpec(target=model, device="cpu", max_num_seqs=4, max_num_batched_tokens=2048,
                         max_model_len=96, seed=0, threads=1)
    generate_parallel(spec, PROMPTS, cfg, two, workers=2)
    for s in range(4):
        a, b = load_file(str(shard_path(one, s))), load_file(str(shard_path(two, s)))
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].equal(b[name]), (s, name)
    assert (two / "meta.json").read_text() == (one / "meta.json").read_text()


def test_a_failing_process_is_reported(tiny_models, tmp_path):
    """Data made under other settings is refused by the generator processes, and the refusal reaches
    the caller as the same clear error one engine gives."""
    model = str(tiny_models["llama"])
    spec = GeneratorSpec(target=model, device="cpu", max_num_seqs=4, max_num_batched_tokens=2048,
                         max_model_len=96, seed=0, threads=1)
    data = tmp_path / "data"
    generate_parallel(spec, PROMPTS, GenerationConfig(num_samples=4, response_len=6, shard_size=4), data, workers=2)
    with pytest.raises(ConfigError, match="response_len"):
        generate_parallel(spec, PROMPTS, GenerationConfig(num_samples=8, response_len=8, shard_size=4), data,
                          workers=2)
