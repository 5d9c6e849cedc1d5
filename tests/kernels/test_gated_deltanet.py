"""Gated DeltaNet decode/verify kernels: the references against a hand-written definition and against the
eager GatedDeltaNet layer (bit for bit on CPU float32), and the Triton kernels against the references (on a
GPU, or on CPU under TRITON_INTERPRET=1, with grids kept small: the interpreter runs each program in Python).
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from blockspec.kernels import gated_deltanet as gdn
from blockspec.kernels._triton import kernel_device
from blockspec.kernels.gated_deltanet import (
    causal_conv_update,
    causal_conv_update_ref,
    gated_rms_norm,
    gated_rms_norm_ref,
    gdn_recurrent,
    gdn_recurrent_ref,
)
from tests.tiny_hybrid import tiny_gated_deltanet

DEVICE = kernel_device()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
kernel = pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU, or Triton with TRITON_INTERPRET=1")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def make_inputs(n: int, length: int, hk: int, heads: int, dk: int, dv: int, slots: int,
                dtype: torch.dtype = torch.float32,
                device: str = "cpu", seed: int = 0) -> dict:
    """Raw layer-like inputs: q/k at the scale of SiLU outputs, a/b as projections, a decaying but non-trivial gate."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0, offset: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale + offset).to(dtype=dtype, device=device)

    return dict(
        q=rand(n, length, hk, dk), k=rand(n, length, hk, dk), v=rand(n, length, heads, dv),
        a=rand(n, length, heads), b=rand(n, length, heads, scale=2.0),
        A_log=(torch.rand(heads, generator=g) * 2).to(dtype=dtype, device=device),
        dt_bias=rand(heads, scale=0.5),
        ssm=(torch.randn(slots, heads, dk, dv, generator=g) * 0.3).to(device),
    )


# ---- references -----------------------------------------------------------------------------------------------


def by_hand(q, k, v, a, b, A_log, dt_bias, ssm, read_slots, counts=None):
    """The recurrence written out per row, head and token (matrix form, float64), as the brief defines it."""
    n_rows, length, hk, dk = k.shape
    heads = v.shape[2]
    out = torch.zeros(v.shape, dtype=torch.float64)
    states = torch.zeros(n_rows, length, heads, dk, v.shape[3], dtype=torch.float64)
    finals = []
    for n in range(n_rows):
        c = length if counts is None else int(counts[n])
        s_all = ssm[read_slots[n]].double().clone()
        for h in range(heads):
            kh = h // (heads // hk)
            s = s_all[h]
            for t in range(c):
                qv, kv_ = q[n, t, kh].double(), k[n, t, kh].double()
                qn = qv / math.sqrt(float(qv @ qv) + 1e-6) / math.sqrt(dk)
                kn = kv_ / math.sqrt(float(kv_ @ kv_) + 1e-6)
                beta = float(torch.sigmoid(b[n, t, h]))  # in b's dtype, as the layer
                x = float(a[n, t, h]) + float(dt_bias[h])
                g = -math.exp(float(A_log[h])) * (x if x > 20 else math.log1p(math.exp(x)))
                s = s * math.exp(g)
                s = s + torch.outer(kn, (v[n, t, h].double() - s.T @ kn) * beta)
                out[n, t, h] = s.T @ qn
                states[n, t, h] = s
            s_all[h] = s
        finals.append(s_all)
    return out, torch.stack(finals), states


