"""Stream a Hugging Face safetensors checkpoint tensor by tensor, straight onto the target device.

Large models only fit when no full CPU copy is ever made, so each shard is opened with
``safe_open(device=...)`` and tensors are yielded one at a time; the caller copies each into its
parameter and drops it before the next one is read.
"""

import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from blockspec.loader.errors import ModelLoadError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Files beside the weights that some uploads keep out of the index, or ship without one: the MTP head of
# NVFP4 re-packs of Qwen3.5 / 3.6 (model.safetensors + model_mtp.safetensors, unquantized). Read with the
# checkpoint when present and not already listed; the target's loader skips their `mtp.*` names as always.
SIDECAR_FILES = ("model_mtp.safetensors",)


def checkpoint_shards(model_dir: Path) -> dict[Path, list[str] | None]:
    """Map each shard file to the tensor names the index assigns it (None: every tensor in it).

    All shards are checked to exist before any is read, so a half-downloaded model fails at once
    instead of after minutes of loading.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist: pass a Hugging Face model directory")
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ModelLoadError(f"cannot read {index_path} ({err}): re-download the checkpoint's index file") from None
        shards: dict[Path, list[str] | None] = {}
        for name, shard in weight_map.items():
            names = shards.setdefault(model_dir / shard, [])
            assert names is not None
            names.append(name)
        missing = [p.name for p in shards if not p.is_file()]
        if missing:
            raise ModelLoadError(
                f"{INDEX_FILE} in {model_dir} references missing shard(s) {', '.join(missing[:3])}"
                f"{' ...' if len(missing) > 3 else ''}: the download is incomplete, fetch them again"
            )
        return shards | _sidecars(model_dir, shards)
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return {single: None} | _sidecars(model_dir, {single: None})
    hint = " (it holds .bin weights: convert them to safetensors)" if any(model_dir.glob("*.bin")) else ""
    raise ModelLoadError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}{hint}: "
        "pass a Hugging Face model directory with safetensors weights"
    )


def _sidecars(model_dir: Path, shards: dict[Path, list[str] | None]) -> dict[Path, list[str] | None]:
    """SIDECAR_FILES present in model_dir that the index does not already assign tensors to (all their tensors)."""
    return {model_dir / name: None for name in SIDECAR_FILES
            if (model_dir / name).is_file() and model_dir / name not in shards}


def read_tensor_headers(model_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (safetensors dtype, shape)}`` of every tensor, read from the shard headers alone.

    Quantization set-up needs to know which layers a checkpoint stores quantized (and with which scale
    tensors) before any weight is read; the headers say so for a few KiB per shard. Empty when the
    directory holds no safetensors (dummy-weight runs from a bare config.json).
    """
    try:
        shards = checkpoint_shards(Path(model_dir))
    except ModelLoadError:
        return {}
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for shard in shards:
        try:
            with shard.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error) as err:
            raise ModelLoadError(f"cannot read the header of {shard} ({err}): the file is corrupt or truncated, "
                                 "re-download it") from None
        for name, info in header.items():
            if name != "__metadata__":
                out[name] = (str(info["dtype"]), tuple(int(d) for d in info["shape"]))
    return out


def iter_safetensors(
    model_dir: Path,
    device: torch.device | str,
    skip: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint, materialised on ``device``.

    ``skip(name)`` returning True leaves that tensor unread (e.g. a VLM's vision tower when only
    the language model is served).
    """
    for shard, listed in checkpoint_shards(Path(model_dir)).items():
        try:
            handle = safe_open(str(shard), framework="pt", device=str(device))
        except Exception as err:  # safetensors raises its own error type or OSError
            raise ModelLoadError(
                f"cannot open {shard} ({err}): the file is corrupt or truncated, re-download it"
            ) from None
        with handle as f:
            present = set(f.keys())
            names = list(f.keys()) if listed is None else listed
            for name in names:
                if skip is not None and skip(name):
                    continue
                if name not in present:
                    raise ModelLoadError(
                        f"{INDEX_FILE} says {name} is in {shard.name} but that shard lacks it: "
                        "the checkpoint is inconsistent, re-download it"
                    )
                try:
                    tensor = f.get_tensor(name)
                except Exception as err:
                    raise ModelLoadError(
                        f"cannot read tensor {name} from {shard} ({err}): "
                        "the file is corrupt or truncated, re-download it"
                    ) from None
                yield name, tensor
                del tensor  # hold at most the tensor the caller is copying
