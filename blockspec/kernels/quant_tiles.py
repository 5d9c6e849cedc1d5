"""Triton tiles of the quantized weight layouts, dequantized in registers: the one copy that the dense GEMMs
(kernels/quant_linear.py) and the grouped MoE GEMMs (kernels/moe_grouped.py) both call.

A tile is [SPLIT, BLOCK_N, BLOCK_K] weights of rows `rows` (int64 row indices from the base pointers QW / S / Z,
so a caller reading one expert of a stacked [E, N, ...] tensor passes that expert's base pointers), starting at
columns kk (one per slice). The layouts are defined in models/layers/quant_linear.py; kernels/quant_linear.py
describes which path uses the fast PTX unpackers and why. This module imports nothing from the models, so the
MoE kernels (imported by models/layers/moe.py) can use it without an import cycle.
"""

from __future__ import annotations

from blockspec.kernels._triton import HAVE_TRITON

FP4_GLOBAL_BIAS = 2.0 ** 26  # fast NVFP4 / MXFP4 tiles hold w * 2^-26 (see _unpack_e2m1_fast); the epilogue restores it

# PTX for the fast unpackers, elementwise over bytes (Triton packs any 4 of a thread's bytes into $4; output
# i depends on byte i only): output i is the int32 holding the 16-bit pair (low nibble, high nibble) of byte
# i, dequantized; the caller splits it with bitcasts and interleaves the halves, which LLVM folds back into
# the register the mma reads (no repacking). Per-group operands arrive as int32 pairs (x, x), one per
# byte ($5.., $9..). prmt moves byte i to lane 0 and the byte holding its high nibble to lane 1, zeroing
# bytes 1 and 3 (selector nibble 8-15 = the sign of a byte known to be < 0x80). bf16 arithmetic is
# fma.rn.bf16x2 (sm_80+; sub / mul.bf16x2 need sm_90).
# int4: lop3 (t & 0x000F000F) | magic makes magic + q exactly (128 + q in bf16, 1024 + q in fp16); adding
# -(magic + z) is exact and the multiply by the scale rounds once, as dequantize() rounds (q - z) * s.

# E2M1 -> bf16 without a table: a code n (sign | e1 e0 m) alone in a 16-bit lane, times 0x1040, holds n at
# bits 6..9 and again at 12..15 (no carries); masking 0x81C0 keeps e1 e0 m at bits 8..6 and the sign at
# bit 15: the bf16 number e2m1 * 2^-126 (e = 0 lands on the subnormal m * 0.5 * 2^-126, e > 0 on
# 2^(e-127) * (1 + m/2)). The scale operand carries 2^100 (s' = s * 2^100, exact), so one multiply gives
# w * 2^-26, a normal bf16 for every code and e4m3 scale; the epilogue multiplies by 2^26 * global_scale.
E2M1_REGS = ".reg .b32 lo, hi, t<4>, nz;\n"


def e2m1_decode_ptx(src: str) -> str:
    """PTX lines decoding the 4 bytes in register `src` into t0..t3 (declared by E2M1_REGS): t_i holds byte i's
    (low, high) E2M1 codes as the bf16 pair code * 2^-126, before any scale (nz: the -0 pair for the scaling fma).
    Shared by _E2M1_ASM and kernels/quant_gemv.py's mma GEMV."""
    return (f"mov.b32 nz, 0x80008000;\nand.b32 lo, {src}, 0x0F0F0F0F;\nshr.b32 hi, {src}, 4;\n"
            "and.b32 hi, hi, 0x0F0F0F0F;\n"
            + "".join(f"prmt.b32 t{i}, lo, hi, 0x8{i + 4}8{i};\n" for i in range(4))
            + "".join(f"mul.lo.u32 t{i}, t{i}, 0x1040;\n" for i in range(4))
            + "".join(f"and.b32 t{i}, t{i}, 0x81C081C0;\n" for i in range(4)))


INT4_REGS = ".reg .b32 v, t<4>, one, nz;\n"
_INT4_MAGIC = {"bf16x2": ("0x43004300", "0x3F803F80"), "f16x2": ("0x64006400", "0x3C003C00")}  # (magic, 1.0) pairs


