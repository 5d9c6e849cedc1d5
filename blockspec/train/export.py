"""Writing a trained drafter as a z-lab DFlash checkpoint directory.

config.json carries the Qwen3-style fields plus block_size, num_target_layers and dflash_config
{mask_token_id, target_layer_ids}; model.safetensors holds the z-lab tensor names (fc, hidden_norm,
layers.{i}.*, norm). DFlashDrafter keeps those names except for its fused projections (qkv_proj,
gate_up_proj), which are split back into q_proj/k_proj/v_proj and gate_proj/up_proj here. DFlash 2
drafters (DFlash2DraftModel) add their convolution and selector fields to dflash_config and store the
selector's codebooks as z-lab does (without ".weight"). blockspec (--draft) and the `dflash` reference
package both load the result.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from blockspec.models.layers.linear import FUSED_SHARDS, FusedLinear
from blockspec.models.model_config import ModelConfig
from blockspec.spec.dflash import CODEBOOKS, DFlashDrafter

WEIGHTS = "model.safetensors"


def drafter_config_json(target: ModelConfig, num_layers: int, block_size: int, mask_token_id: int,
                        target_layer_ids: list[int], max_position_embeddings: int | None = None,
                        dtype: str = "bfloat16", dflash2: dict[str, int] | None = None) -> dict[str, Any]:
    """A drafter of the target's width and head layout, non-causal full attention in every layer; with
    `dflash2` (conv_kernel_size, conv_group_size, selector_rank, selector_top_k) a DFlash 2 drafter."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": target.rope_theta}
    if target.rope_scaling:
        rope = {**target.rope_scaling, "rope_theta": target.rope_theta}
    cfg: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": target.vocab_size,
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "rope_parameters": rope,
        "max_position_embeddings": max_position_embeddings or target.max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * num_layers,
        "torch_dtype": dtype,
        "block_size": block_size,
        "num_target_layers": target.num_hidden_layers,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
    }
    if target.rope_scaling:
        cfg["rope_scaling"] = dict(target.rope_scaling)
    return as_dflash2(cfg, block_size, dflash2) if dflash2 else cfg


def as_dflash2(config_json: dict[str, Any], block_size: int, dflash2: dict[str, int]) -> dict[str, Any]:
    """A DFlash 1 drafter config turned into DFlash 2's: the same layers, widths, target layers and mask
    token, plus the convolution and selector fields, at `block_size`."""
    cfg = {**config_json, "architectures": ["DFlash2DraftModel"], "is_causal": False, "block_size": block_size}
    cfg["dflash_config"] = {**config_json["dflash_config"], "block_size": block_size, **dflash2}
    return cfg


def zlab_state_dict(drafter: DFlashDrafter) -> dict[str, torch.Tensor]:
    """The drafter's state dict under z-lab's names and shapes: every FusedLinear split into the checkpoint
    projections it holds (the inverse of the loading side, weight_utils.copy_named)."""
    checkpoint_name = {slot: proj for proj, slot in FUSED_SHARDS.items()}  # (fused name, shard) -> proj
    fused = {name: m for name, m in drafter.named_modules() if isinstance(m, FusedLinear)}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in drafter.state_dict().items():
        owner, _, rest = name.rpartition(".")  # rest: weight | bias
        layer = fused.get(owner)
        if layer is None:
            out[owner if owner in CODEBOOKS else name] = tensor
            continue
        parent, _, attr = owner.rpartition(".")
        for shard, size in enumerate(layer.shard_sizes):
            start = layer.shard_offset(shard)
            proj = checkpoint_name[(attr, shard)]
            out[f"{parent}.{proj}.{rest}" if parent else f"{proj}.{rest}"] = tensor[start:start + size]
    return out


def save_drafter(drafter: DFlashDrafter, config: dict[str, Any], out_dir: Path,
                 dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json + model.safetensors (weights cast to `dtype`); returns out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().to("cpu", dtype).contiguous() for name, p in zlab_state_dict(drafter).items()}
    cfg = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    tmp = out_dir / (WEIGHTS + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out_dir / WEIGHTS)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out_dir


def write_model_card(out_dir: Path, title: str, sections: dict[str, str]) -> Path:
    """README.md: a title and one short section per entry (data, training, evaluation, ...)."""
    lines = [f"# {title}", ""]
    for head, body in sections.items():
        lines += [f"## {head}", "", body.strip(), ""]
    path = out_dir / "README.md"
    path.write_text("\n".join(lines))
    return path
