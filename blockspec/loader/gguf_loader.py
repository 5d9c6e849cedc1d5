"""Read llama.cpp GGUF files as Hugging Face configs and tensors.

A GGUF is turned into exactly what a Hugging Face directory of the same model would hold, so the
rest of blockspec only ever sees one weight format: the config keys of ``config.json``, HF tensor
names, HF tensor layouts (llama.cpp's rotary permutation of Q/K undone), dequantized floats.
"""

import math
import re
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch

from blockspec.loader.errors import ModelLoadError

# GGUF architecture -> (HF architecture class, HF model_type)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

# llama.cpp's converter interleaves the two rotary halves of each Q/K head for these architectures.
PERMUTED_QK_ARCHITECTURES = {"llama"}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors llama.cpp adds that have no HF parameter (their content goes into the config instead).
_NON_PARAMETERS = {"rope_freqs.weight"}

GGUFSource = Path | str | gguf.GGUFReader


def open_gguf(source: GGUFSource) -> gguf.GGUFReader:
    """Open (memory-map) a GGUF file, turning every parse failure into a ModelLoadError."""
    if isinstance(source, gguf.GGUFReader):
        return source
    path = Path(source)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist: pass an existing .gguf file")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as err:  # bad magic, truncated header, unknown value types
        raise ModelLoadError(
            f"cannot read {path} as GGUF ({err}): the file is corrupt or not a GGUF, re-download it"
        ) from None
    split_count = _field(reader, "split.count", 1)
    if split_count and int(split_count) > 1:
        raise ModelLoadError(
            f"{path.name} is part of a {split_count}-way split GGUF: merge it first with `llama-gguf-split --merge`"
        )
    return reader


def _field(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    if field.types == [gguf.GGUFValueType.FLOAT32]:
        # Shortest decimal that round-trips the float32: 1e-05, as config.json had it, not 9.99e-06.
        value = float(str(np.float32(value)))
    return value


def _architecture(reader: gguf.GGUFReader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)}): "
            "use the model's Hugging Face safetensors directory instead"
        )
    return arch


def _tensor_names(reader: gguf.GGUFReader) -> set[str]:
    return {t.name for t in reader.tensors}


