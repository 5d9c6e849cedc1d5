"""The one-row NVFP4 mma GEMV (kernels/quant_gemv.py) against quant_linear_ref, and quant_linear's dispatch to
it; its one-token MoE form against the dequantized experts' reference, and moe_experts' dispatch to it. The
kernels are PTX (mma.sync) that only a GPU runs; on CPU only the dispatch rules are checked."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from blockspec.kernels import quant_gemv as qg
from blockspec.kernels import quant_linear as ql
from blockspec.kernels._triton import HAVE_TRITON
from blockspec.kernels.activation import silu_mul_ref
from blockspec.kernels.moe_grouped import moe_experts, quant_operand
from blockspec.models.layers.moe import SparseMoeBlock
from blockspec.models.layers.quant_linear import QuantExperts, QuantLinear
from tests.kernels.test_moe_grouped import random_routing
from tests.kernels.test_moe_grouped_quant import fill_random, reference
from tests.kernels.test_quant_linear import make_layer

gpu = pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU")
# the streamed one-row kernel: one K part and several, steps of 2-8 spans (the whole part in one step where K is
# short), dependents released early or late; the one-part kernel releasing early; and one row on the rows kernel
STREAMED = (qg.GemvConfig(2, 4, 1, stream=True), qg.GemvConfig(8, 2, 4, stream=True, early=True),
            qg.GemvConfig(16, 8, 2, stream=True), qg.GemvConfig(4, 2, 2, stream=True, early=True),
            qg.GemvConfig(2, 4, 1, early=True),
            # one row on the rows kernel (weights as the mma's A operand), plain and streamed
            qg.GemvConfig(4, 2, 1, rows=True), qg.GemvConfig(8, 2, 4, stream=True, rows=True),
            qg.ROWS_ONE_WIDE, qg.ROWS_ONE_WIDE_LONG_K, qg.ROWS_ONE, qg.SPLIT_ONE, qg.ROWS_ONE_LONG_K,
            qg.GemvConfig(16, 4, 8, stream=True, rows=True),
            qg.GemvConfig(4, 1, 2, groups=2, splits=4, rows=True))  # K split over programs too
# the streamed 2-16-row kernel: one K part and several, a whole short part in one step, early and late
STREAMED_ROWS = (qg.STREAM_ROWS_WIDE, qg.STREAM_ROWS_MID, qg.STREAM_ROWS_NARROW, qg.GemvConfig(8, 2, 8, stream=True),
                 qg.GemvConfig(16, 4, 8, stream=True, early=True), qg.GemvConfig(8, 1, 2, stream=True))
# R blocks a program sharing each span's x loads, plain and streamed (GemvConfig.groups)
GROUPED_ROWS = (qg.GROUPED_WIDE, qg.GROUPED_MID, qg.GemvConfig(4, 2, 1, groups=2),
                qg.GemvConfig(4, 1, 1, stream=True, early=True, groups=2),
                qg.GemvConfig(4, 1, 4, stream=True, early=True, groups=2), qg.GemvConfig(4, 1, 4, groups=4))
# K split over programs (GemvConfig.splits), plain and streamed, with and without groups
SPLIT_ROWS = (qg.GemvConfig(4, 1, 4, groups=2, splits=2), qg.GemvConfig(4, 1, 4, stream=True, early=True, groups=2,
                                                                        splits=4),
              qg.GemvConfig(8, 2, 4, stream=True, early=True, splits=2), qg.GemvConfig(4, 1, 2, groups=2, splits=2),
              qg.SPLIT_ROWS)


@pytest.fixture(autouse=True)
def inference():
    """As the engine runs: with grad enabled quant_linear takes the reference (the kernels have no backward)."""
    with torch.inference_mode():
        yield


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def exact(x: torch.Tensor, layer) -> torch.Tensor:
    """float32 products of x with the float32-dequantized weights (w * s * global scale, no bf16 rounding of the
    weight): what the kernels' float32 sums compute, up to the order of the sum; the results are rounded once."""
    return x.float() @ ql.dequantize_layer(layer, torch.float32).T


