"""A DFlash drafter quantized at load (--speculative-config "quantization": "fp8" | "rtn").

Lossless whatever the drafter computes (greedy output is the target's), and close to the unquantized drafter
where it matters: on the embedded SmolLM2 with the drafter trained for it (real weights), the acceptance of
fp8 / int8 / int4 drafts stays near the bf16 drafter's. Plus the flag's checks, and the bytes `plan` counts.
"""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from blockspec.bench.footprint import drafter_footprint
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.memory import weight_bytes, weights_report
from blockspec.engine.sampling_params import SamplingParams
from blockspec.errors import ConfigError
from blockspec.models.layers.quant_linear import QuantLinear

PROMPTS = ["hello world", "The quick brown fox jumps over", "def f(n):\n    return"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _engine(model, drafter, quantization, k=7, **kw) -> Engine:
    spec = SpeculativeConfig(model=str(drafter), num_speculative_tokens=k, quantization=quantization)
    return Engine(EngineConfig(model=str(model), device="cpu", speculative=spec, **kw))


def _generate(engine: Engine, prompts, params=GREEDY):
    return engine.generate(prompts, SamplingParams(**vars(params)))


@pytest.fixture(scope="module")
def ar_tokens(tiny_models):
    engine = Engine(EngineConfig(model=str(tiny_models["qwen3"]), device="cpu"))
    return [o.token_ids for o in _generate(engine, PROMPTS)]


@pytest.mark.parametrize("method,bits", [("fp8", None), ("rtn", 8), ("rtn", 4)])
def test_quantized_drafter_greedy_equals_autoregressive(tiny_models, tiny_drafter, ar_tokens, monkeypatch,
                                                        method, bits):
    monkeypatch.setenv("RTN_GROUP_SIZE", "32")
    if bits:
        monkeypatch.setenv("RTN_NUM_BITS", str(bits))
    engine = _engine(tiny_models["qwen3"], tiny_drafter, method, max_num_batched_tokens=24)
    drafter = engine.proposer
    assert all(isinstance(drafter.get_submodule(n), QuantLinear) for n in drafter.quantizable())
    scheme = "fp8" if method == "fp8" else f"int{bits}"
    assert drafter.draft_head.scheme == scheme and drafter.draft_head.out_features == engine.model_config.vocab_size
    assert not any(isinstance(p, torch.nn.Linear) and not isinstance(p, QuantLinear)
                   for n, p in drafter.named_modules() if n in drafter.quantizable())
    assert [o.token_ids for o in _generate(engine, PROMPTS)] == ar_tokens
    assert "its LM head copy too" in weights_report(engine)


def test_quantized_drafter_sampling_keeps_running(tiny_models, tiny_drafter, monkeypatch):
    monkeypatch.setenv("RTN_GROUP_SIZE", "32")
    engine = _engine(tiny_models["qwen3"], tiny_drafter, "rtn")
    outs = _generate(engine, PROMPTS, SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=3))
    assert all(len(o.token_ids) == 24 for o in outs)


def test_acceptance_of_the_trained_default_drafter_survives_quantization(default_model, monkeypatch):
    """Real weights: SmolLM2-135M-Instruct and the drafter trained for it. Rounding the drafter to fp8, int8 or int4
    (groups of 64) keeps its greedy output the target's and its acceptance near the bf16 drafter's."""
    from blockspec.loader.default_model import default_drafter_dir

    drafter = default_drafter_dir()
    if drafter is None:
        pytest.skip("no default drafter ships in this checkout")
    prompts = ["def fibonacci(n):", "List three prime numbers:"]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    monkeypatch.setenv("RTN_GROUP_SIZE", "64")  # SmolLM2's hidden size 576 = 9 x 64

    def run(quantization, bits=None):
        if bits:
            monkeypatch.setenv("RTN_NUM_BITS", str(bits))
        outs = _generate(_engine(default_model, drafter, quantization, k=15), prompts, params)
        return [o.token_ids for o in outs], statistics.mean(o.stats.tau for o in outs)

    ref, tau = run(None)
    assert tau > 2.0  # the trained drafter is accepted (else the comparison says nothing)
    for quantization, bits, keep in (("fp8", None, 0.9), ("rtn", 4, 0.75)):  # (int8 sits between the two)
        tokens, q_tau = run(quantization, bits)
        assert tokens == ref
        assert q_tau >= keep * tau, (quantization, bits, q_tau, tau)


