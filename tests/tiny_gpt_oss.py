"""Tiny random GPT-OSS checkpoints written by transformers itself: bf16-layout (as transformers saves it)
and MXFP4 (the experts as `*_blocks` / `*_scales`, everything else as stored, the config's
quantization_config as the published checkpoints declare it).

Small sliding window and a YaRN rope with `truncate: false`, so the windowed layers and the rope's
fractional ramp both matter at test lengths; weights perturbed so biases, sinks and norms are not trivial.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.conftest import VOCAB, write_tokenizer

CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
              max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=258,
              bos_token_id=None, pad_token_id=None,
              rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128})
MXFP4_CONFIG = {"quant_method": "mxfp4",
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"]}


def tiny_config(**overrides):
    import transformers

    return transformers.GptOssConfig(**{**CONFIG, **overrides})


def random_model(seed: int = 0, **overrides):
    """transformers' GptOssForCausalLM (fp32, eager attention) with perturbed random weights."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(tiny_config(**overrides)).float().eval()
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "embed" in name:
                p.copy_(torch.randn_like(p))
            elif name.endswith(("bias", "sinks")):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.08)
    return model


def save_tiny_gpt_oss(out: Path, seed: int = 0, **overrides) -> Path:
    """The bf16-layout checkpoint (fp32 here), as transformers' save_pretrained writes it."""
    random_model(seed, **overrides).save_pretrained(out, safe_serialization=True)
    _tokenizer(out)
    return out


def mxfp4_pack(w: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 codes for a weight stack [E, N, K]: `blocks` uint8 [E, N, K/32, 16] (two E2M1 codes a
    byte, the even element in the low nibble) and `scales` uint8 E8M0 [E, N, K/32] near w's magnitude."""
    e, n, k = w.shape
    blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    exp = torch.log2(w.abs().amax(-1, keepdim=True).clamp_min(1e-6) / 6).round().to(torch.int32)
    scales = (127 + exp + torch.randint(-1, 2, (e, n, k // 32), generator=gen, dtype=torch.int32)).to(torch.uint8)
    return blocks, scales


def save_tiny_gpt_oss_mxfp4(out: Path, seed: int = 0, **overrides) -> Path:
    """The same model with MXFP4 experts: random codes and scales in the checkpoint's stacked layout (gate
    and up rows interleaved, as the bf16 stack's columns are), biases and all other tensors as stored."""
    from safetensors.torch import save_file

    model = random_model(seed, **overrides)
    gen = torch.Generator().manual_seed(seed + 100)
    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4_pack(t.transpose(1, 2), gen)  # [E, K, N] in memory, rows of N stored
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        else:
            tensors[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    config = model.config.to_dict()
    config.update(architectures=["GptOssForCausalLM"], quantization_config=MXFP4_CONFIG, torch_dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(config))
    _tokenizer(out)
    return out


def _tokenizer(out: Path) -> None:
    write_tokenizer(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [258]}))


def save_tiny_gpt_oss_drafter(out: Path, target_dir: Path, block_size: int = 16) -> Path:
    """A random DFlash drafter for the tiny target, in the shape of z-lab's GPT-OSS drafters: Qwen3 layers with
    q/k/v/o biases, rope theta 150000, config.json's model_type "gpt_oss" (written with the reference package)."""
    from transformers import AutoConfig

    from tests.conftest import save_tiny_drafter

    save_tiny_drafter(out, AutoConfig.from_pretrained(target_dir), target_layer_ids=[0, 2], block_size=block_size,
                      mask_token_id=300, attention_bias=True, rope_theta=150000.0)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "model_type": "gpt_oss"}))
    return out


def save_tiny_gpt_oss_pair(root: Path) -> dict[str, Path]:
    """bf16 and MXFP4 targets and a drafter for the bf16 one, from seeds whose greedy outputs vary (with seed 0
    the tiny models fall into repeating one token): {"bf16", "mxfp4", "drafter"}."""
    bf16 = save_tiny_gpt_oss(root / "bf16", seed=1)
    return {"bf16": bf16, "mxfp4": save_tiny_gpt_oss_mxfp4(root / "mxfp4", seed=2),
            "drafter": save_tiny_gpt_oss_drafter(root / "drafter", bf16)}
