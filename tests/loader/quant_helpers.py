"""Quantized checkpoints for the tests, written by the formats' own code or from their definitions.

`write_ct_checkpoint` turns a tiny float checkpoint into a real compressed-tensors one: the
`compressed-tensors` package computes every scale (calculate_qparams / generate_gparam on min-max
statistics, as its observers do), compresses each linear weight with its registered compressor and
serialises the quantization_config; its own `decompress` gives the oracle weights, written as a
plain float checkpoint beside it.

`pack_gptq` / `pack_awq` / `pack_modelopt_nvfp4` write those formats from their published
definitions (independently of blockspec/loader/quant/formats.py).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# presets: (compressed-tensors preset or weights args, format)
CT_SCHEMES = {
    "nvfp4": ("NVFP4A16", None),
    "int4_g32": ({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}, None),
    "int4_asym_g32": ({"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32},
                      None),
    "int4_g128": ("W4A16", None),
    "int4_asym_g128": ("W4A16_ASYM", None),
    "int4_channel": ({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"}, None),
    "int8_g32": ({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}, None),
    "int8_asym_channel": ({"num_bits": 8, "type": "int", "symmetric": False, "strategy": "channel"}, None),
    "fp8_channel": ("FP8_DYNAMIC", None),
    "fp8_tensor": ("FP8", None),
    "fp8_block": ("FP8_BLOCK", None),
}
# what llm-compressor recipes leave unquantized: the head, routers, and the DeltaNet b/a projections (a few rows)
DEFAULT_IGNORE = ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$", "re:.*in_proj_(ba|b|a)$"]


def is_linear_weight(name: str, tensor: torch.Tensor) -> bool:
    """The 2-D weights of linear layers (what compressed-tensors' "Linear" target quantizes)."""
    return name.endswith(".weight") and tensor.dim() == 2 and "embed_tokens" not in name and "norm" not in name \
        and "visual" not in name


def _matches(name: str, patterns: list[str]) -> bool:
    return any(re.match(p[3:], name) if p.startswith("re:") else p == name for p in patterns)


def ct_scheme(key: str):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme

    preset, _ = CT_SCHEMES[key]
    if isinstance(preset, str):
        return preset_name_to_scheme(preset, ["Linear"])
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**preset))


