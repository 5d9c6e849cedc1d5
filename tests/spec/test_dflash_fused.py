"""The drafter's fused decode path (skinny GEMMs, rope_qk with the cache write) against its unfused path.

A decode step as blockspec/runner/decode_step.py runs it: write_context for the newly committed context
rows, then forward_blocks over uniform [anchor, MASK * 7] blocks with DraftMetadata.decode set. The same
drafter, inputs and caches go through both paths; outputs and both K/V caches must agree.
"""

from __future__ import annotations

import pytest
import torch

import blockspec.kernels.rotary as rotary_mod
import blockspec.kernels.skinny_linear as skinny_mod
import blockspec.spec.dflash as dflash
from blockspec.kernels._triton import kernel_device, use_triton
from blockspec.kernels.paged_attention import paged_attention, paged_attention_ref
from blockspec.loader.quant.online import OnlineScheme
from blockspec.models.layers.attention import DecodeMetadata
from blockspec.models.layers.linear import folds
from blockspec.models.layers.quant_linear import QuantLinear
from blockspec.spec.dflash import DFlashDrafter, DrafterConfig, DraftMetadata

DEVICE = kernel_device()
PAGE, Q = 4, 8
ANCHORS = [10, 5]  # context positions [0, anchor) are committed; the block sits at [anchor, anchor + Q)
TABLES = [[3, 0, 5, 1, 7], [2, 6, 4, 8, 9]]  # page 9 is padding (seq 1 needs 4 pages)
KV_START = [2, 0]  # seq 0 with a drafter window: keys before position 2 hidden


