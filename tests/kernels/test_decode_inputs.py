"""The decode-inputs kernel against a row-by-row definition, fresh and chained (advanced by acceptance)."""

from __future__ import annotations

import pytest
import torch

from blockspec.kernels._triton import kernel_device
from blockspec.kernels.decode_inputs import DERIVED, ROW_INPUTS, decode_inputs, decode_inputs_ref

DEVICE = kernel_device()
kernels = pytest.mark.skipif(DEVICE is None, reason="Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1)")

BS, SCRATCH, MASK = 4, 99, 7


def make_inputs(bp: int, q: int, m: int, live: int, seed: int) -> dict[str, torch.Tensor]:
    """`live` real rows (distinct blocks, long enough for anchor + 2q), the rest padding."""
    g = torch.Generator().manual_seed(seed)
    p = {n: torch.zeros(bp, dtype=torch.int64) for n in ROW_INPUTS[:-1]}
    p["tables"] = torch.full((bp, m), SCRATCH, dtype=torch.int64)
    p.update({n: torch.full((bp * q,) if n not in ("seq_lens", "kv_start", "draft_seq_lens", "draft_kv_start")
                            else (bp,), -5, dtype=torch.int64) for n in DERIVED})
    blocks = torch.randperm(SCRATCH, generator=g)
    for b in range(live):
        anchor = int(torch.randint(1, (m - 3) * BS - 2 * q, (1,), generator=g))
        n_blocks = -(-(anchor + 2 * q) // BS)
        p["tables"][b, :n_blocks] = blocks[b * m:b * m + n_blocks]
        count = int(torch.randint(0, min(q, anchor) + 1, (1,), generator=g))
        p["anchor"][b] = anchor
        p["token"][b] = int(torch.randint(0, 50, (1,), generator=g))
        p["ctx_pos0"][b] = anchor - count
        p["ctx_count"][b] = count
        p["ctx_row0"][b] = int(torch.randint(0, bp * q - count + 1, (1,), generator=g))
        p["num_drafts"][b] = int(torch.randint(0, q, (1,), generator=g))
        p["state_slot"][b] = 2 * b + int(torch.randint(0, 2, (1,), generator=g))
    return p


def expected_rows(p: dict[str, torch.Tensor], q: int, window: int) -> dict[str, list]:
    """Row by row, as the decode step defines them."""
    tables = p["tables"].tolist()
    out: dict[str, list] = {n: [] for n in DERIVED}
    for b, table in enumerate(tables):
        live = table[0] != SCRATCH
        anchor, token, nd = int(p["anchor"][b]), int(p["token"][b]), int(p["num_drafts"][b])
        pos0, count, row0 = int(p["ctx_pos0"][b]), int(p["ctx_count"][b]), int(p["ctx_row0"][b])

        def slot(pos: int, table=table) -> int:
            return table[pos // BS] * BS + pos % BS

        scratch = [SCRATCH * BS + i % BS for i in range(q)]
        out["tokens"] += [token] + [0] * (q - 1)
        out["positions"] += [anchor + i for i in range(q)]
        out["slots"] += [slot(anchor + i) if i <= nd else scratch[i] for i in range(q)]
        out["seq_lens"].append(anchor + q)
        out["kv_start"].append(0)
        out["draft_seq_lens"].append(anchor + nd + 1 if live else q)
        out["draft_kv_start"].append(max(0, anchor - window) if window >= 0 else 0)
        out["draft_tokens"] += [token] + [MASK] * (q - 1)
        out["ctx_rows"] += [row0 + i if i < count else 0 for i in range(q)]
        out["ctx_positions"] += [pos0 + i if i < count else 0 for i in range(q)]
        out["ctx_slots"] += [slot(pos0 + i) if i < count else scratch[i] for i in range(q)]
    return out


@pytest.mark.parametrize("q,window", [(1, -1), (4, -1), (16, 9)])
def test_reference_matches_row_definition(q, window):
    p = make_inputs(bp=8, q=q, m=12, live=5, seed=q)
    decode_inputs_ref(p, None, SCRATCH, BS, MASK, window)
    want = expected_rows(p, q, window)
    for name in DERIVED:
        assert p[name].tolist() == want[name], name


@pytest.mark.parametrize("q", [1, 5, 16])
def test_chained_reference_advances_each_live_row(q):
    """After a verify pass that accepted a_b drafts, row b continues from anchor + a_b + 1 with the bonus
    token as anchor, and hands positions anchor..anchor + a_b (rows b*q..) to the drafter."""
    bp, m = 8, 14
    p = make_inputs(bp, q, m, live=6, seed=10 + q)
    g = torch.Generator().manual_seed(q)
    greedy = torch.randint(0, 50, (bp, q + 1), generator=g)
    greedy[:, 0] = torch.randint(0, q, (bp,), generator=g)
    p["tables"][2] = SCRATCH  # a row whose sequence left the batch
    before = {n: p[n].clone() for n in ROW_INPUTS}
    decode_inputs_ref(p, greedy, SCRATCH, BS, MASK, -1)
    for b in range(bp):
        live = b < 6 and b != 2
        a = int(greedy[b, 0])
        if live:
            assert int(p["anchor"][b]) == int(before["anchor"][b]) + a + 1
            assert int(p["token"][b]) == int(greedy[b, 1 + a])
            assert (int(p["ctx_pos0"][b]), int(p["ctx_count"][b]), int(p["ctx_row0"][b])) == \
                (int(before["anchor"][b]), a + 1, b * q)
        else:
            assert all(int(p[n][b]) == 0 for n in ROW_INPUTS[:5])
        # every row moves to the slot the previous step committed into (padding stays in its pair)
        assert int(p["state_slot"][b]) == int(before["state_slot"][b]) ^ 1
    want = expected_rows(p, q, -1)
    for name in DERIVED:
        assert p[name].tolist() == want[name], name


@kernels
@pytest.mark.parametrize("q,window,chained", [(1, -1, False), (1, -1, True), (16, -1, False), (16, 9, True),
                                              (6, -1, True)])
def test_kernel_matches_reference(q, window, chained):
    bp, m = 8, 14
    p = make_inputs(bp, q, m, live=6, seed=q + 3)
    greedy = None
    if chained:
        g = torch.Generator().manual_seed(1)
        greedy = torch.randint(0, 50, (bp, q + 1), generator=g)
        greedy[:, 0] = torch.randint(0, q, (bp,), generator=g)
    ref = {n: t.clone() for n, t in p.items()}
    decode_inputs_ref(ref, greedy, SCRATCH, BS, MASK, window)
    dev = {n: t.to(DEVICE) for n, t in p.items()}
    decode_inputs(dev, None if greedy is None else greedy.to(DEVICE), SCRATCH, BS, MASK,
                  None if window < 0 else window)
    for name, t in ref.items():
        assert dev[name].cpu().tolist() == t.tolist(), name
