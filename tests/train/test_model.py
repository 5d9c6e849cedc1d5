"""The training forward against z-lab's reference DFlashDraftModel, and the target's dense feature path
against transformers, on the same random weights."""

from __future__ import annotations

import pytest
import torch
import transformers

from blockspec.loader.weights import load_weights
from blockspec.models.model_config import ModelConfig
from blockspec.models.registry import model_class
from blockspec.spec.dflash import DFlashDrafter, DrafterConfig
from blockspec.train.batching import make_batch
from blockspec.train.data import Sample
from blockspec.train.features import target_features
from blockspec.train.loss import dflash_loss, position_weights
from blockspec.train.mask import BlockAttention, dense_block_mask
from blockspec.train.model import train_forward

dflash_model = pytest.importorskip("dflash.model", reason="test-only oracle: pip install --no-deps dflash")


def _our_drafter(path) -> DFlashDrafter:
    cfg = DrafterConfig.from_dir(path)
    drafter = DFlashDrafter(cfg, 256)
    load_weights(drafter, path, "cpu", torch.float32)
    return drafter


def _our_target(path) -> torch.nn.Module:
    cfg = ModelConfig.from_dir(path)
    model = model_class(cfg)(cfg, max_positions=256)
    load_weights(model, path, "cpu", torch.float32)
    return model.eval()


def test_train_forward_matches_reference_many_blocks(tiny_drafter):
    ref = dflash_model.DFlashDraftModel.from_pretrained(tiny_drafter, dtype=torch.float32).eval()
    ours = _our_drafter(tiny_drafter)
    block = ours.config.block_size
    n_feat = len(ours.config.target_layer_ids) * ours.config.model.hidden_size
    torch.manual_seed(0)
    n, s, hidden = 2, 40, ours.config.model.hidden_size
    anchors = torch.tensor([[3, 11, 20], [0, 25, 39]])
    features = torch.randn(n, s, n_feat)
    embeds = torch.randn(n, 3 * block, hidden)
    positions = (anchors[:, :, None] + torch.arange(block)).view(n, -1)
    with torch.no_grad():
        got = train_forward(ours, features, embeds, positions, BlockAttention(anchors, s, block, "sdpa"))
        mask = dense_block_mask(anchors, s, block)
        for b in range(n):
            pos = torch.cat([torch.arange(s), positions[b]])[None]
            want = ref(target_hidden=features[b:b + 1], noise_embedding=embeds[b:b + 1], position_ids=pos,
                       attention_mask=mask[b:b + 1])
            torch.testing.assert_close(got[b], want[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_single_block_equals_reference_decode_pass(tiny_drafter, tiny_drafter2, arch):
    """One anchor with all context before it is exactly a decode-time draft pass of the reference (DFlash 2:
    the convolutions inside the block; its sliding window, 12, spans this context and block)."""
    path = tiny_drafter2 if arch == "dflash2" else tiny_drafter
    cls = dflash_model.DFlash2DraftModel if arch == "dflash2" else dflash_model.DFlashDraftModel
    ref = cls.from_pretrained(path, dtype=torch.float32).eval()
    ours = _our_drafter(path)
    block = ours.config.block_size
    n_feat = len(ours.config.target_layer_ids) * ours.config.model.hidden_size
    torch.manual_seed(1)
    s, anchor = 30, 4
    features = torch.randn(1, s, n_feat)
    embeds = torch.randn(1, block, ours.config.model.hidden_size)
    positions = torch.arange(anchor, anchor + block)[None]
    with torch.no_grad():
        attention = BlockAttention(torch.tensor([[anchor]]), s, block, "sdpa")
        got = train_forward(ours, features, embeds, positions, attention)
        want = ref(target_hidden=features[:, :anchor], noise_embedding=embeds,
                   position_ids=torch.arange(anchor + block)[None])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_dense_target_features_match_transformers(tiny_models):
    path = tiny_models["qwen3"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = _our_target(path)
    ids = torch.randint(0, 256, (3, 21), generator=torch.Generator().manual_seed(0))
    layer_ids = [1, 3, 4]
    feats, _ = target_features(ours, ids, layer_ids)
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states
    want = dflash_model.extract_context_feature(hs, layer_ids)
    torch.testing.assert_close(feats, want, rtol=1e-4, atol=1e-4)


def test_right_padding_does_not_change_real_positions(tiny_models):
    ours = _our_target(tiny_models["llama"])
    ids = torch.randint(0, 256, (1, 15), generator=torch.Generator().manual_seed(1))
    padded = torch.cat([ids, torch.zeros(1, 9, dtype=torch.long)], dim=1)
    torch.testing.assert_close(target_features(ours, padded, [2])[0][:, :15], target_features(ours, ids, [2])[0])


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_batch_gradients_reach_every_drafter_parameter(tiny_drafter, tiny_drafter2, arch):
    """Through the training forward and the loss (DFlash 2: the selector's K-way loss too)."""
    ours = _our_drafter(tiny_drafter2 if arch == "dflash2" else tiny_drafter)
    block = ours.config.block_size
    n_feat = len(ours.config.target_layer_ids) * ours.config.model.hidden_size
    ids = torch.arange(40) % 250
    mask = torch.arange(40) >= 10
    batch = make_batch([Sample(ids, mask)], 6, block, ours.config.mask_token_id, torch.Generator().manual_seed(0))
    features = torch.randn(1, 40, n_feat)
    embeds = torch.randn(1, 6 * block, ours.config.model.hidden_size)
    h = train_forward(ours, features, embeds, batch.block_positions,
                      BlockAttention(batch.anchors, 40, block, "sdpa"))
    lm_head = torch.randn(ours.config.model.vocab_size, ours.config.model.hidden_size)
    n, a = batch.anchors.shape
    labels = (h.detach().view(n, a, block, -1)[:, :, 1:] @ lm_head.T).argmax(-1)  # inside the unary top-K
    out = dflash_loss(h, labels, batch.label_mask, batch.anchor_valid, position_weights(block, 7.0),
                      lambda rows: rows @ lm_head.T, ours.candidate_selector, batch.block_ids.view(n, a, -1)[:, :, 0])
    (out.loss + h.square().mean()).backward()
    assert (out.selector_loss is not None) == (arch == "dflash2")
    missing = [n for n, p in ours.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing
