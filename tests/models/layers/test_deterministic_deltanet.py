"""--deterministic Gated DeltaNet mixer (models/layers/deterministic_deltanet.py): a token's output and the state
after it are the same bits whether the token is prefilled in one chunk, in chunks cut anywhere beside other
sequences, decoded alone on the CUDA-graph path, verified in a k+1 block (committed by replay or by checkpoint,
on either step description) or saved in a prefix-cache snapshot. bf16 activations, float32 and bf16 state pools.
The Triton kernels run under TRITON_INTERPRET=1 (and on a GPU), the per-token references otherwise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from blockspec.models.layers.attention import forward_context
from blockspec.models.layers.gated_deltanet import GatedDeltaNet
from blockspec.models.layers.recurrent_state import DecodeStateMetadata, LayerState, StateMetadata
from tests.tiny_hybrid import tiny_gated_deltanet

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
L = 20  # tokens of the sequence under test
SLOT = 2  # its slot pair (2, 3); other sequences use pairs (0, 1), (4, 5)


def tiny_layer(packed: bool) -> GatedDeltaNet:
    layer = tiny_gated_deltanet(packed, heads=4, hk=2, scale=0.5)
    layer = layer.to(DEVICE, torch.bfloat16)
    layer.deterministic = True
    return layer


def bind_state(layer: GatedDeltaNet, state_dtype: torch.dtype, checkpoints: int = 0) -> LayerState:
    layer.state = LayerState(8, layer.conv_dim, layer.conv_kernel - 1, layer.num_v_heads, layer.head_k_dim,
                             layer.head_v_dim, torch.bfloat16, state_dtype, torch.device(DEVICE), checkpoints,
                             checkpoint_rows=4, snapshots=4)
    return layer.state


def inputs(layer: GatedDeltaNet, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random projected rows (qkvz, ba) of n tokens, as the two input GEMMs would give them (the first rows the
    same for any n)."""
    qkvz = torch.randn(n, layer.in_proj_qkvz.weight.shape[0], generator=torch.Generator().manual_seed(seed))
    ba = torch.randn(n, layer.in_proj_ba.weight.shape[0], generator=torch.Generator().manual_seed(seed + 1000))
    return qkvz.to(DEVICE, torch.bfloat16), ba.to(DEVICE, torch.bfloat16)


SEQ = 11  # the seed of the sequence under test's tokens


def general(layer, parts: list[tuple], snapshots=None) -> list[torch.Tensor]:
    """One ragged step: parts of (qkvz, ba, slot, has_state, speculative); each part's mixer output."""
    lengths = [p[0].shape[0] for p in parts]
    starts = [sum(lengths[:i]) for i in range(len(parts))]
    meta = StateMetadata(starts=starts, lengths=lengths, slots=[p[2] for p in parts], has_state=[p[3] for p in parts],
                         speculative=[p[4] for p in parts], device=torch.device(DEVICE), snapshots=snapshots)
    with forward_context(SimpleNamespace(state=meta, state_decode=None)):
        out = layer.forward_deterministic(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
    return [out[s:s + n] for s, n in zip(starts, lengths)]


def uniform(layer, rows: list[tuple], q_len: int) -> tuple[torch.Tensor, DecodeStateMetadata]:
    """One CUDA-graph-path step: rows of (qkvz, ba, read slot), each q_len tokens, written into the pair partner."""
    read = torch.tensor([r[2] for r in rows], device=DEVICE)
    sd = DecodeStateMetadata(read, read ^ 1, q_len)
    with forward_context(SimpleNamespace(state=None, state_decode=sd)):
        out = layer.forward_deterministic(torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows]))
    return out, sd


def commit_uniform(sd: DecodeStateMetadata, counts: list[int]) -> None:
    for lyr, saved in sd.pending:
        lyr.commit_decode(sd, saved, torch.tensor(counts, device=DEVICE))


