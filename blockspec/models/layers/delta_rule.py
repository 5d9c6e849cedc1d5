"""The gated delta rule in plain PyTorch: the CPU path and the oracle for the GPU kernels.

For each head, with an l2-normalised key k_t and query q_t (scaled by 1/sqrt(d)), a decay
g_t <= 0 (log space) and a write strength beta_t in (0, 1), the state S (key_dim x value_dim) evolves as

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

`recurrent` runs that token by token (decode, verify blocks; optionally returning the state after
every token). `chunked` computes the same thing a chunk at a time (prefill): inside a chunk the
delta-rule updates collapse into a unit-lower-triangular solve (the WY / UT form), and only the
chunk boundaries are sequential.
All math is float32; inputs are [T, heads, dim] with query/key heads already repeated to the value
heads (`prepare_qk`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, Hk, D] queries/keys -> float32, l2-normalised, repeated to the value heads; q scaled by D^-0.5."""
    groups = num_v_heads // q.shape[1]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    return q * q.shape[-1] ** -0.5, k


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor, keep_states: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """q/k [T, H, Dk], v [T, H, Dv], g/beta [T, H], state [H, Dk, Dv] (all float32).

    Returns (outputs [T, H, Dv], final state, states after each token [T, H, Dk, Dv] or None).
    """
    out = v.new_empty(v.shape)
    states = [] if keep_states else None
    s = state
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        kv = (s * k[t][:, :, None]).sum(dim=1)
        delta = (v[t] - kv) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = (s * q[t][:, :, None]).sum(dim=1)
        if states is not None:
            states.append(s)
    return out, s, (torch.stack(states) if states else None)


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `recurrent` (without per-token states), one chunk of tokens at a time."""
    t_len = q.shape[0]
    pad = (-t_len) % chunk_size
    # [H, N, C, D] blocks; padding tokens have k = v = beta = 0 and g = 0, so they change nothing.
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)).transpose(0, 1) for x in (g, beta))
    heads, total = q.shape[0], q.shape[1]
    n = total // chunk_size
    q, k, v = (x.reshape(heads, n, chunk_size, -1) for x in (q, k, v))
    g, beta = g.reshape(heads, n, chunk_size), beta.reshape(heads, n, chunk_size)

    gamma = g.cumsum(dim=-1)  # log decay from the chunk start to each token
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # (I + L) with L strictly lower: the within-chunk interaction of the delta-rule updates.
    system = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    system = system + torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    new_v = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    k_read = torch.linalg.solve_triangular(system, k_beta * gamma.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()

    out = torch.empty_like(new_v)
    s = state
    for c in range(n):
        u = new_v[:, c] - k_read[:, c] @ s
        out[:, c] = q_decayed[:, c] @ s + attn[:, c] @ u
        s = s * chunk_decay[:, c, None, None] + k_to_end[:, c].transpose(-1, -2) @ u
    out = out.reshape(heads, total, -1)[:, :t_len].transpose(0, 1)
    return out, s
