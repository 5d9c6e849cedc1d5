"""Quantization at load time of full-precision weights (vLLM's online methods `fp8` and `rtn`).

Why: a DFlash drafter reads its whole weights (and, drafting, the LM head) every step, so in front of a 4-bit
target a bf16 drafter is a large share of a k = 15 step's bytes (a Qwen3-8B drafter: 2.1 GB + the 1.2 GB head
beside a 4.9 GB int4 target). Drafts only need to be likely, not exact: verification keeps the output lossless
whatever the drafter computes, so its weights may be rounded. The results are ordinary QuantLinear layouts
(models/layers/quant_linear.py), run by the same kernels as quantized checkpoints.

- "fp8": FP8 E4M3 weights with one float32 scale per output channel (absmax / 448), bf16 activations (W8A16).
- "rtn": symmetric round-to-nearest integers, RTN_NUM_BITS (4 or 8, default 8) bits in groups of
  RTN_GROUP_SIZE (default 128; 0 or -1: one group a row) along K, scales in the model dtype (vLLM's variables).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from blockspec.errors import ConfigError
from blockspec.models.layers.quant_linear import QuantLinear, check_shape, layout_shapes, pack_nibbles, packs_scale_zero

ONLINE_METHODS = ("fp8", "rtn")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SLICE_BYTES = 64 << 20  # float32 working rows at a time: an LM head (0.6-1.5 G weights) is never copied whole


@dataclass(frozen=True)
class OnlineScheme:
    """What an online method makes of each layer: a QuantLinear scheme and its group size (0: per channel)."""

    method: str
    scheme: str  # fp8 | int4 | int8
    group_size: int

    @property
    def bits(self) -> int:
        return 4 if self.scheme == "int4" else 8

    def describe(self) -> str:
        if self.scheme == "fp8":
            return "fp8 (per-channel scales, online)"
        group = f"groups of {self.group_size}" if self.group_size else "per-channel scales"
        return f"rtn {self.scheme} ({group}, symmetric, online)"

    def bytes_for(self, n: int, k: int, elem_bytes: int) -> int:
        """In-memory bytes of an [n, k] weight in this scheme with a model dtype of `elem_bytes`, from the layout's
        own shapes (quant_linear.layout_shapes; int4 with 16-bit scales holds one int32 scale|zero a group)."""
        dtype = torch.float32 if elem_bytes == 4 else torch.bfloat16
        packed = packs_scale_zero(self.scheme, dtype)
        total = 0
        for name, spec in layout_shapes(self.scheme, n, k, 0 if self.scheme == "fp8" else self.group_size or k,
                                        True).items():
            if spec is None or (packed and name == "zeros"):
                continue
            shape, tdtype = spec
            size = 4 if packed and name == "scales" else torch.empty(0, dtype=tdtype or dtype).element_size()
            total += math.prod(shape) * size
        return total


def draft_head_copy() -> bool:
    """Whether a drafter quantized at load drafts through its own rounded copy of the target's LM head
    (BLOCKSPEC_DRAFT_HEAD=copy) or through the target's head as loaded (=target)."""
    value = os.environ.get("BLOCKSPEC_DRAFT_HEAD", "copy")
    if value not in ("copy", "target"):
        raise ConfigError(f"BLOCKSPEC_DRAFT_HEAD={value!r}: use copy or target")
    return value == "copy"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


def online_scheme(method: str) -> OnlineScheme:
    """The scheme of an online method name (rtn reads RTN_NUM_BITS / RTN_GROUP_SIZE from the environment)."""
    method = method.lower()
    if method == "fp8":
        return OnlineScheme("fp8", "fp8", 0)
    if method == "rtn":
        bits = _env_int("RTN_NUM_BITS", 8)
        if bits not in (4, 8):
            raise ConfigError(f"RTN_NUM_BITS={bits}: rtn quantizes to 4 or 8 bits")
        group = _env_int("RTN_GROUP_SIZE", 128)
        if group < -1:
            raise ConfigError(f"RTN_GROUP_SIZE={group}: use a positive group size, or -1 / 0 for one group a row")
        return OnlineScheme("rtn", f"int{bits}", max(group, 0))
    raise ConfigError(f"online quantization {method!r} is not supported: use one of {', '.join(ONLINE_METHODS)}")


def _row_slices(n: int, k: int):
    step = max(1, SLICE_BYTES // (4 * k))
    for r in range(0, n, step):
        yield r, min(n, r + step)


@torch.no_grad()
def quantize_weight(weight: torch.Tensor, scheme: OnlineScheme, dtype: torch.dtype, name: str = "weight",
                    shard_sizes: list[int] | None = None, bias: torch.Tensor | None = None) -> QuantLinear:
    """A QuantLinear holding `weight` [N, K] rounded to `scheme`, on weight's device (row slices at a time)."""
    n, k = weight.shape
    group = scheme.group_size or k
    problem = check_shape(scheme.scheme, n, k, 0 if scheme.scheme == "fp8" else group)
    if problem:
        raise ConfigError(f"{name} [{n}, {k}] cannot be quantized to {scheme.describe()}: {problem} (set "
                          "RTN_GROUP_SIZE to a divisor of it, or -1 for one group a row)")
    layer = QuantLinear(scheme.scheme, k, n, 0 if scheme.scheme == "fp8" else group, bias=bias is not None,
                        symmetric=True, shard_sizes=shard_sizes, dtype=dtype, device=weight.device)
    for a, b in _row_slices(n, k):
        w = weight[a:b].float()
        if scheme.scheme == "fp8":
            scale = (w.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
            layer.qweight[a:b] = (w / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            layer.scales[a:b] = scale
            continue
        qmax = 2 ** (scheme.bits - 1) - 1
        wg = w.view(b - a, k // group, group)
        # the scale as the layer stores it (model dtype), so q * stored scale is the nearest representable value
        scale = (wg.abs().amax(-1) / qmax).to(layer.scales.dtype)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.round(wg / scale.float().unsqueeze(-1)).clamp_(-qmax - 1, qmax).view(b - a, k)
        layer.scales[a:b] = scale
        if scheme.scheme == "int4":
            layer.qweight[a:b] = pack_nibbles((q + 8).to(torch.uint8))
            layer.zeros[a:b] = 8
        else:
            layer.qweight[a:b] = q.to(torch.int8)
    if bias is not None:
        layer.bias.copy_(bias)
    return layer


def quantize_linear(module: nn.Linear, scheme: OnlineScheme, name: str = "weight") -> QuantLinear:
    """The QuantLinear standing in for a plain (or fused) Linear: the same shards, the same bias."""
    sizes = list(getattr(module, "shard_sizes", [module.out_features]))
    return quantize_weight(module.weight, scheme, module.weight.dtype, name, sizes, module.bias)


def quantize_modules(root: nn.Module, names: list[str], scheme: OnlineScheme) -> int:
    """Swap the named Linear submodules of `root` for their quantized stand-ins, one at a time (each full-precision
    weight is released as soon as its copy exists); returns how many were swapped."""
    count = 0
    for name in names:
        module = root.get_submodule(name)
        if not isinstance(module, nn.Linear):  # a QuantLinear too: rounding twice is a caller's mistake
            raise TypeError(f"{name} is a {type(module).__name__}, not a Linear")
        parent, _, child = name.rpartition(".")
        setattr(root.get_submodule(parent) if parent else root, child, quantize_linear(module, scheme, name))
        count += 1
    return count


__all__ = ["ONLINE_METHODS", "OnlineScheme", "draft_head_copy", "online_scheme", "quantize_linear",
           "quantize_modules", "quantize_weight"]
