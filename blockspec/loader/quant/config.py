"""What a checkpoint declares about its quantization, and which layers it quantizes with which scheme.

Sources, first found wins: config.json's `quantization_config` (or its text_config's), ModelOpt's
hf_quant_config.json, AutoGPTQ's quantize_config.json. Each method's config is reduced to one
question, `scheme_for(checkpoint module name) -> LayerScheme | None`, answered with the checkpoint's
own names (ignore / exclude lists name checkpoint modules, VLM prefixes included). Anything this
module cannot serve ends in one ConfigError line naming it and listing what is supported.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blockspec.errors import ConfigError

SUPPORTED = ("compressed-tensors nvfp4-pack-quantized, pack-quantized int4/int8 weight-only (any group size, "
             "symmetric or asymmetric), float-quantized fp8 (per tensor, per channel, 128x128 blocks) and "
             "int-quantized int8; ModelOpt NVFP4 / FP8 (per tensor, per channel, 128x128 blocks); fp8 with "
             "128x128 block scales; GPTQ int4/int8 (v1 and v2 zero points, act-order); AWQ int4 (gemm); "
             "AutoRound int4/int8 (auto_round:auto_gptq, auto_round:auto_awq); MXFP4 experts (GPT-OSS)")

# --quantization values (vLLM's names) that mean each checkpoint method.
FLAG_NAMES: dict[str, tuple[str, ...]] = {
    "compressed-tensors": ("compressed-tensors", "compressed_tensors"),
    "modelopt": ("modelopt", "modelopt_fp4", "modelopt_fp8", "nvfp4"),
    "fp8": ("fp8",),
    "gptq": ("gptq", "gptq_marlin", "gptq_bitblas", "marlin"),
    "awq": ("awq", "awq_marlin"),
    "auto-round": ("auto-round", "auto_round", "autoround", "intel/auto-round"),
    "mxfp4": ("mxfp4",),
}
KNOWN_FLAGS = tuple(sorted({n for names in FLAG_NAMES.values() for n in names}))
LINEAR_CLASSES = ("Linear", "LinearBase", "nn.Linear", "torch.nn.Linear")


@dataclass(frozen=True)
class LayerScheme:
    """One layer's quantization: the in-memory layout and how the checkpoint stores it.

    `source` names the checkpoint layout the converters read (formats.py). `group_size`: int4/int8
    elements per scale along K (0: one per output channel); fp8 128 for 128x128 blocks, 0 per channel
    or tensor; nvfp4 16.
    """

    scheme: str  # int4 | int8 | fp8 | nvfp4 | mxfp4
    source: str  # ct-pack | ct-int | ct-float | ct-nvfp4 | modelopt-nvfp4 | modelopt-fp8 | hf-fp8 | gptq | awq | mxfp4
    group_size: int
    symmetric: bool = True
    gptq_v1: bool = False  # GPTQ v1 checkpoints store zero - 1


@dataclass
class QuantConfig:
    """A checkpoint's quantization: the method, a one-line description, and the per-layer schemes."""

    method: str  # compressed-tensors | modelopt | fp8 | gptq | awq | auto-round | mxfp4
    description: str
    tensors: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # raw name -> (dtype, shape)

    def scheme_for(self, module: str) -> LayerScheme | None:
        raise NotImplementedError

    def flag_names(self) -> tuple[str, ...]:
        return FLAG_NAMES[self.method]


# ---- matching helpers ------------------------------------------------------------------------------

