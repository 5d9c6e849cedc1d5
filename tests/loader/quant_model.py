"""Loading a quantized checkpoint into our model the way Engine._load_target does, for the tests."""

from __future__ import annotations

from pathlib import Path

import torch

from blockspec.loader.quant import deferred_linears, detect_quantization, quantize_model
from blockspec.loader.weights import load_weights
from blockspec.models.model_config import ModelConfig
from blockspec.models.registry import model_class


def load_quantized(path: Path, dtype: torch.dtype = torch.float32, quantization: str | None = None):
    cfg = ModelConfig.from_dir(path)
    quant = detect_quantization(path, quantization)
    if quant is None:
        model = model_class(cfg)(cfg).eval().requires_grad_(False)
    else:
        with deferred_linears():
            model = model_class(cfg)(cfg).eval().requires_grad_(False)
        quantize_model(model, quant, "cpu", dtype)
    load_weights(model, path, "cpu", dtype)
    return model


def _unpermuted(weight: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    return weight if perm is None else torch.empty_like(weight).index_copy_(-1, perm, weight)


def dequantized_weights(model, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """{checkpoint weight name (plain): dequantized [N, K]} of every quantized projection, split back into
    the checkpoint's projections (q_proj/k_proj/v_proj, experts.{e}.gate_proj, ...)."""
    from blockspec.loader.quant.apply import SHARDS_OF
    from blockspec.models.layers.quant_linear import QuantExperts, QuantLinear

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            owner, _, proj = name.rpartition(".")
            projs = SHARDS_OF[proj] if len(module.shard_sizes) > 1 else [proj]
            w = _unpermuted(module.dequantize(dtype), module.perm)
            for i, p in enumerate(projs):
                start = module.shard_offset(i)
                out[f"{owner}.{p}.weight"] = w[start:start + module.shard_sizes[i]]
        elif isinstance(module, QuantExperts):
            i = module.intermediate_size
            for e in range(module.num_experts):
                gu = module.gate_up_proj.expert(e, dtype)
                if module.gate_up_proj.perm is not None:
                    gu = _unpermuted(gu, module.gate_up_proj.perm[e])
                down = module.down_proj.expert(e, dtype)
                if module.down_proj.perm is not None:
                    down = _unpermuted(down, module.down_proj.perm[e])
                out[f"{name}.{e}.gate_proj.weight"] = gu[:i]
                out[f"{name}.{e}.up_proj.weight"] = gu[i:]
                out[f"{name}.{e}.down_proj.weight"] = down
    return out


def reference_weights(ref_dir: Path) -> dict[str, torch.Tensor]:
    """The oracle checkpoint's weights under their plain (causal-LM) names."""
    from safetensors.torch import load_file

    from blockspec.loader.weights import checkpoint_name

    state = {}
    for f in sorted(Path(ref_dir).glob("*.safetensors")):
        state.update({checkpoint_name(k): v for k, v in load_file(f).items()})
    return state


def assert_matches_reference(model, ref_dir: Path, rtol: float = 0.0, atol: float = 0.0,
                             dtype: torch.dtype = torch.float32) -> int:
    """Every quantized projection dequantizes to the oracle's weight; returns how many were compared."""
    ref = reference_weights(ref_dir)
    got = dequantized_weights(model, dtype)
    assert got, "no quantized layers"
    for name, w in got.items():
        torch.testing.assert_close(w, ref[name].to(dtype), rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    return len(got)