def gguf_config(source: GGUFSource) -> dict:
    """The ``config.json`` a Hugging Face checkpoint of this GGUF's model would have."""
    reader = open_gguf(source)
    arch = _architecture(reader)
    hf_arch, model_type = ARCHITECTURES[arch]

    def meta(key: str, default: int | float | None = None) -> int | float:
        value = _field(reader, f"{arch}.{key}", default)
        if not isinstance(value, int | float):
            raise ModelLoadError(
                f"GGUF metadata {arch}.{key} is {'missing' if value is None else repr(value)}: "
                "the file is incomplete or of an unsupported variant, use the Hugging Face checkpoint"
            )
        return value

    names = _tensor_names(reader)
    if "token_embd.weight" not in names:
        raise ModelLoadError("GGUF has no token_embd.weight: the file is incomplete, re-download it")
    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    kv_heads = int(meta("attention.head_count_kv", heads))
    head_dim = int(meta("attention.key_length", hidden // heads))
    if int(meta("rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError(
            f"GGUF uses partial rotary embeddings ({arch}.rope.dimension_count != head_dim), which "
            "blockspec does not support for this architecture: use the Hugging Face checkpoint"
        )
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    config: dict = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "vocab_size": int(embd.shape[1]),
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "bfloat16",
    }
    if model_type == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in names
        config["mlp_bias"] = False
    rope_scaling = _rope_scaling(reader, arch, head_dim, config["rope_theta"])
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    for key, hf_key in (("bos", "bos"), ("eos", "eos"), ("padding", "pad")):
        token_id = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[f"{hf_key}_token_id"] = int(token_id)
    return config


def gguf_eos_token_ids(source: GGUFSource) -> list[int]:
    """End-of-sequence ids a chat server should stop on: eos plus end-of-turn/end-of-message."""
    reader = open_gguf(source)
    ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        token_id = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and int(token_id) not in ids:
            ids.append(int(token_id))
    return ids


def _rope_scaling(reader: gguf.GGUFReader, arch: str, head_dim: int, theta: float) -> dict | None:
    """Rebuild HF ``rope_scaling`` from GGUF metadata, or refuse when it cannot be done exactly."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if kind in ("linear", "yarn") and factor:
        scaling = {"rope_type": kind, "factor": float(factor)}
        original = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if kind == "yarn" and original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    if kind not in (None, "none"):
        raise ModelLoadError(f"GGUF rope scaling {kind!r} is not supported: use the Hugging Face checkpoint instead")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    # Llama 3.1+ GGUFs store per-frequency divisors instead of the llama3 parameters; recover them
    # by matching the divisors against the llama3 formula with Meta's published constants.
    stored = np.asarray(gguf.quants.dequantize(freqs.data, freqs.tensor_type), dtype=np.float64)
    scaling = {
        "rope_type": "llama3",
        "factor": float(round(stored.max(), 4)),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if not np.allclose(stored, _llama3_divisors(scaling, head_dim, theta), rtol=1e-3):
        raise ModelLoadError(
            "GGUF rope_freqs do not match llama3 rope scaling: use the Hugging Face checkpoint instead"
        )
    return scaling


def _llama3_divisors(scaling: dict, head_dim: int, theta: float) -> np.ndarray:
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    old = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    smooth = np.clip((old / wavelen - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1 - smooth) / factor + smooth)


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF parameter name of a llama.cpp tensor name; None for names with no known counterpart."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match and match.group(2) in _BLOCK_NAMES:
        layer, part, suffix = match.groups()
        return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{suffix}"
    return None


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary permutation of a Q or K projection (weight or bias).

    HF rotates the two *halves* of each head (``rotate_half``); llama.cpp rotates *adjacent pairs*,
    so its converter reorders every head's rows from ``[x0..x_{d/2-1}, y0..y_{d/2-1}]`` to
    ``[x0, y0, x1, y1, ...]``. Reading the rows as (head, pair, 2) and swapping the last two axes
    restores (head, 2, pair), i.e. the HF order.
    """
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _check_quant_types(reader: gguf.GGUFReader) -> None:
    """Fail before any work if a tensor uses a type the gguf package cannot dequantize."""
    for qtype in sorted({t.tensor_type for t in reader.tensors}):
        block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
        try:
            gguf.quants.dequantize(np.zeros((1, block_bytes), dtype=np.uint8), qtype)
        except NotImplementedError:
            raise ModelLoadError(
                f"GGUF tensors of type {qtype.name} cannot be dequantized: use a GGUF with "
                "F32/F16/BF16, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 or Q2_K..Q6_K tensors"
            ) from None


def gguf_tensor_specs(source: GGUFSource) -> list[tuple[str, tuple[int, ...]]]:
    """HF names and shapes of the tensors ``iter_gguf_tensors`` yields, in the same order.

    Known from the header alone, so a converter can lay out its output before dequantizing.
    """
    reader = open_gguf(source)
    _architecture(reader)
    _check_quant_types(reader)
    specs = []
    for tensor in reader.tensors:
        if tensor.name in _NON_PARAMETERS:
            continue
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise ModelLoadError(
                f"GGUF tensor {tensor.name!r} has no Hugging Face counterpart in blockspec: "
                "use the model's Hugging Face safetensors directory instead"
            )
        specs.append((name, tuple(int(d) for d in reversed(tensor.shape.tolist()))))
    return specs


def iter_gguf_tensors(source: GGUFSource, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every weight, dequantized to ``dtype`` in HF layout, on CPU."""
    reader = open_gguf(source)
    arch = _architecture(reader)
    specs = gguf_tensor_specs(reader)
    config = gguf_config(reader)
    permuted = arch in PERMUTED_QK_ARCHITECTURES
    tensors = [t for t in reader.tensors if t.name not in _NON_PARAMETERS]
    for tensor, (name, shape) in zip(tensors, specs, strict=True):
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # np.array copies out of the read-only memory map so torch owns writable memory.
        weight = torch.from_numpy(np.array(array, dtype=np.float32)).reshape(shape)
        if permuted and ".self_attn.q_proj." in name:
            weight = unpermute_qk(weight, config["num_attention_heads"])
        elif permuted and ".self_attn.k_proj." in name:
            weight = unpermute_qk(weight, config["num_key_value_heads"])
        yield name, weight.to(dtype)
