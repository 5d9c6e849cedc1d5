"""Gated DeltaNet token mixer (Qwen3-Next, Qwen3.5/3.6) over a ragged flat batch with state slots.

Per token: project to q, k, v (through a short causal depthwise convolution + SiLU), an output
gate z, a write strength beta = sigmoid(b) and a decay g = -exp(A_log) * softplus(a + dt_bias);
run the gated delta rule (delta_rule.py) per head; RMS-normalise the result, gate it with SiLU(z)
and project out. Qwen3-Next packs q/k/v/z and b/a in per-key-head groups (`in_proj_qkvz`,
`in_proj_ba`); Qwen3.5 has one projection each, which we hold as the two fused GEMMs [qkv | z] and
[b | a] under the same names (checkpoint names load into their slices: layers/linear.FUSED_SHARDS).

The flat batch holds each sequence's tokens as one contiguous span (a prefill chunk, a decode
token, or a verify block); `StateMetadata` (recurrent_state.py) says where each span is and which
state slot it reads. Non-speculative spans write their final state during the pass; speculative
spans leave the slot alone and `commit` advances it by the accepted count afterwards.

Uniform decode/verify batches (the runner's CUDA-graph path, `DecodeStateMetadata`) take fixed-shape
kernels instead (kernels/gated_deltanet.py): each row reads its state from one slot and the committed
state lands in its pair partner, during the pass for single tokens, at `commit_decode` for verify
blocks (whose inputs the pass keeps on the device, so the commit runs without the host).

Under --deterministic the decoder layer projects and calls `forward_deterministic` instead, on either step
description: every token through the same convolution and sequential recurrence
(layers/deterministic_deltanet.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.errors import ConfigError
from blockspec.kernels.deterministic_gated_deltanet import conv_windows
from blockspec.kernels.gated_deltanet import causal_conv_update, gated_rms_norm, gdn_recurrent, verify_fuses_norm
from blockspec.kernels.rms_norm import rms_norm
from blockspec.kernels.skinny_linear import skinny_linear, skinny_linear_pair
from blockspec.models.layers import delta_rule, delta_rule_fla, deterministic_deltanet
from blockspec.models.layers.attention import current_metadata
from blockspec.models.layers.linear import FusedLinear, Linear, folded_linear
from blockspec.models.layers.recurrent_state import DecodeStateMetadata, LayerState, StateMetadata
from blockspec.models.model_config import ModelConfig

BACKENDS = ("auto", "reference", "fla")
RECURRENT_MAX_TOKENS = 16  # reference: spans up to this long run token by token, longer ones chunked


def backend_for(x: torch.Tensor) -> str:
    """BLOCKSPEC_GDN_BACKEND: auto (fla on CUDA when importable, else the reference), reference, fla."""
    choice = os.environ.get("BLOCKSPEC_GDN_BACKEND", "auto")
    if choice not in BACKENDS:
        raise ConfigError(f"BLOCKSPEC_GDN_BACKEND={choice!r}: use one of {', '.join(BACKENDS)}")
    if choice == "auto":
        return "fla" if x.device.type == "cuda" and delta_rule_fla.available() else "reference"
    if choice == "fla" and not delta_rule_fla.available():
        raise ConfigError(f"BLOCKSPEC_GDN_BACKEND=fla but fla-core is not importable: "
                          f"pip install fla-core=={delta_rule_fla.FLA_VERSION} --no-deps (needs Triton and a GPU)")
    return choice


class GatedRMSNorm(nn.Module):
    """RMSNorm of the delta-rule output, then multiplied by SiLU(gate) (norm before gate)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(dtype) * F.silu(gate.float())).to(dtype)


@dataclass
class _Pending:
    """What a pass keeps of its speculative spans until `commit` knows how many tokens stay."""

    meta: StateMetadata
    conv_buffer: torch.Tensor  # the extended conv inputs of the whole step
    spec: list[int]  # batch indices of the speculative spans
    backend: str  # who produced `inputs`, and so who replays them
    # replay: (k, v, g, beta); reference: whole batch, fla: spec tokens; deterministic: (k, v, a, b), whole batch
    inputs: tuple[torch.Tensor, ...] | None


