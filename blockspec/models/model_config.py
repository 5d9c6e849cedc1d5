"""Architecture hyper-parameters read from a Hugging Face ``config.json``.

We read the raw JSON rather than transformers' config classes so that loading never depends on the
installed transformers version knowing a model type, and so that both the transformers 4 layout
(``rope_theta`` + ``rope_scaling``) and the transformers 5 layout (``rope_parameters``) work.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blockspec.errors import ConfigError


@dataclass
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    torch_dtype: str | None
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        # VLM wrappers keep the language model's fields under text_config.
        if "text_config" in cfg and "hidden_size" not in cfg:
            text = dict(cfg["text_config"])
            text.setdefault("architectures", cfg.get("architectures"))
            text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
            cfg = text
        try:
            archs = cfg.get("architectures") or []
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            rope_theta, rope_scaling = _rope(cfg)
            return cls(
                architecture=archs[0] if archs else "",
                model_type=str(cfg.get("model_type", "")),
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
                raw=cfg,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"config.json lacks or mangles field {exc}: is this a causal LM checkpoint?") from None

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        return cls.from_dict(read_config_json(model_dir))

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token per layer in 2-byte dtypes, times layers (planning figure)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 2


def read_config_json(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in {model_dir}: pass a Hugging Face model directory or a .gguf file")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}): re-download the checkpoint") from None


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = params.get("rope_type", params.get("type", "default"))
        scaling = None if rope_type == "default" else dict(params)
        return theta, scaling
    theta = float(cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, scaling
