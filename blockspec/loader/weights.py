"""Find a model's files and load its weights into a blockspec model.

Checkpoint names are normalised here (VLM wrapper prefixes removed, vision and MTP weights not read
into the target; the MTP head loads them on its own, spec/mtp.py) so model code only knows plain Hugging
Face causal-LM names; the model's own ``load_weight(name, tensor) -> bool`` does the copy, because only it
knows fused or sharded layouts.
"""

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from blockspec.loader.cache import cache_root
from blockspec.loader.default_model import default_model_dir
from blockspec.loader.errors import ModelLoadError
from blockspec.loader.gguf_convert import convert_gguf
from blockspec.loader.safetensors_loader import iter_safetensors

logger = logging.getLogger(__name__)

# (checkpoint prefix, model prefix), first match wins.
PREFIX_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
# Parts of multimodal / multi-token-prediction checkpoints a text-only target never uses.
SKIPPED_MARKERS = ("visual.", "vision_tower", "multi_modal_projector", "mtp.")
# Dtypes that are plain precision choices, cast to the model dtype on load.
CASTABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Stored dtypes that only quantized layers hold: outside a quantized layer they mean a missing or
# mismatched quantization_config, and copying them into float parameters would load garbage.
PAYLOAD_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.int8, torch.int32)
# Tensors of quantized checkpoints that the KV cache or activations would use; we keep both in the model dtype.
IGNORED_QUANT_SUFFIXES = (".k_scale", ".v_scale", ".q_scale", ".prob_scale", ".input_scale", ".kv_scale")


