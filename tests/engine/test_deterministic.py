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


def test_targets_not_covered_are_refused():
    """Every model class and quantized layout the loader builds today is covered; the refusals stay for what is
    not (a class without a deterministic path, a layout outside COVERED_SCHEMES), in one line naming the fix."""
    class NoPath(LlamaForCausalLM):
        supports_deterministic = False

    msg = deterministic.problem(NoPath, "NoPathForCausalLM", None)
    assert msg is not None and "NoPathForCausalLM" in msg and "drop --deterministic" in msg
    msg = deterministic.problem(LlamaForCausalLM, "LlamaForCausalLM", "some 3-bit format", {"int3"})
    assert msg is not None and "int3" in msg and "drop --deterministic" in msg
    for cls, desc, schemes in ((LlamaForCausalLM, "compressed-tensors pack-quantized", {"int4"}),
                               (LlamaForCausalLM, "ModelOpt NVFP4", {"nvfp4"}),
                               (Qwen3MoeForCausalLM, "compressed-tensors float-quantized", {"fp8"}),
                               (GptOssForCausalLM, "MXFP4 experts", {"mxfp4"}),
                               (LlamaForCausalLM, "GPTQ 8-bit (gptq)", {"int8"}),
                               (Qwen3_5ForConditionalGeneration, "compressed-tensors pack-quantized", {"int4"})):
        assert deterministic.problem(cls, cls.__name__, desc, schemes) is None
    for cls in (GptOssForCausalLM, Qwen3NextForCausalLM, Qwen3_5ForConditionalGeneration,
                Qwen3_5MoeForConditionalGeneration):
        assert deterministic.problem(cls, cls.__name__, None) is None
    assert deterministic.problem(Qwen3MoeForCausalLM, "Qwen3MoeForCausalLM", None) is None
    assert deterministic.problem(LlamaForCausalLM, "LlamaForCausalLM", None) is None
    refusal = deterministic.problem(LlamaForCausalLM, "LlamaForCausalLM", "some 2-bit format", {"int2", "int4"})
    assert "int2 layers" in refusal and "int4" not in refusal.split("so far")[1] and "NVFP4" in refusal
    assert "\n" not in refusal


def test_a_layout_not_covered_is_refused_before_the_weights_load(tiny_models, monkeypatch):
    """The engine asks with the layouts the layers were built in (here one relabelled as a future layout)."""
    pytest.importorskip("compressed_tensors")
    monkeypatch.setattr(deterministic, "quantized_schemes", lambda model: {"int2"})
    with pytest.raises(ConfigError, match="int2 layers\\) is not covered yet"):
        engine(quantized_target(tiny_models, "int4_asym_g32"), None, 0)


# ---- quantized targets: every QuantLinear through the quantized kernel's fixed config (CPU: its row-by-row
# reference), a checkpoint written by compressed-tensors itself ----------------------------------------------------

_QUANTIZED: dict[str, Path] = {}


def quantized_target(tiny_models, fmt: str) -> Path:
    """The tiny Qwen3 as a compressed-tensors checkpoint (tests/loader/quant_helpers.py), made once a session."""
    import tempfile

    from tests.loader.quant_helpers import write_ct_checkpoint

    if fmt not in _QUANTIZED:
        root = Path(tempfile.mkdtemp(prefix=f"det_{fmt}_"))
        _QUANTIZED[fmt] = write_ct_checkpoint(tiny_models["qwen3"], root / "q", fmt)[0]
    return _QUANTIZED[fmt]


_ALONE: dict[str, list[list[int]]] = {}


def greedy_alone(target: Path) -> list[list[int]]:
    """Greedy decoding of every prompt, one request at a time (once a target)."""
    if str(target) not in _ALONE:
        eng = engine(target, None, 0)
        _ALONE[str(target)] = [eng.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    return _ALONE[str(target)]


# NVFP4 with drafts is test_quantized_moe_batch_of_8's (k = 15: its dense projections are NVFP4 QuantLinears too);
# the drafts' blocks do not depend on the format: int4 at k = 7 (several blocks a step) and 15 (one a step)
@pytest.mark.parametrize("fmt,k", [("int4_asym_g32", 0), ("int4_asym_g32", 7), ("int4_asym_g32", 15), ("nvfp4", 0)])
def test_quantized_batch_of_8_with_drafts_equals_greedy_alone(tiny_models, tiny_drafter, fmt, k):
    pytest.importorskip("compressed_tensors")
    target = quantized_target(tiny_models, fmt)
    alone = greedy_alone(target)
    eng = engine(target, tiny_drafter, k)
    assert any(type(m).__name__ == "QuantLinear" for m in eng.runner.target.modules())
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == alone
    if k:
        assert [eng.generate([p], GREEDY)[0].token_ids for p in PROMPTS[:3]] == alone[:3]


@pytest.mark.parametrize("k", [0, 15])
def test_quantized_moe_batch_of_8_with_drafts_equals_greedy_alone(tiny_moe, tmp_path_factory, k):
    """Qwen3-MoE quantized by compressed-tensors (NVFP4 experts, router left in bf16): the experts' stacks in the
    fixed expert tiles (CPU: row by row through their reference), the dense projections as any QuantLinear."""
    pytest.importorskip("compressed_tensors")
    from tests.loader.quant_helpers import write_ct_checkpoint

    if "moe_nvfp4" not in _QUANTIZED:
        _QUANTIZED["moe_nvfp4"] = write_ct_checkpoint(tiny_moe[0], tmp_path_factory.mktemp("det_moe_q") / "q",
                                                      "nvfp4")[0]
    target = _QUANTIZED["moe_nvfp4"]
    alone = greedy_alone(target)
    eng = engine(target, tiny_moe[1], k)
    assert any(type(m).__name__ == "QuantExperts" for m in eng.runner.target.modules())
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == alone


# ---- GPT-OSS: sinks, sliding-window layers, biased projections and experts, clamped SwiGLU; bf16 or MXFP4 experts

@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory) -> dict[str, Path]:
    from tests.tiny_gpt_oss import save_tiny_gpt_oss_pair

    return save_tiny_gpt_oss_pair(tmp_path_factory.mktemp("det_gpt_oss"))