def test_dispatch_rule_keeps_cpu_narrow_and_folded_layers_off_the_gemv() -> None:
    wide = make_layer("nvfp4", qg.WIDE_ROWS, 512, torch.bfloat16)
    meta = ql.quant_meta(wide)
    x = torch.randn(1, 512, dtype=torch.bfloat16)
    assert qg.launch_config(meta) == qg._fit_k(qg.ROWS_ONE_WIDE, 512)  # one row of a wide layer: the rows kernel
    assert not qg.applies(x, wide, meta, None, None, False)  # CPU tensors: the reference / interpreter path
    def cfg(scheme: str, n: int, k: int, gated: bool = False) -> qg.GemvConfig | None:
        layer = make_layer(scheme, n, k, torch.bfloat16, group=128) if scheme == "int4" else \
            make_layer(scheme, n, k, torch.bfloat16)
        return qg.launch_config(ql.quant_meta(layer), 1, gated)

    assert cfg("nvfp4", 4096, 4096) == qg.STREAM_NARROW  # o
    assert cfg("nvfp4", 6144, 4096) == cfg("nvfp4", qg.NARROW_MAX_ROWS + 64, 4096) == qg.STREAM_MID  # qkv
    # from GEMV_WIDE_ROWS outputs the rows kernel: 35B q|g|k|v, 27B in_proj / q|g|k|v
    assert cfg("nvfp4", 9216, 2048) == cfg("nvfp4", 16384, 5120) == cfg("nvfp4", 14336, 5120) == qg.ROWS_ONE
    # gate|up from WIDE_ROWS outputs: one K part past K = 4096 (Qwen3.6-27B, with SwiGLU), else four
    assert cfg("nvfp4", 24576, 4096, True) == cfg("nvfp4", 24576, 4096) == qg.ROWS_ONE_WIDE
    assert cfg("nvfp4", 34816, 5120, True) == qg.ROWS_ONE_WIDE_LONG_K and cfg("nvfp4", 34816, 5120) == qg.ROWS_ONE
    # K > 4096 between NARROWEST_ROWS and GEMV_WIDE_ROWS outputs: the rows kernel, K split over two programs where
    # that tiles K (Qwen3.6-27B out_proj), else unsplit (27B down: 136 spans)
    assert cfg("nvfp4", 5120, 6144) == cfg("nvfp4", 3072, 8192) == qg.SPLIT_ONE
    assert cfg("nvfp4", 5120, 17408) == cfg("nvfp4", 2560, 9216) == replace(qg.SPLIT_ONE, splits=1)
    # a down projection of 4096-4224 outputs (Qwen3-8B): K in 8 parts, unsplit, where its 4-span steps tile K, else
    # SPLIT_ONE (Llama-3-8B's K = 14336)
    assert cfg("nvfp4", 4096, 12288) == cfg("nvfp4", 4096, 12288, True) == qg.ROWS_ONE_LONG_K
    assert cfg("nvfp4", 4096, 14336) == qg.SPLIT_ONE
    assert cfg("nvfp4", 4096, 4096 + 128) == qg._fit_k(qg.STREAM_NARROW, 4096 + 128)  # it does not tile K at all
    assert cfg("nvfp4", 2048, 4096) == qg.NARROWEST  # 35B out_proj
    assert cfg("nvfp4", 2048, 2048) == qg.STREAM_NARROW  # K short of NARROWEST's step
    # K short of the streamed launch's step: its spans, then its parts cut until whole steps tile K
    assert cfg("nvfp4", 4096, 1024) == qg.GemvConfig(8, 2, 4, stream=True, early=True)
    assert cfg("nvfp4", 4096, 512) == qg.GemvConfig(8, 1, 4, stream=True, early=True)
    assert cfg("nvfp4", 4096, 256) == qg.GemvConfig(8, 1, 2, stream=True, early=True)
    # int4: an o projection and a q|k|v streamed, from GEMV_WIDE_ROWS outputs the rows kernel, the 8B's down as
    # NVFP4's (not the 27B's), the rest on the dot path
    assert cfg("int4", 4096, 4096) == qg.STREAM_NARROW and cfg("int4", 6144, 4096) == qg.STREAM_MID
    assert cfg("int4", 4096, 12288) == qg.ROWS_ONE_LONG_K and cfg("int4", 4096, 14336) == qg.SPLIT_ONE
    assert cfg("int4", 24576, 4096, True) == cfg("int4", 24576, 4096) == cfg("int4", 34816, 5120, True) == \
        cfg("int4", 9216, 2048) == qg.ROWS_ONE
    assert cfg("int4", 5120, 6144) is None and cfg("int4", 5120, 17408) is None and cfg("int4", 2560, 9216) is None


def test_rows_dispatch_rule() -> None:
    def cfg(n: int, k: int, m: int) -> qg.GemvConfig | None:
        return qg.launch_config(ql.quant_meta(make_layer("nvfp4", n, k, torch.bfloat16)), m)

    assert cfg(6144, 4096, 2) == cfg(6144, 4096, 8) == qg.ROWS_FEW  # qkv: a k <= 7 verify block, small batches
    # 9-16 rows streamed: qkv, o, down, gate|up (Qwen3-8B)
    assert cfg(6144, 4096, 9) == cfg(6144, 4096, 16) == qg.STREAM_ROWS_MID
    assert cfg(4096, 4096, 16) == qg.STREAM_ROWS_NARROW and cfg(4096, 12288, 16) == qg.STREAM_ROWS_MID
    assert cfg(24576, 4096, 16) == qg.GROUPED_WIDE  # gate|up: two blocks of rows a program share x
    assert cfg(24576, 8192, 16) == qg.STREAM_ROWS_WIDE  # past the measured K = 4096: streamed, one block
    assert cfg(qg.WIDE_ROWS, 512, 16) == cfg(qg.WIDE_ROWS, 512, 3) == qg.ROWS_WIDE  # K < 4096: unstreamed
    # Qwen3.6-35B-A3B's in_proj and q|gate|k|v (K = 2048): two blocks of rows a program; shorter K the dot path
    assert cfg(12288, 2048, 16) == cfg(9216, 2048, 9) == qg.GROUPED_MID \
        and cfg(12288, 2048, 8) == qg._fit_k(qg.ROWS_FEW, 2048)
    assert cfg(12288, 1024, 16) is None and cfg(4096, 2048, 16) is None
    assert cfg(2048, 4096, 16) == qg.ROWS_LONG_K and cfg(2048, 2048, 16) is None  # up to 2048 outputs: unstreamed
    # past 4224 outputs (up to GEMV_WIDE_ROWS), K > 4096: K split over programs (Qwen3.6-27B's down and out_proj)
    assert cfg(6144, 6144, 16) == cfg(5120, 6144, 9) == cfg(5120, 17408, 16) == qg.SPLIT_ROWS
    assert cfg(5120, 6144, 8) == qg._fit_k(qg.ROWS_FEW, 6144) and cfg(qg.GEMV_WIDE_ROWS, 6144, 16) is None
    assert cfg(4096, 4096, 17) is None  # more rows: quant_linear's tiles
    # K that does not tile into the config's parts x spans: both cut until it does (27B: K = 5120)
    assert cfg(4096, 5120, 4) == qg.GemvConfig(16, 1, 8)
    assert cfg(4096, 17408, 16) == qg.GemvConfig(4, 2, 4, stream=True, early=True)
    # Qwen3.6-27B's measured launches at 9-16 rows (ROWS_TUNED); at 2-8 rows the rules
    assert cfg(34816, 5120, 16) == qg.GemvConfig(4, 1, 4, groups=2) and cfg(34816, 5120, 8) == qg.ROWS_WIDE
    assert cfg(14336, 5120, 16) == qg.GemvConfig(8, 2, 2)
    assert cfg(4096, 256, 2) == qg.GemvConfig(16, 1, 2)
    assert cfg(4096, 192, 2) is None  # not whole 128-weight spans


