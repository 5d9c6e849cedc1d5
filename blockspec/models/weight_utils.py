"""Copying checkpoint tensors into parameters by name, shared by targets and drafters."""

from __future__ import annotations

import torch
from torch import nn

from blockspec.errors import ConfigError
from blockspec.models.layers.linear import FUSED_SHARDS


def copy_named(module: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Copy `tensor` into `module`'s parameter `name`; False if the module has no such parameter."""
    index = module.__dict__.get("_param_index")
    if index is None:
        index = dict(module.named_parameters())
        module.__dict__["_param_index"] = index
    param = index.get(name)
    if param is None:
        return _copy_shard(module, index, name, tensor)
    if param.shape != tensor.shape:
        raise ConfigError(
            f"{name}: checkpoint shape {tuple(tensor.shape)} does not match the model's {tuple(param.shape)}: "
            "config.json and the weights disagree"
        )
    with torch.no_grad():
        param.copy_(tensor)
    return True


def _copy_shard(module: nn.Module, index: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> bool:
    """q_proj/k_proj/v_proj and gate_proj/up_proj into the slices of a FusedLinear sibling."""
    prefix, _, rest = name.rpartition(".")  # rest: weight | bias
    owner, _, proj = prefix.rpartition(".")
    if proj not in FUSED_SHARDS:
        return False
    fused_name, shard = FUSED_SHARDS[proj]
    fused = f"{owner}.{fused_name}" if owner else fused_name
    param = index.get(f"{fused}.{rest}")
    if param is None:
        return False
    layer = module.get_submodule(fused)
    start, size = layer.shard_offset(shard), layer.shard_sizes[shard]
    if tensor.shape[0] != size or tuple(tensor.shape[1:]) != tuple(param.shape[1:]):
        raise ConfigError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not match the model's "
                          f"({size}, {', '.join(map(str, param.shape[1:]))}): config.json and the weights disagree")
    with torch.no_grad():
        param[start:start + size].copy_(tensor)
    return True
