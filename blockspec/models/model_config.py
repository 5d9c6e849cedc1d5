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

# Rope types that need no frequency scaling ("mrope" on text tokens is plain rotary: t = h = w).
PLAIN_ROPE_TYPES = ("default", "mrope")


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
    hidden_act: str = "silu"
    # Fraction of head_dim that rotary rotates (Qwen3-Next / Qwen3.5: 0.25); M-RoPE sections (text
    # tokens have equal t/h/w positions, so M-RoPE reduces to 1-D rotary over the same dims).
    partial_rotary_factor: float = 1.0
    mrope_section: list[int] | None = None
    # Hybrid models: "full_attention" or "linear_attention" (Gated DeltaNet) per layer; GPT-OSS:
    # "full_attention" or "sliding_attention" (keys less than `sliding_window` positions back).
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    linear: LinearAttentionConfig | None = None
    moe: MoeConfig | None = None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_attention_layers(self) -> int:
        """Layers with a KV cache (all of them, except in hybrid models)."""
        if not self.layer_types:
            return self.num_hidden_layers
        return sum(t != "linear_attention" for t in self.layer_types)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        # VLM wrappers keep the language model's fields under text_config.
        if "text_config" in cfg and "hidden_size" not in cfg:
            text = dict(cfg["text_config"])
            text.setdefault("architectures", cfg.get("architectures"))
            text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
            text.setdefault("torch_dtype", cfg.get("torch_dtype") or cfg.get("dtype"))
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
                # MoE-only models (Qwen3.5-MoE) have no dense MLP and so no intermediate_size.
                intermediate_size=int(cfg["intermediate_size"] if "moe_intermediate_size" not in cfg
                                      else cfg.get("intermediate_size") or 0),
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
                hidden_act=str(cfg.get("hidden_act") or "silu"),
                partial_rotary_factor=_rope_field(cfg, "partial_rotary_factor", 1.0),
                mrope_section=_rope_field(cfg, "mrope_section", None),
                layer_types=_layer_types(cfg),
                sliding_window=int(cfg["sliding_window"]) if cfg.get("sliding_window") else None,
                linear=LinearAttentionConfig.from_dict(cfg),
                moe=MoeConfig.from_dict(cfg),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"config.json lacks or mangles field {exc}: is this a causal LM checkpoint?") from None

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        return cls.from_dict(read_config_json(model_dir))

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token per layer in 2-byte dtypes, times layers (planning figure)."""
        return 2 * self.num_attention_layers * self.num_key_value_heads * self.head_dim * 2


@dataclass
class LinearAttentionConfig:
    """Gated DeltaNet fields (Qwen3-Next, Qwen3.5): value heads share query/key heads in groups."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    state_dtype: str | None  # `mamba_ssm_dtype` (real checkpoints: float32); None: the model dtype

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> LinearAttentionConfig | None:
        if "linear_num_value_heads" not in cfg:
            return None
        return cls(
            num_key_heads=int(cfg["linear_num_key_heads"]),
            num_value_heads=int(cfg["linear_num_value_heads"]),
            key_head_dim=int(cfg["linear_key_head_dim"]),
            value_head_dim=int(cfg["linear_value_head_dim"]),
            conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
            state_dtype=cfg.get("mamba_ssm_dtype"),
        )


@dataclass
class MoeConfig:
    """Sparse MLP fields (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, GPT-OSS)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int  # 0: no shared expert
    norm_topk_prob: bool
    sparse_step: int  # layer i is sparse when (i + 1) % sparse_step == 0 ...
    dense_layers: list[int]  # ... and i is not in mlp_only_layers
    # GPT-OSS: router and experts carry biases, and the experts' gate is the clamped SwiGLU of that limit
    # (None: silu(gate) * up).
    bias: bool = False
    swiglu_limit: float | None = None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> MoeConfig | None:
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        gpt_oss = cfg.get("model_type") == "gpt_oss"  # every layer sparse, experts of intermediate_size
        if experts <= 0 or ("moe_intermediate_size" not in cfg and not gpt_oss):
            return None
        return cls(
            num_experts=experts,
            top_k=int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token")),
            intermediate_size=int(cfg["intermediate_size" if gpt_oss else "moe_intermediate_size"]),
            shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
            # Qwen3.5-MoE has no such field and always renormalises; Qwen3-MoE's default is False; GPT-OSS
            # takes the softmax of the top-k logits, which is the renormalised top-k of the full softmax.
            norm_topk_prob=bool(cfg.get("norm_topk_prob", cfg.get("model_type") != "qwen3_moe")),
            sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            dense_layers=[int(i) for i in cfg.get("mlp_only_layers") or []],
            bias=gpt_oss,
            swiglu_limit=float(cfg.get("swiglu_limit") or 7.0) if gpt_oss else None,
        )

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


def read_config_json(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in {model_dir}: pass a Hugging Face model directory or a .gguf file")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}): re-download the checkpoint") from None


def _rope_field(cfg: dict[str, Any], name: str, default: Any) -> Any:
    """A rotary field from `rope_parameters` (transformers 5) or the top level (transformers 4)."""
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    params = params or (cfg.get("rope_scaling") if isinstance(cfg.get("rope_scaling"), dict) else {})
    value = params.get(name, cfg.get(name))
    if value is None:
        return default
    return float(value) if isinstance(default, float) else value


def _layer_types(cfg: dict[str, Any]) -> list[str]:
    """Per-layer mixer kinds; hybrids without `layer_types` use `full_attention_interval` (default 4)."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types:
        return [str(t) for t in types][:n]
    if "linear_num_value_heads" in cfg:
        interval = int(cfg.get("full_attention_interval") or 4)
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    if cfg.get("model_type") == "gpt_oss":  # transformers' default: sliding first, then every other layer
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    return []


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = params.get("rope_type", params.get("type", "default"))
        scaling = None if rope_type in PLAIN_ROPE_TYPES else dict(params)
        return theta, scaling
    theta = float(cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) in PLAIN_ROPE_TYPES:
        scaling = None
    return theta, scaling