@gpu
@pytest.mark.parametrize("n,k,global_scale", [(qg.WIDE_ROWS + 24, 512, True), (qg.WIDE_ROWS, 1024, False),
                                              (24576, 4096, True), (4096 - 24, 2048, True), (4096, 12288, False),
                                              (qg.GEMV_WIDE_ROWS + 8, 2048, True), (2048 - 40, 4096, True)])
def test_gemv_matches_the_reference(n: int, k: int, global_scale: bool) -> None:
    layer = make_layer("nvfp4", n, k, torch.bfloat16, global_scale=global_scale, seed=n + k).to("cuda")
    meta = ql.quant_meta(layer)
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    assert qg.applies(x, layer, meta, None, None, False)
    got = qg.gemv(x, layer, meta, qg.launch_config(meta))
    want = exact(x, layer)
    for cfg in (qg.WIDE, qg.NARROW, qg.NARROWEST, qg.GemvConfig(8, 2, 2), *STREAMED):  # every K split and kernel
        if qg._tiles_k(cfg, k):
            assert rel_err(qg.gemv(x, layer, meta, cfg), want) < 3e-3, cfg
    assert got.shape == (1, n)
    assert rel_err(got, want) < 3e-3  # bf16 outputs of float32 sums in another order
    assert rel_err(got, ql.quant_linear_ref(x, layer)) < 1e-2  # the reference rounds the weights to bf16 first
    torch.testing.assert_close(ql.quant_linear(x, layer), got, rtol=0, atol=0)  # the dispatch takes it


@gpu
@pytest.mark.parametrize("m", [2, 5, 8, 9, 16])
@pytest.mark.parametrize("n,k,global_scale", [(qg.WIDE_ROWS + 24, 512, True), (4096 - 24, 2048, True),
                                              (6144, 4096, False), (4096, 12288, True), (40, 512, True),
                                              (1000, 5120, True)])
def test_rows_match_the_reference(m: int, n: int, k: int, global_scale: bool) -> None:
    """2-16 rows, every token block and row group edge: N not a multiple of 16 (a group of live lo rows and
    dead hi rows), tokens not a multiple of 8, the configs' K splits whatever the dispatch picks."""
    layer = make_layer("nvfp4", n, k, torch.bfloat16, global_scale=global_scale, seed=n + k + m).to("cuda")
    meta = ql.quant_meta(layer)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    want = exact(x, layer)
    for c in (qg.ROWS_FEW, qg.ROWS_LONG_K, qg.ROWS_WIDE, qg.GemvConfig(4, 4, 4), qg.GemvConfig(8, 4, 2),
              *qg.ROWS_TUNED.values(), *STREAMED_ROWS, *GROUPED_ROWS, *SPLIT_ROWS):
        c = qg._fit_k(c, k)
        got = qg.gemv(x, layer, meta, c)
        assert got.shape == (m, n)
        assert rel_err(got, want) < 3e-3, c
        assert rel_err(got[-1:], want[-1:]) < 3e-3, c  # the last token: its block's edge
        assert rel_err(got[:, -8:], want[:, -8:]) < 3e-3, c  # the last rows: their group's edge
    cfg = qg.applies(x, layer, meta, None, None, False)
    if cfg is not None:
        torch.testing.assert_close(ql.quant_linear(x, layer), qg.gemv(x, layer, meta, cfg), rtol=0, atol=0)
    else:  # the dot path
        assert rel_err(ql.quant_linear(x, layer), want) < 3e-3


@gpu
@pytest.mark.parametrize("m,n,k", [(1, qg.WIDE_ROWS, 512), (1, 4096, 4096), (3, 4096, 4096), (16, 4096, 12288),
                                   (16, qg.WIDE_ROWS, 512)])
def test_residual_is_added_in_place_as_a_separate_add_rounds(m: int, n: int, k: int) -> None:
    layer = make_layer("nvfp4", n, k, torch.bfloat16, seed=k + m).to("cuda")
    meta = ql.quant_meta(layer)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    res = torch.randn(m, n, dtype=torch.bfloat16, device="cuda") * 4
    assert qg.applies(x, layer, meta, res, None, False)
    y = qg.gemv(x, layer, meta, qg.applies(x, layer, meta, None, None, False))
    before = res.clone()
    out = ql.quant_linear(x, layer, residual=res)
    assert out.data_ptr() == res.data_ptr()
    torch.testing.assert_close(res, before + y, rtol=0, atol=0)  # y rounded first, then the bf16 add
    for cfg in STREAMED if m == 1 else STREAMED_ROWS + GROUPED_ROWS + SPLIT_ROWS:
        if qg._tiles_k(cfg, k):
            res = before.clone()
            qg.gemv(x, layer, meta, cfg, residual=res)
            torch.testing.assert_close(res, before + qg.gemv(x, layer, meta, cfg), rtol=0, atol=0)


