"""The sparse MoE block: routing and both expert paths against transformers' Qwen3 MoE blocks."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

from blockspec.models.gpt_oss import deinterleave_rows
from blockspec.models.layers.moe import (
    GatedActivation,
    SparseMoeBlock,
    experts_grouped,
    experts_reference,
    load_expert_weight,
    route,
)
from blockspec.models.weight_utils import copy_named


def _copy_from_hf(ours: SparseMoeBlock, hf: torch.nn.Module) -> None:
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
        ours.experts.down_proj.copy_(hf.experts.down_proj)
        if ours.shared_expert is not None:
            for name, tensor in hf.shared_expert.state_dict().items():  # gate/up into the fused halves, as loading
                assert copy_named(ours.shared_expert, name, tensor)
            ours.shared_expert_gate.weight.copy_(hf.shared_expert_gate.weight)


def _randomise(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


@pytest.mark.parametrize("normalize", [True, False])
def test_256_experts_reference_and_grouped_match_transformers(normalize):
    cfg = transformers.Qwen3MoeConfig(hidden_size=64, num_experts=256, num_experts_per_tok=8,
                                      moe_intermediate_size=32, norm_topk_prob=normalize)
    hf = Qwen3MoeSparseMoeBlock(cfg).eval()
    _randomise(hf, 0)
    ours = SparseMoeBlock(64, 256, 8, 32, normalize)
    _copy_from_hf(ours, hf)
    x = torch.randn(45, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(x[None])[0]
        weights, ids = route(ours.gate(x), 8, normalize)
        assert ids.unique().numel() > 100  # many experts hit, most of them by one or two tokens
        for fn in (experts_reference, experts_grouped):
            got = fn(x, ours.experts.gate_up_proj, ours.experts.down_proj, weights, ids)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours(x), want, rtol=1e-5, atol=1e-6)
        # one token (batch-1 decode): 8 of 256 groups non-empty
        torch.testing.assert_close(experts_grouped(x[:1], ours.experts.gate_up_proj, ours.experts.down_proj,
                                                   weights[:1], ids[:1]), want[:1], rtol=1e-5, atol=1e-6)


def test_routing_weights():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    w, ids = route(logits, 2, renormalize=False)
    p = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[3, 2]]
    torch.testing.assert_close(w[0], p[[3, 2]])
    w, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(1))


def test_shared_expert_matches_qwen3_next_block():
    cfg = transformers.Qwen3NextConfig(hidden_size=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=48, norm_topk_prob=True)
    hf = Qwen3NextSparseMoeBlock(cfg).eval()
    _randomise(hf, 2)
    ours = SparseMoeBlock(64, 16, 4, 32, True, shared_intermediate_size=48)
    _copy_from_hf(ours, hf)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x[None])[0], rtol=1e-5, atol=1e-6)


def test_expert_weights_load_per_expert_and_stacked_transposed():
    block = torch.nn.Module()
    block.mlp = SparseMoeBlock(8, 4, 2, 6, True)
    gate, up, down = torch.randn(6, 8), torch.randn(6, 8), torch.randn(8, 6)
    assert load_expert_weight(block, "mlp.experts.2.gate_proj.weight", gate)
    assert load_expert_weight(block, "mlp.experts.2.up_proj.weight", up)
    assert load_expert_weight(block, "mlp.experts.2.down_proj.weight", down)
    torch.testing.assert_close(block.mlp.experts.gate_up_proj[2], torch.cat([gate, up]))
    torch.testing.assert_close(block.mlp.experts.down_proj[2], down)
    stacked = torch.randn(4, 8, 12)  # [E, H, 2I]: the transposed layout some exporters write
    assert load_expert_weight(block, "mlp.experts.gate_up_proj", stacked)
    torch.testing.assert_close(block.mlp.experts.gate_up_proj, stacked.transpose(1, 2))
    assert not load_expert_weight(block, "mlp.experts.down_proj", torch.randn(4, 8, 6))  # ours: plain copy
    assert not load_expert_weight(block, "mlp.gate.weight", torch.randn(4, 8))


def test_gpt_oss_block_matches_transformers():
    """Router with bias, softmax over the top-k logits, experts with biases and the clamped SwiGLU; the
    checkpoint's interleaved gate|up columns become our [gate; up] halves."""
    cfg = transformers.GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=16, num_experts_per_tok=4)
    hf = GptOssMLP(cfg).eval()
    _randomise(hf, 4)
    with torch.no_grad():  # gates and ups past the clamp limit (7) on both sides
        hf.experts.gate_up_proj.mul_(30)
    act = GatedActivation(7.0)
    ours = SparseMoeBlock(64, 16, 4, 32, True, bias=True, activation=act)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.router.weight)
        ours.gate.bias.copy_(hf.router.bias)
        ours.experts.gate_up_proj.copy_(deinterleave_rows(hf.experts.gate_up_proj.transpose(1, 2)))
        ours.experts.gate_up_proj_bias.copy_(deinterleave_rows(hf.experts.gate_up_proj_bias))
        ours.experts.down_proj.copy_(hf.experts.down_proj.transpose(1, 2))
        ours.experts.down_proj_bias.copy_(hf.experts.down_proj_bias)
    x = torch.randn(23, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = hf(x[None])[0][0]
        gu = ours.experts.gate_up_proj
        h = torch.nn.functional.linear(x, gu.flatten(0, 1)).view(23, 16, 64)
        assert (h[..., :32] > 7).any() and (h[..., 32:].abs() > 7).any()  # the clamps bind
        weights, ids = route(ours.gate(x), 4, True)
        for fn in (experts_reference, experts_grouped):
            got = fn(x, gu, ours.experts.down_proj, weights, ids, act, ours.experts.gate_up_proj_bias,
                     ours.experts.down_proj_bias)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours(x), want, rtol=1e-5, atol=1e-5)
