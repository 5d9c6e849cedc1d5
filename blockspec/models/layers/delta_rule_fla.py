"""The gated delta rule on GPU through flash-linear-attention (`fla-core`, pinned to 0.6.0).

Optional: `available()` is False when fla (or Triton) cannot be imported, and callers then use the
plain reference in delta_rule.py, which is also the oracle these wrappers are checked against
(bench/hybrid_gpu.py). fla takes raw (not yet normalised) queries/keys with their own head count
(value heads share them in groups), a log-space decay and post-sigmoid betas, and ragged batches as
one flattened sequence with `cu_seqlens`.

fla-core 0.6.0 has no kernel that returns the state after every token, so per-position
checkpoints of a verify block are taken as the final states of its prefixes (lengths 1..n, run as
separate varlen sequences from the same initial state): correct, but it reads the initial state n
times where a dedicated kernel would read it once (about 2-3x the state traffic). The default
rollback (replay) needs no such kernel.
"""

from __future__ import annotations

import functools

import torch

FLA_VERSION = "0.6.0"


@functools.cache
def available() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception:  # ImportError, or Triton failing to initialise without a GPU
        return False
    return True


def _ops():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        initial: torch.Tensor, cu_seqlens: torch.Tensor, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q/k [T, Hk, Dk] raw, v [T, H, Dv], g/beta [T, H], initial [N, H, Dk, Dv] float32.

    Returns (outputs [T, H, Dv], final states [N, H, Dk, Dv] float32). Short spans (decode and
    verify blocks) use the recurrent kernel, longer ones the chunked kernel.
    """
    chunk, recurrent = _ops()
    fn = recurrent if longest <= 64 else chunk
    o, final = fn(q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=initial,
                  output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
    return o[0], final


def prefix_layout(lengths: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Host lists for `prefix_states`: token index, cu_seqlens and owning span of every prefix."""
    index, cu, owner, start = [], [0], [], 0
    for b, n in enumerate(lengths):
        for j in range(1, n + 1):
            index.extend(range(start, start + j))
            cu.append(cu[-1] + j)
            owner.append(b)
        start += n
    return index, cu, owner


def prefix_states(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, initial: torch.Tensor,
                  index: torch.Tensor, cu_seqlens: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """States after each token of each span: [sum(lengths), H, Dk, Dv], span by span in order.

    k/v/g/beta hold the spans back to back; initial [N, H, Dk, Dv] is each span's starting state;
    index/cu_seqlens/owner are `prefix_layout(lengths)` on the device (no host work here, so the
    call can sit inside a CUDA graph).
    """
    _, recurrent = _ops()
    sel = [x[index][None] for x in (k, v, g, beta)]
    _, final = recurrent(sel[0], sel[0], sel[1], g=sel[2], beta=sel[3], initial_state=initial[owner],
                         output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
    return final
