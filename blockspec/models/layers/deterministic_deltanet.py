"""Gated DeltaNet's mixer under --deterministic, on both step descriptions (recurrent_state.py).

A token's conv output, delta-rule output and state must not depend on whether it is a decode row, part of a
k+1 verify block, of a commit's replay, or inside a prefill chunk cut anywhere (chunked prefill, prefix-cache
snapshots, a preemption's recompute). So every path describes its tokens as spans continuing from state slots
and runs the same two kernels (kernels/deterministic_gated_deltanet.py): `conv_windows` over a buffer of
saved and new inputs, and `gdn_spans`, whose per-token arithmetic is one compiled loop body.

- uniform decode/verify rows (`DecodeStateMetadata`, CUDA graphs): N spans of q_len tokens, all index
  tensors built on the device (no host work, capturable); a verify block writes no slot and its commit
  (`replay_decode`, or the per-position checkpoint) lands the state after the accepted prefix;
- ragged steps (`StateMetadata`): one span per sequence, cut at its snapshot points into rounds when the pass
  saves snapshots; a verify block's commit replays its accepted prefix (`replay`) or takes its checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from blockspec.kernels._triton import use_triton
from blockspec.kernels.deterministic_gated_deltanet import conv_windows, gdn_spans
from blockspec.kernels.gated_deltanet import gated_rms_norm
from blockspec.models.layers.recurrent_state import DecodeStateMetadata, LayerState, StateMetadata

if TYPE_CHECKING:
    from blockspec.models.layers.gated_deltanet import GatedDeltaNet


def heads(layer: GatedDeltaNet, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conv outputs [T, conv_dim] -> q, k [T, Hk, Dk] and v [T, H, Dv] (views)."""
    t = y.shape[0]
    q, k, v = y.split([layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    return (q.view(t, layer.num_k_heads, layer.head_k_dim), k.view(t, layer.num_k_heads, layer.head_k_dim),
            v.view(t, layer.num_v_heads, layer.head_v_dim))


def gated_norm(core: torch.Tensor, z: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """GatedRMSNorm of the delta-rule output [T, H, Dv]: the per-token kernel where Triton runs, else the
    reference one token at a time (PyTorch's CPU SiLU rounds a vectorised body and a scalar tail differently)."""
    if use_triton(z):
        return gated_rms_norm(core, z, norm.weight, norm.eps)
    return torch.cat([gated_rms_norm(core[i:i + 1], z[i:i + 1], norm.weight, norm.eps) for i in range(z.shape[0])])


# ---- uniform decode / verify rows -------------------------------------------------------------------------------


def _uniform_spans(n: int, q_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Starts and lengths of N rows of q_len tokens (device ops: capturable)."""
    starts = torch.arange(n, device=device) * q_len
    return starts, torch.full_like(starts, q_len)


def decode(layer: GatedDeltaNet, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
           sd: DecodeStateMetadata) -> torch.Tensor:
    """N rows of q_len tokens: conv (window written for single tokens) and delta rule (state written into the
    pair partner for single tokens; verify blocks keep their inputs for `replay_decode`). -> o [T, H, Dv]."""
    st, n, q = layer.state, sd.num_rows, sd.q_len
    channels, width = layer.conv_dim, layer.conv_kernel - 1
    rows = mixed.reshape(n, q, channels)
    buffer = torch.cat([st.conv[sd.read_slots].to(mixed.dtype), rows], dim=1)  # [N, W + q, C]: reads first
    dev = mixed.device
    windows = (torch.arange(n, device=dev)[:, None, None] * (width + q) + torch.arange(q, device=dev)[None, :, None]
               + torch.arange(width + 1, device=dev)[None, None, :]).view(-1, width + 1)
    y = conv_windows(buffer.view(-1, channels), windows, layer.conv1d.weight[:, 0, :])
    if not sd.speculative:
        st.conv[sd.write_slots] = buffer[:, q:].to(st.conv.dtype)
    qh, kh, vh = heads(layer, y)
    starts, lengths = _uniform_spans(n, q, dev)
    write = torch.full_like(starts, -1) if sd.speculative else sd.write_slots
    checkpoints = st.checkpoints[:n] if sd.speculative and st.checkpoints is not None else None
    out = gdn_spans(qh, kh, vh, a, b, layer.A_log, layer.dt_bias, st.ssm, starts, lengths, sd.read_slots, write,
                    checkpoints=checkpoints)
    if sd.speculative:
        sd.pending.append((layer, (rows, kh, vh, a, b)))
    return out


def replay_decode(layer: GatedDeltaNet, sd: DecodeStateMetadata, saved: tuple[torch.Tensor, ...],
                  counts: torch.Tensor) -> None:
    """Each verify row's state after its first counts[row] tokens into its write slot, through the verify
    pass's own arithmetic (the conv window is `commit_decode`'s)."""
    _, k, v, a, b = saved
    starts, _ = _uniform_spans(sd.num_rows, sd.q_len, counts.device)
    gdn_spans(None, k, v, a, b, layer.A_log, layer.dt_bias, layer.state.ssm, starts, counts, sd.read_slots,
              sd.write_slots, compute_output=False)


# ---- ragged steps -------------------------------------------------------------------------------------------------


def spans(layer: GatedDeltaNet, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: StateMetadata,
          st: LayerState) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """The delta rule over each sequence's span (non-speculative spans write their slot, snapshots saved at
    their points); returns (o [T, H, Dv], the inputs a replaying commit needs, or None with checkpoints)."""
    q, k, v = heads(layer, y)
    speculative = any(meta.speculative)
    checkpoints = st.checkpoints if speculative and st.checkpoints is not None else None
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for r, (starts, lengths, read, write, saves) in enumerate(_rounds(meta)):
        gdn_spans(q, k, v, a, b, layer.A_log, layer.dt_bias, st.ssm, starts, lengths, read, write,
                  checkpoints=checkpoints if r == 0 else None, out=out)
        if saves is not None:  # the state after the round's pieces that end at a snapshot point
            slots, entries = saves
            st.snap_ssm[entries] = st.ssm[slots]
    return out, ((k, v, a, b) if speculative and checkpoints is None else None)


def _rounds(meta: StateMetadata) -> list[tuple]:
    """Round r: the r-th piece (meta.pieces) of every span that has one, as device tensors (starts, lengths,
    read, write) and the (slots, entries) of the snapshots saved after it or None; one round of whole spans
    without snapshots. Round 0 lists every span in batch order (a verify block's checkpoints are rows of the
    step). Built once per step, shared by the layers."""
    pieces = [meta.pieces(b) for b in range(meta.num_seqs)]
    rounds = []
    for r in range(max(len(p) for p in pieces)):
        live = [b for b in range(meta.num_seqs) if r < len(pieces[b])]
        cuts = [pieces[b][r] for b in live]
        saves = [(meta.slots[b], entry) for b, (_, _, entry) in zip(live, cuts) if entry is not None]

        def tensor(name: str, values: list[int], r: int = r) -> torch.Tensor:
            return meta.tensor(("det_" + name, r), lambda: (values, torch.int64))

        rounds.append((
            tensor("starts", [meta.starts[b] + first for b, (first, _, _) in zip(live, cuts)]),
            tensor("lengths", [end - first for first, end, _ in cuts]),
            tensor("read", [meta.slots[b] if r or meta.has_state[b] else -1 for b in live]),
            tensor("write", [-1 if meta.speculative[b] else meta.slots[b] for b in live]),
            (tensor("save_slots", [s for s, _ in saves]), tensor("save_entries", [e for _, e in saves]))
            if saves else None))
    return rounds


def replay(layer: GatedDeltaNet, meta: StateMetadata, spec: list[int], counts: list[int],
           inputs: tuple[torch.Tensor, ...]) -> None:
    """Advance each verify block's slot over its committed prefix with the verify pass's arithmetic (the
    step's commit has one set of counts: its tensors are shared by the layers)."""
    k, v, a, b = inputs

    def tensor(name: str, values: list[int]) -> torch.Tensor:
        return meta.tensor(("det_replay_" + name,), lambda: (values, torch.int64))

    gdn_spans(None, k, v, a, b, layer.A_log, layer.dt_bias, layer.state.ssm,
              tensor("starts", [meta.starts[s] for s in spec]), tensor("counts", counts),
              tensor("read", [meta.slots[s] if meta.has_state[s] else -1 for s in spec]),
              tensor("slots", [meta.slots[s] for s in spec]), compute_output=False)
