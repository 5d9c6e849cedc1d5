"""`blockspec plan`: will this model (+ drafter) fit, at what context x concurrency, and how fast can it go.

Everything comes from config.json files (and safetensors headers when present): weights, KV bytes
per token, recurrent state for hybrids. The verdict uses the same KV arithmetic the engine runs at
start-up (blockspec/engine/memory.py); only the activation peak, which the engine measures by running
the largest step, and the CUDA context are estimated here. Checked on an H200 against the engine's own
start-up numbers (tests/bench/plan_vs_engine_gpu.py): weights and KV bytes per block agree exactly,
activations within 0.3 GiB (plan above the engine for large models), KV budget within 0.6 GiB.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockspec.bench.footprint import (
    DTYPE_BYTES,
    Footprint,
    drafter_footprint,
    recurrent_state_bytes,
    target_footprint,
    text_config,
)
from blockspec.bench.presets import PRESETS
from blockspec.config import DEFAULT_MAMBA_CACHE_SNAPSHOTS
from blockspec.engine.memory import GIB, MIB, blocks_for_sequence, cuda_kv_budget, kv_shortfall
from blockspec.engine.state_pool import checkpoints_per_slot
from blockspec.errors import ConfigError
from blockspec.models.layers.recurrent_state import pool_size

ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
# CUDA context and driver memory: outside the measured step peak, but the engine sees it as memory it
# may not use ("others" in memory.cuda_kv_budget). Measured 0.60-0.68 GiB on an H200 (tests/bench/
# plan_vs_engine_gpu.py); kept a little above so plan errs towards "does not fit".
CUDA_RESERVE_BYTES = 3 * GIB // 4
# Fixed workspaces (cuBLAS, sampler buffers) the per-token activation formula does not scale with.
ACTIVATION_FLOOR_BYTES = 64 << 20
UNIFIED_SAFE_UTILIZATION = 0.85  # above this a unified-memory box starves its OS (seeds: Thor, Spark)


@dataclass
class PlanInputs:
    model: str | None = None
    draft: str | None = None
    draft_quantization: str | None = None  # --speculative-config "quantization" (an online method)
    num_speculative_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    dtype: str = "auto"
    memory_bytes: int | None = None
    bandwidth_gbs: float | None = None
    device_preset: str | None = None
    enable_prefix_caching: bool = True
    mamba_cache_mode: str = "align"
    mamba_block_size: int | None = None
    mamba_cache_snapshots: int = DEFAULT_MAMBA_CACHE_SNAPSHOTS


def _dtype(dtype: str, checkpoint_dtype: str | None) -> str:
    """The dtype `serve` picks on a GPU (EngineConfig.resolve_dtype)."""
    if dtype != "auto":
        name = ALIASES.get(dtype, dtype)
        if name not in DTYPE_BYTES:
            raise ConfigError(f"--dtype {dtype!r} is not one of auto, float32, bfloat16, float16")
        return name
    return checkpoint_dtype if checkpoint_dtype in ("float16", "bfloat16") else "bfloat16"


def activation_estimate(cfg: dict[str, Any], tokens: int, elem: int, n_capture: int, logit_rows: int) -> int:
    """Peak activation bytes of the largest prefill step (the engine measures this; we estimate).

    Per token: residual + normed hidden + attention/linear-attention projections + MLP intermediates
    + captured context features; plus the bool attention mask and fp32 logits of the sampled rows.
    """
    t = text_config(cfg)
    h = int(t["hidden_size"])
    nh = int(t["num_attention_heads"])
    nkv = int(t.get("num_key_value_heads") or nh)
    hd = int(t.get("head_dim") or h // nh)
    proj = (2 * nh + 2 * nkv) * hd + nh * hd
    if "linear_num_value_heads" in t:
        nk, nv = int(t["linear_num_key_heads"]), int(t["linear_num_value_heads"])
        dk, dv = int(t["linear_key_head_dim"]), int(t["linear_value_head_dim"])
        proj = max(proj, 2 * (2 * nk * dk + nv * dv) + 2 * nv * dv)
    experts = int(t.get("num_experts") or t.get("num_local_experts") or 0)
    inter = int(t.get("intermediate_size") or 0)
    if experts:
        moe = int(t.get("num_experts_per_tok") or 1) * int(t.get("moe_intermediate_size") or inter)
        inter = max(inter, moe + int(t.get("shared_expert_intermediate_size") or 0))
    per_token = (4 * h + proj + 3 * inter + n_capture * h) * elem
    return ACTIVATION_FLOOR_BYTES + tokens * per_token + tokens * tokens + logit_rows * int(t["vocab_size"]) * 4 * 2


def _fit_table(kv_budget: int, per_block: int, k: int, block_size: int, limit: int,
               max_model_len: int) -> list[dict[str, int]]:
    contexts = sorted({c for c in (2048 << i for i in range(12)) if c < limit} | {max_model_len, limit})
    rows = []
    for c in contexts:
        per_seq = blocks_for_sequence(c, k, block_size) * per_block
        rows.append({"context": c, "max_sequences": max(0, kv_budget // per_seq) if kv_budget > 0 else 0})
    return rows


def _max_len_for(seqs: int, kv_budget: int, per_block: int, k: int, block_size: int) -> int:
    """Longest max_model_len at which `seqs` full-length sequences fit in kv_budget."""
    if kv_budget <= 0 or seqs < 1:
        return 0
    blocks = (kv_budget // seqs) // per_block
    return max(0, blocks * block_size - k - 1)


def make_plan(inp: PlanInputs) -> dict[str, Any]:
    """Compute every figure of the plan; raises BlockspecError only for unreadable inputs."""
    from blockspec.config import EngineConfig, SpeculativeConfig
    from blockspec.loader.weights import resolve_model_path
    from blockspec.models.model_config import ModelConfig, read_config_json

    model_dir = resolve_model_path(inp.model)
    raw = read_config_json(model_dir)
    text = text_config(raw)
    dtype = _dtype(inp.dtype, text.get("torch_dtype") or text.get("dtype") or raw.get("torch_dtype"))
    elem = DTYPE_BYTES[dtype]
    target = target_footprint(raw, dtype, model_dir=model_dir)
    reasons: list[str] = []  # why serve would refuse to start, each with what to change
    warnings: list[str] = []
    mcfg = None
    try:
        mcfg = ModelConfig.from_dict(raw)
    except ConfigError as exc:
        reasons.append(str(exc))
    arch = (raw.get("architectures") or [""])[0]

    drafter: Footprint | None = None
    dcfg = None
    block = 1
    if inp.draft:
        from blockspec.spec.dflash import DrafterConfig

        draft_dir = Path(inp.draft)
        dcfg = DrafterConfig.from_dir(draft_dir)
        drafter = drafter_footprint(read_config_json(draft_dir), dtype, inp.draft_quantization,
                                    (int(text["vocab_size"]), int(text["hidden_size"])))
        block = dcfg.block_size
        if mcfg is not None:
            try:
                dcfg.check_target(mcfg)
            except ConfigError as exc:
                reasons.append(str(exc))
    k = (inp.num_speculative_tokens if inp.num_speculative_tokens is not None else block - 1) if dcfg else 0
    if dcfg and k > block - 1:
        reasons.append(f"num_speculative_tokens {k} exceeds the drafter's block_size - 1 = {block - 1}: lower it")

    limit = int(text.get("max_position_embeddings", 4096))
    max_len = inp.max_model_len or limit
    if max_len > limit:
        reasons.append(f"--max-model-len {max_len} exceeds the model's max_position_embeddings {limit}: lower it")
    spec = SpeculativeConfig(model=inp.draft, num_speculative_tokens=k, quantization=inp.draft_quantization)
    engine_cfg = EngineConfig(model=str(model_dir), speculative=spec, max_model_len=max_len,
                              max_num_seqs=inp.max_num_seqs, max_num_batched_tokens=inp.max_num_batched_tokens,
                              block_size=inp.block_size, gpu_memory_utilization=inp.gpu_memory_utilization,
                              enable_prefix_caching=inp.enable_prefix_caching, mamba_cache_mode=inp.mamba_cache_mode,
                              mamba_block_size=inp.mamba_block_size, mamba_cache_snapshots=inp.mamba_cache_snapshots)
    try:
        engine_cfg.validate()
    except ConfigError as exc:
        reasons.append(str(exc))
    if mcfg is not None:
        from blockspec.models.registry import model_class

        try:
            model_class(mcfg)
        except ConfigError as exc:
            reasons.append(f"{exc} (blockspec cannot serve this family yet; the figures below still hold)")

    # ---- memory -----------------------------------------------------------------------------
    kv_token = target.kv_bytes_per_token + (drafter.kv_bytes_per_token if drafter else 0)
    per_block = kv_token * inp.block_size
    # Hybrids: the engine allocates max_num_seqs state slots before sizing the KV cache (state_pool.py),
    # with k + 1 checkpoints per slot in checkpoint rollback mode, and the prefix cache's state snapshots.
    checkpoints = checkpoints_per_slot(k) if target.state_bytes_per_seq else 0
    snapshots = engine_cfg.num_state_snapshots() if target.state_bytes_per_seq else 0
    state = recurrent_state_bytes(raw, dtype, checkpoints)
    plain_state = recurrent_state_bytes(raw, dtype, 0)
    # slot pairs + the scratch pair (+ checkpoints) + snapshots
    state_pool = pool_size(plain_state, state, inp.max_num_seqs, snapshots)
    scratch_pool = pool_size(plain_state, state, 0, snapshots)  # what does not shrink with --max-num-seqs
    state_per_seq = pool_size(plain_state, state, 1, snapshots) - scratch_pool
    min_blocks = blocks_for_sequence(max_len, k, inp.block_size)
    need_one = min_blocks * per_block
    weights = target.weight_bytes + (drafter.weight_bytes if drafter else 0)
    n_capture = len(dcfg.target_layer_ids) if dcfg else 0
    tokens = max(1, min(inp.max_num_batched_tokens, max_len - 1))
    act = activation_estimate(raw, tokens, elem, n_capture, inp.max_num_seqs * (k + 1))
    preset = PRESETS.get(inp.device_preset) if inp.device_preset else None
    if inp.device_preset and preset is None:
        raise ConfigError(f"--device-preset {inp.device_preset!r} is not one of {', '.join(PRESETS)}")
    total_mem, device = inp.memory_bytes, "given --memory-gb"
    if total_mem is None and preset is not None:
        total_mem, device = preset.memory_bytes, preset.description
    if total_mem is None:
        total_mem, device = _local_cuda_memory()
    bandwidth = inp.bandwidth_gbs or (preset.bandwidth_gbs if preset else None)

    memory: dict[str, Any] = {"device": device, "total_bytes": total_mem,
                              "gpu_memory_utilization": inp.gpu_memory_utilization, "weight_bytes": weights,
                              "state_pool_bytes": state_pool,
                              "activation_estimate_bytes": act, "cuda_reserve_bytes": CUDA_RESERVE_BYTES}
    fit: dict[str, Any] = {}
    if total_mem is not None:
        kv_budget = cuda_kv_budget(total_mem, inp.gpu_memory_utilization, CUDA_RESERVE_BYTES,
                                   weights + state_pool + act)
        memory["kv_budget_bytes"] = kv_budget
        memory["kv_tokens"] = max(0, kv_budget // per_block * inp.block_size) if per_block else 0
        allowed = total_mem * inp.gpu_memory_utilization
        fixed = weights + state_pool + act + CUDA_RESERVE_BYTES
        util_needed = (fixed + need_one) / total_mem
        slots = int((allowed - weights - act - CUDA_RESERVE_BYTES - need_one - scratch_pool) // state_per_seq) \
            if state else 0
        fewer = f"--max-num-seqs {slots}" if state and 1 <= slots < inp.max_num_seqs else None
        if fixed > allowed:
            fix = " or ".join(f for f in (fewer, f"--gpu-memory-utilization {util_needed:.2f}"
                                          if util_needed <= 0.95 else None) if f)
            fix = f"{fix} would fit" if fix else "use a quantized checkpoint or a device with more memory"
            pool = f" + recurrent state ({state_pool / GIB:.2f} GiB)" if state_pool else ""
            reasons.append(f"weights ({weights / GIB:.2f} GiB){pool} + activations (~{act / GIB:.2f} GiB) + CUDA "
                           f"reserve ({CUDA_RESERVE_BYTES / GIB:.2f} GiB) exceed {inp.gpu_memory_utilization:g} x "
                           f"{total_mem / GIB:.1f} GiB = {allowed / GIB:.2f} GiB: {fix}")
        else:
            message = kv_shortfall("cuda", max_len, need_one, kv_budget)
            if message:
                if state_pool:  # the engine's own addendum (engine/memory.py)
                    message += (f" (the recurrent state of --max-num-seqs {inp.max_num_seqs} sequences already "
                                f"takes {state_pool / MIB:.0f} MiB: fewer sequences need less)")
                longest = min(limit, _max_len_for(1, kv_budget, per_block, k, inp.block_size))
                fixes = [f"--max-model-len {longest}" if longest >= 2 else None, fewer,
                         f"--gpu-memory-utilization {util_needed:.2f}" if util_needed <= 0.95 else None]
                message += " (" + " or ".join(f for f in fixes if f) + " would fit)" if any(fixes) else ""
                reasons.append(message)
        seqs_at_len = max(0, kv_budget // need_one) if kv_budget > 0 else 0
        fit = {"max_sequences_at_max_model_len": seqs_at_len,
               "max_model_len_at_max_num_seqs": min(limit, _max_len_for(inp.max_num_seqs, kv_budget, per_block,
                                                                        k, inp.block_size)),
               "table": _fit_table(kv_budget, per_block, k, inp.block_size, limit, max_len)}
        if 0 < seqs_at_len < inp.max_num_seqs:
            warnings.append(f"only {seqs_at_len} of --max-num-seqs {inp.max_num_seqs} sequences fit at the full "
                            f"{max_len} tokens at once (the rest wait); all {inp.max_num_seqs} fit up to "
                            f"--max-model-len {fit['max_model_len_at_max_num_seqs']}")
        if preset is not None and preset.unified and inp.gpu_memory_utilization > UNIFIED_SAFE_UTILIZATION:
            warnings.append(f"{preset.name} shares memory with the OS: above --gpu-memory-utilization "
                            f"{UNIFIED_SAFE_UTILIZATION} the box can run out of host memory")
    else:
        warnings.append("no device memory known: pass --memory-gb or --device-preset to check the fit")

    roofline = _roofline(bandwidth, target, drafter, text, elem, max_len, k)
    return {
        "model": {"path": str(model_dir), "architecture": arch, "model_type": text.get("model_type"),
                  **target.to_dict()},
        "drafter": None if drafter is None else {"path": inp.draft, "block_size": block, **drafter.to_dict()},
        "dtype": dtype,
        "num_speculative_tokens": k,
        "max_model_len": max_len,
        "max_num_seqs": inp.max_num_seqs,
        "block_size": inp.block_size,
        "kv": {"target_bytes_per_token": target.kv_bytes_per_token,
               "drafter_bytes_per_token": drafter.kv_bytes_per_token if drafter else 0,
               "bytes_per_token": kv_token, "state_bytes_per_seq": state, "state_checkpoints": checkpoints,
               "state_pool_bytes": state_pool, "state_snapshots": snapshots,
               "state_snapshot_bytes": snapshots * plain_state,
               "state_snapshot_interval": engine_cfg.snapshot_interval() if snapshots else 0,
               "bytes_per_full_sequence": need_one},
        "memory": memory,
        "fit": fit,
        "roofline": roofline,
        "serve": {"would_start": None if total_mem is None and not reasons else not reasons,
                  "reasons": reasons, "warnings": warnings},
    }


def _roofline(bandwidth: float | None, target: Footprint, drafter: Footprint | None, text: dict[str, Any],
              elem: int, max_len: int, k: int) -> dict[str, Any]:
    """Batch-1 decode ceilings: bandwidth / bytes read per token (or per DFlash step, divided by tau)."""
    if not bandwidth:
        return {"bandwidth_gbs": None}
    bps = bandwidth * 1e9
    state_rw = 2 * target.state_bytes_per_seq  # recurrent state is read and written every step
    ar = bps / (target.read_bytes_per_token + state_rw)
    at_len = bps / (target.read_bytes_per_token + state_rw + max_len * target.kv_bytes_per_token)
    out: dict[str, Any] = {"bandwidth_gbs": bandwidth, "bytes_per_token": target.read_bytes_per_token + state_rw,
                           "ar_tok_s": ar, "ar_tok_s_at_max_model_len": at_len}
    if drafter is not None and k:
        # the drafter reads the target's LM head, or its own rounded copy (counted in its bytes then)
        lm_head = 0 if drafter.lm_head_params else int(text["vocab_size"]) * int(text["hidden_size"]) * elem
        step = target.read_bytes_per_token + state_rw + drafter.read_bytes_per_token + lm_head
        taus = [t for t in (2, 3, 4, 5, 6, 8) if t <= k + 1]
        out["dflash_step_bytes"] = step
        out["dflash_tok_s_at_tau"] = {str(t): bps * t / step for t in taus}
    return out


def _local_cuda_memory() -> tuple[int | None, str]:
    try:
        import torch

        if torch.cuda.is_available():
            _, total = torch.cuda.mem_get_info()
            return int(total), torch.cuda.get_device_name()
    except Exception:  # noqa: BLE001 - no GPU is a normal answer here
        pass
    return None, "unknown"
