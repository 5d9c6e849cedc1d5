"""Maps a checkpoint's `architectures[0]` to our model class."""

from __future__ import annotations

from torch import nn

from blockspec.errors import ConfigError
from blockspec.models.gpt_oss import GptOssForCausalLM
from blockspec.models.llama import LlamaForCausalLM
from blockspec.models.model_config import ModelConfig
from blockspec.models.qwen2 import Qwen2ForCausalLM
from blockspec.models.qwen3 import Qwen3ForCausalLM
from blockspec.models.qwen3_5 import (
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
)
from blockspec.models.qwen3_moe import Qwen3MoeForCausalLM
from blockspec.models.qwen3_next import Qwen3NextForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    cls = MODEL_CLASSES.get(cfg.architecture)
    if cls is None:
        supported = ", ".join(sorted(MODEL_CLASSES))
        raise ConfigError(f"architecture {cfg.architecture or '(none)'!r} is not supported; supported: {supported}")
    return cls