def _minmax(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """The min / max statistics compressed-tensors' minmax observer reduces for each strategy."""
    strategy = str(args.strategy.value if hasattr(args.strategy, "value") else args.strategy)
    if strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if strategy == "channel":
        return w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    if strategy in ("group", "tensor_group"):
        g = w.unflatten(-1, (w.shape[-1] // args.group_size, args.group_size))
        return g.amin(dim=-1), g.amax(dim=-1)
    if strategy == "block":
        bh, bw = args.block_structure
        n, k = w.shape
        pad = torch.nn.functional.pad(w, (0, -k % bw, 0, -n % bh))
        blocks = pad.unflatten(0, (-1, bh)).unflatten(2, (-1, bw))  # [nb, bh, kb, bw]
        return blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    raise ValueError(strategy)


FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("in_proj_qkv", "in_proj_z"),
                ("in_proj_b", "in_proj_a"))


def _fused_global_scales(state: dict[str, torch.Tensor], ignore: list[str]) -> dict[str, torch.Tensor]:
    """One NVFP4 global scale for the projections vLLM-style engines fuse (q/k/v, gate/up), from their
    joint min/max, as llm-compressor exports them."""
    from compressed_tensors.quantization.utils import generate_gparam

    out = {}
    for name in state:
        for group in FUSED_GROUPS:
            if not name.endswith(f".{group[0]}.weight"):
                continue
            owner = name[: -len(f".{group[0]}.weight")]
            modules = [f"{owner}.{p}" for p in group]
            if any(f"{m}.weight" not in state or _matches(m, ignore) for m in modules):
                continue
            weights = torch.cat([state[f"{m}.weight"].float().flatten() for m in modules])
            gs = generate_gparam(weights.amin(), weights.amax())
            out.update({m: gs for m in modules})
    return out


def ct_compress(w: torch.Tensor, scheme, global_scale: torch.Tensor | None = None, exact_nvfp4: bool = True
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor, str]:
    """(the compressed tensors of one weight, compressed-tensors' own decompression of them, format)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    args = scheme.weights
    fmt = infer_module_format(torch.nn.Linear, scheme)
    compressor = BaseCompressor.get_value_from_registry(fmt.value)
    lo, hi = _minmax(w, args)
    state = {"weight": w}
    if args.num_bits == 4 and str(args.type.value if hasattr(args.type, "value") else args.type) == "float":
        if global_scale is None:
            global_scale = generate_gparam(w.amin(), w.amax())
        state["weight_global_scale"] = global_scale
    scale, zero = calculate_qparams(lo, hi, args, global_scale=global_scale)
    state["weight_scale"] = scale
    state["weight_zero_point"] = zero
    compressed = compressor.compress(state, scheme)
    restored = compressor.decompress({k: v.clone() for k, v in compressed.items()}, scheme)["weight"]
    if fmt.value == "nvfp4-pack-quantized" and not exact_nvfp4:
        return compressed, restored, fmt.value
    if fmt.value == "nvfp4-pack-quantized":
        # its decompress() rounds to bf16; the same two library steps in float32 give the exact weights
        from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
        from compressed_tensors.quantization.lifecycle.forward import dequantize

        packed = compressed["weight_packed"]
        codes = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
        restored = dequantize(codes, compressed["weight_scale"].float(), args=args,
                              global_scale=compressed["weight_global_scale"], dtype=torch.float32)
    return compressed, restored, fmt.value


def _start_pair(src: Path, out: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Make `out` and its `-dequant` twin with src's non-weight files; returns (the twin, src's float tensors)."""
    out.mkdir(parents=True, exist_ok=True)
    ref = out.parent / f"{out.name}-dequant"
    ref.mkdir(exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and not f.name.endswith(".index.json"):
            shutil.copy(f, out / f.name)
            shutil.copy(f, ref / f.name)
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(f))
    return ref, state


def write_ct_checkpoint(src: Path, out: Path, key: str, ignore: list[str] | None = None,
                        weight_dtype: torch.dtype = torch.float32, fuse_globals: bool = True) -> tuple[Path, Path]:
    """`src` (a float checkpoint) -> (`out`: compressed-tensors checkpoint, `out`-dequant: its decompression)."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    ignore = DEFAULT_IGNORE if ignore is None else ignore
    scheme = ct_scheme(key)
    ref, state = _start_pair(src, out)
    packed, dequant = {}, {}
    fmt = None
    shared = _fused_global_scales(state, ignore) if key == "nvfp4" and fuse_globals else {}
    group = scheme.weights.group_size or 1
    ignore = list(ignore)
    for name, tensor in state.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module is not None and is_linear_weight(name, tensor) and tensor.shape[1] % group:
            ignore.append(module)  # too narrow for the group size: left unquantized, as a user would list it
        if module is None or not is_linear_weight(name, tensor) or _matches(module, ignore):
            packed[name] = tensor
            dequant[name] = tensor
            continue
        compressed, restored, fmt = ct_compress(tensor.to(weight_dtype), scheme, shared.get(module))
        for suffix, value in compressed.items():
            packed[f"{module}.{suffix}"] = value.clone().contiguous()
        dequant[name] = restored.to(tensor.dtype)
    save_file(packed, out / "model.safetensors")
    save_file(dequant, ref / "model.safetensors")
    qcfg = QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore, format=fmt,
                              quantization_status=QuantizationStatus.COMPRESSED)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors",
                                     **json.loads(qcfg.model_dump_json(exclude={"quant_method"}))}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out, ref


# ---- formats written from their definitions ---------------------------------------------------------------

def quantize_int(w: torch.Tensor, bits: int, group: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest unsigned codes q [N, K], scales and zero points [N, K/G]: w ~ (q - z) * s."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    top = 2 ** bits - 1
    if sym:
        s = g.abs().amax(-1) / (top // 2) + 1e-8
        z = torch.full_like(s, (top + 1) // 2)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        s = (hi - lo) / top + 1e-8
        z = torch.clamp(torch.round(-lo / s), 0, top)
    q = torch.clamp(torch.round(g / s[..., None] + z[..., None]), 0, top)
    return q.reshape(n, k).to(torch.int64), s, z.to(torch.int64)


def pack_rows_lsb_first(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 [R, C] codes -> int32 [R, C*bits/32]: code j of each word at bits j*bits (word = C // (32/bits))."""
    per = 32 // bits
    r, c = values.shape
    v = values.reshape(r, c // per, per)
    word = torch.zeros(r, c // per, dtype=torch.int64)
    for j in range(per):
        word |= (v[..., j] & (2 ** bits - 1)) << (bits * j)
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word)
    return word.to(torch.int32)


def pack_gptq(w: torch.Tensor, bits: int, group: int, sym: bool, v1: bool, act_order: bool, seed: int = 0
              ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """GPTQ tensors (qweight, qzeros, scales fp16, g_idx) of w [N, K] and the weight they define.

    Act-order: the columns are quantized in a random order, group boundaries every `group` columns of
    that order, so g_idx is a non-trivial map with `group` columns per group.
    """
    gen = torch.Generator().manual_seed(seed)
    n, k = w.shape
    order = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
    q_o, s, z = quantize_int(w[:, order], bits, group, sym)
    s = s.half()
    q = torch.empty_like(q_o)
    q[:, order] = q_o
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group
    mask = 2 ** bits - 1
    stored_z = (z - 1) & mask if v1 else z
    effective_z = stored_z + 1 if v1 else z  # v1 kernels add the 1 back without masking
    defined = (q - effective_z[:, g_idx]).float() * s.float()[:, g_idx]
    tensors = {
        "qweight": pack_rows_lsb_first(q, bits).t().contiguous(),  # [K*bits/32, N], packed along K
        "qzeros": pack_rows_lsb_first(stored_z.t().contiguous(), bits),  # [K/G, N*bits/32], packed along N
        "scales": s.t().contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }
    return tensors, defined


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_awq(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """AutoAWQ gemm tensors (qweight [K, N/8], qzeros [K/G, N/8], scales fp16 [K/G, N]) and their weight."""
    q, s, z = quantize_int(w, 4, group, False)
    s = s.half()
    k = w.shape[1]
    cols = torch.arange(k) // group
    defined = (q - z[:, cols]).float() * s.float()[:, cols]

    def pack(values: torch.Tensor) -> torch.Tensor:  # [R, N] -> [R, N/8], nibble i = column AWQ_ORDER[i]
        r, nn = values.shape
        v = values.reshape(r, nn // 8, 8)[..., list(AWQ_ORDER)]
        return pack_rows_lsb_first(v.reshape(r, nn), 4)

    return {"qweight": pack(q.t().contiguous()), "qzeros": pack(z.t().contiguous()),
            "scales": s.t().contiguous()}, defined


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def pack_modelopt_nvfp4(w: torch.Tensor, amax: torch.Tensor | None = None
                        ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """ModelOpt NVFP4: weight uint8 [N, K/2] (even element low nibble), weight_scale fp8 [N, K/16],
    weight_scale_2 = amax / (6 * 448) that multiplies (amax shared by fused projections); and the
    weight they define."""
    n, k = w.shape
    scale_2 = ((w.abs().amax() if amax is None else amax) / (6 * 448)).float()
    blocks = w.reshape(n, k // 16, 16)
    scale = (blocks.abs().amax(-1) / 6 / scale_2).clamp(min=2 ** -6).to(torch.float8_e4m3fn)
    x = blocks / (scale.float() * scale_2)[..., None]
    mag = (x.abs()[..., None] - E2M1).abs().argmin(-1)  # nearest E2M1 magnitude
    codes = (mag | ((x < 0).long() << 3)).reshape(n, k)
    e2m1 = (E2M1[mag] * torch.sign(x).where(x != 0, torch.ones_like(x))).reshape(n, k)
    defined = e2m1 * scale.float().repeat_interleave(16, -1) * scale_2  # left to right, as the format reads
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return {"weight": packed, "weight_scale": scale, "weight_scale_2": scale_2.reshape(()),
            "input_scale": torch.tensor(1.0)}, defined


def pack_fp8(w: torch.Tensor, per_channel: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """ModelOpt FP8: weight fp8 [N, K] and weight_scale (scalar, or [N] per channel) that multiplies."""
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax()
    scale = (amax / 448).float()
    q = (w / (scale[:, None] if per_channel else scale)).to(torch.float8_e4m3fn)
    defined = q.float() * (scale[:, None] if per_channel else scale)
    return {"weight": q, "weight_scale": scale, "input_scale": torch.tensor(1.0)}, defined


def pack_fp8_block(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """transformers' FineGrainedFP8: weight fp8 and weight_scale_inv [ceil(N/128), ceil(K/128)] (multiplies)."""
    n, k = w.shape
    pad = torch.nn.functional.pad(w, (0, -k % 128, 0, -n % 128))
    blocks = pad.unflatten(0, (-1, 128)).unflatten(2, (-1, 128))
    scale = (blocks.abs().amax(dim=(1, 3)) / 448).float() + 1e-12
    full = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    q = (w / full).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale}, q.float() * full


FUSED_WITH = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gu", "up_proj": "gu",
              "in_proj_qkv": "qkvz", "in_proj_z": "qkvz", "in_proj_b": "ba", "in_proj_a": "ba"}


def write_packed_checkpoint(src: Path, out: Path, method: str, bits: int = 4, group: int = 32, sym: bool = True,
                            v1: bool = True, act_order: bool = False, skip: tuple[str, ...] = ("lm_head", "mlp.gate",
                                                                                            "shared_expert_gate"),
                            config_style: str = "config") -> tuple[Path, Path]:
    """`src` -> (`out` in format `method`, `out`-dequant holding the weights the format defines).

    method: gptq | auto-round | auto-round-awq | awq | modelopt-nvfp4 | modelopt-fp8 | modelopt-fp8-channel |
    fp8-block. Layers the format cannot hold (N or K not a multiple of what it packs) stay float, as
    exporters leave them.
    """
    ref, state = _start_pair(src, out)
    # fused projections share what their exporters share: act-order permutation (same inputs), NVFP4 global
    seeds: dict[str, int] = {}
    amax: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        proj = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if proj in FUSED_WITH:
            key = name.rsplit(".", 2)[0] + FUSED_WITH[proj]
            amax[key] = torch.maximum(amax.get(key, torch.tensor(0.0)), t.abs().amax().float())
    packed, dequant = {}, {}
    excluded = []
    for name, tensor in state.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        n, k = tensor.shape if tensor.dim() == 2 else (0, 0)
        fits = module is not None and is_linear_weight(name, tensor) and not any(
            module == s or module.endswith("." + s) for s in skip)
        if fits and method in ("gptq", "auto-round", "auto-round-awq", "awq"):
            fits = n % 8 == 0 and k % group == 0
        if fits and method == "modelopt-nvfp4":
            fits = k % 16 == 0
        if not fits:
            packed[name] = tensor
            dequant[name] = tensor
            if module is not None and is_linear_weight(name, tensor):
                excluded.append(module)
            continue
        w = tensor.float()
        proj = module.rsplit(".", 1)[-1]
        key = module.rsplit(".", 1)[0] + FUSED_WITH.get(proj, proj)
        if method in ("gptq", "auto-round"):
            seed = seeds.setdefault(key, len(seeds))
            tensors, defined = pack_gptq(w, bits, group, sym, v1, act_order, seed)
            if not act_order and method == "auto-round":
                tensors.pop("g_idx")
        elif method in ("awq", "auto-round-awq"):
            tensors, defined = pack_awq(w, group)
        elif method == "modelopt-nvfp4":
            tensors, defined = pack_modelopt_nvfp4(w, amax.get(key))
        elif method in ("modelopt-fp8", "modelopt-fp8-channel"):
            tensors, defined = pack_fp8(w, per_channel=method.endswith("channel"))
        elif method == "fp8-block":
            tensors, defined = pack_fp8_block(w)
        else:
            raise ValueError(method)
        for suffix, value in tensors.items():
            packed[f"{module}.{suffix}"] = value.contiguous()
        dequant[name] = defined.to(tensor.dtype)
    save_file(packed, out / "model.safetensors")
    save_file(dequant, ref / "model.safetensors")
    qcfg = _declared_config(method, bits, group, sym, v1, act_order, excluded)
    config = json.loads((src / "config.json").read_text())
    if method.startswith("modelopt") and config_style == "hf_quant_config":
        (out / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": qcfg}))
    else:
        config["quantization_config"] = qcfg if not method.startswith("modelopt") else \
            {"quant_method": "modelopt", **qcfg}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out, ref


def _declared_config(method: str, bits: int, group: int, sym: bool, v1: bool, act_order: bool,
                     excluded: list[str]) -> dict:
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": sym,
                "checkpoint_format": "gptq" if v1 else "gptq_v2", "lm_head": False}
    if method in ("auto-round", "auto-round-awq"):
        return {"quant_method": "auto-round", "bits": bits, "group_size": group, "sym": sym, "data_type": "int",
                "packing_format": "auto_round:auto_awq" if method.endswith("awq") else "auto_round:auto_gptq",
                "extra_config": {m: {"bits": 16} for m in excluded}}
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    if method == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    algo = {"modelopt-nvfp4": "NVFP4", "modelopt-fp8": "FP8", "modelopt-fp8-channel": "FP8_PER_CHANNEL_PER_TOKEN"}
    return {"quant_algo": algo[method], "kv_cache_quant_algo": None, "group_size": 16,
            "exclude_modules": ["lm_head", "*.mlp.gate", "*shared_expert_gate"]}
