"""Checkpoint tensors of each quantized format -> pieces of our in-memory layouts, one tensor at a time.

`convert` takes one stored tensor of one projection (already on the target device) and returns which
piece of the layout it is (qweight, scales, zeros, global, g_idx, bias) in our layout for that
projection's rows: models/layers/quant_linear.py defines the layouts. The stored layouts, from the
formats' definitions:

- compressed-tensors pack-quantized: `weight_packed` int32 [N, ceil(K*b/32)], value + 2^(b-1) packed
  densely from bit 0 of word 0 (little-endian bytes, so element 2i is the low nibble of byte i);
  `weight_zero_point` packed the same way along N; `weight_scale` [N, K/G]; `weight_g_idx` [K].
- compressed-tensors nvfp4-pack-quantized: `weight_packed` uint8 [N, K/2] E2M1 (even element low);
  `weight_scale` fp8 [N, K/16]; `weight_global_scale` [1] *divides* (w = e2m1 * scale / global).
- compressed-tensors float-/int-quantized: `weight` fp8 / int8 [N, K]; `weight_scale` [1], [N, 1] or
  [ceil(N/128), ceil(K/128)].
- ModelOpt: NVFP4 `weight` uint8 [N, K/2], `weight_scale` fp8 [N, K/16], `weight_scale_2` scalar that
  *multiplies*; FP8 `weight` fp8 with `weight_scale` scalar, [N] or [N/128, 1, K/128, 1].
- fp8 (transformers FineGrainedFP8): `weight` fp8 and `weight_scale_inv` [ceil(N/128), ceil(K/128)],
  which multiplies despite its name (or a per-tensor `weight_scale`).
- GPTQ: `qweight` int32 [K*b/32, N] packed along K from bit 0; `qzeros` int32 [K/G, N*b/32] packed
  along N; `scales` [K/G, N]; `g_idx` [K]; v1 checkpoints store zero - 1.
- AWQ (gemm): `qweight` int32 [K, N/8] and `qzeros` [K/G, N/8] packed along N in the nibble order
  0 2 4 6 1 3 5 7; `scales` [K/G, N]; zeros stored as they are.
- MXFP4 (GPT-OSS, one tensor per expert stack, `convert_stacked`): `{proj}_blocks` uint8
  [E, N, K/32, 16], each group of 32 inputs as 16 bytes of E2M1 codes (even element in the low nibble);
  `{proj}_scales` uint8 [E, N, K/32] of E8M0 exponents. Our layout holds the same bytes as [E, N, K/2].
"""

from __future__ import annotations

import math

import torch

from blockspec.errors import ConfigError
from blockspec.loader.quant.config import LayerScheme
from blockspec.models.layers.quant_linear import FP8_BLOCK, pack_nibbles, unpack_nibbles

# Tensors a quantized projection may carry that hold nothing for weight-only inference.
IGNORED = {"input_scale", "input_global_scale", "input_zero_point", "output_scale", "output_zero_point",
           "weight_shape", "k_scale", "v_scale"}
# Pieces each source must provide for every projection, by checkpoint suffix (for the error messages).
REQUIRED = {
    "ct-pack": {"qweight": "weight_packed", "scales": "weight_scale"},
    "ct-int": {"qweight": "weight", "scales": "weight_scale"},
    "ct-float": {"qweight": "weight", "scales": "weight_scale"},
    "ct-nvfp4": {"qweight": "weight_packed", "scales": "weight_scale", "global": "weight_global_scale"},
    "modelopt-nvfp4": {"qweight": "weight", "scales": "weight_scale", "global": "weight_scale_2"},
    "modelopt-fp8": {"qweight": "weight", "scales": "weight_scale"},
    "hf-fp8": {"qweight": "weight", "scales": "weight_scale_inv"},
    "gptq": {"qweight": "qweight", "scales": "scales", "zeros": "qzeros"},
    "awq": {"qweight": "qweight", "scales": "scales", "zeros": "qzeros"},
    "mxfp4": {"qweight": "blocks", "scales": "scales"},
}
# Sources that store each expert stack as one tensor per piece, named `{proj}_{suffix}`.
STACKED = ("mxfp4",)
ZERO_SUFFIX = {"ct-pack": "weight_zero_point", "ct-int": "weight_zero_point"}
AWQ_ORDER_INVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # natural column c sits at nibble AWQ_ORDER_INVERSE[c] of a word


def required_pieces(ls: LayerScheme) -> dict[str, str]:
    """{piece: checkpoint suffix} every projection of this scheme must load."""
    pieces = dict(REQUIRED[ls.source])
    if ls.source == "hf-fp8" and not ls.group_size:
        pieces["scales"] = "weight_scale"
    if not ls.symmetric and ls.source in ZERO_SUFFIX:
        pieces["zeros"] = ZERO_SUFFIX[ls.source]
    return pieces


def payload_suffix(ls: LayerScheme) -> str:
    return REQUIRED[ls.source]["qweight"]


