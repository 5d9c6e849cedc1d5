"""MXFP4 experts (GPT-OSS): the layout's dequantize against transformers' own MXFP4 dequantization, the
checkpoint's stacked `*_blocks` / `*_scales` through the loader, the errors of broken checkpoints, the
flag, and the bytes the planner counts."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from blockspec.config import EngineConfig
from blockspec.engine.engine import Engine
from blockspec.errors import BlockspecError, ConfigError
from blockspec.loader.quant import detect_quantization
from blockspec.loader.quant.bytes import checkpoint_memory_bytes, quantized_weight_bytes
from blockspec.models.gpt_oss import deinterleave_rows
from blockspec.models.layers.quant_linear import QuantExperts, dequantize, quantized_tensor_bytes
from tests.tiny_gpt_oss import save_tiny_gpt_oss_mxfp4

GEN = torch.Generator().manual_seed(0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_gpt_oss_mxfp4(tmp_path_factory.mktemp("mxfp4") / "model")


@pytest.fixture(scope="module")
def engine(checkpoint):
    return Engine(EngineConfig(model=str(checkpoint), device="cpu", dtype="float32"))


def transformers_dequantized(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' MXFP4 dequantization ([E, K, N], as its experts hold them) back to [E, N, K]."""
    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)


def test_dequantize_is_transformers_dequantization():
    e, n, k = 3, 10, 96
    blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=GEN, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(90, 160, (e, n, k // 32), generator=GEN, dtype=torch.int32).to(torch.uint8)
    ours = dequantize("mxfp4", blocks.reshape(e, n, k // 2), scales, None, None, 32, torch.float32)
    torch.testing.assert_close(ours, transformers_dequantized(blocks, scales), rtol=0, atol=0)
    # by hand: byte j of group g holds elements 32 g + 2 j (low nibble) and 32 g + 2 j + 1 (high)
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    byte, scale = int(blocks[1, 4, 2, 5]), int(scales[1, 4, 2])
    for nibble, elem in ((byte & 15, 64 + 10), (byte >> 4, 64 + 11)):
        value = (-1 if nibble & 8 else 1) * e2m1[nibble & 7] * 2.0 ** (scale - 127)
        assert ours[1, 4, elem].item() == value


def test_loaded_experts_are_the_checkpoint_dequantized_by_transformers(checkpoint, engine):
    """Every layer's stacks: the bytes as stored, the gate|up rows de-interleaved into [gate; up]."""
    stored = load_file(checkpoint / "model.safetensors")
    for i, layer in enumerate(engine.runner.target.model.layers):
        experts = layer.mlp.experts
        assert isinstance(experts, QuantExperts) and experts.scheme == "mxfp4"
        gate_up, down = experts.dequantize(torch.float32)
        p = f"model.layers.{i}.mlp.experts."
        want_gu = transformers_dequantized(stored[p + "gate_up_proj_blocks"], stored[p + "gate_up_proj_scales"])
        torch.testing.assert_close(gate_up, deinterleave_rows(want_gu), rtol=0, atol=0)
        torch.testing.assert_close(down, transformers_dequantized(stored[p + "down_proj_blocks"],
                                                                  stored[p + "down_proj_scales"]), rtol=0, atol=0)
        bias = deinterleave_rows(stored[p + "gate_up_proj_bias"]).float()
        torch.testing.assert_close(experts.gate_up_proj_bias, bias)
    assert engine.runner.target.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32  # not quantized


def _broken(checkpoint, tmp_path, edit) -> str:
    out = tmp_path / "broken"
    shutil.copytree(checkpoint, out)
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors")
    return str(out)


def test_missing_scales_and_wrong_shapes_are_refused(checkpoint, tmp_path):
    name = "model.layers.1.mlp.experts.down_proj_scales"
    path = _broken(checkpoint, tmp_path, lambda t: t.pop(name))
    with pytest.raises(BlockspecError, match=f"lacks {name}"):
        Engine(EngineConfig(model=path, device="cpu", dtype="float32"))
    shutil.rmtree(path)
    blocks = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    path = _broken(checkpoint, tmp_path, lambda t: t.update({blocks: t[blocks][:, :, :1].contiguous()}))
    with pytest.raises(BlockspecError, match=f"{blocks} has shape"):
        Engine(EngineConfig(model=path, device="cpu", dtype="float32"))


def test_quantization_flag(checkpoint):
    assert detect_quantization(checkpoint, "mxfp4").description == "MXFP4 experts"
    with pytest.raises(ConfigError, match="--quantization mxfp4"):
        detect_quantization(checkpoint, "awq")


def test_bytes_held_and_planned(checkpoint, engine):
    assert quantized_weight_bytes("mxfp4", 2880, 2880, 32, True, 2) == 2880 * 1440 + 2880 * 90
    model = engine.runner.target
    held = sum(p.numel() * 4 for p in model.parameters()) + quantized_tensor_bytes(model)
    experts = sum(quantized_tensor_bytes(m) + sum(p.numel() * 4 for p in m.parameters())
                  for m in model.modules() if isinstance(m, QuantExperts))
    embed = model.model.embed_tokens.weight.numel() * 4
    assert checkpoint_memory_bytes(checkpoint, 4) == (held, experts, embed)
