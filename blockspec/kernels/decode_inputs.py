"""A decode step's index tensors, derived on the device from a few integers per sequence.

The host writes, per row: the anchor position and token, the context rows the previous step
committed (first position, count, first row of the feature buffer), the recurrent-state slot it reads
(hybrid models; the committed state goes to its pair partner, slot ^ 1), the number of drafts and the
block table. One kernel derives everything the drafter and verify graphs read: positions, KV slots,
sequence lengths, the drafter's context indices and the [anchor, MASK...] block.

Chained mode is pipelined decoding: the next step is launched before the host has read this one's
tokens, so the kernel first advances each live row by the acceptance the verify graph left on the
device (`greedy`: [accepted, argmax_0..argmax_k] per row) and moves each row to the state slot the
previous step committed into. The host then only supplies block tables (dead rows point at the
scratch block) and draft counts.
"""

from __future__ import annotations

import torch

from blockspec.kernels._triton import HAVE_TRITON, use_triton

# Sections the host writes (in buffer order), and the ones derived from them.
ROW_INPUTS = ("anchor", "token", "ctx_pos0", "ctx_count", "ctx_row0", "state_slot", "num_drafts", "tables")
DERIVED = ("tokens", "positions", "slots", "seq_lens", "kv_start", "draft_seq_lens", "draft_kv_start",
           "draft_tokens", "ctx_rows", "ctx_positions", "ctx_slots")

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _decode_inputs_kernel(ANCHOR, TOKEN, CPOS0, CCOUNT, CROW0, SLOT, ND, TABLES, GREEDY,
                              TOKENS, POSITIONS, SLOTS, SEQ_LENS, KV_START, DSEQ_LENS, DKV_START, DTOKENS,
                              CROWS, CPOSITIONS, CSLOTS, m, scratch, bs, mask_token, window, q,
                              CHAINED: tl.constexpr, QP: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        table = TABLES + b * m
        live = tl.load(table) != scratch
        if CHAINED:
            g = GREEDY + b * (q + 1)
            a = tl.minimum(tl.maximum(tl.load(g), 0), q - 1)
            old = tl.load(ANCHOR + b)
            bonus = tl.load(g + 1 + a)
            anchor = tl.where(live, old + a + 1, 0)
            token = tl.where(live, bonus, 0)
            cpos0 = tl.where(live, old, 0)
            ccount = tl.where(live, a + 1, 0)
            crow0 = tl.where(live, b * q, 0)
            tl.store(ANCHOR + b, anchor)
            tl.store(TOKEN + b, token)
            tl.store(CPOS0 + b, cpos0)
            tl.store(CCOUNT + b, ccount)
            tl.store(CROW0 + b, crow0)
            tl.store(SLOT + b, tl.load(SLOT + b) ^ 1)
        else:
            anchor = tl.load(ANCHOR + b)
            token = tl.load(TOKEN + b)
            cpos0 = tl.load(CPOS0 + b)
            ccount = tl.load(CCOUNT + b)
            crow0 = tl.load(CROW0 + b)
        nd = tl.load(ND + b)
        i = tl.arange(0, QP)
        valid = i < q
        scratch_slot = scratch * bs + i % bs
        pos = anchor + i
        blk = tl.load(table + tl.minimum(pos // bs, m - 1), mask=valid, other=0)
        out = b * q + i
        tl.store(POSITIONS + out, pos, mask=valid)
        tl.store(SLOTS + out, tl.where(i <= nd, blk * bs + pos % bs, scratch_slot), mask=valid)
        tl.store(TOKENS + out, tl.where(i == 0, token, 0), mask=valid)
        tl.store(DTOKENS + out, tl.where(i == 0, token, mask_token), mask=valid)
        in_ctx = i < ccount
        cpos = cpos0 + i
        cblk = tl.load(table + tl.minimum(cpos // bs, m - 1), mask=valid, other=0)
        tl.store(CROWS + out, tl.where(in_ctx, crow0 + i, 0), mask=valid)
        tl.store(CPOSITIONS + out, tl.where(in_ctx, cpos, 0), mask=valid)
        tl.store(CSLOTS + out, tl.where(in_ctx, cblk * bs + cpos % bs, scratch_slot), mask=valid)
        tl.store(SEQ_LENS + b, anchor + q)
        tl.store(KV_START + b, anchor * 0)
        tl.store(DSEQ_LENS + b, tl.where(live, anchor + nd + 1, q))
        tl.store(DKV_START + b, tl.where(window >= 0, tl.maximum(anchor - window, 0), 0))


def decode_inputs_ref(p: dict[str, torch.Tensor], greedy: torch.Tensor | None, scratch: int, block_size: int,
                      mask_token: int, window: int) -> None:
    """Plain-PyTorch definition (in place on the sections in `p`); window < 0: no drafter window."""
    tables = p["tables"]
    bp, m = tables.shape
    q = p["tokens"].numel() // bp
    dev = tables.device
    live = tables[:, 0] != scratch
    zero = torch.zeros(bp, dtype=torch.int64, device=dev)
    if greedy is not None:
        a = greedy[:, 0].clamp(0, q - 1)
        old = p["anchor"].clone()
        bonus = greedy.gather(1, (1 + a)[:, None])[:, 0]
        p["ctx_pos0"].copy_(torch.where(live, old, zero))
        p["ctx_count"].copy_(torch.where(live, a + 1, zero))
        p["ctx_row0"].copy_(torch.where(live, torch.arange(bp, device=dev) * q, zero))
        p["anchor"].copy_(torch.where(live, old + a + 1, zero))
        p["token"].copy_(torch.where(live, bonus, zero))
        p["state_slot"].bitwise_xor_(1)
    ar = torch.arange(q, device=dev)
    anchor, nd = p["anchor"], p["num_drafts"]
    scratch_slots = (scratch * block_size + ar % block_size).expand(bp, q)

    def slot(pos: torch.Tensor) -> torch.Tensor:
        return tables.gather(1, (pos // block_size).clamp(max=m - 1)) * block_size + pos % block_size

    pos = anchor[:, None] + ar
    p["positions"].view(bp, q).copy_(pos)
    p["slots"].view(bp, q).copy_(torch.where(ar <= nd[:, None], slot(pos), scratch_slots))
    p["seq_lens"].copy_(anchor + q)
    p["kv_start"].zero_()
    p["draft_seq_lens"].copy_(torch.where(live, anchor + nd + 1, zero + q))
    p["draft_kv_start"].copy_((anchor - window).clamp(min=0) if window >= 0 else zero)
    first = ar == 0
    p["tokens"].view(bp, q).copy_(torch.where(first, p["token"][:, None], 0))
    p["draft_tokens"].view(bp, q).copy_(torch.where(first, p["token"][:, None], mask_token))
    in_ctx = ar < p["ctx_count"][:, None]
    cpos = p["ctx_pos0"][:, None] + ar
    p["ctx_rows"].view(bp, q).copy_(torch.where(in_ctx, p["ctx_row0"][:, None] + ar, 0))
    p["ctx_positions"].view(bp, q).copy_(torch.where(in_ctx, cpos, 0))
    p["ctx_slots"].view(bp, q).copy_(torch.where(in_ctx, slot(cpos), scratch_slots))


def decode_inputs(p: dict[str, torch.Tensor], greedy: torch.Tensor | None, scratch: int, block_size: int,
                  mask_token: int, window: int | None) -> None:
    """Derive a step's index tensors in place (advancing by `greedy` first when given): one launch on GPU."""
    w = -1 if window is None else window
    tables = p["tables"]
    if not use_triton(tables):
        decode_inputs_ref(p, greedy, scratch, block_size, mask_token, w)
        return
    bp, m = tables.shape
    q = p["tokens"].numel() // bp
    _decode_inputs_kernel[(bp,)](
        *(p[n] for n in ROW_INPUTS), greedy if greedy is not None else tables, *(p[n] for n in DERIVED),
        m, scratch, block_size, mask_token, w, q, CHAINED=greedy is not None, QP=triton.next_power_of_2(q))
