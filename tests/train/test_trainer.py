"""The training loop on a learnable synthetic task: the loss falls, and --resume continues exactly;
greedy labels reproduce what the target writes."""

from __future__ import annotations

import time
from collections import deque

import pytest
import torch

from blockspec.config import EngineConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams
from blockspec.loader.weights import load_weights
from blockspec.models.model_config import ModelConfig
from blockspec.models.registry import model_class
from blockspec.spec.dflash import DrafterConfig
from blockspec.train.batching import greedy_labels
from blockspec.train.data import Sample
from blockspec.train.drafter_init import build_training_drafter
from blockspec.train.export import drafter_config_json
from blockspec.train.features import target_features
from blockspec.train.trainer import TrainConfig, Trainer, cosine_with_warmup

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target(tiny_models):
    cfg = ModelConfig.from_dir(tiny_models["llama"])
    model = model_class(cfg)(cfg, max_positions=256)
    load_weights(model, tiny_models["llama"], CPU, torch.float32)
    return model.eval().requires_grad_(False)


def _samples(n: int) -> list[Sample]:
    """Responses that are one of four fixed phrases after a random prompt: learnable continuations."""
    g = torch.Generator().manual_seed(0)
    phrases = [torch.randperm(250, generator=g)[:30] for _ in range(4)]
    out = []
    for i in range(n):
        prompt = torch.randint(0, 250, (6,), generator=g)
        mask = torch.cat([torch.zeros(6, dtype=torch.bool), torch.ones(30, dtype=torch.bool)])
        out.append(Sample(torch.cat([prompt, phrases[i % 4]]), mask))
    return out


def _trainer(target, tmp_path, cfg: TrainConfig, samples) -> Trainer:
    tcfg = target.config
    dcfg = DrafterConfig.from_dict(drafter_config_json(tcfg, 1, 8, 300, [1, 3]))
    drafter = build_training_drafter(dcfg, 128, CPU, seed=0)
    return Trainer(cfg, drafter, target, samples, tmp_path, CPU)


def test_cosine_schedule():
    assert cosine_with_warmup(0, 100, 4) == 0.25
    assert cosine_with_warmup(3, 100, 4) == 1.0
    assert abs(cosine_with_warmup(52, 100, 4) - 0.5) < 1e-9
    assert cosine_with_warmup(100, 100, 4) == 0.0


def test_loss_falls(target, tmp_path):
    samples = _samples(32)
    # the synthetic phrases are not the target's writing: learn the stored tokens
    cfg = TrainConfig(epochs=20, batch_size=8, num_anchors=8, lr=3e-2, save_every=1000, labels="data")
    trainer = _trainer(target, tmp_path, cfg, samples)
    probe = trainer.batch(0, 0)
    with torch.no_grad():
        before = trainer.loss(probe).loss.item()
    result = trainer.train()
    with torch.no_grad():
        after = trainer.loss(probe)
    assert result.steps == 80
    assert after.loss.item() < 0.6 * before
    assert after.tau_est.item() > 2.0
    assert (tmp_path / "train_log.jsonl").is_file() and (tmp_path / "train_state.pt").is_file()


def test_resume_continues_exactly(target, tmp_path):
    samples = _samples(16)
    cfg = TrainConfig(epochs=2, batch_size=4, num_anchors=4, lr=1e-3, save_every=3, labels="data")
    full = _trainer(target, tmp_path / "full", cfg, samples)
    full.train()

    cut = _trainer(target, tmp_path / "cut", cfg, samples)
    original = cut.train_step

    def stop_after_four(batch):
        if cut.step == 4:
            raise KeyboardInterrupt
        return original(batch)

    cut.train_step = stop_after_four
    with pytest.raises(KeyboardInterrupt):
        cut.train()
    resumed = _trainer(target, tmp_path / "cut", cfg, samples)
    resumed.train(resume=True)
    assert resumed.step == full.step == 8
    for (name, a), (_, b) in zip(full.drafter.named_parameters(), resumed.drafter.named_parameters()):
        torch.testing.assert_close(a, b, msg=name)


def test_greedy_labels_of_greedy_responses_are_the_responses(target, tiny_models):
    """The training pass's argmax chain equals the engine's greedy decode: on greedy data the
    relabelled blocks keep every label and change none (the oracle that the relabel is aligned)."""
    engine = Engine(EngineConfig(model=str(tiny_models["llama"]), device="cpu", dtype="float32", max_model_len=96))
    prompts = [[5, 9, 33, 2], [7, 7, 100, 42, 3, 250], [1, 2]]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    samples = [Sample(torch.tensor(p + o.token_ids),
                      torch.cat([torch.zeros(len(p), dtype=torch.bool), torch.ones(20, dtype=torch.bool)]))
               for p, o in zip(prompts, outs)]
    trainer = _trainer(target, None, TrainConfig(batch_size=3, num_anchors=12), samples)
    b = trainer.batch(0, 0)
    _, next_ids = target_features(target, b.input_ids, [1], greedy=True)
    labels, mask = greedy_labels(b.labels, b.label_mask, b.anchors, next_ids)
    assert b.label_mask.sum() > 50
    assert torch.equal(mask, b.label_mask) and torch.equal(labels, b.labels)


def test_time_budget_fits_the_schedule_to_the_recent_pace(target, tmp_path):
    """A slow first step (compilation) must not cut the run: the pace is the median of recent steps;
    early on the fit may grow the schedule, past a quarter of the budget it only shrinks it."""
    cfg = TrainConfig(epochs=1000, batch_size=4, num_anchors=4, max_time_s=200.0, labels="data")
    trainer = _trainer(target, tmp_path, cfg, _samples(16))
    trainer.step, trainer.total_steps = 6, 50  # as if an earlier fit had been too pessimistic
    stamps = deque([0.0, 30.0, 30.1, 30.2, 30.3, 30.4, 30.5])  # one 30 s step, then 0.1 s steps
    now = time.perf_counter()
    trainer._fit_budget(now - 30.5, stamps)  # 169.5 s left at 0.1 s per step
    assert 1690 <= trainer.total_steps <= 1710
    trainer._fit_budget(now - 120.5, stamps)  # 79.5 s left, late: shrinks
    assert 790 <= trainer.total_steps <= 810
    trainer._fit_budget(now - 60.5, deque([0.0, 0.01, 0.02, 0.03, 0.04, 0.05]))  # faster, but late: kept
    assert 790 <= trainer.total_steps <= 810
