"""--deterministic on CPU in bf16, where rounding does depend on the batch: greedy DFlash at k = 0, 7, 15 and in a
batch of 8 equals greedy decoding alone, token for token (CPU runs the row-by-row references, or the Triton kernels
under TRITON_INTERPRET=1); targets not covered yet are refused with one clear line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams
from blockspec.errors import ConfigError
from blockspec.models import deterministic
from blockspec.models.gpt_oss import GptOssForCausalLM
from blockspec.models.llama import LlamaForCausalLM
from blockspec.models.qwen3_5 import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration
from blockspec.models.qwen3_moe import Qwen3MoeForCausalLM
from blockspec.models.qwen3_next import Qwen3NextForCausalLM
from tests.tiny_hybrid import save_tiny_hybrid

PROMPTS = ["hello world", "a" * 37, "The quick brown fox jumps over", "x", "def f(n):\n    return", "zz top",
           "1 2 3 4", "qwerty"]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def engine(target, drafter, k: int, **config) -> Engine:
    spec = SpeculativeConfig(model=str(drafter), num_speculative_tokens=k) if k else SpeculativeConfig()
    return Engine(EngineConfig(model=str(target), device="cpu", dtype="bfloat16", speculative=spec,
                               deterministic=True, max_num_batched_tokens=24, **config))


@pytest.fixture(scope="module")
def alone(tiny_models) -> list[list[int]]:
    """Greedy decoding, one request at a time."""
    eng = engine(tiny_models["qwen3"], None, 0)
    return [eng.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


@pytest.mark.parametrize("k", [0, 7, 15])
def test_batch_of_8_with_drafts_equals_greedy_alone(tiny_models, tiny_drafter, alone, k):
    eng = engine(tiny_models["qwen3"], tiny_drafter, k)
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == alone
    if k:
        assert [eng.generate([p], GREEDY)[0].token_ids for p in PROMPTS[:3]] == alone[:3]


def test_start_up_report_says_deterministic(tiny_models, caplog):
    with caplog.at_level(logging.INFO, logger="blockspec"):
        engine(tiny_models["llama"], None, 0)
    assert any(r.getMessage().startswith("numerics: deterministic") for r in caplog.records)


def test_targets_not_covered_are_refused(tmp_path):
    from tests.tiny_gpt_oss import save_tiny_gpt_oss

    sinks = save_tiny_gpt_oss(tmp_path / "gpt_oss")
    with pytest.raises(ConfigError, match="--deterministic covers dense Llama-family targets .* not covered yet"):
        Engine(EngineConfig(model=str(sinks), device="cpu", deterministic=True))
    assert "int4" in deterministic.problem(LlamaForCausalLM, "LlamaForCausalLM", "compressed-tensors int4")
    assert "int4" in deterministic.problem(Qwen3MoeForCausalLM, "Qwen3MoeForCausalLM", "compressed-tensors int4")
    assert deterministic.problem(GptOssForCausalLM, "GptOssForCausalLM", None) is not None
    assert deterministic.problem(Qwen3MoeForCausalLM, "Qwen3MoeForCausalLM", None) is None
    for hybrid in (Qwen3NextForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration):
        assert deterministic.problem(hybrid, hybrid.__name__, None) is None
        assert "int4" in deterministic.problem(hybrid, hybrid.__name__, "compressed-tensors int4")
    assert deterministic.problem(LlamaForCausalLM, "LlamaForCausalLM", None) is None


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Qwen3-MoE (a dense layer among the sparse ones) and a random DFlash drafter for it."""
    from transformers import AutoConfig

    from tests.conftest import save_tiny_drafter

    root = tmp_path_factory.mktemp("det_moe")
    target = save_tiny_hybrid(root / "target", "qwen3_moe", num_layers=4)
    drafter = save_tiny_drafter(root / "drafter", AutoConfig.from_pretrained(target), target_layer_ids=[0, 2])
    return target, drafter


@pytest.mark.parametrize("k", [0, 7, 15])
def test_moe_batch_of_8_with_drafts_equals_greedy_alone(tiny_moe, k):
    """Qwen3-MoE: routing, experts and combine give a token the same bits alone, in a verify block, in a batch
    and in a prefill chunk (bf16 on CPU, where the regular path's rounding follows the step's rows)."""
    target, drafter = tiny_moe
    alone = [engine(target, None, 0).generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    eng = engine(target, drafter, k)
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == alone


def test_moe_fp32_output_is_the_models(tiny_moe):
    """In fp32 the deterministic MoE path computes the same model as the regular CPU path."""
    def greedy(det: bool) -> list[list[int]]:
        eng = Engine(EngineConfig(model=str(tiny_moe[0]), device="cpu", deterministic=det,
                                  max_num_batched_tokens=24))
        return [o.token_ids for o in eng.generate(PROMPTS[:4], GREEDY)]
    assert greedy(True) == greedy(False)


@pytest.mark.parametrize("family", ["qwen2", "llama_tied"])
def test_fp32_output_is_the_models(tiny_models, family):
    """In fp32 the deterministic path computes the same model as the regular CPU path (the oracle the lossless
    tests compare): q/k/v bias (Qwen2) and a tied LM head (the embedding) through its epilogues."""
    def greedy(det: bool) -> list[list[int]]:
        eng = Engine(EngineConfig(model=str(tiny_models[family]), device="cpu", deterministic=det,
                                  max_num_batched_tokens=24))
        return [o.token_ids for o in eng.generate(PROMPTS[:4], GREEDY)]
    assert greedy(True) == greedy(False)
