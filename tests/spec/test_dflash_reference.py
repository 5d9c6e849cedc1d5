"""Our DFlash drafter and loop against z-lab's reference package on the same random weights."""

from __future__ import annotations

import pytest
import torch
import transformers

dflash_model = pytest.importorskip("dflash.model", reason="test-only oracle: pip install --no-deps dflash")

from blockspec.config import EngineConfig, SpeculativeConfig  # noqa: E402
from blockspec.engine.engine import Engine  # noqa: E402
from blockspec.engine.sampling_params import SamplingParams  # noqa: E402
from blockspec.engine.scheduler import ScheduledSeq  # noqa: E402
from tests.spec.proposer_helpers import prefill  # noqa: E402


def _reference(target_dir, draft_dir):
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = dflash_model.DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32).eval()
    return target, drafter


def _engine(target_dir, draft_dir, k=15, **kw):
    spec = SpeculativeConfig(model=str(draft_dir), num_speculative_tokens=k)
    return Engine(EngineConfig(model=str(target_dir), device="cpu", speculative=spec, **kw))


def test_drafter_matches_reference(tiny_models, tiny_drafter):
    target, ref_drafter = _reference(tiny_models["qwen3"], tiny_drafter)
    engine = _engine(tiny_models["qwen3"], tiny_drafter)
    ids = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(3)).tolist()
    anchor = 97
    k = 15
    mask = ref_drafter.mask_token_id
    with torch.no_grad():
        out = target(torch.tensor([ids]), output_hidden_states=True)
        ctx = dflash_model.extract_context_feature(out.hidden_states, ref_drafter.target_layer_ids)
        block = torch.tensor([[anchor] + [mask] * k])
        noise = target.get_input_embeddings()(block)
        positions = torch.arange(len(ids) + k + 1)[None]
        ref_hidden = ref_drafter(target_hidden=ctx, noise_embedding=noise, position_ids=positions)[0]
        ref_logits = ref_drafter.compute_logits(ref_hidden[1:], target.lm_head)

    # Our path: prefill through the engine's runner (captures features), then one drafter pass.
    runner = engine.runner
    seq = prefill(engine, ids, anchor, k)
    features = seq.pending_features
    torch.testing.assert_close(features, ctx[0], rtol=1e-5, atol=1e-5)
    drafter = runner.proposer
    with torch.inference_mode():
        feats, embeds, meta, rows = drafter.general_inputs([ScheduledSeq(seq, 1, k)], runner.step_context())
        hidden = drafter(feats, embeds, meta)
        logits = drafter.compute_logits(hidden[rows[0]], runner.target.lm_head_weight)
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prompt_len,max_new", [(5, 40), (31, 23)])
def test_greedy_loop_matches_dflash_generate(tiny_models, tiny_drafter, prompt_len, max_new):
    target, ref_drafter = _reference(tiny_models["qwen3"], tiny_drafter)
    ids = torch.randint(0, 256, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    with torch.no_grad():
        ref = dflash_model.dflash_generate(ref_drafter, target, torch.tensor([ids]), max_new_tokens=max_new,
                                           stop_token_ids=None, temperature=0.0)
    ref_tokens = ref[0, prompt_len:].tolist()
    engine = _engine(tiny_models["qwen3"], tiny_drafter)
    out = engine.generate([ids], SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True))[0]
    assert out.token_ids == ref_tokens


def test_draft_window_limits_context_like_a_truncated_reference(tiny_models, tiny_drafter):
    """With a drafter context window W, the block sees exactly the last W context tokens."""
    target, ref_drafter = _reference(tiny_models["qwen3"], tiny_drafter)
    window, k, anchor = 8, 7, 42
    engine = _engine(tiny_models["qwen3"], tiny_drafter, k=k)
    engine.runner.draft_window = window
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        out = target(torch.tensor([ids]), output_hidden_states=True)
        ctx = dflash_model.extract_context_feature(out.hidden_states, ref_drafter.target_layer_ids)[:, -window:]
        noise = target.get_input_embeddings()(torch.tensor([[anchor] + [ref_drafter.mask_token_id] * k]))
        positions = torch.arange(len(ids) - window, len(ids) + k + 1)[None]
        ref_hidden = ref_drafter(target_hidden=ctx, noise_embedding=noise, position_ids=positions)[0]
    seq = prefill(engine, ids, anchor, k)
    with torch.inference_mode():
        drafter = engine.runner.proposer
        feats, embeds, meta, _ = drafter.general_inputs([ScheduledSeq(seq, 1, k)], engine.runner.step_context())
        hidden = drafter(feats, embeds, meta)
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-4, atol=1e-4)