class GatedDeltaNet(nn.Module):
    deterministic = False  # --deterministic (models/deterministic.py): set by the model's set_deterministic

    def __init__(self, cfg: ModelConfig, packed_projections: bool) -> None:
        super().__init__()
        lin = cfg.linear
        if lin is None:
            raise ConfigError("config.json lacks the linear_* fields of a Gated DeltaNet hybrid")
        if lin.num_value_heads % lin.num_key_heads:
            raise ConfigError(f"linear_num_value_heads {lin.num_value_heads} is not a multiple of "
                              f"linear_num_key_heads {lin.num_key_heads}")
        h = cfg.hidden_size
        self.num_k_heads, self.num_v_heads = lin.num_key_heads, lin.num_value_heads
        self.head_k_dim, self.head_v_dim = lin.key_head_dim, lin.value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = lin.conv_kernel
        self.state_dtype_name = lin.state_dtype
        self.packed = packed_projections
        if packed_projections:
            self.in_proj_qkvz = Linear(h, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = Linear(h, 2 * self.num_v_heads, bias=False)
        else:
            self.in_proj_qkvz = FusedLinear(h, [self.conv_dim, self.value_dim], bias=False)
            self.in_proj_ba = FusedLinear(h, [self.num_v_heads, self.num_v_heads], bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, h, bias=False)
        self.state: LayerState | None = None  # bound by the model's allocate_state

    # ---- projections -------------------------------------------------------------------------

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, H] -> conv input [T, conv_dim], z [T, Hv, Dv], b and a [T, Hv]."""
        return self._split(self.in_proj_qkvz(x), self.in_proj_ba(x))

    def _split(self, qkvz: torch.Tensor, ba: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The two projections' outputs -> conv input [T, conv_dim], z [T, Hv, Dv], b and a [T, Hv]."""
        t, hk, dk, dv = qkvz.shape[0], self.num_k_heads, self.head_k_dim, self.head_v_dim
        if not self.packed:  # [qkv | z], [b | a]: views
            mixed, z = qkvz.split([self.conv_dim, self.value_dim], dim=-1)
            b, a = ba.split([self.num_v_heads, self.num_v_heads], dim=-1)
            return mixed, z.reshape(t, -1, dv), b, a
        r = self.num_v_heads // hk  # value heads per key head: each group is [q, k, v, z] / [b, a]
        q, k, v, z = qkvz.view(t, hk, -1).split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = ba.view(t, hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, -1, dv), b.reshape(t, -1), a.reshape(t, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = current_metadata()
        if getattr(ctx, "state_decode", None) is not None and self.state is not None:
            return self._forward_decode(x, ctx.state_decode)
        meta, st = getattr(ctx, "state", None), self.state
        if meta is None and hasattr(ctx, "batch"):  # whole sequences without a cache (drafter training)
            meta, st = self._stateless(ctx.batch, x)
        if meta is None or st is None:
            raise RuntimeError("Gated DeltaNet needs state slots: the engine allocates them (allocate_state) and the "
                               "runner describes them per step (StateMetadata)")
        t = x.shape[0]
        mixed, z, b, a = self._project(x)
        mixed, conv_buffer = self._conv(mixed, meta, st)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.reshape(t, self.num_k_heads, -1), k.reshape(t, self.num_k_heads, -1)
        v = v.reshape(t, self.num_v_heads, -1)
        beta = torch.sigmoid(b)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        backend = backend_for(x)
        if backend == "fla":
            core, inputs = self._delta_rule_fla(q, k, v, g, beta, meta, st)
        else:
            core, inputs = self._delta_rule_reference(q, k, v, g, beta, meta, st)
        spec = meta.spans(speculative=True)
        st.pending = _Pending(meta, conv_buffer, spec, backend, inputs) if spec else None
        out = self.norm(core.to(x.dtype), z)
        return self.out_proj(out.reshape(t, -1))

    # ---- --deterministic ----------------------------------------------------------------------

    def forward_deterministic(self, qkvz: torch.Tensor, ba: torch.Tensor) -> torch.Tensor:
        """The two input projections' rows -> the gated, normed mixer output [T, value_dim] (before out_proj),
        through the batch-invariant kernels on the CUDA-graph decode path and the general path alike."""
        ctx = current_metadata()
        t = qkvz.shape[0]
        mixed, z, b, a = self._split(qkvz, ba)
        sd = getattr(ctx, "state_decode", None)
        if sd is not None and self.state is not None:
            core = deterministic_deltanet.decode(self, mixed, a, b, sd)
        else:
            meta, st = getattr(ctx, "state", None), self.state
            if meta is None or st is None:
                raise RuntimeError("deterministic Gated DeltaNet needs state slots (allocate_state) and the runner's "
                                   "StateMetadata")
            y, conv_buffer = self._conv(mixed, meta, st)
            core, inputs = deterministic_deltanet.spans(self, y, a, b, meta, st)
            spec = meta.spans(speculative=True)
            st.pending = _Pending(meta, conv_buffer, spec, "deterministic", inputs) if spec else None
        return deterministic_deltanet.gated_norm(core, z, self.norm).reshape(t, -1)

    # ---- uniform decode / verify rows (CUDA graphs) ---------------------------------------------

    def _forward_decode(self, x: torch.Tensor, sd: DecodeStateMetadata) -> torch.Tensor:
        """N rows of q_len tokens: fixed shapes, slots as device tensors, no host work."""
        return self.out_proj(self._decode_core(self.in_proj_qkvz(x), self.in_proj_ba(x), sd))

    def forward_residual(self, h: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """Decode rows on the GPU: h += out_proj(mixer(norm(h))) with the norm folded into the two input
        GEMMs (one launch for both) and the residual add into the output GEMM (the decoder layer's fast path)."""
        sd = current_metadata().state_decode
        w, eps = norm.kernel_weight(), norm.eps
        if isinstance(self.in_proj_qkvz, nn.Linear) and isinstance(self.in_proj_ba, nn.Linear):
            qkvz, ba = skinny_linear_pair(h, self.in_proj_qkvz.weight, self.in_proj_ba.weight, norm_weight=w, eps=eps)
        elif h.shape[0] == 1 and isinstance(self.in_proj_ba, nn.Linear):
            # a quantized q|k|v|z beside a plain b|a (as checkpoints leave it): one decode row's b|a GEMM takes the
            # norm in and writes the normed row the quantized GEMM reads, one launch for both (a verify block's
            # norm stays on its own: folded into a few-column GEMM's programs it costs more, as the MoE router's)
            x = torch.empty_like(h)
            ba = skinny_linear(h, self.in_proj_ba.weight, norm_weight=w, eps=eps, norm_out=x)
            qkvz = folded_linear(x, self.in_proj_qkvz)
        else:  # quantized input projections: the norm once, then each projection on its own kernel
            x = rms_norm(h, w, eps)[0]
            qkvz, ba = folded_linear(x, self.in_proj_qkvz), folded_linear(x, self.in_proj_ba)
        return folded_linear(self._decode_core(qkvz, ba, sd), self.out_proj, residual=h)

    def _decode_core(self, qkvz: torch.Tensor, ba: torch.Tensor, sd: DecodeStateMetadata) -> torch.Tensor:
        """Projected rows -> the gated, normed mixer output [T, value_dim] (before out_proj)."""
        st, n, q, t = self.state, sd.num_rows, sd.q_len, qkvz.shape[0]
        mixed, z, b, a = self._split(qkvz, ba)
        mixed, b, a = mixed.reshape(n, q, -1), b.reshape(n, q, -1), a.reshape(n, q, -1)
        write = None if sd.speculative else sd.write_slots
        y = causal_conv_update(mixed, st.conv, sd.read_slots, self.conv1d.weight[:, 0, :], write_slots=write)
        qh, kh, vh = y.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        qh = qh.reshape(n, q, self.num_k_heads, self.head_k_dim)
        kh = kh.reshape(n, q, self.num_k_heads, self.head_k_dim)
        vh = vh.reshape(n, q, self.num_v_heads, self.head_v_dim)
        checkpoints = st.checkpoints[:n] if sd.speculative and st.checkpoints is not None else None
        if sd.speculative:
            sd.pending.append((self, (mixed, kh, vh, a, b)))
        fused = checkpoints is None and verify_fuses_norm(n, q, self.num_v_heads, self.head_v_dim)
        out = gdn_recurrent(qh, kh, vh, a, b, self.A_log, self.dt_bias, st.ssm, sd.read_slots, write_slots=write,
                            checkpoints=checkpoints, z=z.reshape(n, q, *z.shape[1:]) if fused else None,
                            norm_weight=self.norm.weight, eps=self.norm.eps)
        if not fused:
            out = gated_rms_norm(out.reshape(t, self.num_v_heads, self.head_v_dim), z, self.norm.weight,
                                 self.norm.eps)
        return out.reshape(t, -1)

    def commit_decode(self, sd: DecodeStateMetadata, saved: tuple[torch.Tensor, ...], counts: torch.Tensor) -> None:
        """Write each row's state after its first counts[row] verified tokens into its write slot."""
        st = self.state
        mixed, k, v, a, b = saved
        causal_conv_update(mixed, st.conv, sd.read_slots, self.conv1d.weight[:, 0, :], counts=counts,
                           write_slots=sd.write_slots, compute_output=False)
        if st.checkpoints is not None:
            rows = torch.arange(sd.num_rows, device=counts.device)
            st.ssm[sd.write_slots] = st.checkpoints[rows, counts - 1]
            return
        if self.deterministic:
            deterministic_deltanet.replay_decode(self, sd, saved, counts)
            return
        gdn_recurrent(None, k, v, a, b, self.A_log, self.dt_bias, st.ssm, sd.read_slots, counts=counts,
                      write_slots=sd.write_slots, compute_output=False)

    def _stateless(self, batch: int, x: torch.Tensor) -> tuple[StateMetadata, LayerState]:
        """`batch` equal-length rows, each from a zero state, in a throwaway state of `batch` slots."""
        n = x.shape[0] // batch
        meta = StateMetadata(starts=[b * n for b in range(batch)], lengths=[n] * batch, slots=list(range(batch)),
                             has_state=[False] * batch, speculative=[False] * batch, device=x.device)
        st = LayerState(batch, self.conv_dim, self.conv_kernel - 1, self.num_v_heads, self.head_k_dim,
                        self.head_v_dim, x.dtype, torch.float32, x.device, checkpoints=0)
        return meta, st

    # ---- convolution -------------------------------------------------------------------------

    def _conv(self, x: torch.Tensor, meta: StateMetadata, st: LayerState) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal depthwise conv + SiLU over each span, continuing from its slot's last inputs.

        Returns the outputs [T, C] and the extended input buffer (each span's previous kernel-1
        inputs, then its new ones), from which any committed prefix's new conv state is a slice.
        """
        width = self.conv_kernel - 1
        rows, bases = meta.conv_layout(width)
        prev = _from_slots(st.conv, meta).to(x.dtype)
        src = meta.tensor(("conv_rows", width), lambda: (rows, torch.int64))
        buffer = torch.cat([prev.reshape(-1, x.shape[1]), x])[src]
        windows = meta.tensor(("conv_windows", width), lambda: (_windows(meta, bases, width), torch.int64))
        weight = self.conv1d.weight[:, 0, :]  # [C, kernel]
        if self.deterministic:  # float32, one token at a time: the decode path's arithmetic
            y = conv_windows(buffer, windows, weight)
        else:
            y = buffer[windows[:, 0]] * weight[:, 0]
            for j in range(1, self.conv_kernel):
                y = y + buffer[windows[:, j]] * weight[:, j]
            y = F.silu(y)
        done = meta.spans(speculative=False)
        if done:
            ends = meta.tensor(("conv_ends", width),
                               lambda: (_state_rows(bases, meta.lengths, done, width), torch.int64))
            slots = meta.tensor("done_slots", lambda: ([meta.slots[b] for b in done], torch.int64))
            st.conv[slots] = buffer[ends].view(len(done), width, -1).to(st.conv.dtype)
        if meta.snapshots:  # the window before each snapshot point
            saves = [(b, off, entry) for b in range(meta.num_seqs) for off, entry in meta.snapshots[b]]
            rows = meta.tensor(("snap_conv_rows", width), lambda: (
                [bases[b] + off + j for b, off, _ in saves for j in range(width)], torch.int64))
            entries = meta.tensor("snap_entries", lambda: ([e for _, _, e in saves], torch.int64))
            st.snap_conv[entries] = buffer[rows].view(len(saves), width, -1).to(st.snap_conv.dtype)
        return y, buffer

    # ---- delta rule --------------------------------------------------------------------------

    def _delta_rule_reference(self, q, k, v, g, beta, meta: StateMetadata, st: LayerState):
        qp, kp = delta_rule.prepare_qk(q, k, self.num_v_heads)
        vf, bf = v.float(), beta.float()
        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        for b in range(meta.num_seqs):
            s, n, slot = meta.starts[b], meta.lengths[b], meta.slots[b]
            sl = slice(s, s + n)
            h0 = st.ssm[slot].float() if meta.has_state[b] else qp.new_zeros(st.ssm.shape[1:])
            if meta.speculative[b]:
                keep = st.checkpoints is not None
                out[sl], _, states = delta_rule.recurrent(qp[sl], kp[sl], vf[sl], g[sl], bf[sl], h0, keep_states=keep)
                if keep:  # checkpoints are per row of the step (recurrent_state.py)
                    st.checkpoints[b, :n] = states.to(st.checkpoints.dtype)
            else:
                h = h0
                for a, e, entry in meta.pieces(b):  # one piece unless the pass saves snapshots in this span
                    fn = delta_rule.recurrent if e - a <= RECURRENT_MAX_TOKENS else delta_rule.chunked
                    pl = slice(s + a, s + e)
                    out[pl], h = fn(qp[pl], kp[pl], vf[pl], g[pl], bf[pl], h)[:2]
                    if entry is not None:
                        st.snap_ssm[entry] = h.to(st.snap_ssm.dtype)
                st.ssm[slot] = h.to(st.ssm.dtype)
        inputs = (kp, vf, g, bf) if st.checkpoints is None else None
        return out, inputs

    def _delta_rule_fla(self, q, k, v, g, beta, meta: StateMetadata, st: LayerState):
        initial = _from_slots(st.ssm, meta).float()
        if meta.snapshots:
            out, final = self._fla_in_pieces(q, k, v, g, beta, initial, meta, st)
        else:
            out, final = delta_rule_fla.run(q, k, v, g, beta, initial, meta.cu_seqlens, max(meta.lengths))
        done = meta.spans(speculative=False)
        if done:
            idx = meta.tensor("done_index", lambda: (done, torch.int64))
            slots = meta.tensor("done_slots", lambda: ([meta.slots[b] for b in done], torch.int64))
            st.ssm[slots] = final[idx].to(st.ssm.dtype)
        spec = meta.spans(speculative=True)
        if not spec:
            return out, None
        tokens = meta.tensor("spec_tokens", lambda: (_span_tokens(meta, spec), torch.int64))
        sel = (k[tokens], v[tokens], g[tokens], beta[tokens])
        if st.checkpoints is None:
            return out, sel
        layout = delta_rule_fla.prefix_layout([meta.lengths[b] for b in spec])
        prefix = [meta.tensor(f"prefix_{i}", lambda i=i: (layout[i], torch.int64)) for i in range(3)]
        states = delta_rule_fla.prefix_states(*sel, initial[meta.tensor("spec_index", lambda: (spec, torch.int64))],
                                              *prefix)
        rows = meta.tensor("spec_ckpt_rows", lambda: (_checkpoint_rows(meta, spec, st.checkpoints.shape[1]),
                                                      torch.int64))
        st.checkpoints.view(-1, *st.checkpoints.shape[2:])[rows] = states.to(st.checkpoints.dtype)
        return out, None

    def _fla_in_pieces(self, q, k, v, g, beta, initial: torch.Tensor, meta: StateMetadata, st: LayerState):
        """fla over spans cut at their snapshot points: round r runs the r-th piece of every span that has
        one (one varlen call), from the state the previous round ended in, and saves the snapshots."""
        out = None
        final = initial.clone()
        for rnd in meta.piece_rounds():
            o, f = delta_rule_fla.run(q[rnd.tokens], k[rnd.tokens], v[rnd.tokens], g[rnd.tokens], beta[rnd.tokens],
                                      final[rnd.spans], rnd.cu_seqlens, rnd.longest)
            if out is None:
                out = o.new_empty((q.shape[0], *o.shape[1:]))
            out[rnd.tokens] = o
            final[rnd.spans] = f
            if rnd.entries is not None:
                st.snap_ssm[rnd.entries] = f[rnd.saved].to(st.snap_ssm.dtype)
        return out, final

    # ---- commit ------------------------------------------------------------------------------

    def commit(self, committed: list[int]) -> None:
        """Advance the speculative spans' slots by their committed token counts (batch order)."""
        st = self.state
        pending, st.pending = st.pending, None
        if pending is None:
            return
        meta, spec, width = pending.meta, pending.spec, self.conv_kernel - 1
        _, bases = meta.conv_layout(width)
        counts = [committed[b] for b in spec]
        if any(not 1 <= c <= meta.lengths[b] for c, b in zip(counts, spec)):
            raise RuntimeError(f"commit counts {counts} outside the verified spans {[meta.lengths[b] for b in spec]}")
        dev = st.ssm.device
        slots = torch.tensor([meta.slots[b] for b in spec], device=dev)
        ends = torch.tensor(_state_rows(bases, committed, spec, width), device=dev)
        st.conv[slots] = pending.conv_buffer[ends].view(len(spec), width, -1).to(st.conv.dtype)
        if st.checkpoints is not None:
            st.ssm[slots] = st.checkpoints[torch.tensor(spec, device=dev), torch.tensor(counts, device=dev) - 1]
            return
        if pending.backend == "reference":
            self._replay_reference(meta, spec, counts, pending.inputs)
            return
        if pending.backend == "deterministic":
            deterministic_deltanet.replay(self, meta, spec, counts, pending.inputs)
            return
        k, v, g, beta = pending.inputs
        tokens, start = [], 0
        for b, c in zip(spec, counts):
            tokens.extend(range(start, start + c))
            start += meta.lengths[b]
        idx = torch.tensor(tokens, device=dev)
        cu = torch.tensor(list(accumulate(counts, initial=0)), dtype=torch.int64, device=dev)
        _, final = delta_rule_fla.run(k[idx], k[idx], v[idx], g[idx], beta[idx], st.ssm[slots].float(), cu,
                                      max(counts))
        st.ssm[slots] = final.to(st.ssm.dtype)

    def _replay_reference(self, meta: StateMetadata, spec: list[int], counts: list[int], inputs) -> None:
        """Re-run the recurrence over each accepted prefix (same ops as the verify pass: same bits)."""
        st = self.state
        kp, vf, g, bf = inputs
        for b, c in zip(spec, counts):
            s, slot = meta.starts[b], meta.slots[b]
            sl = slice(s, s + c)
            h0 = st.ssm[slot].float() if meta.has_state[b] else kp.new_zeros(st.ssm.shape[1:])
            _, final, _ = delta_rule.recurrent(kp[sl], kp[sl], vf[sl], g[sl], bf[sl], h0)
            st.ssm[slot] = final.to(st.ssm.dtype)


def _from_slots(states: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
    """Each span's starting state: its slot's, or zeros for a sequence's first chunk."""
    picked = states[meta.slot_t]
    if all(meta.has_state):
        return picked
    mask = meta.has_state_t.view(-1, *[1] * (states.dim() - 1))
    return torch.where(mask, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))


def _windows(meta: StateMetadata, bases: list[int], width: int) -> list[list[int]]:
    """For every flat token, the buffer rows of its conv window (oldest first, itself last)."""
    windows = [[0] * (width + 1) for _ in range(sum(meta.lengths))]
    for s, n, base in zip(meta.starts, meta.lengths, bases):
        for i in range(n):
            windows[s + i] = [base + i + j for j in range(width + 1)]
    return windows


def _state_rows(bases: list[int], counts: list[int], spans: list[int], width: int) -> list[int]:
    """Buffer rows holding the last `width` inputs after committing counts[b] tokens of each span b."""
    return [bases[b] + counts[b] + j for b in spans for j in range(width)]


def _span_tokens(meta: StateMetadata, spans: list[int]) -> list[int]:
    return [meta.starts[b] + i for b in spans for i in range(meta.lengths[b])]


def _checkpoint_rows(meta: StateMetadata, spans: list[int], per_row: int) -> list[int]:
    return [b * per_row + i for b in spans for i in range(meta.lengths[b])]