def test_speculative_config_reads_quantization():
    spec = SpeculativeConfig.from_json('{"method": "dflash", "model": "/d", "quantization": "FP8"}')
    assert spec.quantization == "fp8"
    with pytest.raises(ConfigError, match="method \"mtp\" drafts with the target's head"):
        SpeculativeConfig.from_json('{"method": "mtp", "num_speculative_tokens": 2, "quantization": "fp8"}')
    with pytest.raises(ConfigError, match="must be a method name"):
        SpeculativeConfig.from_json('{"model": "/d", "quantization": 4}')


def test_unknown_method_is_refused_before_loading(tiny_models, tiny_drafter):
    with pytest.raises(ConfigError, match="'gptq' is not supported: use one of fp8, rtn"):
        _engine(tiny_models["qwen3"], tiny_drafter, "gptq")


def test_quantized_drafter_checkpoint_is_refused_with_the_fix(tiny_models, tiny_drafter, tmp_path):
    """A drafter directory that declares a quantization is not loaded as if it were bf16."""
    quantized = tmp_path / "draft-fp8"
    quantized.mkdir()
    for f in tiny_drafter.iterdir():
        (quantized / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((quantized / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (quantized / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"stored quantized \(config.json declares fp8\).*\"quantization\": \"fp8\""):
        _engine(tiny_models["qwen3"], quantized, None)


def test_group_size_that_does_not_fit_names_the_layer(tiny_models, tiny_drafter, monkeypatch):
    monkeypatch.setenv("RTN_GROUP_SIZE", "48")  # 64 % 48 != 0
    with pytest.raises(ConfigError, match="cannot be quantized to rtn int8.*RTN_GROUP_SIZE"):
        _engine(tiny_models["qwen3"], tiny_drafter, "rtn")


@pytest.mark.parametrize("method,bits", [("fp8", None), ("rtn", 4)])
def test_plan_counts_the_bytes_the_engine_holds(tiny_models, tiny_drafter, monkeypatch, method, bits):
    monkeypatch.setenv("RTN_GROUP_SIZE", "32")
    if bits:
        monkeypatch.setenv("RTN_NUM_BITS", str(bits))
    engine = _engine(tiny_models["qwen3"], tiny_drafter, method)
    target = json.loads((tiny_models["qwen3"] / "config.json").read_text())
    plan = drafter_footprint(json.loads((tiny_drafter / "config.json").read_text()), "float32", method,
                             (target["vocab_size"], target["hidden_size"]))
    assert plan.weight_bytes == weight_bytes(engine.proposer)[0]
    plain = drafter_footprint(json.loads((tiny_drafter / "config.json").read_text()), "float32")
    assert plan.lm_head_params == target["vocab_size"] * 64 and plain.lm_head_params == 0


def test_draft_head_can_stay_the_targets(tiny_models, tiny_drafter, ar_tokens, monkeypatch):
    """BLOCKSPEC_DRAFT_HEAD=target: the layers rounded, the drafts read through the target's head as loaded (no
    copy's memory); a value other than copy / target is refused."""
    monkeypatch.setenv("RTN_GROUP_SIZE", "32")
    monkeypatch.setenv("BLOCKSPEC_DRAFT_HEAD", "target")
    engine = _engine(tiny_models["qwen3"], tiny_drafter, "rtn", max_num_batched_tokens=24)
    assert engine.proposer.draft_head is None
    assert isinstance(engine.proposer.fc, QuantLinear)
    assert [o.token_ids for o in _generate(engine, PROMPTS)] == ar_tokens
    plan = drafter_footprint(json.loads((tiny_drafter / "config.json").read_text()), "float32", "rtn")
    assert plan.weight_bytes == weight_bytes(engine.proposer)[0] and plan.lm_head_params == 0
    monkeypatch.setenv("BLOCKSPEC_DRAFT_HEAD", "bf16")
    with pytest.raises(ConfigError, match="BLOCKSPEC_DRAFT_HEAD='bf16': use copy or target"):
        _engine(tiny_models["qwen3"], tiny_drafter, "rtn")