@gpu
def test_kernels_are_not_taken_with_norm_bias_or_many_rows() -> None:
    n, k = qg.WIDE_ROWS, 512
    layer = make_layer("nvfp4", n, k, torch.bfloat16).to("cuda")
    meta = ql.quant_meta(layer)
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    assert not qg.applies(x, layer, meta, None, torch.ones(k, dtype=torch.bfloat16, device="cuda"), False)
    res = torch.zeros(1, n, dtype=torch.bfloat16, device="cuda")
    assert qg.applies(x, layer, meta, None, None, True) and not qg.applies(x, layer, meta, res, None, True)
    assert not qg.applies(torch.randn(17, k, dtype=torch.bfloat16, device="cuda"), layer, meta, None, None, False)
    biased = make_layer("nvfp4", n, k, torch.bfloat16, bias=True).to("cuda")
    assert not qg.applies(x, biased, ql.quant_meta(biased), None, None, False)
    # with the norm fold quant_linear's kernel runs, and still computes the same product
    w = torch.ones(k, dtype=torch.bfloat16, device="cuda")
    got = ql.quant_linear(x, layer, norm_weight=w, eps=1e-6)
    normed = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    assert rel_err(got, exact(normed, layer)) < 1e-2


@gpu
@pytest.mark.parametrize("m", [1, 16])
def test_gemv_replays_in_a_cuda_graph(m: int) -> None:
    n, k = qg.WIDE_ROWS, 1024
    layer = make_layer("nvfp4", n, k, torch.bfloat16, seed=3).to("cuda")
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
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


@gpu
def test_split_rows_replay_in_a_cuda_graph(monkeypatch) -> None:
    """K split over programs: the last program of each block adds the splits' sums in split order (the same
    result on every call and replay), resets its arrival counter for the next launch, and a capture before any
    eager launch allocated the counters is refused rather than allocating them from the graph's pool."""
    import blockspec.kernels.arrivals as arrivals

    monkeypatch.setattr(arrivals, "_counters", {})
    n, k, m = 4096 - 24, 4096, 16
    layer = make_layer("nvfp4", n, k, torch.bfloat16, seed=5).to("cuda")
    meta = ql.quant_meta(layer)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    cfg = qg.GemvConfig(4, 1, 4, groups=2, splits=4)
    with pytest.raises(ValueError, match="arrival counters"), torch.cuda.graph(torch.cuda.CUDAGraph()):
        qg.gemv(x, layer, meta, cfg)
    eager = qg.gemv(x, layer, meta, cfg)  # allocates the counters
    assert torch.equal(qg.gemv(x, layer, meta, cfg), eager) and not arrivals._counters[x.device].any()
    assert rel_err(eager, exact(x, layer)) < 3e-3
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = qg.gemv(x, layer, meta, cfg)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager) and not arrivals._counters[x.device].any()
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, qg.gemv(x, layer, meta, cfg), rtol=0, atol=0)


@gpu
def test_one_row_split_runs_unsplit_when_captured_before_the_counters(monkeypatch) -> None:
    """SPLIT_ONE (one row, K over two programs) needs the arrival counters, which an eager launch allocates: a graph
    captured before any such launch gets the same launch without the split (and the same sums within bf16)."""
    import blockspec.kernels.arrivals as arrivals

    monkeypatch.setattr(arrivals, "_counters", {})
    n, k = 5120, 6144  # Qwen3.6-27B's out_proj
    layer = make_layer("nvfp4", n, k, torch.bfloat16, seed=11).to("cuda")
    meta = ql.quant_meta(layer)
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    unsplit = replace(qg.SPLIT_ONE, splits=1)
    assert qg.applies(x, layer, meta, None, None, False) == qg.SPLIT_ONE
    eager = qg.gemv(x, layer, meta, unsplit)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        taken = qg.applies(x, layer, meta, None, None, False)
        out = ql.quant_linear(x, layer)
    assert taken == unsplit and not arrivals._counters
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    assert rel_err(qg.gemv(x, layer, meta, qg.SPLIT_ONE), exact(x, layer)) < 3e-3  # eager: allocates them
    assert arrivals._counters and qg.applies(x, layer, meta, None, None, False) == qg.SPLIT_ONE


def int4_layer(n: int, k: int, group: int, seed: int, *, symmetric: bool = False):
    """An int4 layer on the GPU; asymmetric ones also hold GPTQ v1's zero 16 (the format's off-by-one kept)."""
    layer = make_layer("int4", n, k, torch.bfloat16, group=group, zeros=not symmetric, seed=seed)
    if not symmetric:
        layer.zeros[::7, ::3] = 16
        layer.scale_zero = ql.packed_scale_zero(layer.scales, layer.zeros)  # what the kernels read
    return layer.to("cuda")


@gpu
@pytest.mark.parametrize("n,k,group,symmetric", [(qg.WIDE_ROWS + 24, 512, 128, False), (24576, 4096, 128, True),
                                                 (4096 - 24, 2048, 32, False), (4096, 12288, 128, False),
                                                 (2048 - 40, 4096, 64, True), (6144, 4096, 4096, False)])
def test_int4_gemv_matches_the_reference(n: int, k: int, group: int, symmetric: bool) -> None:
    """One row of int4 on the mma kernels (every K split): each weight rounded to bf16 as (q - z) * s as the
    reference rounds it, so only the order of the float32 sums differs."""
    layer = int4_layer(n, k, group, n + k, symmetric=symmetric)
    meta = ql.quant_meta(layer)
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    want = ql.quant_linear_ref(x, layer)
    for cfg in (qg.WIDE, qg.NARROW, qg.GemvConfig(8, 2, 2), qg.GemvConfig(16, 2, 8), *STREAMED):
        if qg._tiles_k(cfg, k):
            got = qg.gemv(x, layer, meta, cfg)
            assert got.shape == (1, n)
            assert rel_err(got, want) < 3e-3, cfg
            assert rel_err(got[:, -8:], want[:, -8:]) < 3e-3, cfg  # the last rows: their program's edge
    cfg = qg.applies(x, layer, meta, None, None, False)
    if cfg is not None:
        torch.testing.assert_close(ql.quant_linear(x, layer), qg.gemv(x, layer, meta, cfg), rtol=0, atol=0)


