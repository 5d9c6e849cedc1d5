"""Engine-side pieces of bench/hybrid_gpu.py: model directories, byte accounting, timed runs, MoE routing.

Everything here goes through `Engine` as `serve` builds it (load_format="dummy": random weights in the
checkpoint's shapes); the only model internals touched are read-only (parameter sizes) and the two
hooks of `SparseMoeBlock` (`route_override`, `record_routing`), found with getattr.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from correlated_router import correlated_router  # noqa: E402  (bench/ is on sys.path)

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine, build_module
from blockspec.engine.sampling_params import SamplingParams
from blockspec.loader.quant import deferred_linears, quantize_model
from blockspec.loader.quant.config import parse_quantization
from blockspec.models.layers.moe import SparseMoeBlock
from blockspec.models.layers.quant_linear import QuantExperts, quantized_tensor_bytes
from blockspec.models.model_config import ModelConfig
from blockspec.models.registry import model_class
from blockspec.spec.dflash import DFlashDrafter, DrafterConfig, default_target_layer_ids

MIB = 1 << 20
TOKENIZER_SIZE = 256  # word-level ids 0..255 plus <unk>: enough to detokenize nothing, load everything

# ---- model directories ------------------------------------------------------------------------


def write_tokenizer(path: Path) -> None:
    """A small word-level fast tokenizer (the benchmark feeds token ids; this only has to load)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(TOKENIZER_SIZE)}
    vocab["<unk>"] = TOKENIZER_SIZE
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<unk>").save_pretrained(path)


def torch_dtype(name: str) -> torch.dtype:
    from blockspec.config import DTYPES

    return DTYPES[name]


def write_model_dir(path: Path, config: dict[str, Any], tokenizer: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if tokenizer:
        write_tokenizer(path)
    return path


def drafter_config(target: dict[str, Any], mask_token_id: int, layers: int = 5) -> tuple[dict[str, Any], list[str]]:
    """A z-lab-shaped DFlash drafter for `target`: `layers` Qwen3 layers of the target's width and heads,
    block size 16, context layers spread from 1 to L-3. Returns (config, fields that are assumed)."""
    cfg = ModelConfig.from_dict(target)
    assumed = ["drafter heads/head_dim/intermediate follow the target (first_gpu.drafter_config's rule)"]
    intermediate = cfg.intermediate_size
    if not intermediate:  # MoE-only targets have no dense MLP width
        intermediate = 3 * cfg.hidden_size
        assumed.append(f"drafter intermediate_size {intermediate} = 3 x hidden (target has none)")
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": 1e-6, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "block_size": 16,
        "num_target_layers": cfg.num_hidden_layers, "tie_word_embeddings": False,
        "dflash_config": {"mask_token_id": mask_token_id,
                          "target_layer_ids": default_target_layer_ids(cfg.num_hidden_layers, layers)},
    }, assumed


def param_bytes_estimate(target: dict[str, Any], drafter: dict[str, Any] | None, dtype: torch.dtype) -> int:
    """Weight bytes of target + drafter, counted on the meta device (nothing allocated); a quantized config's
    layers as the loader holds them (packed weights + scales)."""
    meta = torch.device("meta")
    cfg = ModelConfig.from_dict(target)
    qcfg = target.get("quantization_config") or cfg.raw.get("quantization_config")  # VLMs: beside text_config
    quant = parse_quantization(qcfg) if qcfg else None
    with deferred_linears() if quant is not None else contextlib.nullcontext():
        model = build_module(lambda: model_class(cfg)(cfg, max_positions=64), meta, dtype)
    if quant is not None:
        quantize_model(model, quant, meta, dtype)
    modules = [model]
    if drafter is not None:
        dcfg = DrafterConfig.from_dict(drafter)
        modules.append(build_module(lambda: DFlashDrafter(dcfg, 64), meta, dtype))
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters()) + quantized_tensor_bytes(model)


