"""compressed-tensors checkpoints written by the `compressed-tensors` package itself (its scale computation,
its compressors, its serialised quantization_config): our loader reproduces its decompressed weights.

Dense Qwen3 (fused q|k|v and gate|up), Qwen3-MoE (per-expert tensors into stacked experts) and Qwen3.5
(a VLM checkpoint: `model.language_model.` names in the ignore list, fused [qkv|z] DeltaNet inputs).
Exact equality with compressed-tensors' decompression for int4/int8/fp8. NVFP4: compressed-tensors divides
by its global scale where our layout multiplies by the inverse, so in float32 the two agree to one unit
in the last place; its own `decompress` rounds to bfloat16, and there they are equal.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from blockspec.errors import ConfigError
from blockspec.loader.quant import detect_quantization
from blockspec.models.layers.quant_linear import QuantExperts, QuantLinear
from tests.conftest import save_tiny_model
from tests.loader.quant_helpers import ct_compress, ct_scheme, write_ct_checkpoint
from tests.loader.quant_model import assert_matches_reference, load_quantized
from tests.tiny_hybrid import save_tiny_hybrid

pytest.importorskip("compressed_tensors")

NARROW = ("nvfp4", "int4_g32", "int4_asym_g32", "int4_channel", "int8_g32", "int8_asym_channel", "fp8_channel",
          "fp8_tensor")
ULP = 2.4e-7  # two float32 units in the last place
WIDE = ("int4_g128", "int4_asym_g128", "fp8_block")  # need in_features >= 128 / 128-row aligned fused parts


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct_src")
    return {
        "qwen3": save_tiny_model(root / "qwen3", "qwen3", num_hidden_layers=2),
        "wide": save_tiny_model(root / "wide", "qwen3", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                num_key_value_heads=4, head_dim=32, num_hidden_layers=2),
        "qwen3_moe": save_tiny_hybrid(root / "qwen3_moe", "qwen3_moe", num_layers=2),
        "qwen3_5": save_tiny_hybrid(root / "qwen3_5", "qwen3_5", num_layers=4),
    }


@pytest.mark.parametrize("key", NARROW + WIDE)
def test_dense_weights_equal_decompression(sources, tmp_path, key):
    src = sources["wide" if key in WIDE else "qwen3"]
    out, ref = write_ct_checkpoint(src, tmp_path / key, key)
    model = load_quantized(out)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 2 * 4  # qkv, o, gate_up, down per layer; lm_head ignored
    assert assert_matches_reference(model, ref, rtol=ULP if key == "nvfp4" else 0.0) == 2 * 7


@pytest.mark.parametrize("key", ["nvfp4", "int4_asym_g32", "fp8_channel"])
def test_moe_experts_are_stacked(sources, tmp_path, key):
    out, ref = write_ct_checkpoint(sources["qwen3_moe"], tmp_path / key, key)
    model = load_quantized(out)
    experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert experts and experts[0].gate_up_proj.qweight.shape[0] == 8  # [E, 2I, ...]
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.float32  # the router stays as stored
    assert_matches_reference(model, ref, rtol=ULP if key == "nvfp4" else 0.0)


@pytest.mark.parametrize("key", ["nvfp4", "int4_g32"])
def test_vlm_names_and_fused_deltanet_inputs(sources, tmp_path, key):
    ignore = ["lm_head", "re:.*mlp.gate$", "re:.*in_proj_(b|a)$", "model.language_model.layers.3.self_attn.o_proj"]
    out, ref = write_ct_checkpoint(sources["qwen3_5"], tmp_path / key, key, ignore=ignore)
    model = load_quantized(out)
    layer0 = model.model.layers[0].linear_attn
    assert isinstance(layer0.in_proj_qkvz, QuantLinear) and len(layer0.in_proj_qkvz.shard_sizes) == 2
    assert not isinstance(layer0.in_proj_ba, QuantLinear)  # ignored by regex
    assert not isinstance(model.model.layers[3].self_attn.o_proj, QuantLinear)  # ignored by (checkpoint) name
    assert isinstance(model.model.layers[3].self_attn.qkv_proj, QuantLinear)
    assert_matches_reference(model, ref, rtol=ULP if key == "nvfp4" else 0.0)


def test_nvfp4_matches_the_packages_bfloat16_decompress():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(3)) * 0.05
    compressed, restored, _ = ct_compress(w, ct_scheme("nvfp4"), exact_nvfp4=False)
    assert restored.dtype == torch.bfloat16
    from blockspec.loader.quant.config import LayerScheme
    from blockspec.loader.quant.formats import convert

    ls = LayerScheme("nvfp4", "ct-nvfp4", 16)
    layer = QuantLinear("nvfp4", 64, 32, 16)
    for suffix in ("weight_packed", "weight_scale"):
        kind, value = convert(ls, suffix, suffix, compressed[suffix], 32, 64, 16, torch.float32)
        getattr(layer, {"qweight": "qweight", "scales": "scales"}[kind]).copy_(value)
    layer.global_scale.copy_(convert(ls, "g", "weight_global_scale", compressed["weight_global_scale"], 32, 64,
                                     16, torch.float32)[1])
    assert torch.equal(layer.dequantize(torch.bfloat16), restored)


def test_different_global_scales_of_fused_parts_are_unified(sources, tmp_path, caplog):
    out, ref = write_ct_checkpoint(sources["qwen3"], tmp_path / "nvfp4", "nvfp4", fuse_globals=False)
    with caplog.at_level(logging.WARNING, logger="blockspec"):
        model = load_quantized(out)
    assert "different NVFP4 global scales" in caplog.text
    # block scales requantized to one global: within an FP8 step of the exact weights
    assert_matches_reference(model, ref, rtol=0.07, atol=1e-3)


def test_config_is_what_the_package_writes(sources, tmp_path):
    out, _ = write_ct_checkpoint(sources["qwen3"], tmp_path / "int4", "int4_asym_g32")
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == "pack-quantized" and qcfg["quant_method"] == "compressed-tensors"
    config = detect_quantization(out)
    assert config.description == "compressed-tensors pack-quantized"
    assert config.scheme_for("model.layers.0.self_attn.q_proj").group_size == 32
    assert config.scheme_for("lm_head") is None
    assert detect_quantization(out, "compressed-tensors") is not None
    with pytest.raises(ConfigError, match="--quantization gptq does not match .* compressed-tensors pack-quantized"):
        detect_quantization(out, "gptq")


def test_unsupported_format_is_one_clear_error(sources, tmp_path):
    out, _ = write_ct_checkpoint(sources["qwen3"], tmp_path / "int4", "int4_g32")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["format"] = "mxfp4-pack-quantized"
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    weights.update(type="float", group_size=32)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"unsupported quantization: compressed-tensors format mxfp4-pack-quantized"
                                          r".*blockspec supports compressed-tensors nvfp4-pack-quantized"):
        detect_quantization(out)


def test_missing_scale_tensor_is_refused_before_loading(sources, tmp_path):
    from safetensors.torch import load_file, save_file

    out, _ = write_ct_checkpoint(sources["qwen3"], tmp_path / "fp8", "fp8_channel")
    state = load_file(out / "model.safetensors")
    del state["model.layers.1.self_attn.k_proj.weight_scale"]
    save_file(state, out / "model.safetensors")
    with pytest.raises(ConfigError, match=r"lacks model.layers.1.self_attn.k_proj.weight_scale, the scales of the fp8 "
                                          r"weight .* re-export or re-download"):
        load_quantized(out)


def test_quantized_lm_head_is_kept_dequantized(sources, tmp_path):
    """The logits path reads lm_head's weight: a quantized head loads through its layout, then is held
    dequantized in the model dtype."""
    from tests.loader.quant_model import reference_weights

    out, ref = write_ct_checkpoint(sources["qwen3"], tmp_path / "int8", "int8_g32", ignore=[])
    model = load_quantized(out)
    assert type(model.lm_head) is torch.nn.Linear
    assert torch.equal(model.lm_head.weight, reference_weights(ref)["lm_head.weight"])


@pytest.mark.parametrize("src", ["qwen3", "qwen3_moe"])
def test_int4_scales_and_zeros_land_packed_at_load(sources, tmp_path, src):
    """Loaded in bfloat16, every int4 layer (dense and stacked experts) holds its scales and zeros as the one
    int32 a group the kernels read (`scale_zero`), built by loading, not on the first GEMM: equal to packing
    the float32 load's scales (rounded to bfloat16) and zeros."""
    from blockspec.kernels.quant_linear import packed_scale_zero
    from blockspec.models.layers.quant_linear import _QuantTensors

    out, _ = write_ct_checkpoint(sources[src], tmp_path / "int4", "int4_asym_g32")
    apart = dict(load_quantized(out).named_modules())  # float32 scales: held apart
    holders = {n: m for n, m in load_quantized(out, torch.bfloat16).named_modules() if isinstance(m, _QuantTensors)}
    assert holders and (src != "qwen3_moe" or any(n.endswith("experts.gate_up_proj") for n in holders))
    for name, held in holders.items():
        ref = apart[name]
        assert ref.scale_zero is None and held.scale_zero is not None
        assert torch.equal(held.zeros, ref.zeros) and torch.equal(held.scales, ref.scales.to(torch.bfloat16))
        assert torch.equal(held.scale_zero, packed_scale_zero(ref.scales.to(torch.bfloat16), ref.zeros))