@gpu
@pytest.mark.parametrize("m", [2, 8, 9, 16])
@pytest.mark.parametrize("n,k,group", [(qg.WIDE_ROWS + 24, 512, 128), (4096 - 24, 2048, 32), (4096, 12288, 128),
                                       (40, 512, 64)])
def test_int4_rows_match_the_reference(m: int, n: int, k: int, group: int) -> None:
    layer = int4_layer(n, k, group, n + k + m)
    meta = ql.quant_meta(layer)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    want = ql.quant_linear_ref(x, layer)
    for c in (qg.ROWS_FEW, qg.ROWS_LONG_K, qg.ROWS_WIDE, qg.GemvConfig(8, 4, 2), *STREAMED_ROWS, *GROUPED_ROWS,
              *SPLIT_ROWS):
        c = qg._fit_k(c, k)
        got = qg.gemv(x, layer, meta, c)
        assert got.shape == (m, n)
        assert rel_err(got, want) < 3e-3, c
        assert rel_err(got[-1:], want[-1:]) < 3e-3, c
        assert rel_err(got[:, -8:], want[:, -8:]) < 3e-3, c


@gpu
@pytest.mark.parametrize("scheme", ["nvfp4", "int4"])
@pytest.mark.parametrize("m,n,k", [(1, 2 * qg.WIDE_ROWS + 48, 512), (1, 4096 - 48, 2048), (1, 24576, 4096),
                                   (3, 4096 - 48, 2048), (16, 24576, 4096), (9, 2 * 40, 512)])
