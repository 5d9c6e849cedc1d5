"""NVFP4 layers in the mma kernels' lane order (kernels/lane_order.py): the permutation's maps agree with each
other and with the kernels' (Triton) map, dequantize() puts the columns back, and every kernel that reads a
lane-order layer (quant_linear's dot path with its folds, its dequantize kernel, quant_gemv's 1-16-row mma
kernels) gives the natural-order layer's result; a GPU model's dense NVFP4 layers go into lane order, shared
experts and CPU tensors stay as loaded, and BLOCKSPEC_LANE_ORDER is checked."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from blockspec.errors import ConfigError
from blockspec.kernels import lane_order as lo
from blockspec.kernels import quant_gemv as qg
from blockspec.kernels import quant_linear as ql
from blockspec.kernels._triton import HAVE_TRITON
from blockspec.models.layers.quant_linear import QuantLinear
from tests.kernels.test_quant_linear import (  # launch: the fixture
    EPS,
    KERNEL_DEVICE,
    TOL,
    check_fold,
    gpu,
    kernel,
    launch,  # noqa: F401
    make_layer,
    rel_err,
)


def lane_copy(layer: ql.QuantWeights) -> ql.QuantWeights:
    """The same layer in lane order (a copy: `layer` keeps its own tensors)."""
    copy = ql.QuantWeights(**{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in vars(layer).items()})
    lo.to_lane_order(copy)
    return copy


def test_the_maps_are_one_permutation() -> None:
    """Stored byte q holds original byte P(q), its weights columns 2 P(q) and 2 P(q) + 1, and the 8 bytes of a
    stored scale group all come from the one original group its scale is."""
    p, groups = lo.source_bytes(), lo.source_groups()
    cols = lo.source_columns(384)
    assert sorted(p.tolist()) == list(range(64)) and sorted(groups.tolist()) == list(range(8))
    assert sorted(cols.tolist()) == list(range(384))
    for q in range(64):
        assert cols[2 * q] == 2 * p[q] and cols[2 * q + 1] == 2 * p[q] + 1
        assert cols[128 + 2 * q] == 128 + 2 * p[q]  # each 128-weight block on its own
    for u in range(8):
        assert set((p[8 * u:8 * u + 8] // 8).tolist()) == {groups[u].item()}
    # lane t's 16 bytes: two runs of 8, one in each half of the span (each x load a token's lanes in one line)
    for t in range(4):
        lane = p[16 * t:16 * t + 16]
        assert lane[:8].max() < 32 <= lane[8:].min()


def test_dequantize_puts_the_columns_back() -> None:
    torch.manual_seed(0)
    layer = QuantLinear("nvfp4", 256, 48, 16, dtype=torch.bfloat16)
    layer.global_scale.fill_(0.7)
    before, stored = layer.dequantize(), layer.qweight.clone()
    lo.to_lane_order(layer)
    assert layer.lane_order and not torch.equal(layer.qweight, stored)
    assert torch.equal(layer.dequantize(), before)
    assert torch.equal(layer.row_slice(8, 24).dequantize(), before[8:24])  # a row slice keeps the order
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), x @ before.t())  # the CPU path: the reference on the restored weight


def test_the_switch_is_checked_and_cpu_layers_stay_as_loaded(monkeypatch) -> None:
    model = nn.Sequential(QuantLinear("nvfp4", 256, 32, 16))
    monkeypatch.setenv("BLOCKSPEC_LANE_ORDER", "yes")
    with pytest.raises(ConfigError, match="BLOCKSPEC_LANE_ORDER"):
        lo.order_model(model)
    monkeypatch.setenv("BLOCKSPEC_LANE_ORDER", "on")
    assert lo.order_model(model) == 0 and not model[0].lane_order  # the CPU path reads the checkpoint's order


def test_only_dense_nvfp4_layers_of_whole_blocks_fit() -> None:
    assert lo.fits(QuantLinear("nvfp4", 256, 32, 16))
    assert not lo.fits(QuantLinear("nvfp4", 80, 32, 16))  # K not a whole number of 128-weight blocks
    assert not lo.fits(QuantLinear("int4", 256, 32, 128))
    permuted = QuantLinear("nvfp4", 256, 32, 16)
    permuted.perm = torch.arange(256).flip(0)  # act-order
    assert not lo.fits(permuted)
    strided = QuantLinear("nvfp4", 256, 32, 16)
    strided._buffers["scales"] = torch.empty(32, 32, dtype=strided.scales.dtype)[:, :16]  # a view, not contiguous
    assert not lo.fits(strided)
    layer = QuantLinear("nvfp4", 256, 32, 16)
    lo.to_lane_order(layer)
    assert not lo.fits(layer)
    with pytest.raises(ValueError, match="lane order"):
        lo.to_lane_order(layer)  # twice would scramble it


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _cols_kernel(OUT, RUN: tl.constexpr, N: tl.constexpr):
        c = tl.arange(0, N)
        tl.store(OUT + c, lo.lane_cols(c, RUN))


@kernel
def test_the_kernels_map_is_the_columns_map() -> None:
    for run, expected in ((16, lo.source_columns(256)), (8, torch.cat([lo.source_bytes(), 64 + lo.source_bytes()]))):
        out = torch.empty(expected.numel(), dtype=torch.int32, device=KERNEL_DEVICE)
        _cols_kernel[(1,)](out, RUN=run, N=expected.numel())
        assert torch.equal(out.cpu().long(), expected)


@kernel
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("folds", ["none", "norm+gated", "residual"])
def test_dot_path_reads_x_at_the_original_columns(launch, m: int, folds: str) -> None:  # noqa: F811
    """The dot path (one-row and tile forms) on a lane-order layer, with the folded norm's weight read in the
    same order: the natural layer's reference."""
    dtype = torch.bfloat16
    natural = make_layer("nvfp4", 48, 384, dtype, seed=m).to(KERNEL_DEVICE)
    layer = lane_copy(natural)
    x = torch.randn(m, 384, dtype=dtype, device=KERNEL_DEVICE)
    nw = (1 + 0.1 * torch.randn(384, device=KERNEL_DEVICE)).to(dtype) if folds == "norm+gated" else None
    gated = folds == "norm+gated"
    r = torch.randn(m, 48, dtype=dtype, device=KERNEL_DEVICE) if folds == "residual" else None
    r0 = None if r is None else r.clone()
    if nw is None and not gated:
        out = launch(x, layer, residual=r)
        expected = ql.quant_linear_ref(x, natural, None if r0 is None else r0.clone())
        assert rel_err(out, expected) < TOL[dtype]
    else:
        out = launch(x, layer, norm_weight=nw, eps=EPS, gated=gated)
        check_fold(out, x, natural, nw, gated, None, None)


