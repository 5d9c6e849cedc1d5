"""Online quantization (loader/quant/online.py): round-to-nearest into the QuantLinear layouts, and row views.

The oracle is the layouts' own definition (quant_linear.dequantize): every weight must come back as the nearest
value its group's scale can represent (within half a step), zero rows must stay exact, and quantizing the
dequantized weights again must give the same codes (rounding is idempotent).
"""

from __future__ import annotations

import pytest
import torch

import blockspec.loader.quant.online as online
from blockspec.errors import ConfigError
from blockspec.loader.quant.online import OnlineScheme, online_scheme, quantize_linear, quantize_weight
from blockspec.models.layers.linear import FusedLinear
from blockspec.models.layers.quant_linear import QuantLinear, unpack_nibbles

SCHEMES = [OnlineScheme("fp8", "fp8", 0), OnlineScheme("rtn", "int8", 32), OnlineScheme("rtn", "int8", 0),
           OnlineScheme("rtn", "int4", 32), OnlineScheme("rtn", "int4", 128), OnlineScheme("rtn", "int4", 0)]


def _weight(n: int = 48, k: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 0, n).unsqueeze(1)  # rows of very different scales
    w[5] = 0.0  # an all-zero row (and so all-zero groups)
    return w


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.scheme}g{s.group_size}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rounding_is_to_nearest_within_half_a_step(scheme, dtype):
    w = _weight().to(dtype)
    layer = quantize_weight(w, scheme, dtype)
    assert layer.scheme == scheme.scheme and layer.dtype == dtype
    back = layer.dequantize(torch.float32)
    err = (back - w.float()).abs()
    assert torch.equal(back[5], torch.zeros_like(back[5]))
    if scheme.scheme == "fp8":  # 3 mantissa bits: half a step is 2^-4 of the value, and the row's scale
        bound = w.float().abs() * 2.0**-4 + layer.scales.float() * 2.0**-9
    else:
        group = scheme.group_size or w.shape[1]
        bound = layer.scales.float().repeat_interleave(group, dim=1) / 2
    assert bool((err <= bound * (1 + 1e-3) + 1e-12).all())
    # absmax of each group is representable up to the scale's own rounding: symmetric ranges are used in full
    if scheme.scheme != "fp8":
        qmax = 7 if scheme.scheme == "int4" else 127
        codes = (unpack_nibbles(layer.qweight).int() - 8) if scheme.scheme == "int4" else layer.qweight.int()
        assert codes.abs().max() in (qmax, qmax + 1)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.scheme}g{s.group_size}")
def test_rounding_is_idempotent(scheme):
    layer = quantize_weight(_weight(), scheme, torch.float32)
    again = quantize_weight(layer.dequantize(torch.float32), scheme, torch.float32)
    assert torch.equal(again.qweight.view(torch.uint8), layer.qweight.view(torch.uint8))
    assert torch.allclose(again.scales.float(), layer.scales.float(), rtol=1e-6)


def test_large_weights_are_rounded_in_row_slices(monkeypatch):
    """An LM head is rounded a slice of rows at a time (no float32 copy of it whole): the same result."""
    w = _weight(n=64, k=128)
    whole = quantize_weight(w, OnlineScheme("rtn", "int4", 32), torch.bfloat16)
    monkeypatch.setattr(online, "SLICE_BYTES", 4 * 128 * 5)  # 5 rows a slice
    sliced = quantize_weight(w, OnlineScheme("rtn", "int4", 32), torch.bfloat16)
    assert torch.equal(sliced.qweight, whole.qweight) and torch.equal(sliced.scale_zero, whole.scale_zero)


def test_quantize_linear_keeps_shards_and_bias():
    fused = FusedLinear(64, [32, 16, 16], bias=True)
    torch.nn.init.normal_(fused.bias)
    layer = quantize_linear(fused, OnlineScheme("rtn", "int8", 32))
    assert isinstance(layer, QuantLinear) and layer.shard_sizes == [32, 16, 16]
    x = torch.randn(3, 64)
    assert torch.allclose(layer(x), fused(x), atol=0.02 * fused(x).abs().max().item())
    assert torch.equal(layer.bias, fused.bias)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.scheme}g{s.group_size}")
def test_row_slice_is_those_rows_sharing_storage(scheme):
    layer = quantize_weight(_weight(n=48), scheme, torch.bfloat16, bias=torch.randn(48))
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    view = layer.row_slice(16, 48)
    assert view.qweight.data_ptr() == layer.qweight[16].data_ptr()  # a view, no copy
    assert torch.equal(view.dequantize(), layer.dequantize()[16:48])
    assert torch.equal(view(x), layer(x)[:, 16:48])


def test_row_slice_of_fp8_blocks_only_on_block_boundaries():
    layer = QuantLinear("fp8", 256, 384, 128)
    assert layer.row_slice(128, 384) is not None and layer.row_slice(128, 300) is None
    assert torch.equal(layer.row_slice(128, 384).dequantize(), layer.dequantize()[128:])
    assert layer.row_slice(64, 128) is None


def test_online_scheme_from_names_and_environment(monkeypatch):
    assert online_scheme("fp8") == OnlineScheme("fp8", "fp8", 0)
    monkeypatch.delenv("RTN_NUM_BITS", raising=False)
    monkeypatch.delenv("RTN_GROUP_SIZE", raising=False)
    assert online_scheme("rtn") == OnlineScheme("rtn", "int8", 128)  # vLLM's defaults
    monkeypatch.setenv("RTN_NUM_BITS", "4")
    monkeypatch.setenv("RTN_GROUP_SIZE", "-1")
    assert online_scheme("RTN") == OnlineScheme("rtn", "int4", 0)
    monkeypatch.setenv("RTN_NUM_BITS", "3")
    with pytest.raises(ConfigError, match="RTN_NUM_BITS=3"):
        online_scheme("rtn")
    monkeypatch.setenv("RTN_NUM_BITS", "four")
    with pytest.raises(ConfigError, match="not an integer"):
        online_scheme("rtn")
    with pytest.raises(ConfigError, match="'awq' is not supported: use one of fp8, rtn"):
        online_scheme("awq")


def test_group_that_does_not_divide_the_row_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"fc \[8, 96\].*multiple of the group size 64.*RTN_GROUP_SIZE"):
        quantize_weight(torch.randn(8, 96), OnlineScheme("rtn", "int4", 64), torch.float32, "fc")


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.scheme}g{s.group_size}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_for_counts_what_the_layer_holds(scheme, dtype):
    from blockspec.models.layers.quant_linear import quantized_tensor_bytes

    layer = quantize_weight(_weight(n=48, k=256).to(dtype), scheme, dtype)
    elem = torch.tensor([], dtype=dtype).element_size()
    assert scheme.bytes_for(48, 256, elem) == quantized_tensor_bytes(layer)
