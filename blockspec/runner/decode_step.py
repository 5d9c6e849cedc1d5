"""The fast path for uniform decode/verify steps (every sequence: its anchor plus up to k drafts).

Per step: one host-to-device copy of the packed integer inputs, one drafter graph (project the
context features the previous step committed, denoise the blocks, write the drafts into the verify
input), one target graph (verify pass, logits, greedy acceptance), one device-to-host copy.

Context features stay on the device between steps: the target graph writes every verified position's
features into a persistent buffer, and the next step's drafter graph gathers the committed rows from
it. A sequence that is not in the next decode step gets its rows copied out (`pending_features`)
before the buffer is overwritten, so the general path can pick them up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from blockspec.engine.scheduler import ScheduledSeq
from blockspec.engine.sequence import Sequence
from blockspec.models.layers.attention import AttentionMetadata, DecodeMetadata, forward_context
from blockspec.runner.acceptance import accept, greedy_only
from blockspec.runner.decode_graphs import DecodeGraphs, DecodeViews
from blockspec.spec.dflash import DraftMetadata

if TYPE_CHECKING:
    from blockspec.runner.model_runner import ModelRunner, StepResult


class DecodeStep:
    def __init__(self, runner: ModelRunner, max_batch: int, max_model_len: int, use_graphs: bool) -> None:
        self.r = runner
        self.k = runner.num_speculative_tokens
        self.q = self.k + 1
        max_blocks = -(-(max_model_len + self.q) // runner.block_size)
        self.graphs = DecodeGraphs(runner.device, max_batch, self.q, max_blocks, use_graphs)
        self.uses_drafter = runner.drafter is not None and self.k > 0
        width = len(runner.capture_layer_ids) * runner.target.config.hidden_size if self.uses_drafter else 0
        self.features = torch.zeros(max_batch * self.q, width, device=runner.device, dtype=runner.dtype)
        self.holders: list[Sequence] = []  # sequences whose committed features sit in self.features

    @property
    def max_batch(self) -> int:
        return self.graphs.buckets[-1]

    def capture(self, log) -> float:
        fns = {"target": self._target_fn}
        if self.uses_drafter and self.r.synthetic is None:
            fns = {"draft": self._draft_fn, **fns}
        return self.graphs.capture(fns, self._fill_dummy, log)

    # ---- graphs ---------------------------------------------------------------------------------

    def _target_fn(self, v: DecodeViews) -> tuple[torch.Tensor, torch.Tensor]:
        r, bp, q = self.r, v.batch, v.q_len
        meta = AttentionMetadata(slot_mapping=v.slots, decode=DecodeMetadata(v.tables, v.seq_lens, v.kv_start, q))
        with forward_context(meta):
            hidden, features = r.target(v.tokens, v.positions, r.capture_layer_ids)
        if features is not None and self.uses_drafter:
            self.features[: bp * q].copy_(features)
        logits = r.target.compute_logits(hidden)
        # Greedy acceptance inside the graph: [accepted, argmax_0..argmax_k] per row.
        argmax = logits.argmax(-1).view(bp, q)
        drafts = v.tokens.view(bp, q)[:, 1:]
        valid = torch.arange(q - 1, device=argmax.device)[None, :] < v.num_drafts[:, None]
        accepted = ((drafts == argmax[:, :-1]) & valid).to(torch.int32).cumprod(1).sum(1)
        return torch.cat([accepted[:, None].to(argmax.dtype), argmax], dim=1), logits

    def _draft_fn(self, v: DecodeViews) -> torch.Tensor:
        r, bp, q = self.r, v.batch, v.q_len
        r.drafter.write_context(self.features[v.ctx_rows], v.ctx_positions, v.ctx_slots)
        meta = DraftMetadata(ctx_positions=v.ctx_positions, ctx_slots=v.ctx_slots, block_positions=v.positions,
                             block_slots=v.slots,
                             decode=DecodeMetadata(v.tables, v.draft_seq_lens, v.draft_kv_start, q))
        hidden = r.drafter.forward_blocks(r.target.embed(v.draft_tokens), meta)
        hidden = hidden.view(bp, q, -1)[:, 1:]
        drafts = r.drafter.compute_logits(hidden, r.target.lm_head_weight).argmax(-1)
        v.tokens.view(bp, q)[:, 1:].copy_(drafts)  # straight into the verify input
        return drafts

    def _fill_dummy(self, v: DecodeViews) -> None:
        self.graphs.upload(v.batch, self._pack([], v.batch))

    # ---- host side ------------------------------------------------------------------------------

    def _pack(self, items: list[ScheduledSeq], bp: int) -> dict[str, list[int]]:
        """The step's integer inputs per section; rows past len(items) are padding on the scratch block."""
        r, q, k = self.r, self.q, self.k
        bs, scratch = r.block_size, r.scratch_block
        scratch_slots = [scratch * bs + i % bs for i in range(q)]
        h: dict[str, list[int]] = {name: [] for name in DecodeGraphs.section_names()}
        for item in items:
            seq = item.seq
            anchor = seq.num_tokens - 1
            h["tokens"] += [seq.token_ids(anchor, anchor + 1)[0]] + [0] * k
            h["positions"] += range(anchor, anchor + q)
            h["slots"] += [r._slot(seq, anchor + i) if i <= item.num_drafts else scratch_slots[i] for i in range(q)]
            h["tables"] += seq.block_table + [scratch] * (self.graphs.max_blocks - len(seq.block_table))
            h["seq_lens"].append(anchor + q)
            h["draft_seq_lens"].append(anchor + item.num_drafts + 1)
            h["draft_kv_start"].append(0 if r.draft_window is None else max(0, anchor - r.draft_window))
            h["num_drafts"].append(item.num_drafts)
            rows = seq.feature_rows
            count = rows[1] if rows is not None else 0
            h["ctx_rows"] += [rows[0] + i if i < count else 0 for i in range(q)]
            h["ctx_positions"] += [seq.drafter_computed + i if i < count else 0 for i in range(q)]
            h["ctx_slots"] += [r._slot(seq, seq.drafter_computed + i) if i < count else scratch_slots[i]
                               for i in range(q)]
            if rows is not None:
                seq.drafter_computed += count
                seq.feature_rows = None
        pad = bp - len(items)
        h["tokens"] += [0] * (pad * q)
        h["positions"] += list(range(q)) * pad
        h["slots"] += scratch_slots * pad
        h["tables"] += [scratch] * (pad * self.graphs.max_blocks)
        h["seq_lens"] += [q] * pad
        h["draft_seq_lens"] += [q] * pad
        h["draft_kv_start"] += [0] * pad
        h["num_drafts"] += [0] * pad
        h["ctx_rows"] += [0] * (pad * q)
        h["ctx_positions"] += [0] * (pad * q)
        h["ctx_slots"] += scratch_slots * pad
        h["kv_start"] = [0] * bp
        h["draft_tokens"] = [t if i % q == 0 else r.mask_token_id for i, t in enumerate(h["tokens"])]
        return h

    def release_features(self, keep: set[int] | None = None) -> None:
        """Copy the committed feature rows of held sequences out of the shared buffer (before it is reused)."""
        for seq in self.holders:
            if seq.feature_rows is None or seq.finished or (keep is not None and id(seq) in keep):
                continue
            start, count = seq.feature_rows
            rows = self.features[start:start + count].clone()
            seq.pending_features = rows if seq.pending_features is None else torch.cat([seq.pending_features, rows])
            seq.feature_rows = None
        self.holders = []

    def execute(self, items: list[ScheduledSeq]) -> list[StepResult]:
        from blockspec.runner.model_runner import StepResult

        r, q = self.r, self.q
        batch = len(items)
        bp = self.graphs.bucket(batch)
        self.release_features(keep={id(i.seq) for i in items})
        # Features committed through the general path (e.g. a prefill) are projected eagerly, once.
        pending = [i.seq for i in items if i.seq.pending_features is not None]
        if pending and self.uses_drafter:
            feats, pos, slots = [], [], []
            for seq in pending:
                feats.append(seq.pending_features)
                pos += range(seq.drafter_computed, seq.drafter_computed + seq.pending_features.shape[0])
                slots += r._slots(seq, seq.drafter_computed, seq.drafter_computed + seq.pending_features.shape[0])
                seq.drafter_computed += seq.pending_features.shape[0]
                seq.pending_features = None
            r.drafter.write_context(torch.cat(feats), r._tensor(pos), r._tensor(slots))
        v = self.graphs.upload(bp, self._pack(items, bp))
        if self.k and r.synthetic is not None:
            drafts = r._synthetic_drafts(items)
            if drafts is not None:
                index = [b * q + 1 + i for b, item in enumerate(items) for i in range(item.num_drafts)]
                v.tokens.index_copy_(0, r._tensor(index), drafts)
        elif self.uses_drafter:
            self.graphs.run("draft", bp, self._draft_fn)
        greedy, logits = self.graphs.run("target", bp, self._target_fn)
        seqs = [i.seq for i in items]
        if greedy_only(seqs):
            host = greedy[:batch].tolist()  # the step's one device-to-host copy
            rows = [(row[0], row[1:row[0] + 2], None) for row in host]
        else:
            logits = logits.view(bp, q, -1)[:batch]
            rows = accept(seqs, [i.num_drafts for i in items], logits, v.tokens.view(bp, q)[:batch], r.device)
        results = [StepResult(item.seq, tokens, item.num_drafts, a, lps) for item, (a, tokens, lps) in zip(items, rows)]
        committed = [1 + res.num_accepted for res in results]
        r._commit_state(items, committed)
        for b, (seq, n) in enumerate(zip(seqs, committed)):
            seq.num_computed += n
            if self.uses_drafter:
                seq.feature_rows = (b * q, n)
        self.holders = seqs if self.uses_drafter else []
        return results
