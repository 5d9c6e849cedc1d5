"""--deterministic: batch-invariant numerics in the target, so greedy output does not depend on k or the batch.

On the GPU the fast path rounds a token differently depending on what shares its pass: the skinny GEMM has
a one-row path and a tensor-core path, cuBLAS picks kernels and split-K from the row count, prefill takes
flash attention while decode splits the keys by context length, the norm is folded into a GEMM for
decode rows only. Greedy DFlash then drifts from greedy decoding, and a request beside others drifts from
the same request alone. In this mode every row of the target goes through the same arithmetic whatever the
step holds (decode row, k+1 verify block, prefill chunk, any batch):

- norms: the standalone per-row RMSNorm (kernels/rms_norm.py: one program a row, the same reduction for
  every row; the hybrids' zero-centred form too), never folded into a GEMM;
- every projection and the LM head: kernels/deterministic_linear.py (tiles from the weight's shape only, K
  reduced in order, the bias, SwiGLU and residual add in the epilogue the same for every row count);
- quantized projections (QuantLinear: int4 / int8 with groups, symmetric or asymmetric, FP8 per channel or
  in blocks, NVFP4): the quant kernel's dot path (kernels/quant_linear.deterministic_quant_linear) with one
  launch config from the layer's format and shape (a 16-row tile, K in SPLIT slices summed in a fixed order
  inside the program), the weight dequantized in registers for every row count, long prefills too (never the
  dequantize-then-cuBLAS path); a checkpoint's quantized LM head is held dequantized, a plain weight;
- attention, decode and verify and prefill alike: kernels/paged_attention.fixed_split_attention (keys cut
  at fixed absolute positions, merged in order), prefill over the paged cache after its K/V are written;
  GPT-OSS's sliding window masks inside the same splits and its sinks join each row's normaliser once, last;
- rotary and q/k norm: one program per (token, head) already (kernels/rotary.py);
- MoE blocks (Qwen3-MoE, GPT-OSS, the hybrids' with a shared expert): the router GEMM as any projection, routing
  in fixed 16-token tiles (a row's softmax sums reduced the same way for any T), every expert GEMM on 16-row
  tensor-core tiles with one config from the weight's shape (a single token too, not the one-row path), bf16 or
  quantized stacks (MXFP4 and the dense layouts, dequantized in the tiles), expert biases and GPT-OSS's clamped
  SwiGLU in the epilogue, the combine per token in slot order (kernels/moe_grouped.py); a shared expert's
  projections and its sigmoid gate as any projection, added per element;
- Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5/3.6 dense and MoE): the short convolution and the delta rule
  through one per-token kernel each for decode rows, verify blocks, their commits and prefill chunks, the state
  rounded to its pool's dtype after every token so chunk boundaries change nothing
  (layers/deterministic_deltanet.py, kernels/deterministic_gated_deltanet.py), the gated RMSNorm per token;
  gated attention's zero-centred q/k norms and partial rotary per (token, head), its sigmoid gate per element.

The switch is one flag on the model (`set_deterministic`), read where each layer dispatches. Covered (COVERED):
the Llama-family dense targets, Qwen3-MoE, GPT-OSS and the Gated DeltaNet hybrids, unquantized or in
COVERED_SCHEMES' layouts; `problem` says what is refused and why. On CPU without Triton every piece runs its
row-by-row reference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from blockspec.kernels._triton import INTERPRET
from blockspec.kernels.deterministic_linear import deterministic_linear
from blockspec.kernels.moe_grouped import (
    FIXED_ROUTE_TOKENS,
    fixed_gemm_config,
    fused_supported,
    moe_align,
    moe_experts,
    moe_route,
)
from blockspec.kernels.quant_linear import deterministic_quant_linear
from blockspec.kernels.rms_norm import rms_norm
from blockspec.kernels.rotary import NORM_ZERO_CENTERED, rope_heads
from blockspec.models.layers.moe import SparseMoeBlock, route

COVERED_SCHEMES = ("int4", "int8", "fp8", "nvfp4", "mxfp4")  # the quantized layouts whose GEMMs are batch-invariant
COVERED = ("dense Llama-family targets (Llama, SmolLM, Qwen2, Qwen3), Qwen3-MoE, GPT-OSS and the Gated DeltaNet "
           "hybrids (Qwen3-Next, Qwen3.5/3.6 dense and MoE), with unquantized weights or quantized ones in the int4 / "
           "int8 (any group size, symmetric or asymmetric), FP8 (per tensor, per channel, 128x128 blocks), NVFP4 and "
           "MXFP4 layouts")


def problem(model_cls: type[nn.Module], architecture: str, quantization: str | None,
            schemes: Iterable[str] = ()) -> str | None:
    """Why --deterministic cannot be honoured for this target, or None. `quantization`: the checkpoint's
    description; `schemes`: the layouts its layers were built in (`quantized_schemes`, once the quantized
    modules are swapped in: before that only the model class is checked)."""
    if not getattr(model_cls, "supports_deterministic", False):
        return f"--deterministic covers {COVERED} so far; {architecture} is not covered " \
               "yet: drop --deterministic"
    uncovered = sorted(set(schemes) - set(COVERED_SCHEMES))
    if quantization is not None and uncovered:
        return f"--deterministic covers {COVERED} so far; this checkpoint's {quantization} ({', '.join(uncovered)} " \
               "layers) is not covered yet: drop --deterministic or serve unquantized weights"
    return None


def quantized_schemes(model: nn.Module) -> set[str]:
    """The layouts of the model's quantized layers (QuantLinear, and the expert stacks of QuantExperts)."""
    return {m.scheme for m in model.modules() if isinstance(getattr(m, "qweight", None), torch.Tensor)}


