"""Bytes of quantized weights as blockspec holds them (packed codes + scales + zeros), from shapes alone.

The start-up report and `blockspec plan` count these, not the checkpoint's stored bytes (GPTQ stores
fp16 scales and int32 zero points, we hold model-dtype scales and uint8 zeros: with bf16 / fp16 scales both
in one int32 a group, `scale_zero`, the only copy), and the roofline's bytes per decode token are the bytes
actually read (for every layout here the kernels read exactly what is held).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from blockspec.errors import ConfigError
from blockspec.loader.quant.config import LayerScheme, parse_quantization
from blockspec.models.layers.quant_linear import FP8_BLOCK, MXFP4_GROUP, NVFP4_GROUP

SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
                     "U32": 4, "U16": 2, "U8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "BOOL": 1}
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
INT4_PACKED_GROUP_BYTES = 4  # int4 with 16-bit scales: scale bits | zero << 16 (models/layers/quant_linear)


def quantized_weight_bytes(scheme: str, n: int, k: int, group_size: int, symmetric: bool, elem_bytes: int) -> int:
    """Bytes of one [n, k] weight in our layout (group_size as on the layer: int K/G, fp8 0 or 128)."""
    if scheme == "int4":  # 16-bit scales: scale and zero packed in one int32 a group (held and read as such)
        groups = n * (k // group_size)
        return n * k // 2 + groups * (INT4_PACKED_GROUP_BYTES if elem_bytes == 2 else elem_bytes + 1)
    if scheme == "int8":
        groups = n * (k // group_size)
        return n * k + groups * elem_bytes + (0 if symmetric else groups)
    if scheme == "fp8":
        scales = n if not group_size else math.ceil(n / FP8_BLOCK) * math.ceil(k / FP8_BLOCK)
        return n * k + 4 * scales
    if scheme == "nvfp4":
        return n * k // 2 + n * k // NVFP4_GROUP + 4
    if scheme == "mxfp4":
        return n * k // 2 + n * k // MXFP4_GROUP
    raise ValueError(f"unknown quantization scheme {scheme!r}")


def bits_per_weight(ls: LayerScheme, k: int, elem_bytes: int) -> float:
    """Effective bits per weight of a scheme for rows of k inputs (scales and zeros included)."""
    group = ls.group_size or (k if ls.scheme in ("int4", "int8") else 0)
    return quantized_weight_bytes(ls.scheme, 1024, k, group, ls.symmetric, elem_bytes) * 8 / (1024 * k)


def declared_bits_per_weight(qcfg: dict[str, Any] | None, hidden: int, elem_bytes: int) -> float | None:
    """Bits per weight of a config-declared quantization (its first scheme), None if unquantized or unknown."""
    if not qcfg:
        return None
    try:
        config = parse_quantization(qcfg)
    except ConfigError:
        return None
    if config is None:
        return None
    scheme = getattr(config, "scheme", None)
    if scheme is None and hasattr(config, "targets"):
        scheme = next(iter(config.targets.values()), None)
    if scheme is None and hasattr(config, "bits"):
        scheme = LayerScheme("int4" if config.bits == 4 else "int8", config.source, max(config.group_size, 0),
                             config.sym)
    return None if scheme is None else bits_per_weight(scheme, hidden, elem_bytes)


def _logical_shape(ls: LayerScheme, stored: dict[str, tuple[str, tuple[int, ...]]]) -> tuple[int, int]:
    """[n, k] of a quantized layer from the stored shapes of its tensors."""
    from blockspec.loader.quant.formats import payload_suffix

    shape = stored[payload_suffix(ls)][1]
    bits = 4 if ls.scheme in ("int4", "nvfp4") else 8
    if ls.source == "ct-pack":
        scale = stored.get("weight_scale", (None, ()))[1]
        k = scale[-1] * ls.group_size if ls.group_size and scale else shape[1] * 32 // bits
        return shape[0], k
    if ls.source in ("ct-nvfp4", "modelopt-nvfp4"):
        return shape[0], shape[1] * 2
    if ls.source == "gptq":
        return shape[1], shape[0] * 32 // bits
    if ls.source == "awq":
        return shape[1] * 8, shape[0]
    return shape[0], shape[1]


def checkpoint_memory_bytes(model_dir: Path, elem_bytes: int,
                            tensors: dict[str, tuple[str, tuple[int, ...]]] | None = None
                            ) -> tuple[int, int, int] | None:
    """(weight bytes in memory, routed-expert bytes, input-embedding bytes) of a quantized checkpoint,
    from its safetensors headers; None when it is not quantized (or holds no safetensors)."""
    from blockspec.loader.quant.apply import resolve_scheme
    from blockspec.loader.quant.config import detect_quantization
    from blockspec.loader.safetensors_loader import read_tensor_headers
    from blockspec.loader.weights import is_skipped

    tensors = read_tensor_headers(model_dir) if tensors is None else tensors
    config = detect_quantization(model_dir, None, tensors) if tensors else None
    if config is None:
        return None
    modules: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for name, info in tensors.items():
        if not is_skipped(name):
            module, _, suffix = name.rpartition(".")
            modules.setdefault(module, {})[suffix] = info
    sizes = []
    for module, stored in modules.items():
        ls = resolve_scheme(config, module) if "weight" in stored or "qweight" in stored \
            or "weight_packed" in stored else None
        if ls is not None:
            n, k = _logical_shape(ls, stored)
            group = ls.group_size or (k if ls.scheme in ("int4", "int8") else 0)
            size = quantized_weight_bytes(ls.scheme, n, k, group, ls.symmetric, elem_bytes)
            if "bias" in stored:
                size += math.prod(stored["bias"][1]) * elem_bytes
        else:
            size = sum(math.prod(shape) * (elem_bytes if dtype in FLOAT_DTYPES else SAFETENSORS_BYTES.get(dtype, 1))
                       for dtype, shape in stored.values())
        sizes.append((module, size))
    return split_bytes(sizes)


def split_bytes(sizes: Iterable[tuple[str, int]]) -> tuple[int, int, int]:
    """(total, routed-expert, input-embedding) bytes of named tensors or modules: what a decode step does
    not read (idle experts, all but one embedding row) is told apart by name."""
    total = experts = embed = 0
    for name, size in sizes:
        total += size
        # per-expert tensors (experts.7.up_proj) or a stacked format's module (experts.gate_up_proj_blocks)
        if (".experts." in name or name.endswith(".experts")) and "shared_expert" not in name:
            experts += size
        if "embed_tokens" in name:
            embed += size
    return total, experts, embed
