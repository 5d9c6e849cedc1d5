"""The drafter's training forward: many blocks of a sequence in one pass over dense context features.

It runs the very modules (and parameter names) of blockspec.spec.dflash.DFlashDrafter, so what is
trained is what serves. At inference the drafter projects context K/V into a paged cache and
attends one block per sequence; here context K/V are projected for the whole sequence and all
blocks attend at once under the DFlash training mask (mask.BlockAttention). DFlash 2 drafters run their
convolutions around each sublayer, inside each block (spec/dflash2.py).
"""

from __future__ import annotations

import torch
from torch import nn

from blockspec.spec.dflash import DFlashDrafter
from blockspec.train.mask import BlockAttention


def _rope(rotary: nn.Module, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, T, heads, D] by positions [N, T] (the rotary module takes flat tokens)."""
    n, t, h, d = x.shape
    (out,) = rotary(positions.reshape(-1), x.reshape(n * t, h, d))
    return out.view(n, t, h, d)


def _heads(x: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    return x.view(*x.shape[:2], heads, head_dim)


def train_forward(drafter: DFlashDrafter, features: torch.Tensor, block_embeds: torch.Tensor,
                  block_positions: torch.Tensor, attention: BlockAttention) -> torch.Tensor:
    """features [N, S, n*H] (raw target features), block_embeds [N, Q, H], block_positions [N, Q]
    -> final-normed block hidden states [N, Q, H]."""
    n, s, _ = features.shape
    ctx = drafter.hidden_norm(drafter.fc(features))
    ctx_positions = torch.arange(s, device=features.device).expand(n, s)
    scale = drafter.config.input_embedding_scale
    h = block_embeds * scale if scale != 1.0 else block_embeds
    block = drafter.config.block_size
    block_index = torch.arange(block, device=h.device).repeat(h.shape[1] // block)
    for layer in drafter.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        if layer.attention_conv is not None:
            x, post = layer.attention_conv.prepare(x, block_index)
        q = _rope(attn.rotary, attn.q_norm(_heads(attn.proj_q(x), attn.num_heads, attn.head_dim)), block_positions)
        keys, values = [], []
        for src, pos in ((ctx, ctx_positions), (x, block_positions)):  # context vectors skip the input norm
            k = _rope(attn.rotary, attn.k_norm(_heads(attn.proj_k(src), attn.num_kv_heads, attn.head_dim)), pos)
            keys.append(k)
            values.append(_heads(attn.proj_v(src), attn.num_kv_heads, attn.head_dim))
        k = torch.cat(keys, dim=1).transpose(1, 2)
        v = torch.cat(values, dim=1).transpose(1, 2)
        out = attention(q.transpose(1, 2), k, v, attn.head_dim**-0.5)
        out = attn.o_proj(out.transpose(1, 2).reshape(n, -1, attn.num_heads * attn.head_dim))
        if layer.attention_conv is not None:
            out = layer.attention_conv.finish(out, post, block_index)
            h = h + out
            x, post = layer.mlp_conv.prepare(layer.post_attention_layernorm(h), block_index)
            h = h + layer.mlp_conv.finish(layer.mlp(x), post, block_index)
            continue
        h = h + out
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h)
