"""kernels/l2_prefetch.py: what a layer's prefetch reads, where it runs at all, and (GPU) that a captured step
with prefetches forked and joined replays to the same numbers."""

from __future__ import annotations

import pytest
import torch

from blockspec.kernels import l2_prefetch
from blockspec.models.layers.quant_linear import QuantLinear


def test_weight_tensors_of_a_plain_layer_is_its_weight() -> None:
    layer = torch.nn.Linear(64, 32, bias=True)
    assert [t.data_ptr() for t in l2_prefetch.weight_tensors(layer)] == [layer.weight.data_ptr()]


@pytest.mark.parametrize("scheme, group", [("int4", 32), ("nvfp4", 16), ("fp8", 0), ("int8", 32)])
def test_weight_tensors_of_a_quantized_layer_are_its_scales_then_its_weights(scheme: str, group: int) -> None:
    layer = QuantLinear(scheme, 64, 32, group, dtype=torch.bfloat16)
    got = l2_prefetch.weight_tensors(layer)
    assert got[-1] is layer.qweight
    if layer.scale_zero is not None:  # int4 with 16-bit scales: scales and zeros are views of the packed tensor
        assert scheme == "int4" and got[:-1] == [layer.scale_zero]
    else:
        want = [layer.scales] + ([layer.zeros] if layer.zeros is not None else [])
        assert [t.data_ptr() for t in got[:-1]] == [t.data_ptr() for t in want]


def test_budget_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLOCKSPEC_L2_PREFETCH_MB", "3")
    assert l2_prefetch.budget_bytes(torch.device("cpu")) == 3 << 20


def test_no_prefetch_off_the_gpu_or_outside_a_capture() -> None:
    layer = torch.nn.Linear(64, 32)
    x = torch.randn(1, 64)
    assert not l2_prefetch.available(x)
    before = dict(l2_prefetch._side)
    l2_prefetch.prefetch_ahead([layer], x)  # a no-op: no side stream is made
    assert l2_prefetch._side == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("enabled", ["1", "0"])
def test_captured_prefetches_replay_to_the_eager_numbers(enabled: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from blockspec.runner.decode_graphs import capture_graph

    monkeypatch.setenv("BLOCKSPEC_L2_PREFETCH", enabled)
    torch.manual_seed(0)
    a = QuantLinear("int4", 256, 512, 128, dtype=torch.bfloat16, device="cuda")
    b = torch.nn.Linear(512, 256, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)

    @torch.inference_mode()
    def step(x: torch.Tensor) -> torch.Tensor:
        y = a(x)
        l2_prefetch.prefetch_ahead([b, a], y)  # forks while the next op runs; capture_graph joins
        return b(torch.relu(y))

    want = step(x)
    graph, out = capture_graph(step, x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
