"""How many KV blocks the engine may allocate, or a clear refusal when the minimum does not fit.

On CUDA the budget is `gpu_memory_utilization` of the card, minus what other processes hold, minus
the weights and the activation peak of the largest step (measured by running one, vLLM-style), or
exactly `--kv-cache-memory` when given (as vLLM's --kv-cache-memory-bytes): a share of the card that
does not depend on what other processes hold at start-up, so several engines can share one GPU.
On CPU it is `--kv-cache-memory` (default 1 GiB), capped at what max_num_seqs full-length
sequences could use. Hybrid models' recurrent state (one slot per sequence, times k + 1 when
checkpoints are kept; engine/state_pool.py) is allocated before planning: on CUDA the profiled peak
includes it, so the KV budget is what is left after it; the start-up log reports both.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from blockspec.engine.state_pool import state_report
from blockspec.errors import OutOfMemoryError

if TYPE_CHECKING:
    from blockspec.engine.engine import Engine

log = logging.getLogger("blockspec")

GIB = 1 << 30
MIB = 1 << 20
CPU_DEFAULT_KV_BYTES = 1 * GIB


def blocks_for_sequence(max_model_len: int, num_speculative_tokens: int, block_size: int) -> int:
    """Blocks one sequence of max_model_len needs, with room for a full verify block at its end."""
    return -(-(max_model_len + num_speculative_tokens + 1) // block_size)


def blocks_per_sequence(engine: Engine) -> int:
    return blocks_for_sequence(engine.max_model_len, engine.num_speculative_tokens, engine.config.block_size)


def cuda_kv_budget(total: int, gpu_memory_utilization: float, others: int, peak: int) -> int:
    """Bytes left for the KV cache: the allowed share of the card minus other processes and our peak
    (weights + activations). `blockspec plan` calls this with estimates, the engine with measurements."""
    return int(total * gpu_memory_utilization - others - peak)


def cpu_kv_budget(kv_cache_memory: int | None, max_num_seqs: int, need: int) -> int:
    return kv_cache_memory or min(CPU_DEFAULT_KV_BYTES, max_num_seqs * need)


def kv_shortfall(device_type: str, max_model_len: int, need: int, budget: int) -> str | None:
    """The start-up refusal message when one full-length sequence does not fit, else None."""
    if budget >= need:
        return None
    if device_type == "cuda":
        flag = "raise --gpu-memory-utilization, lower --max-model-len, or lower --max-num-batched-tokens"
        have = f"{budget / GIB:.2f} GiB left for the KV cache after weights and activations"
    else:
        flag = "raise --kv-cache-memory or lower --max-model-len"
        have = f"--kv-cache-memory allows {budget / MIB:.0f} MiB"
    return (f"not enough memory for the KV cache: one {max_model_len}-token sequence needs "
            f"{need / MIB:.0f} MiB, {have}: {flag}")


def weight_bytes(module: torch.nn.Module) -> tuple[int, int]:
    """(bytes of all weights, bytes of the quantized layouts among them: packed codes + scales + zeros)."""
    from blockspec.models.layers.quant_linear import quantized_tensor_bytes

    total = sum(p.numel() * p.element_size() for p in module.parameters() if not p.is_meta)  # shared once
    quantized = quantized_tensor_bytes(module)
    return total + quantized, quantized


def start_load_peak(device: torch.device) -> int | None:
    """Before loading: reset the CUDA peak counter; returns the bytes allocated now (None off CUDA)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def load_peak(device: torch.device, base: int | None) -> int | None:
    """After loading: the peak bytes allocated since start_load_peak, over what was allocated then."""
    if base is None:
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def loaded_weight_bytes(engine: Engine) -> int:
    """Bytes of the target's and the proposer's weights as held (quantized layers: packed + scales)."""
    total = weight_bytes(engine.runner.target)[0]
    proposer = engine.runner.proposer
    if proposer is not None and any(True for _ in proposer.parameters()):
        total += weight_bytes(proposer)[0]
    return total


