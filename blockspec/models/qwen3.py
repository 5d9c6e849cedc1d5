"""Qwen3: the Llama block with per-head RMSNorm on queries and keys before rotary."""

from blockspec.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
