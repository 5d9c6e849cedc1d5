"""Load a model's tokenizer, chat template and stop ids from local files only.

No model hub is reachable where blockspec runs, so nothing here may try the network: a missing
file must fail at once with a message, not after a connection timeout.
"""

import json
import logging
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from blockspec.loader.errors import ModelLoadError

logger = logging.getLogger(__name__)


def load_tokenizer(
    model_dir: Path, tokenizer: str | None = None, chat_template: str | None = None
) -> PreTrainedTokenizerFast:
    """The fast tokenizer of ``model_dir`` (or of ``tokenizer``, a local directory).

    ``chat_template`` (a file path or the template text itself) replaces the model's own template,
    for models that ship none or a broken one.
    """
    source = tokenizer if tokenizer is not None else str(model_dir)
    try:
        loaded = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except Exception as err:  # transformers raises OSError, ValueError, KeyError... for bad dirs
        raise ModelLoadError(
            f"cannot load a tokenizer from {source} ({_one_line(err)}): "
            "pass --tokenizer with a local directory holding tokenizer.json"
        ) from None
    if not isinstance(loaded, PreTrainedTokenizerFast):
        raise ModelLoadError(
            f"{source} only has a slow ({type(loaded).__name__}) tokenizer: "
            "add a tokenizer.json (save it with a fast tokenizer) or pass --tokenizer"
        )
    if chat_template is not None:
        loaded.chat_template = read_chat_template(chat_template)
    return loaded


def read_chat_template(value: str) -> str:
    """The template text of ``value``: the contents of the file it names, or itself if Jinja."""
    try:
        path = Path(value).expanduser()
        if path.is_file():
            return path.read_text()
    except OSError:  # a long literal template is not a valid file name
        pass
    if any(marker in value for marker in ("{{", "{%", "\n")):
        return value
    raise ModelLoadError(
        f"chat template {value!r} is neither an existing file nor Jinja text: "
        "pass a path to a .jinja file or the template itself"
    )


def load_eos_token_ids(model_dir: Path, tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Token ids that end a generation.

    ``generation_config.json`` is what the model's authors meant (chat models list the end-of-turn
    token there); ``config.json`` is the older place; the tokenizer's eos is always included
    because some checkpoints declare only it.
    """
    model_dir = Path(model_dir)
    ids = _eos_ids_in(model_dir / "generation_config.json")
    if not ids:
        ids = _eos_ids_in(model_dir / "config.json")
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        logger.warning("no eos token id found for %s: generations stop only at max_tokens", model_dir)
    return ids


def _eos_ids_in(path: Path) -> list[int]:
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot parse {path} ({err}): fix or re-download the file") from None
    value = data.get("eos_token_id")
    if value is None and isinstance(data.get("text_config"), dict):  # VLM wrapper configs
        value = data["text_config"].get("eos_token_id")
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) for v in values):
        raise ModelLoadError(f"eos_token_id in {path} is {value!r}, not an int or list of ints")
    return list(dict.fromkeys(values))


def _one_line(err: Exception) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 200 else text[:197] + "..."
