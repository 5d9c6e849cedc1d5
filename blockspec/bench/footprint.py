"""What a model costs in memory and in bytes read per token, computed from config.json alone.

`blockspec plan` must answer "does it fit, how fast can it go" before any weight is downloaded, so
parameter counts come from the architecture fields (dense, MoE, Gated DeltaNet hybrids, DFlash
drafters). When safetensors files are present their headers (not their data) give exact stored
bytes, which also covers quantized checkpoints whose bit widths the config only hints at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Model families whose attention has per-head q/k RMSNorm, and those whose q_proj also emits an
# output gate (Qwen3-Next and Qwen3.5 full-attention layers).
QK_NORM_TYPES = ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
GATED_Q_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Checkpoint parts the loader never reads (vision towers, multi-token-prediction heads).
SKIPPED_MARKERS = ("visual.", "vision_tower", "multi_modal_projector", "mtp.")


@dataclass
class Footprint:
    """Parameter counts and byte figures of one model (target or drafter)."""

    total_params: int
    active_params: int  # parameters used per token (MoE: routed top-k experts only)
    embedding_params: int  # input embedding table: one row read per token
    lm_head_params: int  # read in full for every token (tied: the embedding table)
    weight_bytes: int  # resident in memory
    read_bytes_per_token: int  # weights read by one decode step at batch 1 (the roofline's bytes)
    full_attention_layers: int
    linear_attention_layers: int
    kv_bytes_per_token: int  # K + V of every attention layer, in the KV dtype
    state_bytes_per_seq: int  # recurrent + conv state of linear-attention layers, no checkpoints
    bytes_source: str  # "config" (estimated from the fields) or "safetensors headers"
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields (VLM wrappers keep them under text_config)."""
    if "text_config" in cfg and "hidden_size" not in cfg:
        text = dict(cfg["text_config"])
        text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        text.setdefault("quantization_config", cfg.get("quantization_config"))
        return text
    return cfg