def kv_cache_bytes(target: dict[str, Any], drafter: dict[str, Any] | None, dtype: torch.dtype, max_num_seqs: int,
                   max_model_len: int, block_size: int = 16) -> int:
    """--kv-cache-memory for max_num_seqs full-length sequences (+ verify room and 10% slack): a fixed
    amount instead of a share of the card, so the same defaults fit an 80 GB H100 and an H200."""
    per_token = ModelConfig.from_dict(target).kv_bytes_per_token
    if drafter is not None:
        per_token += ModelConfig.from_dict({**drafter, "architectures": ["DFlashDraftModel"]}).kv_bytes_per_token
    per_token = per_token * torch.tensor([], dtype=dtype).element_size() // 2  # kv_bytes_per_token assumes 2 bytes
    blocks = max_num_seqs * (-(-(max_model_len + 2 * block_size) // block_size) + 1)
    return int(1.1 * blocks * block_size * per_token) + 32 * MIB


def build_engine(model_dir: Path, draft_dir: Path | None, k: int, device: str, dtype: str, max_model_len: int,
                 max_num_seqs: int, kv_cache_memory: int | None, gpu_memory_utilization: float | None,
                 enforce_eager: bool = False, draft_quantization: str | None = None) -> Engine:
    """The engine `serve` would build for these flags (random weights: load_format dummy); draft_quantization is
    --speculative-config's "quantization" (an online method quantizes the random drafter at load)."""
    spec = SpeculativeConfig(model=str(draft_dir), num_speculative_tokens=k, load_format="dummy",
                             quantization=draft_quantization) if draft_dir is not None else SpeculativeConfig()
    memory: dict[str, Any] = {"kv_cache_memory": kv_cache_memory} if gpu_memory_utilization is None else \
        {"gpu_memory_utilization": gpu_memory_utilization}
    return Engine(EngineConfig(model=str(model_dir), device=device, dtype=dtype, max_model_len=max_model_len,
                               max_num_seqs=max_num_seqs, load_format="dummy", speculative=spec,
                               enforce_eager=enforce_eager, **memory))


# ---- bytes one step reads ---------------------------------------------------------------------


def weight_split(target: torch.nn.Module) -> dict[str, Any]:
    """Weight bytes by role. dense: every matrix a decode token reads whole except the LM head (attention,
    DeltaNet, dense MLPs, routers, shared experts, norms); lm_head: the output matrix (the embedding table
    when tied); embedding: an untied table (one row per token: left out of the rooflines); experts: bytes of
    one expert per MoE layer, with that layer's top-k. Quantized layers count as held (packed + scales)."""
    blocks = [m for m in target.modules() if isinstance(m, SparseMoeBlock)]
    expert_params = {id(p) for b in blocks for p in b.experts.parameters()}
    lm = target.lm_head_weight
    embeds = {id(m.weight) for m in target.modules() if isinstance(m, torch.nn.Embedding)}

    def expert_bytes(experts: torch.nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in experts.parameters()) + quantized_tensor_bytes(experts)

    out = {"total": 0, "dense": 0, "lm_head": 0, "embedding": 0,
           "experts": [{"bytes_per_expert": expert_bytes(b.experts) // b.experts.num_experts,
                        "num_experts": b.experts.num_experts, "top_k": b.top_k,
                        "scheme": getattr(b.experts, "scheme", None)} for b in blocks]}
    quantized = quantized_tensor_bytes(target)
    quantized_dense = quantized - sum(quantized_tensor_bytes(b.experts) for b in blocks)
    out["total"] += quantized
    out["dense"] += quantized_dense
    for p in target.parameters():  # shared (tied) parameters come once
        n = p.numel() * p.element_size()
        out["total"] += n
        if id(p) in expert_params:
            continue
        role = "lm_head" if p is lm else "embedding" if id(p) in embeds else "dense"
        out[role] += n
    return out


def step_bytes(split: dict[str, Any], experts_per_layer: list[float] | None = None) -> float:
    """Weight bytes one step reads: dense + LM head + the experts it touches (top-k each when not given)."""
    touched = experts_per_layer if experts_per_layer is not None else [e["top_k"] for e in split["experts"]]
    return split["dense"] + split["lm_head"] + sum(n * e["bytes_per_expert"] for n, e in zip(touched, split["experts"]))


@torch.inference_mode()  # as the engine runs: with grad enabled the experts take the reference path
def quantized_experts_capturable(device: str) -> dict[str, Any]:
    """Whether quantized MoE experts run inside a CUDA graph (a kernel that dequantizes in registers, no host
    sync) or only eagerly (the dequantize-then-matmul reference reads the routed ids back to the host)."""
    if device != "cuda":
        return {"capturable": True, "note": "no CUDA graphs off the GPU"}
    experts = QuantExperts("mxfp4", 4, 64, 64, 32, 32, dtype=torch.bfloat16, device=device)
    x = torch.randn(2, 64, device=device, dtype=torch.bfloat16)
    weights = torch.full((2, 2), 0.5, device=device, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3]], device=device)
    experts(x, weights, ids)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            experts(x, weights, ids)
    except Exception as exc:  # a host sync inside the capture
        torch.cuda.synchronize()
        return {"capturable": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"capturable": True}


# ---- timed runs -------------------------------------------------------------------------------


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, min(vocab, 30000), (length,), generator=gen).tolist() for _ in range(n)]


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False)


def one_request(engine: Engine, prompt: list[int], tokens: int) -> dict[str, Any]:
    """One greedy request through engine.generate: its decode rate and mean step time."""
    st = engine.generate([prompt], greedy(tokens))[0].stats
    return {"tok_s": st.decode_tok_s, "step_ms": 1000 * st.decode_time / max(st.steps, 1), "steps": st.steps,
            "tau": st.tau}


def decode_steps_table(engine: Engine, prompt: list[int], tokens: int, table: Callable[..., dict[str, Any]]
                       ) -> dict[str, Any]:
    """profile_decode.steps_table over the decode steps of one greedy request (its prefill steps run before
    the profiler starts), per step, beside the mean wall time of those steps."""
    engine.add_request("profiled", prompt, greedy(tokens))
    while not any(o.token_ids for o in engine.step()):
        pass  # prefill (chunks) until the first token
    steps = 0
    wall = 0.0

    def decode() -> None:
        nonlocal steps, wall
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        wall = time.perf_counter() - t0

    out = table(decode, 1)
    scale = 1 / max(steps, 1)
    rows = [[name, round(us * scale, 2), round(n * scale, 2)] for name, us, n in out["kernels"]]
    return {"steps": steps, "step_us": round(1e6 * wall * scale, 1), "kernel_us": round(out["kernel_us"] * scale, 1),
            "launches": round(out["launches"] * scale, 1), "kernels": rows[:40]}


