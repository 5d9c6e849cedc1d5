"""Quantized linear layers: one packed in-memory layout per scheme, and the dequantize reference.

Every checkpoint format (compressed-tensors, ModelOpt, GPTQ, AWQ, AutoRound, MXFP4) is converted at load
time (blockspec/loader/quant/) into one of five layouts, so the kernels know exactly these (the linear
kernels are meant for the first four, SCHEMES; the grouped MoE kernels also read "mxfp4", GPT-OSS's experts;
the per-scheme register tiles of both are in kernels/quant_tiles.py). A weight of logical shape [N, K]
(out, in):

- "int4":  qweight uint8 [N, K/2], two unsigned nibbles per byte, element k even in the LOW nibble;
           scales [N, K/G] model dtype; zeros uint8 [N, K/G] (unsigned; symmetric formats store 8; a
           GPTQ v1 checkpoint whose zero point was 0 stores 16, its off-by-one kept as the format defines
           it); w[n, k] = (q[n, k] - zeros[n, k // G]) * scales[n, k // G]. With bf16 / fp16 scales both
           live in one int32 a group, `scale_zero` (scale bits | zero << 16: what the kernels read, one
           4-byte load a group), and `scales` / `zeros` are strided views into it (see _QuantTensors).
- "int8":  qweight int8 [N, K]; scales [N, K/G] model dtype; zeros int8 [N, K/G] or None; w = (q - z) * s.
- "fp8":   qweight float8_e4m3fn [N, K]; scales float32 [N, 1] (per channel, group_size 0; per-tensor
           scales are expanded to it) or [ceil(N/128), ceil(K/128)] (128x128 blocks, group_size 128);
           w = qweight.float() * scale, broadcast per row or per block.
- "nvfp4": qweight uint8 [N, K/2] of E2M1 codes (bits s e1 e0 m; element k even in the LOW nibble);
           scales float8_e4m3fn [N, K/16]; global_scale float32 scalar; w = e2m1 * scales.float() * global.
- "mxfp4": qweight uint8 [N, K/2] of E2M1 codes (as nvfp4); scales uint8 [N, K/32] of E8M0 exponents
           (a power of two per 32 elements, bias 127); w = e2m1 * 2 ** (scales - 127). GPT-OSS experts'
           `*_blocks` [.., N, K/32, 16] are these bytes, `*_scales` these scales (OCP MX format).

Stacked MoE experts (`QuantExpertWeights`) hold the same tensors with a leading [E] dim (global_scale
[E]). `perm` (int64 [K], or None): GPTQ act-order checkpoints are permuted at load so that group k // G
holds column k; the layer then computes x[..., perm] @ W.T. `QuantLinear` has no `.weight`: code that
reads a projection's weight directly must check `isinstance(proj, QuantLinear)` and call the module.
"""

from __future__ import annotations

import functools
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.device import cuda_capability
from blockspec.errors import ConfigError
from blockspec.kernels._triton import use_triton
from blockspec.kernels.activation import silu_mul
from blockspec.kernels.lane_order import restore_columns
from blockspec.kernels.skinny_linear import linear
from blockspec.models.layers.moe import BACKENDS, SILU, GatedActivation, experts_fused, experts_loop, fused_applies

SCHEMES = ("int4", "int8", "fp8", "nvfp4")  # the layouts the Triton linear kernels read (kernels/quant_linear.py)
LAYOUTS = (*SCHEMES, "mxfp4")  # every layout; mxfp4 (GPT-OSS experts): the dequantize reference and the MoE kernels
NVFP4_GROUP = 16
MXFP4_GROUP = 32
E8M0_BIAS = 127
FP8_BLOCK = 128
# E2M1 magnitudes by the 3 low bits of a code; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_TABLES: dict[torch.device, torch.Tensor] = {}
DUMMY_SLICE_BYTES = 64 << 20  # the largest temporary init_dummy makes (random fp8 weights, in float32 slices)


# ---- packing helpers (shared with the loader's format converters) ---------------------------------

def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 [..., K]: element 2i from the low nibble of byte i, 2i + 1 from the high."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K] (each < 16) -> uint8 [..., K/2], the inverse of unpack_nibbles."""
    v = values.to(torch.uint8)
    return (v[..., 0::2] | (v[..., 1::2] << 4)).contiguous()


