"""Rotary position embedding with the scaling schemes our model families use.

cos/sin are precomputed once for every position up to max_positions, in float32, so a step only
gathers rows by position (no per-step trigonometry, and CUDA-graph friendly).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from blockspec.errors import ConfigError


def _inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = float(s["factor"])
    low = float(s.get("low_freq_factor", 1.0))
    high = float(s.get("high_freq_factor", 4.0))
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(rotary_dim: int, base: float, s: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    factor = float(s["factor"])
    old_len = float(s.get("original_max_position_embeddings") or max_pos / factor)
    beta_fast = float(s.get("beta_fast") or 32)
    beta_slow = float(s.get("beta_slow") or 1)
    mscale = s.get("attention_factor")
    if mscale is None:
        def get_mscale(m: float) -> float:
            return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

        both = s.get("mscale") and s.get("mscale_all_dim")
        mscale = get_mscale(float(s["mscale"])) / get_mscale(float(s["mscale_all_dim"])) if both else get_mscale(1.0)

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    # `truncate` (default true) rounds the ramp's ends to whole dimensions; GPT-OSS keeps them fractional.
    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = _inv_freq(rotary_dim, base)
    interpolation = extrapolation / factor
    keep_extrapolation = 1 - ramp
    return interpolation * (1 - keep_extrapolation) + extrapolation * keep_extrapolation, float(mscale)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        base: float,
        scaling: dict[str, Any] | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        attention_scale = 1.0
        inv_freq = _inv_freq(self.rotary_dim, base)
        if rope_type == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "yarn":
            inv_freq, attention_scale = _yarn_inv_freq(self.rotary_dim, base, scaling, max_positions)
        elif rope_type != "default":
            raise ConfigError(f"rope scaling type {rope_type!r} is not supported: use a checkpoint with "
                              "default, linear, llama3 or yarn rope scaling")
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attention_scale, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_scale, persistent=False)

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotate each x of shape [tokens, heads, head_dim] by its token's position."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return tuple(self._rotate(x, cos, sin) for x in xs)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = self.rotary_dim
        rot, rest = (x, None) if rd == x.shape[-1] else (x[..., :rd], x[..., rd:])
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        half = rd // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + rotated * sin
        return out if rest is None else torch.cat((out, rest), dim=-1)
