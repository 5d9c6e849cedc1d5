"""The one-row NVFP4 mma GEMV (kernels/quant_gemv.py) against quant_linear_ref, and quant_linear's dispatch to
it; its one-token MoE form against the dequantized experts' reference, and moe_experts' dispatch to it. The
kernels are PTX (mma.sync) that only a GPU runs; on CPU only the dispatch rules are checked."""

from __future__ import annotations

import pytest
import torch

from blockspec.kernels import quant_gemv as qg
from blockspec.kernels import quant_linear as ql
from blockspec.kernels._triton import HAVE_TRITON
from blockspec.kernels.moe_grouped import moe_experts, quant_operand
from blockspec.models.layers.quant_linear import QuantExperts
from tests.kernels.test_moe_grouped import random_routing
from tests.kernels.test_moe_grouped_quant import fill_random, reference
from tests.kernels.test_quant_linear import make_layer

gpu = pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def inference():
    """As the engine runs: with grad enabled quant_linear takes the reference (the kernels have no backward)."""
    with torch.inference_mode():
        yield


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_dispatch_rule_keeps_cpu_narrow_and_folded_layers_off_the_gemv() -> None:
    wide = make_layer("nvfp4", qg.WIDE_ROWS, 512, torch.bfloat16)
    meta = ql.quant_meta(wide)
    x = torch.randn(1, 512, dtype=torch.bfloat16)
    assert qg.launch_config(meta) == qg.WIDE
    assert not qg.applies(x, wide, meta, None, None, False)  # CPU tensors: the reference / interpreter path
    assert qg.launch_config(ql.quant_meta(make_layer("nvfp4", 4096, 4096, torch.bfloat16))) == qg.NARROW
    assert qg.launch_config(ql.quant_meta(make_layer("nvfp4", 6144, 4096, torch.bfloat16))) is None  # qkv: dot
    assert qg.launch_config(ql.quant_meta(make_layer("nvfp4", 4096, 1024, torch.bfloat16))) is None  # K short


@gpu
@pytest.mark.parametrize("n,k,global_scale", [(qg.WIDE_ROWS + 24, 512, True), (qg.WIDE_ROWS, 1024, False),
                                              (24576, 4096, True), (4096 - 24, 2048, True), (4096, 12288, False)])
def test_gemv_matches_the_reference(n: int, k: int, global_scale: bool) -> None:
    layer = make_layer("nvfp4", n, k, torch.bfloat16, global_scale=global_scale, seed=n + k).to("cuda")
    meta = ql.quant_meta(layer)
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    assert qg.applies(x, layer, meta, None, None, False)
    got = qg.nvfp4_gemv(x, layer, meta, qg.launch_config(meta))
    for cfg in (qg.WIDE, qg.NARROW, qg.GemvConfig(8, 2, 2)):  # every K split, whatever the dispatch picks
        if k % (128 * cfg.spans * cfg.parts) == 0:
            assert rel_err(qg.nvfp4_gemv(x, layer, meta, cfg), ql.quant_linear_ref(x, layer)) < 1e-2, cfg
    ref = ql.quant_linear_ref(x, layer)
    assert got.shape == ref.shape == (1, n)
    assert rel_err(got, ref) < 1e-2  # bf16 outputs of float32 sums in another order
    torch.testing.assert_close(ql.quant_linear(x, layer), got, rtol=0, atol=0)  # the dispatch takes it


@gpu
def test_gemv_is_not_taken_with_folds_bias_or_more_rows() -> None:
    n, k = qg.WIDE_ROWS, 512
    layer = make_layer("nvfp4", n, k, torch.bfloat16).to("cuda")
    meta = ql.quant_meta(layer)
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    res = torch.zeros(1, n, dtype=torch.bfloat16, device="cuda")
    assert not qg.applies(x, layer, meta, res, None, False)
    assert not qg.applies(x, layer, meta, None, torch.ones(k, dtype=torch.bfloat16, device="cuda"), False)
    assert not qg.applies(x, layer, meta, None, None, True)
    assert not qg.applies(torch.randn(2, k, dtype=torch.bfloat16, device="cuda"), layer, meta, None, None, False)
    biased = make_layer("nvfp4", n, k, torch.bfloat16, bias=True).to("cuda")
    assert not qg.applies(x, biased, ql.quant_meta(biased), None, None, False)
    # with the residual the dot path runs, and still adds the same product
    ref = ql.quant_linear_ref(x, layer)
    got = ql.quant_linear(x, layer, residual=res)
    assert rel_err(got, ref) < 1e-2


