"""Prefix-cache state snapshots of a Gated DeltaNet hybrid (tiny Qwen3.5, fp32, CPU).

A prefill pass that saves snapshots inside its span must save exactly the state a pass ending there
would leave in the slot, and change nothing else; a sequence whose slot is loaded from a snapshot and
whose block table starts on the cached blocks continues with the one-shot pass's logits. Both delta-rule
paths: the reference, and the fla path's piece-by-piece rounds (fla itself needs a GPU, so its `run`
is replaced by the reference recurrence with fla's contract: raw q/k, per-segment initial states).
"""

from __future__ import annotations

import pytest
import torch

from blockspec.engine.scheduler import ScheduledSeq
from blockspec.loader.weights import load_weights
from blockspec.models.layers import delta_rule, delta_rule_fla
from blockspec.models.model_config import ModelConfig
from blockspec.models.registry import model_class
from blockspec.runner.model_runner import ModelRunner
from tests.models.test_hybrid_models import _seq
from tests.tiny_hybrid import save_tiny_hybrid

TOL = dict(rtol=1e-4, atol=1e-4)
POINTS = (16, 48, 80)  # a recurrent piece (16 tokens), a chunked one (32), and one more


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = save_tiny_hybrid(tmp_path_factory.mktemp("snap") / "qwen3_5", "qwen3_5", num_layers=4)
    cfg = ModelConfig.from_dir(path)
    model = model_class(cfg)(cfg).eval()
    load_weights(model, path, "cpu", torch.float32)
    model.allocate_state(max_num_seqs=4, snapshots=len(POINTS))
    runner = ModelRunner(model, None, torch.device("cpu"), torch.float32, block_size=16)
    runner.allocate_kv_cache(24)
    return model, runner


def fla_stand_in(q, k, v, g, beta, initial, cu_seqlens, longest):
    outs, finals = [], []
    bounds = cu_seqlens.tolist()
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        qp, kp = delta_rule.prepare_qk(q[a:b], k[a:b], v.shape[1])
        o, s, _ = delta_rule.recurrent(qp, kp, v[a:b].float(), g[a:b].float(), beta[a:b].float(), initial[i])
        outs.append(o)
        finals.append(s)
    return torch.cat(outs), torch.stack(finals)


@pytest.fixture(params=["reference", "fla"])
def backend(request, monkeypatch):
    monkeypatch.setenv("BLOCKSPEC_GDN_BACKEND", request.param)
    if request.param == "fla":
        monkeypatch.setattr(delta_rule_fla, "available", lambda: True)
        monkeypatch.setattr(delta_rule_fla, "run", fla_stand_in)
    return request.param


def _step(runner, model, seq, n, snapshots=()):
    item = ScheduledSeq(seq, n, 0, list(snapshots))
    hidden, _, _ = runner._target([item], None)
    model.commit_state([seq], [n])
    seq.num_computed += n
    return model.compute_logits(hidden)


def _state(model, slot):
    return [(layer.state.conv[slot].clone(), layer.state.ssm[slot].clone()) for layer in model.state_layers]


def test_snapshots_hold_the_state_at_their_points_and_a_hit_resumes_from_them(hybrid, backend):
    model, runner = hybrid
    ids = torch.randint(0, 256, (83,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.inference_mode():
        want = {}
        for p in POINTS:  # the slot after a pass that ends at p
            _step(runner, model, _seq(ids[:p], range(6), 0), p)
            want[p] = _state(model, 0)
        plain = _step(runner, model, _seq(ids, range(6), 0), len(ids))
        seq = _seq(ids, range(6, 12), 2)
        saved = _step(runner, model, seq, len(ids), [(p, e) for e, p in enumerate(POINTS)])
        torch.testing.assert_close(saved, plain, **TOL)  # saving snapshots changes no output
        for e, p in enumerate(POINTS):
            for layer, (conv, ssm) in zip(model.state_layers, want[p]):
                torch.testing.assert_close(layer.state.snap_conv[e], conv, **TOL)
                torch.testing.assert_close(layer.state.snap_ssm[e], ssm, **TOL)
        # a second sequence on the first 48 positions' blocks, its slot loaded from the snapshot at 48
        hit = _seq(ids, list(range(6, 9)) + [12, 13, 14], 4)
        model.restore_state([4], [POINTS.index(48)])
        hit.num_computed = 48
        resumed = _step(runner, model, hit, len(ids) - 48)
        torch.testing.assert_close(resumed, plain[48:], **TOL)