def test_swiglu_is_folded_into_the_epilogue(scheme: str, m: int, n: int, k: int) -> None:
    """gate|up with SwiGLU in the epilogue: one output's gate and up rows in one program, rounded as the separate
    F.linear and silu_mul_ref round them; through every kernel (wide, K parts, rows) and quant_linear's dispatch."""
    layer = int4_layer(n, k, 128, n + k + m) if scheme == "int4" else \
        make_layer("nvfp4", n, k, torch.bfloat16, seed=n + k + m).to("cuda")
    meta = ql.quant_meta(layer)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    want = silu_mul_ref(ql.quant_linear_ref(x, layer))
    cfgs = (qg.WIDE, qg.NARROW, qg.GemvConfig(8, 2, 8), *STREAMED) if m == 1 else \
        (qg.ROWS_FEW, qg.ROWS_WIDE, qg.ROWS_LONG_K, *qg.ROWS_TUNED.values(), *STREAMED_ROWS, *GROUPED_ROWS, *SPLIT_ROWS)
    for cfg in cfgs:
        cfg = qg._fit_k(cfg, k)
        got = qg.gemv(x, layer, meta, cfg, gated=True)
        assert got.shape == (m, n // 2)
        assert rel_err(got, want) < 1e-2, cfg
        assert rel_err(got[:, -64:], want[:, -64:]) < 1e-2, cfg  # the last outputs: their program's edge
    cfg = qg.applies(x, layer, meta, None, None, True)
    if cfg is not None:
        unfused = silu_mul_ref(qg.gemv(x, layer, meta, cfg))
        folded = ql.quant_linear(x, layer, gated=True)
        torch.testing.assert_close(folded, qg.gemv(x, layer, meta, cfg, gated=True), rtol=0, atol=0)
        torch.testing.assert_close(folded, unfused, rtol=0, atol=0)  # the same sums, rounded as the two launches


@gpu
@pytest.mark.parametrize("scheme,folds", [("nvfp4", (1, 16)), ("int4", (1,))])
def test_quantized_gate_up_folds_swiglu_where_the_mma_kernels_take_it(monkeypatch, scheme: str, folds) -> None:
    """A decoder's quantized gate|up (QuantLinear.forward_gated, as folded_linear calls it): one launch where
    the mma kernels take the rows, the GEMM and a SwiGLU kernel elsewhere (rows they do not take)."""
    h, i = 512, qg.WIDE_ROWS
    if scheme == "nvfp4":
        proj = nvfp4_linear(2 * i, h, 5, [i, i])
    else:
        src = make_layer("int4", 2 * i, h, torch.bfloat16, group=128, seed=5)
        proj = QuantLinear("int4", h, 2 * i, 128, symmetric=False, shard_sizes=[i, i], dtype=torch.bfloat16)
        for name in ("qweight", "scales", "zeros"):  # scales and zeros: views into the packed scale|zero words
            getattr(proj, name).copy_(getattr(src, name))
        proj = proj.cuda()
        assert ql.scale_zero_of(proj) is not None
    calls = count_calls(monkeypatch, "gemv")
    for m in (1, 16, 17):
        x = torch.randn(m, h, dtype=torch.bfloat16, device="cuda")
        assert ql.gemv_takes(x, proj, gated=True) == (m in folds)
        calls.clear()
        got = proj.forward_gated(x)
        assert len(calls) == (m in folds or (m <= 16 and ql.gemv_takes(x, proj)))
        assert rel_err(got, silu_mul_ref(proj.reference(x))) < 1e-2


def test_int4_dispatch_rule() -> None:
    """int4 takes the kernels with bf16 scales and groups of >= 32 weights (a lane's 16 bytes in one group);
    SwiGLU needs whole (gate, up) pairs of tile rows in a warp."""
    def cfg(group: int, dtype: torch.dtype = torch.bfloat16, n: int = qg.WIDE_ROWS, gated: bool = False):
        layer = make_layer("int4", n, 512, dtype, group=group)
        meta = ql.quant_meta(layer)
        return qg.launch_config(meta, 1, gated) if qg.layer_fits(layer, meta) else None

    assert cfg(128, gated=True) == cfg(32, gated=True) == cfg(128) == qg._fit_k(qg.ROWS_ONE, 512)
    assert cfg(16, gated=True) is None and cfg(128, torch.float16, gated=True) is None
    # narrower: streamed as a q|k|v, then (up to NARROWEST_ROWS outputs) the dot path
    assert cfg(128, n=qg.GEMV_WIDE_ROWS - 8, gated=True) == qg._gated_fit(qg._fit_k(qg.STREAM_MID, 512), True)
    assert cfg(128, n=qg.NARROWEST_ROWS, gated=True) is None
    rows = make_layer("int4", qg.WIDE_ROWS, 512, torch.bfloat16, group=128)
    assert qg.launch_config(ql.quant_meta(rows), 16) is None
    # 9-16 rows of a gate|up: the dot path, then the SwiGLU launch (two blocks of rows a program lost there)
    gate_up = ql.quant_meta(make_layer("int4", 24576, 4096, torch.bfloat16, group=128))
    assert qg.launch_config(gate_up, 16, True) is None and qg.launch_config(gate_up, 16) is None
    # ... but past 4224 outputs with K > 4096 K split over programs, as NVFP4 (Qwen3.6-27B's down)
    down = ql.quant_meta(make_layer("int4", 5120, 17408, torch.bfloat16, group=128))
    assert qg.launch_config(down, 16) == qg.SPLIT_ROWS and qg.launch_config(down, 8) is None
    assert qg.launch_config(ql.quant_meta(make_layer("nvfp4", 4096, 4096, torch.bfloat16)), 1, True) == \
        qg.STREAM_NARROW
    assert qg.launch_config(ql.quant_meta(make_layer("nvfp4", 64, 4096, torch.bfloat16)), 1, True) == qg.NARROWEST


def nvfp4_experts(e: int, h: int, i: int, device: str) -> QuantExperts:
    return fill_random(QuantExperts("nvfp4", e, h, i, 16, 16, symmetric=True, dtype=torch.bfloat16), seed=e + h).to(
        device)


def count_calls(monkeypatch, *names: str) -> list:
    """A list that gets an entry per call of any of quant_gemv's `names`."""
    calls = []
    for name in names:
        real = getattr(qg, name)
        monkeypatch.setattr(qg, name, lambda *a, real=real, **kw: calls.append(1) or real(*a, **kw))
    return calls


def replay_routed_graph(step, logits: torch.Tensor, x: torch.Tensor, experts: QuantExperts) -> None:
    """Capture `step` (routing from `logits`, then the experts on x: -> weights, ids, out) in a CUDA graph and
    replay it on new logits and x, each output against the reference of the routing the replay wrote."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids, out = step()
    for seed in range(8):
        torch.manual_seed(seed)
        logits.copy_(torch.randn_like(logits))
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, reference(experts, x, weights, ids)) < 1e-2


def test_moe_dispatch_rule() -> None:
    experts = nvfp4_experts(4, 256, 128, "cpu")
    gu, d = quant_operand(experts.gate_up_proj, torch.bfloat16), quant_operand(experts.down_proj, torch.bfloat16)
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    assert not qg.moe_applies(x, gu, d, None, False, False)  # CPU: the grouped kernels / reference
    assert qg._moe_spans(256) == 2 and qg._moe_spans(512) == 4 and qg._moe_spans(128) == 1


@gpu
@pytest.mark.parametrize("e,h,i,k", [(16, 256, 128, 8), (64, 2048, 512, 8), (8, 384, 256, 2)])
def test_moe_one_token_matches_the_reference(e: int, h: int, i: int, k: int, monkeypatch) -> None:
    experts = nvfp4_experts(e, h, i, "cuda")
    weights, ids = random_routing(1, e, k, torch.bfloat16, seed=i)
    x = torch.randn(1, h, dtype=torch.bfloat16, device="cuda")
    calls = count_calls(monkeypatch, "nvfp4_moe")
    got = moe_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids)
    assert len(calls) == 2  # gate|up and down on the GEMV
    want = reference(experts, x, weights, ids)
    assert rel_err(got, want) < 1e-2
    res = torch.randn_like(x)
    got_res = moe_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, residual=res)
    assert rel_err(got_res, want + res) < 1e-2


@gpu
def test_moe_keeps_the_grouped_kernels_where_the_gemv_does_not_apply(monkeypatch) -> None:
    calls = count_calls(monkeypatch, "nvfp4_moe", "nvfp4_moe_rows")
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


@gpu
def test_moe_gemv_reads_routing_written_by_the_launch_before_it() -> None:
    """The engine's graph: the routing kernel writes the expert ids just before the GEMV reads them, so with
    programmatic dependent launch the GEMV must wait before its first read (an early read took stale ids and
    faulted on the 35B-A3B shape)."""
    from blockspec.kernels.moe_grouped import moe_route

    e, h, i, k = 256, 512, 256, 8
    experts = nvfp4_experts(e, h, i, "cuda")
    x = torch.randn(1, h, dtype=torch.bfloat16, device="cuda")
    logits = torch.randn(1, e, dtype=torch.bfloat16, device="cuda")

    def step():
        weights, ids, _ = moe_route(logits, k, True)
        return weights, ids, moe_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids)

    replay_routed_graph(step, logits, x, experts)


def test_moe_rows_dispatch_rule() -> None:
    experts = nvfp4_experts(4, 256, 128, "cpu")
    gu, d = quant_operand(experts.gate_up_proj, torch.bfloat16), quant_operand(experts.down_proj, torch.bfloat16)
    x = torch.randn(16, 256, dtype=torch.bfloat16)
    assert not qg.moe_rows_applies(x, gu, d, None, False, False)  # CPU: the grouped kernels / reference
    assert qg._fit_k(qg.MOE_ROWS, 2048) == qg.MOE_ROWS and qg._fit_k(qg.MOE_ROWS, 128) == qg.GemvConfig(4, 1, 1)
    assert qg._fit_k(qg.MOE_ROWS, 96) is None


@gpu
@pytest.mark.parametrize("t,e,h,i,k", [
    (2, 16, 256, 128, 8),  # two tokens: one block of 8, most of it clamped
    (16, 64, 2048, 512, 8),  # a k = 15 verify block on the 35B-A3B expert shape (64 of its 256 experts)
    (5, 8, 384, 256, 2),  # few tokens, K of 3 spans
    (64, 8, 256, 128, 4),  # 32 pairs an expert: the item's tokens in 4 passes of 8, items chunked at 64 pairs
])
def test_moe_rows_match_the_reference(t: int, e: int, h: int, i: int, k: int, monkeypatch) -> None:
    experts = nvfp4_experts(e, h, i, "cuda")
    weights, ids = random_routing(t, e, k, torch.bfloat16, seed=t + i)
    x = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")
    calls = count_calls(monkeypatch, "nvfp4_moe_rows")
    got = moe_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids)
    assert len(calls) == 2  # gate|up and down on the rows kernel
    want = reference(experts, x, weights, ids)
    assert rel_err(got, want) < 1e-2
    res, sw, sout = torch.randn_like(x), torch.rand(t, dtype=x.dtype, device="cuda"), torch.randn_like(x)
    got = moe_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, residual=res, shared_weight=sw,
                      shared_out=sout)
    assert rel_err(got, want + res + sw[:, None] * sout) < 1e-2


@gpu
def test_moe_rows_read_the_layout_written_by_the_launch_before_them(monkeypatch) -> None:
    """The engine's verify graph: routing and grouping (one launch) write the layout the rows kernel reads first."""
    from blockspec.kernels.moe_grouped import moe_route_align

    t, e, h, i, k = 16, 256, 512, 256, 8
    experts = nvfp4_experts(e, h, i, "cuda")
    x = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")
    logits = torch.randn(t, e, dtype=torch.bfloat16, device="cuda")
    calls = count_calls(monkeypatch, "nvfp4_moe_rows")

    def step():
        weights, ids, _, layout = moe_route_align(logits, k, True)
        return weights, ids, moe_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, layout=layout)

    replay_routed_graph(step, logits, x, experts)
    assert len(calls) == 4