def layer_types(cfg: dict[str, Any]) -> list[str]:
    """'full_attention' / 'linear_attention' / 'sliding_attention' per layer."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types:
        return [str(t) for t in types][:n]
    interval = cfg.get("full_attention_interval")
    if interval and "linear_num_value_heads" in cfg:
        return ["full_attention" if (i + 1) % int(interval) == 0 else "linear_attention" for i in range(n)]
    return ["full_attention"] * n


def _attention_params(cfg: dict[str, Any]) -> int:
    h, nh = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    nkv = int(cfg.get("num_key_value_heads") or nh)
    hd = int(cfg.get("head_dim") or h // nh)
    mt = str(cfg.get("model_type", ""))
    q_out = nh * hd * (2 if mt in GATED_Q_TYPES or cfg.get("attn_output_gate") else 1)
    n = h * q_out + 2 * h * nkv * hd + nh * hd * h
    if mt == "qwen2":
        n += q_out + 2 * nkv * hd  # q/k/v biases, none on o_proj
    elif cfg.get("attention_bias"):
        n += q_out + 2 * nkv * hd + h  # all four projections
    if mt in QK_NORM_TYPES:
        n += 2 * hd
    if mt == "gpt_oss":
        n += nh  # one attention sink logit per head
    return n


def linear_attention_dims(cfg: dict[str, Any]) -> tuple[int, int, int, int, int]:
    """(key heads, value heads, key head dim, value head dim, conv kernel) of a Gated DeltaNet layer."""
    return (int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"]), int(cfg["linear_key_head_dim"]),
            int(cfg["linear_value_head_dim"]), int(cfg.get("linear_conv_kernel_dim", 4)))


def _linear_attention_params(cfg: dict[str, Any]) -> int:
    h = int(cfg["hidden_size"])
    nk, nv, dk, dv, kernel = linear_attention_dims(cfg)
    key_dim, value_dim = nk * dk, nv * dv
    conv_dim = 2 * key_dim + value_dim
    # in_proj qkv + z + b + a, depthwise conv, dt_bias + A_log, gated norm, out_proj.
    return h * conv_dim + h * value_dim + 2 * h * nv + conv_dim * kernel + 2 * nv + dv + value_dim * h


def recurrent_state_bytes(cfg: dict[str, Any], dtype_name: str, checkpoints: int = 0) -> int:
    """One sequence's Gated DeltaNet state across all linear-attention layers, by the engine's own rule
    (models/layers/recurrent_state.bytes_per_sequence): conv state in the model dtype, the delta-rule
    state in `mamba_ssm_dtype` (float32 by default) times 1 + checkpoints."""
    from types import SimpleNamespace

    import torch

    from blockspec.models.layers.recurrent_state import bytes_per_sequence

    cfg = text_config(cfg)
    n_linear = sum(t == "linear_attention" for t in layer_types(cfg))
    if not n_linear:
        return 0
    nk, nv, dk, dv, kernel = linear_attention_dims(cfg)
    layer = SimpleNamespace(num_v_heads=nv, head_k_dim=dk, head_v_dim=dv, conv_kernel=kernel,
                            conv_dim=2 * nk * dk + nv * dv, state_dtype_name=cfg.get("mamba_ssm_dtype"))
    return bytes_per_sequence([layer] * n_linear, getattr(torch, dtype_name), checkpoints)


def _moe_layers(cfg: dict[str, Any]) -> list[bool]:
    n = int(cfg["num_hidden_layers"])
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if experts <= 0:
        return [False] * n
    dense_only = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step") or 1)
    return [i not in dense_only and (i + 1) % step == 0 for i in range(n)]


def _mlp_params(cfg: dict[str, Any], moe: bool) -> tuple[int, int, int]:
    """(total, active per token, routed-expert matrices of total) parameters of one layer's MLP."""
    h = int(cfg["hidden_size"])
    if not moe:
        inter = int(cfg["intermediate_size"])
        n = 3 * h * inter + (2 * inter + h if cfg.get("mlp_bias") else 0)
        return n, n, 0
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts"))
    top_k = int(cfg.get("num_experts_per_tok") or 1)
    inter = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    shared_inter = int(cfg.get("shared_expert_intermediate_size") or 0)
    per_expert = 3 * h * inter
    shared = 3 * h * shared_inter + h if shared_inter else 0  # shared expert + its sigmoid gate
    router = experts * h
    biases = 0
    if cfg.get("model_type") == "gpt_oss":  # router bias; per expert gate|up and down biases
        router += experts
        biases = 2 * inter + h
    total = experts * (per_expert + biases) + router + shared
    return total, top_k * (per_expert + biases) + router + shared, experts * per_expert


