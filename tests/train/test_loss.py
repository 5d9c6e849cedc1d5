"""Loss weights and the weighted block loss against brute-force loops."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from blockspec.train.loss import default_gamma, dflash_loss, position_weights


def test_position_weights_match_definition():
    w = position_weights(16, 7.0)
    assert w.shape == (15,)
    for k in range(1, 16):
        assert math.isclose(w[k - 1].item(), math.exp(-(k - 1) / 7), rel_tol=1e-6)
    assert default_gamma(16) == 7.0


def test_weighted_loss_and_acceptance_match_brute_force():
    torch.manual_seed(0)
    n, a, block, h, vocab = 2, 3, 5, 8, 11
    hidden = torch.randn(n, a * block, h)
    head = torch.randn(vocab, h)
    labels = torch.randint(0, vocab, (n, a, block - 1))
    label_mask = torch.rand(n, a, block - 1) > 0.2
    label_mask = label_mask.long().cumprod(-1).bool()
    label_mask[0, 0] = True
    valid = torch.tensor([[True, True, True], [True, True, False]])
    label_mask[1, 2] = False
    w = position_weights(block, 2.0)
    out = dflash_loss(hidden, labels, label_mask, valid, w, lambda x: x @ head.T)

    num = den = 0.0
    prefixes = []
    correct_pos = [0] * (block - 1)
    count_pos = [0] * (block - 1)
    for b in range(n):
        for i in range(a):
            run, alive = 0, True
            for k in range(1, block):
                if not label_mask[b, i, k - 1]:
                    alive = False
                    continue
                logits = hidden[b, i * block + k] @ head.T
                ce = F.cross_entropy(logits[None], labels[b, i, k - 1][None]).item()
                num += w[k - 1].item() * ce
                den += w[k - 1].item()
                hit = logits.argmax().item() == labels[b, i, k - 1].item()
                correct_pos[k - 1] += hit
                count_pos[k - 1] += 1
                alive = alive and hit
                run += alive
            if valid[b, i]:
                prefixes.append(run)
    assert math.isclose(out.loss.item(), num / den, rel_tol=1e-5)
    assert math.isclose(out.tau_est.item(), 1 + sum(prefixes) / len(prefixes), rel_tol=1e-6)
    expected_acc = [c / max(t, 1) for c, t in zip(correct_pos, count_pos)]
    torch.testing.assert_close(out.accuracy, torch.tensor(expected_acc))
    assert out.num_labels == int(label_mask.sum())