@kernel
def test_prefill_dequantize_kernel_restores_the_order(launch) -> None:  # noqa: F811
    natural = make_layer("nvfp4", 40, 256, torch.float32).to(KERNEL_DEVICE)
    layer = lane_copy(natural)
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(ql.dequantize_triton(layer, dtype), ql.dequantize_layer(natural, dtype))
            assert torch.equal(ql.dequantize_layer(layer, dtype), ql.dequantize_layer(natural, dtype))


# the mma kernels' launch forms: the one-part, parts and streamed one-row GEMVs, one row on the rows kernel (plain,
# streamed, K split), 2-16 rows plain, streamed, grouped and split
MMA_LAUNCHES = [(1, qg.WIDE), (1, qg.NARROW), (1, qg.STREAM_NARROW), (1, qg.ROWS_ONE_WIDE), (1, qg.ROWS_ONE_LONG_K),
                (1, qg.SPLIT_ONE), (16, qg.ROWS_FEW), (9, qg.STREAM_ROWS_MID), (16, qg.GROUPED_WIDE),
                (16, qg.SPLIT_ROWS), (4, qg.ROWS_LONG_K)]


@gpu
@pytest.mark.parametrize("m,cfg", MMA_LAUNCHES)
@pytest.mark.parametrize("gated", [False, True])
def test_mma_kernels_read_x_at_the_original_columns(m: int, cfg: qg.GemvConfig, gated: bool) -> None:
    """Each launch form of quant_gemv on a lane-order layer against the natural layer's reference (K = 12288: every
    form tiles it; SwiGLU folded or not)."""
    torch.manual_seed(m)
    n, k = 4096, 12288
    natural = make_layer("nvfp4", n, k, torch.bfloat16, seed=m).to("cuda")
    layer = lane_copy(natural)
    meta = ql.quant_meta(layer)
    cfg = qg._fit_k(cfg, k) or cfg
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    y = qg.gemv(x, layer, meta, cfg, gated=gated)
    expected = ql.quant_linear_ref(x, natural, gated=gated)
    assert rel_err(y, expected) < 2e-2, cfg


@gpu
def test_a_model_orders_its_dense_nvfp4_layers_but_not_shared_experts(monkeypatch) -> None:
    class Expert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.down_proj = QuantLinear("nvfp4", 256, 32, 16, device="cuda")

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared_expert = Expert()
            self.o_proj = QuantLinear("nvfp4", 256, 32, 16, device="cuda")
            self.q_proj = QuantLinear("int4", 256, 32, 128, device="cuda")

    model = Block()
    weights = {name: m.dequantize() for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    monkeypatch.setenv("BLOCKSPEC_LANE_ORDER", "off")
    assert lo.order_model(model) == 0 and not model.o_proj.lane_order
    monkeypatch.setenv("BLOCKSPEC_LANE_ORDER", "on")
    assert lo.order_model(model) == 1
    assert model.o_proj.lane_order and not model.shared_expert.down_proj.lane_order and not model.q_proj.lane_order
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            assert torch.equal(m.dequantize(), weights[name])


@gpu
def test_a_served_nvfp4_checkpoint_decodes_the_same_in_lane_order(tmp_path, monkeypatch) -> None:
    """End to end on the GPU: a compressed-tensors NVFP4 checkpoint (K a multiple of 128, so its dense layers go into
    lane order) gives the same greedy tokens in bf16 with and without it, CUDA graphs and all: a reader of the bytes
    that missed the column map would change them."""
    pytest.importorskip("compressed_tensors")
    from blockspec.config import EngineConfig
    from blockspec.engine.engine import Engine
    from blockspec.engine.sampling_params import SamplingParams
    from tests.conftest import save_tiny_model
    from tests.loader.quant_helpers import write_ct_checkpoint

    src = save_tiny_model(tmp_path / "src", "qwen3", hidden_size=256, intermediate_size=512, head_dim=64)
    out, _ = write_ct_checkpoint(src, tmp_path / "nvfp4", "nvfp4")
    prompts = ["hello world", "a" * 37, "The quick brown fox jumps over", "def f(n):\n    return"]

    def greedy(order: str) -> list[list[int]]:
        monkeypatch.setenv("BLOCKSPEC_LANE_ORDER", order)
        engine = Engine(EngineConfig(model=str(out), device="cuda", dtype="bfloat16", max_num_seqs=4,
                                     gpu_memory_utilization=0.3))
        ordered = [m for m in engine.runner.target.modules() if getattr(m, "lane_order", False)]
        assert bool(ordered) == (order == "on")
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        engine.release()
        return [o.token_ids for o in outs]

    assert greedy("on") == greedy("off")
