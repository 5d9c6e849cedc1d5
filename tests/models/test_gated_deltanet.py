"""The gated delta rule reference: chunked == recurrent == transformers' torch implementation; the
span-aware causal convolution; and, on a GPU with fla-core, fla's kernels against the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from blockspec.models.layers import delta_rule, delta_rule_fla


def _inputs(t: int, hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 24, seed: int = 0, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, hk, dk, generator=gen), torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, generator=gen) * 2
    beta = torch.rand(t, hv, generator=gen)
    s0 = torch.randn(hv, dk, dv, generator=gen) * 0.1
    return [x.to(device) for x in (q, k, v, g, beta, s0)]


@pytest.mark.parametrize("t", [1, 15, 64, 150])
def test_chunked_equals_recurrent_and_transformers(t):
    q, k, v, g, beta, s0 = _inputs(t)
    qp, kp = delta_rule.prepare_qk(q, k, v.shape[1])
    o_rec, s_rec, states = delta_rule.recurrent(qp, kp, v, g, beta, s0, keep_states=True)
    o_chk, s_chk = delta_rule.chunked(qp, kp, v, g, beta, s0)
    torch.testing.assert_close(o_chk, o_rec, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_chk, s_rec, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[-1], s_rec)
    rep = v.shape[1] // q.shape[1]
    # q and k normalized here as transformers' l2norm does: with fla-core installed its in-kernel norm calls
    # fla's Triton kernel, which cannot read these CPU tensors
    qn, kn = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    o_hf, s_hf = torch_chunk_gated_delta_rule(qn.repeat_interleave(rep, 1)[None], kn.repeat_interleave(rep, 1)[None],
                                              v[None], g[None], beta[None], initial_state=s0[None],
                                              output_final_state=True, use_qk_l2norm_in_kernel=False)
    torch.testing.assert_close(o_chk, o_hf[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_chk, s_hf[0], rtol=1e-5, atol=1e-5)


def test_state_after_each_token_is_the_prefix_state():
    q, k, v, g, beta, s0 = _inputs(9)
    qp, kp = delta_rule.prepare_qk(q, k, 4)
    _, _, states = delta_rule.recurrent(qp, kp, v, g, beta, s0, keep_states=True)
    for n in (1, 4, 9):
        _, s_n, _ = delta_rule.recurrent(qp[:n], kp[:n], v[:n], g[:n], beta[:n], s0)
        assert torch.equal(states[n - 1], s_n)  # replaying a prefix gives the very same bits


@pytest.mark.skipif(not (torch.cuda.is_available() and delta_rule_fla.available()), reason="needs a GPU and fla-core")
def test_fla_kernels_match_the_reference():
    lengths = [1, 16, 100]
    parts = [_inputs(n, seed=i, device="cuda") for i, n in enumerate(lengths)]
    q, k, v, g, beta = (torch.cat([p[i] for p in parts]) for i in range(5))
    s0 = torch.stack([p[5] for p in parts])
    cu = torch.tensor([0, 1, 17, 117], device="cuda")
    o, final = delta_rule_fla.run(q, k, v, g, beta, s0, cu, max(lengths))
    for i, (n, start) in enumerate(zip(lengths, (0, 1, 17))):
        qp, kp = delta_rule.prepare_qk(q[start:start + n], k[start:start + n], 4)
        want, s_n, _ = delta_rule.recurrent(qp, kp, v[start:start + n], g[start:start + n], beta[start:start + n],
                                            s0[i])
        torch.testing.assert_close(o[start:start + n].float(), want, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(final[i], s_n, rtol=2e-3, atol=2e-3)
    index, cu_p, owner = (torch.tensor(x, device="cuda") for x in delta_rule_fla.prefix_layout([16]))
    states = delta_rule_fla.prefix_states(k[1:17], v[1:17], g[1:17], beta[1:17], s0[1:2], index, cu_p, owner)
    qp, kp = delta_rule.prepare_qk(q[1:17], k[1:17], 4)
    _, _, want = delta_rule.recurrent(qp, kp, v[1:17], g[1:17], beta[1:17], s0[1], keep_states=True)
    torch.testing.assert_close(states, want, rtol=2e-3, atol=2e-3)


def test_span_conv_matches_conv1d():
    """The gather-based conv of GatedDeltaNet over two spans (one continuing from a saved window)."""
    from blockspec.models.layers.gated_deltanet import _windows
    from blockspec.models.layers.recurrent_state import StateMetadata

    c, kernel = 6, 4
    width = kernel - 1
    gen = torch.Generator().manual_seed(0)
    history, x = torch.randn(width, c, generator=gen), torch.randn(12, c, generator=gen)
    weight = torch.randn(c, kernel, generator=gen)
    meta = StateMetadata(starts=[0, 5], lengths=[5, 7], slots=[0, 1], has_state=[False, True],
                         speculative=[False, False], device=torch.device("cpu"))
    rows, bases = meta.conv_layout(width)
    prev = torch.stack([torch.zeros(width, c), history])
    buffer = torch.cat([prev.reshape(-1, c), x])[torch.tensor(rows)]
    win = torch.tensor(_windows(meta, bases, width))
    got = sum(buffer[win[:, j]] * weight[:, j] for j in range(kernel))
    ref0 = F.conv1d(x[:5].t()[None], weight[:, None], padding=width, groups=c)[0, :, :5].t()
    ref1 = F.conv1d(torch.cat([history, x[5:]]).t()[None], weight[:, None], groups=c)[0].t()
    torch.testing.assert_close(got, torch.cat([ref0, ref1]))
