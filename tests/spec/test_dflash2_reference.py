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
from blockspec.engine.sampling_params import SamplingParams
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


def _reference_modules(drafter2, reference):
    """Our GroupedDynamicConv / CandidateSelector and the reference's, with the same random weights."""
    from blockspec.loader.weights import load_weights
    from blockspec.spec.dflash import DFlashDrafter

    cfg = DrafterConfig.from_dir(drafter2)
    ours = DFlashDrafter(cfg, 256)
    load_weights(ours, drafter2, "cpu", torch.float32)
    return ours, reference[1]


def test_convolution_matches_reference_block_by_block(drafter2, reference):
    """Blocks of different lengths side by side (a ragged general-path pass): each block's rows through our
    convolution equal the reference GroupedDynamicCausalConv run on that block alone, so no tap crosses a block
    boundary, on both the input ("prepare") and output ("finish") sides."""
    ours, ref = _reference_modules(drafter2, reference)
    lengths = [8, 3, 1, 5]
    hidden = ours.config.model.hidden_size
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(sum(lengths), hidden, generator=gen)
    y = torch.randn(sum(lengths), hidden, generator=gen)
    block_index = torch.tensor([i for n in lengths for i in range(n)])
    for i, layer in enumerate(ours.layers):
        for name in ("attention_conv", "mlp_conv"):
            conv, ref_conv = getattr(layer, name), getattr(ref.layers[i], name)
            assert isinstance(ref_conv, dflash_model.GroupedDynamicCausalConv)
            with torch.no_grad():
                got_x, post = conv.prepare(x, block_index)
                got_y = conv.finish(y, post, block_index)
                start = 0
                for n in lengths:
                    want_x, ref_post = ref_conv.prepare(x[None, start:start + n])
                    want_y = ref_conv.finish(y[None, start:start + n], ref_post)
                    torch.testing.assert_close(got_x[start:start + n], want_x[0], rtol=1e-5, atol=1e-5)
                    torch.testing.assert_close(got_y[start:start + n], want_y[0], rtol=1e-5, atol=1e-5)
                    start += n
    # a nonzero second tap: the rows really mix (the test would pass for an identity otherwise)
    assert not torch.allclose(got_x[1:8], x[1:8], atol=1e-3)


def test_selector_walk_matches_reference_select(drafter2, reference, monkeypatch):
    """A batch of rows through our CandidateSelector.walk and the reference CandidateSelector.select on the same
    hidden states and logits: greedy paths and candidate sets equal; sampled, with the reference's draws forced
    onto our path, its q rows equal ours (candidates matched by token id: its top-K is unsorted)."""
    ours, ref = _reference_modules(drafter2, reference)
    sel, ref_sel = ours.candidate_selector, ref.candidate_selector
    assert isinstance(ref_sel, dflash_model.CandidateSelector)
    gen = torch.Generator().manual_seed(12)
    rows, slots = 5, K
    hidden = torch.randn(rows, slots, ours.config.model.hidden_size, generator=gen)
    logits = torch.randn(rows, slots, ours.config.model.vocab_size, generator=gen) * 2
    anchors = torch.randint(0, 256, (rows,), generator=gen)
    with torch.no_grad():
        path, cands, q = sel.walk(hidden, logits, anchors)
        ref_path, ref_cands, ref_q = ref_sel.select(hidden, logits, anchors, 0.0)
    assert q is None and ref_q is None
    assert torch.equal(path, ref_path)
    assert torch.equal(cands.sort(-1).values, ref_cands.sort(-1).values)
    assert not torch.equal(path, logits.argmax(-1))  # the pairwise term changed some picks

    temperature = torch.tensor([0.7, 0.0, 1.3, 0.7, 0.0])  # greedy rows beside sampled ones
    noise = torch.empty(rows, slots, sel.top_k).exponential_(generator=gen)
    with torch.no_grad():
        path, cands, q = sel.walk(hidden, logits, anchors, temperature, noise)
    for r in range(rows):
        if temperature[r] == 0:
            assert torch.equal(path[r], ref_path[r])
            continue
        with torch.no_grad():
            _, ref_cands_r, _ = ref_sel.select(hidden[r:r + 1], logits[r:r + 1], anchors[r:r + 1], 0.0)
        step = iter(range(slots))

        def forced(probs, r=r, step=step, ref_cands_r=ref_cands_r):  # the reference draws our walk's candidate
            slot = next(step)
            return (ref_cands_r[0, slot] == path[r, slot]).nonzero()[0]

        with torch.no_grad():
            monkeypatch.setattr(dflash_model, "_sample_probs", forced)
            got_path, _, got_q = ref_sel.select(hidden[r:r + 1], logits[r:r + 1], anchors[r:r + 1],
                                                float(temperature[r]))
            monkeypatch.undo()
        assert torch.equal(got_path[0], path[r])
        for s in range(slots):
            order, ref_order = cands[r, s].argsort(), ref_cands_r[0, s].argsort()
            torch.testing.assert_close(q[r, s, order], got_q[0, s, ref_order], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("prompt_len,max_new", [(5, 30), (19, 17)])
def test_greedy_loop_matches_dflash_generate(tiny_models, drafter2, reference, prompt_len, max_new, monkeypatch):
    """Greedy token ids of our engine and the reference loop (dflash_generate with DFlash2DraftModel.propose),
    and the tokens each verify step committed, on the same random weights."""
    target, ref_drafter = reference
    ids = torch.randint(0, 256, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    import time

    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)  # its stats time with CUDA events
    with torch.no_grad():
        ref = dflash_model.dflash_generate(ref_drafter, target, torch.tensor([ids]), max_new_tokens=max_new,
                                           stop_token_ids=None, temperature=0.0, return_stats=True)
    engine = _engine(tiny_models["qwen3"], drafter2)
    out = engine.generate([ids], SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True))[0]
    assert out.token_ids == ref.output_ids[0, prompt_len:].tolist()
    assert out.stats.decode_tokens == sum(ref.acceptance_lengths)
    assert out.stats.steps == len(ref.acceptance_lengths)
