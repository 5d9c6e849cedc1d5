"""Qwen2: the Llama block with biases on the q/k/v projections."""

from blockspec.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
