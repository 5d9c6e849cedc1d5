"""Shared fixtures: tiny random checkpoints in the real Hugging Face layouts, and a byte-level tokenizer.

Tiny models keep the CPU suite fast while exercising exactly the code paths real checkpoints use:
config.json + safetensors written by transformers itself, loaded by our loader.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from blockspec.kernels._triton import INTERPRET

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 320  # 256 bytes + 3 specials + unused rows (some used as the drafter's mask token)


def write_tokenizer(out: Path) -> None:
    """A byte-level BPE with no merges: every byte is a token, so any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_map = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_map))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token=None,
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(out)


def tiny_config(arch: str, **overrides):
    """A tiny transformers config of the given family (fp32, random weights)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=258, bos_token_id=None)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**{**common, "head_dim": 16, **overrides})
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**{**common, **overrides})
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**{**common, "head_dim": 16, **overrides})
    else:
        raise ValueError(arch)
    return cfg


def save_tiny_model(out: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Write a random tiny HF checkpoint (weights perturbed so norms are not all ones) plus tokenizer."""
    import transformers

    cfg = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.05 if p.dim() > 1 and "embed" not in name else torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [258]}))
    return out


# DFlash 2 fields of the tiny drafters (z-lab's real ones: taps 2, groups of 16, rank 256, top 16)
TINY_DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}


def save_tiny_drafter(out: Path, target_cfg, seed: int = 1, num_layers: int = 2, block_size: int = 16,
                      target_layer_ids: list[int] | None = None, mask_token_id: int = 300,
                      dflash2: dict | None = None, selector_scale: float = 1.0, **overrides) -> Path:
    """A random z-lab-format DFlash drafter for a tiny target, written with the reference package.

    dflash2 (e.g. TINY_DFLASH2): a DFlash2DraftModel instead, in the published layout (sliding-window,
    non-causal layers; selector codebooks stored without ".weight"), its selector weighted so that its
    pairwise term, not only the logits, decides the path (selector_scale < 1: a gentler walk, whose
    sampled q spreads over the candidates)."""
    from dflash.model import DFlash2DraftModel, DFlashDraftModel
    from transformers import Qwen3Config

    layer_ids = target_layer_ids or [1, 3]
    if dflash2:
        overrides = {"layer_types": ["sliding_attention"] * num_layers, "sliding_window": 12,
                     "use_sliding_window": True, **overrides}
    cfg = Qwen3Config(
        vocab_size=target_cfg.vocab_size, hidden_size=target_cfg.hidden_size, intermediate_size=96,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, rms_norm_eps=1e-6, **overrides)
    cfg.architectures = ["DFlash2DraftModel" if dflash2 else "DFlashDraftModel"]
    cfg.block_size = block_size
    cfg.num_target_layers = target_cfg.num_hidden_layers
    cfg.dflash_config = {"mask_token_id": mask_token_id, "target_layer_ids": layer_ids, **(dflash2 or {})}
    if dflash2:
        cfg.is_causal = False
    torch.manual_seed(seed)
    model = (DFlash2DraftModel if dflash2 else DFlashDraftModel)(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "codebook" in name:
                p.copy_(torch.randn_like(p) * selector_scale)
            elif "base_kernel" in name:
                p.copy_(0.2 * torch.randn_like(p))
                p[:, 0] += 1.0  # near identity on the row itself, as trained ones start
            else:
                p.copy_(torch.randn_like(p) * (0.3 if "hidden_projection" in name else 0.08))
    model.save_pretrained(out, safe_serialization=True)
    if dflash2:
        from safetensors.torch import load_file, save_file

        tensors = load_file(out / "model.safetensors")
        save_file({k.replace("codebook.weight", "codebook"): v for k, v in tensors.items()},
                  out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(autouse=True, scope="session")
def interpreter_scalar_loop_bounds():
    """Triton 3.6's interpreter holds scalars as 1-element arrays and turns them into loop bounds with
    int(array), which NumPy 2.4 refuses for arrays that are not 0-d: kernels whose loop bounds are loaded
    values (paged attention's key range) then fail only in the interpreter. Give its tensors an __index__
    that takes the one element."""
    if not INTERPRET:
        yield
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch
    yield
    interpreter._patch_lang_tensor = original


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Tiny matmuls gain nothing from threads, and two spinning OpenMP threads next to a server's event
    loop on a 2-core machine made engine steps about 10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """One tiny checkpoint per family, written once per session."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": save_tiny_model(root / "llama", "llama"),
        "llama_tied": save_tiny_model(root / "llama_tied", "llama", tie_word_embeddings=True),
        "qwen2": save_tiny_model(root / "qwen2", "qwen2"),
        "qwen3": save_tiny_model(root / "qwen3", "qwen3"),
    }


@pytest.fixture(scope="session")
def tiny_drafter(tmp_path_factory, tiny_models) -> Path:
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("draft")
    return save_tiny_drafter(root / "qwen3_draft", AutoConfig.from_pretrained(tiny_models["qwen3"]))


@pytest.fixture(scope="session")
def tiny_drafter2(tmp_path_factory, tiny_models) -> Path:
    """A random DFlash 2 drafter (block size 8) for the tiny Qwen3 target."""
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("draft2")
    return save_tiny_drafter(root / "qwen3_draft2", AutoConfig.from_pretrained(tiny_models["qwen3"]), block_size=8,
                             dflash2=TINY_DFLASH2)


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The embedded SmolLM2-135M-Instruct directory (converted from the wheel's GGUF once)."""
    from blockspec.loader.default_model import default_model_dir

    return default_model_dir()