def e2m1_table(device: torch.device) -> torch.Tensor:
    """The 16 E2M1 code values as float32 (codes 8..15 are the negatives of 0..7)."""
    table = _E2M1_TABLES.get(device)
    if table is None:
        pos = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        table = torch.cat([pos, -pos]).to(device)
        _E2M1_TABLES[device] = table
    return table


def _per_group(t: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """[..., K/G] -> [..., K]: each group's value repeated over its G columns."""
    return t.repeat_interleave(group, dim=-1)[..., :k]


def dequantize(scheme: str, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               global_scale: torch.Tensor | None, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The definition of every layout: [..., N, K] weights in `dtype` (computed in float32, rounded once)."""
    if scheme == "int4":
        q = unpack_nibbles(qweight).float()
        k = q.shape[-1]
        w = (q - _per_group(zeros.float(), group_size, k)) * _per_group(scales.float(), group_size, k)
    elif scheme == "int8":
        q = qweight.float()
        k = q.shape[-1]
        if zeros is not None:
            q = q - _per_group(zeros.float(), group_size, k)
        w = q * _per_group(scales.float(), group_size, k)
    elif scheme == "fp8":
        w = qweight.float()
        n, k = w.shape[-2:]
        s = scales.float()
        if group_size:  # 128x128 blocks
            s = s.repeat_interleave(FP8_BLOCK, dim=-2)[..., :n, :].repeat_interleave(FP8_BLOCK, dim=-1)[..., :k]
        w = w * s
    elif scheme == "nvfp4":
        codes = unpack_nibbles(qweight).long()
        e2m1 = e2m1_table(qweight.device)[codes]
        k = e2m1.shape[-1]
        w = e2m1 * _per_group(scales.float(), NVFP4_GROUP, k)
        g = global_scale.float()
        w = w * (g.reshape(*g.shape, 1, 1) if g.dim() else g)
    elif scheme == "mxfp4":
        e2m1 = e2m1_table(qweight.device)[unpack_nibbles(qweight).long()]
        w = torch.ldexp(e2m1, _per_group(scales.int() - E8M0_BIAS, MXFP4_GROUP, e2m1.shape[-1]))
    else:
        raise ValueError(f"unknown quantization scheme {scheme!r}")
    return w.to(dtype)


def layout_shapes(scheme: str, n: int, k: int, group_size: int, symmetric: bool
                  ) -> dict[str, tuple[tuple[int, ...], torch.dtype | None] | None]:
    """Shapes and dtypes (None: the model dtype) of each tensor of a layout; None for absent tensors."""
    if scheme == "int4":
        return {"qweight": ((n, k // 2), torch.uint8), "scales": ((n, k // group_size), None),
                "zeros": ((n, k // group_size), torch.uint8), "global_scale": None}
    if scheme == "int8":
        return {"qweight": ((n, k), torch.int8), "scales": ((n, k // group_size), None),
                "zeros": None if symmetric else ((n, k // group_size), torch.int8), "global_scale": None}
    if scheme == "fp8":
        scale = (n, 1) if not group_size else (math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK))
        return {"qweight": ((n, k), torch.float8_e4m3fn), "scales": (scale, torch.float32), "zeros": None,
                "global_scale": None}
    if scheme == "nvfp4":
        return {"qweight": ((n, k // 2), torch.uint8), "scales": ((n, k // NVFP4_GROUP), torch.float8_e4m3fn),
                "zeros": None, "global_scale": ((), torch.float32)}
    if scheme == "mxfp4":
        return {"qweight": ((n, k // 2), torch.uint8), "scales": ((n, k // MXFP4_GROUP), torch.uint8),
                "zeros": None, "global_scale": None}
    raise ValueError(f"unknown quantization scheme {scheme!r}")


def packs_scale_zero(scheme: str, dtype: torch.dtype) -> bool:
    """Whether a layout holds its scales and zeros as one int32 a group (`scale_zero`): int4 with 16-bit
    scales, the only int4 the kernels' packed load reads (float32 scales do not fit 16 bits)."""
    return scheme == "int4" and dtype in (torch.bfloat16, torch.float16)


def check_shape(scheme: str, n: int, k: int, group_size: int) -> str | None:
    """Why [N, K] cannot take this layout (None when it can)."""
    if scheme in ("int4", "nvfp4", "mxfp4") and k % 2:
        return f"in_features {k} is odd (two 4-bit values per byte)"
    if scheme in ("int4", "int8") and (group_size <= 0 or k % group_size):
        return f"in_features {k} is not a multiple of the group size {group_size}"
    if scheme == "nvfp4" and k % NVFP4_GROUP:
        return f"in_features {k} is not a multiple of {NVFP4_GROUP}"
    if scheme == "mxfp4" and k % MXFP4_GROUP:
        return f"in_features {k} is not a multiple of {MXFP4_GROUP}"
    if scheme == "fp8" and group_size not in (0, FP8_BLOCK):
        return f"fp8 scales are per channel or per {FP8_BLOCK}x{FP8_BLOCK} block, not group size {group_size}"
    return None


class _QuantTensors(nn.Module):
    """The buffers of one layout (optionally with leading dims), filled shard by shard by the loader."""

    def __init__(self, scheme: str, out_features: int, in_features: int, group_size: int, symmetric: bool,
                 shard_sizes: list[int] | None, leading: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        super().__init__()
        if scheme not in LAYOUTS:
            raise ValueError(f"unknown quantization scheme {scheme!r}")
        problem = check_shape(scheme, out_features, in_features, group_size)
        if problem:
            raise ValueError(problem)
        self.scheme = scheme
        self.out_features, self.in_features = out_features, in_features
        self.group_size = group_size
        self.symmetric = symmetric
        self.shard_sizes = list(shard_sizes) if shard_sizes else [out_features]
        self.dtype = dtype  # the model dtype (scales of int layouts, dequantized output by default)
        packed = packs_scale_zero(scheme, dtype)
        for name, spec in layout_shapes(scheme, out_features, in_features, group_size, symmetric).items():
            if spec is None:
                self.register_buffer(name, None)
                continue
            shape, tdtype = spec
            if packed and name == "scales":  # scale_zero holds them; scales / zeros are set as views below
                self.register_buffer("scale_zero", torch.zeros((*leading, *shape), dtype=torch.int32, device=device),
                                     persistent=False)
            if not (packed and name in ("scales", "zeros")):
                self.register_buffer(name, torch.empty((*leading, *shape), dtype=tdtype or dtype, device=device))
        if packed:
            self._alias_scale_zero(dtype)
        else:
            self.register_buffer("scale_zero", None, persistent=False)
        self.register_buffer("perm", None)  # act-order input permutation (int64 [K]), set by the loader
        self.lane_order = False  # NVFP4 bytes in the mma kernels' lane order (kernels/lane_order.py), set at load
        self.init_dummy()

    # ---- int4 with 16-bit scales: one packed tensor, scales and zeros as views of it ----------------------
    # Why not the scales and zeros plus a packed copy: the kernels read only the packed int32 (one 4-byte load
    # a group, wide enough for cp.async), so separate scales (2 bytes) and zeros (1) would be 3 bytes a group
    # that no GPU pass reads, ~190 MB on an 8B int4 g128 model: memory a Thor-class box cannot spare. And not
    # built later from them (on the first GEMM, as before): then it was outside `plan` and the start-up report,
    # built during CUDA-graph warm-up, and briefly held beside them. As the storage itself it is allocated with
    # the layer, filled by the loader through the views (copy_ into `scales` writes the low 16 bits of each
    # int32, into `zeros` its third byte; the fourth stays 0), moves with .to() and is counted once; the
    # reference path, dequantize and the loader read and write `scales` / `zeros` exactly as before.

    def _alias_scale_zero(self, dtype: torch.dtype) -> None:
        """scales / zeros as views of scale_zero: the low int16 of each int32 as `dtype`, its third byte."""
        if sys.byteorder != "little":
            raise RuntimeError("the packed int4 scale|zero layout assumes a little-endian host")
        packed = self.scale_zero
        self._buffers["scales"] = packed.view(dtype)[..., 0::2]
        self._buffers["zeros"] = packed.view(torch.uint8)[..., 2::4]

    def __setattr__(self, name: str, value) -> None:
        if name in ("scales", "zeros") and self.__dict__.get("_buffers", {}).get("scale_zero") is not None:
            raise AttributeError(f"{name} of a packed int4 layer is a view of its scale_zero: write into it "
                                 f"(.{name}.copy_(...)) instead of replacing it")
        super().__setattr__(name, value)

    def _apply(self, fn, recurse: bool = True):
        """.to() / .cuda() / .half(): the packed tensor moves once and the views are re-made on it (moving the
        views as buffers of their own would copy them apart); a new scale dtype re-packs or unpacks."""
        if self.scale_zero is None:
            super()._apply(fn, recurse)
            if packs_scale_zero(self.scheme, self.scales.dtype):  # e.g. float32 scales made bfloat16
                self._set_scale_dtype(self.scales.dtype)
            return self
        dtype = self._buffers.pop("scales").dtype
        del self._buffers["zeros"]
        try:
            super()._apply(fn, recurse)
        finally:
            self._alias_scale_zero(dtype)
        new = fn(torch.empty(0, dtype=dtype, device=self.scale_zero.device)).dtype
        if new != dtype:
            self._set_scale_dtype(new)
        return self

    def _set_scale_dtype(self, dtype: torch.dtype) -> None:
        scales, zeros = self.scales.to(dtype), self.zeros.clone()
        self.dtype = dtype
        if packs_scale_zero(self.scheme, dtype):
            self._buffers["scale_zero"] = torch.zeros(scales.shape, dtype=torch.int32, device=scales.device)
            self._alias_scale_zero(dtype)
            self.scales.copy_(scales)
            self.zeros.copy_(zeros)
        else:
            self._buffers["scale_zero"] = None
            self._buffers["scales"], self._buffers["zeros"] = scales, zeros

    def shard_offset(self, index: int) -> int:
        return sum(self.shard_sizes[:index])

    @torch.no_grad()
    def init_dummy(self) -> None:
        """Finite random contents of the right magnitude (what --load-format dummy serves; loading overwrites)."""
        # In place, or in slices (fp8): a 122B model's expert stack is ~0.8 GB packed, and a temporary of its
        # shape (4x that as int32 / float32) would sit on top of the weights at the load's peak.
        gen_dev = self.qweight.device
        if self.scheme in ("int4", "nvfp4", "mxfp4"):
            self.qweight.random_(0, 256)
        elif self.scheme == "int8":
            self.qweight.random_(-128, 128)
        else:
            rows = self.qweight.view(-1, self.qweight.shape[-1])
            step = max(1, DUMMY_SLICE_BYTES // (4 * rows.shape[1]))
            for r in range(0, rows.shape[0], step):
                block = rows[r:r + step]
                block.copy_(torch.randn(block.shape, device=gen_dev).clamp_(-3, 3))
        scale = {"int4": 0.02 / 4, "int8": 0.02 / 64, "fp8": 0.02, "nvfp4": 0.02 / 3,
                 "mxfp4": E8M0_BIAS + round(math.log2(0.02 / 3))}[self.scheme]  # mxfp4: an exponent
        self.scales.fill_(scale)
        if self.zeros is not None:
            self.zeros.fill_(8 if self.scheme == "int4" else 0)
        if self.global_scale is not None:
            self.global_scale.fill_(1.0)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full-precision weights [..., N, K] (columns in permuted order when `perm` is set; a layer stored in
        the mma kernels' lane order has its columns put back: kernels/lane_order.py)."""
        w = dequantize(self.scheme, self.qweight, self.scales, self.zeros, self.global_scale, self.group_size,
                       dtype or self.dtype)
        return restore_columns(w) if self.lane_order else w

    def extra_repr(self) -> str:
        return (f"{self.scheme}, in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}")


@functools.cache
def _triton_kernels():
    """blockspec.kernels.quant_linear (imported on first use: it imports this module), or None when not available."""
    try:
        from blockspec.kernels import quant_linear as kernels
    except ImportError:
        return None
    return kernels


def _triton_quant_linear():
    """The GPU kernel entry point `quant_linear(x, layer, *, residual=None, gated=False)`, or None."""
    return getattr(_triton_kernels(), "quant_linear", None)


def native_low_precision_supported(x: torch.Tensor, layer: QuantLinear) -> bool:
    """Blackwell (sm100+) tensor cores run FP4 and FP8 GEMMs natively."""
    return (x.is_cuda and layer.scheme in ("nvfp4", "fp8")
            and cuda_capability(x.device) >= (10, 0))


class QuantLinear(_QuantTensors):
    """A linear projection (or several fused ones: q|k|v, gate|up) stored in one quantized layout.

    Attributes read by the kernels: scheme, qweight, scales, zeros, global_scale, group_size,
    out_features, in_features, bias, perm (see the module docstring for each layout).
    """

    def __init__(self, scheme: str, in_features: int, out_features: int, group_size: int, *, bias: bool = False,
                 symmetric: bool = True, shard_sizes: list[int] | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        dtype = dtype or torch.get_default_dtype()
        super().__init__(scheme, out_features, in_features, group_size, symmetric, shard_sizes, (), dtype, device)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        # ---- GPU dispatch point: the Triton kernel dequantizes in registers (blockspec/kernels/quant_linear.py).
        if use_triton(x):
            kernel = _triton_quant_linear()
            if kernel is not None:
                return kernel(x, self)
        # ---- Blackwell dispatch point (not implemented): native FP4 / FP8 tensor-core GEMM with block
        # scales would go here; until then Blackwell takes the Triton kernel above or the reference.
        if native_low_precision_supported(x, self):
            pass
        return self.reference(x)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += self(x), in place, returned: on the GPU the add rides in the GEMM's epilogue (a decoder's
        down projection: one launch fewer a layer; bench/quant_gemm.py --folds: 14.7 vs 17.2 us for the 8B down
        in int4 at one row on an H200), rounded as the separate add."""
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if use_triton(x):
            kernel = _triton_quant_linear()
            if kernel is not None:
                return kernel(x, self, residual=residual)
        return residual.add_(self.reference(x))

    def forward_gated(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up over self(x)'s [gate; up] halves (a decoder's gate|up projection). On the GPU in the
        GEMM's epilogue where the 1-16-row mma kernels take the rows (one launch fewer a layer), else a SwiGLU
        kernel after the GEMM, which measured faster than the dot path's fold (kernels/quant_linear.gemv_takes)."""
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        kernels = _triton_kernels() if use_triton(x) else None
        if kernels is not None:
            if kernels.gemv_takes(x, self, gated=True):
                return kernels.quant_linear(x, self, gated=True)
            return silu_mul(kernels.quant_linear(x, self))
        return silu_mul(self.reference(x))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Dequantize, then the same linear the unquantized layers run (x already permuted): the CPU path
        and the kernels' oracle."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return linear(x, self.dequantize(x.dtype), bias)

    def row_slice(self, start: int, end: int) -> QuantLinear | None:
        """Outputs [start, end) as a layer of their own that shares this one's storage (the k|v rows of a fused
        q|k|v: a drafter's context write reads only those), or None where the layout cannot be cut there (fp8
        128-row scale blocks cut off their boundary)."""
        if not 0 <= start < end <= self.out_features:
            raise ValueError(f"rows [{start}, {end}) outside [0, {self.out_features})")
        if self.scheme == "fp8" and self.group_size and (start % FP8_BLOCK or (end % FP8_BLOCK and
                                                                              end != self.out_features)):
            return None
        view = QuantLinear(self.scheme, self.in_features, end - start, self.group_size, bias=False,
                           symmetric=self.symmetric, dtype=self.dtype, device="meta")
        block = FP8_BLOCK if self.scheme == "fp8" and self.group_size else 1
        for name in ("qweight", "scales", "zeros", "scale_zero"):
            t = getattr(self, name)
            if t is None or (name in ("scales", "zeros") and self.scale_zero is not None):
                continue
            rows = slice(start // block, -(-end // block)) if name == "scales" else slice(start, end)
            view._buffers[name] = t[rows]
        if self.scale_zero is not None:
            view._alias_scale_zero(self.dtype)
        view._buffers["global_scale"] = self.global_scale
        view._buffers["perm"] = self.perm
        view.lane_order = self.lane_order
        if self.bias is not None:
            view.bias = nn.Parameter(self.bias[start:end], requires_grad=False)
        return view


class QuantExpertWeights(_QuantTensors):
    """One stacked expert projection ([E, N, K] logically): gate|up (shards [I, I]) or down."""

    def __init__(self, scheme: str, num_experts: int, in_features: int, out_features: int, group_size: int, *,
                 symmetric: bool = True, shard_sizes: list[int] | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        dtype = dtype or torch.get_default_dtype()
        self.num_experts = num_experts
        super().__init__(scheme, out_features, in_features, group_size, symmetric, shard_sizes, (num_experts,),
                         dtype, device)
        self.bias = None

    def expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's [N, K] weights (columns in permuted order when `perm` is set)."""
        g = None if self.global_scale is None else self.global_scale[e]
        return dequantize(self.scheme, self.qweight[e], self.scales[e], None if self.zeros is None else self.zeros[e],
                          g, self.group_size, dtype)

    def apply(self, x: torch.Tensor, e: int) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm[e])
        return F.linear(x, self.expert(e, x.dtype))


class QuantExperts(nn.Module):
    """Quantized stand-in for models.layers.moe.Experts: the same forward(x, weights, ids), experts stacked
    as `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] in one layout each.

    `forward` takes the grouped Triton kernels (kernels/moe_grouped.py, the weights dequantized in registers,
    no host sync: CUDA graphs capture it) where layers.moe.fused_applies says so (decode and verify steps, and
    any step under capture), else the reference: a loop over the experts that received tokens, dequantizing
    only those (the CPU path, the oracle, and prefill). SparseMoeBlock runs the same kernels with its own
    routing kernel (its fused path reads `gate_up_proj` / `down_proj` and the biases). With `bias` the experts carry
    `gate_up_proj_bias` [E, 2I] and `down_proj_bias` [E, H] in the model dtype (GPT-OSS), and `activation`
    joins the gate and up halves (moe.GatedActivation: SiLU, or GPT-OSS's clamped SwiGLU).
    """

    def __init__(self, scheme: str, num_experts: int, hidden_size: int, intermediate_size: int, group_size: int,
                 down_group_size: int, *, symmetric: bool = True, bias: bool = False,
                 activation: GatedActivation = SILU, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.scheme = scheme
        self.activation = activation
        # as layers.moe.Experts: "auto" / "fused" take the grouped kernels (fused_applies), "reference" and
        # "grouped" the reference loop (torch's grouped GEMM has no quantized operands)
        self.backend = os.environ.get("BLOCKSPEC_MOE_BACKEND", "auto")
        if self.backend not in BACKENDS:
            raise ConfigError(f"BLOCKSPEC_MOE_BACKEND={self.backend!r}: use one of {', '.join(BACKENDS)}")
        i = intermediate_size
        self.gate_up_proj = QuantExpertWeights(scheme, num_experts, hidden_size, 2 * i, group_size,
                                               symmetric=symmetric, shard_sizes=[i, i], dtype=dtype, device=device)
        self.down_proj = QuantExpertWeights(scheme, num_experts, i, hidden_size, down_group_size,
                                            symmetric=symmetric, dtype=dtype, device=device)
        dtype = dtype or torch.get_default_dtype()
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * i, dtype=dtype, device=device),
                                              requires_grad=False) if bias else None
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden_size, dtype=dtype, device=device),
                                           requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if fused_applies(x, self.gate_up_proj, self.down_proj, self.backend):
            return experts_fused(x, self.gate_up_proj, self.down_proj, weights, ids, self.activation,
                                 self.gate_up_proj_bias, self.down_proj_bias)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"these {self.scheme} MoE experts are not in a layout the grouped kernels read (an "
                               "act-order permutation?) and their reference path reads the routed experts back to "
                               "the host, which a CUDA graph cannot capture: serve with --enforce-eager")
        return self.reference(x, weights, ids)

    def reference(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Dequantize the experts that received tokens, then their projections: the CPU path and the oracle."""
        def project(holder: QuantExpertWeights, bias: torch.Tensor | None):
            def fn(rows: torch.Tensor, e: int) -> torch.Tensor:
                y = holder.apply(rows, e)
                return y if bias is None else y + bias[e].to(y.dtype)
            return fn

        return experts_loop(x, weights, ids, project(self.gate_up_proj, self.gate_up_proj_bias),
                            project(self.down_proj, self.down_proj_bias), self.activation)

    def dequantize(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) in full precision, for checks and the unfused fallback.

        Valid as is only without act-order permutations (perm is None), which MoE exports do not use."""
        return self.gate_up_proj.dequantize(dtype), self.down_proj.dequantize(dtype)


def quantized_tensor_bytes(module: nn.Module) -> int:
    """Bytes held by the quantized layouts inside `module` (packed weights, scales, zeros or the packed
    scale_zero they are views of, globals, permutations): each storage once."""
    total = 0
    for sub in module.modules():
        if isinstance(sub, _QuantTensors):
            names = ("qweight", "scale_zero") if sub.scale_zero is not None else ("qweight", "scales", "zeros")
            for name in (*names, "global_scale", "perm"):
                t = getattr(sub, name, None)
                if t is not None:
                    total += t.numel() * t.element_size()
    return total