@pytest.mark.parametrize("heads,hk", [(4, 2), (6, 2)])
def test_reference_matches_hand_definition(heads, hk):
    inp = make_inputs(3, 5, hk, heads, 8, 12, slots=4)
    read, write, counts = torch.tensor([2, 0, 3]), torch.tensor([1, 0, 2]), torch.tensor([5, 1, 3])
    want_o, want_final, want_states = by_hand(**inp, read_slots=read)
    ssm = inp.pop("ssm")
    pool, ckpt = ssm.clone(), torch.zeros(3, 5, heads, 8, 12)
    o = gdn_recurrent_ref(**inp, ssm=pool, read_slots=read, write_slots=write, checkpoints=ckpt)
    torch.testing.assert_close(o.double(), want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[write].double(), want_final, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ckpt.double(), want_states, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool[3], ssm[3])  # slots nobody writes stay
    # commit: only the first counts[n] tokens, outputs past them are zero, the row's own slot rewritten
    want_o, want_final, _ = by_hand(**inp, ssm=ssm, read_slots=read, counts=counts)
    pool = ssm.clone()
    o = gdn_recurrent_ref(**inp, ssm=pool, read_slots=read, counts=counts, write_slots=read)
    torch.testing.assert_close(o.double(), want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[read].double(), want_final, rtol=1e-5, atol=1e-5)
    assert gdn_recurrent_ref(**{**inp, "q": None}, ssm=pool, read_slots=read, compute_output=False) is None


def test_reference_counts_zero_keeps_the_state():
    inp = make_inputs(2, 3, 1, 2, 8, 8, slots=2)
    ssm = inp.pop("ssm")
    pool = ssm.clone()
    gdn_recurrent_ref(**inp, ssm=pool, read_slots=torch.tensor([0, 1]), counts=torch.tensor([0, 0]),
                      write_slots=torch.tensor([1, 0]), compute_output=False)
    assert torch.equal(pool, ssm.flip(0))  # each row wrote the other's (untouched) state: reads came first