def median_runs(fn: Callable[[], dict[str, Any]], runs: int, warmup: Callable[[], Any] | None = None
                ) -> dict[str, Any]:
    """Medians of `runs` calls after one warm-up call (warmup, or fn itself)."""
    (warmup or fn)()
    results = [fn() for _ in range(runs)]
    out = {key: statistics.median(r[key] for r in results) for key in results[0]}
    out["runs"] = [round(r["tok_s"], 2) for r in results]
    return out


def aggregate_decode(engine: Engine, prompts: list[list[int]], tokens: int, tag: str) -> dict[str, Any]:
    """All prompts at once; aggregate decode tok/s over the steps where every request decodes (after the
    last prefill, until the first request finishes), so chunked prefill does not dilute it."""
    n = len(prompts)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, greedy(tokens))
    started: set[str] = set()
    finished = steady_tokens = steady_steps = 0
    steady_s = 0.0
    while engine.has_unfinished_requests():
        steady = len(started) == n and finished == 0
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        new = 0
        for out in outs:
            if out.request_id in started:
                new += len(out.new_token_ids)
            elif out.new_token_ids:
                started.add(out.request_id)
            finished += out.finished
        if steady:
            steady_tokens += new
            steady_s += dt
            steady_steps += 1
    return {"tok_s": steady_tokens / steady_s if steady_s else 0.0,
            "step_ms": 1000 * steady_s / max(steady_steps, 1), "steps": steady_steps}


# ---- MoE routing ------------------------------------------------------------------------------


def moe_blocks(engine: Engine) -> list[SparseMoeBlock]:
    return [m for m in engine.runner.target.modules() if isinstance(m, SparseMoeBlock)]


def missing_hooks(blocks: list[SparseMoeBlock]) -> list[str]:
    """The SparseMoeBlock hooks this tree lacks (route_override, record_routing)."""
    sentinel = object()
    return [name for name in ("route_override", "record_routing")
            if blocks and getattr(blocks[0], name, sentinel) is sentinel]


def set_routing(engine: Engine, share: float | None) -> None:
    """share None: the model's own (uniform random) router; else the correlated router on every block."""
    for b in moe_blocks(engine):
        b.route_override = None if share is None else correlated_router(
            b.top_k, b.experts.num_experts, share, b.renormalize)


def recapture(engine: Engine) -> None:
    """Re-make the decode step (and its CUDA graphs) at the current k, so hook changes are captured. Synthetic
    drafts stay synthetic: set_num_speculative_tokens alone would bring the configured drafter back, and a
    "verify step alone" would then time the drafter's pass as well."""
    synthetic = engine.synthetic
    if synthetic is not None:
        engine.enable_synthetic_drafts(synthetic.references, synthetic.accept_prob, engine.num_speculative_tokens)
    else:
        engine.set_num_speculative_tokens(engine.num_speculative_tokens)


def distinct_experts(engine: Engine, prompt: list[int], tokens: int, q: int) -> dict[str, Any]:
    """Mean distinct experts per MoE layer over the verify passes (q tokens each) of one request.

    record_routing is switched on (and the decode step re-captured) for this request only; each step's
    ids are counted on the device and read back once at the end."""
    blocks = moe_blocks(engine)
    for b in blocks:
        b.record_routing = True
        if hasattr(b, "ids_by_tokens"):
            b.ids_by_tokens.clear()
    recapture(engine)
    counts: list[torch.Tensor] = []
    try:
        engine.add_request("routing", prompt, greedy(tokens))
        while engine.has_unfinished_requests():
            outs = engine.step()
            if not any(o.token_ids and len(o.token_ids) > len(o.new_token_ids) for o in outs):
                continue  # the prefill step
            # by token count: a graph replay refreshes the tensor captured for q tokens, while the eager
            # prefill left `last_ids` pointing at its own
            ids = [getattr(b, "ids_by_tokens", {}).get(q, getattr(b, "last_ids", None)) for b in blocks]
            if any(i is None or i.shape[0] != q for i in ids):
                continue
            counts.append(torch.stack([torch.zeros(b.experts.num_experts, device=i.device).index_fill_(
                0, i.reshape(-1).long(), 1).sum() for b, i in zip(blocks, ids)]))
    finally:
        for b in blocks:
            b.record_routing = False
        recapture(engine)
    if not counts:
        return {"error": f"no verify pass of {q} tokens was recorded"}
    per_layer = torch.stack(counts).float().mean(0).tolist()
    return {"per_layer": [round(x, 2) for x in per_layer], "mean": statistics.fmean(per_layer),
            "steps": len(counts)}