@gpu
def test_gemv_replays_in_a_cuda_graph() -> None:
    n, k = qg.WIDE_ROWS, 1024
    layer = make_layer("nvfp4", n, k, torch.bfloat16, seed=3).to("cuda")
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    eager = ql.quant_linear(x, layer)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ql.quant_linear(x, layer)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ql.quant_linear(x, layer)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, ql.quant_linear(x, layer), rtol=0, atol=0)
    assert not torch.equal(out, eager)


def nvfp4_experts(e: int, h: int, i: int, device: str) -> QuantExperts:
    return fill_random(QuantExperts("nvfp4", e, h, i, 16, 16, symmetric=True, dtype=torch.bfloat16), seed=e + h).to(
        device)


def test_moe_dispatch_rule() -> None:
    experts = nvfp4_experts(4, 256, 128, "cpu")
    gu, d = quant_operand(experts.gate_up_proj, torch.bfloat16), quant_operand(experts.down_proj, torch.bfloat16)
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    assert not qg.moe_applies(x, gu, d, False, False, False)  # CPU: the grouped kernels / reference
    assert qg._moe_spans(256) == 2 and qg._moe_spans(512) == 4 and qg._moe_spans(128) == 1


@gpu
@pytest.mark.parametrize("e,h,i,k", [(16, 256, 128, 8), (64, 2048, 512, 8), (8, 384, 256, 2)])
def test_moe_one_token_matches_the_reference(e: int, h: int, i: int, k: int, monkeypatch) -> None:
    experts = nvfp4_experts(e, h, i, "cuda")
    weights, ids = random_routing(1, e, k, torch.bfloat16, seed=i)
    x = torch.randn(1, h, dtype=torch.bfloat16, device="cuda")
    calls = []
    real = qg.nvfp4_moe
    monkeypatch.setattr(qg, "nvfp4_moe", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = moe_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids)
    assert len(calls) == 2  # gate|up and down on the GEMV
    want = reference(experts, x, weights, ids)
    assert rel_err(got, want) < 1e-2
    res = torch.randn_like(x)
    got_res = moe_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, residual=res)
    assert rel_err(got_res, want + res) < 1e-2


@gpu
def test_moe_keeps_the_grouped_kernels_where_the_gemv_does_not_apply(monkeypatch) -> None:
    calls = []
    real = qg.nvfp4_moe
    monkeypatch.setattr(qg, "nvfp4_moe", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    experts = nvfp4_experts(8, 256, 96, "cuda")  # the down projection's K (96) is not whole spans
    weights, ids = random_routing(2, 8, 2, torch.bfloat16, seed=1)
    x = torch.randn(2, 256, dtype=torch.bfloat16, device="cuda")  # and two tokens
    for t in (1, 2):
        got = moe_experts(x[:t], experts.gate_up_proj, experts.down_proj, weights[:t], ids[:t])
        assert rel_err(got, reference(experts, x[:t], weights[:t], ids[:t])) < 1e-2
    assert not calls


@gpu
def test_moe_gemv_replays_in_a_cuda_graph() -> None:
    experts = nvfp4_experts(16, 256, 128, "cuda")
    weights, ids = random_routing(1, 16, 4, torch.bfloat16, seed=2)
    x = torch.randn(1, 256, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        moe_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids)
    new_w, new_ids = random_routing(1, 16, 4, torch.bfloat16, seed=3)
    weights.copy_(new_w)
    ids.copy_(new_ids)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, reference(experts, x, weights, ids)) < 1e-2
