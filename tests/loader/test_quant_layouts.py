"""The in-memory quantized layouts (models/layers/quant_linear.py): packing, the dequantize definition of
each scheme written out by hand, the reference forward, the kernel dispatch point and the byte counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blockspec.loader.quant.bytes import quantized_weight_bytes
from blockspec.models.layers import quant_linear
from blockspec.models.layers.moe import experts_reference
from blockspec.models.layers.quant_linear import (
    QuantExperts,
    QuantLinear,
    dequantize,
    pack_nibbles,
    quantized_tensor_bytes,
    unpack_nibbles,
)

GEN = torch.Generator().manual_seed(0)
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_nibbles_even_element_low():
    assert pack_nibbles(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)).tolist() == [[0x21, 0x0F]]
    codes = torch.randint(0, 16, (5, 34), generator=GEN, dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)


def test_int4_definition():
    n, k, g = 6, 64, 32
    q = torch.randint(0, 16, (n, k), generator=GEN, dtype=torch.uint8)
    z = torch.randint(0, 16, (n, k // g), generator=GEN, dtype=torch.uint8)
    s = torch.rand(n, k // g, generator=GEN)
    want = torch.tensor([[(float(q[i, j]) - float(z[i, j // g])) * float(s[i, j // g]) for j in range(k)]
                         for i in range(n)])
    torch.testing.assert_close(dequantize("int4", pack_nibbles(q), s, z, None, g, torch.float32), want)


def test_int8_definition_with_and_without_zeros():
    q = torch.randint(-128, 128, (4, 64), generator=GEN, dtype=torch.int8)
    s = torch.rand(4, 2, generator=GEN)
    z = torch.randint(-5, 5, (4, 2), generator=GEN, dtype=torch.int8)
    cols = torch.arange(64) // 32
    torch.testing.assert_close(dequantize("int8", q, s, z, None, 32, torch.float32),
                               (q.float() - z.float()[:, cols]) * s[:, cols])
    torch.testing.assert_close(dequantize("int8", q, s, None, None, 32, torch.float32), q.float() * s[:, cols])


def test_fp8_per_channel_and_block_definitions():
    w = torch.randn(200, 300, generator=GEN).to(torch.float8_e4m3fn)
    rows = torch.rand(200, 1, generator=GEN)
    torch.testing.assert_close(dequantize("fp8", w, rows, None, None, 0, torch.float32), w.float() * rows)
    blocks = torch.rand(2, 3, generator=GEN)
    per_element = blocks[torch.arange(200)[:, None] // 128, torch.arange(300)[None, :] // 128]
    torch.testing.assert_close(dequantize("fp8", w, blocks, None, None, 128, torch.float32), w.float() * per_element)


def test_nvfp4_definition():
    codes = torch.randint(0, 16, (3, 32), generator=GEN, dtype=torch.uint8)
    scales = (torch.rand(3, 2, generator=GEN) * 4).to(torch.float8_e4m3fn)
    g = torch.tensor(0.37)
    want = torch.tensor([[E2M1[int(codes[i, j])] * float(scales[i, j // 16]) * 0.37 for j in range(32)]
                         for i in range(3)])
    torch.testing.assert_close(dequantize("nvfp4", pack_nibbles(codes), scales, None, g, 16, torch.float32), want)


@pytest.mark.parametrize("scheme,group", [("int4", 32), ("int8", 64), ("fp8", 0), ("fp8", 128), ("nvfp4", 16)])
def test_reference_forward_is_dequantize_then_linear(scheme, group):
    layer = QuantLinear(scheme, 128, 48, group, bias=True, symmetric=False)
    layer.bias.normal_(generator=GEN)
    x = torch.randn(3, 128, generator=GEN)
    assert not hasattr(layer, "weight")
    torch.testing.assert_close(layer(x), F.linear(x, layer.dequantize(torch.float32), layer.bias))
    assert quantized_tensor_bytes(layer) == quantized_weight_bytes(scheme, 48, 128, group, False, 4)


def test_act_order_permutes_the_input():
    layer = QuantLinear("int4", 64, 8, 32)
    layer.perm = torch.randperm(64, generator=GEN)
    x = torch.randn(2, 64, generator=GEN)
    torch.testing.assert_close(layer(x), x[:, layer.perm] @ layer.dequantize(torch.float32).T)


def test_triton_dispatch_point(monkeypatch):
    """On a GPU the layer hands itself to kernels.quant_linear.quant_linear(x, layer); the reference otherwise."""
    calls = []
    monkeypatch.setattr(quant_linear, "use_triton", lambda x: True)
    monkeypatch.setattr(quant_linear, "_triton_quant_linear", lambda: lambda x, layer: calls.append(layer) or x)
    layer = QuantLinear("nvfp4", 32, 8, 16)
    x = torch.randn(1, 32)
    assert layer(x) is x and calls == [layer]
    monkeypatch.setattr(quant_linear, "_triton_quant_linear", lambda: None)  # no kernel module yet
    torch.testing.assert_close(layer(x), layer.reference(x))


def test_quantized_experts_equal_the_reference_on_dequantized_stacks():
    experts = QuantExperts("int4", 4, 64, 32, 32, 32, symmetric=True)
    x = torch.randn(7, 64, generator=GEN)
    ids = torch.randint(0, 4, (7, 2), generator=GEN)
    weights = torch.rand(7, 2, generator=GEN)
    gate_up, down = experts.dequantize(torch.float32)
    assert gate_up.shape == (4, 64, 64) and down.shape == (4, 64, 32)
    torch.testing.assert_close(experts(x, weights, ids), experts_reference(x, gate_up, down, weights, ids))


def test_byte_counts():
    # int4: 16-bit scales and uint8 zeros held (and read) as one int32 a group; float32 scales apart
    assert quantized_weight_bytes("int4", 4096, 4096, 128, True, 2) == 4096 * 2048 + 4096 * 32 * 4
    assert quantized_weight_bytes("int4", 4096, 4096, 128, True, 4) == 4096 * 2048 + 4096 * 32 * 5
    assert quantized_weight_bytes("nvfp4", 4096, 4096, 16, True, 2) == 4096 * 2048 + 4096 * 256 + 4
    assert quantized_weight_bytes("fp8", 4096, 4096, 0, True, 2) == 4096 * 4096 + 4096 * 4
    assert quantized_weight_bytes("fp8", 300, 300, 128, True, 2) == 300 * 300 + 9 * 4
    assert quantized_weight_bytes("int8", 64, 64, 32, False, 2) == 64 * 64 + 128 * 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_scales_and_zeros_are_views_of_one_packed_buffer(dtype):
    """int4 with 16-bit scales holds scale|zero as one int32 a group (what the kernels read), registered as a
    non-persistent buffer; scales / zeros are views of it, so writing them (as the loader does) fills it."""
    from blockspec.kernels.quant_linear import packed_scale_zero

    layer = QuantLinear("int4", 128, 48, 32, symmetric=False, dtype=dtype)
    assert "scale_zero" in dict(layer.named_buffers()) and "scale_zero" not in layer.state_dict()
    assert layer.scale_zero.dtype == torch.int32 and layer.scale_zero.shape == (48, 4)
    scales = torch.rand(48, 4, generator=GEN).to(dtype) + 0.1
    zeros = torch.randint(0, 17, (48, 4), generator=GEN, dtype=torch.uint8)
    layer.scales.copy_(scales)
    layer.zeros[:5].copy_(zeros[:5])  # row slices, as the loader fills fused shards
    layer.zeros[5:].copy_(zeros[5:])
    assert torch.equal(layer.scale_zero, packed_scale_zero(scales, zeros))
    assert torch.equal(layer.scales, scales) and torch.equal(layer.zeros, zeros)
    assert layer.scales.untyped_storage().data_ptr() == layer.scale_zero.untyped_storage().data_ptr()
    # held once: packed weights + 4 bytes a group, the figure `plan` counts
    assert quantized_tensor_bytes(layer) == 48 * 64 + 48 * 4 * 4 == quantized_weight_bytes("int4", 48, 128, 32,
                                                                                             False, 2)
    x = torch.randn(3, 128, generator=GEN).to(dtype)
    torch.testing.assert_close(layer(x), F.linear(x, dequantize("int4", layer.qweight, scales, zeros, None, 32, dtype)))
    with pytest.raises(AttributeError, match="view of its scale_zero"):
        layer.scales = scales


def test_packed_int4_buffer_follows_to():
    """.to() moves the packed tensor once and re-makes the views; float32 scales unpack, 16-bit ones re-pack."""
    from blockspec.kernels.quant_linear import packed_scale_zero

    layer = QuantLinear("int4", 64, 16, 32, symmetric=False, dtype=torch.bfloat16)
    layer.scales.copy_(torch.rand(16, 2, generator=GEN) + 0.1)
    layer.zeros.copy_(torch.randint(0, 16, (16, 2), generator=GEN))
    want = layer.dequantize(torch.float32)
    layer.float()
    assert layer.scale_zero is None and layer.scales.dtype == torch.float32 and layer.scales.is_contiguous()
    assert torch.equal(layer.dequantize(torch.float32), want)
    layer.bfloat16()
    assert torch.equal(layer.scale_zero, packed_scale_zero(layer.scales, layer.zeros))
    assert torch.equal(layer.dequantize(torch.float32), want)
    layer.to("cpu")
    assert layer.scales.untyped_storage().data_ptr() == layer.scale_zero.untyped_storage().data_ptr()


def test_int4_experts_hold_one_packed_stack():
    experts = QuantExperts("int4", 4, 64, 32, 32, 32, symmetric=False, dtype=torch.bfloat16)
    for holder, shape in ((experts.gate_up_proj, (4, 64, 2)), (experts.down_proj, (4, 64, 1))):
        assert holder.scale_zero.shape == shape and holder.scales.shape == shape
    held = quantized_tensor_bytes(experts)
    assert held == 4 * (quantized_weight_bytes("int4", 64, 64, 32, False, 2)
                        + quantized_weight_bytes("int4", 64, 32, 32, False, 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme,group", [("nvfp4", 16), ("int4", 128), ("fp8", 128), ("int8", 128)])
def test_dummy_weights_are_made_on_the_device_without_large_temporaries(scheme, group):
    """--load-format dummy builds quantized experts directly in their packed layouts on the device: the peak
    while making a 122B-sized stack (64 of its 256 experts) stays within the bytes held + one fp8 slice."""
    from blockspec.models.layers.quant_linear import DUMMY_SLICE_BYTES

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    experts = QuantExperts(scheme, 64, 3072, 1024, group, group, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    held = quantized_tensor_bytes(experts)
    assert 0 <= torch.cuda.memory_allocated() - base - held < 1 << 20  # the allocator rounds to 512 bytes
    assert torch.cuda.max_memory_allocated() - base <= held + DUMMY_SLICE_BYTES + (2 << 20)
