"""Turn a GGUF file into a Hugging Face model directory, once, atomically.

Converting up front means the engine, the tokenizer code and transformers (our test oracle) all
read one format. The directory is built under a temporary name and renamed into place at the end,
so an interrupted conversion never leaves a half-written cache that a later run would trust.
"""

import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch
from tqdm.auto import tqdm

from blockspec.loader.errors import ModelLoadError
from blockspec.loader.gguf_loader import (
    gguf_config,
    gguf_eos_token_ids,
    gguf_tensor_specs,
    iter_gguf_tensors,
    open_gguf,
)
from blockspec.loader.safetensors_writer import write_safetensors

logger = logging.getLogger(__name__)

CONVERTED_DTYPE = torch.bfloat16
# Keys transformers records from the call that loaded the tokenizer, meaningless in a saved copy.
_LOAD_TIME_KEYS = ("is_local", "local_files_only")


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Return ``out_dir`` holding the HF form of ``gguf_path``, converting only if it is absent."""
    out_dir = Path(out_dir)
    if out_dir.is_dir():
        return out_dir
    reader = open_gguf(gguf_path)  # validate before creating anything
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is readable like any model dir
    except OSError as err:
        raise ModelLoadError(
            f"cannot create {out_dir.parent} ({err}): set BLOCKSPEC_CACHE to a writable directory"
        ) from None
    try:
        _write_hf_dir(Path(gguf_path), reader, tmp)
        try:
            tmp.rename(out_dir)
        except OSError:
            if not out_dir.is_dir():
                raise
            logger.info("%s was converted concurrently by another process; using it", out_dir)
    except OSError as err:
        raise ModelLoadError(
            f"cannot write the converted model to {out_dir} ({err}): free disk space "
            "or set BLOCKSPEC_CACHE to a writable directory"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _write_hf_dir(gguf_path: Path, reader, out: Path) -> None:
    config = gguf_config(reader)
    specs = gguf_tensor_specs(reader)
    _write_json(out / "config.json", config)
    tensors = tqdm(
        iter_gguf_tensors(reader, dtype=CONVERTED_DTYPE),
        total=len(specs),
        desc=f"Converting {gguf_path.name} to bf16",
        unit="tensor",
    )
    write_safetensors(out / "model.safetensors", specs, CONVERTED_DTYPE, tensors)
    generation = {"eos_token_id": gguf_eos_token_ids(reader)}
    for key in ("bos_token_id", "pad_token_id"):
        if key in config:
            generation[key] = config[key]
    _write_json(out / "generation_config.json", generation)
    if "tokenizer.ggml.model" in reader.fields:
        _write_tokenizer(gguf_path, reader, config, out)
    else:
        logger.warning("%s has no tokenizer; pass --tokenizer when serving it", gguf_path.name)


def _write_tokenizer(gguf_path: Path, reader, config: dict, out: Path) -> None:
    """Save the GGUF's tokenizer as HF files, with the special tokens the GGUF declares."""
    from transformers import AutoTokenizer  # heavy import, needed only when converting

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
        )
    except Exception as err:  # transformers raises many types for unsupported tokenizers
        raise ModelLoadError(
            f"cannot build a tokenizer from {gguf_path.name} ({err}): "
            "pass --tokenizer with a Hugging Face tokenizer directory"
        ) from None
    tokens = reader.fields["tokenizer.ggml.tokens"]
    # transformers' GGUF conversion takes eos from the bos id for some vocabularies; the GGUF
    # header is the authority, so set every special token from its ids.
    for key in ("bos", "eos", "pad"):
        token_id = config.get(f"{key}_token_id")
        if token_id is not None:
            setattr(tokenizer, f"{key}_token", tokens.contents(token_id))
    template = reader.fields.get("tokenizer.chat_template")
    if template is not None:
        tokenizer.chat_template = template.contents()
    tokenizer.model_max_length = config["max_position_embeddings"]
    tokenizer.clean_up_tokenization_spaces = False  # byte-level BPE decodes exactly without it
    tokenizer.save_pretrained(str(out))
    tokenizer_config = out / "tokenizer_config.json"
    data = json.loads(tokenizer_config.read_text())
    for key in _LOAD_TIME_KEYS:
        data.pop(key, None)
    _write_json(tokenizer_config, data)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