def ct_matches(name: str, pattern: str) -> bool:
    """compressed-tensors' rule: `re:` patterns match from the start of the name; a Linear class name
    matches every linear layer; anything else is an exact module name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name or pattern in LINEAR_CLASSES


def wildcard_matches(name: str, pattern: str) -> bool:
    """ModelOpt / fp8 exclude lists: shell wildcards, or a module name (also without the wrapper prefix,
    as older exports write `lm_head`) covering everything under it."""
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.startswith(pattern + ".") or name.endswith("." + pattern) \
        or f".{pattern}." in name


# ---- compressed-tensors -----------------------------------------------------------------------------

class CompressedTensorsConfig(QuantConfig):
    def __init__(self, qcfg: dict[str, Any], tensors: dict) -> None:
        top_format = qcfg.get("format") or "dense"
        if qcfg.get("sparsity_config") and (qcfg["sparsity_config"].get("format") or "dense") != "dense":
            _unsupported(f"compressed-tensors sparsity ({qcfg['sparsity_config'].get('format')})")
        if qcfg.get("transform_config") and (qcfg["transform_config"].get("config_groups") or {}):
            _unsupported("compressed-tensors with a transform_config (rotated weights need online transforms)")
        self.targets: dict[str, LayerScheme] = {}
        formats = set()
        for gname, group in (qcfg.get("config_groups") or {}).items():
            weights = (group or {}).get("weights")
            if not weights:
                continue  # activation-only groups leave the weights as stored
            fmt = group.get("format") or top_format
            scheme = _ct_scheme(fmt, weights, gname)
            formats.add(fmt if fmt != "mixed-precision" else scheme.source)
            for target in group.get("targets") or []:
                self.targets[str(target)] = scheme
        self.ignore = [str(p) for p in qcfg.get("ignore") or []]
        self.dense = not self.targets
        super().__init__("compressed-tensors", f"compressed-tensors {', '.join(sorted(formats)) or 'dense'}",
                         tensors)

    def scheme_for(self, module: str) -> LayerScheme | None:
        if any(ct_matches(module, p) for p in self.ignore):
            return None
        for target, scheme in self.targets.items():
            if ct_matches(module, target):
                return scheme
        return None


def _ct_scheme(fmt: str, w: dict[str, Any], group: str) -> LayerScheme:
    bits = int(w.get("num_bits") or 0)
    kind = str(w.get("type") or "int")
    strategy = str(w.get("strategy") or "tensor")
    sym = bool(w.get("symmetric", True))
    size = int(w.get("group_size") or 0)
    what = f"compressed-tensors format {fmt} ({group}: {bits}-bit {kind}, strategy {strategy}" + \
           (f", group {size})" if size else ")")
    if fmt == "mixed-precision":  # the group's own format was not written: infer it as compressed-tensors does
        fmt = "nvfp4-pack-quantized" if (kind, bits, size) == ("float", 4, 16) else \
            "pack-quantized" if kind == "int" and bits < 8 else \
            "float-quantized" if kind == "float" else "int-quantized"
    if w.get("dynamic") not in (False, None, "false"):
        _unsupported(what + " with dynamic weight scales")
    if fmt == "nvfp4-pack-quantized" and (kind, bits, size, sym) == ("float", 4, 16, True):
        return LayerScheme("nvfp4", "ct-nvfp4", 16)
    if fmt == "pack-quantized" and kind == "int" and bits in (4, 8):
        if strategy not in ("group", "channel", "tensor") or (strategy == "group" and size <= 0):
            _unsupported(what)
        return LayerScheme("int4" if bits == 4 else "int8", "ct-pack", size if strategy == "group" else 0, sym)
    if fmt in ("int-quantized", "naive-quantized") and kind == "int" and bits == 8:
        if strategy not in ("group", "channel", "tensor"):
            _unsupported(what)
        return LayerScheme("int8", "ct-int", size if strategy == "group" else 0, sym)
    if fmt in ("float-quantized", "naive-quantized") and kind == "float" and bits == 8 and sym:
        if strategy in ("tensor", "channel"):
            return LayerScheme("fp8", "ct-float", 0)
        if strategy == "block" and list(w.get("block_structure") or []) == [128, 128]:
            return LayerScheme("fp8", "ct-float", 128)
    _unsupported(what)
    raise AssertionError  # unreachable


# ---- ModelOpt ---------------------------------------------------------------------------------------

MODELOPT_ALGOS = {"NVFP4": ("nvfp4", 16), "W4A16_NVFP4": ("nvfp4", 16), "FP8": ("fp8", 0),
                  "FP8_PER_CHANNEL_PER_TOKEN": ("fp8", 0), "FP8_PB_WO": ("fp8", 128)}


class ModelOptConfig(QuantConfig):
    def __init__(self, qcfg: dict[str, Any], tensors: dict) -> None:
        section = qcfg.get("quantization") if isinstance(qcfg.get("quantization"), dict) else qcfg
        algo = str(section.get("quant_algo") or "").upper()
        if algo not in MODELOPT_ALGOS:
            _unsupported(f"ModelOpt quant_algo {algo or '(none)'}")
        scheme, group = MODELOPT_ALGOS[algo]
        if scheme == "nvfp4" and int(section.get("group_size") or 16) != 16:
            _unsupported(f"ModelOpt NVFP4 with group_size {section.get('group_size')}")
        self.scheme = LayerScheme(scheme, f"modelopt-{scheme}", group)
        self.exclude = [str(p) for p in section.get("exclude_modules") or section.get("ignore") or []]
        super().__init__("modelopt", f"ModelOpt {algo}", tensors)

    def flag_names(self) -> tuple[str, ...]:
        return ("modelopt_fp4", "modelopt", "nvfp4") if self.scheme.scheme == "nvfp4" else ("modelopt", "modelopt_fp8")

    def scheme_for(self, module: str) -> LayerScheme | None:
        if any(wildcard_matches(module, p) for p in self.exclude) or _is_vision(module):
            return None
        return self.scheme


# ---- fp8 (transformers' FineGrainedFP8 / vLLM "fp8" serialized checkpoints) ----------------------------

class Fp8Config(QuantConfig):
    def __init__(self, qcfg: dict[str, Any], tensors: dict) -> None:
        block = qcfg.get("weight_block_size")
        if block is not None and list(block) != [128, 128]:
            _unsupported(f"fp8 with weight_block_size {block}")
        self.scheme = LayerScheme("fp8", "hf-fp8", 128 if block else 0)
        self.exclude = [str(p) for p in (qcfg.get("ignored_layers") or qcfg.get("modules_to_not_convert") or [])]
        super().__init__("fp8", "fp8 " + ("128x128 blocks" if block else "per tensor"), tensors)

    def scheme_for(self, module: str) -> LayerScheme | None:
        if any(wildcard_matches(module, p) for p in self.exclude) or _is_vision(module):
            return None
        # Exporters leave some layers in bf16 without listing them: the stored dtype decides.
        return self.scheme if _stored_dtype(self.tensors, f"{module}.weight") in ("F8_E4M3", None) else None


# ---- GPTQ / AWQ / AutoRound ------------------------------------------------------------------------------

class IntPackedConfig(QuantConfig):
    """GPTQ, AWQ and AutoRound: every layer whose `qweight` the checkpoint holds, with per-layer overrides.

    These configs do not enumerate their layers (exporters skip routers and layers too narrow to pack),
    so the checkpoint's tensor names decide which layers are quantized; without tensors (dummy
    weights) every layer but lm_head is.
    """

    def __init__(self, method: str, source: str, bits: int, group_size: int, sym: bool, gptq_v1: bool,
                 description: str, tensors: dict, skip: list[str] | None = None,
                 overrides: list[tuple[str, dict[str, Any]]] | None = None, lm_head: bool = False) -> None:
        self.source, self.bits, self.group_size, self.sym, self.gptq_v1 = source, bits, group_size, sym, gptq_v1
        self.skip = skip or []  # regexes (re.match) of layers left unquantized
        self.overrides = overrides or []  # (regex, {bits, group_size, sym}) per layer
        self.lm_head = lm_head
        super().__init__(method, description, tensors)

    def scheme_for(self, module: str) -> LayerScheme | None:
        if any(re.match(p, module) for p in self.skip) or _is_vision(module):
            return None
        if self.tensors:
            if f"{module}.qweight" not in self.tensors:
                return None
        elif module.endswith("lm_head") and not self.lm_head:
            return None
        bits, group, sym = self.bits, self.group_size, self.sym
        for pattern, values in self.overrides:
            if re.match(pattern, module):
                bits = int(values.get("bits", bits))
                group = int(values.get("group_size", group))
                sym = bool(values.get("sym", sym))
        if bits >= 16:
            return None
        if bits not in (4, 8) or (self.source == "awq" and bits != 4):
            _unsupported(f"{self.description} with {bits}-bit layers ({module})")
        return LayerScheme("int4" if bits == 4 else "int8", self.source, max(group, 0), sym, self.gptq_v1)


def _gptq(qcfg: dict[str, Any], tensors: dict) -> IntPackedConfig:
    fmt = str(qcfg.get("checkpoint_format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        _unsupported(f"GPTQ checkpoint_format {fmt}")
    skip, overrides = [], []
    for key, values in (qcfg.get("dynamic") or {}).items():  # GPTQModel per-module rules
        if key.startswith("-:"):
            skip.append(key[2:])
        else:
            overrides.append((key.removeprefix("+:"), values or {}))
    bits = int(qcfg.get("bits", 4))
    return IntPackedConfig("gptq", "gptq", bits, int(qcfg.get("group_size", 128)), bool(qcfg.get("sym", True)),
                           fmt == "gptq", f"GPTQ {bits}-bit ({fmt})", tensors, skip, overrides,
                           bool(qcfg.get("lm_head", False)))


def _awq(qcfg: dict[str, Any], tensors: dict) -> IntPackedConfig:
    version = str(qcfg.get("version") or "gemm").lower()
    if version != "gemm":
        _unsupported(f"AWQ version {version} (its packing differs from gemm)")
    bits = int(qcfg.get("bits") or qcfg.get("w_bit") or 4)
    group = int(qcfg.get("group_size") or qcfg.get("q_group_size") or 128)
    skip = [re.escape(m) + r"(\.|$)" for m in qcfg.get("modules_to_not_convert") or []]
    skip = [r".*" + s for s in skip]
    return IntPackedConfig("awq", "awq", bits, group, not bool(qcfg.get("zero_point", True)), False,
                           f"AWQ {bits}-bit gemm", tensors, skip)


def _auto_round(qcfg: dict[str, Any], tensors: dict) -> IntPackedConfig:
    packing = str(qcfg.get("packing_format") or "auto_round:auto_gptq")
    data_type = str(qcfg.get("data_type") or "int")
    if data_type != "int":
        _unsupported(f"AutoRound data_type {data_type}")
    if packing not in ("auto_round:auto_gptq", "auto_gptq", "auto_round:auto_awq", "auto_awq"):
        _unsupported(f"AutoRound packing_format {packing}")
    awq = packing.endswith("awq")
    overrides = [(re.escape(name) + "$", values or {}) for name, values in (qcfg.get("extra_config") or {}).items()]
    blocks = qcfg.get("block_name_to_quantize") or qcfg.get("to_quant_block_names")
    skip = []
    if blocks:
        names = blocks.split(",") if isinstance(blocks, str) else [str(b) for b in blocks]
        skip.append(r"(?!" + "|".join(re.escape(n.strip()) for n in names) + ")")
    bits = int(qcfg.get("bits", 4))
    return IntPackedConfig("auto-round", "awq" if awq else "gptq", bits, int(qcfg.get("group_size", 128)),
                           bool(qcfg.get("sym", True)), not awq, f"AutoRound {bits}-bit ({packing})", tensors, skip,
                           overrides)


# ---- MXFP4 (GPT-OSS) ------------------------------------------------------------------------------------

class Mxfp4Config(QuantConfig):
    """`quant_method: mxfp4` (GPT-OSS): the routed experts stored as stacked `*_blocks` / `*_scales` (E2M1
    codes, one E8M0 scale per 32 inputs), everything else in bf16. transformers and vLLM quantize exactly
    the experts (`modules_to_not_convert` lists the rest), and so does this; experts a checkpoint stores in
    float (a dequantized export that kept the config) load unquantized."""

    def __init__(self, qcfg: dict[str, Any], tensors: dict) -> None:
        self.scheme = LayerScheme("mxfp4", "mxfp4", 32)
        self.exclude = [str(p) for p in qcfg.get("modules_to_not_convert") or []]
        super().__init__("mxfp4", "MXFP4 experts", tensors)

    def scheme_for(self, module: str) -> LayerScheme | None:
        owner, found, _ = module.partition(".experts.")  # ...mlp.experts.{e}.{gate,up,down}_proj
        if not found or any(wildcard_matches(module, p) for p in self.exclude):
            return None
        stacks = (f"{owner}.experts.{p}_blocks" for p in ("gate_up_proj", "down_proj"))
        if self.tensors and not any(name in self.tensors for name in stacks):
            return None
        return self.scheme


# ---- detection --------------------------------------------------------------------------------------------

def _unsupported(what: str) -> None:
    raise ConfigError(f"unsupported quantization: {what}; blockspec supports {SUPPORTED}")


def _is_vision(module: str) -> bool:
    return any(m in module for m in ("visual.", "vision_tower", "vision_model", "multi_modal_projector"))


def _stored_dtype(tensors: dict, name: str) -> str | None:
    info = tensors.get(name)
    return None if info is None else info[0]


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot parse {path} ({err}): fix or re-download the file") from None
    return data if isinstance(data, dict) else None


def declared_quantization(model_dir: Path) -> tuple[dict[str, Any] | None, str]:
    """The checkpoint's quantization config dict and the file it came from (None when unquantized)."""
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "config.json") or {}
    qcfg = config.get("quantization_config")
    if not qcfg and isinstance(config.get("text_config"), dict):
        qcfg = config["text_config"].get("quantization_config")
    if qcfg:
        return dict(qcfg), "config.json"
    modelopt = _read_json(model_dir / "hf_quant_config.json")
    if modelopt:
        return {"quant_method": "modelopt", **modelopt}, "hf_quant_config.json"
    for name in ("quantize_config.json", "quant_config.json"):
        legacy = _read_json(model_dir / name)
        if legacy:
            legacy.setdefault("quant_method", "gptq" if name == "quantize_config.json" else "awq")
            return legacy, name
    return None, ""