def scale_suffixes(ls: LayerScheme) -> tuple[str, ...]:
    """Suffixes any of which provides the scales (hf-fp8 names them by granularity)."""
    return ("weight_scale_inv", "weight_scale") if ls.source == "hf-fp8" else (REQUIRED[ls.source]["scales"],)


def _fail(name: str, what: str) -> None:
    raise ConfigError(f"checkpoint tensor {name} {what}: the checkpoint does not match its quantization config "
                      "(re-export it, or check config.json's quantization_config)")


def _expect(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...] | None = None) -> None:
    if t.dtype not in dtypes:
        _fail(name, f"is {str(t.dtype).removeprefix('torch.')}, expected "
                    f"{' or '.join(str(d).removeprefix('torch.') for d in dtypes)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        _fail(name, f"has shape {tuple(t.shape)}, expected {tuple(shape)}")


def _words_to_bytes(t: torch.Tensor) -> torch.Tensor:
    """int32 words -> their little-endian bytes (element i of a packed row is bits 4i.. / 8i..)."""
    flat = t.contiguous().reshape(-1)  # 1-D first: a size-1 dim can leave a "contiguous" tensor with odd strides
    return flat.view(torch.uint8).reshape(*t.shape[:-1], t.shape[-1] * 4)


def _signed8(u: torch.Tensor) -> torch.Tensor:
    """Unsigned 8-bit values stored with a +128 offset -> int8."""
    return (u ^ 0x80).view(torch.int8)


def _groups(k: int, group: int) -> int:
    return k // group if group else 1


def _scales(name: str, t: torch.Tensor, n: int, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-group scales [n, groups] (a per-tensor scalar expanded to every row) in `dtype`."""
    if t.numel() == 1:
        return t.reshape(1, 1).to(dtype).expand(n, groups).contiguous()
    if t.dim() == 1 and t.shape[0] == n and groups == 1:
        t = t[:, None]
    _expect(name, t, (torch.float32, torch.float16, torch.bfloat16), (n, groups))
    return t.to(dtype)


def _fp8_scales(name: str, t: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    """float32 [n, 1] per channel (per-tensor expanded) or [ceil(n/128), ceil(k/128)] blocks."""
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        _fail(name, f"is {t.dtype}, expected a float scale")
    t = t.float()
    if not block:
        if t.numel() == 1:
            return t.reshape(1, 1).expand(n, 1).contiguous()
        return t.reshape(-1, 1) if t.numel() == n else _fail(name, f"has shape {tuple(t.shape)}, expected "
                                                                   f"one scale or {n}")
    want = (math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK))
    if t.dim() == 4:  # ModelOpt FP8_PB_WO: [out_blocks, 1, in_blocks, 1]
        t = t[:, 0, :, 0]
    _expect(name, t, (torch.float32,), want)
    return t


def _int4_rows(name: str, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """compressed-tensors' int32 rows -> uint8 [n, k/2] (unsigned nibbles, k even low)."""
    _expect(name, packed, (torch.int32,), (n, math.ceil(k * 4 / 32)))
    return _words_to_bytes(packed)[:, : k // 2]


def _ct_zero_points(name: str, t: torch.Tensor, n: int, groups: int, bits: int) -> torch.Tensor:
    if t.dtype == torch.int32:  # packed along the output dim
        _expect(name, t, (torch.int32,), (math.ceil(n * bits / 32), groups))
        rows = _words_to_bytes(t.t())  # [groups, bytes]
        if bits == 4:
            return unpack_nibbles(rows)[:, :n].t().contiguous()
        return _signed8(rows[:, :n].t().contiguous())
    _expect(name, t, (torch.int8, torch.int32, torch.float32, torch.bfloat16, torch.float16), (n, groups))
    z = t.to(torch.int16)  # signed zero points
    return (z + 8).to(torch.uint8) if bits == 4 else z.to(torch.int8)


def _gptq_weight(name: str, t: torch.Tensor, n: int, k: int, bits: int) -> torch.Tensor:
    _expect(name, t, (torch.int32,), (k * bits // 32, n))
    rows = _words_to_bytes(t.t())  # [n, k*bits/8]: the same bit order, one row per output channel
    return rows if bits == 4 else _signed8(rows)


def _gptq_zeros(name: str, t: torch.Tensor, n: int, groups: int, bits: int, v1: bool) -> torch.Tensor:
    _expect(name, t, (torch.int32,), (groups, math.ceil(n * bits / 32)))
    rows = _words_to_bytes(t)
    z = (unpack_nibbles(rows) if bits == 4 else rows)[:, :n].t().to(torch.int16) + (1 if v1 else 0)
    return z.to(torch.uint8).contiguous() if bits == 4 else (z - 128).clamp(-128, 127).to(torch.int8).contiguous()


def _awq_unpack(name: str, t: torch.Tensor, rows: int, n: int) -> torch.Tensor:
    """AWQ int32 [rows, n/8] -> uint8 [rows, n] in natural column order."""
    _expect(name, t, (torch.int32,), (rows, n // 8))
    nibbles = unpack_nibbles(_words_to_bytes(t)).view(rows, n // 8, 8)
    order = torch.tensor(AWQ_ORDER_INVERSE, device=t.device)
    return nibbles.index_select(-1, order).reshape(rows, n)


def stored_name(ls: LayerScheme, module: str, suffix: str) -> str:
    """The checkpoint name of one piece of a projection (`module.suffix`, or `module_suffix` when stacked)."""
    return f"{module}_{suffix}" if ls.source in STACKED else f"{module}.{suffix}"


def convert_stacked(ls: LayerScheme, name: str, suffix: str, t: torch.Tensor, e: int, n: int,
                    k: int) -> tuple[str, torch.Tensor]:
    """One stored tensor of a whole expert stack ([e, n, k] logically) -> (piece, tensor in our layout)."""
    if ls.source == "mxfp4" and suffix == "blocks":
        _expect(name, t, (torch.uint8,), (e, n, k // 32, 16))
        return "qweight", t.reshape(e, n, k // 2)
    if ls.source == "mxfp4" and suffix == "scales":
        _expect(name, t, (torch.uint8,), (e, n, k // 32))
        return "scales", t
    _fail(name, f"is not part of the {ls.source} layout as blockspec reads it (expected "
                f"{', '.join(required_pieces(ls).values())})")
    raise AssertionError  # unreachable


def convert(ls: LayerScheme, name: str, suffix: str, t: torch.Tensor, n: int, k: int, group: int,
            dtype: torch.dtype) -> tuple[str, torch.Tensor] | None:
    """One stored tensor (`name` = module + '.' + suffix) of an [n, k] projection -> (piece, tensor).

    `group` is the layer's resolved group size (K for per-channel int scales). None: nothing to keep.
    """
    src, groups = ls.source, _groups(k, group)
    if suffix in IGNORED:
        return None
    if suffix == "bias":
        return "bias", t.to(dtype)
    if src == "ct-pack":
        bits = 4 if ls.scheme == "int4" else 8
        if suffix == "weight_packed":
            if bits == 4:
                return "qweight", _int4_rows(name, t, n, k)
            _expect(name, t, (torch.int32,), (n, math.ceil(k / 4)))
            return "qweight", _signed8(_words_to_bytes(t)[:, :k].contiguous())
        if suffix == "weight_scale":
            return "scales", _scales(name, t, n, groups, dtype)
        if suffix == "weight_zero_point":
            return "zeros", _ct_zero_points(name, t, n, groups, bits)
        if suffix == "weight_g_idx":
            return "g_idx", t
    elif src == "ct-int":
        if suffix == "weight":
            _expect(name, t, (torch.int8,), (n, k))
            return "qweight", t
        if suffix == "weight_scale":
            return "scales", _scales(name, t, n, groups, dtype)
        if suffix == "weight_zero_point":
            return "zeros", _ct_zero_points(name, t, n, groups, 8)
    elif src in ("ct-float", "modelopt-fp8", "hf-fp8"):
        if suffix == "weight":
            _expect(name, t, (torch.float8_e4m3fn,), (n, k))
            return "qweight", t
        if suffix in ("weight_scale", "weight_scale_inv"):
            return "scales", _fp8_scales(name, t, n, k, ls.group_size)
    elif src in ("ct-nvfp4", "modelopt-nvfp4"):
        if suffix == ("weight_packed" if src == "ct-nvfp4" else "weight"):
            _expect(name, t, (torch.uint8,), (n, k // 2))
            return "qweight", t
        if suffix == "weight_scale":
            _expect(name, t, (torch.float8_e4m3fn,), (n, k // 16))
            return "scales", t
        if suffix == "weight_global_scale" and src == "ct-nvfp4":
            _expect(name, t, (torch.float32,))
            return "global", (1.0 / t.reshape(-1)[0]).reshape(())  # compressed-tensors divides by it
        if suffix == "weight_scale_2" and src == "modelopt-nvfp4":
            _expect(name, t, (torch.float32,))
            return "global", t.reshape(-1)[0].reshape(())
    elif src == "gptq":
        bits = 4 if ls.scheme == "int4" else 8
        if suffix == "qweight":
            return "qweight", _gptq_weight(name, t, n, k, bits)
        if suffix == "qzeros":
            return "zeros", _gptq_zeros(name, t, n, groups, bits, ls.gptq_v1)
        if suffix == "scales":
            _expect(name, t, (torch.float16, torch.bfloat16, torch.float32), (groups, n))
            return "scales", t.t().to(dtype).contiguous()
        if suffix == "g_idx":
            return "g_idx", t
    elif src == "awq":
        if suffix == "qweight":
            return "qweight", pack_nibbles(_awq_unpack(name, t, k, n).t())
        if suffix == "qzeros":
            return "zeros", _awq_unpack(name, t, groups, n).t().contiguous()
        if suffix == "scales":
            _expect(name, t, (torch.float16, torch.bfloat16, torch.float32), (groups, n))
            return "scales", t.t().to(dtype).contiguous()
    _fail(name, f"is not part of the {ls.source} layout as blockspec reads it (expected "
                f"{', '.join(required_pieces(ls).values())})")
    return None
