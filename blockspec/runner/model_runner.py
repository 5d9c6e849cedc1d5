"""Executes one scheduled step: draft, verify in one target pass, accept.

The runner turns a `SchedulerOutput` into tensors, runs the drafter over the new context features
and the [anchor, MASK * k] blocks, runs the target over prefill chunks and verify blocks together,
and decides acceptance on the device. The only device-to-host copy of a step is the accepted
counts and tokens (plus log-probabilities when a request asks for them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.device import upload
from blockspec.engine.scheduler import ScheduledSeq, SchedulerOutput
from blockspec.engine.sequence import Sequence, TokenLogprob
from blockspec.models.layers.attention import AttentionMetadata, forward_context
from blockspec.models.layers.recurrent_state import StateMetadata
from blockspec.runner.acceptance import accept
from blockspec.runner.decode_step import DecodeStep
from blockspec.spec.dflash import DFlashDrafter, DraftMetadata
from blockspec.spec.synthetic import SyntheticProposer


@dataclass
class StepResult:
    seq: Sequence
    tokens: list[int]  # committed this step (empty for a prefill chunk that does not finish)
    num_drafts: int
    num_accepted: int
    logprobs: list[TokenLogprob] | None = None


def _pad_index(lengths: list[int], starts: list[int]) -> tuple[list[list[int]], list[int]]:
    """Padded [B, max(lengths)] indices into a flat array and the flat positions of the real ones."""
    width = max(lengths) if lengths else 0
    index, unpad = [], []
    for b, (n, s) in enumerate(zip(lengths, starts)):
        index.append([s + i for i in range(n)] + [s] * (width - n))
        unpad.extend(b * width + i for i in range(n))
    return index, unpad


class ModelRunner:
    def __init__(self, target: torch.nn.Module, drafter: DFlashDrafter | None, device: torch.device,
                 dtype: torch.dtype, block_size: int, draft_window: int | None = None) -> None:
        self.target = target
        self.drafter = drafter
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.draft_window = draft_window
        self.capture_layer_ids = tuple(drafter.config.target_layer_ids) if drafter is not None else ()
        self.mask_token_id = drafter.config.mask_token_id if drafter is not None else 0
        self.num_blocks = 0
        self.synthetic: SyntheticProposer | None = None  # benchmark/test mode: drafts from known tokens
        self.num_speculative_tokens = 0
        self.decode: DecodeStep | None = None  # CUDA fast path for uniform decode/verify steps

    # ---- CUDA decode fast path --------------------------------------------------------------

    def prepare_decode(self, max_batch: int, max_model_len: int, use_graphs: bool, log=print) -> float:
        """Set up the uniform-decode fast path (and capture its CUDA graphs); returns capture seconds."""
        self.decode = DecodeStep(self, max_batch, max_model_len, use_graphs)
        return self.decode.capture(log)

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    def _uniform_decode(self, items: list[ScheduledSeq]) -> bool:
        return (self.decode is not None and 0 < len(items) <= self.decode.max_batch
                and all(i.num_new == 1 and i.samples for i in items))

    # ---- memory -------------------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        """Target plus drafter K/V bytes for one block of positions."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        per_token = sum(2 * a.num_kv_heads * a.head_dim for a in self.target.attention_layers)
        if self.drafter is not None:
            per_token += sum(2 * a.num_kv_heads * a.head_dim for a in self.drafter.attention_layers)
        return per_token * elem * self.block_size

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """num_blocks usable blocks plus one scratch block (index num_blocks) for padded rows."""
        self.num_blocks = num_blocks
        layers = list(self.target.attention_layers)
        if self.drafter is not None:
            layers += list(self.drafter.attention_layers)
        for layer in layers:
            shape = (num_blocks + 1 if num_blocks else 0, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    # ---- helpers ------------------------------------------------------------------------------

    def _tensor(self, values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return upload(values, dtype, self.device)

    def _slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        return [self._slot(seq, p) for p in range(start, end)]

    # ---- the step -----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> list[StepResult]:
        items = sched.items
        self._restore_snapshots(items)
        if self._uniform_decode(items):
            return self.decode.execute(items)
        if self.decode is not None:
            self.decode.drop_inflight()
            self.decode.release_features()  # the general path reads pending_features
        drafts = self._draft(items) if self.drafter is not None or self.synthetic is not None else None
        hidden, features, offsets = self._target(items, drafts)
        results = self._sample(items, hidden, offsets)
        committed = [item.num_new + (res.num_accepted if item.samples else 0) for item, res in zip(items, results)]
        self._commit_state(items, committed)
        for item, start, n in zip(items, offsets, committed):
            self._advance(item, start, n, features)
        return results

    def _restore_snapshots(self, items: list[ScheduledSeq]) -> None:
        """Sequences starting on a cached prefix of a hybrid: their state slots from the prefix's snapshot
        (before this step's pass, which may itself overwrite that entry with a new snapshot)."""
        starting = [item.seq for item in items if item.seq.restore_snapshot is not None]
        if starting:
            self.target.restore_state([s.state_slot for s in starting], [s.restore_snapshot for s in starting])
            for seq in starting:
                seq.restore_snapshot = None

    def project_pending(self, seqs: list[Sequence]) -> None:
        """Write the drafter's context K/V for the sequences' pending features now (one drafter pass)."""
        seqs = [s for s in seqs if s.pending_features is not None]
        if not seqs or self.drafter is None:
            return
        feats, pos, slots = [], [], []
        for seq in seqs:
            n = seq.pending_features.shape[0]
            feats.append(seq.pending_features)
            pos += range(seq.drafter_computed, seq.drafter_computed + n)
            slots += self._slots(seq, seq.drafter_computed, seq.drafter_computed + n)
            seq.drafter_computed += n
            seq.pending_features = None
        self.drafter.write_context(torch.cat(feats), self._tensor(pos), self._tensor(slots))

    @torch.inference_mode()
    def complete_context(self, seq: Sequence) -> None:
        """A finishing sequence's last committed positions into the drafter's cache, so that all its full
        blocks can enter the prefix cache (without it, a 1-token request would leave nothing cacheable)."""
        if self.drafter is None:
            return
        if self.decode is not None:
            self.decode.copy_out(seq)
        self.project_pending([seq])

    def _commit_state(self, items: list[ScheduledSeq], committed: list[int]) -> None:
        commit_state = getattr(self.target, "commit_state", None)
        if commit_state is not None:
            # Recurrent layers (Gated DeltaNet, Mamba) keep a state per verified position during the
            # pass; each sequence continues from the state after its last committed position.
            commit_state([item.seq for item in items], committed)

    def _draft(self, items: list[ScheduledSeq]) -> torch.Tensor | None:
        """One drafter pass: project pending context features; draft for decoding sequences."""
        if self.synthetic is not None:
            return self._synthetic_drafts(items)
        inputs = self.draft_inputs(items)
        if inputs is None:
            return None
        features, embeds, meta, rows = inputs
        hidden = self.drafter(features, embeds, meta)
        if not rows:
            return None
        logits = self.drafter.compute_logits(hidden[self._tensor(rows)], self.target.lm_head_weight)
        return logits.argmax(-1)

    def draft_inputs(self, items: list[ScheduledSeq]
                     ) -> tuple[torch.Tensor, torch.Tensor, DraftMetadata, list[int]] | None:
        """Drafter inputs for a step, consuming the sequences' pending features.

        Returns (context features, block embeddings, metadata, rows of the block outputs that
        become drafts: offsets 1..k of every block), or None when the drafter has nothing to do.
        """
        feats, ctx_pos, ctx_slots = [], [], []
        block_tokens, block_pos, q_lens, kv_slots, key_pos, query_pos = [], [], [], [], [], []
        for item in items:
            seq = item.seq
            if seq.pending_features is not None:
                feats.append(seq.pending_features)
                ctx_pos.extend(range(seq.drafter_computed, seq.num_computed))
                ctx_slots.extend(self._slots(seq, seq.drafter_computed, seq.num_computed))
                seq.drafter_computed, seq.pending_features = seq.num_computed, None
            if item.num_drafts:
                anchor = seq.num_tokens - 1
                lo = 0 if self.draft_window is None else max(0, anchor - self.draft_window)
                block_tokens.append(seq.output_ids[-1])
                block_tokens.extend([self.mask_token_id] * item.num_drafts)
                block_pos.extend(range(anchor, anchor + item.num_drafts + 1))
                q_lens.append(item.num_drafts + 1)
                kv_slots.append(self._slots(seq, lo, anchor))
                key_pos.append(list(range(lo, anchor)))
                query_pos.append(list(range(anchor, anchor + item.num_drafts + 1)))
        if not feats and not block_tokens:
            return None
        starts = [sum(q_lens[:b]) for b in range(len(q_lens))]
        query_index, query_unpad = _pad_index(q_lens, starts)
        lc = max((len(s) for s in kv_slots), default=0)
        qmax = max(q_lens, default=0)
        keys = [kp + [-1] * (lc - len(kp)) + qp + [-1] * (qmax - len(qp)) for kp, qp in zip(key_pos, query_pos)]
        b = len(q_lens)
        meta = DraftMetadata(
            ctx_positions=self._tensor(ctx_pos),
            ctx_slots=self._tensor(ctx_slots),
            block_positions=self._tensor(block_pos),
            query_index=self._tensor(query_index).view(b, qmax),
            query_unpad=self._tensor(query_unpad),
            kv_slots=self._tensor([s + [0] * (lc - len(s)) for s in kv_slots]).view(b, lc),
            key_pos=self._tensor(keys).view(b, lc + qmax),
            query_pos=self._tensor([q + [q[-1]] * (qmax - len(q)) for q in query_pos]).view(b, qmax),
        )
        hidden_size = self.drafter.config.model.hidden_size
        features = torch.cat(feats) if feats else torch.zeros(0, 1, device=self.device, dtype=self.dtype)
        embeds = self.target.embed(self._tensor(block_tokens)) if block_tokens else \
            torch.zeros(0, hidden_size, device=self.device, dtype=self.dtype)
        rows = [s + i for s, n in zip(starts, q_lens) for i in range(1, n)]
        return features, embeds, meta, rows

    def _synthetic_drafts(self, items: list[ScheduledSeq]) -> torch.Tensor | None:
        drafts = [t for item in items if item.num_drafts for t in self.synthetic.propose(item.seq, item.num_drafts)]
        return self._tensor(drafts) if drafts else None

    def _target(self, items: list[ScheduledSeq], drafts: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        tokens, positions, slots, q_lens, offsets, kv, draft_at = [], [], [], [], [], [], []
        for item in items:
            seq = item.seq
            start, n = seq.num_computed, item.num_new + item.num_drafts
            offsets.append(len(tokens))
            tokens.extend(seq.token_ids(start, start + item.num_new))
            draft_at.extend(range(len(tokens), len(tokens) + item.num_drafts))
            tokens.extend([0] * item.num_drafts)
            positions.extend(range(start, start + n))
            slots.extend(self._slots(seq, start, start + n))
            q_lens.append(n)
            kv.append(self._slots(seq, 0, start + n))
        lmax = max(len(s) for s in kv)
        qmax = max(q_lens)
        query_index, query_unpad = _pad_index(q_lens, offsets)
        pos_t = self._tensor(positions)
        kv_len = self._tensor([len(s) for s in kv])
        qpos = self._tensor(query_index).view(len(items), qmax)
        query_pos = pos_t[qpos]
        key = torch.arange(lmax, device=self.device)
        mask = (key[None, None, :] <= query_pos[:, :, None]) & (key[None, None, :] < kv_len[:, None, None])
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            query_index=qpos,
            query_unpad=self._tensor(query_unpad),
            kv_slots=self._tensor([s + [0] * (lmax - len(s)) for s in kv]).view(len(items), lmax),
            mask=mask[:, None],
            query_pos=query_pos,
            # On GPU only: the CPU path stays the single reference that the exactness tests compare.
            fresh_prefill=(self.device.type == "cuda" and len(items) == 1 and items[0].seq.num_computed == 0
                           and items[0].num_drafts == 0),
        )
        if getattr(self.target, "has_recurrent_state", False):  # hybrid models: each sequence's state slot
            meta.state = StateMetadata.for_items(items, offsets, self.device)
        token_t = self._tensor(tokens)
        if draft_at:
            token_t.index_copy_(0, self._tensor(draft_at), drafts)
        self._last_tokens = token_t
        with forward_context(meta):
            hidden, features = self.target(token_t, pos_t, self.capture_layer_ids)
        return hidden, features, offsets

    def _sample(self, items: list[ScheduledSeq], hidden: torch.Tensor, offsets: list[int]) -> list[StepResult]:
        results = [StepResult(item.seq, [], item.num_drafts, 0) for item in items]
        rows = [b for b, item in enumerate(items) if item.samples]
        if not rows:
            return results
        k = max(items[b].num_drafts for b in rows)
        # [R, K+1] flat indices of the verified positions (padding repeats the row's last one).
        index = []
        for b in rows:
            first = offsets[b] + items[b].num_new - 1
            n = items[b].num_drafts + 1
            index.append([first + min(i, n - 1) for i in range(k + 1)])
        index_t = self._tensor(index)
        logits = self.target.compute_logits(hidden[index_t.view(-1)]).view(len(rows), k + 1, -1)
        accepted = accept([items[b].seq for b in rows], [items[b].num_drafts for b in rows], logits,
                          self._last_tokens[index_t], self.device)
        for b, (a, tokens, lps) in zip(rows, accepted):
            results[b].num_accepted, results[b].tokens, results[b].logprobs = a, tokens, lps
        return results

    def _advance(self, item: ScheduledSeq, start: int, committed: int, features: torch.Tensor | None) -> None:
        """Move the sequence's computed frontier; keep the committed positions' context features.

        Attention K/V written past the frontier (rejected drafts) need no undo: those slots are
        simply overwritten by the next step.
        """
        seq = item.seq
        if features is not None:
            new = features[start:start + committed]
            seq.pending_features = new if seq.pending_features is None else torch.cat([seq.pending_features, new])
        seq.num_computed += committed