def _config(bias: bool, sliding: bool = False) -> DrafterConfig:
    """sliding: layer 0 is a sliding-window layer (window 6, non-causal as DFlash 2 checkpoints set it)."""
    window = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6,
              "is_causal": False} if sliding else {}
    return DrafterConfig.from_dict({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": 64, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64,
        "attention_bias": bias, "block_size": Q, "num_target_layers": 4, **window,
        "dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 2]}})


def _step(device: str, bias: bool, sliding: bool = False, quant: OnlineScheme | None = None):
    """A drafter with random weights and random cache contents, and one decode step's inputs; `quant`: its
    projections rounded at load (--speculative-config "quantization")."""
    g = torch.Generator().manual_seed(0)
    drafter = DFlashDrafter(_config(bias, sliding), 64).to(device).eval()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.08 * noise)
    if quant is not None:
        drafter.quantize_online(quant)
    m = drafter.config.model
    caches = torch.randn(2 * m.num_hidden_layers, 10, PAGE, m.num_key_value_heads, m.head_dim, generator=g)

    def slot(b: int, pos: int) -> int:
        return TABLES[b][pos // PAGE] * PAGE + pos % PAGE

    ctx_pos = [p for a in ANCHORS for p in range(a)]
    ctx_slots = [slot(b, p) for b, a in enumerate(ANCHORS) for p in range(a)]
    block_pos = [p for a in ANCHORS for p in range(a, a + Q)]
    block_slots = [slot(b, p) for b, a in enumerate(ANCHORS) for p in range(a, a + Q)]
    t = torch.tensor
    meta = DraftMetadata(
        ctx_positions=t(ctx_pos, device=device), ctx_slots=t(ctx_slots, device=device),
        block_positions=t(block_pos, device=device), block_slots=t(block_slots, device=device),
        block_start=t(ANCHORS, device=device),
        decode=DecodeMetadata(t(TABLES, device=device), t([a + Q for a in ANCHORS], device=device),
                              t(KV_START, device=device), Q))
    features = torch.randn(len(ctx_pos), 2 * m.hidden_size, generator=g).to(device)
    embeds = torch.randn(len(block_pos), m.hidden_size, generator=g).to(device)
    assert features.shape[0] <= 16 and embeds.shape[0] <= 16  # both within the skinny kernels' reach
    return drafter, caches.to(device), features, embeds, meta


def _run(drafter: DFlashDrafter, caches: torch.Tensor, features: torch.Tensor, embeds: torch.Tensor,
         meta: DraftMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    caches = caches.clone()
    for i, attn in enumerate(drafter.attention_layers):
        attn.k_cache, attn.v_cache = caches[2 * i], caches[2 * i + 1]
    with torch.no_grad():
        drafter.write_context(features, meta.ctx_positions, meta.ctx_slots)
        hidden = drafter.forward_blocks(embeds, meta)
    return hidden, caches


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _paged_attention(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Both paths call paged attention identically (tests/kernels checks the kernel): off CUDA take the
    reference, which keeps the interpreter runs short and independent of that kernel."""
    return (paged_attention if q.is_cuda else paged_attention_ref)(q, *args, **kwargs)


def _compare(monkeypatch, device: str, bias: bool, force: bool, sliding: bool = False,
             quant: OnlineScheme | None = None) -> dict[str, int]:
    """Reference (fused path off) vs fused path; `force` takes the fused path's wiring even where the
    kernels cannot run (skinny_linear, quant_linear and rope_qk then run their PyTorch references)."""
    drafter, caches, features, embeds, meta = _step(device, bias, sliding, quant)
    before = embeds.clone()
    monkeypatch.setattr(dflash, "paged_attention", _paged_attention)
    monkeypatch.setattr(dflash, "folds", lambda x, proj: False)
    ref_hidden, ref_caches = _run(drafter, caches, features, embeds, meta)
    monkeypatch.setattr(dflash, "folds", folds)

    calls = {"skinny_triton": 0, "rope_qk": 0}
    triton_launch = getattr(skinny_mod, "_skinny_linear_triton", None)
    if triton_launch is not None:
        def counting_launch(*args, **kwargs):
            calls["skinny_triton"] += 1
            return triton_launch(*args, **kwargs)
        monkeypatch.setattr(skinny_mod, "_skinny_linear_triton", counting_launch)

    def counting_rope(qkv, *args, **kwargs):
        calls["rope_qk"] += int(use_triton(qkv) and qkv.is_contiguous())  # the kernel, not rope_qk_ref
        return rotary_mod.rope_qk(qkv, *args, **kwargs)
    monkeypatch.setattr(dflash, "rope_qk", counting_rope)
    if force:
        monkeypatch.setattr(dflash, "folds", lambda x, proj: True)
    hidden, fused_caches = _run(drafter, caches, features, embeds, meta)

    assert torch.equal(embeds, before)  # the fused layers update their own copy in place, not the caller's
    tol = 1e-4 if quant is None else 1e-3  # the quantized kernels sum in another order than dequantize + matmul
    assert rel_err(hidden, ref_hidden) < tol
    for i in range(fused_caches.shape[0]):  # every layer's K and V, context and block rows
        assert rel_err(fused_caches[i], ref_caches[i]) < tol
    touched = torch.zeros(10 * PAGE, dtype=torch.bool)
    touched[meta.ctx_slots.cpu()] = True
    touched[meta.block_slots.cpu()] = True
    flat = fused_caches.flatten(1, 2)
    assert torch.equal(flat[:, ~touched.to(device)], caches.flatten(1, 2)[:, ~touched.to(device)])  # rest as was
    return calls


@pytest.mark.parametrize("bias,sliding", [(False, False), (True, False), (False, True)])
def test_fused_wiring_matches_unfused(monkeypatch, bias, sliding):
    """Runs everywhere: the fused path's data flow (weight slices, folded norms, in-place residual,
    rope_qk's cache write) on whatever implementations this machine has; a sliding-window layer too."""
    _compare(monkeypatch, DEVICE or "cpu", bias, force=True, sliding=sliding)


@pytest.mark.skipif(DEVICE is None, reason="Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("bias", [False, True])
def test_fused_kernels_match_unfused(monkeypatch, bias):
    """The real decode path: every projection a skinny kernel launch, every q/k/v pass one rope_qk kernel."""
    calls = _compare(monkeypatch, DEVICE, bias, force=False)
    layers = 2
    # write_context: fc + one K|V GEMM per layer; each layer: qkv, o_proj, gate|up, down
    assert calls == {"skinny_triton": 1 + layers + 4 * layers, "rope_qk": 2 * layers}


QUANTS = [OnlineScheme("fp8", "fp8", 0), OnlineScheme("rtn", "int8", 32), OnlineScheme("rtn", "int4", 32),
          OnlineScheme("rtn", "int4", 0)]


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: f"{q.scheme}g{q.group_size}")
def test_quantized_fused_wiring_matches_unfused(monkeypatch, quant):
    """A drafter quantized at load takes the same fused path, its projections as QuantLinears (the context write's
    K|V GEMM on a row view of q|k|v), and agrees with its unfused path."""
    drafter = _step("cpu", True, quant=quant)[0]
    assert all(isinstance(drafter.get_submodule(n), QuantLinear) for n in drafter.quantizable())
    _compare(monkeypatch, DEVICE or "cpu", True, force=True, quant=quant)


@pytest.mark.skipif(DEVICE is None, reason="Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: f"{q.scheme}g{q.group_size}")
def test_quantized_fused_kernels_match_unfused(monkeypatch, quant):
    """The real decode path of a quantized drafter: its projections on the quantized kernels."""
    _compare(monkeypatch, DEVICE, False, force=False, quant=quant)


def test_fused_path_only_for_decode_fast_path_layers():
    """Uniform decode blocks with a bound cache take the fused kernels, whatever the layer's mask (the paged
    kernel applies causal and sliding windows); ragged general-path blocks do not."""
    drafter = DFlashDrafter(_config(False), 64)
    attn = drafter.attention_layers[0]
    meta = DraftMetadata(ctx_positions=torch.zeros(0), ctx_slots=torch.zeros(0), block_positions=torch.zeros(0),
                         decode=DecodeMetadata(torch.zeros(1, 1), torch.ones(1), torch.zeros(1), 1))
    assert not attn.decode_fusable(meta)  # no cache bound yet
    attn.k_cache = attn.v_cache = torch.zeros(1, PAGE, 2, 16)
    assert attn.decode_fusable(meta)
    attn.causal, attn.window = True, 8
    assert attn.decode_fusable(meta)
    meta.decode = None
    assert not attn.decode_fusable(meta)
