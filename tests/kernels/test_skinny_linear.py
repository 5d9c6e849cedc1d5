"""Skinny GEMM with folded RMSNorm / SwiGLU / residual: the reference against a hand computation (always, CPU),
the Triton kernel against the reference (on a GPU, or on CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.nn.functional as F

from blockspec.kernels.skinny_linear import (
    _MIN_PROGRAMS,
    _launch_config,
    linear,
    skinny_linear,
    skinny_linear_ref,
    skinny_supported,
)
from tests.kernels.interpreter_bf16 import interpreter_like_gpu as _interpreter_like_gpu

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if HAVE_TRITON and torch.cuda.is_available():
    KERNEL_DEVICE: str | None = "cuda"
elif HAVE_TRITON and INTERPRET:
    KERNEL_DEVICE = "cpu"  # Triton's interpreter runs the kernel on CPU tensors
else:
    KERNEL_DEVICE = None

kernel = pytest.mark.skipif(KERNEL_DEVICE is None, reason="needs a CUDA GPU, or Triton with TRITON_INTERPRET=1")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def make_inputs(m: int, n: int, k: int, dtype: torch.dtype, *, bias: bool, norm: bool, gated: bool,
                residual: bool, device: str = "cpu", seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n_out = n // 2 if gated else n

    def rand(*shape: int, scale: float = 1.0, offset: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale + offset).to(dtype=dtype, device=device)

    return dict(
        x=rand(m, k, scale=2.0, offset=0.3),
        weight=rand(n, k, scale=k ** -0.5),
        bias=rand(n, scale=0.1) if bias else None,
        norm_weight=(torch.rand(k, generator=g) + 0.5).to(dtype=dtype, device=device) if norm else None,
        eps=1e-6 if norm else 0.0,
        gated=gated,
        residual=rand(m, n_out, scale=0.2) if residual else None,
    )


def by_hand(x, weight, bias, norm_weight, eps, gated, residual) -> torch.Tensor:
    """The same math written out, rounding to the activation dtype wherever a torch op would."""
    dt = x.dtype
    if norm_weight is not None:
        xf = x.float()
        h = (xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) / x.shape[-1] + eps)).to(dt)
        x = (h.float() * norm_weight.float()).to(dt)
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    y = y.to(dt)
    if gated:
        g, u = y[:, : y.shape[1] // 2].float(), y[:, y.shape[1] // 2:].float()
        y = ((g * torch.sigmoid(g)).to(dt).float() * u).to(dt)
    if residual is not None:
        y = (residual.float() + y.float()).to(dt)
    return y


COMBOS = list(itertools.product([False, True], repeat=4))  # bias, norm, gated, residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias,norm,gated,residual", COMBOS)
def test_reference_matches_hand_computation(dtype, bias, norm, gated, residual):
    inp = make_inputs(3, 48, 40, dtype, bias=bias, norm=norm, gated=gated, residual=residual)
    x0 = inp["x"].clone()
    r0 = inp["residual"].clone() if residual else None
    expected = by_hand(**{**inp, "residual": r0})
    out = skinny_linear_ref(**inp)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:
        assert rel_err(out, expected) < 1e-2
    assert out.shape == (3, 24 if gated else 48) and out.dtype == dtype
    assert torch.equal(inp["x"], x0)
    if residual:
        assert out is inp["residual"] and not torch.equal(out, r0)


def test_reference_parts_match_torch_ops():
    """Gated = F.silu(gate) * up on the F.linear output; residual = residual + F.linear(...)."""
    inp = make_inputs(2, 32, 24, torch.float32, bias=True, norm=False, gated=False, residual=False)
    lin = F.linear(inp["x"], inp["weight"], inp["bias"])
    torch.testing.assert_close(skinny_linear_ref(inp["x"], inp["weight"], inp["bias"], gated=True),
                               F.silu(lin[:, :16]) * lin[:, 16:])
    r = torch.randn(2, 32)
    torch.testing.assert_close(skinny_linear_ref(inp["x"], inp["weight"], inp["bias"], residual=r.clone()), r + lin)


def test_cpu_falls_back_to_reference():
    inp = make_inputs(2, 64, 32, torch.float32, bias=True, norm=True, gated=True, residual=False)
    assert not skinny_supported(inp["x"], inp["weight"])
    torch.testing.assert_close(skinny_linear(**inp), skinny_linear_ref(**inp), rtol=0, atol=0)


@pytest.mark.parametrize("m", [1, 2, 16])
@pytest.mark.parametrize("n,k", [(576, 576), (192, 960), (4096, 4096), (12288, 4096), (151936, 960),
                                 (200, 96), (1, 8)])
def test_launch_config(m, n, k):
    block_n, block_k, num_warps, num_stages = _launch_config(m, n, k)
    for v in (block_n, block_k, num_warps):
        assert v & (v - 1) == 0
    assert block_k >= 16 and num_stages >= 1
    if m == 1:
        assert 4 <= block_n <= 16 and 64 <= block_k <= 1024
    else:
        assert 16 <= block_n <= 64  # tl.dot needs >= 16 in every dimension
    if -(-n // 16) >= _MIN_PROGRAMS:  # enough columns: the grid fills the GPU
        assert -(-n // block_n) >= _MIN_PROGRAMS


@pytest.fixture
def launch(monkeypatch):
    """Runs the kernel: the public entry point on a GPU; under the interpreter the launch itself on CPU."""
    if INTERPRET:
        _interpreter_like_gpu(monkeypatch)
    if KERNEL_DEVICE == "cuda":
        def run(**inp):
            with torch.no_grad():  # the kernels serve inference only
                assert skinny_supported(inp["x"], inp["weight"])
                return skinny_linear(**inp)
        return run
    from blockspec.kernels.skinny_linear import _skinny_linear_triton

    def run(**inp):
        return _skinny_linear_triton(inp["x"], inp["weight"], inp["bias"], inp["norm_weight"], inp["eps"],
                                     inp["gated"], inp["residual"])
    return run


CASES = {  # name: (N, K, options); N and K are deliberately not multiples of the block sizes
    "plain": (200, 96, dict()),
    "bias": (200, 96, dict(bias=True)),
    "norm": (576, 576, dict(norm=True)),
    "norm+gated": (384, 1536, dict(norm=True, gated=True)),
    "residual": (200, 96, dict(residual=True)),
    "all": (200, 160, dict(bias=True, norm=True, gated=True, residual=True)),
}


@kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("m", [1, 2, 5, 16])
def test_kernel_matches_reference(launch, m, case, dtype):
    n, k, opts = CASES[case]
    gated = opts.get("gated", False)
    n_out = n // 2 if gated else n
    if KERNEL_DEVICE == "cpu" and m == 2 and _launch_config(2, n_out, k, gated) == _launch_config(5, n_out, k, gated):
        # both pad to the same 16-row dot tile: the same program (bias and all), fewer live rows
        pytest.skip("2 rows on the 5-row launch run on the GPU (the suite's time under TRITON_INTERPRET=1)")
    flags = dict(bias=False, norm=False, gated=False, residual=False) | opts
    inp = make_inputs(m, n, k, dtype, device=KERNEL_DEVICE, seed=m, **flags)
    x0 = inp["x"].clone()
    ref_inp = {**inp, "residual": inp["residual"].clone() if flags["residual"] else None}
    r0 = ref_inp["residual"].clone() if flags["residual"] else None
    expected = skinny_linear_ref(**ref_inp)
    ptr = inp["residual"].data_ptr() if flags["residual"] else None
    out = launch(**inp)
    assert out.shape == expected.shape and out.dtype == dtype
    assert rel_err(out, expected) < (1e-2 if dtype == torch.bfloat16 else 1e-4)
    assert torch.equal(inp["x"], x0)
    if flags["residual"]:
        assert out.data_ptr() == ptr and torch.equal(out, inp["residual"]) and not torch.equal(out, r0)
        # the projection itself, not just the residual it was added to
        assert rel_err(out.float() - r0.float(), expected.float() - r0.float()) < (3e-2 if dtype == torch.bfloat16
                                                                                 else 1e-4)


@kernel
def test_kernel_fp16_all_options(launch):
    inp = make_inputs(5, 200, 160, torch.float16, device=KERNEL_DEVICE, bias=True, norm=True, gated=True,
                      residual=True)
    ref_inp = {**inp, "residual": inp["residual"].clone()}
    assert rel_err(launch(**inp), skinny_linear_ref(**ref_inp)) < 1e-2


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_cpu_linear_pads_two_and_three_rows_without_changing_results(rows):
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 64, generator=g), torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    y = linear(x, w, b)
    assert y.shape == (rows, 96)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@kernel
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("m", [1, 5])
def test_pair_matches_two_projections(monkeypatch, m, norm):
    """Two projections of one x in one launch (a Gated DeltaNet layer's [qkv | z] and [b | a]): each output equals
    its own reference, the second one's columns not a multiple of the block and far fewer than the first's."""
    from blockspec.kernels.skinny_linear import _skinny_pair_triton, skinny_linear_pair

    if INTERPRET:
        _interpreter_like_gpu(monkeypatch)
    g = torch.Generator().manual_seed(7)
    k, n1, n2 = 192, 320, 24
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(KERNEL_DEVICE)
    w1 = (torch.randn(n1, k, generator=g) * 0.05).to(torch.bfloat16).to(KERNEL_DEVICE)
    w2 = (torch.randn(n2, k, generator=g) * 0.05).to(torch.bfloat16).to(KERNEL_DEVICE)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(torch.bfloat16).to(KERNEL_DEVICE) if norm else None
    with torch.no_grad():
        y1, y2 = (skinny_linear_pair(x, w1, w2, norm_weight=nw, eps=1e-6) if KERNEL_DEVICE == "cuda"
                  else _skinny_pair_triton(x, w1, w2, nw, 1e-6))
    assert y1.shape == (m, n1) and y2.shape == (m, n2)
    assert rel_err(y1, skinny_linear_ref(x, w1, norm_weight=nw, eps=1e-6)) < 1e-2
    assert rel_err(y2, skinny_linear_ref(x, w2, norm_weight=nw, eps=1e-6)) < 1e-2


def test_pair_falls_back_to_two_references_on_cpu():
    from blockspec.kernels.skinny_linear import skinny_linear_pair

    x, w1, w2 = torch.randn(1, 32), torch.randn(48, 32), torch.randn(8, 32)
    nw = torch.rand(32) + 0.5
    y1, y2 = skinny_linear_pair(x, w1, w2, norm_weight=nw, eps=1e-6)
    torch.testing.assert_close(y1, skinny_linear_ref(x, w1, norm_weight=nw, eps=1e-6))
    torch.testing.assert_close(y2, skinny_linear_ref(x, w2, norm_weight=nw, eps=1e-6))


@kernel
@pytest.mark.parametrize("m", [1, 5])
def test_norm_out_is_the_norm_itself(monkeypatch, m):
    """An MoE block's router GEMM with its norm folded in also writes rms_norm(x) for the experts: equal to
    rms_norm_ref (the product too), from one launch."""
    from blockspec.kernels.rms_norm import rms_norm_ref
    from blockspec.kernels.skinny_linear import _skinny_linear_triton

    if INTERPRET:
        _interpreter_like_gpu(monkeypatch)
    g = torch.Generator().manual_seed(9)
    k, n = 320, 40
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(KERNEL_DEVICE)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16).to(KERNEL_DEVICE)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(torch.bfloat16).to(KERNEL_DEVICE)
    xn = torch.full_like(x, float("nan"))
    with torch.no_grad():
        y = (skinny_linear(x, w, norm_weight=nw, eps=1e-6, norm_out=xn) if KERNEL_DEVICE == "cuda"
             else _skinny_linear_triton(x, w, None, nw, 1e-6, False, None, xn))
    want = rms_norm_ref(x, nw, 1e-6)[0]
    assert rel_err(xn, want) < 1e-2 and torch.isfinite(xn).all()
    assert (xn != want).float().mean() < 0.01  # at most a last-bit difference from the variance's summation order
    assert rel_err(y, skinny_linear_ref(x, w, norm_weight=nw, eps=1e-6)) < 1e-2


def test_norm_out_on_the_reference_path():
    from blockspec.kernels.rms_norm import rms_norm_ref

    x, w, nw = torch.randn(3, 32), torch.randn(8, 32), torch.rand(32) + 0.5
    xn = torch.empty_like(x)
    y = skinny_linear(x, w, norm_weight=nw, eps=1e-6, norm_out=xn)
    torch.testing.assert_close(xn, rms_norm_ref(x, nw, 1e-6)[0])
    torch.testing.assert_close(y, skinny_linear_ref(x, w, norm_weight=nw, eps=1e-6))


def test_split_k_only_for_narrow_dot_launches():
    """The K split fills the SMs a very narrow weight's tiles leave idle (an MoE router at 16 rows), in whole BLOCK_K
    steps; one row and wider weights (measured slower split) keep one program a tile."""
    from blockspec.kernels.skinny_linear import split_k

    assert split_k(16, 128, 2048, 16, 256) == 8  # a router's 8 tiles, each split to one 256-column step
    assert split_k(16, 256, 2048, 16, 256) == 8  # 16 tiles
    assert split_k(16, 48, 1024, 16, 256) == 4
    assert split_k(1, 128, 2048, 16, 256) == 1
    assert split_k(16, 2048, 4096, 16, 256) == 1  # an o_proj's 128 tiles: measured slower split
    assert split_k(16, 6144, 4096, 32, 128) == 1
    assert split_k(16, 128, 96, 16, 128) == 1  # no whole step to split


@kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("m", [2, 16])
def test_split_k_matches_one_program_a_tile(monkeypatch, m, residual, dtype):
    """A tile's K over 4 programs, the last to arrive summing their float32 sums in split order: the reference's
    result (and the unsplit launch's to float32 rounding), the same on a second call, and the arrival counters
    back at zero for the next launch (a CUDA graph replays it)."""
    from blockspec.kernels.arrivals import _counters
    from blockspec.kernels.skinny_linear import _launch_config, _skinny_linear_triton, split_k

    if INTERPRET:
        _interpreter_like_gpu(monkeypatch)
    n, k = 48, 1024
    assert split_k(m, n, k, *_launch_config(m, n, k)[:2]) == 4
    inp = make_inputs(m, n, k, dtype, device=KERNEL_DEVICE, seed=11, bias=True, norm=False, gated=False,
                      residual=residual)
    res0 = inp["residual"].clone() if residual else None

    def run(split: int | None) -> torch.Tensor:
        res = res0.clone() if residual else None
        with torch.no_grad():
            return _skinny_linear_triton(inp["x"], inp["weight"], inp["bias"], None, 0.0, False, res, split=split)

    split, one = run(None), run(1)
    expected = skinny_linear_ref(inp["x"], inp["weight"], inp["bias"],
                                 residual=res0.clone() if residual else None)
    assert rel_err(split, expected) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert rel_err(split, one) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert torch.equal(run(None), split)
    assert not _counters[inp["x"].device].any()
    with pytest.raises(ValueError, match="whole 256-column steps"):
        run(8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_split_k_inside_a_graph_capture(monkeypatch):
    """The arrival counters outlive every graph: allocated by an eager launch, then captured and replayed (reset by
    each replay's last programs); a capture with none allocated yet takes the unsplit launch instead of allocating
    them from the graph's pool."""
    import blockspec.kernels.arrivals as arrivals
    import blockspec.kernels.skinny_linear as sl
    from blockspec.runner.decode_graphs import capture_graph

    monkeypatch.setattr(arrivals, "_counters", {})
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 2048, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(128, 2048, generator=g) * 0.02).to("cuda", torch.bfloat16)
    with torch.no_grad():
        one = sl._skinny_linear_triton(x, w, None, None, 0.0, False, None, split=1)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = sl._skinny_linear_triton(x, w, None, None, 0.0, False, None)
        graph.replay()
        assert not arrivals._counters and torch.equal(captured, one)
        eager = sl._skinny_linear_triton(x, w, None, None, 0.0, False, None)  # allocates the counters
        graph, out = capture_graph(lambda: sl._skinny_linear_triton(x, w, None, None, 0.0, False, None))
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager)
            assert not arrivals._counters[x.device].any()
    assert rel_err(eager, one) < 1e-2