def nvfp4_linear(n: int, k: int, seed: int, shards: list[int] | None = None) -> QuantLinear:
    """A QuantLinear (bf16, CUDA) holding make_layer's random NVFP4 codes, scales and global scale."""
    src = make_layer("nvfp4", n, k, torch.bfloat16, seed=seed)
    layer = QuantLinear("nvfp4", k, n, 16, shard_sizes=shards, dtype=torch.bfloat16)
    layer.qweight.copy_(src.qweight)
    layer.scales.copy_(src.scales)
    layer.global_scale.copy_(src.global_scale)
    return layer.cuda()


def shared_ref(x: torch.Tensor, gate_up: QuantLinear, down: QuantLinear) -> torch.Tensor:
    gate, up = ql.quant_linear_ref(x, gate_up).chunk(2, dim=-1)
    return ql.quant_linear_ref(F.silu(gate) * up, down)


@gpu
@pytest.mark.parametrize("routed", [False, True])
def test_moe_one_token_on_the_rows_kernel(routed: bool, monkeypatch) -> None:
    """MOE_ROWS_MIN_TOKENS = 1: one token's experts (and a folded shared expert) on the rows kernel over the
    one-token layout -- the routing launch's (item j = slot j, routed) or moe_align's -- not on the GEMV."""
    from blockspec.kernels.moe_grouped import moe_route_align

    monkeypatch.setattr(qg, "MOE_ROWS_MIN_TOKENS", 1)
    e, h, i, k = 64, 2048, 512, 8
    experts = nvfp4_experts(e, h, i, "cuda")
    shared = qg.Nvfp4Shared(nvfp4_linear(2 * i, h, 3, [i, i]), nvfp4_linear(h, i, 4))
    x = torch.randn(1, h, dtype=torch.bfloat16, device="cuda")
    sw = torch.rand(1, dtype=x.dtype, device="cuda")
    layout = None
    if routed:
        weights, ids, _, layout = moe_route_align(torch.randn(1, e, dtype=x.dtype, device="cuda"), k, True)
    else:
        weights, ids = random_routing(1, e, k, torch.bfloat16, seed=5)
    rows, gemv = count_calls(monkeypatch, "nvfp4_moe_rows"), count_calls(monkeypatch, "nvfp4_moe")
    got = moe_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, layout=layout)
    assert len(rows) == 2 and not gemv
    assert rel_err(got, reference(experts, x, weights, ids)) < 1e-2
    if not routed:  # the shared expert as expert E: the layout gets its slot
        got = moe_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, shared, sw)
        want = reference(experts, x, weights, ids) + sw[:, None] * shared_ref(x, shared.gate_up, shared.down)
        assert rel_err(got, want) < 1e-2