def int4_decode_ptx(src: str, zero_pairs: str | list[str], scale_pairs: str | list[str] | None, out: str = "t",
                    ty: str = "bf16x2") -> str:
    """PTX lines decoding the 4 int4 bytes in register `src` into out0..out3 (temporaries declared by INT4_REGS):
    byte i's (low, high) nibbles as the `ty` pair (q - z) * s, rounded once as dequantize() rounds it (above).
    `zero_pairs` holds -(magic + z) as a pair, `scale_pairs` s: one register for all 4 bytes, or one a byte;
    None: the pairs q - z alone (exact), the caller scaling the sums they feed (a group's dot product)."""
    magic, one = _INT4_MAGIC[ty]
    zeros = [zero_pairs] * 4 if isinstance(zero_pairs, str) else zero_pairs
    head = (f"mov.b32 one, {one};\nmov.b32 nz, 0x80008000;\nshr.b32 v, {src}, 4;\n"
            + "".join(f"prmt.b32 t{i}, {src}, v, 0xF{i + 4}F{i};\n" for i in range(4))
            + "".join(f"lop3.b32 t{i}, t{i}, 0x000F000F, {magic}, 0xEA;\n" for i in range(4)))
    if scale_pairs is None:
        return head + "".join(f"fma.rn.{ty} {out}{i}, t{i}, one, {zeros[i]};\n" for i in range(4))
    scales = [scale_pairs] * 4 if isinstance(scale_pairs, str) else scale_pairs
    return (head + "".join(f"fma.rn.{ty} t{i}, t{i}, one, {zeros[i]};\n" for i in range(4))
            + "".join(f"fma.rn.{ty} {out}{i}, t{i}, {scales[i]}, nz;\n" for i in range(4)))


def _int4_asm(ty: str, scaled: bool = True) -> str:
    """The fast int4 unpacker: bytes in $4, per-byte zero pairs $5..$8 and (scaled) scale pairs $9..$12, out
    $0..$3."""
    scales = [f"${9 + i}" for i in range(4)] if scaled else None
    return "{\n" + INT4_REGS + int4_decode_ptx("$4", [f"${5 + i}" for i in range(4)], scales, "$", ty) + "}"


_E2M1_ASM = "{\n" + E2M1_REGS + e2m1_decode_ptx("$4") + "".join(
    f"fma.rn.bf16x2 ${i}, t{i}, ${i + 5}, nz;\n" for i in range(4)) + "}"
INT4_ASM_BF16 = _int4_asm("bf16x2")
INT4_ASM_FP16 = _int4_asm("f16x2")
INT4_DIFF_ASM_BF16 = _int4_asm("bf16x2", scaled=False)
INT4_DIFF_ASM_FP16 = _int4_asm("f16x2", scaled=False)
E2M1_ASM_BF16 = _E2M1_ASM

