"""The training loop: frozen target features on the fly, DFlash block loss, AdamW with a cosine schedule.

Each step: collate a batch and draw its anchors (a fresh draw every epoch), run the frozen target
over the batch (dense causal pass) for context features, run the drafter over all blocks at once,
and take an AdamW step on the position-weighted loss (grad clip, bf16 autocast on CUDA). Progress
goes to a tqdm bar and train_log.jsonl; tau is measured through the Engine every `eval_every`
steps; train_state.pt lets `--resume` continue exactly where a run stopped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from blockspec.spec.dflash import DFlashDrafter
from blockspec.train.batching import TrainBatch, greedy_labels, make_batch
from blockspec.train.data import Sample
from blockspec.train.features import target_features
from blockspec.train.loss import default_gamma, dflash_loss, position_weights
from blockspec.train.mask import BlockAttention, resolve_backend
from blockspec.train.model import train_forward

log = logging.getLogger("blockspec")
STATE = "train_state.pt"
LOG = "train_log.jsonl"


@dataclass
class TrainConfig:
    epochs: int = 4
    lr: float = 6e-4
    batch_size: int = 16  # sequences per step
    num_anchors: int = 64  # anchors (blocks) per sequence per step
    gamma: float | None = None  # None: 7 for B = 16
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    weight_decay: float = 0.01
    eval_every: int = 0  # steps between tau evaluations; 0: once per epoch
    save_every: int = 500  # steps between train_state.pt checkpoints
    max_time_s: float | None = None  # wall-clock cap: the schedule is fitted to it after a few steps
    attention: str = "auto"  # auto | sdpa | flex
    labels: str = "greedy"  # greedy: the target's argmax chain (batching.greedy_labels) | data: stored tokens
    seed: int = 0


@dataclass
class TrainResult:
    steps: int
    epochs_done: float
    wall_s: float
    loss: float
    tau_est: float
    last_eval: dict[str, Any] | None


def cosine_with_warmup(step: int, total: int, warmup: int) -> float:
    """LR multiplier: linear warm-up to 1, then cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    def __init__(self, cfg: TrainConfig, drafter: DFlashDrafter, target: nn.Module, samples: list[Sample],
                 out_dir: Path, device: torch.device,
                 evaluator: Callable[[DFlashDrafter], dict[str, Any]] | None = None) -> None:
        if len(samples) < cfg.batch_size:
            raise ValueError(f"{len(samples)} samples are fewer than one batch of {cfg.batch_size}")
        self.cfg, self.drafter, self.target, self.samples = cfg, drafter, target, samples
        self.out_dir, self.device, self.evaluator = out_dir, device, evaluator
        dcfg = drafter.config
        self.block_size, self.mask_token_id = dcfg.block_size, dcfg.mask_token_id
        self.layer_ids = list(dcfg.target_layer_ids)
        self.backend = resolve_backend(cfg.attention, device, cfg.num_anchors * self.block_size)
        self.weights = position_weights(self.block_size, cfg.gamma or default_gamma(self.block_size), device)
        self.steps_per_epoch = len(samples) // cfg.batch_size
        self.total_steps = cfg.epochs * self.steps_per_epoch
        self.warmup = max(1, round(cfg.warmup_ratio * self.total_steps))
        self.optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                           weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: cosine_with_warmup(s, self.total_steps, self.warmup))
        self.step = 0
        self.last_eval: dict[str, Any] | None = None
        self._epoch_order: tuple[int, list[int]] = (-1, [])

    # ---- batches --------------------------------------------------------------------------------

    def _order(self, epoch: int) -> list[int]:
        if self._epoch_order[0] != epoch:
            g = torch.Generator().manual_seed(self.cfg.seed * 7919 + epoch)
            self._epoch_order = (epoch, torch.randperm(len(self.samples), generator=g).tolist())
        return self._epoch_order[1]

    def batch(self, epoch: int, index: int) -> TrainBatch:
        """Batch `index` of `epoch`: its samples and anchors depend only on (seed, epoch, index)."""
        order = self._order(epoch)
        bs = self.cfg.batch_size
        chosen = [self.samples[i] for i in order[index * bs:(index + 1) * bs]]
        g = torch.Generator().manual_seed((self.cfg.seed * 1_000_003 + epoch) * 1_000_003 + index)
        pad = 128 if self.backend == "flex" else 16  # few distinct shapes for the compiled kernel
        return make_batch(chosen, self.cfg.num_anchors, self.block_size, self.mask_token_id, g, pad_to=pad)

    # ---- one step -------------------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def loss(self, batch: TrainBatch):
        """Forward of one batch (features, drafter, loss); used by the step and by the tests."""
        b = batch.to(self.device)
        features, next_ids = target_features(self.target, b.input_ids, self.layer_ids,
                                             greedy=self.cfg.labels == "greedy")
        labels, label_mask = b.labels, b.label_mask
        if next_ids is not None:
            labels, label_mask = greedy_labels(labels, label_mask, b.anchors, next_ids)
        with torch.no_grad():
            embeds = self.target.embed(b.block_ids).float()
        attention = BlockAttention(b.anchors, b.input_ids.shape[1], self.block_size, self.backend)
        lm_head = self.target.lm_head_weight
        n, a = b.anchors.shape
        with self._autocast():
            hidden = train_forward(self.drafter, features, embeds, b.block_positions, attention)
            return dflash_loss(hidden, labels, label_mask, b.anchor_valid, self.weights,
                               lambda rows: self.drafter.compute_logits(rows, lm_head),
                               self.drafter.candidate_selector, b.block_ids.view(n, a, -1)[:, :, 0])

    def train_step(self, batch: TrainBatch):
        try:
            out = self.loss(batch)
        except Exception as exc:  # noqa: BLE001 - a compiler failure must not cost the run
            if self.backend != "flex" or self.step > 0:
                raise
            log.warning("flex_attention failed on the first step (%s): continuing with dense SDPA", exc)
            self.backend = "sdpa"
            out = self.loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return out, grad_norm

    # ---- state ----------------------------------------------------------------------------------

    def save_state(self) -> None:
        state = {"drafter": self.drafter.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(), "step": self.step, "total_steps": self.total_steps,
                 "config": asdict(self.cfg), "num_samples": len(self.samples)}
        tmp = self.out_dir / (STATE + ".tmp")
        torch.save(state, tmp)
        tmp.replace(self.out_dir / STATE)

    def load_state(self) -> bool:
        path = self.out_dir / STATE
        if not path.is_file():
            return False
        state = torch.load(path, map_location=self.device, weights_only=True)
        if state["num_samples"] != len(self.samples):
            log.warning("resuming with %d samples (the checkpoint had %d): batches differ from the first run",
                        len(self.samples), state["num_samples"])
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.total_steps = state["step"], state["total_steps"]
        return True

    def _log(self, record: dict[str, Any]) -> None:
        with open(self.out_dir / LOG, "a") as f:
            f.write(json.dumps(record) + "\n")

    # ---- the loop -------------------------------------------------------------------------------

    def _fit_budget(self, start: float, stamps: deque[float]) -> None:
        """Fit total_steps to end inside max_time_s, from the median pace of the recent steps (the
        first step of each padded shape carries compilation, so a mean from the start cut runs short).
        Early in the run the fit may grow as well as shrink; later it only shrinks, so the cosine
        schedule is not pulled back up near its end."""
        budget = self.cfg.max_time_s
        if budget is None or len(stamps) < 5:
            return
        now = time.perf_counter()
        times = list(stamps)
        pace = statistics.median(b - a for a, b in zip(times[:-1], times[1:]))
        fit = self.step + max(0, int((budget - (now - start)) / pace))
        cap = self.cfg.epochs * self.steps_per_epoch
        if now - start < 0.25 * budget:
            self.total_steps = min(cap, fit)
        elif fit < self.total_steps:
            self.total_steps = fit
        self.warmup = min(self.warmup, max(1, round(self.cfg.warmup_ratio * self.total_steps)))

    def _evaluate(self, bar: tqdm) -> None:
        if self.evaluator is None:
            return
        self.drafter.eval()
        result = self.evaluator(self.drafter)
        self.drafter.train()
        self.last_eval = {"step": self.step, **result}
        self._log({"eval": self.last_eval})
        per_pos = " ".join(f"{a:.2f}" for a in result.get("acceptance_per_position", [])[:8])
        bar.write(f"step {self.step}: held-out tau {result['tau']:.3f} (acceptance by position: {per_pos} ...)")

    def train(self, resume: bool = False) -> TrainResult:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if resume and self.load_state():
            log.info("resumed at step %d of %d", self.step, self.total_steps)
        elif (self.out_dir / LOG).exists():
            (self.out_dir / LOG).unlink()
        eval_every = self.cfg.eval_every or self.steps_per_epoch
        start = time.perf_counter()
        stamps: deque[float] = deque(maxlen=50)  # end times of the recent steps, for the time budget
        recent: deque[tuple[float, float]] = deque(maxlen=20)  # (loss, tau_est) of the last steps
        bar = tqdm(total=self.total_steps, initial=self.step, desc="training", unit="step", dynamic_ncols=True)
        try:
            while self.step < self.total_steps:
                epoch, index = divmod(self.step, self.steps_per_epoch)
                out, grad_norm = self.train_step(self.batch(epoch, index))
                stamps.append(time.perf_counter())
                loss, tau = out.loss.item(), out.tau_est.item()
                recent.append((loss, tau))
                loss_avg, tau_avg = (sum(x) / len(recent) for x in zip(*recent))
                lr = self.scheduler.get_last_lr()[0]
                bar.set_postfix(loss=f"{loss_avg:.3f}", acc1=f"{out.accuracy[0].item():.2f}",
                                tau_est=f"{tau_avg:.2f}", lr=f"{lr:.1e}", ep=f"{self.step / self.steps_per_epoch:.2f}")
                bar.update(1)
                if self.step % 10 == 0 or self.step == 1:
                    record = {"step": self.step, "epoch": round(self.step / self.steps_per_epoch, 3),
                              "loss": round(loss, 5), "tau_est": round(tau, 4), "lr": lr,
                              "grad_norm": round(float(grad_norm), 4),
                              "accuracy": [round(a, 4) for a in out.accuracy.tolist()],
                              "elapsed_s": round(time.perf_counter() - start, 1)}
                    if out.selector_loss is not None:
                        record |= {name: round(getattr(out, name).item(), 4)
                                   for name in ("selector_loss", "selector_recall", "selector_accuracy")}
                    self._log(record)
                if self.step % eval_every == 0 and self.step < self.total_steps:
                    self._evaluate(bar)
                if self.step % self.cfg.save_every == 0:
                    self.save_state()
                self._fit_budget(start, stamps)
                bar.total = self.total_steps
            self._evaluate(bar)
            self.save_state()
        finally:
            bar.close()
        loss_avg, tau_avg = (sum(x) / len(recent) for x in zip(*recent)) if recent else (0.0, 0.0)
        return TrainResult(self.step, self.step / self.steps_per_epoch, time.perf_counter() - start,
                           loss_avg, tau_avg, self.last_eval)
