"""Put quantized layers into a built model, then fill them tensor by tensor as the checkpoint streams in.

1. `deferred_linears()` while the model is built: every nn.Linear and MoE expert stack is created on
   the meta device, so a 122B NVFP4 model never exists in bf16 (not even briefly).
2. `quantize_model(model, qconfig)`: swaps each Linear / FusedLinear / expert stack that the
   checkpoint quantizes (its own names, ignore lists and stored tensors decide) for a QuantLinear /
   QuantExperts on the device, and materialises the rest in the model dtype.
3. `QuantLoader` (driven by loader.weights.load_weights): routes each stored tensor of a quantized
   layer to its piece and rows (q_proj -> the first rows of qkv_proj, experts.7.up_proj -> expert 7's
   second half, experts.gate_up_proj_blocks -> every expert's gate|up at once for stacked formats),
   converting on the device; `finish` checks nothing is missing, unifies NVFP4 global scales of fused
   shards and applies act-order permutations.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from blockspec.errors import ConfigError
from blockspec.loader.quant.config import LayerScheme, QuantConfig
from blockspec.loader.quant.formats import (
    STACKED,
    convert,
    convert_stacked,
    payload_suffix,
    required_pieces,
    scale_suffixes,
    stored_name,
)
from blockspec.models.layers.linear import FUSED_SHARDS, FusedLinear
from blockspec.models.layers.moe import Experts
from blockspec.models.layers.quant_linear import (
    FP8_BLOCK,
    QuantExperts,
    QuantExpertWeights,
    QuantLinear,
    _QuantTensors,
    check_shape,
    pack_nibbles,
    unpack_nibbles,
)

log = logging.getLogger("blockspec")

# fused module name -> its checkpoint projections, in shard order
SHARDS_OF = {fused: [p for p, (f, _) in sorted(FUSED_SHARDS.items(), key=lambda kv: kv[1][1]) if f == fused]
             for fused, _ in FUSED_SHARDS.values()}
FLOAT_DTYPES = ("BF16", "F16", "F32")
# Quantized modules the model reads as plain weights: loaded quantized, then kept dequantized.
DEQUANTIZE_AFTER_LOAD = ("lm_head",)


# ---- 1. building without full-precision linears -----------------------------------------------------------

@contextlib.contextmanager
def deferred_linears() -> Iterator[None]:
    """Build nn.Linear weights and MoE expert stacks on the meta device (quantize_model places them)."""
    linear_init, experts_init = nn.Linear.__init__, Experts.__init__

    def meta_linear(self, *args, **kwargs):
        kwargs["device"] = "meta"
        linear_init(self, *args, **kwargs)

    def meta_experts(self, *args, **kwargs):
        with torch.device("meta"):
            experts_init(self, *args, **kwargs)

    nn.Linear.__init__, Experts.__init__ = meta_linear, meta_experts
    try:
        yield
    finally:
        nn.Linear.__init__, Experts.__init__ = linear_init, experts_init


# ---- 2. swapping modules ------------------------------------------------------------------------------------

def quantize_model(model: nn.Module, qconfig: QuantConfig, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> int:
    """Replace every linear layer / expert stack the checkpoint quantizes; returns how many were replaced.

    Modules are matched by their checkpoint names (a FusedLinear by its shards' names); layers left
    unquantized that were built on the meta device (deferred_linears) are allocated here.
    """
    from blockspec.loader.weights import checkpoint_name

    ref = next((t for t in [*model.parameters(), *model.buffers()] if not t.is_meta and t.is_floating_point()), None)
    device = torch.device(device) if device is not None else (ref.device if ref is not None else torch.device("cpu"))
    dtype = dtype or (ref.dtype if ref is not None else torch.get_default_dtype())
    raw_of: dict[str, str] = {}
    for raw in qconfig.tensors:
        module = raw.rpartition(".")[0]
        raw_of.setdefault(checkpoint_name(module + ".x")[:-2], module)
    swap = _Swapper(qconfig, raw_of, device, dtype)
    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, Experts):
            new = swap.experts(name, module)
        elif isinstance(module, nn.Linear) and not isinstance(module, QuantLinear):
            new = swap.linear(name, module)
        else:
            continue
        if new is not None:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
            count += 1
    if count:
        log.info("quantized weights: %s, %d layers (%s)", qconfig.description, count,
                 ", ".join(sorted({m.scheme for m in model.modules() if isinstance(m, (QuantLinear, QuantExperts))})))
    return count


def resolve_scheme(qconfig: QuantConfig, raw: str, warned: set[str] | None = None) -> LayerScheme | None:
    """A layer's scheme (by its checkpoint name), reconciled with what the checkpoint actually stores:
    a layer the config would quantize but that is stored in float loads unquantized (with a note); a
    quantized layer the config leaves alone, or one whose scales are missing, is refused."""
    ls = qconfig.scheme_for(raw)
    tensors = qconfig.tensors
    if not any(f"{raw}.{s}" in tensors for s in ("weight", "qweight", "weight_packed")):
        return ls  # no checkpoint (dummy weights) or a layer the checkpoint does not hold (tied heads)
    weight = tensors.get(f"{raw}.weight")
    stored_float = weight is not None and weight[0] in FLOAT_DTYPES and f"{raw}.qweight" not in tensors \
        and f"{raw}.weight_packed" not in tensors
    if ls is None:
        if not stored_float:
            raise ConfigError(f"checkpoint stores {raw} quantized but its quantization config "
                              f"({qconfig.description}) leaves that layer unquantized: the config does not "
                              "match the weights; re-export the checkpoint")
        return None
    if stored_float:
        if warned is not None and raw not in warned:
            warned.add(raw)
            log.info("note: %s is stored in %s although %s would quantize it: loaded unquantized", raw,
                     weight[0], qconfig.description)
        return None
    payload = f"{raw}.{payload_suffix(ls)}"
    if payload not in tensors:
        raise ConfigError(f"checkpoint lacks {payload}, the quantized weight of {raw} ({qconfig.description}): "
                          "the export is incomplete or of another format; re-export or re-download it")
    for piece, suffix in required_pieces(ls).items():
        names = scale_suffixes(ls) if piece == "scales" else (suffix,)
        if not any(f"{raw}.{s}" in tensors for s in names):
            raise ConfigError(f"checkpoint lacks {raw}.{names[0]}, the {piece} of the {ls.scheme} weight {payload} "
                              f"({qconfig.description}): without it the weights are meaningless; the export is "
                              "incomplete, re-export or re-download it")
    return ls


@dataclass
class _Swapper:
    qconfig: QuantConfig
    raw_of: dict[str, str]  # our (plain) module name -> the checkpoint's
    device: torch.device
    dtype: torch.dtype
    warned: set[str] = field(default_factory=set)

    def raw(self, plain: str) -> str:
        return self.raw_of.get(plain, plain)

    def resolve(self, plain: str) -> LayerScheme | None:
        return resolve_scheme(self.qconfig, self.raw(plain), self.warned)

    def common(self, names: list[str], what: str) -> LayerScheme | None:
        schemes = [self.resolve(n) for n in names]
        if any(s != schemes[0] for s in schemes):
            listed = ", ".join(f"{self.raw(n)}: {s.scheme if s else 'unquantized'}" for n, s in zip(names, schemes))
            raise ConfigError(f"{what} are stored differently ({listed}); blockspec runs them as one layer and needs "
                              "them quantized alike: re-export the checkpoint with one scheme for them")
        return schemes[0]

    def group(self, ls: LayerScheme, k: int) -> int:
        return ls.group_size if ls.group_size or ls.scheme == "fp8" else k

    def check(self, ls: LayerScheme, raw: str, n: int, k: int, group: int, offsets: list[int]) -> None:
        problem = check_shape(ls.scheme, n, k, group)
        if problem is None and ls.scheme == "fp8" and group and any(o % FP8_BLOCK for o in offsets):
            problem = f"its fused parts start at rows {offsets}, not all multiples of the {FP8_BLOCK}-row scale blocks"
        if problem:
            raise ConfigError(f"{raw} cannot be held as {ls.scheme}: {problem}; blockspec cannot serve this checkpoint")

    def linear(self, name: str, module: nn.Linear) -> nn.Module | None:
        owner, _, proj = name.rpartition(".")
        shards = [f"{owner}.{p}" if owner else p for p in SHARDS_OF[proj]] \
            if isinstance(module, FusedLinear) and proj in SHARDS_OF else [name]
        ls = self.common(shards, " / ".join(self.raw(s) for s in shards))
        if ls is None:
            _materialize_linear(module, self.device)
            return None
        n, k = module.out_features, module.in_features
        sizes = list(module.shard_sizes) if len(shards) > 1 else [n]
        group = self.group(ls, k)
        self.check(ls, self.raw(shards[0]), n, k, group, [sum(sizes[:i]) for i in range(len(sizes))])
        layer = QuantLinear(ls.scheme, k, n, group, bias=module.bias is not None, symmetric=ls.symmetric,
                            shard_sizes=sizes, dtype=self.dtype, device=self.device)
        _describe(layer, ls, self.qconfig.description, [self.raw(s) for s in shards])
        return layer

    def experts(self, name: str, module: Experts) -> nn.Module | None:
        e_count, inter = module.num_experts, module.intermediate_size
        hidden = module.gate_up_proj.shape[-1]
        gate_up = self.common([f"{name}.{e}.{p}_proj" for e in range(e_count) for p in ("gate", "up")],
                              f"the gate/up projections of {self.raw(name)}")
        down = self.common([f"{name}.{e}.down_proj" for e in range(e_count)], f"the experts of {self.raw(name)}")
        if gate_up is None and down is None:
            _materialize_experts(module, self.device)
            return None
        if gate_up is None or down is None or gate_up.scheme != down.scheme or gate_up.source != down.source:
            raise ConfigError(f"the experts of {self.raw(name)} mix quantized and unquantized (or differently "
                              "quantized) projections: blockspec needs gate, up and down stored alike")
        g_gu, g_d = self.group(gate_up, hidden), self.group(down, inter)
        self.check(gate_up, self.raw(f"{name}.0.gate_proj"), 2 * inter, hidden, g_gu, [0, inter])
        self.check(down, self.raw(f"{name}.0.down_proj"), hidden, inter, g_d, [0])
        experts = QuantExperts(gate_up.scheme, e_count, hidden, inter, g_gu, g_d, symmetric=gate_up.symmetric,
                               bias=module.gate_up_proj_bias is not None, activation=module.activation,
                               dtype=self.dtype, device=self.device)
        base = self.raw(f"{name}.0.gate_proj").rpartition(".0.gate_proj")[0]
        stacked = gate_up.source in STACKED
        _describe(experts.gate_up_proj, gate_up, self.qconfig.description,
                  [f"{base}.gate_up_proj"] if stacked else [f"{base}.{{e}}.gate_proj", f"{base}.{{e}}.up_proj"])
        _describe(experts.down_proj, down, self.qconfig.description,
                  [f"{base}.down_proj"] if stacked else [f"{base}.{{e}}.down_proj"])
        return experts


def _describe(holder: _QuantTensors, ls: LayerScheme, description: str, raw_shards: list[str]) -> None:
    """What the loader needs to know about a holder: its scheme, its config's name, its checkpoint names."""
    holder.layer_scheme = ls
    holder.quant_description = description
    holder.raw_shards = raw_shards  # expert holders: templates with {e}


def _materialize_linear(module: nn.Linear, device: torch.device) -> None:
    """A deferred (meta) Linear left unquantized: real storage, initialised as a dummy-weights run expects."""
    if not module.weight.is_meta:
        return
    module.weight = nn.Parameter(torch.empty(module.weight.shape, dtype=module.weight.dtype, device=device)
                                 .normal_(0, 0.02), requires_grad=False)
    if module.bias is not None:
        module.bias = nn.Parameter(torch.zeros(module.bias.shape, dtype=module.bias.dtype, device=device),
                                   requires_grad=False)


def _materialize_experts(module: Experts, device: torch.device) -> None:
    for attr, param in list(module.named_parameters(recurse=False)):
        if param.is_meta:
            value = torch.empty(param.shape, dtype=param.dtype, device=device)
            value = value.zero_() if attr.endswith("_bias") else value.normal_(0, 0.02)
            setattr(module, attr, nn.Parameter(value, requires_grad=False))


# ---- 3. loading ---------------------------------------------------------------------------------------------

@dataclass
class _Progress:
    """What one holder has received so far."""

    loaded: set[tuple[str, int | None, int]] = field(default_factory=set)  # (piece, expert, shard)
    globals: dict[tuple[int | None, int], torch.Tensor] = field(default_factory=dict)
    g_idx: dict[tuple[int | None, int], torch.Tensor] = field(default_factory=dict)


class QuantLoader:
    """Routes the stored tensors of quantized layers into the model's QuantLinear / QuantExperts."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.index: dict[str, tuple[_QuantTensors, int | None, int]] = {}
        self.stacked: dict[str, QuantExperts] = {}  # expert stacks stored as one tensor per piece
        self.progress: dict[int, _Progress] = {}
        self.holders: list[_QuantTensors] = []
        for name, module in model.named_modules():
            if isinstance(module, QuantLinear):
                owner, _, proj = name.rpartition(".")
                projs = SHARDS_OF[proj] if len(module.shard_sizes) > 1 and proj in SHARDS_OF else [proj]
                for i, p in enumerate(projs):
                    self.index[f"{owner}.{p}" if owner else p] = (module, None, i)
                self._track(module)
            elif isinstance(module, QuantExperts):
                if module.gate_up_proj.layer_scheme.source in STACKED:
                    self.stacked[name] = module
                for e in range(module.num_experts):
                    self.index[f"{name}.{e}.gate_proj"] = (module.gate_up_proj, e, 0)
                    self.index[f"{name}.{e}.up_proj"] = (module.gate_up_proj, e, 1)
                    self.index[f"{name}.{e}.down_proj"] = (module.down_proj, e, 0)
                self._track(module.gate_up_proj)
                self._track(module.down_proj)

    def _track(self, holder: _QuantTensors) -> None:
        self.holders.append(holder)
        self.progress[id(holder)] = _Progress()

    def __bool__(self) -> bool:
        return bool(self.index)

    @torch.no_grad()
    def load(self, raw_name: str, name: str, tensor: torch.Tensor) -> bool:
        """Take one checkpoint tensor (`name`: its plain causal-LM name) if it belongs to a quantized layer."""
        module, _, suffix = name.rpartition(".")
        if module in self.stacked:
            return self._load_stacked(self.stacked[module], raw_name, suffix, tensor)
        entry = self.index.get(module)
        if entry is None:
            return False
        holder, expert, shard = entry
        n, k = holder.shard_sizes[shard], holder.in_features
        piece = convert(holder.layer_scheme, raw_name, suffix, tensor, n, k, holder.group_size, holder.dtype)
        if piece is None:
            return True
        kind, value = piece
        progress = self.progress[id(holder)]
        if kind == "zeros" and holder.zeros is None:  # symmetric int8 formats that store their zero points anyway
            if bool((value != 0).any()):
                raise ConfigError(f"checkpoint tensor {raw_name} holds non-zero zero points but "
                                  f"{holder.quant_description} declares symmetric quantization: the checkpoint "
                                  "does not match its config")
        elif kind == "global":
            progress.globals[(expert, shard)] = value.float()
        elif kind == "g_idx":
            progress.g_idx[(expert, shard)] = value.to(torch.int64)
        else:
            target = self._rows(holder, kind, expert, shard, raw_name)
            if tuple(target.shape) != tuple(value.shape):
                raise ConfigError(f"checkpoint tensor {raw_name} gives {kind} of shape {tuple(value.shape)} where the "
                                  f"model needs {tuple(target.shape)}: config.json and the weights disagree")
            target.copy_(value)
        progress.loaded.add((kind, expert, shard))
        return True

    def _load_stacked(self, experts: QuantExperts, raw_name: str, suffix: str, tensor: torch.Tensor) -> bool:
        """`{proj}_{piece}` of a stacked format: the whole stack's piece at once (biases are not ours)."""
        proj, _, part = suffix.rpartition("_")
        holder = {"gate_up_proj": experts.gate_up_proj, "down_proj": experts.down_proj}.get(proj)
        if holder is None or part == "bias":
            return False
        kind, value = convert_stacked(holder.layer_scheme, raw_name, part, tensor, holder.num_experts,
                                      holder.out_features, holder.in_features)
        target = getattr(holder, kind)
        if tuple(target.shape) != tuple(value.shape):
            raise ConfigError(f"checkpoint tensor {raw_name} gives {kind} of shape {tuple(value.shape)} where the "
                              f"model needs {tuple(target.shape)}: config.json and the weights disagree")
        target.copy_(value)
        loaded = self.progress[id(holder)].loaded
        loaded.update((kind, e, i) for e in range(holder.num_experts) for i in range(len(holder.shard_sizes)))
        return True

    def _rows(self, holder: _QuantTensors, kind: str, expert: int | None, shard: int, raw_name: str) -> torch.Tensor:
        full = getattr(holder, kind, None)
        if full is None:
            raise ConfigError(f"checkpoint tensor {raw_name} holds {kind}, which a {holder.layer_scheme.scheme} layer "
                              f"of {holder.quant_description} does not have: the checkpoint does not match its config")
        if expert is not None and kind != "bias":
            full = full[expert]
        start, size = holder.shard_offset(shard), holder.shard_sizes[shard]
        if kind == "scales" and holder.scheme == "fp8" and holder.group_size:  # rows of 128x128 blocks
            start, size = start // FP8_BLOCK, math.ceil(size / FP8_BLOCK)
        return full[start:start + size]

    @torch.no_grad()
    def finish(self) -> None:
        """After the last tensor: everything present, NVFP4 globals unified, act-order applied."""
        for holder in self.holders:
            progress = self.progress[id(holder)]
            self._check_complete(holder, progress)
            experts = list(range(holder.num_experts)) if isinstance(holder, QuantExpertWeights) else [None]
            if holder.scheme == "nvfp4":
                for e in experts:
                    _unify_globals(holder, e, [progress.globals[(e, i)] for i in range(len(holder.shard_sizes))])
            if progress.g_idx:
                _apply_act_order(holder, experts, progress.g_idx)
        finalize_quantized(self.model)

    def _check_complete(self, holder: _QuantTensors, progress: _Progress) -> None:
        pieces = required_pieces(holder.layer_scheme)
        if holder.bias is not None:
            pieces["bias"] = "bias"
        experts = range(holder.num_experts) if isinstance(holder, QuantExpertWeights) else [None]
        for e in experts:
            for i, raw in enumerate(holder.raw_shards):
                for piece, suffix in pieces.items():
                    if (piece, e, i) not in progress.loaded:
                        where = stored_name(holder.layer_scheme, raw.format(e=e) if e is not None else raw, suffix)
                        raise ConfigError(f"the checkpoint lacks {where} ({holder.quant_description}: every "
                                          f"quantized layer needs {', '.join(pieces.values())}): the checkpoint is "
                                          "incomplete or not what its config declares; re-download or re-export it")


def _unify_globals(holder: _QuantTensors, e: int | None, values: list[torch.Tensor]) -> None:
    """One global scale per layer: fused shards with different globals get their FP8 block scales
    rescaled to the largest (exact when they agree, which exporters arrange for q/k/v and gate/up)."""
    target = holder.global_scale if e is None else holder.global_scale[e]
    top = torch.stack(values).max()
    if not all(torch.equal(v, values[0]) for v in values):
        log.warning("warning: %s and the projections fused with it have different NVFP4 global scales: their "
                    "FP8 block scales are requantized to the largest global (up to 1/16 relative change per block;"
                    " exporters that share one global across fused projections avoid this)", holder.raw_shards[0])
        scales = holder.scales if e is None else holder.scales[e]
        for i, v in enumerate(values):
            rows = scales[holder.shard_offset(i):holder.shard_offset(i) + holder.shard_sizes[i]]
            rows.copy_((rows.float() * (v / top)).to(rows.dtype))
    target.copy_(top)


def _apply_act_order(holder: _QuantTensors, experts: list[int | None], g_idx: dict) -> None:
    """GPTQ act-order: permute the columns so group k // G holds column k; x is permuted to match."""
    k, group = holder.in_features, holder.group_size
    trivial = torch.arange(k, device=holder.qweight.device) // group
    perms = []
    for e in experts:
        found = [g_idx[(e, i)] for i in range(len(holder.shard_sizes)) if (e, i) in g_idx]
        if not found or all(torch.equal(g, trivial) for g in found):
            perms.append(None)
            continue
        orders = [torch.argsort(g, stable=True) for g in found]
        if len(found) != len(holder.shard_sizes) or any(not torch.equal(o, orders[0]) for o in orders):
            raise ConfigError(f"{holder.raw_shards[0]}: the fused projections have different act-order (g_idx) "
                              "permutations; blockspec runs them as one layer and cannot serve this checkpoint")
        order = orders[0]
        if not torch.equal(found[0][order], trivial):
            raise ConfigError(f"{holder.raw_shards[0]}: g_idx does not give every group {group} columns; "
                              "blockspec cannot serve this act-order layout")
        q = holder.qweight if e is None else holder.qweight[e]
        if holder.scheme == "int4":
            q.copy_(pack_nibbles(unpack_nibbles(q).index_select(-1, order)))
        else:
            q.copy_(q.index_select(-1, order))
        perms.append(order)
    if all(p is None for p in perms):
        return
    if experts == [None]:
        holder.perm = perms[0]
    else:
        ident = torch.arange(k, device=trivial.device)
        holder.perm = torch.stack([ident if p is None else p for p in perms])


def finalize_quantized(model: nn.Module) -> None:
    """Quantized layers the model reads as plain weights (the LM head) become dequantized Linears."""
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantLinear) and name.rpartition(".")[2] in DEQUANTIZE_AFTER_LOAD:
            weight = module.dequantize()
            if module.perm is not None:
                weight = torch.empty_like(weight).index_copy_(1, module.perm, weight)
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                              device="meta")
            plain.weight = nn.Parameter(weight, requires_grad=False)
            if module.bias is not None:
                plain.bias = nn.Parameter(module.bias.detach().clone(), requires_grad=False)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, plain)
            log.info("note: %s is stored quantized; it is kept dequantized in %s (the logits read its weight)",
                     name, str(weight.dtype).removeprefix("torch."))