def target_footprint(config: dict[str, Any], dtype_name: str, model_dir: Path | None = None) -> Footprint:
    """Counts for a causal LM (dense, MoE or hybrid) from its config.json dict, weights and KV cache in
    `dtype_name` (float32 / bfloat16 / float16)."""
    cfg = text_config(config)
    elem_bytes = kv_elem = DTYPE_BYTES[dtype_name]
    h, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    nh = int(cfg["num_attention_heads"])
    nkv = int(cfg.get("num_key_value_heads") or nh)
    hd = int(cfg.get("head_dim") or h // nh)
    types = layer_types(cfg)
    moe = _moe_layers(cfg)
    tied = bool(cfg.get("tie_word_embeddings", False))
    linear_params = total = active = experts_total = 0
    for t, is_moe in zip(types, moe):
        mix = _linear_attention_params(cfg) if t == "linear_attention" else _attention_params(cfg)
        mlp_total, mlp_active, routed = _mlp_params(cfg, is_moe)
        norms = 2 * h
        total += mix + mlp_total + norms
        active += mix + mlp_active + norms
        linear_params += mix + mlp_total
        experts_total += routed
    embed = vocab * h
    head = 0 if tied else vocab * h
    total += embed + head + h
    active += embed + head + h
    n_full = sum(t != "linear_attention" for t in types)
    n_linear = len(types) - n_full
    notes: list[str] = []
    bits = quant_bits(cfg.get("quantization_config"), h, elem_bytes)
    if bits is not None:
        # MXFP4 (GPT-OSS) quantizes the routed experts only; the other methods every decoder linear layer
        experts_only = str((cfg.get("quantization_config") or {}).get("quant_method", "")).lower() == "mxfp4"
        quantized = experts_total if experts_only else linear_params
        weight_bytes = int(quantized * bits / 8) + (total - quantized) * elem_bytes
        notes.append(f"quantized checkpoint: {'routed experts' if experts_only else 'decoder linear layers'} "
                     f"counted at {bits:g} bits per weight")
    else:
        weight_bytes = total * elem_bytes
    expert_bytes = int(experts_total * (bits / 8 if bits is not None else elem_bytes))
    top_k = int(cfg.get("num_experts_per_tok") or 1)
    n_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 1)
    idle_expert_bytes = int(expert_bytes * (1 - top_k / n_experts)) if experts_total else 0
    embed_bytes = embed * elem_bytes
    source = "config"
    header = held = None
    if model_dir is not None:
        from blockspec.loader.safetensors_loader import read_tensor_headers

        tensors = read_tensor_headers(model_dir)  # once, for both questions below
        held = _quantized_bytes(model_dir, elem_bytes, tensors, notes)
        header = held if held is not None else safetensors_bytes(tensors)
    if header is not None:
        stored, stored_experts, stored_embed = header
        weight_bytes, source = stored, "safetensors headers"
        idle_expert_bytes = int(stored_experts * (1 - top_k / n_experts)) if stored_experts else idle_expert_bytes
        embed_bytes = stored_embed or embed_bytes
        notes.append("weight bytes from the safetensors headers: quantized layers as held in memory (packed "
                     f"weights + scales), the rest in {dtype_name}" if held is not None else
                     "weight bytes read from the safetensors headers (as stored)")
    # One decode step reads every active weight once, but only one row of the input embedding
    # (unless the embedding doubles as the LM head).
    read = weight_bytes - idle_expert_bytes - (0 if tied else embed_bytes)
    if experts_total:
        notes.append(f"MoE: {top_k} of {n_experts} experts per token; memory counts all, the roofline the active")
    return Footprint(
        total_params=total, active_params=active, embedding_params=embed, lm_head_params=vocab * h,
        weight_bytes=weight_bytes, read_bytes_per_token=read, full_attention_layers=n_full,
        linear_attention_layers=n_linear, kv_bytes_per_token=n_full * 2 * nkv * hd * kv_elem,
        state_bytes_per_seq=recurrent_state_bytes(cfg, dtype_name),
        bytes_source=source, notes=notes)