def resolve_model_path(model: str | None, cache_dir: Path | None = None) -> Path:
    """The Hugging Face directory to serve for ``--model`` (None: the embedded default model)."""
    if model is None:
        return default_model_dir(cache_dir)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        stat = path.stat()
        key = hashlib.sha256(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
        root = cache_dir if cache_dir is not None else cache_root()
        return convert_gguf(path, root / "gguf" / f"{path.stem}-{key[:12]}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            hint = f" (it holds {ggufs[0]}: pass that file)" if ggufs else ""
            raise ModelLoadError(f"no config.json in {path}{hint}: pass a Hugging Face model directory or a .gguf file")
        return path
    if path.exists():
        raise ModelLoadError(
            f"{path} is neither a directory nor a .gguf file: pass a Hugging Face model directory or a .gguf file"
        )
    raise ModelLoadError(
        f"model {model!r} not found: pass a local Hugging Face model directory or a .gguf file "
        "(no model hub is reachable)"
    )


def checkpoint_name(name: str) -> str:
    """The plain causal-LM name of a checkpoint tensor name (VLM wrapper prefixes removed)."""
    for old, new in PREFIX_RENAMES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def is_skipped(name: str) -> bool:
    """True for vision-tower and MTP-head tensors, which are never read."""
    return any(marker in name for marker in SKIPPED_MARKERS)


def load_weights(model: torch.nn.Module, model_dir: Path, device: torch.device | str, dtype: torch.dtype,
                 names: Callable[[str], str | None] | None = None,
                 fresh: Callable[[str], bool] | None = None) -> None:
    """Stream every checkpoint tensor of ``model_dir`` into ``model`` and check nothing is missing.

    ``names`` maps a checkpoint name to the model's (None: not this model's tensor); the default reads the
    text model (wrapper prefixes removed, vision and MTP tensors skipped). A part of a checkpoint, such as
    its MTP head (spec/mtp.py), loads with its own mapping. ``fresh`` names the parameters that may keep
    their initial values (a DFlash 2 drafter started from a DFlash 1 drafter's weights).
    """
    model_dir = Path(model_dir)
    rename = checkpoint_name if names is None else names
    skip = is_skipped if names is None else (lambda raw: names(raw) is None)
    versions = _param_versions(model)
    from blockspec.loader.quant.apply import QuantLoader

    quant = QuantLoader(model)  # quantized layers (loader.quant.quantize_model) take their tensors first
    # a family whose checkpoints name or lay out tensors differently from its modules maps them (GPT-OSS)
    own_layout = getattr(model, "checkpoint_tensor", None)
    loaded: set[str] = set()
    unknown: list[str] = []
    for raw_name, tensor in iter_safetensors(model_dir, device, skip=skip):
        name = rename(raw_name)
        if own_layout is not None:
            name, tensor = own_layout(name, tensor)
        if quant and quant.load(raw_name, name, tensor):
            loaded.add(name)
            continue
        if raw_name.endswith(IGNORED_QUANT_SUFFIXES):
            continue
        if tensor.dtype in PAYLOAD_DTYPES:
            raise ModelLoadError(
                f"checkpoint tensor {raw_name} is stored as {str(tensor.dtype).removeprefix('torch.')} but the model "
                "keeps that layer unquantized: config.json declares no quantization for it (a missing or wrong "
                "quantization_config / hf_quant_config.json); fix the checkpoint's config"
            )
        if tensor.dtype in CASTABLE_DTYPES and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        if _load_one(model, name, tensor):
            loaded.add(name)
        else:
            unknown.append(raw_name)
        del tensor  # let the device memory go before the next tensor is read
    if quant:
        quant.finish()
    if unknown:
        logger.warning(
            "ignored %d checkpoint tensors the model does not use: %s%s",
            len(unknown),
            ", ".join(unknown[:5]),
            " ..." if len(unknown) > 5 else "",
        )
    _tie_lm_head(model, model_dir, loaded)
    missing = [name for name in _missing_parameters(model, loaded, versions) if fresh is None or not fresh(name)]
    if missing:
        raise ModelLoadError(
            f"{len(missing)} model parameters are not in the checkpoint {model_dir} "
            f"(e.g. {', '.join(missing[:4])}): the weights do not match the architecture in "
            "config.json; check that the directory holds the complete model"
        )


def _load_one(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> bool:
    try:
        return bool(model.load_weight(name, tensor))
    except (RuntimeError, ValueError) as err:  # shape or dtype mismatch inside the copy
        raise ModelLoadError(
            f"checkpoint tensor {name} {tuple(tensor.shape)} does not fit the model "
            f"({' '.join(str(err).split())[:160]}): the checkpoint does not match config.json"
        ) from None


def _tie_lm_head(model: torch.nn.Module, model_dir: Path, loaded: set[str]) -> None:
    """Fill an untied lm_head from the embedding when the config ties them and it was absent."""
    if "lm_head.weight" in loaded or "model.embed_tokens.weight" not in loaded:
        return
    if not _ties_embeddings(model_dir):
        return
    params = dict(model.named_parameters(remove_duplicate=False))
    head, embedding = params.get("lm_head.weight"), params.get("model.embed_tokens.weight")
    if head is None or embedding is None or head is embedding:
        return  # no separate head to fill (tied by sharing, or the model reuses the embedding)
    if _load_one(model, "lm_head.weight", embedding.detach()):
        loaded.add("lm_head.weight")


def _ties_embeddings(model_dir: Path) -> bool:
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot parse {path} ({err}): fix or re-download the file") from None
    text_config = config.get("text_config")
    if isinstance(text_config, dict) and "tie_word_embeddings" in text_config:
        return bool(text_config["tie_word_embeddings"])
    return bool(config.get("tie_word_embeddings", False))


def _param_versions(model: torch.nn.Module) -> dict[int, int] | None:
    """Each parameter's in-place version counter, to see which ones load_weight wrote.

    Names alone cannot tell: a model may rename or fuse what it is given (q/k/v into one qkv).
    None when the parameters were made under inference_mode, which keeps no counters.
    """
    try:
        return {id(p): p._version for p in model.parameters()}
    except RuntimeError:
        return None


def _missing_parameters(model: torch.nn.Module, loaded: set[str], versions: dict[int, int] | None) -> list[str]:
    """Parameters no checkpoint tensor reached; a parameter shared under several names counts once."""
    names_of: dict[int, list[str]] = {}
    written: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
        if versions is not None and param._version != versions.get(id(param)):
            written.add(id(param))
    return [
        names[0] for key, names in names_of.items() if key not in written and not any(name in loaded for name in names)
    ]