@pytest.mark.parametrize("layout,k", [("bf16", 0), ("bf16", 7), ("bf16", 15), ("mxfp4", 0), ("mxfp4", 7)])
def test_gpt_oss_batch_of_8_with_drafts_equals_greedy_alone(tiny_gpt_oss, layout, k):
    """The window (8 keys) is far shorter than the prompts and outputs, so the sliding layers mask inside every
    step; the sinks join every row's softmax. The layout changes only the experts: MXFP4 at k = 0 (decode rows,
    prefill chunks) and k = 7 (several verify blocks a step); k = 15 (one block a step) on the bf16 experts."""
    target = tiny_gpt_oss[layout]
    alone = greedy_alone(target)
    eng = engine(target, tiny_gpt_oss["drafter"], k)
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == alone
    if k:
        assert [eng.generate([p], GREEDY)[0].token_ids for p in PROMPTS[:3]] == alone[:3]


def test_gpt_oss_fp32_output_is_the_models(tiny_gpt_oss):
    """In fp32 the deterministic path (fixed-split attention with sinks and window, the MoE's fixed tiles)
    computes the same model as the regular CPU path."""
    def greedy(det: bool) -> list[list[int]]:
        eng = Engine(EngineConfig(model=str(tiny_gpt_oss["bf16"]), device="cpu", deterministic=det,
                                  max_num_batched_tokens=24))
        return [o.token_ids for o in eng.generate(PROMPTS[:4], GREEDY)]
    assert greedy(True) == greedy(False)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Qwen3-MoE (a dense layer among the sparse ones) and a random DFlash drafter for it."""
    from transformers import AutoConfig

    from tests.conftest import save_tiny_drafter

    root = tmp_path_factory.mktemp("det_moe")
    target = save_tiny_hybrid(root / "target", "qwen3_moe", num_layers=4)
    drafter = save_tiny_drafter(root / "drafter", AutoConfig.from_pretrained(target), target_layer_ids=[0, 2])
    return target, drafter


@pytest.mark.parametrize("k", [0, 15])
def test_moe_batch_of_8_with_drafts_equals_greedy_alone(tiny_moe, k):
    """Qwen3-MoE: routing, experts and combine give a token the same bits alone, in a verify block, in a batch
    and in a prefill chunk (bf16 on CPU, where the regular path's rounding follows the step's rows). k = 0 and 15
    as the quantized MoE's; several verify blocks a step (k = 7) through an MoE: GPT-OSS's, bf16 and MXFP4."""
    target, drafter = tiny_moe
    alone = greedy_alone(target)
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


def test_quantized_fp32_output_is_the_models(tiny_models):
    """In fp32 the deterministic path through the quantized layers computes the regular path's model."""
    pytest.importorskip("compressed_tensors")
    target = quantized_target(tiny_models, "int4_asym_g32")

    def greedy(det: bool) -> list[list[int]]:
        eng = Engine(EngineConfig(model=str(target), device="cpu", deterministic=det, max_num_batched_tokens=24))
        return [o.token_ids for o in eng.generate(PROMPTS[:4], GREEDY)]
    assert greedy(True) == greedy(False)


def test_a_quantized_lm_head_is_a_plain_weight(tiny_models, tiny_drafter, tmp_path):
    """A checkpoint that quantizes the LM head too: it is held dequantized (the logits and the drafter read its
    weight), so the deterministic logits GEMM takes it as any bf16 head; DFlash in a batch equals greedy alone."""
    pytest.importorskip("compressed_tensors")
    from torch import nn

    from tests.loader.quant_helpers import write_ct_checkpoint

    target = write_ct_checkpoint(tiny_models["qwen3"], tmp_path / "q", "int4_g32", ignore=["re:.*mlp.gate$"])[0]
    alone = [engine(target, None, 0).generate([p], GREEDY)[0].token_ids for p in PROMPTS[:4]]
    eng = engine(target, tiny_drafter, 7)
    assert type(eng.runner.target.lm_head) is nn.Linear
    assert [o.token_ids for o in eng.generate(PROMPTS[:4], GREEDY)] == alone