def test_conv_reference_matches_conv1d():
    n, length, c, width = 3, 5, 12, 3
    g = torch.Generator().manual_seed(0)
    x, pool, weight = torch.randn(n, length, c, generator=g), torch.randn(4, width, c, generator=g), \
        torch.randn(c, width + 1, generator=g)
    read, counts = torch.tensor([3, 1, 1]), torch.tensor([5, 1, 2])
    y = causal_conv_update_ref(x, pool.clone(), read, weight)
    for i in range(n):
        buf = torch.cat([pool[read[i]], x[i]]).t()[None]  # [1, C, W + L]
        want = F.silu(F.conv1d(buf, weight[:, None, :], groups=c)[0].t())
        torch.testing.assert_close(y[i], want, rtol=1e-5, atol=1e-6)
    # commit windows: the last W inputs after counts[n] tokens; rows 1 and 2 share a read slot, row 0 aliases
    new = pool.clone()
    causal_conv_update_ref(x, new, read, weight, counts=counts, write_slots=torch.tensor([3, 0, 2]),
                           compute_output=False)
    for i, slot in enumerate((3, 0, 2)):
        buf = torch.cat([pool[read[i]], x[i]])
        assert torch.equal(new[slot], buf[counts[i]:counts[i] + width])
    assert torch.equal(new[1], pool[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_norm_reference_is_the_module(dtype):
    from blockspec.models.layers.gated_deltanet import GatedRMSNorm

    norm = GatedRMSNorm(16, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16) + 0.5)
    o, z = torch.randn(5, 3, 16), torch.randn(5, 3, 16).to(dtype)
    with torch.no_grad():
        assert torch.equal(gated_rms_norm_ref(o, z, norm.weight, 1e-6), norm(o.to(dtype), z))


def _eager_step(layer, x, slots: list[int], length: int, speculative: bool):
    from blockspec.models.layers.attention import forward_context
    from blockspec.models.layers.recurrent_state import StateMetadata

    meta = StateMetadata(starts=[i * length for i in range(len(slots))], lengths=[length] * len(slots), slots=slots,
                         has_state=[True] * len(slots), speculative=[speculative] * len(slots),
                         device=torch.device("cpu"))
    with forward_context(SimpleNamespace(state=meta)):
        return layer(x)


def _kernel_step(layer, x, conv, ssm, read, length, *, write=None, counts=None, checkpoints=None, output=True):
    """The layer's step composed from the three references (what the decode graphs will call)."""
    t = x.shape[0]
    n = t // length
    mixed, z, b, a = layer._project(x)
    y = causal_conv_update_ref(mixed.view(n, length, -1), conv, read, layer.conv1d.weight[:, 0, :], counts=counts,
                               write_slots=write)
    q, k, v = y.split([layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    hk, heads, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    o = gdn_recurrent_ref(q.reshape(n, length, hk, dk), k.reshape(n, length, hk, dk), v.reshape(n, length, heads, dv),
                          a.view(n, length, heads), b.view(n, length, heads), layer.A_log, layer.dt_bias, ssm, read,
                          counts=counts, write_slots=write, checkpoints=checkpoints, compute_output=output)
    if not output:
        return None
    return layer.out_proj(gated_rms_norm_ref(o.view(t, heads, dv), z, layer.norm.weight, layer.norm.eps).reshape(t, -1))


@pytest.mark.parametrize("packed", [False, True], ids=["qwen3.5", "qwen3-next"])
@pytest.mark.parametrize("length", [1, 4])
def test_references_reproduce_the_eager_layer_bit_for_bit(packed, length, monkeypatch):
    """A non-speculative step (state written) through the eager layer and through the references: same bits."""
    from blockspec.models.layers.recurrent_state import LayerState

    monkeypatch.setenv("BLOCKSPEC_GDN_BACKEND", "reference")
    layer = tiny_gated_deltanet(packed)
    st = LayerState(5, layer.conv_dim, 3, 6, 16, 16, torch.float32, torch.float32, torch.device("cpu"), checkpoints=0)
    st.conv.normal_()
    st.ssm.normal_(std=0.3)
    conv0, ssm0 = st.conv.clone(), st.ssm.clone()
    layer.state = st
    slots = [3, 0, 2]
    x = torch.randn(len(slots) * length, 32)
    with torch.no_grad():
        want = _eager_step(layer, x, slots, length, speculative=False)
        read = torch.tensor(slots)
        got = _kernel_step(layer, x, conv0, ssm0, read, length, write=read)
    assert torch.equal(got, want)
    assert torch.equal(conv0, st.conv) and torch.equal(ssm0, st.ssm)


@pytest.mark.parametrize("keep", [False, True], ids=["replay", "checkpoints"])
def test_references_reproduce_verify_and_commit(keep, monkeypatch):
    """A speculative verify block, then commit of counts tokens: outputs, checkpoints and committed states."""
    from blockspec.models.layers.recurrent_state import LayerState

    monkeypatch.setenv("BLOCKSPEC_GDN_BACKEND", "reference")
    length, slots, counts = 5, [1, 4, 2], [5, 1, 3]
    layer = tiny_gated_deltanet(packed=False, heads=4, hk=2)
    st = LayerState(5, layer.conv_dim, 3, 4, 16, 16, torch.float32, torch.float32, torch.device("cpu"),
                    checkpoints=length if keep else 0)
    st.conv.normal_()
    st.ssm.normal_(std=0.3)
    conv0, ssm0 = st.conv.clone(), st.ssm.clone()
    layer.state = st
    x = torch.randn(len(slots) * length, 32)
    read, cnt = torch.tensor(slots), torch.tensor(counts)
    with torch.no_grad():
        want = _eager_step(layer, x, slots, length, speculative=True)
        ckpt = torch.zeros(len(slots), length, 4, 16, 16) if keep else None
        got = _kernel_step(layer, x, conv0, ssm0, read, length, checkpoints=ckpt)
        assert torch.equal(got, want)
        assert torch.equal(conv0, st.conv) and torch.equal(ssm0, st.ssm)  # verify writes nothing
        if keep:  # the layer keeps checkpoints per row of the step
            assert torch.equal(ckpt, st.checkpoints[:len(slots)])
        layer.commit(counts)
        _kernel_step(layer, x, conv0, ssm0, read, length, write=read, counts=cnt, output=False)
    assert torch.equal(conv0, st.conv) and torch.equal(ssm0, st.ssm)


def test_cpu_dispatch_is_the_reference():
    if INTERPRET:
        pytest.skip("the interpreter sends CPU tensors to the kernels")
    inp = make_inputs(2, 3, 1, 2, 8, 8, slots=2)
    p1, p2 = inp["ssm"].clone(), inp["ssm"].clone()
    read = torch.tensor([1, 0])
    with torch.no_grad():
        o1 = gdn_recurrent(**{**inp, "ssm": p1}, read_slots=read, write_slots=read)
        o2 = gdn_recurrent_ref(**{**inp, "ssm": p2}, read_slots=read, write_slots=read)
    assert torch.equal(o1, o2) and torch.equal(p1, p2)


@pytest.mark.parametrize("n,heads,length", [(1, 48, 1), (1, 48, 16), (1, 32, 16), (4, 32, 1), (16, 48, 16)])
def test_launch_config(n, heads, length):
    block_v, warps = gdn._launch_config(n, heads, 128, 128, length)
    assert block_v & (block_v - 1) == 0 and 1 <= warps <= 8 and 128 % block_v == 0
    assert 128 * block_v // (32 * warps) <= 64  # state elements per thread: no spills (ptxas, sm_90)


# ---- kernels against the references ---------------------------------------------------------------------------


@pytest.fixture
def launch(monkeypatch):
    """Under the interpreter: bf16 rounding as on the GPU, and one program per head (the interpreter runs
    programs one by one in Python); on a GPU the real launch heuristic."""
    if INTERPRET:
        from tests.kernels.test_skinny_linear import _interpreter_like_gpu

        _interpreter_like_gpu(monkeypatch)
        monkeypatch.setattr(gdn, "_launch_config", lambda n, h, dk, dv, length: (gdn._pow2(dv), 1))
    return DEVICE


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


def _chunk_tol(dtype: torch.dtype) -> float:
    """The chunk kernel against the recurrence: float32 models take IEEE dots, bf16 ones TF32 (`_chunk_dot`)."""
    return 1e-5 if dtype == torch.float32 or INTERPRET else 5e-3


def _run_both(inp: dict, read, **kw):
    """The public entry point (kernel) and the reference, each on its own copy of the pools."""
    pool_k, pool_r = inp["ssm"].clone(), inp["ssm"].clone()
    ck_k = kw.pop("checkpoints", None)
    ck_r = ck_k.clone() if ck_k is not None else None
    with torch.no_grad():
        ok = gdn_recurrent(**{**inp, "ssm": pool_k}, read_slots=read, checkpoints=ck_k, **kw)
        orf = gdn_recurrent_ref(**{**inp, "ssm": pool_r}, read_slots=read, checkpoints=ck_r, **kw)
    return (ok, pool_k, ck_k), (orf, pool_r, ck_r)


@kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,hk", [(4, 2), (6, 2)], ids=["gqa2", "gqa3"])
def test_kernel_decode_writes_state(launch, heads, hk, dtype):
    inp = make_inputs(3, 1, hk, heads, 16, 32, slots=5, dtype=dtype, device=launch)
    read = torch.tensor([4, 1, 2], device=launch)
    write = torch.tensor([0, 1, 3], device=launch)  # row 1 writes the slot it read
    (ok, pk, _), (orf, pr, _) = _run_both(inp, read, write_slots=write)
    assert ok.shape == (3, 1, heads, 32) and ok.dtype == torch.float32
    assert rel_err(ok, orf) < _tol(dtype)
    assert rel_err(pk, pr) < _tol(dtype) / 10
    assert torch.equal(pk[[2, 4]], inp["ssm"][[2, 4]])  # read-only slots untouched


@kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_verify_block_outputs_and_checkpoints(launch, dtype):
    n = 2 if dtype == torch.float32 else 1
    inp = make_inputs(n, 16, 1, 3, 16, 16, slots=3, dtype=dtype, device=launch, seed=1)
    read = torch.tensor([2, 0][:n], device=launch)
    ckpt = torch.zeros(n, 16, 3, 16, 16, device=launch)
    (ok, pk, ck_k), (orf, pr, ck_r) = _run_both(inp, read, checkpoints=ckpt)
    assert rel_err(ok, orf) < _tol(dtype)
    assert rel_err(ck_k, ck_r) < _tol(dtype) / 10
    assert torch.equal(pk, inp["ssm"])  # no write_slots: the pool is left alone
    with torch.no_grad():  # the same block without checkpoints (the chunk kernel): the same outputs
        assert rel_err(gdn_recurrent(**inp, read_slots=read), ok) < _chunk_tol(dtype)


@kernel
def test_kernel_commit_reproduces_verify_states(launch, monkeypatch):
    """Verify (checkpoints) then commit with counts 1, L and in between on the recurrent kernel, each row writing
    the slot it read: the committed states are the verify pass's checkpoints bit for bit, and match the
    reference (the engine commits from checkpoints, or recomputes on the kernel its verify blocks take)."""
    monkeypatch.setattr(gdn, "_chunked", lambda *args, **kwargs: False)
    length = 6
    inp = make_inputs(3, length, 2, 4, 16, 16, slots=4, device=launch, seed=2)
    read = torch.tensor([3, 0, 1], device=launch)
    counts = torch.tensor([1, length, 4], device=launch)
    ckpt = torch.zeros(3, length, 4, 16, 16, device=launch)
    with torch.no_grad():
        o = gdn_recurrent(**inp, read_slots=read, checkpoints=ckpt)
        pool = inp["ssm"].clone()
        none = gdn_recurrent(**{**inp, "q": None, "ssm": pool}, read_slots=read, counts=counts, write_slots=read,
                             compute_output=False)
    assert none is None
    for i in range(3):
        assert torch.equal(pool[read[i]], ckpt[i, counts[i] - 1])
    assert torch.equal(pool[2], inp["ssm"][2])
    (ok, pk, _), (orf, pr, _) = _run_both(inp, read, counts=counts, write_slots=read)
    assert torch.equal(pk, pool)  # with outputs on: the same states
    assert rel_err(pk, pr) < 1e-6 and rel_err(ok, orf) < 1e-5
    for i in range(3):  # outputs: as the verify pass up to the count, zero past it
        c = int(counts[i])
        assert torch.equal(ok[i, :c], o[i, :c]) and not ok[i, c:].any()


@kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("length", [2, 7, 16, 17, 32])
def test_kernel_chunk_verify_and_commit(launch, length, dtype):
    """Verify blocks of 2-32 tokens take the chunk kernel: outputs and committed states (counts 0, 1, L and in
    between; rows reading one slot and writing another, or their own) match the reference, a commit's outputs
    are its verify pass's up to the count and zero past it, and the state after every token (checkpoints, on
    the recurrent kernel) agrees with what the chunk kernel commits at that count."""
    assert gdn._chunked(length, None) and not gdn._chunked(length, torch.empty(0)) and not gdn._chunked(1, None)
    assert not gdn._chunked(length, None, dk=8)  # narrower heads than a dot's side: the recurrent kernel
    inp = make_inputs(4, length, 2, 4, 16, 32, slots=6, dtype=dtype, device=launch, seed=length)
    read = torch.tensor([3, 0, 1, 5], device=launch)
    write = torch.tensor([2, 0, 4, 5], device=launch)
    counts = torch.tensor([0, 1, length, (length + 1) // 2], device=launch)
    (ok, pk, _), (orf, pr, _) = _run_both(inp, read, counts=counts, write_slots=write)
    assert rel_err(ok, orf) < _tol(dtype) and rel_err(pk, pr) < _chunk_tol(dtype)
    with torch.no_grad():
        o = gdn_recurrent(**inp, read_slots=read)
        ckpt = torch.zeros(4, length, 4, 16, 32, device=launch)
        gdn_recurrent(**inp, read_slots=read, checkpoints=ckpt)
    for i in range(4):
        c = int(counts[i])
        assert torch.equal(ok[i, :c], o[i, :c]) and not ok[i, c:].any()
        want = inp["ssm"][read[i]] if c == 0 else ckpt[i, c - 1]
        assert rel_err(pk[write[i]], want) < _chunk_tol(dtype)
    assert torch.equal(pk[1], inp["ssm"][1])  # read, not written


def test_chunk_launch_config_and_norm_fold():
    """Value blocks: the narrowest whose programs fit one wave of the 132 SMs, else whole heads; the verify
    block's norm folds in exactly where whole heads run (the fused norm needs a head in one program)."""
    assert gdn._chunk_launch_config(1, 32, 128) == (32, 4)  # Qwen3.5-4B / 35B-A3B: 128 programs
    assert gdn._chunk_launch_config(1, 48, 128) == (64, 4)  # Qwen3.6-27B: 96 programs
    assert gdn._chunk_launch_config(16, 32, 128) == (128, 4)
    assert gdn._chunk_launch_config(1, 4, 16) == (16, 4)  # narrower heads than any block
    assert not gdn.verify_fuses_norm(1, 16, 32, 128) and gdn.verify_fuses_norm(4, 16, 32, 128)
    assert not gdn.verify_fuses_norm(4, 1, 32, 128)  # decode rows: the recurrent kernel
    assert gdn._chunk_dot(torch.float32) == "ieee" and gdn._chunk_dot(torch.bfloat16) == "tf32"


@kernel
def test_kernel_padding_rows_use_a_scratch_slot(launch):
    """Rows past the live batch read and write one scratch slot (the bucket's padding): live rows unaffected."""
    inp = make_inputs(4, 2, 1, 2, 16, 16, slots=4, device=launch, seed=3)
    scratch = 3
    read = torch.tensor([1, 0, scratch, scratch], device=launch)
    (ok, pk, _), (orf, pr, _) = _run_both(inp, read, write_slots=read)
    assert rel_err(ok[:2], orf[:2]) < 1e-5 and rel_err(pk[:2], pr[:2]) < 1e-6
    assert torch.equal(pk[2], inp["ssm"][2]) and torch.isfinite(pk[scratch]).all()


@kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_strided_inputs_from_the_conv_output(launch, dtype):
    """q, k, v as views of one [N, L, 2*Hk*Dk + H*Dv] conv output, a/b as views of one [N, L, 2H] tensor."""
    n, length, hk, heads, dk, dv = 2, 3, 1, 2, 16, 16
    inp = make_inputs(n, length, hk, heads, dk, dv, slots=2, dtype=dtype, device=launch, seed=4)
    mixed = torch.cat([inp["q"].flatten(2), inp["k"].flatten(2), inp["v"].flatten(2)], dim=-1)
    ba = torch.cat([inp["b"], inp["a"]], dim=-1)
    q, k, v = mixed.split([hk * dk, hk * dk, heads * dv], dim=-1)
    views = dict(q=q.view(n, length, hk, dk), k=k.view(n, length, hk, dk), v=v.view(n, length, heads, dv),
                 b=ba[..., :heads], a=ba[..., heads:])
    assert not views["q"].is_contiguous() and not views["a"].is_contiguous()
    read = torch.tensor([1, 0], device=launch)
    (o_views, p_views, _), _ = _run_both({**inp, **views}, read, write_slots=read)
    (o_plain, p_plain, _), _ = _run_both(inp, read, write_slots=read)
    assert rel_err(o_views, o_plain) < 1e-6 and rel_err(p_views, p_plain) < 1e-6


@kernel
@pytest.mark.parametrize("block_v,warps", [(4, 1), (8, 1), (8, 2)])
def test_kernel_launch_configs(launch, block_v, warps):
    """The narrow tiles of the real heuristic (and the benchmark's sweep), on a small grid."""
    inp = make_inputs(1, 3, 1, 2, 16, 16, slots=2, device=launch, seed=5)
    read, counts = torch.tensor([1], device=launch), torch.tensor([2], device=launch)
    pool = inp["ssm"].clone()
    ckpt = torch.zeros(1, 3, 2, 16, 16, device=launch)
    with torch.no_grad():
        o = gdn._gdn_recurrent_triton(*(inp[x] for x in ("q", "k", "v", "a", "b", "A_log", "dt_bias")), pool, read,
                                      None, None, ckpt, True, None, None, 1e-6, block_v=block_v, num_warps=warps)
        gdn._gdn_recurrent_triton(*(inp[x] for x in ("q", "k", "v", "a", "b", "A_log", "dt_bias")), pool, read,
                                  counts, read, None, False, None, None, 1e-6, block_v=block_v, num_warps=warps,
                                  chunk=False)
    want, _, ck_want = _run_both(inp, read, checkpoints=torch.zeros_like(ckpt))[1]
    assert rel_err(o, want) < 1e-5 and rel_err(ckpt, ck_want) < 1e-6
    assert torch.equal(pool[1], ckpt[0, 1])


@kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("length", [1, 4])
def test_kernel_fused_gated_norm(launch, length, dtype):
    inp = make_inputs(2, length, 1, 3, 16, 16, slots=2, dtype=dtype, device=launch, seed=6)
    g = torch.Generator().manual_seed(7)
    z = torch.randn(2, length, 3, 16, generator=g).to(dtype=dtype, device=launch)
    nw = (torch.rand(16, generator=g) + 0.5).to(dtype=dtype, device=launch)
    read = torch.tensor([0, 1], device=launch)
    (ok, pk, _), (orf, pr, _) = _run_both(inp, read, write_slots=read, z=z, norm_weight=nw, eps=1e-6)
    assert ok.dtype == dtype and ok.shape == (2, length, 3, 16)
    assert rel_err(ok, orf) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert rel_err(pk, pr) < (1e-5 if length == 1 else _chunk_tol(dtype))  # 4 tokens: the chunk kernel


@kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("length", [1, 16])
def test_kernel_conv_update(launch, length, dtype):
    n, c, width = 3, 200, 3  # C not a multiple of the channel block
    g = torch.Generator().manual_seed(length)
    x = torch.randn(n, length, c, generator=g).to(dtype=dtype, device=launch)
    pool = torch.randn(4, width, c, generator=g).to(dtype=dtype, device=launch)
    weight = (torch.randn(c, width + 1, generator=g) * 0.5).to(dtype=dtype, device=launch)
    read = torch.tensor([3, 0, 3], device=launch)
    write = torch.tensor([2, 0, 1], device=launch)  # row 1 aliases its read slot
    with torch.no_grad():
        for counts in (None, torch.tensor([1, length, min(2, length)], device=launch),
                       torch.tensor([0, 1, length], device=launch)):
            pk, pr = pool.clone(), pool.clone()
            yk = causal_conv_update(x, pk, read, weight, counts=counts, write_slots=write)
            yr = causal_conv_update_ref(x, pr, read, weight, counts=counts, write_slots=write)
            assert yk.dtype == dtype and rel_err(yk, yr) < (1e-6 if dtype == torch.float32 else 1e-2)
            assert torch.equal(pk, pr)  # the window is a copy: exact
        # verify (no write) and commit (no output)
        pk = pool.clone()
        assert rel_err(causal_conv_update(x, pk, read, weight), yr) < (1e-6 if dtype == torch.float32 else 1e-2)
        assert torch.equal(pk, pool)
        assert causal_conv_update(x, pk, read, weight, counts=counts, write_slots=write, compute_output=False) is None
        assert torch.equal(pk, pr)


@kernel
@pytest.mark.parametrize("o_dtype,z_dtype,w_dtype", [(torch.float32, torch.float32, torch.float32),
                                                     (torch.float32, torch.bfloat16, torch.bfloat16),
                                                     (torch.bfloat16, torch.bfloat16, torch.bfloat16),
                                                     (torch.float32, torch.bfloat16, torch.float32)])
def test_kernel_gated_rms_norm(launch, o_dtype, z_dtype, w_dtype):
    g = torch.Generator().manual_seed(0)
    o = (torch.randn(5, 6, 48, generator=g) * 3).to(dtype=o_dtype, device=launch)
    z = torch.randn(5, 6, 48, generator=g).to(dtype=z_dtype, device=launch)
    w = (torch.rand(48, generator=g) + 0.5).to(dtype=w_dtype, device=launch)
    with torch.no_grad():
        got, want = gated_rms_norm(o, z, w, 1e-6), gated_rms_norm_ref(o, z, w, 1e-6)
    assert got.dtype == z_dtype and got.shape == want.shape
    assert rel_err(got, want) < (1e-6 if z_dtype == torch.float32 else 1e-2)
