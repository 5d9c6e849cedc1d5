"""Executes one scheduled step: draft, verify in one target pass, accept.

The runner turns a `SchedulerOutput` into tensors, asks the proposer (spec/proposer.py: a DFlash drafter,
the target's MTP head, synthetic drafts) for drafts from the new context, runs the target over prefill
chunks and verify blocks together, and decides acceptance on the device. The only device-to-host copy of
a step is the accepted counts and tokens (plus log-probabilities when a request asks for them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.device import upload
from blockspec.engine.scheduler import ScheduledSeq, SchedulerOutput
from blockspec.engine.sequence import Sequence, TokenLogprob
from blockspec.models.layers.attention import forward_context, ragged_metadata
from blockspec.models.layers.recurrent_state import StateMetadata
from blockspec.runner.acceptance import accept
from blockspec.runner.decode_step import DecodeStep
from blockspec.runner.prefill_graphs import PrefillGraphs, graph_prefill_supported
from blockspec.spec.proposer import Drafts, Proposer, StepContext, TargetNeeds


@dataclass
class StepResult:
    seq: Sequence
    tokens: list[int]  # committed this step (empty for a prefill chunk that does not finish)
    num_drafts: int
    num_accepted: int
    logprobs: list[TokenLogprob] | None = None


class ModelRunner:
    def __init__(self, target: torch.nn.Module, proposer: Proposer | None, device: torch.device,
                 dtype: torch.dtype, block_size: int, draft_window: int | None = None) -> None:
        self.target = target
        self.proposer = proposer  # None: plain decoding
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.draft_window = draft_window
        self.num_blocks = 0
        self.num_speculative_tokens = 0
        self.decode: DecodeStep | None = None  # CUDA fast path for uniform decode/verify steps
        self.prefill: PrefillGraphs | None = None  # CUDA graphs for one sequence's short prefill

    # ---- CUDA decode fast path --------------------------------------------------------------

    def prepare_decode(self, max_batch: int, max_model_len: int, use_graphs: bool, log=print,
                       prefill_graph_tokens: int = 0) -> float:
        """Set up the uniform-decode fast path (and capture its CUDA graphs) and, when prefill_graph_tokens > 0
        (--prefill-cuda-graphs: the step's token budget), the short-prefill graphs; returns capture seconds."""
        self.decode = DecodeStep(self, max_batch, max_model_len, use_graphs)
        elapsed = self.decode.capture(log)
        self.prefill = None
        if prefill_graph_tokens and use_graphs and self.device.type == "cuda":
            if graph_prefill_supported(self.target):
                self.prefill = PrefillGraphs(self, prefill_graph_tokens, max_model_len)
                elapsed += self.prefill.capture(self.needs.layer_ids, log)
            else:
                log("prefill CUDA graphs: not for this model (its recurrent state would advance over padded "
                    "rows): prefills run eagerly")
        return elapsed

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    @property
    def needs(self) -> TargetNeeds:
        """What the proposer reads from each target pass."""
        return self.proposer.needs if self.proposer is not None else TargetNeeds()

    @property
    def keeps_context(self) -> bool:
        """The proposer keeps per-position context K/V (DFlash, MTP), so a cached block is complete only once
        its proposer context is written (synthetic drafts keep none)."""
        return self.proposer is not None and bool(self.proposer.attention_layers)

    @property
    def mask_token_id(self) -> int:
        config = getattr(self.proposer, "config", None)
        return getattr(config, "mask_token_id", 0)

    def step_context(self) -> StepContext:
        return StepContext(self.target, self.device, self.dtype, self.block_size, self.draft_window)

    def _uniform_decode(self, items: list[ScheduledSeq]) -> bool:
        return (self.decode is not None and 0 < len(items) <= self.decode.max_batch
                and all(i.num_new == 1 and i.samples for i in items))

    # ---- memory -------------------------------------------------------------------------------

    def _kv_layers(self) -> list:
        return list(self.target.attention_layers) + (self.proposer.attention_layers if self.proposer else [])

    def kv_bytes_per_block(self) -> int:
        """Target plus proposer K/V bytes for one block of positions."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        per_token = sum(2 * a.num_kv_heads * a.head_dim for a in self._kv_layers())
        return per_token * elem * self.block_size

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """num_blocks usable blocks plus one scratch block (index num_blocks) for padded rows."""
        self.num_blocks = num_blocks
        layers = self._kv_layers()
        for layer in layers:
            shape = (num_blocks + 1 if num_blocks else 0, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    # ---- helpers ------------------------------------------------------------------------------

    def _tensor(self, values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return upload(values, dtype, self.device)


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
        drafts = self.proposer.propose(items, self.step_context()) if self.proposer is not None else None
        hidden, features, offsets = self._target(items, drafts)
        results = self._sample(items, hidden, offsets, drafts)
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

    @torch.inference_mode()
    def complete_context(self, seq: Sequence) -> None:
        """A finishing sequence's last committed positions into the proposer's cache, so that all its full
        blocks can enter the prefix cache (without it, a 1-token request would leave nothing cacheable)."""
        if self.proposer is None:
            return
        if self.decode is not None:
            self.decode.copy_out(seq)
        if seq.pending_features is not None:
            self.proposer.write_pending([seq], self.step_context(), keep_last=False)

    def _commit_state(self, items: list[ScheduledSeq], committed: list[int]) -> None:
        commit_state = getattr(self.target, "commit_state", None)
        if commit_state is not None:
            # Recurrent layers (Gated DeltaNet, Mamba) keep a state per verified position during the
            # pass; each sequence continues from the state after its last committed position.
            commit_state([item.seq for item in items], committed)

    def _target(self, items: list[ScheduledSeq], drafts: Drafts | None
                ) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        bucket = self.prefill.bucket(items) if self.prefill is not None else None
        if bucket is not None:  # one sequence's short prefill: a graph replay
            seq, n = items[0].seq, items[0].num_new
            hidden, layers, self._last_tokens = self.prefill.run(items, bucket,
                                                                 seq.token_ids(seq.num_computed, seq.num_computed + n))
            features = self.needs.select(hidden, layers)
            return hidden, (features.clone() if features is not None else None), [0]  # kept past the next replay
        tokens, positions, spans, offsets, draft_at, counts = [], [], [], [], [], []
        for item in items:
            seq = item.seq
            start, n = seq.num_computed, item.num_new + item.num_drafts
            offsets.append(len(tokens))
            tokens.extend(seq.token_ids(start, start + item.num_new))
            draft_at.extend(range(len(tokens), len(tokens) + item.num_drafts))
            tokens.extend([0] * item.num_drafts)
            positions.extend(range(start, start + n))
            spans.append((seq.block_table, start, n))
            if item.num_drafts:
                counts.append(item.num_drafts)
        deterministic = getattr(self.target, "deterministic", False)  # prefill through the paged kernel too
        meta = ragged_metadata(spans, self.block_size, self.device, block_tables=deterministic)
        # On GPU only: the CPU path stays the single reference that the exactness tests compare.
        meta.fresh_prefill = (self.device.type == "cuda" and len(items) == 1 and items[0].seq.num_computed == 0
                              and items[0].num_drafts == 0)
        pos_t = self._tensor(positions)
        if getattr(self.target, "has_recurrent_state", False):  # hybrid models: each sequence's state slot
            meta.state = StateMetadata.for_items(items, offsets, self.device)
        token_t = self._tensor(tokens)
        if draft_at:
            width = drafts.tokens.shape[1]
            real = torch.arange(width, device=self.device)[None, :] < self._tensor(counts)[:, None]
            token_t.index_copy_(0, self._tensor(draft_at), drafts.tokens[real])
        self._last_tokens = token_t
        needs = self.needs
        with forward_context(meta):
            hidden, features = self.target(token_t, pos_t, needs.layer_ids)
        return hidden, needs.select(hidden, features), offsets

    def _sample(self, items: list[ScheduledSeq], hidden: torch.Tensor, offsets: list[int],
                drafts: Drafts | None = None) -> list[StepResult]:
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
        draft_probs = None
        if drafts is not None and drafts.q is not None:  # sampled drafts: q of each row that drafted
            drafting = [b for b, item in enumerate(items) if item.num_drafts]
            draft_probs = logits.new_zeros(len(rows), k, logits.shape[-1], dtype=torch.float32)
            sub = self._tensor([rows.index(b) for b in drafting])
            draft_probs.index_copy_(0, sub, drafts.dense_q(logits.shape[-1]))
        accepted = accept([items[b].seq for b in rows], [items[b].num_drafts for b in rows], logits,
                          self._last_tokens[index_t], self.device, draft_probs)
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
