"""One decode row through an NVFP4 layer on tensor cores, the weights never leaving registers.

quant_linear's one-row paths dequantize a tile and either reduce it with float32 multiplies or hand it to
`tl.dot`, which stages it through shared memory into the mma operand layout. Here each lane loads 16 bytes of
one weight row (lane = 4 g + t: row g of the warp's 8, bytes 16 t .. 16 t + 15 of a 64-byte span) and feeds
them to `mma.sync.m16n8k16` as the B operand where they are, with no layout conversion: the order of the
products over K does not matter to the sum, so the k index the mma gives a B register is simply defined to be
the physical column that lane loaded, and x is loaded in the same order for the A operand. x has one row, so
A's rows are copies of it: the aligned quad of x pairs (P0, P1, P2, P3) of bytes 0-3 is A as loaded, row g
reading (P0 | P2) and row g + 8 (P1 | P3). One mma takes B = (bytes 0, 2) and keeps its row g, the other
B = (bytes 1, 3) and keeps its row g + 8: every product is counted once and no register is copied.
C register c of lane (g, t) then holds the dot product of weight row 2 t + c (of the 8) with x.

Narrow layers have too few rows for enough warps, so a row's K can be split over P of the warp's 8 mma
columns (column c: row c // P, K part c % P), each A row g then carrying x of part g % P: C[g][n] is right where
g % P == n % P, and the P parts of a row are summed after the loop.

The E2M1 decode is quant_tiles' PTX (w * scale * 2^-26 as bf16 pairs, exact), the 2^26 and the global scale
are applied to the float32 sums. Measured on an H100 (bench/quant_gemv.py, bench/results/quant_gemv_h100_*.json,
% of copy bandwidth): Qwen3-8B gate|up 37.8 -> 27.0 us (50 -> 70%), o 10.2 -> 8.9, down 25.8 -> 21.7; qkv stays
on quant_linear's dot path (15.6 against 11.6 us): `launch_config` holds the lines.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.kernels._triton import HAVE_TRITON, INTERPRET, pdl
from blockspec.kernels.quant_tiles import E2M1_REGS, FP4_GLOBAL_BIAS, e2m1_decode_ptx

NUM_SMS = 132  # H100 / H200
SPAN_BYTES = 64  # weight bytes a row per mma step group: 4 lanes x 16


@dataclass(frozen=True)
class GemvConfig:
    warps: int  # a program: 8 mma columns a warp
    spans: int  # 64-byte spans a loop step
    parts: int  # K parts a weight row is split over (P mma columns a row)

    @property
    def block(self) -> int:
        return 8 * self.warps


WIDE_ROWS = 16384  # from here one K part: many programs already (gate|up, LM heads)
WIDE = GemvConfig(warps=2, spans=4, parts=1)
# narrow layers: K in 4 parts over 16 warps (32 rows a program), while the programs fit one wave
NARROW = GemvConfig(warps=16, spans=4, parts=4)


def launch_config(meta) -> GemvConfig | None:
    """The GEMV's launch for an NVFP4 layer, or None where quant_linear's dot path measured faster (H100,
    bench/quant_gemv.py --sweep): one K part for >= WIDE_ROWS outputs; 4 parts over 16 warps for layers narrow
    enough that their programs fit one wave (Qwen3-8B o_proj 10.2 -> 8.9 us, down 25.8 -> 21.7); between
    the two (qkv: 15.6 against 11.6) the dot path."""
    cfg = WIDE if meta.n >= WIDE_ROWS else NARROW if meta.n * NARROW.parts <= NARROW.block * NUM_SMS else None
    if cfg is None or meta.k % (2 * SPAN_BYTES * cfg.spans * cfg.parts):
        return None
    return cfg


# quant_tiles' E2M1 decode of the 4 bytes in $16 into t0..t3, scaled by the pair $21 (pairs of bytes 0..3), then
# the two mma steps into ($0..$3, from $8..$11) and ($4..$7, from $12..$15), A = $17..$20
_E2M1_MMA = "{\n" + E2M1_REGS + e2m1_decode_ptx("$16") + "".join(
    f"fma.rn.bf16x2 t{i}, t{i}, $21, nz;\n" for i in range(4)) + """\
mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3},
    {$17, $18, $19, $20}, {t0, t2}, {$8, $9, $10, $11};
mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$4, $5, $6, $7},
    {$17, $18, $19, $20}, {t1, t3}, {$12, $13, $14, $15};
}"""


def applies(x: torch.Tensor, layer, meta, residual, norm_weight, gated: bool) -> GemvConfig | None:
    """The GEMV's launch where it takes the call, else None: one bf16 row on a CUDA GPU, an NVFP4 layer of a
    width it measured faster on (`launch_config`), no bias and no fold (quant_linear's kernel keeps those)."""
    if not (HAVE_TRITON and not INTERPRET and x.is_cuda and x.dtype == torch.bfloat16 and x.shape[0] == 1
            and meta.scheme == "nvfp4" and layer.bias is None and residual is None and norm_weight is None
            and not gated):
        return None
    return launch_config(meta)


if HAVE_TRITON:
    import triton
    import triton.language as tl

    from blockspec.kernels._triton import release_dependents, wait_for_inputs

    _E2M1_MMA_C = tl.constexpr(_E2M1_MMA)
    _FP4_BIAS = tl.constexpr(FP4_GLOBAL_BIAS)

    @triton.jit
    def _span_mma(acc1, acc2, w, xp, sa, sb, BN: tl.constexpr):
        """acc1, acc2 += the span's products (module docstring)."""
        sf = tl.join(sa, sb).to(tl.float8e4nv, bitcast=True).to(tl.float32)  # [BN, 4, 2]
        top = (sf * 1.2676506002282294e30).to(tl.int32, bitcast=True) & -65536  # s * 2^100 as bf16, exact
        s2 = top | ((top >> 16) & 0xFFFF)
        s2 = tl.reshape(tl.broadcast_to(s2[:, :, :, None], [BN, 4, 2, 8]), [BN, 64])
        acc1, acc2 = tl.inline_asm_elementwise(
            _E2M1_MMA_C, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
            [acc1, acc2, w, xp, s2], dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
        return acc1, acc2

    @triton.jit
    def _c_sums(acc1, acc2, BN: tl.constexpr):
        """The accumulators -> C [BN, t, c] of each lane (column 2 t + c of its 8-column block): element 4 i + c of
        a lane's 16 is C register c of its i-th group of 4 bytes; row g (c 0, 1) of acc1 and row g + 8 (c 2, 3)
        of acc2 hold the products, and the 4 groups are summed."""
        lo1, hi1 = tl.split(tl.permute(tl.reshape(acc1, [BN, 4, 4, 2, 2]), [0, 1, 2, 4, 3]))
        lo2, hi2 = tl.split(tl.permute(tl.reshape(acc2, [BN, 4, 4, 2, 2]), [0, 1, 2, 4, 3]))
        return tl.sum(lo1 + hi2, axis=2)

    @triton.jit
    def _wide_span(acc1, acc2, QW, x32, S, rows64, n_mask, b0, KB: tl.constexpr, NG: tl.constexpr,
                    BN: tl.constexpr):
        """acc1, acc2 += one 64-byte span of the rows (bytes b0 ..) against x (see the module docstring)."""
        kb = tl.arange(0, 64)
        w = tl.load(QW + rows64[:, None] * KB + b0 + kb[None, :], mask=n_mask[:, None], other=0)
        xp = tl.load(x32 + b0 + kb)  # x as bf16 pairs, pair i beside weight byte i
        # a lane's two groups (bytes 16 t + 8 h): loaded [t, row] and transposed, which gives the scales the
        # lane layout of the weight tile (a [row, t] load would be laid out across the lanes the other way
        # and converted through shared memory, a barrier a span)
        g = b0 // 8 + 2 * tl.arange(0, 4)
        sp = S + rows64[None, :] * NG + g[:, None]
        sa = tl.trans(tl.load(sp, mask=n_mask[None, :], other=0))
        sb = tl.trans(tl.load(sp + 1, mask=n_mask[None, :], other=0))
        return _span_mma(acc1, acc2, w, tl.broadcast_to(xp[None, :], w.shape), sa, sb, BN)

    @triton.jit
    def _wide_kernel(X, QW, S, GS, Y, N, K: tl.constexpr, HAS_GS: tl.constexpr, BN: tl.constexpr,
                     SPANS: tl.constexpr, PDL: tl.constexpr = False):
        """One K part (wide layers). Kept as first measured: the parts kernel at P = 1 (its loads written the
        same) compiled to another schedule, ~20% slower on gate|up (bench/quant_gemv.py, H100)."""
        pid = tl.program_id(0)
        rows = pid * BN + tl.arange(0, BN)
        n_mask = rows < N
        rows64 = rows.to(tl.int64)
        KB: tl.constexpr = K // 2
        NG: tl.constexpr = K // 16
        x32 = X.to(tl.pointer_type(tl.int32))
        acc1 = tl.zeros([BN, 64], dtype=tl.float32)
        acc2 = tl.zeros([BN, 64], dtype=tl.float32)
        wait_for_inputs(PDL)
        for b0 in range(0, KB, 64 * SPANS):
            for u in tl.static_range(SPANS):
                acc1, acc2 = _wide_span(acc1, acc2, QW, x32, S, rows64, n_mask, b0 + 64 * u, KB, NG, BN)
        y = _c_sums(acc1, acc2, BN) * _FP4_BIAS  # [BN, t, c]: weight row 2 t + c of the 8
        if HAS_GS:
            y = y * tl.load(GS)
        release_dependents(PDL)
        r = tl.arange(0, BN)[:, None, None]
        out = pid * BN + (r // 8) * 8 + 2 * tl.arange(0, 4)[None, :, None] + tl.arange(0, 2)[None, None, :]
        tl.store(Y + out, y.to(Y.dtype.element_ty), mask=((r % 8) == 0) & (out < N))  # lanes g = 0 store

    @triton.jit
    def _span_loads(QW, x32, S, wrow, part, n_mask, b0, KB: tl.constexpr, NG: tl.constexpr, BN: tl.constexpr,
                    P: tl.constexpr):
        """What one 64-byte span (bytes b0 .. of each column's K part) reads: the weight bytes [BN, 64], x as bf16
        pairs beside them (pair i beside byte i) and the e4m3 scales of each lane's two groups (bytes 16 t +
        8 h) as two [BN, 4] uint8 tensors. Nothing past the part's end is read (b0 may be one span beyond)."""
        kb = tl.arange(0, 64)
        KP: tl.constexpr = KB // P  # bytes a part
        live = b0 < KP
        g = b0 // 8 + 2 * tl.arange(0, 4)
        w = tl.load(QW + wrow[:, None] * KB + (part * KP)[:, None] + b0 + kb[None, :], mask=n_mask[:, None] & live,
                    other=0)
        # x pairs [P, 64], broadcast over the rows of each part; loaded small (fewer elements than threads),
        # Triton loads it straight in the tile's lane layout
        xp = tl.load(x32 + (tl.arange(0, P) * KP)[:, None] + b0 + kb[None, :], mask=live, other=0)
        xp = tl.reshape(tl.broadcast_to(xp[None, :, :], [BN // P, P, 64]), [BN, 64])
        sp = S + (wrow * NG + part * (NG // P))[None, :] + g[:, None]
        # the scales loaded [t, column] and transposed, which gives them the lane layout of the weight tile (a
        # [column, t] load would be laid out across the lanes the other way and converted through shared
        # memory, a barrier a span)
        sa = tl.trans(tl.load(sp, mask=n_mask[None, :] & live, other=0))
        sb = tl.trans(tl.load(sp + 1, mask=n_mask[None, :] & live, other=0))
        return w, xp, sa, sb

    @triton.jit
    def _parts_kernel(X, QW, S, GS, Y, N, K: tl.constexpr, HAS_GS: tl.constexpr, BN: tl.constexpr,
                      SPANS: tl.constexpr, P: tl.constexpr, PDL: tl.constexpr = False):
        # BN tile columns = BN / P weight rows x P parts of K (column c: row c // P, part c % P); P divides 8,
        # so the 8 columns of a warp's mma hold whole rows and part(g) = g % P
        pid = tl.program_id(0)
        cols = tl.arange(0, BN)
        rows = pid * (BN // P) + cols // P
        part = (cols % P).to(tl.int64)
        n_mask = rows < N
        wrow = rows.to(tl.int64)
        KB: tl.constexpr = K // 2
        NG: tl.constexpr = K // 16
        x32 = X.to(tl.pointer_type(tl.int32))
        acc1 = tl.zeros([BN, 64], dtype=tl.float32)
        acc2 = tl.zeros([BN, 64], dtype=tl.float32)
        wait_for_inputs(PDL)
        # software-pipelined by one span: the next span's loads are issued before this one's mma
        w, xp, sa, sb = _span_loads(QW, x32, S, wrow, part, n_mask, 0, KB, NG, BN, P)
        for b0 in range(0, KB // P, 64 * SPANS):
            for u in tl.static_range(SPANS):
                nw, nxp, nsa, nsb = _span_loads(QW, x32, S, wrow, part, n_mask, b0 + 64 * (u + 1), KB, NG, BN, P)
                acc1, acc2 = _span_mma(acc1, acc2, w, xp, sa, sb, BN)
                w, xp, sa, sb = nw, nxp, nsa, nsb
        y = _c_sums(acc1, acc2, BN)  # [BN, t, e]: C[g][n] with g = c % 8 and n = 2 t + e of c's 8-column block
        # C[g][n] used x of part g % P: right where that is n's part, n % P; keep g = n % P, sum n's P parts
        y = tl.reshape(y, [BN // 8, 8, 8])  # [block, g, n]
        gi = tl.arange(0, 8)[None, :, None]
        ni = tl.arange(0, 8)[None, None, :]
        y = tl.sum(tl.where(gi == ni % P, y, 0.0), axis=1)  # [block, n]
        y = tl.sum(tl.reshape(y, [BN // 8, 8 // P, P]), axis=2) * _FP4_BIAS  # [block, row of the block]
        if HAS_GS:
            y = y * tl.load(GS)
        release_dependents(PDL)
        out = pid * (BN // P) + tl.arange(0, BN // 8)[:, None] * (8 // P) + tl.arange(0, 8 // P)[None, :]
        tl.store(Y + out, y.to(Y.dtype.element_ty), mask=out < N)


def nvfp4_gemv(x: torch.Tensor, layer, meta, cfg: GemvConfig) -> torch.Tensor:
    """x [1, K] (bf16, contiguous) @ dequantize(layer).T -> [1, N] with the launch `applies` gave (or a swept
    one: bench/quant_gemv.py)."""
    y = torch.empty(1, meta.n, dtype=x.dtype, device=x.device)
    on = pdl(x)
    args = (x, layer.qweight, layer.scales.view(torch.uint8), layer.global_scale if meta.has_gs else x, y, meta.n)
    grid = (triton.cdiv(meta.n * cfg.parts, cfg.block),)
    if cfg.parts == 1:
        _wide_kernel[grid](*args, K=meta.k, HAS_GS=meta.has_gs, BN=cfg.block, SPANS=cfg.spans, PDL=on,
                           num_warps=cfg.warps, num_stages=1, launch_pdl=on)
    else:
        _parts_kernel[grid](*args, K=meta.k, HAS_GS=meta.has_gs, BN=cfg.block, SPANS=cfg.spans, P=cfg.parts, PDL=on,
                            num_warps=cfg.warps, num_stages=1, launch_pdl=on)
    return y


# ---------------------------------------------------------------------------------------------------------------
# One token through NVFP4 experts: the wide kernel over each routed expert's stacked weight


def moe_applies(x: torch.Tensor, gate_up, down, shared: bool, biases: bool, clamped: bool) -> bool:
    """One bf16 token on a CUDA GPU through NVFP4 experts (kernels/moe_grouped.QuantOperand with the PTX
    unpacker) whose widths fill whole spans, with no folded shared expert, biases or clamped activation (the
    grouped kernels keep those)."""
    return (HAVE_TRITON and not INTERPRET and x.is_cuda and x.dtype == torch.bfloat16 and x.shape[0] == 1
            and not (shared or biases or clamped)
            and all(getattr(w, "meta", None) is not None and w.meta.scheme == "nvfp4" and w.fast
                    and w.k % (2 * SPAN_BYTES) == 0 for w in (gate_up, down)))


def _moe_spans(k: int) -> int:
    return next(s for s in (4, 2, 1) if k % (2 * SPAN_BYTES * s) == 0)


if HAVE_TRITON:
    @triton.jit
    def _moe_kernel(X, IDS, QW, S, GS, OUT, N_W: tl.constexpr, K: tl.constexpr, W_STRIDE: tl.constexpr,
                    S_STRIDE: tl.constexpr, HAS_GS: tl.constexpr, GATED: tl.constexpr, X_PER_SLOT: tl.constexpr,
                    BN: tl.constexpr, SPANS: tl.constexpr, PDL: tl.constexpr = False):
        """Program (slot, block): BN rows of the slot's expert (IDS[slot]) against x (X, or row `slot` of X
        with X_PER_SLOT). GATED (gate|up, N_W = 2I rows): tile column c reads gate row c // 2 (c even) or up
        row I + c // 2 (c odd), so a lane's two C registers are one output's gate and up, and it writes
        SiLU(gate) * up to OUT [slots, I], rounded as silu_mul_ref; else OUT [slots, N_W]."""
        slot = tl.program_id(0)
        blk = tl.program_id(1)
        e = tl.load(IDS + slot).to(tl.int64)
        cols = tl.arange(0, BN)
        if GATED:
            HALF: tl.constexpr = N_W // 2  # I
            m = blk * (BN // 2) + cols // 2
            n_mask = m < HALF
            rows = m + (cols % 2) * HALF
        else:
            rows = blk * BN + cols
            n_mask = rows < N_W
        KB: tl.constexpr = K // 2
        NG: tl.constexpr = K // 16
        wait_for_inputs(PDL)
        x = X + slot * K if X_PER_SLOT else X
        x32 = x.to(tl.pointer_type(tl.int32))
        qw = QW + e * W_STRIDE
        s = S + e * S_STRIDE
        rows64 = rows.to(tl.int64)
        acc1 = tl.zeros([BN, 64], dtype=tl.float32)
        acc2 = tl.zeros([BN, 64], dtype=tl.float32)
        for b0 in range(0, KB, 64 * SPANS):
            for u in tl.static_range(SPANS):
                acc1, acc2 = _wide_span(acc1, acc2, qw, x32, s, rows64, n_mask, b0 + 64 * u, KB, NG, BN)
        y = _c_sums(acc1, acc2, BN) * _FP4_BIAS  # [BN, t, c]: tile column 2 t + c of the 8 (every lane right)
        if HAS_GS:
            y = y * tl.load(GS + e)
        dtype = OUT.dtype.element_ty
        release_dependents(PDL)
        r = tl.arange(0, BN)[:, None]
        t = tl.arange(0, 4)[None, :]
        if GATED:
            gate, up = tl.split(y)  # [BN, 4]: output m = the block's 4 (r // 8) * 4 + t
            g = gate.to(dtype).to(tl.float32)  # the F.linear outputs, then silu_mul_ref's roundings
            sg = (g / (1.0 + tl.exp(-g))).to(dtype)
            act = (sg.to(tl.float32) * up.to(dtype).to(tl.float32)).to(dtype)
            out = blk * (BN // 2) + (r // 8) * 4 + t
            tl.store(OUT + slot * HALF + out, act, mask=((r % 8) == 0) & (out < HALF))
        else:
            r3 = r[:, :, None]
            out = blk * BN + (r3 // 8) * 8 + 2 * t[:, :, None] + tl.arange(0, 2)[None, None, :]
            tl.store(OUT + slot * N_W + out, y.to(dtype), mask=((r3 % 8) == 0) & (out < N_W))


def nvfp4_moe(x: torch.Tensor, ids: torch.Tensor, w, gated: bool) -> torch.Tensor:
    """One token's routed experts through one stacked NVFP4 projection w (QuantOperand): gated, x [1, H] ->
    SiLU(gate) * up [k, I] for the k experts of ids [1, k]; else x [k, I] (one row a slot) -> [k, H]. The
    caller checked `moe_applies`."""
    slots = ids.shape[-1]
    n_out = w.n // 2 if gated else w.n
    out = torch.empty(slots, n_out, dtype=x.dtype, device=x.device)
    ids = ids.reshape(-1)
    on = pdl(x)
    _moe_kernel[(slots, triton.cdiv(w.n, WIDE.block))](
        x, ids if ids.is_contiguous() else ids.contiguous(), w.qweight, w.scales,
        w.global_scale if w.global_scale is not None else w.scales, out, N_W=w.n, K=w.k,
        W_STRIDE=w.strides[0], S_STRIDE=w.strides[1], HAS_GS=w.global_scale is not None, GATED=gated,
        X_PER_SLOT=not gated, BN=WIDE.block, SPANS=_moe_spans(w.k), PDL=on, num_warps=WIDE.warps, num_stages=1,
        launch_pdl=on)
    return out