if HAVE_TRITON:
    import triton
    import triton.language as tl

    _INT4_ASM_BF16 = tl.constexpr(INT4_ASM_BF16)
    _INT4_ASM_FP16 = tl.constexpr(INT4_ASM_FP16)
    _INT4_DIFF_ASM_BF16 = tl.constexpr(INT4_DIFF_ASM_BF16)
    _INT4_DIFF_ASM_FP16 = tl.constexpr(INT4_DIFF_ASM_FP16)
    _E2M1_ASM_BF16 = tl.constexpr(E2M1_ASM_BF16)

    @triton.jit
    def _pair16(v):
        """A 16-bit float tensor -> int32 holding its bits in both halves (a broadcast operand for the PTX)."""
        bits = v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return bits | (bits << 16)

    @triton.jit
    def _split_pairs(pair, OUT: tl.constexpr):
        """int32 (low, high) 16-bit pairs from the PTX -> the two halves as OUT tensors."""
        lo = (pair & 0xFFFF).to(tl.int16).to(OUT, bitcast=True)
        hi = (pair >> 16).to(tl.int16).to(OUT, bitcast=True)
        return lo, hi

    @triton.jit
    def _unpack_int4_fast(b, nz2, s2, IS_BF16: tl.constexpr):
        """uint8 bytes -> int32 pairs of (low, high) nibbles dequantized to the 16-bit dtype: (q - z) * s.
        nz2 holds -(magic + z) (-(128 + z) in bf16, -(1024 + z) in fp16) and s2 the scale, as pairs."""
        if IS_BF16:
            return tl.inline_asm_elementwise(_INT4_ASM_BF16, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [b, nz2, s2],
                                             dtype=tl.int32, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(_INT4_ASM_FP16, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [b, nz2, s2],
                                             dtype=tl.int32, is_pure=True, pack=4)

    @triton.jit
    def _unpack_int4_diff_fast(b, nz2, IS_BF16: tl.constexpr):
        """uint8 bytes -> int32 pairs of (low, high) nibbles minus the zero, q - z, exact in the 16-bit dtype."""
        if IS_BF16:
            return tl.inline_asm_elementwise(_INT4_DIFF_ASM_BF16, "=r,=r,=r,=r,r,r,r,r,r", [b, nz2],
                                             dtype=tl.int32, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(_INT4_DIFF_ASM_FP16, "=r,=r,=r,=r,r,r,r,r,r", [b, nz2],
                                             dtype=tl.int32, is_pure=True, pack=4)

    @triton.jit
    def _unpack_e2m1_fast(b, s2):
        """uint8 bytes of E2M1 pairs -> int32 pairs of bf16 values * s * 2^-126; s2 carries s * 2^100 (above)."""
        return tl.inline_asm_elementwise(_E2M1_ASM_BF16, "=r,=r,=r,=r,r,r,r,r,r", [b, s2],
                                         dtype=tl.int32, is_pure=True, pack=4)

    @triton.jit
    def _int_to_float(v):
        """Exact int32 -> float32 for |v| < 2^22 without I2F (a quarter-rate instruction on Hopper): the bits
        0x4B400000 + v are the float 2^23 + 2^22 + v."""
        return (v + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0

    @triton.jit
    def _e2m1_plain(c):
        """4-bit E2M1 codes (int32) -> float32 with integer ops only: 2|v| = m (e = 0) or (2 + m) << (e - 1)."""
        e = (c >> 1) & 3
        m = c & 1
        twice = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0))
        mag = _int_to_float(twice) * 0.5
        return tl.where((c & 8) != 0, -mag, mag)

    @triton.jit
    def _group_scales(S, Z, rows, n_mask, k0, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr, G: tl.constexpr,
                      NG: tl.constexpr, NGT: tl.constexpr, SCALE_ROW_DIV: tl.constexpr, HAS_ZERO: tl.constexpr,
                      PACKED: tl.constexpr = False):
        """Scales (and zeros) of the groups a step of SPLIT slices of BLOCK_K columns from k0 covers:
        [SPLIT, BLOCK_N, NGT], NGT groups a slice (one when a group spans more than a slice). Out-of-range
        groups and rows read scale 0, so their weights come out 0. Loaded as one contiguous run of groups a
        row (the slices are adjacent), >= 4 bytes a thread where the tile is large enough, so that the
        pipeliner streams them with cp.async ahead of their step like the weights instead of a synchronous
        load that stalls every step (int4's 2 + 1 bytes a group arrive PACKED as one int32 for that)."""
        if G <= BLOCK_K:
            g = k0 // G + tl.arange(0, SPLIT * NGT)
        else:
            g = (k0 + tl.arange(0, SPLIT) * BLOCK_K) // G
        srow = (rows // SCALE_ROW_DIV)[:, None]
        gmask = n_mask[:, None] & (g < NG)[None, :]
        if PACKED:  # int32 scale bits | zero << 16 in Z (see _kernel_operands); S only gives the scales' dtype
            v = tl.load(Z + srow * NG + g[None, :], mask=gmask, other=0)
            v = tl.permute(tl.reshape(v, [v.shape[0], SPLIT, NGT]), [1, 0, 2])
            return (v & 0xFFFF).to(tl.int16).to(S.dtype.element_ty, bitcast=True), v >> 16
        s = tl.load(S + srow * NG + g[None, :], mask=gmask, other=0)
        s = tl.permute(tl.reshape(s, [s.shape[0], SPLIT, NGT]), [1, 0, 2])
        if HAS_ZERO:
            z = tl.load(Z + srow * NG + g[None, :], mask=gmask, other=0)
            z = tl.permute(tl.reshape(z, [z.shape[0], SPLIT, NGT]), [1, 0, 2])
        else:
            z = tl.zeros(s.shape, dtype=tl.int32)
        return s, z

    @triton.jit
    def _packed_offsets(kk, NGT: tl.constexpr, GT: tl.constexpr):
        """Byte offsets within a row of two-per-byte weights: [SPLIT, NGT groups, GT / 2 bytes]."""
        group = tl.arange(0, NGT)[None, :, None] * (GT // 2)
        return kk[:, None, None] // 2 + group + tl.arange(0, GT // 2)[None, None, :]

    @triton.jit
    def _packed_bytes(QW, rows, n_mask, kk, K: tl.constexpr, NGT: tl.constexpr, GT: tl.constexpr,
                      EVEN_K: tl.constexpr):
        """The bytes of a two-per-byte weight tile: [SPLIT, BLOCK_N, NGT groups, GT / 2]."""
        kb = _packed_offsets(kk, NGT, GT)
        mask = n_mask[None, :, None, None]
        if not EVEN_K:
            mask = mask & (kb < K // 2)[:, None, :, :]
        return tl.load(QW + rows[None, :, None, None] * (K // 2) + kb[:, None, :, :], mask=mask, other=0)

    @triton.jit
    def _int4_tile(QW, s, z, rows, n_mask, kk, K: tl.constexpr, G: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr, FAST: tl.constexpr, OUT: tl.constexpr, SCALED: tl.constexpr = True):
        """int4 weights [SPLIT, BLOCK_N, BLOCK_K] starting at columns kk (one per slice), as OUT; s, z are the
        tile's group scales and zeros (_tile_scales). SCALED False: q - z only (exact; s unread), for a caller
        that scales each group's dot product instead of each weight."""
        GT: tl.constexpr = G if G < BLOCK_K else BLOCK_K
        NGT: tl.constexpr = BLOCK_K // GT
        b = _packed_bytes(QW, rows, n_mask, kk, K, NGT, GT, EVEN_K)
        if FAST:  # bf16 / fp16 pairs straight from the bytes (PTX)
            IS_BF16: tl.constexpr = tl.bfloat16 == OUT
            NEG_MAGIC: tl.constexpr = 0xC300 if IS_BF16 else 0xE400  # sign bit | magic
            nz = z.to(tl.int32) | NEG_MAGIC
            nz2 = tl.broadcast_to((nz | (nz << 16))[:, :, :, None], b.shape)
            if SCALED:
                pair = _unpack_int4_fast(b, nz2, tl.broadcast_to(_pair16(s.to(OUT))[:, :, :, None], b.shape),
                                         IS_BF16)
            else:
                pair = _unpack_int4_diff_fast(b, nz2, IS_BF16)
            lo, hi = _split_pairs(pair, OUT)
        elif SCALED:
            bi = b.to(tl.int32)
            zi = z.to(tl.int32)[:, :, :, None]
            sf = s.to(tl.float32)[:, :, :, None]
            lo = (_int_to_float((bi & 0xF) - zi) * sf).to(OUT)
            hi = (_int_to_float((bi >> 4) - zi) * sf).to(OUT)
        else:
            bi = b.to(tl.int32)
            zi = z.to(tl.int32)[:, :, :, None]
            lo = _int_to_float((bi & 0xF) - zi).to(OUT)
            hi = _int_to_float((bi >> 4) - zi).to(OUT)
        w = tl.interleave(lo, hi)  # [S, BN, NGT, GT]: element k even from the low nibble
        return tl.reshape(w, [w.shape[0], w.shape[1], BLOCK_K])

    @triton.jit
    def _nvfp4_tile(QW, s, rows, n_mask, kk, K: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                    FAST: tl.constexpr, OUT: tl.constexpr):
        """NVFP4 weights [SPLIT, BLOCK_N, BLOCK_K] * e4m3 group scale (s: the tile's scale bytes), without the
        global scale (applied to the accumulator); FAST tiles are also scaled by 2^-26 (bf16 only)."""
        GT: tl.constexpr = 16
        NGT: tl.constexpr = BLOCK_K // GT
        b = _packed_bytes(QW, rows, n_mask, kk, K, NGT, GT, EVEN_K)
        sf = s.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # e4m3 scales passed as a uint8 view
        if FAST:
            # s * 2^100 is exact in bf16 (4 significant bits): its float32 bits' top half, duplicated into both
            # halves of the operand (a byte shuffle), not a rounding conversion (F2F: quarter rate)
            top = (sf * 1.2676506002282294e30).to(tl.int32, bitcast=True) & -65536
            pair = _unpack_e2m1_fast(b, tl.broadcast_to((top | ((top >> 16) & 0xFFFF))[:, :, :, None], b.shape))
            lo, hi = _split_pairs(pair, tl.bfloat16)
        else:
            bi = b.to(tl.int32)
            lo = (_e2m1_plain(bi & 0xF) * sf[:, :, :, None]).to(OUT)
            hi = (_e2m1_plain(bi >> 4) * sf[:, :, :, None]).to(OUT)
        w = tl.interleave(lo, hi)
        return tl.reshape(w, [w.shape[0], w.shape[1], BLOCK_K])

    @triton.jit
    def _mxfp4_tile(QW, s, rows, n_mask, kk, K: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                    FAST: tl.constexpr, OUT: tl.constexpr):
        """MXFP4 weights [SPLIT, BLOCK_N, BLOCK_K]: E2M1 codes as NVFP4's, times 2^(s - 127) per 32 (E8M0 s,
        uint8). Plain: the power of two built from its exponent bits (s = 0: the subnormal 2^-127), exact.
        FAST (bf16): NVFP4's PTX with the scale operand 2^(s - 27) (bf16 exponent field s + 100), so the tile
        holds w * 2^-26 as NVFP4's fast tiles do (the epilogue's FP4_GLOBAL_BIAS restores it); exact for
        21 <= s <= 154 (scales 2^-106 .. 2^27), beyond which real weights do not go: smaller ones flush to
        zero, larger ones clamp."""
        GT: tl.constexpr = 32
        NGT: tl.constexpr = BLOCK_K // GT
        b = _packed_bytes(QW, rows, n_mask, kk, K, NGT, GT, EVEN_K)
        if FAST:
            top = tl.minimum(s.to(tl.int32) + 100, 254) << 7
            pair = _unpack_e2m1_fast(b, tl.broadcast_to((top | (top << 16))[:, :, :, None], b.shape))
            lo, hi = _split_pairs(pair, tl.bfloat16)
        else:
            si = s.to(tl.int32)
            sf = tl.where(si == 0, 0x00400000, si << 23).to(tl.float32, bitcast=True)[:, :, :, None]
            bi = b.to(tl.int32)
            lo = (_e2m1_plain(bi & 0xF) * sf).to(OUT)
            hi = (_e2m1_plain(bi >> 4) * sf).to(OUT)
        w = tl.interleave(lo, hi)
        return tl.reshape(w, [w.shape[0], w.shape[1], BLOCK_K])

    @triton.jit
    def _byte_tile(QW, s, z, rows, n_mask, kk, z_row, K: tl.constexpr, G: tl.constexpr, IS_FP8: tl.constexpr,
                   PER_ROW: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, OUT: tl.constexpr):
        """int8 or fp8 weights [SPLIT, BLOCK_N, BLOCK_K]. PER_ROW (one scale per row): the tile is q - z (int8)
        or q (fp8) and the scale is applied to the accumulator; else each group's scale is applied here
        (fp8 128x128 blocks: G = 128 along K and SCALE_ROW_DIV = 128 rows)."""
        GT: tl.constexpr = BLOCK_K if PER_ROW else (G if G < BLOCK_K else BLOCK_K)
        NGT: tl.constexpr = BLOCK_K // GT
        ks = kk[:, None, None] + tl.arange(0, NGT)[None, :, None] * GT + tl.arange(0, GT)[None, None, :]
        mask = n_mask[None, :, None, None]
        if not EVEN_K:
            mask = mask & (ks < K)[:, None, :, :]
        q = tl.load(QW + rows[None, :, None, None] * K + ks[:, None, :, :], mask=mask, other=0)
        if IS_FP8:  # passed as a uint8 view (a masked fp8 load has no `other` to fill with)
            v = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        elif PER_ROW:
            v = _int_to_float(q.to(tl.int32) - z_row[None, :, None, None])
        else:
            v = q.to(tl.int32)
        if not PER_ROW:
            if not IS_FP8:
                v = _int_to_float(v - z.to(tl.int32)[:, :, :, None])
            v = v * s.to(tl.float32)[:, :, :, None]
        w = v.to(OUT)
        return tl.reshape(w, [w.shape[0], w.shape[1], BLOCK_K])

    @triton.jit
    def _tile_scales(S, Z, rows, n_mask, k0, SPLIT: tl.constexpr, SCHEME: tl.constexpr, K: tl.constexpr,
                     G: tl.constexpr, NG: tl.constexpr, SCALE_ROW_DIV: tl.constexpr, HAS_ZERO: tl.constexpr,
                     PER_ROW: tl.constexpr, BLOCK_K: tl.constexpr):
        """The scales and zeros the tiles of a step from k0 need ([SPLIT, BLOCK_N, groups a slice]; zeros as
        int32 0 where the scheme has none)."""
        if SCHEME == "nvfp4":
            return _group_scales(S, S, rows, n_mask, k0, SPLIT, BLOCK_K, 16, NG, BLOCK_K // 16, 1, False)
        elif SCHEME == "mxfp4":
            return _group_scales(S, S, rows, n_mask, k0, SPLIT, BLOCK_K, 32, NG, BLOCK_K // 32, 1, False)
        elif PER_ROW:  # int8 / fp8 with one scale per row: applied to the accumulator instead
            none = tl.zeros([SPLIT, rows.shape[0], 1], dtype=tl.int32)
            return none, none
        else:
            GT: tl.constexpr = G if G < BLOCK_K else BLOCK_K
            return _group_scales(S, Z, rows, n_mask, k0, SPLIT, BLOCK_K, G, NG, BLOCK_K // GT, SCALE_ROW_DIV,
                                 HAS_ZERO and SCHEME != "fp8", SCHEME == "int4" and Z.dtype.element_ty == tl.int32)

    @triton.jit
    def _dequant_scaled(QW, s, z, rows, n_mask, kk, z_row, SCHEME: tl.constexpr, K: tl.constexpr,
                        G: tl.constexpr, PER_ROW: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                        FAST: tl.constexpr, OUT: tl.constexpr):
        """The per-scheme tile dequantizer given the tile's scales (_tile_scales): [SPLIT, BLOCK_N, BLOCK_K]."""
        if SCHEME == "int4":
            return _int4_tile(QW, s, z, rows, n_mask, kk, K, G, BLOCK_K, EVEN_K, FAST, OUT)
        elif SCHEME == "nvfp4":
            return _nvfp4_tile(QW, s, rows, n_mask, kk, K, BLOCK_K, EVEN_K, FAST, OUT)
        elif SCHEME == "mxfp4":
            return _mxfp4_tile(QW, s, rows, n_mask, kk, K, BLOCK_K, EVEN_K, FAST, OUT)
        else:
            return _byte_tile(QW, s, z, rows, n_mask, kk, z_row, K, G, SCHEME == "fp8", PER_ROW, BLOCK_K, EVEN_K,
                              OUT)

    @triton.jit
    def _dequant_tile(QW, S, Z, rows, n_mask, k0, z_row, SPLIT: tl.constexpr, SCHEME: tl.constexpr,
                      K: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, SCALE_ROW_DIV: tl.constexpr,
                      HAS_ZERO: tl.constexpr, PER_ROW: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                      FAST: tl.constexpr, OUT: tl.constexpr):
        """Scales + dequantization of the SPLIT slices of BLOCK_K columns from k0: the per-scheme tile shared by
        the dense GEMM (its K step), the whole-weight kernel (SPLIT = 1) and the grouped MoE GEMMs (which pass
        an expert's QW / S / Z base pointers). Returns [SPLIT, BLOCK_N, BLOCK_K] as OUT."""
        kk = k0 + tl.arange(0, SPLIT) * BLOCK_K
        s, z = _tile_scales(S, Z, rows, n_mask, k0, SPLIT, SCHEME, K, G, NG, SCALE_ROW_DIV, HAS_ZERO, PER_ROW,
                            BLOCK_K)
        return _dequant_scaled(QW, s, z, rows, n_mask, kk, z_row, SCHEME, K, G, PER_ROW, BLOCK_K, EVEN_K, FAST, OUT)
