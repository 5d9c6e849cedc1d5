"""A fresh drafter for a target: which target layers it reads, its mask token, its initial weights."""

from __future__ import annotations

import torch
from torch import nn

from blockspec.errors import ConfigError
from blockspec.models.layers.linear import FusedLinear
from blockspec.spec.dflash import DFlashDrafter, DrafterConfig, default_target_layer_ids

DEFAULT_NUM_FEATURE_LAYERS = 5  # DESIGN.md §1: typically 5 target layers spread from 1 to L-3


def spread_layer_ids(num_target_layers: int, count: int = DEFAULT_NUM_FEATURE_LAYERS) -> list[int]:
    """`count` target layers spread from layer 1 to L-3 (fewer for very shallow targets)."""
    count = max(1, min(count, num_target_layers - 3)) if num_target_layers > 4 else 1
    return default_target_layer_ids(num_target_layers, count)


def parse_layer_ids(text: str | None, num_target_layers: int) -> list[int]:
    if not text:
        return spread_layer_ids(num_target_layers)
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--target-layer-ids {text!r}: give comma-separated layer indices, e.g. 1,8,14") from None
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if not ids or bad:
        raise ConfigError(f"--target-layer-ids {text!r}: the target has layers 0..{num_target_layers - 1}")
    return ids


def pick_mask_token(tokenizer, response_counts: torch.Tensor, vocab_size: int) -> int:
    """An existing token the target never writes in the data, so MASK cannot be confused with text.

    Prefer the highest-numbered special token that is not a role/eos/bos/pad token (SmolLM2: one of
    its code-dataset markers); otherwise the highest vocabulary id absent from the responses."""
    reserved = {getattr(tokenizer, n, None) for n in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    template = getattr(tokenizer, "chat_template", None) or ""
    specials = []
    for tid, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
        text = getattr(tok, "content", str(tok))
        if tid not in reserved and tid < vocab_size and text not in template:
            specials.append(tid)
    for tid in sorted(specials, reverse=True):
        if response_counts[tid] == 0:
            return tid
    unused = torch.nonzero(response_counts[:vocab_size] == 0).flatten()
    if len(unused) == 0:
        raise ConfigError("every vocabulary id occurs in the data: pass --mask-token-id")
    return int(unused[-1])


def init_weights(drafter: nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Linear weights N(0, std), norms one (the usual Qwen3 initialisation), reproducibly; DFlash 2's
    convolutions start as the identity (tap 0 one, the others and the dynamic part near zero).

    A fused projection (q|k|v, gate|up) draws shard by shard, so the random stream and the weights are
    those of the unfused layout (z-lab's tensor order) for a given seed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("base_kernel"):
                p.zero_()
                p[:, 0] = 1.0
            elif p.dim() == 2:
                owner = drafter.get_submodule(name.rpartition(".")[0])
                sizes = owner.shard_sizes if isinstance(owner, FusedLinear) else [p.shape[0]]
                p.copy_(torch.cat([torch.randn((n, *p.shape[1:]), generator=g) for n in sizes]) * std)
            else:
                p.zero_()


def build_training_drafter(cfg: DrafterConfig, max_positions: int, device: torch.device, seed: int = 0
                           ) -> DFlashDrafter:
    """The drafter to train: float32 master weights, built directly on `device`."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device(device):
            drafter = DFlashDrafter(cfg, max_positions)
    finally:
        torch.set_default_dtype(previous)
    init_weights(drafter, seed=seed)
    return drafter.train()


def copy_final_norm(drafter: DFlashDrafter, target: nn.Module) -> bool:
    """Start the drafter's final norm from the target's: both feed the same LM head, and the head's
    logit scale depends on it (SmolLM2's is ~1.8, not 1). False if the target has no `model.norm`."""
    norm = getattr(getattr(target, "model", None), "norm", None)
    weight = getattr(norm, "weight", None)
    if weight is None or weight.shape != drafter.norm.weight.shape:
        return False
    with torch.no_grad():
        drafter.norm.weight.copy_(weight)
    return True


def identity_convolutions(drafter: nn.Module) -> None:
    """DFlash 2's convolutions exactly the identity (their dynamic taps zero, not small): a DFlash 2 drafter
    started from a DFlash 1 drafter then drafts as that drafter did, and training moves on from there."""
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("conv.kernel_projection.weight"):
                p.zero_()
