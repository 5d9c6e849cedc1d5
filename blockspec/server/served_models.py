"""The names a server answers to, and the default sampling parameters behind each name.

One backend, several names: `--served-model-name a b` makes aliases, and `--alias fast:temperature=0`
adds a name whose requests default to those parameters (seed 003 ran `qwen36-fast` at T=0 and
`qwen36-deep` at T=0.7 on one model). Defaults stack, later wins: the model's generation_config.json
(vLLM's `--generation-config auto`), `--override-generation-config`, the alias, then the request.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from blockspec.errors import ConfigError
from blockspec.server.errors import APIError

# Parameters a default may set, with the type a flag value is converted to.
DEFAULTABLE: dict[str, type] = {
    "temperature": float, "top_p": float, "top_k": int, "min_p": float, "max_tokens": int,
    "presence_penalty": float, "frequency_penalty": float, "repetition_penalty": float,
    "min_tokens": int, "ignore_eos": bool, "seed": int, "stop": list, "skip_special_tokens": bool,
    "chat_template_kwargs": dict,
}
# generation_config.json keys vLLM takes as sampling defaults (name in the file -> ours).
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def check_defaults(values: dict[str, Any], where: str) -> dict[str, Any]:
    """Convert and check default values (ConfigError naming `where` on a bad key or type)."""
    out = {}
    for key, value in values.items():
        kind = DEFAULTABLE.get(key)
        if kind is None:
            raise ConfigError(f"{where}: {key!r} is not a sampling parameter; use one of {', '.join(DEFAULTABLE)}")
        if kind is list and isinstance(value, str):
            value = [value]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if not ok:
            raise ConfigError(f"{where}: {key}={value!r} is not a {kind.__name__}")
        out[key] = value
    return out


def _flag_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        lowered = text.lower()
        return {"true": True, "false": False}.get(lowered, text)


def parse_alias(text: str) -> tuple[str, dict[str, Any]]:
    """`NAME`, `NAME:key=value,key=value` or `NAME:{json}` -> (name, defaults)."""
    name, _, rest = text.partition(":")
    name = name.strip()
    if not name:
        raise ConfigError(f"--alias {text!r}: give a name, e.g. --alias fast:temperature=0")
    rest = rest.strip()
    if not rest:
        return name, {}
    if rest.startswith("{"):
        try:
            raw = json.loads(rest)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--alias {text!r}: the defaults are not valid JSON ({exc.msg})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"--alias {text!r}: the defaults must be a JSON object")
    else:
        raw = {}
        for pair in rest.split(","):
            key, eq, value = pair.partition("=")
            if not eq or not key.strip():
                raise ConfigError(f"--alias {text!r}: expected key=value pairs, e.g. fast:temperature=0,top_p=1")
            raw[key.strip()] = _flag_value(value.strip())
    return name, check_defaults(raw, f"--alias {name}")


def generation_config_defaults(source: str, model_dir: Path) -> dict[str, Any]:
    """Sampling defaults from generation_config.json: `auto` (the model's), `vllm` (none), or a folder."""
    if source == "vllm":
        return {}
    folder = model_dir if source == "auto" else Path(source).expanduser()
    path = folder / "generation_config.json"
    if not path.is_file():
        if source != "auto":
            raise ConfigError(f"--generation-config {source}: no generation_config.json there")
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path} ({exc}): fix the file or pass --generation-config vllm") from None
    picked = {ours: raw[theirs] for theirs, ours in GENERATION_CONFIG_KEYS.items() if raw.get(theirs) is not None}
    if raw.get("do_sample") is False and "temperature" in picked:
        picked["temperature"] = 0.0  # HF: do_sample false means greedy, whatever temperature says
    return check_defaults(picked, str(path))


class ServedModels:
    def __init__(self, names: list[str], aliases: dict[str, dict[str, Any]] | None = None) -> None:
        aliases = aliases or {}
        self.names = list(dict.fromkeys([*names, *aliases]))
        self.alias_defaults = aliases
        self.base_defaults: dict[str, Any] = {}  # generation config (+ overrides), set once loaded

    @property
    def primary(self) -> str:
        return self.names[0]

    def resolve(self, requested: str | None) -> tuple[str, dict[str, Any]]:
        """(name to echo back, defaults) for a request's `model`; 404 listing the names if unknown."""
        name = requested if requested else self.primary
        if name not in self.names:
            served = ", ".join(self.names)
            raise APIError(404, f"the model {name!r} does not exist; this server serves: {served}", "model")
        defaults = dict(self.base_defaults)
        alias = self.alias_defaults.get(name, {})
        if "chat_template_kwargs" in alias and "chat_template_kwargs" in defaults:
            alias = {**alias, "chat_template_kwargs": {**defaults["chat_template_kwargs"],
                                                       **alias["chat_template_kwargs"]}}
        defaults.update(alias)
        return name, defaults