def weights_report(engine: Engine) -> str:
    """The start-up line on weight memory (quantized layers counted as held: packed weights, scales, zeros or
    int4's packed scale|zero), and on CUDA the peak of loading beside them (streamed loading: a little over)."""
    total, quantized = weight_bytes(engine.runner.target)
    line = f"weights: target {_size(total)}"
    if quantized:
        line += f" ({_size(quantized)} of it quantized layers: packed weights + scales)"
    proposer = engine.runner.proposer
    if proposer is not None and any(True for _ in proposer.parameters()):
        line += f", {proposer.describe()} proposer {_size(weight_bytes(proposer)[0])}"
    peak = getattr(engine, "load_peak_bytes", None)
    if peak is not None:
        line += f"; peak during load {_size(peak)} (weights + {_size(max(0, peak - loaded_weight_bytes(engine)))})"
    return line


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def plan_kv_blocks(engine: Engine) -> int:
    log.info("%s", weights_report(engine))
    per_block = engine.runner.kv_bytes_per_block()
    min_blocks = blocks_per_sequence(engine)
    need = min_blocks * per_block
    cfg = engine.config
    if engine.device.type == "cuda":
        budget = _cuda_kv_budget(engine)
    else:
        budget = cpu_kv_budget(cfg.kv_cache_memory, cfg.max_num_seqs, need)
    message = kv_shortfall(engine.device.type, engine.max_model_len, need, budget)
    state_bytes = getattr(engine, "state_bytes", 0)
    if message:
        if state_bytes:
            message += (f" (the recurrent state of --max-num-seqs {cfg.max_num_seqs} sequences already takes "
                        f"{state_bytes / MIB:.0f} MiB: fewer sequences need less)")
        raise OutOfMemoryError(message)
    num_blocks = int(budget // per_block)
    log.info("KV cache: %d blocks of %d tokens (%.0f MiB)", num_blocks, cfg.block_size, num_blocks * per_block / MIB)
    report = state_report(engine)
    if report:
        where = "taken before the KV cache was sized" if engine.device.type == "cuda" else \
            "in addition to --kv-cache-memory"
        log.info("%s (%s)", report, where)
    return num_blocks


def fixed_kv_budget(kv_cache_memory: int, free_after_peak: int) -> int:
    """--kv-cache-memory on CUDA: that many bytes, or a refusal if the card cannot hold them now."""
    if kv_cache_memory > free_after_peak:
        raise OutOfMemoryError(f"--kv-cache-memory {kv_cache_memory / GIB:.2f} GiB does not fit: only "
                               f"{max(0, free_after_peak) / GIB:.2f} GiB of the GPU are free after the weights "
                               "and activations: lower --kv-cache-memory")
    return kv_cache_memory


def _cuda_kv_budget(engine: Engine) -> int:
    dev = engine.device
    torch.cuda.synchronize(dev)
    free, total = torch.cuda.mem_get_info(dev)
    others = (total - free) - torch.cuda.memory_reserved(dev)
    peak = profile_step_peak(engine)
    if engine.config.kv_cache_memory is not None:
        return fixed_kv_budget(engine.config.kv_cache_memory, cuda_kv_budget(total, 1.0, others, peak))
    return cuda_kv_budget(total, engine.config.gpu_memory_utilization, others, peak)


def profile_step_peak(engine: Engine) -> int:
    """Peak bytes (weights included) of the largest prefill step plus a full drafter pass."""
    from blockspec.engine.sampling_params import SamplingParams
    from blockspec.engine.scheduler import ScheduledSeq, SchedulerOutput
    from blockspec.engine.sequence import Sequence

    runner, dev = engine.runner, engine.device
    tokens = min(engine.config.max_num_batched_tokens, engine.max_model_len - 1)
    k = engine.num_speculative_tokens
    blocks = -(-(tokens + k + 2) // engine.config.block_size)
    runner.allocate_kv_cache(blocks)
    cache_bytes = blocks * runner.kv_bytes_per_block()
    torch.cuda.reset_peak_memory_stats(dev)
    seq = Sequence("profile", [0] * tokens, SamplingParams(temperature=0, max_tokens=k + 2), None, [], None)
    seq.block_table = list(range(blocks))
    seq.state_slot = 0  # hybrid models: any slot will do, a new sequence never reads it before writing
    runner.execute(SchedulerOutput([ScheduledSeq(seq, tokens, 0)]))
    if k:
        seq.output_ids.append(0)
        runner.execute(SchedulerOutput([ScheduledSeq(seq, 1, k)]))
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - cache_bytes
    runner.allocate_kv_cache(0)
    torch.cuda.empty_cache()
    return peak