def parse_quantization(qcfg: dict[str, Any], tensors: dict | None = None) -> QuantConfig | None:
    """The QuantConfig of a declared quantization_config dict (None: declared but nothing quantized)."""
    tensors = tensors or {}
    method = str(qcfg.get("quant_method") or "").lower()
    if method.startswith("modelopt"):
        return ModelOptConfig(qcfg, tensors)
    if method == "compressed-tensors":
        cfg = CompressedTensorsConfig(qcfg, tensors)
        return None if cfg.dense else cfg
    if method == "fp8":
        return Fp8Config(qcfg, tensors)
    if method == "gptq":
        return _gptq(qcfg, tensors)
    if method == "awq":
        return _awq(qcfg, tensors)
    if method == "mxfp4":
        return Mxfp4Config(qcfg, tensors)
    if method in ("auto-round", "autoround", "auto_round", "intel/auto-round"):
        return _auto_round(qcfg, tensors)
    _unsupported(f"quant_method {method or '(none)'}")
    raise AssertionError  # unreachable


def check_flag(requested: str | None) -> None:
    """--quantization must be a name we know (vLLM's spellings) before any checkpoint is looked at."""
    if requested is not None and requested.lower() not in KNOWN_FLAGS:
        raise ConfigError(f"--quantization {requested} is not a method blockspec reads; the checkpoint's own "
                          f"quantization is used anyway, so drop the flag or use one of {', '.join(KNOWN_FLAGS)}")


def detect_quantization(model_dir: Path, requested: str | None = None,
                        tensors: dict[str, tuple[str, tuple[int, ...]]] | None = None) -> QuantConfig | None:
    """The checkpoint's quantization (None: unquantized), checked against --quantization `requested`."""
    check_flag(requested)
    qcfg, source = declared_quantization(model_dir)
    if qcfg is None:
        if requested is not None:
            raise ConfigError(f"--quantization {requested} given but the checkpoint {model_dir} declares no "
                              "quantization (no quantization_config in config.json, no hf_quant_config.json): "
                              "drop --quantization (blockspec does not quantize weights at load time) or point "
                              f"--model at a {requested} checkpoint")
        return None
    if tensors is None:
        from blockspec.loader.safetensors_loader import read_tensor_headers

        tensors = read_tensor_headers(model_dir)
    config = parse_quantization(qcfg, tensors)
    if requested is not None:
        accepted = config.flag_names() if config is not None else ("compressed-tensors",)
        if requested.lower() not in accepted:
            declared = config.description if config is not None else "compressed-tensors (dense)"
            raise ConfigError(f"--quantization {requested} does not match the checkpoint, whose {source} declares "
                              f"{declared}: drop --quantization or pass --quantization {accepted[0]}")
    return config
