"""Qwen3.5 / Qwen3.6 text models, dense and MoE, served text-only.

The language model is Qwen3-Next's hybrid decoder with one projection per DeltaNet input
(in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) instead of packed groups; dense checkpoints have a
SwiGLU MLP in every layer, MoE ones a sparse block with a gated shared expert (the router always
renormalises its top-k weights). The VLM checkpoints (`*ForConditionalGeneration`) keep the
language model under `model.language_model.`, which the loader maps to `model.`; the vision tower
and MTP head are never read. Rotary is M-RoPE over a quarter of each head: for text tokens the
temporal, height and width positions are equal, so it is plain 1-D rotary over those dimensions.
"""

from __future__ import annotations

from blockspec.models.qwen3_next import Qwen3NextForCausalLM


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    packed_projections = False


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The VLM checkpoint's language model (text-only serving)."""


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """MoE layers come from the config's num_experts fields; the class only names the architecture."""


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    """The MoE VLM checkpoint's language model (text-only serving)."""