@gpu
@pytest.mark.parametrize("t", [1, 2, 16])
def test_moe_fold_the_shared_expert(t: int, monkeypatch) -> None:
    """A quantized shared expert as expert E of the one-token (t = 1) or the rows launches (every token's last
    slot), weighted in the combine, against the routed reference plus its own."""
    e, h, i, k = 32, 256, 128, 4
    experts = nvfp4_experts(e, h, i, "cuda")
    shared = qg.Nvfp4Shared(nvfp4_linear(2 * i, h, 1, [i, i]), nvfp4_linear(h, i, 2))
    weights, ids = random_routing(t, e, k, torch.bfloat16, seed=t)
    x = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")
    sw = torch.rand(t, dtype=x.dtype, device="cuda")
    gu, dn = quant_operand(experts.gate_up_proj, x.dtype), quant_operand(experts.down_proj, x.dtype)
    assert qg.shared_fits(shared, gu, dn)
    assert not qg.shared_fits(qg.Nvfp4Shared(shared.down, shared.gate_up), gu, dn)  # shapes swapped
    calls = count_calls(monkeypatch, "nvfp4_moe" if t == 1 else "nvfp4_moe_rows")
    got = moe_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, shared, sw)
    assert len(calls) == 2
    want = reference(experts, x, weights, ids) + sw[:, None] * shared_ref(x, shared.gate_up, shared.down)
    assert rel_err(got, want) < 1e-2


@gpu
@pytest.mark.parametrize("t", [1, 8])
def test_moe_reach_a_shared_expert_gigabytes_away(t: int) -> None:
    """The shared expert is read at its offset from the stacked experts, which in a real model is gigabytes (an
    offset /16 that fits 32 bits but not times 16 faulted in the 35B-A3B engine): its weights placed in a buffer
    more than 2^31 bytes from the experts, for the one-token kernel and the rows kernel."""
    e, h, i, k = 16, 256, 128, 4
    experts = nvfp4_experts(e, h, i, "cuda")
    shared = qg.Nvfp4Shared(nvfp4_linear(2 * i, h, 5, [i, i]), nvfp4_linear(h, i, 6))
    far = torch.empty(2**31 + 2**22, dtype=torch.uint8, device="cuda")
    at_end = far.data_ptr() > experts.gate_up_proj.qweight.data_ptr()
    for layer in (shared.gate_up, shared.down):
        for name in ("qweight", "scales"):
            src = getattr(layer, name)
            nbytes = src.numel() * src.element_size()
            start = far.numel() - 2**21 if at_end else 0
            start += 2**20 if name == "scales" else 0
            place = far[start:start + nbytes].view(src.dtype).view(src.shape)
            place.copy_(src)
            setattr(layer, name, place)
        far = far[:-2**22] if at_end else far[2**22:]  # the down projection's pieces elsewhere in the buffer
    gu = quant_operand(experts.gate_up_proj, torch.bfloat16)
    assert abs(shared.gate_up.qweight.data_ptr() - gu.qweight.data_ptr()) > 2**31
    weights, ids = random_routing(t, e, k, torch.bfloat16, seed=7)
    x = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")
    sw = torch.rand(t, dtype=x.dtype, device="cuda")
    got = moe_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, shared, sw)
    torch.cuda.synchronize()
    want = reference(experts, x, weights, ids) + sw[:, None] * shared_ref(x, shared.gate_up, shared.down)
    assert rel_err(got, want) < 1e-2


@gpu
def test_block_folds_a_quantized_shared_expert_into_the_rows_launches(monkeypatch) -> None:
    """SparseMoeBlock with NVFP4 experts and an NVFP4 shared expert of their size: a verify block takes the rows
    kernel and one token the one-token kernel, the shared expert folded in (two launches for all of it), a
    prefill keeps it beside; each as the block's reference path."""
    e, h, i, k = 64, 256, 128, 8
    block = SparseMoeBlock(h, e, k, i, True, shared_intermediate_size=i).to(torch.bfloat16).cuda().eval()
    block.experts = nvfp4_experts(e, h, i, "cuda")
    block.shared_expert.gate_up_proj = nvfp4_linear(2 * i, h, 3, [i, i])
    block.shared_expert.down_proj = nvfp4_linear(h, i, 4)
    calls = count_calls(monkeypatch, "nvfp4_moe_rows", "nvfp4_moe")
    for t, folded in ((16, True), (1, True), (qg.MOE_ROWS_MAX_TOKENS + 1, False)):
        x = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")
        assert isinstance(block._folded_shared(x), qg.Nvfp4Shared) == folded
        calls.clear()
        got = block(x)
        assert len(calls) == (2 if folded else 0)
        block.experts.backend = "reference"
        want = block(x)
        block.experts.backend = "auto"
        assert rel_err(got, want) < 2e-2, t


def test_launches_that_do_not_tile_k_are_refused() -> None:
    """A config whose K parts x spans do not tile K would read across parts: refused before any launch; so are the
    rows kernel's groups and K splits on the one-row kernels."""
    layer = make_layer("nvfp4", 64, 1024, torch.bfloat16)
    meta = ql.quant_meta(layer)
    with pytest.raises(ValueError, match="do not fit"):
        qg.gemv(torch.randn(2, 1024, dtype=torch.bfloat16), layer, meta, qg.GemvConfig(16, 4, 8))
    with pytest.raises(ValueError, match="do not fit"):
        qg.gemv(torch.randn(17, 1024, dtype=torch.bfloat16), layer, meta, qg.ROWS_WIDE)
    with pytest.raises(ValueError, match="groups of weight rows"):  # the one-row GEMV has no blocks to group
        qg.gemv(torch.randn(1, 1024, dtype=torch.bfloat16), layer, meta, qg.GemvConfig(2, 4, 1, groups=2))
    for cfg in (qg.GemvConfig(4, 1, 2, groups=2), qg.GemvConfig(4, 1, 2, splits=2)):  # nor K to split: not run unsplit
        with pytest.raises(ValueError, match="rows kernel's"):
            qg.gemv(torch.randn(1, 1024, dtype=torch.bfloat16), layer, meta, cfg)
