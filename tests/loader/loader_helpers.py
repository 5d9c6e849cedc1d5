"""Test helpers: GGUF files written the way llama.cpp writes them, and HF models with ``load_weight``.

The name tables and the permutation here are written out independently of blockspec.loader, so
the GGUF tests compare the loader against a second implementation, not against itself.
"""

import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

# HF parameter name parts -> llama.cpp tensor names, written out independently of the loader's table.
GLOBAL_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in GLOBAL_TO_GGUF:
        return GLOBAL_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, suffix = rest.rpartition(".")
    return f"blk.{layer}.{LAYER_TO_GGUF[module]}.{suffix}"


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama Q/K: rotary halves -> adjacent pairs."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(
    path: Path,
    state: dict[str, torch.Tensor],
    config,
    arch: str = "llama",
    qtype=None,
    extra: Callable | None = None,
) -> Path:
    """Write ``state`` (HF names, fp32) as a GGUF of ``arch``; 2-D weights quantized to ``qtype``."""
    import gguf

    qtype = gguf.GGMLQuantizationType.F32 if qtype is None else qtype
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    writer.add_eos_token_id(config.eos_token_id)
    if extra is not None:
        extra(writer)
    for name, tensor in state.items():
        array = tensor.detach().float().numpy()
        if arch == "llama" and ".self_attn.q_proj." in name:
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            array = llama_cpp_permute(array, config.num_key_value_heads)
        if array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_model(model_dir: Path):
    """A transformers model from ``model_dir`` (fp32)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def make_loadable(model: torch.nn.Module) -> torch.nn.Module:
    """Give a module HF-named parameters' ``load_weight``: copy by exact name, False when unknown."""

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        params = dict(self.named_parameters(remove_duplicate=False))
        if name not in params:
            return False
        with torch.no_grad():
            params[name].copy_(tensor)
        return True

    model.load_weight = types.MethodType(load_weight, model)
    return model


def fresh_model(model_dir: Path, dtype: torch.dtype = torch.float32, **overrides) -> torch.nn.Module:
    """A loadable model of ``model_dir``'s architecture whose weights are all zeros (nothing loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    return make_loadable(model)
