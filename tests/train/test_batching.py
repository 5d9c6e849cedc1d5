"""Anchors fall inside the response; blocks and labels are what decoding would see."""

from __future__ import annotations

import torch

from blockspec.train.batching import anchor_candidates, greedy_labels, make_batch
from blockspec.train.data import Sample


def _sample(prompt_len: int, resp_len: int, offset: int = 0) -> Sample:
    ids = torch.arange(offset, offset + prompt_len + resp_len)
    mask = torch.cat([torch.zeros(prompt_len, dtype=torch.bool), torch.ones(resp_len, dtype=torch.bool)])
    return Sample(ids, mask)


def test_anchor_candidates_are_response_tokens_with_a_response_successor():
    s = _sample(4, 5)
    assert anchor_candidates(s.mask).tolist() == [4, 5, 6, 7]


def test_batch_blocks_labels_and_padding():
    block, mask_id = 4, 99
    samples = [_sample(3, 6, offset=10), _sample(2, 3, offset=50)]
    g = torch.Generator().manual_seed(0)
    b = make_batch(samples, num_anchors=8, block_size=block, mask_token_id=mask_id, generator=g, pad_to=4)
    assert b.input_ids.shape == (2, 12)  # longest 9, padded to a multiple of 4
    assert b.anchors[0, :5].tolist() == [3, 4, 5, 6, 7] and b.anchor_valid[0].tolist() == [True] * 5 + [False] * 3
    assert b.anchors[1, :2].tolist() == [2, 3] and b.anchor_valid[1].sum() == 2
    blocks = b.block_ids.view(2, 8, block)
    pos = b.block_positions.view(2, 8, block)
    for i in range(5):
        a = b.anchors[0, i].item()
        assert blocks[0, i].tolist() == [10 + a, mask_id, mask_id, mask_id]
        assert pos[0, i].tolist() == list(range(a, a + block))
        for k in range(1, block):
            inside = a + k < 9
            assert b.label_mask[0, i, k - 1].item() == inside
            if inside:
                assert b.labels[0, i, k - 1].item() == 10 + a + k
    assert not b.label_mask[0, 5:].any() and not b.label_mask[1, 2:].any()


def test_anchors_are_resampled_and_capped():
    s = [_sample(5, 100)]
    a1 = make_batch(s, 10, 16, 0, torch.Generator().manual_seed(1)).anchors[0]
    a2 = make_batch(s, 10, 16, 0, torch.Generator().manual_seed(2)).anchors[0]
    assert len(set(a1.tolist())) == 10 and a1.tolist() == sorted(a1.tolist())
    assert not torch.equal(a1, a2)
    assert (a1 >= 5).all() and (a1 < 104).all()


def test_greedy_labels_follow_the_target_chain_until_it_breaks():
    """Brute force: label j is the argmax after x_{a+j-1}, kept while every earlier stored token of the
    block equals the argmax before it."""
    g = torch.Generator().manual_seed(3)
    n, seq, block, vocab = 3, 40, 6, 5
    samples = [Sample(torch.randint(0, vocab, (seq,), generator=g),
                      torch.cat([torch.zeros(8, dtype=torch.bool), torch.ones(seq - 8, dtype=torch.bool)]))
               for _ in range(n)]
    b = make_batch(samples, num_anchors=10, block_size=block, mask_token_id=vocab, generator=g)
    next_ids = torch.randint(0, vocab, (n, seq), generator=g)
    next_ids[:, :-1] = torch.where(torch.rand(n, seq - 1, generator=g) < 0.7, b.input_ids[:, 1:], next_ids[:, :-1])
    labels, mask = greedy_labels(b.labels, b.label_mask, b.anchors, next_ids)
    for i in range(n):
        for j in range(10):
            a = int(b.anchors[i, j])
            alive = bool(b.anchor_valid[i, j])
            for k in range(1, block):
                alive = alive and bool(b.label_mask[i, j, k - 1])
                if k > 1:
                    alive = alive and int(b.input_ids[i, a + k - 1]) == int(next_ids[i, a + k - 2])
                assert bool(mask[i, j, k - 1]) == alive
                assert int(labels[i, j, k - 1]) == (int(next_ids[i, a + k - 1]) if alive else 0)
    assert mask.any() and (mask != b.label_mask).any()
