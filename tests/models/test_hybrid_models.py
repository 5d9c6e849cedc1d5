"""Qwen3-MoE, Qwen3-Next and Qwen3.5 (dense, MoE) against transformers on tiny random configs (fp32, CPU).

Logits must match for one-shot prefill, chunked prefill and token-by-token decode through the paged
runner (the engine's path), with the recurrent state carried in slots between steps; and for the
cache-free dense pass that drafter training uses.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from blockspec.engine.sampling_params import SamplingParams
from blockspec.engine.scheduler import ScheduledSeq
from blockspec.engine.sequence import Sequence
from blockspec.loader.weights import load_weights
from blockspec.models.model_config import ModelConfig
from blockspec.models.registry import model_class
from blockspec.runner.model_runner import ModelRunner
from blockspec.spec.proposer import Drafts
from blockspec.train.features import target_features
from tests.tiny_hybrid import FAMILIES, save_all

TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_all(tmp_path_factory.mktemp("hybrid"))


def _hf(path, family):
    cls = transformers.AutoModelForImageTextToText if family.startswith("qwen3_5") else \
        transformers.AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def _ours(path):
    cfg = ModelConfig.from_dir(path)
    model = model_class(cfg)(cfg).eval()
    load_weights(model, path, "cpu", torch.float32)
    if getattr(model, "has_recurrent_state", False):
        model.allocate_state(max_num_seqs=4)
    runner = ModelRunner(model, None, torch.device("cpu"), torch.float32, block_size=16)
    runner.allocate_kv_cache(24)
    return model, runner


def _seq(ids, blocks, slot):
    seq = Sequence("t", ids, SamplingParams(temperature=0), None, [], None)
    seq.block_table, seq.state_slot = list(blocks), slot
    return seq


def _step(runner, model, seq, n):
    hidden, _, _ = runner._target([ScheduledSeq(seq, n, 0)], None)
    if hasattr(model, "commit_state"):
        model.commit_state([seq], [n])
    seq.num_computed += n
    return model.compute_logits(hidden)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(checkpoints, family):
    path = checkpoints[family]
    hf = _hf(path, family)
    model, runner = _ours(path)
    ids = torch.randint(0, 256, (83,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    assert ref.std() > 0.1  # the random model is not degenerate
    with torch.inference_mode():
        # one-shot prefill (two delta-rule chunks of 64), on scattered blocks
        full = _step(runner, model, _seq(ids, [9, 2, 14, 20, 7, 11], 0), len(ids))
        torch.testing.assert_close(full, ref, **TOL)
        # chunked prefill 16 + 45 + 13 (recurrent and chunked spans), then decode the rest one by one
        seq = _seq(ids, [3, 5, 0, 1, 4, 6], 2)
        parts = [_step(runner, model, seq, n) for n in (16, 45, 13)]
        parts += [_step(runner, model, seq, 1) for _ in range(len(ids) - 74)]
        torch.testing.assert_close(torch.cat(parts), ref, **TOL)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_ragged_batch_equals_sequences_alone(checkpoints, family):
    """Prefill chunks and decode tokens of several sequences in one flat batch, slots interleaved."""
    model, runner = _ours(checkpoints[family])
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (21, 5, 40)]
    with torch.inference_mode():
        alone = []
        for i, ids in enumerate(prompts):
            seq = _seq(ids, [i * 4 + j for j in range(4)], 0)
            alone.append(torch.cat([_step(runner, model, seq, len(ids) - 3)] +
                                   [_step(runner, model, seq, 1) for _ in range(3)]))
        seqs = [_seq(ids, [12 + i * 4 + j for j in range(4)], slot)
                for i, (ids, slot) in enumerate(zip(prompts, (3, 1, 2)))]
        outs = [[] for _ in seqs]
        schedule = [[len(p) - 3 for p in prompts], [1, 1, 1], [1, 1, 1], [1, 1, 1]]
        for counts in schedule:
            items = [ScheduledSeq(s, n, 0) for s, n in zip(seqs, counts)]
            hidden, _, offsets = runner._target(items, None)
            model.commit_state(seqs, counts)
            for i, (s, n, off) in enumerate(zip(seqs, counts, offsets)):
                outs[i].append(model.compute_logits(hidden[off:off + n]))
                s.num_computed += n
    for got, want in zip(outs, alone):
        torch.testing.assert_close(torch.cat(got), want, **TOL)


@pytest.mark.parametrize("mode", ["replay", "checkpoint"])
def test_verify_blocks_roll_back_to_the_accepted_prefix(checkpoints, monkeypatch, mode):
    """Verify blocks of k + 1 tokens (right drafts, then wrong ones); the state continues from the
    last accepted position, so every committed position's logits equal the one-shot pass's."""
    monkeypatch.setenv("BLOCKSPEC_GDN_ROLLBACK", mode)
    model, runner = _ours(checkpoints["qwen3_5"])
    model.allocate_state(max_num_seqs=4, checkpoints=16 if mode == "checkpoint" else 0)
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 256, (90,), generator=gen).tolist()
    with torch.inference_mode():
        ref = _step(runner, model, _seq(ids, range(6), 0), len(ids))
        seq = _seq(ids, range(6, 12), 3)
        _step(runner, model, seq, 20)
        for k, a in [(15, 3), (7, 7), (1, 0), (15, 15), (7, 0), (15, 9), (1, 1), (11, 4)]:
            p = seq.num_computed
            drafts = ids[p + 1:p + 1 + a] + [(t + 1) % 256 for t in ids[p + 1 + a:p + 1 + k]]
            hidden, _, _ = runner._target([ScheduledSeq(seq, 1, k)], Drafts(torch.tensor([drafts])))
            got = model.compute_logits(hidden[:a + 1])
            torch.testing.assert_close(got, ref[p:p + a + 1], **TOL)
            model.commit_state([seq], [a + 1])
            seq.num_computed += a + 1


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_dense_pass_for_drafter_training(checkpoints, family):
    """Whole sequences without cache or slots (train/features.py) match transformers' hidden states."""
    path = checkpoints[family]
    hf = _hf(path, family)
    model, _ = _ours(path)
    ids = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = hf(input_ids=ids, output_hidden_states=True)
        feats, _ = target_features(model, ids, [1, 2])
    torch.testing.assert_close(feats, torch.cat([out.hidden_states[2], out.hidden_states[3]], dim=-1), **TOL)


def test_config_fields(checkpoints):
    cfg = ModelConfig.from_dir(checkpoints["qwen3_5_moe"])
    assert cfg.architecture == "Qwen3_5MoeForConditionalGeneration"
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg.num_attention_layers == 1 and cfg.rotary_dim == 4
    assert cfg.moe.num_experts == 8 and cfg.moe.norm_topk_prob and cfg.moe.shared_intermediate_size == 48
    assert cfg.linear.num_value_heads == 4 and cfg.linear.conv_kernel == 4
    nxt = ModelConfig.from_dir(checkpoints["qwen3_next"])
    assert [nxt.moe.is_sparse(i) for i in range(4)] == [False, True, False, True]
    moe = ModelConfig.from_dir(checkpoints["qwen3_moe"])
    assert moe.linear is None and moe.layer_types == [] and [moe.moe.is_sparse(i) for i in range(4)] == \
        [True, False, True, True]
