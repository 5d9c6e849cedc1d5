"""Copying checkpoint tensors into parameters by name, shared by targets and drafters."""

from __future__ import annotations

import torch
from torch import nn

from blockspec.errors import ConfigError


def copy_named(module: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Copy `tensor` into `module`'s parameter `name`; False if the module has no such parameter."""
    index = module.__dict__.get("_param_index")
    if index is None:
        index = dict(module.named_parameters())
        module.__dict__["_param_index"] = index
    param = index.get(name)
    if param is None:
        return False
    if param.shape != tensor.shape:
        raise ConfigError(
            f"{name}: checkpoint shape {tuple(tensor.shape)} does not match the model's {tuple(param.shape)}: "
            "config.json and the weights disagree"
        )
    with torch.no_grad():
        param.copy_(tensor)
    return True
