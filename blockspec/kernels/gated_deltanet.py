"""Gated DeltaNet decode / verify step as fused kernels over fixed-shape batches with state slots.

The CUDA-graph decode path runs N rows (sequences, padded to a bucket) of exactly L new tokens each
(L = 1: plain decode; L = k + 1: a speculative verify block). Per-sequence state lives in pools
indexed by slot, so every function takes the rows' slots as device tensors: no host syncs and no
data-dependent shapes, so each call can be captured in a CUDA graph.

- `gdn_recurrent`: the gated delta rule over the L tokens of each row with the gating fused in
  (raw q/k, a, b, A_log, dt_bias in): the state is read once and written at most once (plus per-token
  checkpoints when asked). Decode rows (and blocks with checkpoints) take the recurrent kernel, whose
  state tile stays in registers across the tokens; verify blocks of 2-32 tokens the chunk kernel, which
  solves the block in the WY form in a few small dots instead of a dependent chain a token.
  Optionally the GatedRMSNorm of the output is folded into its epilogue.
- `causal_conv_update`: the short depthwise causal convolution + SiLU continuing from each row's
  saved inputs, writing the window after the committed tokens.
- `gated_rms_norm`: GatedRMSNorm (RMS-normalise per head, times weight, times SiLU(gate)).

Each has a plain-PyTorch `_ref` built from exactly the ops of the eager layer
(models/layers/gated_deltanet.py, delta_rule.py), so on CPU in float32 it reproduces that layer bit for
bit; the public functions take the Triton kernel where `use_triton` says so, else the reference.

Speculative rollback: a verify pass (no write) followed by a commit with `counts` (accepted + 1) and
`write_slots` recomputes the committed prefix on the kernel the verify pass took: on the recurrent kernel
the committed state is the very state the verify pass reached at that position (its checkpoint, bit for
bit); on the chunk kernel it is the same solve's state after `count` tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockspec.kernels._triton import HAVE_TRITON, pdl, use_triton
from blockspec.models.layers import delta_rule

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from blockspec.kernels._triton import release_dependents, wait_for_inputs

    @triton.jit
    def _gated_norm(x, zf, w, mask, eps, D: tl.constexpr, ROUND_WN: tl.constexpr, dtype: tl.constexpr):
        """GatedRMSNorm over the last axis of x (already rounded to `dtype`, as float32): rounds where the
        module does (normed value to dtype, weight * normed to dtype unless either is float32)."""
        x = tl.where(mask, x, 0.0)
        rstd = tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) / D + eps)
        p = w.to(tl.float32) * (x * rstd).to(dtype).to(tl.float32)
        if ROUND_WN:
            p = p.to(dtype).to(tl.float32)
        return (p * (zf / (1.0 + tl.exp(-zf)))).to(dtype)

    @triton.jit
    def _gates(a, b, neg_a, dt_b):
        """(beta, log decay g) of raw a (float32) and b (model dtype), per token or per block, as
        GatedDeltaNet.forward computes them: sigmoid in b's dtype; g = -exp(A_log) softplus(a + dt_bias) with
        torch's softplus (threshold 20), log1p(exp(x)) as log(w) * u / (w - 1), w = 1 + u, which keeps log1p's
        precision for tiny u where log(1 + u) does not."""
        beta = (1.0 / (1.0 + tl.exp(-b.to(tl.float32)))).to(b.dtype).to(tl.float32)
        x = a + dt_b
        u = tl.exp(tl.minimum(x, 20.0))
        w = 1.0 + u
        softplus = tl.where(x > 20.0, x, tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0))))
        return beta, neg_a * softplus

    @triton.jit
    def _gdn_recurrent_kernel(Q, K, V, A, B, A_LOG, DT_BIAS, SSM, READ, WRITE, COUNTS, CKPT, OUT, Z, NW,
                              sq_n, sq_t, sq_h, sk_n, sk_t, sk_h, sv_n, sv_t, sv_h, sa_n, sa_t, sb_n, sb_t,
                              sz_n, sz_t, sz_h, scale, eps,
                              L: tl.constexpr, H: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr,
                              DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                              HAS_COUNTS: tl.constexpr, HAS_WRITE: tl.constexpr, HAS_CKPT: tl.constexpr,
                              HAS_OUT: tl.constexpr, HAS_NORM: tl.constexpr, ROUND_WN: tl.constexpr,
                              PDL: tl.constexpr = False):
        # One program: row n, value head h, value columns [vb * BV, vb * BV + BV) of the [DK, DV] state.
        # The key/query vectors are small and re-normalised by every program that needs them.
        wait_for_inputs(PDL)
        release_dependents(PDL)  # few programs: their dependents find the SMs mostly free
        n = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        hk = h // GROUP
        offs_k = tl.arange(0, BK)
        offs_v = vb * BV + tl.arange(0, BV)
        mask_k = offs_k < DK
        mask_v = offs_v < DV
        s_mask = mask_k[:, None] & mask_v[None, :]
        tile = h * (DK * DV) + offs_k[:, None] * DV + offs_v[None, :]  # within one slot / checkpoint
        read = tl.load(READ + n).to(tl.int64)
        s = tl.load(SSM + read * (H * DK * DV) + tile, mask=s_mask, other=0.0).to(tl.float32)
        neg_a = -tl.exp(tl.load(A_LOG + h).to(tl.float32))
        dt_b = tl.load(DT_BIAS + h).to(tl.float32)
        q_row = Q + n * sq_n + hk * sq_h + offs_k
        k_row = K + n * sk_n + hk * sk_h + offs_k
        v_row = V + n * sv_n + h * sv_h + offs_v
        a_row = A + n * sa_n + h
        b_row = B + n * sb_n + h
        o_row = OUT + (n * L * H + h) * DV + offs_v  # OUT: [N, L, H, DV] contiguous
        ck_row = CKPT + n * (L * H * DK * DV) + tile  # CKPT: [N, L, H, DK, DV] contiguous
        z_row = Z + n * sz_n + h * sz_h + offs_v
        if HAS_COUNTS:
            count = tl.load(COUNTS + n)
        else:
            count = L
        # One code path for every token of decode, verify and commit (a dynamic `if` even without counts):
        # a commit then reproduces the verify pass's states bit for bit.
        for t in range(L):
            if t < count:
                kf = tl.load(k_row + t * sk_t, mask=mask_k, other=0.0).to(tl.float32)
                vf = tl.load(v_row + t * sv_t, mask=mask_v, other=0.0).to(tl.float32)
                a = tl.load(a_row + t * sa_t).to(tl.float32)
                b = tl.load(b_row + t * sb_t)
                kn = kf * tl.rsqrt(tl.sum(kf * kf, axis=0) + 1e-6)
                beta, g = _gates(a, b, neg_a, dt_b)
                s = s * tl.exp(g)
                kv = tl.sum(s * kn[:, None], axis=0)
                delta = (vf - kv) * beta
                s = s + kn[:, None] * delta[None, :]
                if HAS_OUT:
                    qf = tl.load(q_row + t * sq_t, mask=mask_k, other=0.0).to(tl.float32)
                    qn = qf * tl.rsqrt(tl.sum(qf * qf, axis=0) + 1e-6) * scale
                    o = tl.sum(s * qn[:, None], axis=0)
                    if HAS_NORM:
                        dtype = Z.dtype.element_ty
                        zf = tl.load(z_row + t * sz_t, mask=mask_v, other=0.0).to(tl.float32)
                        nw = tl.load(NW + offs_v, mask=mask_v, other=0.0)
                        o = _gated_norm(o.to(dtype).to(tl.float32), zf, nw, mask_v, eps, DV, ROUND_WN, dtype)
                    tl.store(o_row + t * (H * DV), o.to(OUT.dtype.element_ty), mask=mask_v)
                if HAS_CKPT:
                    tl.store(ck_row + t * (H * DK * DV), s.to(CKPT.dtype.element_ty), mask=s_mask)
            elif HAS_OUT:  # tokens past the count: zeros, so the output is defined
                tl.store(o_row + t * (H * DV), tl.zeros([BV], dtype=OUT.dtype.element_ty), mask=mask_v)
        if HAS_WRITE:  # the same program read this tile: read == write slot needs no barrier
            write = tl.load(WRITE + n).to(tl.int64)
            tl.store(SSM + write * (H * DK * DV) + tile, s.to(SSM.dtype.element_ty), mask=s_mask)

    @triton.jit
    def _gdn_chunk_kernel(Q, K, V, A, B, A_LOG, DT_BIAS, SSM, READ, WRITE, COUNTS, OUT, Z, NW,
                          sq_n, sq_t, sq_h, sk_n, sk_t, sk_h, sv_n, sv_t, sv_h, sa_n, sa_t, sb_n, sb_t,
                          sz_n, sz_t, sz_h, scale, eps,
                          L: tl.constexpr, LP: tl.constexpr, H: tl.constexpr, GROUP: tl.constexpr,
                          DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          HAS_COUNTS: tl.constexpr, HAS_WRITE: tl.constexpr, HAS_OUT: tl.constexpr,
                          HAS_NORM: tl.constexpr, ROUND_WN: tl.constexpr, LEVELS: tl.constexpr,
                          DOT: tl.constexpr = "tf32", PDL: tl.constexpr = False):
        # One program: row n, value head h, value columns [vb * BV, vb * BV + BV) of the [DK, DV] state, all L
        # tokens at once in the chunk (WY) form of the gated delta rule (bench/NOTES.md, session 22), padded
        # to LP rows.
        wait_for_inputs(PDL)
        release_dependents(PDL)
        n = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        hk = h // GROUP
        offs_t = tl.arange(0, LP)
        offs_k = tl.arange(0, BK)
        offs_v = vb * BV + tl.arange(0, BV)
        live_t = offs_t < L
        mask_k = offs_k < DK
        mask_v = offs_v < DV
        if HAS_COUNTS:
            count = tl.load(COUNTS + n)
        else:
            count = L
        read = tl.load(READ + n).to(tl.int64)
        tile = h * (DK * DV) + offs_k[:, None] * DV + offs_v[None, :]
        s_mask = mask_k[:, None] & mask_v[None, :]
        s0 = tl.load(SSM + read * (H * DK * DV) + tile, mask=s_mask, other=0.0).to(tl.float32)
        kf = tl.load(K + n * sk_n + hk * sk_h + offs_t[:, None] * sk_t + offs_k[None, :],
                     mask=live_t[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        vf = tl.load(V + n * sv_n + h * sv_h + offs_t[:, None] * sv_t + offs_v[None, :],
                     mask=live_t[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
        a = tl.load(A + n * sa_n + offs_t * sa_t + h, mask=live_t, other=0.0).to(tl.float32)
        b = tl.load(B + n * sb_n + offs_t * sb_t + h, mask=live_t, other=0.0)
        kn = kf * tl.rsqrt(tl.sum(kf * kf, axis=1) + 1e-6)[:, None]
        beta, g = _gates(a, b, -tl.exp(tl.load(A_LOG + h).to(tl.float32)), tl.load(DT_BIAS + h).to(tl.float32))
        beta = tl.where(live_t, beta, 0.0)  # padded tokens: no update and no decay
        g = tl.where(live_t, g, 0.0)
        gc = tl.cumsum(g, axis=0)  # log of the decay from the block's start through token t
        ti = offs_t[:, None]
        tj = offs_t[None, :]
        decay = tl.exp(tl.where(ti >= tj, gc[:, None] - gc[None, :], 0.0))  # token j's term seen at token i
        kk = tl.dot(kn, tl.trans(kn), input_precision=DOT)
        ks = tl.dot(kn, s0, input_precision=DOT)  # k_t . S0 columns
        # delta_t (the state's new rank-one term is k_t delta_t^T) solves (I + A) delta = beta (v - D k S0), with
        # A[i, j] = beta_i (k_i . k_j) exp(gc_i - gc_j) below the diagonal
        amat = tl.where(ti > tj, beta[:, None] * kk * decay, 0.0)
        rhs = beta[:, None] * (vf - tl.exp(gc)[:, None] * ks)
        delta = tl.dot(_unit_lower_inverse(amat, LP, LEVELS, DOT), rhs, input_precision=DOT)
        if HAS_OUT:
            qf = tl.load(Q + n * sq_n + hk * sq_h + offs_t[:, None] * sq_t + offs_k[None, :],
                         mask=live_t[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
            qn = qf * (tl.rsqrt(tl.sum(qf * qf, axis=1) + 1e-6) * scale)[:, None]
            qk = tl.where(ti >= tj, tl.dot(qn, tl.trans(kn), input_precision=DOT) * decay, 0.0)
            o = tl.exp(gc)[:, None] * tl.dot(qn, s0, input_precision=DOT) \
                + tl.dot(qk, delta, input_precision=DOT)
            if HAS_NORM:
                dtype = Z.dtype.element_ty
                zf = tl.load(Z + n * sz_n + h * sz_h + offs_t[:, None] * sz_t + offs_v[None, :],
                             mask=live_t[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
                nw = tl.load(NW + offs_v, mask=mask_v, other=0.0)
                o = _gated_norm(o.to(dtype).to(tl.float32), zf, nw[None, :], mask_v[None, :], eps, DV, ROUND_WN,
                                dtype)
            o = tl.where((offs_t < count)[:, None], o, 0.0)  # tokens past the count: zeros
            o_ptr = OUT + ((n * L + offs_t[:, None]) * H + h) * DV + offs_v[None, :]  # OUT: [N, L, H, DV]
            tl.store(o_ptr, o.to(OUT.dtype.element_ty), mask=live_t[:, None] & mask_v[None, :])
        if HAS_WRITE:  # the state after `count` tokens; the same program read this tile (read == write is safe)
            last = tl.sum(tl.where(offs_t == count - 1, gc, 0.0), axis=0)  # 0 for count 0
            kd = tl.where((offs_t < count)[:, None], kn * tl.exp(tl.minimum(last - gc, 0.0))[:, None], 0.0)
            s = tl.exp(last) * s0 + tl.dot(tl.trans(kd), delta, input_precision=DOT)
            write = tl.load(WRITE + n).to(tl.int64)
            tl.store(SSM + write * (H * DK * DV) + tile, s.to(SSM.dtype.element_ty), mask=s_mask)

    @triton.jit
    def _unit_lower_inverse(amat, LP: tl.constexpr, LEVELS: tl.constexpr, DOT: tl.constexpr):
        """(I + A)^-1 for a strictly lower triangular [LP, LP] A, by block doubling: with T the inverse of the
        diagonal blocks of size s, the blocks of size 2 s are [[X, 0], [C, Y]] whose inverse is T - T C T (C:
        A's entries below the diagonal blocks within each 2 s block), LEVELS = log2(LP) levels of two small
        dots; the entries it forms are entries of the inverse (no cancelling power series)."""
        ti = tl.arange(0, LP)[:, None]
        tj = tl.arange(0, LP)[None, :]
        t = tl.where(ti == tj, 1.0, 0.0)
        for lvl in tl.static_range(LEVELS):
            s = 1 << lvl
            c = tl.where((ti // (2 * s) == tj // (2 * s)) & ((ti // s) % 2 == 1) & ((tj // s) % 2 == 0), amat, 0.0)
            t = t - tl.dot(t, tl.dot(c, t, input_precision=DOT), input_precision=DOT)
        return t

    @triton.jit
    def _conv_update_kernel(X, STATE, W, Y, READ, WRITE, COUNTS, sx_n, sx_t, sw_c,
                            C: tl.constexpr, L: tl.constexpr, WIDTH: tl.constexpr, LP: tl.constexpr,
                            WP: tl.constexpr, BC: tl.constexpr, HAS_COUNTS: tl.constexpr,
                            HAS_WRITE: tl.constexpr, HAS_OUT: tl.constexpr, PDL: tl.constexpr = False):
        # One program: row n, channels [cb * BC, cb * BC + BC). Row r of the row's buffer is saved input r
        # (r < WIDTH) or new input r - WIDTH: two masked loads, one of which is live per element.
        wait_for_inputs(PDL)
        release_dependents(PDL)  # few programs: their dependents find the SMs mostly free
        n = tl.program_id(0).to(tl.int64)
        offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
        mask_c = offs_c < C
        read = tl.load(READ + n).to(tl.int64)
        st_rows = STATE + read * (WIDTH * C) + offs_c[None, :]
        x_rows = X + n * sx_n + offs_c[None, :]
        if HAS_OUT:
            t = tl.arange(0, LP)
            live_t = t < L
            acc = tl.zeros([LP, BC], dtype=tl.float32)
            for j in tl.static_range(WIDTH + 1):
                r = t + j
                from_state = r < WIDTH
                m_s = (live_t & from_state)[:, None] & mask_c[None, :]
                m_x = (live_t & (r >= WIDTH))[:, None] & mask_c[None, :]
                vs = tl.load(st_rows + r[:, None] * C, mask=m_s, other=0.0).to(X.dtype.element_ty)
                vx = tl.load(x_rows + (r - WIDTH)[:, None] * sx_t, mask=m_x, other=0.0)
                buf = tl.where(from_state[:, None], vs, vx).to(tl.float32)
                w = tl.load(W + offs_c * sw_c + j, mask=mask_c, other=0.0).to(tl.float32)
                acc += buf * w[None, :]
            y = acc / (1.0 + tl.exp(-acc))
            y_ptrs = Y + (n * L + t[:, None]) * C + offs_c[None, :]  # Y: [N, L, C] contiguous
            tl.store(y_ptrs, y.to(Y.dtype.element_ty), mask=live_t[:, None] & mask_c[None, :])
        if HAS_WRITE:
            if HAS_COUNTS:
                c = tl.load(COUNTS + n)
            else:
                c = L
            i = tl.arange(0, WP)
            r = c + i
            live_i = i < WIDTH
            from_state = r < WIDTH
            m_s = (live_i & from_state)[:, None] & mask_c[None, :]
            m_x = (live_i & (r >= WIDTH))[:, None] & mask_c[None, :]
            vs = tl.load(st_rows + r[:, None] * C, mask=m_s, other=0.0).to(X.dtype.element_ty)
            vx = tl.load(x_rows + (r - WIDTH)[:, None] * sx_t, mask=m_x, other=0.0)
            new = tl.where(from_state[:, None], vs, vx).to(STATE.dtype.element_ty)
            tl.debug_barrier()  # read == write slot: every thread's loads of the old window come first
            write = tl.load(WRITE + n).to(tl.int64)
            tl.store(STATE + write * (WIDTH * C) + i[:, None] * C + offs_c[None, :], new,
                     mask=live_i[:, None] & mask_c[None, :])

    @triton.jit
    def _gated_rms_norm_kernel(X, Z, NW, Y, H, so_t, so_h, sz_t, sz_h, eps, D: tl.constexpr,
                               BH: tl.constexpr, BD: tl.constexpr, ROUND_WN: tl.constexpr,
                               PDL: tl.constexpr = False):
        wait_for_inputs(PDL)
        release_dependents(PDL)  # few programs: their dependents find the SMs mostly free
        t = tl.program_id(0).to(tl.int64)
        offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
        offs_d = tl.arange(0, BD)
        mask_d = offs_d < D
        mask = (offs_h < H)[:, None] & mask_d[None, :]
        dtype = Y.dtype.element_ty
        o = tl.load(X + t * so_t + offs_h[:, None] * so_h + offs_d[None, :], mask=mask, other=0.0)
        zf = tl.load(Z + t * sz_t + offs_h[:, None] * sz_h + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(NW + offs_d, mask=mask_d, other=0.0)[None, :]
        y = _gated_norm(o.to(dtype).to(tl.float32), zf, w, mask, eps, D, ROUND_WN, dtype)
        tl.store(Y + (t * H + offs_h[:, None]) * D + offs_d[None, :], y, mask=mask)


# ---- references (the CPU path; bit-identical to the eager layer in float32) ----------------------------------


def gated_rms_norm_ref(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GatedDeltaNet's `self.norm(core.to(x.dtype), z)`: o is first rounded to z's (the model's) dtype."""
    dtype = z.dtype
    xf = o.to(dtype).float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(dtype) * F.silu(z.float())).to(dtype)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) in float32 exactly as GatedDeltaNet.forward computes them (sigmoid in b's dtype)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, torch.sigmoid(b).float()


def gdn_recurrent_ref(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      A_log: torch.Tensor, dt_bias: torch.Tensor, ssm: torch.Tensor, read_slots: torch.Tensor, *,
                      counts: torch.Tensor | None = None, write_slots: torch.Tensor | None = None,
                      checkpoints: torch.Tensor | None = None, compute_output: bool = True,
                      z: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                      eps: float = 1e-6) -> torch.Tensor | None:
    """The definition of `gdn_recurrent`: delta_rule.prepare_qk + delta_rule.recurrent per row.

    Reads every row's state before writing any. Host-side per-row loop (the counts go to the host).
    """
    n_rows, length, hk, dk = k.shape
    heads = v.shape[2]
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    qp, kp = delta_rule.prepare_qk(q.reshape(-1, hk, dk) if compute_output else k.reshape(-1, hk, dk),
                                   k.reshape(-1, hk, dk), heads)
    qp, kp = qp.view(n_rows, length, heads, dk), kp.view(n_rows, length, heads, dk)
    vf = v.float()
    h0 = ssm[read_slots].float()
    cnt = counts.tolist() if counts is not None else [length] * n_rows
    out = vf.new_zeros(v.shape) if compute_output else None
    finals = []
    for n in range(n_rows):
        c = cnt[n]
        o_n, final, states = delta_rule.recurrent(qp[n, :c], kp[n, :c], vf[n, :c], g[n, :c], beta[n, :c], h0[n],
                                                  keep_states=checkpoints is not None)
        finals.append(final)
        if out is not None:
            out[n, :c] = o_n
        if checkpoints is not None and c > 0:
            checkpoints[n, :c] = states.to(checkpoints.dtype)
    if write_slots is not None:
        ssm[write_slots] = torch.stack(finals).to(ssm.dtype)
    if out is None or z is None:
        return out
    return gated_rms_norm_ref(out.view(-1, heads, out.shape[-1]), z.reshape(-1, heads, z.shape[-1]), norm_weight,
                              eps).view(z.shape)


def causal_conv_update_ref(x: torch.Tensor, conv_state: torch.Tensor, read_slots: torch.Tensor,
                           weight: torch.Tensor, *, counts: torch.Tensor | None = None,
                           write_slots: torch.Tensor | None = None, compute_output: bool = True
                           ) -> torch.Tensor | None:
    """The definition of `causal_conv_update`, with GatedDeltaNet._conv's arithmetic (model dtype)."""
    length, width = x.shape[1], conv_state.shape[1]
    buf = torch.cat([conv_state[read_slots].to(x.dtype), x], dim=1)  # [N, W + L, C]; all reads first
    y = None
    if compute_output:
        y = buf[:, 0:length] * weight[:, 0]
        for j in range(1, width + 1):
            y = y + buf[:, j:j + length] * weight[:, j]
        y = F.silu(y)
    if write_slots is not None:
        if counts is None:
            new = buf[:, length:length + width]
        else:
            rows = counts[:, None] + torch.arange(width, device=x.device)
            new = buf.gather(1, rows[:, :, None].expand(-1, -1, buf.shape[2]))
        conv_state[write_slots] = new.to(conv_state.dtype)
    return y


# ---- launch configuration -------------------------------------------------------------------------------------

_NUM_SMS = 132  # H100 / H200
CHUNK_MIN, CHUNK_MAX = 2, 32  # verify blocks the chunk kernel takes (padded to 16 or 32 rows)
_STATE_PER_THREAD = 32  # fp32 state elements per thread: ~100 registers with the key/query vectors


def _pow2(v: int) -> int:
    return 1 << max(v - 1, 0).bit_length()


def _launch_config(n_rows: int, heads: int, dk: int, dv: int, length: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for the recurrent kernel: a hand heuristic (no autotune: graphs are captured
    right after warm-up), to be replaced by bench/gdn_kernels.py --sweep figures.

    Each program keeps a [Dk, BLOCK_V] fp32 tile in registers across the tokens. One warp over a
    [128, 8] tile holds 32 state elements per thread and reduces over Dk without shared memory. One
    token (decode) streams the state: ~2 programs per SM is enough. A verify block does ~6 flops per
    state element per token, so it is issue-bound at small batch: narrower tiles give more warps.
    """
    bk, bv_max = _pow2(dk), _pow2(dv)
    block_v = 8
    if length > 1 and n_rows * heads * -(-dv // 8) < 4 * _NUM_SMS:
        block_v = 4
    block_v = min(block_v, bv_max)
    return block_v, _warps_for(bk, block_v)


def _warps_for(bk: int, block_v: int) -> int:
    return max(1, min(8, bk * block_v // (32 * _STATE_PER_THREAD)))


# ---- public entry points --------------------------------------------------------------------------------------


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _chunked(length: int, checkpoints: torch.Tensor | None, dk: int = 128, dv: int = 128) -> bool:
    """Whether a block of `length` tokens takes the chunk kernel: every verify block of up to CHUNK_MAX tokens
    without per-token states (bench/gdn_kernels.py: the recurrent kernel pays a dependent chain of reductions a
    token, the chunk kernel a fixed handful of small dots), on heads of 16+ dims (a dot's smallest side)."""
    return CHUNK_MIN <= length <= CHUNK_MAX and checkpoints is None and min(dk, dv) >= 16


def _chunk_dot(dtype: torch.dtype) -> str:
    """The chunk kernel's dot precision: TF32 for bf16 / fp16 models (outputs within ~2e-3 of the float32
    recurrence, as close as fla's chunk kernels on the prefill path come, and 1.8x faster than 3xTF32), IEEE
    float32 for float32 models, whose tests hold kernels to 1e-5."""
    return "ieee" if dtype == torch.float32 else "tf32"


_CHUNK_WARPS = 4  # every block width of the chunk kernel's sweep timed best on 4 warps


def _chunk_launch_config(n_rows: int, heads: int, dv: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for the chunk kernel: the narrowest value block whose programs fit one wave, else
    whole heads (bench/gdn_kernels.py --chunk-sweep, H100, L = 16: one row of 32 heads best at 32 columns (5.1
    us), of 48 heads at 64 (5.8 us); 16 rows at 128 (29.8 / 41.5 us against 37.2 / 53.0 at 32)."""
    for block_v in (32, 64):
        if block_v < dv and n_rows * heads * -(-dv // block_v) <= _NUM_SMS:
            return block_v, _CHUNK_WARPS
    return min(128, _pow2(dv)), _CHUNK_WARPS


def verify_fuses_norm(n_rows: int, length: int, heads: int, dv: int) -> bool:
    """Whether a verify block's GatedRMSNorm rides in the delta-rule launch: where the chunk kernel runs whole
    heads anyway (16 rows of 32 heads: 31.1 us fused against 29.8 + 4.3 apart); one row runs narrower blocks
    and keeps the norm apart (5.1 + 1.7 us against 8.5 fused)."""
    return _chunked(length, None, dv=dv) and _chunk_launch_config(n_rows, heads, dv)[0] == _pow2(dv)


def _gdn_recurrent_triton(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                          b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, ssm: torch.Tensor,
                          read_slots: torch.Tensor, counts: torch.Tensor | None, write_slots: torch.Tensor | None,
                          checkpoints: torch.Tensor | None, compute_output: bool, z: torch.Tensor | None,
                          norm_weight: torch.Tensor | None, eps: float, block_v: int | None = None,
                          num_warps: int | None = None, chunk: bool | None = None,
                          dot: str | None = None) -> torch.Tensor | None:
    """Launch (no dispatch checks; block_v / num_warps override the launch config, `chunk` the choice of kernel
    and `dot` the chunk kernel's dot precision, for the benchmark)."""
    n_rows, length, hk, dk = k.shape
    heads, dv = v.shape[2], v.shape[3]
    if heads % hk:
        raise ValueError(f"{heads} value heads are not a multiple of {hk} key heads")
    if not ssm.is_contiguous() or ssm.shape[1:] != (heads, dk, dv):
        raise ValueError(f"ssm must be a contiguous [slots, {heads}, {dk}, {dv}] pool, got {tuple(ssm.shape)}")
    if checkpoints is not None and (not checkpoints.is_contiguous()
                                    or checkpoints.shape != (n_rows, length, heads, dk, dv)):
        raise ValueError(f"checkpoints must be a contiguous [{n_rows}, {length}, {heads}, {dk}, {dv}] tensor")
    chunk = _chunked(length, checkpoints, dk, dv) if chunk is None else chunk
    fused_norm = compute_output and z is not None
    k, v, a, b = (_last_contiguous(x) for x in (k, v, a, b))
    q = _last_contiguous(q) if compute_output else k
    bk = _pow2(dk)
    if fused_norm:  # the norm needs a whole head's output in one program
        if block_v not in (None, _pow2(dv)):
            raise ValueError(f"the fused norm runs whole heads: block_v must be {_pow2(dv)}, got {block_v}")
        block_v = _pow2(dv)
    if block_v is None:
        block_v, warps = (_chunk_launch_config(n_rows, heads, dv) if chunk
                          else _launch_config(n_rows, heads, dk, dv, length))
    else:
        warps = _CHUNK_WARPS if chunk else _warps_for(bk, block_v)
    num_warps = num_warps or warps
    out = None
    if compute_output:
        out_dtype = z.dtype if fused_norm else torch.float32
        out = torch.empty(n_rows, length, heads, dv, dtype=out_dtype, device=v.device)
    zz = _last_contiguous(z) if fused_norm else v
    round_wn = fused_norm and torch.promote_types(norm_weight.dtype, z.dtype) != torch.float32
    on = pdl(v)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
               zz.stride(0), zz.stride(1), zz.stride(2), dk ** -0.5, eps)
    common = dict(H=heads, GROUP=heads // hk, DK=dk, DV=dv, BK=bk, BV=block_v, HAS_COUNTS=counts is not None,
                  HAS_WRITE=write_slots is not None, HAS_OUT=compute_output, HAS_NORM=fused_norm, ROUND_WN=round_wn,
                  PDL=on, num_warps=num_warps, launch_pdl=on)
    grid = (n_rows, heads, triton.cdiv(dv, block_v))
    write = write_slots if write_slots is not None else read_slots
    cnt = counts if counts is not None else read_slots
    nw = norm_weight if fused_norm else A_log
    if chunk:
        lp = max(16, _pow2(length))
        _gdn_chunk_kernel[grid](q, k, v, a, b, A_log, dt_bias, ssm, read_slots, write, cnt,
                                out if out is not None else ssm, zz, nw, *strides, L=length, LP=lp,
                                LEVELS=lp.bit_length() - 1, DOT=dot or _chunk_dot(v.dtype), **common)
    else:
        _gdn_recurrent_kernel[grid](q, k, v, a, b, A_log, dt_bias, ssm, read_slots, write, cnt,
                                    checkpoints if checkpoints is not None else ssm,
                                    out if out is not None else ssm, zz, nw, *strides, L=length,
                                    HAS_CKPT=checkpoints is not None, **common)
    return out


def gdn_recurrent(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  A_log: torch.Tensor, dt_bias: torch.Tensor, ssm: torch.Tensor, read_slots: torch.Tensor, *,
                  counts: torch.Tensor | None = None, write_slots: torch.Tensor | None = None,
                  checkpoints: torch.Tensor | None = None, compute_output: bool = True,
                  z: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                  eps: float = 1e-6, block_v: int | None = None) -> torch.Tensor | None:
    """The gated delta rule over N rows of L tokens each, state read from / written to slots of a pool.

    q, k [N, L, Hk, Dk] raw (after conv + SiLU, not normalised; q unused without output); v [N, L, H, Dv];
    a, b [N, L, H] raw projections; A_log, dt_bias [H]; ssm [S, H, Dk, Dv] float32 pool; read_slots [N].
    Only the last dimension of q/k/v/z (and a/b) must be contiguous: slices of a fused projection work.
    counts [N]: only the first counts[n] tokens of row n run (outputs past them are 0, checkpoints past
    them are left alone); write_slots [N]: the state after them goes to ssm[write_slots[n]] (a row may
    write its own read slot; two rows must not read/write each other's slots); checkpoints
    [N, L, H, Dk, Dv]: the state after each token. Returns o [N, L, H, Dv] float32, or None without
    compute_output; with z [N, L, H, Dv] and norm_weight [Dv], GatedRMSNorm(o, z) in z's dtype instead.

    Kernel: `_chunked` (2-32 tokens, no checkpoints) takes the chunk kernel, else the recurrent one. Tiling:
    block_v value columns per program (None: `_chunk_launch_config` / `_launch_config`, which depend on N, H,
    Dk, Dv and L only; Dv with the fused norm). On the recurrent kernel the tiling fixes the order of the sum
    over Dk, so a verify block's checkpoints and a commit agree bit for bit with the same block_v (after a
    fused-norm verify, pass block_v=Dv to the commit). Ignored on CPU.
    """
    if use_triton(v):
        return _gdn_recurrent_triton(q, k, v, a, b, A_log, dt_bias, ssm, read_slots, counts, write_slots,
                                     checkpoints, compute_output, z, norm_weight, eps, block_v=block_v)
    return gdn_recurrent_ref(q, k, v, a, b, A_log, dt_bias, ssm, read_slots, counts=counts, write_slots=write_slots,
                             checkpoints=checkpoints, compute_output=compute_output, z=z, norm_weight=norm_weight,
                             eps=eps)


def _conv_launch_config(length: int, channels: int) -> tuple[int, int]:
    """(BLOCK_C, num_warps): tiny, launch-bound work; wide channel blocks for one token, narrower for blocks."""
    block_c = 512 if length <= 2 else 256 if length <= 4 else 128
    return min(block_c, _pow2(channels)), 4


def _causal_conv_update_triton(x: torch.Tensor, conv_state: torch.Tensor, read_slots: torch.Tensor,
                               weight: torch.Tensor, counts: torch.Tensor | None, write_slots: torch.Tensor | None,
                               compute_output: bool) -> torch.Tensor | None:
    n_rows, length, channels = x.shape
    width = conv_state.shape[1]
    if not conv_state.is_contiguous() or conv_state.shape[2] != channels or weight.shape != (channels, width + 1):
        raise ValueError(f"conv_state must be a contiguous [slots, W, {channels}] pool and weight [C, W + 1]: got "
                         f"{tuple(conv_state.shape)} and {tuple(weight.shape)}")
    x = _last_contiguous(x)
    weight = _last_contiguous(weight)
    y = torch.empty(n_rows, length, channels, dtype=x.dtype, device=x.device) if compute_output else None
    block_c, num_warps = _conv_launch_config(length, channels)
    on = pdl(x)
    _conv_update_kernel[(n_rows, triton.cdiv(channels, block_c))](
        x, conv_state, weight, y if y is not None else x, read_slots,
        write_slots if write_slots is not None else read_slots, counts if counts is not None else read_slots,
        x.stride(0), x.stride(1), weight.stride(0),
        C=channels, L=length, WIDTH=width, LP=_pow2(length), WP=_pow2(width), BC=block_c,
        HAS_COUNTS=counts is not None, HAS_WRITE=write_slots is not None, HAS_OUT=compute_output,
        PDL=on, num_warps=num_warps, launch_pdl=on)
    return y


def causal_conv_update(x: torch.Tensor, conv_state: torch.Tensor, read_slots: torch.Tensor, weight: torch.Tensor,
                       *, counts: torch.Tensor | None = None, write_slots: torch.Tensor | None = None,
                       compute_output: bool = True) -> torch.Tensor | None:
    """Depthwise causal conv + SiLU of N rows of L new inputs, continuing from each row's saved window.

    x [N, L, C] (last dim contiguous); conv_state [S, W, C] pool (the last W inputs); weight [C, W + 1]
    (conv1d.weight[:, 0, :]). Returns y [N, L, C] in x's dtype (None without compute_output). With
    write_slots, conv_state[write_slots[n]] becomes the last W inputs after counts[n] (default L) tokens;
    a row may write its own read slot.
    """
    if use_triton(x):
        return _causal_conv_update_triton(x, conv_state, read_slots, weight, counts, write_slots, compute_output)
    return causal_conv_update_ref(x, conv_state, read_slots, weight, counts=counts, write_slots=write_slots,
                                  compute_output=compute_output)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GatedRMSNorm per head: o [T, H, Dv] (float32 or model dtype), z [T, H, Dv] -> z's dtype, [T, H, Dv]."""
    if not use_triton(z):
        return gated_rms_norm_ref(o, z, weight, eps)
    t, heads, d = z.shape
    o, z = _last_contiguous(o), _last_contiguous(z)
    y = torch.empty(t, heads, d, dtype=z.dtype, device=z.device)
    bd = _pow2(d)
    bh = max(1, min(_pow2(heads), 2048 // bd))
    on = pdl(z)
    _gated_rms_norm_kernel[(t, triton.cdiv(heads, bh))](
        o, z, weight, y, heads, o.stride(0), o.stride(1), z.stride(0), z.stride(1), eps, D=d, BH=bh, BD=bd,
        ROUND_WN=torch.promote_types(weight.dtype, z.dtype) != torch.float32, PDL=on, num_warps=4, launch_pdl=on)
    return y