def linear(x: torch.Tensor, proj: nn.Module, *, gated: bool = False,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """proj(x) (SwiGLU over [gate; up] with `gated`, added into `residual` in place with it) through the
    batch-invariant kernel for the projection's weight format: every projection of a deterministic model goes
    through here. Quantized layers (QuantLinear: packed `qweight`, no `weight`) take the quant kernel's dot path
    with one launch config per layer (kernels/quant_linear.deterministic_quant_linear)."""
    if isinstance(getattr(proj, "qweight", None), torch.Tensor):
        return deterministic_quant_linear(x, proj, gated=gated, residual=residual)
    weight = getattr(proj, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise RuntimeError(f"deterministic projection: {type(proj).__name__} weights are not covered yet")
    return deterministic_linear(x, weight, proj.bias, gated=gated, residual=residual)


def norm(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """module(x) through the per-row kernel: an RMSNorm, or the hybrids' zero-centred form (scale 1 + weight,
    whose module computes in PyTorch ops: reductions whose strategy follows the shape on the GPU)."""
    if getattr(module, "zero_centered", False):
        return rms_norm(x, module.weight, module.eps, zero_centered=True)[0]
    return module(x)


def rowwise(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    """fn(*xs) for element-wise work on the GPU; one row at a time elsewhere: PyTorch's CPU kernels round a
    vectorised body and a scalar tail differently (SiLU, sigmoid), so a row's bits would follow its position."""
    if xs[0].is_cuda:
        return fn(*xs)
    return torch.cat([fn(*(x[i:i + 1] for x in xs)) for i in range(xs[0].shape[0])])


def attention_residual(h: torch.Tensor, norm_module: nn.Module, qkv_proj: nn.Module, o_proj: nn.Module,
                       attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """h += o_proj(attend(qkv_proj(norm(h)))), in place, the same arithmetic for any number of rows."""
    qkv = linear(norm(h, norm_module), qkv_proj)
    return linear(attend(qkv).contiguous(), o_proj, residual=h)


def gated_attention_residual(h: torch.Tensor, positions: torch.Tensor, norm_module: nn.Module,
                             attn: nn.Module) -> torch.Tensor:
    """h += o_proj(attention(q, k, v) * sigmoid(gate)), [q, gate] | k | v = qkv_proj(norm(h)), in place
    (Qwen3-Next / Qwen3.5's GatedAttention): zero-centred q/k norms, partial rotary and the cache write in the
    per-(token, head) kernel, attention through fixed_split_attention, the gate per element."""
    nq, nk, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    qkv = linear(norm(h, norm_module), attn.qkv_proj)
    cos, sin = attn.rotary.cos, attn.rotary.sin
    if qkv.is_cuda and (d & (d - 1) or cos.shape[1] % 2):  # rope_heads' PyTorch path reduces by shape
        raise RuntimeError(f"deterministic gated attention needs a power-of-two head_dim and an even rotary "
                           f"dimension, got {d} and {cos.shape[1]}")
    cache = attn.attn.cache_for_store()
    rope_heads(qkv, positions, cos, sin, nq, nk, d, 2 * d, 2 * nq * d, (2 * nq + nk) * d, NORM_ZERO_CENTERED,
               attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, *(cache if cache is not None else ()))
    q, gate, k, v = attn._split(qkv)
    out = attn.attn(q.contiguous(), k, v, stored=cache is not None)
    out = rowwise(lambda o, g: o * torch.sigmoid(g), out, gate.reshape(out.shape))
    return linear(out.contiguous(), attn.o_proj, residual=h)


def deltanet_residual(h: torch.Tensor, norm_module: nn.Module, mixer: nn.Module) -> torch.Tensor:
    """h += out_proj(GatedDeltaNet(norm(h))), in place: the input projections and out_proj as any projection,
    the conv, delta rule and gated norm per token (GatedDeltaNet.forward_deterministic)."""
    x = norm(h, norm_module)
    core = mixer.forward_deterministic(linear(x, mixer.in_proj_qkvz), linear(x, mixer.in_proj_ba))
    return linear(core, mixer.out_proj, residual=h)


def swiglu_residual(h: torch.Tensor, norm_module: nn.Module, gate_up_proj: nn.Module,
                    down_proj: nn.Module) -> torch.Tensor:
    """h += down_proj(silu(gate) * up) with [gate; up] = gate_up_proj(norm(h)), in place."""
    act = linear(norm(h, norm_module), gate_up_proj, gated=True)
    return linear(act, down_proj, residual=h)


def shared_expert(x: torch.Tensor, block: SparseMoeBlock) -> torch.Tensor:
    """sigmoid(shared_expert_gate(x)) * shared_expert(x), rounded as the block's PyTorch ops round it: the four
    projections as any projection, SwiGLU and the gate per element."""
    se = block.shared_expert
    gate, up = linear(x, se.gate_up_proj).chunk(2, dim=-1)
    act = rowwise(lambda g, u: torch.nn.functional.silu(g) * u, gate.contiguous(), up.contiguous())
    return rowwise(lambda g, y: torch.sigmoid(g) * y, linear(x, block.shared_expert_gate), linear(act, se.down_proj))


def moe_residual(h: torch.Tensor, norm_module: nn.Module, block: SparseMoeBlock) -> torch.Tensor:
    """h + block(norm(h)), the same arithmetic for any number of rows: the fixed-tile kernels where Triton runs,
    else the block's reference one row at a time (h updated in place); a shared expert (Qwen3-Next, Qwen3.5-MoE)
    is added to the routed output per element, as the block adds it."""
    x = norm(h, norm_module)
    logits = linear(x, block.gate)
    ex = block.experts
    shared = shared_expert(x, block) if block.shared_expert is not None else None
    if fused_supported(x, ex.gate_up_proj, ex.down_proj):
        weights, ids, _ = moe_route(logits, block.top_k, block.renormalize, block_t=FIXED_ROUTE_TOKENS)
        quantized = not isinstance(ex.gate_up_proj, torch.Tensor)  # QuantExperts: the stacks dequantized in tiles
        configs = (fixed_gemm_config(x.shape[1], quantized), fixed_gemm_config(ex.intermediate_size, quantized))
        out = moe_experts(x, ex.gate_up_proj, ex.down_proj, weights, ids, configs=configs,
                          layout=moe_align(ids, ex.num_experts, False), residual=h if shared is None else None,
                          gate_up_bias=ex.gate_up_proj_bias, down_bias=ex.down_proj_bias, limit=ex.activation.limit,
                          alpha=ex.activation.alpha)
        return out if shared is None else h + (out + shared)
    for i in range(h.shape[0]):  # one fixed-shape pass per row: no row count enters its arithmetic
        weights, ids = route(logits[i:i + 1], block.top_k, block.renormalize)
        out = ex(x[i:i + 1], weights, ids)
        h[i:i + 1] = h[i:i + 1] + (out if shared is None else out + shared[i:i + 1])
    return h


def logits(hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    """The LM head's GEMM. A checkpoint's quantized head is held dequantized (loader/quant/apply.finalize_quantized:
    the logits and the drafter read its weight), so it is a plain weight here too."""
    return deterministic_linear(hidden.contiguous(), lm_head_weight)


def report(on: bool, device: torch.device) -> str:
    """The start-up line saying which numerics the target runs with."""
    if on:
        triton = device.type == "cuda" or INTERPRET
        where = "Triton kernels" if triton else "row-by-row PyTorch references (slow on CPU)"
        return (f"deterministic (--deterministic: batch-invariant GEMMs, norms and fixed-split attention, {where}; "
                "greedy output is the same for any k and batch)")
    if device.type == "cuda":
        return ("fast (greedy output may differ in late tokens with k and with the batch on the GPU: "
                "--deterministic makes it bit-identical)")
    return "fast"