def whole_prefill(layer, state_dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The oracle: the sequence's L tokens as one prefill chunk -> (outputs, final conv window, final state)."""
    st = bind_state(layer, state_dtype)
    qkvz, ba = inputs(layer, L, SEQ)
    out = general(layer, [(qkvz, ba, SLOT, False, False)])[0]
    return out, st.conv[SLOT].clone(), st.ssm[SLOT].clone()


@pytest.fixture(params=[(False, torch.float32), (True, torch.bfloat16)], ids=["qwen3.5-f32state", "next-bf16state"])
def case(request):
    packed, state_dtype = request.param
    layer = tiny_layer(packed)
    with torch.inference_mode():
        want = whole_prefill(layer, state_dtype)
    return layer, state_dtype, want


@torch.inference_mode()
def test_chunked_prefill_beside_other_sequences(case):
    layer, state_dtype, (want, conv, ssm) = case
    st = bind_state(layer, state_dtype)
    qkvz, ba = inputs(layer, L, SEQ)
    other = inputs(layer, 9, 5)
    got = []
    for i, (a, e) in enumerate([(0, 7), (7, 8), (8, 20)]):
        parts = [(other[0][:3 * (i + 1)], other[1][:3 * (i + 1)], 0, False, False),
                 (qkvz[a:e], ba[a:e], SLOT, a > 0, False)]
        got.append(general(layer, parts[::-1] if i == 1 else parts)[0 if i == 1 else 1])
    assert torch.equal(torch.cat(got), want)
    assert torch.equal(st.conv[SLOT], conv) and torch.equal(st.ssm[SLOT], ssm)


@torch.inference_mode()
def test_decode_rows_one_token_at_a_time(case):
    layer, state_dtype, (want, conv, ssm) = case
    st = bind_state(layer, state_dtype)
    qkvz, ba = inputs(layer, L, SEQ)
    general(layer, [(qkvz[:6], ba[:6], SLOT, False, False)])
    others = [inputs(layer, L, 1), inputs(layer, L, 2)]
    slot = SLOT
    for t in range(6, L):
        rows = [(others[0][0][t:t + 1], others[0][1][t:t + 1], 0), (qkvz[t:t + 1], ba[t:t + 1], slot),
                (others[1][0][t:t + 1], others[1][1][t:t + 1], 4 + t % 2)]
        out, _ = uniform(layer, rows, 1)
        assert torch.equal(out[1:2], want[t:t + 1]), t
        slot ^= 1
    assert torch.equal(st.conv[slot], conv) and torch.equal(st.ssm[slot], ssm)


@pytest.mark.parametrize("rollback", ["replay", "checkpoint"])
@pytest.mark.parametrize("path", ["graphs", "ragged"])
@torch.inference_mode()
def test_verify_blocks_and_their_commits(case, rollback, path):
    """k+1 = 4-token blocks whose first `count` tokens are the sequence's next ones (the accepted drafts), beside
    another sequence's block: the kept outputs and, after each commit, the state match the one-chunk prefill."""
    layer, state_dtype, (want, conv, ssm) = case
    q = 4
    st = bind_state(layer, state_dtype, checkpoints=q if rollback == "checkpoint" else 0)
    qkvz, ba = inputs(layer, L + q, SEQ)  # the same first L rows as the oracle's, then drafts past them
    general(layer, [(qkvz[:5], ba[:5], SLOT, False, False)])
    other = inputs(layer, 4 * q, 3)
    general(layer, [(other[0][:2], other[1][:2], 0, False, False)])
    pos, slot, counts = 5, SLOT, [4, 1, 3, 2, 4, 1]
    for i, count in enumerate(counts):
        mine = (qkvz[pos:pos + q], ba[pos:pos + q])
        theirs = (other[0][i * 2:i * 2 + q], other[1][i * 2:i * 2 + q])
        if path == "graphs":
            out, sd = uniform(layer, [(*theirs, 0 if i % 2 == 0 else 1), (*mine, slot)], q)
            out = out[q:]
            commit_uniform(sd, [2, count])
            slot ^= 1
        else:
            out = general(layer, [(*mine, SLOT, True, True), (*theirs, 0, True, True)])[0]
            layer.commit([count, 2])
        assert torch.equal(out[:count], want[pos:pos + count]), i
        pos += count
    assert pos == L
    assert torch.equal(st.conv[slot], conv) and torch.equal(st.ssm[slot], ssm)


@torch.inference_mode()
def test_snapshots_hold_the_prefix_states(case):
    """A prefill that saves snapshots after tokens 5 and 13 (run in rounds cut there): the snapshots are the states
    of 5- and 13-token prefills, the outputs and final state those of the uncut chunk."""
    layer, state_dtype, (want, conv, ssm) = case
    qkvz, ba = inputs(layer, L, SEQ)
    prefix = {}
    for n in (5, 13):
        st = bind_state(layer, state_dtype)
        general(layer, [(qkvz[:n], ba[:n], SLOT, False, False)])
        prefix[n] = st.conv[SLOT].clone(), st.ssm[SLOT].clone()
    st = bind_state(layer, state_dtype)
    other = inputs(layer, 6, 4)
    out = general(layer, [(other[0], other[1], 0, False, False), (qkvz, ba, SLOT, False, False)],
                  snapshots=[[(4, 3)], [(5, 0), (13, 1)]])[1]
    assert torch.equal(out, want)
    assert torch.equal(st.conv[SLOT], conv) and torch.equal(st.ssm[SLOT], ssm)
    for n, entry in ((5, 0), (13, 1)):
        assert torch.equal(st.snap_conv[entry], prefix[n][0]) and torch.equal(st.snap_ssm[entry], prefix[n][1])
