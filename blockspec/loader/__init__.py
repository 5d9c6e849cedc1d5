"""Model loading: find a model, stream its weights onto the device, load its tokenizer.

Inputs are Hugging Face directories (sharded safetensors) and GGUF files (converted once into the
same form); everything raises ModelLoadError with a one-line, actionable message.
"""

from blockspec.loader.default_model import default_model_dir
from blockspec.loader.errors import ModelLoadError
from blockspec.loader.gguf_loader import gguf_config, iter_gguf_tensors
from blockspec.loader.safetensors_loader import iter_safetensors
from blockspec.loader.tokenizer import load_eos_token_ids, load_tokenizer
from blockspec.loader.weights import load_weights, resolve_model_path

__all__ = [
    "ModelLoadError",
    "default_model_dir",
    "gguf_config",
    "iter_gguf_tensors",
    "iter_safetensors",
    "load_eos_token_ids",
    "load_tokenizer",
    "load_weights",
    "resolve_model_path",
]