def drafter_footprint(config: dict[str, Any], dtype_name: str, quantization: str | None = None,
                      target_vocab_hidden: tuple[int, int] | None = None) -> Footprint:
    """Counts for a z-lab DFlash drafter: decoder layers + fc + norms (DFlash 2: + the convolutions and the
    candidate selector); embedding and LM head are the target's. A step reads all of it but the selector's
    codebooks, of which it reads a few rows. With `quantization` (--speculative-config's online method) its
    projections are counted as that layout holds them, plus its rounded copy of the target's LM head
    (target_vocab_hidden: the target's vocabulary and hidden size; the drafter's own fields otherwise)."""
    elem_bytes = kv_elem = DTYPE_BYTES[dtype_name]
    h = int(config["hidden_size"])
    nh = int(config["num_attention_heads"])
    nkv = int(config.get("num_key_value_heads") or nh)
    hd = int(config.get("head_dim") or h // nh)
    inter = int(config["intermediate_size"])
    n_layers = int(config["num_hidden_layers"])
    dflash = config.get("dflash_config") or {}
    n_ctx = len(dflash.get("target_layer_ids") or config.get("target_layer_ids") or [None] * n_layers)
    qwen3_like = {**config, "model_type": "qwen3"}  # drafter layers are Qwen3 blocks (q/k norm)
    per_layer = _attention_params(qwen3_like) + 3 * h * inter + 2 * h
    taps, group = int(dflash.get("conv_kernel_size") or 0), int(dflash.get("conv_group_size") or 1)
    per_layer += 2 * (2 * taps * h + h * 2 * taps * (h // group))  # attention_conv, mlp_conv
    rank = int(dflash.get("selector_rank") or 0)
    codebooks = 2 * int(config["vocab_size"]) * rank
    total = n_layers * per_layer + n_ctx * h * h + 2 * h + codebooks + h * rank
    weight_bytes, head_params, notes = total * elem_bytes, 0, []
    if quantization is not None:
        from blockspec.loader.quant.online import draft_head_copy, online_scheme

        scheme = online_scheme(quantization)
        # the projections quantize_online rounds, [out, in] each (spec/dflash.DFlashDrafter.quantizable)
        shapes = [((nh + 2 * nkv) * hd, h), (h, nh * hd), (2 * inter, h), (h, inter)] * n_layers + [(h, n_ctx * h)]
        rounded = sum(n * k for n, k in shapes)
        weight_bytes += sum(scheme.bytes_for(n, k, elem_bytes) for n, k in shapes) - rounded * elem_bytes
        notes.append(f"drafter in {scheme.describe()}")
        if draft_head_copy():  # BLOCKSPEC_DRAFT_HEAD
            vocab, hidden = target_vocab_hidden or (int(config["vocab_size"]), h)
            head_params = vocab * hidden
            weight_bytes += scheme.bytes_for(vocab, hidden, elem_bytes)
            notes[-1] += ", with its own rounded copy of the target's LM head"
    read = weight_bytes - codebooks * elem_bytes
    return Footprint(
        total_params=total + head_params, active_params=total + head_params - codebooks, embedding_params=0,
        lm_head_params=head_params, weight_bytes=weight_bytes, read_bytes_per_token=read,
        full_attention_layers=n_layers, linear_attention_layers=0,
        kv_bytes_per_token=n_layers * 2 * nkv * hd * kv_elem, state_bytes_per_seq=0, bytes_source="config",
        notes=notes)


def _quantized_bytes(model_dir: Path, elem_bytes: int, tensors: dict[str, tuple[str, tuple[int, ...]]],
                     notes: list[str]) -> tuple[int, int, int] | None:
    """In-memory bytes of a quantized checkpoint (loader.quant.bytes); None when unquantized or unreadable."""
    from blockspec.errors import BlockspecError
    from blockspec.loader.quant.bytes import checkpoint_memory_bytes

    try:
        return checkpoint_memory_bytes(model_dir, elem_bytes, tensors)
    except BlockspecError as exc:
        notes.append(f"quantized bytes counted as stored: {exc}")
        return None


def quant_bits(qcfg: dict[str, Any] | None, hidden: int = 4096, elem_bytes: int = 2) -> float | None:
    """Effective bits per weight (scales included, as held in memory) of a quantization_config, or None
    when unquantized; formats blockspec cannot load get a rough figure from their bit width."""
    if not qcfg:
        return None
    from blockspec.loader.quant.bytes import declared_bits_per_weight

    held = declared_bits_per_weight(qcfg, hidden, elem_bytes)
    if held is not None:
        return held
    method = str(qcfg.get("quant_method", "")).lower()
    if method == "fp8":
        return 8.0
    if method in ("awq", "gptq", "autoround", "auto-round"):
        bits = float(qcfg.get("bits", 4))
        group = int(qcfg.get("group_size", 128) or 128)
        return bits + 32 / group  # fp16 scale + zero point per group
    if method == "modelopt":
        algo = str(qcfg.get("quant_algo", "")).upper()
        return 4.5 if "FP4" in algo else 8.0
    if method == "compressed-tensors":
        for group in (qcfg.get("config_groups") or {}).values():
            w = (group or {}).get("weights") or {}
            bits = w.get("num_bits")
            if bits:
                size = int(w.get("group_size") or 0)
                if bits == 4 and str(w.get("type")) == "float":
                    return 4.5  # NVFP4: fp8 scale per 16 weights
                return float(bits) + (16 / size if size else 0)
        return 8.0
    if "bits" in qcfg:
        return float(qcfg["bits"])
    return None


def safetensors_bytes(tensors: dict[str, tuple[str, tuple[int, ...]]]) -> tuple[int, int, int] | None:
    """(stored bytes, routed-expert bytes, input-embedding bytes) from the headers (read_tensor_headers),
    or None without files."""
    from blockspec.loader.quant.bytes import SAFETENSORS_BYTES, split_bytes

    if not tensors:
        return None
    return split_bytes((name, math.prod(shape) * SAFETENSORS_BYTES.get(dtype, 1))
                       for name, (dtype, shape) in tensors.items() if not any(m in name for m in SKIPPED_MARKERS))
