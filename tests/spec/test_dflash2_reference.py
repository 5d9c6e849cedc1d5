"""Our DFlash 2 drafter against z-lab's DFlash2DraftModel (the `dflash` package) on the same random weights.

The tiny drafter has the published layout: sliding-window non-causal layers (window 12, shorter than the
prompts here), two-tap grouped dynamic convolutions, and a candidate selector (top 4) whose pairwise term
outweighs the logits, so the selected path differs from a per-slot argmax.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.scheduler import ScheduledSeq
from blockspec.errors import ConfigError
from blockspec.spec.dflash import DrafterConfig
from tests.spec.proposer_helpers import decode_drafts, prefill

dflash_model = pytest.importorskip("dflash.model", reason="test-only oracle: pip install --no-deps dflash")

K = 7  # block size 8


@pytest.fixture(scope="module")
def drafter2(tiny_drafter2):
    return tiny_drafter2


@pytest.fixture(scope="module")
def reference(tiny_models, drafter2):
    target = transformers.AutoModelForCausalLM.from_pretrained(tiny_models["qwen3"], dtype=torch.float32).eval()
    drafter = dflash_model.DFlash2DraftModel.from_pretrained(drafter2, dtype=torch.float32).eval()
    return target, drafter


def _engine(target_dir, draft_dir, k=K) -> Engine:
    spec = SpeculativeConfig(model=str(draft_dir), num_speculative_tokens=k)
    return Engine(EngineConfig(model=str(target_dir), device="cpu", speculative=spec))


@torch.no_grad()
def _reference_pass(reference, ids: list[int], anchor: int, k: int):
    """The reference drafter's hidden states for the block [anchor, MASK * k] after context ids."""
    target, drafter = reference
    out = target(torch.tensor([ids]), output_hidden_states=True)
    ctx = dflash_model.extract_context_feature(out.hidden_states, drafter.target_layer_ids)
    block = torch.tensor([[anchor] + [drafter.mask_token_id] * k])
    noise = target.get_input_embeddings()(block)
    positions = torch.arange(len(ids) + k + 1)[None]
    return drafter(target_hidden=ctx, noise_embedding=noise, position_ids=positions)[0]


def test_outputs_and_selected_paths_match_reference(tiny_models, drafter2, reference):
    ids = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(3)).tolist()
    anchor = 97
    ref_hidden = _reference_pass(reference, ids, anchor, K)
    target, ref_drafter = reference
    with torch.no_grad():
        ref_path, ref_candidates, _ = ref_drafter.propose(ref_hidden[None, 1:], torch.tensor([anchor]),
                                                          target.lm_head, 0.0)
        ref_argmax = ref_drafter.compute_logits(ref_hidden[1:], target.lm_head).argmax(-1)
    assert not torch.equal(ref_path[0], ref_argmax)  # the selector, not the argmax, chose the path

    engine = _engine(tiny_models["qwen3"], drafter2)
    drafter = engine.runner.proposer
    assert drafter.method == "dflash2" and drafter.max_drafts == K
    seq = prefill(engine, ids, anchor, K)
    with torch.inference_mode():
        feats, embeds, meta, rows = drafter.general_inputs([ScheduledSeq(seq, 1, K)], engine.runner.step_context())
        hidden = drafter(feats, embeds, meta)
        drafts = drafter.select(hidden[rows[0]][None], torch.tensor([anchor]), engine.runner.target.lm_head_weight)
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-4, atol=1e-4)
    assert drafts.tokens[0].tolist() == ref_path[0].tolist()
    assert torch.equal(drafts.candidates[0].sort(-1).values, ref_candidates[0].sort(-1).values)
    assert drafts.q is None


def test_sampled_walk_returns_q_of_its_path(tiny_models, drafter2, reference):
    """At T > 0 each slot's q is softmax((logit + pairwise term) / T) over the candidates, scored from the
    token the walk sampled before it: the reference selector's arithmetic along our sampled path."""
    target, ref_drafter = reference
    ids = torch.randint(0, 256, (17,), generator=torch.Generator().manual_seed(4)).tolist()
    anchor, temperature = 65, 0.7
    hidden = _reference_pass(reference, ids, anchor, K)[None, 1:]
    engine = _engine(tiny_models["qwen3"], drafter2)
    drafter = engine.runner.proposer
    noise = torch.empty(1, K, 4).exponential_(generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        drafts = drafter.select(hidden, torch.tensor([anchor]), target.lm_head.weight, torch.tensor([temperature]),
                                noise)
        logits = ref_drafter.compute_logits(hidden, target.lm_head)
        sel = ref_drafter.candidate_selector
        context = sel.hidden_projection(hidden)
        previous = anchor
        for slot in range(K):
            cands = drafts.candidates[0, slot]
            scores = logits[0, slot, cands] + (sel.successor_codebook(cands)
                                               @ (sel.predecessor_codebook(torch.tensor(previous)) * context[0, slot]))
            torch.testing.assert_close(drafts.q[0, slot], (scores / temperature).softmax(-1), rtol=1e-4, atol=1e-5)
            previous = int(drafts.tokens[0, slot])
            assert previous in cands.tolist()


def test_decode_path_drafts_match_reference(tiny_models, drafter2, reference, monkeypatch):
    """The in-graph decode path (DecodeStep: carry row, sliding window over the paged cache, blocks that
    shrink at the end) proposes, at every step, the path the reference proposes for the same prefix."""
    engine = _engine(tiny_models["qwen3"], drafter2)
    prompt = torch.randint(0, 256, (15,), generator=torch.Generator().manual_seed(8)).tolist()
    full, seen = decode_drafts(engine, monkeypatch, prompt, 20)
    target, ref_drafter = reference
    assert len(seen) >= 4 and min(n for _, n, _ in seen) < K  # the last blocks are shorter
    for anchor, n, drafts in seen:
        hidden = _reference_pass(reference, full[:anchor], full[anchor], n)
        with torch.no_grad():
            path, _, _ = ref_drafter.propose(hidden[None, 1:], torch.tensor([full[anchor]]), target.lm_head, 0.0)
        assert drafts == path[0].tolist(), anchor


def test_incomplete_dflash2_config_is_refused(drafter2):
    raw = DrafterConfig.from_dir(drafter2).raw
    broken = {**raw, "dflash_config": {k: v for k, v in raw["dflash_config"].items() if k != "selector_top_k"}}
    with pytest.raises(ConfigError, match="selector_top_k"):
        DrafterConfig.from_dict(broken)
    odd = {**raw, "dflash_config": {**raw["dflash_config"], "conv_group_size": 24}}
    with pytest.raises(ConfigError, match="conv_group_size"):
        DrafterConfig.from_dict(odd)
