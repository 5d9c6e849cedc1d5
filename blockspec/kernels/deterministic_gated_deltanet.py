"""Gated DeltaNet for --deterministic: every token through one sequential recurrence, whatever the call holds.

The fast paths round a token's state differently depending on what shares its pass: prefill takes the
chunked (WY) form, decode and verify the recurrent kernel compiled per block length with a tile picked from
the row count, and the convolution runs in the model dtype on one path and in float32 on the other. Here a
call is a list of spans of a flat token batch (a prefill chunk, a decode token, a k+1 verify block, a commit's
accepted prefix), each continuing from a state slot:

- `gdn_spans`: the gated delta rule over each span's tokens, one token at a time, in one compiled kernel
  whose loop bound is a run-time value (the span's length) and whose tile comes from the head sizes only, so
  a token's arithmetic is the same alone, in a verify block, in a replayed commit or inside a prefill chunk.
  The state is rounded to the pool's dtype after every token (a no-op for float32 pools), so a chunk boundary
  (chunked prefill, a prefix-cache snapshot, a preemption's recompute) changes no bit either.
- `conv_windows`: the short causal depthwise convolution + SiLU, one program per token over its own window
  (rows of a buffer of saved and new inputs), accumulated in float32 in a fixed order.

The references are the CPU path: the same arithmetic one token at a time in PyTorch, so no tensor shape
(a vectorised body against a scalar tail) enters a token's result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockspec.kernels._triton import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _gdn_spans_kernel(Q, K, V, A, B, A_LOG, DT_BIAS, SSM, STARTS, LENGTHS, READ, WRITE, CKPT, OUT,
                          sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sa_t, sb_t, sc_n, scale,
                          H: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr, HAS_CKPT: tl.constexpr, HAS_OUT: tl.constexpr,
                          ROUND_STATE: tl.constexpr):
        # One program: span n, value head h, value columns [vb * BV, vb * BV + BV) of the [DK, DV] state. The
        # token loop runs to a loaded length: one compiled body for spans of any length.
        n = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        hk = h // GROUP
        offs_k = tl.arange(0, BK)
        offs_v = vb * BV + tl.arange(0, BV)
        mask_k = offs_k < DK
        mask_v = offs_v < DV
        s_mask = mask_k[:, None] & mask_v[None, :]
        tile = h * (DK * DV) + offs_k[:, None] * DV + offs_v[None, :]
        start = tl.load(STARTS + n).to(tl.int64)
        length = tl.load(LENGTHS + n)
        read = tl.load(READ + n).to(tl.int64)  # < 0: the span starts from zeros (a sequence's first chunk)
        write = tl.load(WRITE + n).to(tl.int64)  # < 0: the slot is left alone (a verify block)
        s = tl.load(SSM + tl.maximum(read, 0) * (H * DK * DV) + tile, mask=s_mask, other=0.0).to(tl.float32)
        s = tl.where(read >= 0, s, 0.0)
        neg_a = -tl.exp(tl.load(A_LOG + h).to(tl.float32))
        dt_b = tl.load(DT_BIAS + h).to(tl.float32)
        for i in range(0, length):
            t = start + i
            kf = tl.load(K + t * sk_t + hk * sk_h + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            vf = tl.load(V + t * sv_t + h * sv_h + offs_v, mask=mask_v, other=0.0).to(tl.float32)
            a = tl.load(A + t * sa_t + h).to(tl.float32)
            b = tl.load(B + t * sb_t + h)
            kn = kf * tl.rsqrt(tl.sum(kf * kf, axis=0) + 1e-6)
            beta = (1.0 / (1.0 + tl.exp(-b.to(tl.float32)))).to(b.dtype).to(tl.float32)  # sigmoid in b's dtype
            x = a + dt_b  # softplus as torch's (threshold 20), log1p's precision for tiny exp(x)
            u = tl.exp(tl.minimum(x, 20.0))
            w = 1.0 + u
            softplus = tl.where(x > 20.0, x, tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0))))
            s = s * tl.exp(neg_a * softplus)
            kv = tl.sum(s * kn[:, None], axis=0)
            delta = (vf - kv) * beta
            s = s + kn[:, None] * delta[None, :]
            if ROUND_STATE:  # the pool's precision after every token: chunk boundaries change nothing
                s = s.to(SSM.dtype.element_ty).to(tl.float32)
            if HAS_OUT:
                qf = tl.load(Q + t * sq_t + hk * sq_h + offs_k, mask=mask_k, other=0.0).to(tl.float32)
                qn = qf * tl.rsqrt(tl.sum(qf * qf, axis=0) + 1e-6) * scale
                o = tl.sum(s * qn[:, None], axis=0)
                tl.store(OUT + (t * H + h) * DV + offs_v, o, mask=mask_v)
            if HAS_CKPT:  # noqa: SIM102 - the state after each token of a span writing no slot (a verify block)
                if write < 0:
                    tl.store(CKPT + n * sc_n + i * (H * DK * DV) + tile, s.to(CKPT.dtype.element_ty), mask=s_mask)
        if write >= 0:  # the same program read this tile: read == write slot needs no barrier
            tl.store(SSM + write * (H * DK * DV) + tile, s.to(SSM.dtype.element_ty), mask=s_mask)

    @triton.jit
    def _conv_windows_kernel(BUF, WIN, W, Y, C, sb, sw_c, TAPS: tl.constexpr, BC: tl.constexpr):
        # One program: token t, channels [cb * BC, cb * BC + BC); the window's rows oldest first.
        t = tl.program_id(0).to(tl.int64)
        offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
        mask = offs_c < C
        acc = tl.zeros([BC], dtype=tl.float32)
        for j in tl.static_range(TAPS):
            r = tl.load(WIN + t * TAPS + j).to(tl.int64)
            x = tl.load(BUF + r * sb + offs_c, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(W + offs_c * sw_c + j, mask=mask, other=0.0).to(tl.float32)
            acc += x * w
        y = acc / (1.0 + tl.exp(-acc))
        tl.store(Y + t * C + offs_c, y.to(Y.dtype.element_ty), mask=mask)


def _pow2(v: int) -> int:
    return 1 << max(v - 1, 0).bit_length()


def spans_tile(dk: int, dv: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) from the head sizes only: the tile fixes the order of the sums over Dk, so it never
    depends on the number of spans or tokens."""
    bk, bv = _pow2(dk), min(8, _pow2(dv))
    return bv, max(1, min(8, bk * bv // 1024))


# ---- references (the CPU path) ---------------------------------------------------------------------------------


def gdn_spans_ref(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  A_log: torch.Tensor, dt_bias: torch.Tensor, ssm: torch.Tensor, starts: torch.Tensor,
                  lengths: torch.Tensor, read: torch.Tensor, write: torch.Tensor,
                  checkpoints: torch.Tensor | None = None, compute_output: bool = True,
                  out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The definition of `gdn_spans`, one token at a time (fixed shapes: no token count enters the arithmetic).
    Reads every span's state before writing any."""
    heads, dk = v.shape[1], k.shape[2]
    group = heads // k.shape[1]
    if compute_output and out is None:
        out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    spans = list(zip(starts.tolist(), lengths.tolist(), read.tolist(), write.tolist()))
    initial = [ssm[r].float() if r >= 0 else ssm.new_zeros(ssm.shape[1:], dtype=torch.float32) for _, _, r, _ in spans]
    finals = []
    for n, ((start, length, _, w), s) in enumerate(zip(spans, initial)):
        for i in range(length):
            t = start + i
            kn = k[t].float().repeat_interleave(group, dim=0)
            kn = kn * torch.rsqrt((kn * kn).sum(-1, keepdim=True) + 1e-6)
            g = -A_log.float().exp() * F.softplus(a[t].float() + dt_bias)
            beta = torch.sigmoid(b[t]).float()
            s = s * g.exp()[:, None, None]
            kv = (s * kn[:, :, None]).sum(dim=1)
            delta = (v[t].float() - kv) * beta[:, None]
            s = (s + kn[:, :, None] * delta[:, None, :]).to(ssm.dtype).float()
            if compute_output:
                qn = q[t].float().repeat_interleave(group, dim=0)
                qn = qn * torch.rsqrt((qn * qn).sum(-1, keepdim=True) + 1e-6) * dk ** -0.5
                out[t] = (s * qn[:, :, None]).sum(dim=1)
            if checkpoints is not None and w < 0:
                checkpoints[n, i] = s.to(checkpoints.dtype)
        finals.append(s)
    for (_, _, _, w), s in zip(spans, finals):
        if w >= 0:
            ssm[w] = s.to(ssm.dtype)
    return out


def conv_windows_ref(buffer: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The definition of `conv_windows`, one token at a time."""
    w = weight.float()
    out = torch.empty(windows.shape[0], buffer.shape[1], dtype=buffer.dtype, device=buffer.device)
    for t, rows in enumerate(windows.tolist()):
        acc = buffer[rows[0]].float() * w[:, 0]
        for j in range(1, len(rows)):
            acc = acc + buffer[rows[j]].float() * w[:, j]
        out[t] = F.silu(acc).to(buffer.dtype)
    return out


# ---- public entry points --------------------------------------------------------------------------------------


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def gdn_spans(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              A_log: torch.Tensor, dt_bias: torch.Tensor, ssm: torch.Tensor, starts: torch.Tensor,
              lengths: torch.Tensor, read: torch.Tensor, write: torch.Tensor, *,
              checkpoints: torch.Tensor | None = None, compute_output: bool = True,
              out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The gated delta rule over spans of a flat token batch, each span continuing from a state slot.

    q, k [T, Hk, Dk] raw (after conv + SiLU; q unused without output); v [T, H, Dv]; a, b [T, H] raw
    projections; A_log, dt_bias [H]; ssm [S, H, Dk, Dv] pool. Per span n (int64 device tensors [N]): its
    tokens starts[n] .. starts[n] + lengths[n], the slot its state is read from (read[n] < 0: zeros) and the
    slot its final state goes to (write[n] < 0: none; a span may write its own read slot, two spans must not
    touch each other's). checkpoints [N, >= max length, H, Dk, Dv]: the state after each token of the spans
    that write no slot. Only the last dimension of q/k/v (and a/b) must be contiguous. Returns o [T, H, Dv]
    float32 (0 for tokens in no span; written into `out` when given), or None without compute_output."""
    if not use_triton(v):
        return gdn_spans_ref(q, k, v, a, b, A_log, dt_bias, ssm, starts, lengths, read, write,
                             checkpoints=checkpoints, compute_output=compute_output, out=out)
    heads, dk, dv = v.shape[1], k.shape[2], v.shape[2]
    if not ssm.is_contiguous() or ssm.shape[1:] != (heads, dk, dv):
        raise ValueError(f"ssm must be a contiguous [slots, {heads}, {dk}, {dv}] pool, got {tuple(ssm.shape)}")
    if checkpoints is not None and (checkpoints.stride(1) != heads * dk * dv or not checkpoints[0, 0].is_contiguous()):
        raise ValueError("checkpoints must hold contiguous [H, Dk, Dv] states, one after another per span")
    k, v, a, b = (_unit_stride(x) for x in (k, v, a, b))
    q = _unit_stride(q) if compute_output else k
    if compute_output and out is None:
        out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    if not starts.shape[0]:
        return out
    block_v, num_warps = spans_tile(dk, dv)
    _gdn_spans_kernel[(starts.shape[0], heads, triton.cdiv(dv, block_v))](
        q, k, v, a, b, A_log, dt_bias, ssm, starts, lengths, read, write,
        checkpoints if checkpoints is not None else ssm, out if out is not None else ssm,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        checkpoints.stride(0) if checkpoints is not None else 0, dk ** -0.5,
        H=heads, GROUP=heads // k.shape[1], DK=dk, DV=dv, BK=_pow2(dk), BV=block_v,
        HAS_CKPT=checkpoints is not None, HAS_OUT=compute_output, ROUND_STATE=ssm.dtype != torch.float32,
        num_warps=num_warps)
    return out


_CONV_BLOCK = 256  # channels per program (the arithmetic is per element: any block gives the same bits)


def conv_windows(buffer: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv + SiLU per token: buffer [R, C] rows of saved and new inputs (unit stride along C),
    windows [T, W + 1] int64 buffer rows of each token's window (oldest first, the token last), weight
    [C, W + 1] -> [T, C] in buffer's dtype, accumulated in float32."""
    if not use_triton(buffer):
        return conv_windows_ref(buffer, windows, weight)
    buffer, weight = _unit_stride(buffer), _unit_stride(weight)
    tokens, channels = windows.shape[0], buffer.shape[1]
    y = torch.empty(tokens, channels, dtype=buffer.dtype, device=buffer.device)
    if tokens:
        block = min(_CONV_BLOCK, _pow2(channels))
        _conv_windows_kernel[(tokens, triton.cdiv(channels, block))](
            buffer, windows.contiguous(), weight, y, channels, buffer.stride(0), weight.stride(0),
            TAPS=windows.shape[1], BC=block, num_warps=4)
    return y
