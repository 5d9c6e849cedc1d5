"""GPT-OSS: attention with learned sinks on alternating sliding-window and full layers, and a sparse MoE
with biased router and experts and a clamped SwiGLU gate.

Attention projections carry biases (q/k/v/o); each head has a learned sink logit that joins its softmax
(models/layers/attention.PagedAttention's `sinks`); `layer_types` marks layers "sliding_attention" (keys
less than `sliding_window` positions back) or "full_attention". Rotary is YaRN as the config defines it
(`truncate: false` keeps the ramp's ends fractional). Every MLP is a SparseMoeBlock: top-k of the
router's logits (with bias), softmax over those k, experts with biases and the clamped SwiGLU
(alpha 1.702, `swiglu_limit`). Everything else is the Llama/Qwen3-MoE code.

Checkpoints keep transformers' layouts, which `checkpoint_tensor` maps to ours as they stream in:
`mlp.router` is our `mlp.gate`, `self_attn.sinks` lives on the attention kernel's module, and the experts'
gate|up rows are interleaved (gate at even rows, up at odd) where ours hold [gate; up] halves; bf16 expert
stacks are stored transposed ([E, H, 2I] and [E, I, H]). MXFP4 stacks (`*_blocks` / `*_scales`) are rows
of the [E, N, K] weight already and only need the gate|up de-interleave (loader/quant does the rest).
"""

from __future__ import annotations

import torch
from torch import nn

from blockspec.errors import ConfigError
from blockspec.models.layers.moe import GatedActivation, SparseMoeBlock
from blockspec.models.layers.norm import RMSNorm
from blockspec.models.layers.rotary import RotaryEmbedding
from blockspec.models.llama import LlamaAttention, LlamaDecoderLayer
from blockspec.models.model_config import ModelConfig
from blockspec.models.qwen3_moe import Qwen3MoeForCausalLM

# checkpoint name part -> ours
RENAMES = ((".mlp.router.", ".mlp.gate."), (".self_attn.sinks", ".self_attn.attn.sinks"))
# expert tensors whose dim 1 holds the interleaved gate|up rows (after the bf16 stack's transpose)
INTERLEAVED = (".experts.gate_up_proj", ".experts.gate_up_proj_bias", ".experts.gate_up_proj_blocks",
               ".experts.gate_up_proj_scales")
TRANSPOSED = (".experts.gate_up_proj", ".experts.down_proj")  # bf16 stacks: [E, K, N] in the checkpoint


def deinterleave_rows(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with gate rows at even and up rows at odd indices -> [gate; up] halves."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1).contiguous()


class GptOssDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block (its forward): sink attention, windowed on sliding layers, and the MoE."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, layer: int) -> None:
        nn.Module.__init__(self)  # not LlamaDecoderLayer's: it would build a dense MLP first
        moe = cfg.moe
        sliding = cfg.layer_types and cfg.layer_types[layer] == "sliding_attention"
        self.self_attn = LlamaAttention(cfg, rotary, qkv_bias=True, qk_norm=False,
                                        sliding_window=cfg.sliding_window if sliding else None, sinks=True)
        self.mlp = SparseMoeBlock(cfg.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size, True,
                                  bias=True, activation=GatedActivation(moe.swiglu_limit))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GptOssForCausalLM(Qwen3MoeForCausalLM):
    layer_cls = GptOssDecoderLayer
    # --deterministic (models/deterministic.py): fixed_split_attention with the sinks and window, the biased
    # projections' epilogues, moe_residual's fixed tiles with the expert biases and clamped SwiGLU, bf16 or MXFP4
    supports_deterministic = True

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        if cfg.moe is None:
            raise ConfigError("GPT-OSS config.json lacks num_local_experts: not a GPT-OSS checkpoint?")
        super().__init__(cfg, max_positions)

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """A checkpoint tensor under our name and in our layout (see the module docstring)."""
        for old, new in RENAMES:
            name = name.replace(old, new)
        if name.endswith(TRANSPOSED) and tensor.dim() == 3:
            tensor = tensor.transpose(1, 2)
        if name.endswith(INTERLEAVED):
            tensor = deinterleave_rows(tensor)
        return name, tensor
