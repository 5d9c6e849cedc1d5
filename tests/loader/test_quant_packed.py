"""GPTQ, AWQ, AutoRound, ModelOpt and fp8 (block) checkpoints, packed in the tests from each format's
published definition (tests/loader/quant_helpers.py), load into weights equal to what the format defines;
and the errors a user meets: unsupported schemes, --quantization mismatches, missing or mismatched tensors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockspec.config import EngineConfig
from blockspec.errors import ConfigError
from blockspec.loader.errors import ModelLoadError
from blockspec.loader.quant import detect_quantization
from blockspec.loader.quant.config import parse_quantization
from blockspec.models.layers.quant_linear import QuantExperts, QuantLinear
from tests.conftest import save_tiny_model
from tests.loader.quant_helpers import write_packed_checkpoint
from tests.loader.quant_model import assert_matches_reference, load_quantized
from tests.tiny_hybrid import save_tiny_hybrid


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed_src")
    return {
        "qwen3": save_tiny_model(root / "qwen3", "qwen3", num_hidden_layers=2),
        "wide": save_tiny_model(root / "wide", "qwen3", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                num_key_value_heads=4, head_dim=32, num_hidden_layers=1),
        "qwen3_moe": save_tiny_hybrid(root / "qwen3_moe", "qwen3_moe", num_layers=2),
    }


CASES = {
    "gptq4": ("gptq", {}),
    "gptq4-asym-v1": ("gptq", {"sym": False}),
    "gptq4-asym-v2": ("gptq", {"sym": False, "v1": False}),
    "gptq4-act-order": ("gptq", {"act_order": True, "sym": False}),
    "gptq8": ("gptq", {"bits": 8}),
    "gptq8-asym-act-order": ("gptq", {"bits": 8, "sym": False, "act_order": True}),
    "gptq4-g64": ("gptq", {"group": 64}),
    "awq": ("awq", {}),
    "autoround-gptq": ("auto-round", {}),
    "autoround-awq": ("auto-round-awq", {}),
    "modelopt-nvfp4": ("modelopt-nvfp4", {}),
    "modelopt-nvfp4-hf-quant-config": ("modelopt-nvfp4", {"config_style": "hf_quant_config"}),
    "modelopt-fp8": ("modelopt-fp8", {}),
    "modelopt-fp8-channel": ("modelopt-fp8-channel", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_weights_equal_the_format_definition(sources, tmp_path, case):
    method, options = CASES[case]
    src = sources["wide" if options.get("group") == 64 else "qwen3"]
    out, ref = write_packed_checkpoint(src, tmp_path / case, method, **options)
    model = load_quantized(out)
    assert assert_matches_reference(model, ref) >= 7
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear)
    assert (qkv.perm is not None) == bool(options.get("act_order"))


@pytest.mark.parametrize("method", ["gptq", "awq", "modelopt-nvfp4", "modelopt-fp8"])
def test_moe_experts(sources, tmp_path, method):
    out, ref = write_packed_checkpoint(sources["qwen3_moe"], tmp_path / method, method,
                                       act_order=method == "gptq")
    model = load_quantized(out)
    assert any(isinstance(m, QuantExperts) for m in model.modules())
    assert_matches_reference(model, ref)


def test_fp8_block_checkpoint(sources, tmp_path):
    out, ref = write_packed_checkpoint(sources["wide"], tmp_path / "fp8", "fp8-block")
    model = load_quantized(out, quantization="fp8")
    assert model.model.layers[0].mlp.down_proj.scales.shape == (1, 2)  # [ceil(128/128), ceil(256/128)]
    assert_matches_reference(model, ref)


def test_layers_exporters_leave_in_float_load_unquantized(sources, tmp_path):
    """GPTQ cannot pack the 8-row router of a MoE block or the lm_head here: the checkpoint keeps them in
    float and so do we (the checkpoint's tensors decide, the GPTQ config does not list layers)."""
    out, _ = write_packed_checkpoint(sources["qwen3_moe"], tmp_path / "gptq", "gptq")
    model = load_quantized(out)
    assert not isinstance(model.model.layers[0].mlp.gate, QuantLinear)
    assert isinstance(model.lm_head, torch.nn.Linear) and not isinstance(model.lm_head, QuantLinear)


def test_quantization_flag_aliases_and_mismatch(sources, tmp_path):
    out, _ = write_packed_checkpoint(sources["qwen3"], tmp_path / "gptq", "gptq")
    for name in ("gptq", "gptq_marlin", "GPTQ"):
        assert detect_quantization(out, name).method == "gptq"
    with pytest.raises(ConfigError, match=r"--quantization awq does not match the checkpoint, whose config.json "
                                          r"declares GPTQ 4-bit \(gptq\): .* --quantization gptq"):
        detect_quantization(out, "awq")
    nv, _ = write_packed_checkpoint(sources["qwen3"], tmp_path / "nv", "modelopt-nvfp4",
                                    config_style="hf_quant_config")
    assert detect_quantization(nv, "modelopt_fp4").description == "ModelOpt NVFP4"
    assert detect_quantization(nv, "modelopt") is not None


def test_quantization_flag_on_an_unquantized_checkpoint(sources):
    with pytest.raises(ConfigError, match=r"--quantization fp8 given but the checkpoint .* declares no quantization"):
        detect_quantization(sources["qwen3"], "fp8")
    with pytest.raises(ConfigError, match=r"--quantization bitsandbytes is not a method blockspec reads"):
        EngineConfig(quantization="bitsandbytes").validate()


@pytest.mark.parametrize("qcfg,what", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method bitsandbytes"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ 3-bit"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version gemv"),
    ({"quant_method": "auto-round", "bits": 4, "packing_format": "auto_round:llm_compressor"},
     "AutoRound packing_format auto_round:llm_compressor"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "ModelOpt quant_algo W4A8_AWQ"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "fp8 with weight_block_size"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                           "block_structure": [64, 64]}}}},
     "compressed-tensors format float-quantized"),
])
def test_unsupported_schemes_name_themselves_and_the_supported_ones(qcfg, what):
    with pytest.raises(ConfigError) as err:
        config = parse_quantization(qcfg)
        if config is not None:
            config.scheme_for("model.layers.0.self_attn.q_proj")
    message = str(err.value)
    assert message.startswith("unsupported quantization: ") and what in message
    assert "blockspec supports compressed-tensors nvfp4-pack-quantized" in message and "\n" not in message


