"""The DFlash training attention mask, dense (reference, CPU) and as a flex_attention BlockMask (GPU).

Queries are the batch's A blocks of B tokens; keys are the S context positions followed by the same
A * B block tokens. A query of the block anchored at a sees context keys t < a (strictly before
the anchor: at decode time the anchor's own features do not exist yet) and all B keys of its own
block (bidirectional), nothing of the other blocks. Padding anchor slots (a = 0) see only their
own block, so no row is empty.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from blockspec.errors import ConfigError

BACKENDS = ("auto", "sdpa", "flex")


def dense_block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """anchors [N, A] -> bool [N, 1, A * B, S + A * B], True where the query may attend."""
    n, a = anchors.shape
    q_block = torch.arange(a * block_size, device=anchors.device) // block_size  # [Q]
    q_anchor = anchors[:, q_block]  # [N, Q]
    ctx = torch.arange(ctx_len, device=anchors.device)
    ctx_ok = ctx[None, None, :] < q_anchor[:, :, None]  # [N, Q, S]
    own = (q_block[:, None] == q_block[None, :]).expand(n, -1, -1)  # [N, Q, Q]
    return torch.cat([ctx_ok, own], dim=2)[:, None]


def block_mask_mod(anchors: torch.Tensor, ctx_len: int, block_size: int) -> Callable:
    """The same rule as a flex_attention mask_mod(b, h, q_idx, kv_idx)."""

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // block_size
        return torch.where(kv_idx < ctx_len, kv_idx < anchors[b, block], (kv_idx - ctx_len) // block_size == block)

    return mask_mod


FLEX_MIN_QUERIES = 4096  # below this many block queries per sequence the dense mask is cheap enough


def resolve_backend(name: str, device: torch.device, queries: int) -> str:
    """auto: flex_attention (block-sparse) on CUDA for many blocks per sequence, else dense SDPA."""
    if name not in BACKENDS:
        raise ConfigError(f"--attention {name!r}: use one of {', '.join(BACKENDS)}")
    if name == "auto":
        return "flex" if device.type == "cuda" and queries >= FLEX_MIN_QUERIES else "sdpa"
    if name == "flex" and device.type != "cuda":
        raise ConfigError("--attention flex needs a CUDA GPU (flex_attention has no CPU backward): use sdpa")
    return name


_compiled_flex: Callable | None = None


def _flex() -> Callable:
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


class BlockAttention:
    """Attention for one training batch: block queries over [context, blocks] keys."""

    def __init__(self, anchors: torch.Tensor, ctx_len: int, block_size: int, backend: str,
                 compiled: bool = True) -> None:
        self.backend = backend
        self.compiled = compiled
        n, a = anchors.shape
        if backend == "flex":
            from torch.nn.attention.flex_attention import create_block_mask

            mod = block_mask_mod(anchors, ctx_len, block_size)
            self.mask = create_block_mask(mod, n, None, a * block_size, ctx_len + a * block_size,
                                          device=anchors.device)
        else:
            self.mask = dense_block_mask(anchors, ctx_len, block_size)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [N, H, Q, D], k/v [N, Hkv, L, D] -> [N, H, Q, D]."""
        if q.is_cuda and torch.is_autocast_enabled("cuda"):  # norms and rotary hand back float32
            dtype = torch.get_autocast_dtype("cuda")
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if self.backend == "flex":
            from torch.nn.attention.flex_attention import flex_attention

            fn = _flex() if self.compiled else flex_attention
            return fn(q, k, v, block_mask=self.mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        if k.shape[1] != q.shape[1]:  # expanded heads keep the memory-efficient kernel usable with a mask
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=self.mask, scale=scale)
