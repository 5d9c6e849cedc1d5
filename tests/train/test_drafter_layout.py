"""The drafter's fused projections against z-lab's separate ones: loading, export names, initialisation."""

from __future__ import annotations

import pytest
import torch

from blockspec.errors import ConfigError
from blockspec.spec.dflash import DFlashDrafter, DrafterConfig
from blockspec.train.drafter_init import init_weights
from blockspec.train.export import zlab_state_dict

CFG = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": 64, "hidden_size": 32,
       "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 8, "block_size": 4, "num_target_layers": 4,
       "dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 2]}}


def _drafter(**overrides) -> DFlashDrafter:
    return DFlashDrafter(DrafterConfig.from_dict({**CFG, **overrides}), 16)


def test_zlab_names_and_shapes():
    drafter = _drafter()
    sd = zlab_state_dict(drafter)
    shapes = {n: tuple(t.shape) for n, t in sd.items() if n.startswith("layers.0.")}
    assert shapes == {
        "layers.0.self_attn.q_proj.weight": (32, 32), "layers.0.self_attn.k_proj.weight": (16, 32),
        "layers.0.self_attn.v_proj.weight": (16, 32), "layers.0.self_attn.o_proj.weight": (32, 32),
        "layers.0.self_attn.q_norm.weight": (8,), "layers.0.self_attn.k_norm.weight": (8,),
        "layers.0.mlp.gate_proj.weight": (48, 32), "layers.0.mlp.up_proj.weight": (48, 32),
        "layers.0.mlp.down_proj.weight": (32, 48),
        "layers.0.input_layernorm.weight": (32,), "layers.0.post_attention_layernorm.weight": (32,)}
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= set(sd)
    assert sum(t.numel() for t in sd.values()) == sum(p.numel() for p in drafter.parameters())


@pytest.mark.parametrize("prefix", ["", "model."])
@pytest.mark.parametrize("bias", [False, True])
def test_zlab_state_dict_loads_back_exactly(prefix, bias):
    src = _drafter(attention_bias=bias)
    init_weights(src, std=1.0, seed=5)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p))  # norms and biases too
    dst = _drafter(attention_bias=bias)
    for name, tensor in zlab_state_dict(src).items():
        assert dst.load_weight(prefix + name, tensor), name
    for (name, a), (_, b) in zip(src.named_parameters(), dst.named_parameters()):
        assert torch.equal(a, b), name
    q = zlab_state_dict(src)["layers.1.self_attn.q_proj.weight"]
    assert torch.equal(dst.layers[1].self_attn.qkv_proj.weight[:32], q)


def test_wrong_shard_shape_is_a_config_error():
    with pytest.raises(ConfigError, match="k_proj"):
        _drafter().load_weight("layers.0.self_attn.k_proj.weight", torch.zeros(8, 32))


def test_init_draws_the_unfused_layout_stream():
    """init_weights on the fused drafter gives exactly the weights the unfused layout got for a seed:
    N(0, std) drawn tensor by tensor in z-lab's order."""
    drafter = _drafter()
    init_weights(drafter, std=0.02, seed=7)
    g = torch.Generator().manual_seed(7)
    for name, t in zlab_state_dict(drafter).items():
        if name.endswith("norm.weight"):
            assert torch.equal(t, torch.ones_like(t)), name
        else:
            assert torch.equal(t, torch.randn(t.shape, generator=g) * 0.02), name