def test_fp8_weights_without_a_quantization_config_are_refused(sources, tmp_path):
    out, _ = write_packed_checkpoint(sources["qwen3"], tmp_path / "fp8", "modelopt-fp8")
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"is stored as float8_e4m3fn but the model keeps that layer unquantized"):
        load_quantized(out)


def test_tensor_of_the_wrong_shape_is_refused(sources, tmp_path):
    out, _ = write_packed_checkpoint(sources["qwen3"], tmp_path / "gptq", "gptq")
    state = load_file(out / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.scales"
    state[name] = state[name][:, :8].contiguous()
    save_file(state, out / "model.safetensors")
    with pytest.raises(ConfigError, match=rf"checkpoint tensor {name} has shape \(4, 8\), expected \(4, 64\)"):
        load_quantized(out)


def test_missing_global_scale_is_refused(sources, tmp_path):
    out, _ = write_packed_checkpoint(sources["qwen3"], tmp_path / "nv", "modelopt-nvfp4")
    state = load_file(out / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight_scale_2"]
    save_file(state, out / "model.safetensors")
    with pytest.raises(ConfigError, match=r"lacks model.layers.1.mlp.up_proj.weight_scale_2, the global of the "
                                          r"nvfp4 weight"):
        load_quantized(out)


def test_act_order_that_differs_between_fused_parts_is_refused(sources, tmp_path):
    out, _ = write_packed_checkpoint(sources["qwen3"], tmp_path / "gptq", "gptq", act_order=True)
    state = load_file(out / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.g_idx"
    state[name] = torch.arange(64, dtype=torch.int32) // 32  # k_proj in natural order, q/v permuted
    save_file(state, out / "model.safetensors")
    with pytest.raises(ConfigError, match="different act-order"):
        load_quantized(out)


def test_layer_selection_rules():
    """Exclusion lists in each method's own syntax, matched against checkpoint names."""
    modelopt = parse_quantization({"quant_method": "modelopt", "quant_algo": "NVFP4",
                                   "ignore": ["lm_head", "model.layers.*.mlp.gate", "model.layers.0.linear_attn"]})
    assert modelopt.scheme_for("model.layers.3.mlp.gate") is None
    assert modelopt.scheme_for("model.layers.3.mlp.gate_proj").scheme == "nvfp4"
    assert modelopt.scheme_for("model.layers.0.linear_attn.in_proj_qkv") is None
    assert modelopt.scheme_for("language_model.lm_head") is None
    gptq = parse_quantization({"quant_method": "gptq", "bits": 4, "group_size": 128,
                               "dynamic": {"-:.*mlp.down_proj": {}, "+:.*layers\\.1\\..*": {"bits": 8}}})
    assert gptq.scheme_for("model.layers.0.mlp.down_proj") is None
    assert gptq.scheme_for("model.layers.1.self_attn.q_proj").scheme == "int8"
    assert gptq.scheme_for("model.layers.0.self_attn.q_proj").scheme == "int4"
    assert gptq.scheme_for("lm_head") is None
    autoround = parse_quantization({"quant_method": "auto-round", "bits": 4, "group_size": 128, "sym": True,
                                    "block_name_to_quantize": "model.language_model.layers",
                                    "extra_config": {"model.language_model.layers.0.mlp.gate": {"bits": 16}}})
    assert autoround.scheme_for("model.language_model.layers.0.mlp.gate") is None
    assert autoround.scheme_for("model.language_model.layers.0.mlp.up_proj").source == "gptq"
    assert autoround.scheme_for("model.visual.blocks.0.attn.qkv") is None
    ct = parse_quantization({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "a": {"targets": ["re:.*self_attn.*"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}},
        "b": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                 "group_size": 64}}}, "ignore": ["re:.*o_proj$"]})
    assert ct.scheme_for("model.layers.0.self_attn.q_proj").scheme == "int8"
    assert ct.scheme_for("model.layers.0.mlp.up_proj").group_size == 64
    assert ct.scheme_for("model.layers.0.self_attn.o_proj") is None
