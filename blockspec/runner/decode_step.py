"""The fast path for uniform decode/verify steps (every sequence: its anchor plus up to k drafts).

Per step: one host-to-device copy of a few integers per sequence, a one-kernel graph deriving the
step's indices from them, one drafter graph (project the context features the previous step
committed, denoise the blocks, write the drafts into the verify input), one target graph (verify
pass, logits, greedy acceptance), one device-to-host copy of [accepted, tokens] per row.

Pipelined decoding (CUDA): when every row is greedy and cannot reach its end within the next step,
the next step is launched before this one's tokens are read back; its inputs are advanced on the
device from this step's acceptance. The GPU then never waits for the host's per-step work
(detokenizing, stop checks, scheduling). If the next schedule is not that step (a sequence finished
or joined), the chained step is dropped: it only wrote K/V past the committed frontier, which the
next step overwrites, and the drafter context it projected is correct either way.

Hybrid targets (Gated DeltaNet layers) keep each sequence's recurrent state in a slot pair: a step
reads `seq.state_slot` and commits into its partner inside the target graph (the greedy acceptance is
there; sampled steps commit again once the host has decided), and the host flips `seq.state_slot`
when it consumes the step. A dropped chained step has then only written spare slots.

Context features stay on the device between steps: the target graph writes every verified position's
features (what the proposer needs: spec/proposer.py) into a persistent buffer, and the next step's
drafter graph gathers the committed rows from it. A sequence that is not in the next decode step gets its
rows copied out (`pending_features`) before the buffer is overwritten, so the general path can pick them
up. Context a general-path step left (`pending_features`) is taken by the proposer eagerly before the
launch, except each sequence's last position, which joins the step through a carry row of the buffer (the
MTP head drafts from that position's output).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from blockspec.engine.scheduler import ScheduledSeq
from blockspec.engine.sequence import Sequence
from blockspec.kernels.decode_inputs import ROW_INPUTS, decode_inputs
from blockspec.models.layers.attention import AttentionMetadata, DecodeMetadata, forward_context
from blockspec.models.layers.recurrent_state import DecodeStateMetadata
from blockspec.runner.acceptance import accept, greedy_only
from blockspec.runner.decode_graphs import DecodeGraphs, DecodeViews
from blockspec.spec.proposer import DecodeInputs, Drafts, exponential_noise

if TYPE_CHECKING:
    from blockspec.runner.model_runner import ModelRunner, StepResult


@dataclass
class _Launch:
    """A step queued on the device: which sequence each row holds, and where its result lands."""

    bp: int
    rows: list[Sequence | None]  # None: padding, or a sequence no longer in the batch
    num_drafts: list[int]
    result: torch.Tensor  # [bp, 1 + q]: accepted count, then the argmax tokens (host copy on GPU)
    event: torch.cuda.Event | None
    logits: torch.Tensor | None = None
    state: DecodeStateMetadata | None = None  # hybrids: what a re-commit with sampled counts needs
    drafts: Drafts | None = None  # the proposer's output (its q, when it sampled, for the sampled accept)

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.result


class DecodeStep:
    def __init__(self, runner: ModelRunner, max_batch: int, max_model_len: int, use_graphs: bool) -> None:
        self.r = runner
        self.k = runner.num_speculative_tokens
        self.q = self.k + 1
        self.max_model_len = max_model_len
        max_blocks = -(-(max_model_len + self.q) // runner.block_size)
        self.graphs = DecodeGraphs(runner.device, max_batch, self.q, max_blocks, use_graphs)
        self.proposer = runner.proposer if self.k > 0 else None
        self.uses_drafter = self.proposer is not None
        self.recurrent = bool(getattr(runner.target, "has_recurrent_state", False))
        self.scratch_state = runner.target.state_scratch_slot if self.recurrent else 0
        needs = runner.needs
        width = needs.width(runner.target.config.hidden_size) if self.uses_drafter else 0
        # verify rows, then one carry row per batch row (a general-path step's last context position)
        rows = max_batch * self.q + max_batch
        self.carry_row0 = max_batch * self.q
        self.features = torch.zeros(rows, width, device=runner.device, dtype=runner.dtype)
        self.feature_tokens = (torch.zeros(rows, dtype=torch.int64, device=runner.device)
                               if self.uses_drafter and needs.next_tokens else None)
        candidates = self.proposer.num_candidates if self.uses_drafter else 0
        # proposers that sample their drafts: each row's temperature (0: greedy) and its Exp(1) draws
        self.temperature = torch.zeros(max_batch, device=runner.device) if candidates else None
        self.draft_noise = torch.ones(max_batch, self.k, candidates, device=runner.device) if candidates else None
        self.holders: list[Sequence] = []  # sequences whose committed features sit in self.features
        # Chain the next step before reading this one (only worth it where the device runs ahead).
        self.pipelined = self.graphs.use_graphs
        self.inflight: _Launch | None = None
        self.chained_used = self.chained_dropped = 0  # chained steps that were / were not the next step
        cuda = runner.device.type == "cuda"
        # Two of each host buffer: one step's copies may still be queued while the next is written.
        self._staging = [torch.zeros(self.graphs.host_size(max_batch), dtype=torch.int64, pin_memory=cuda)
                         for _ in range(2)]
        self._staged: list[torch.cuda.Event | None] = [None, None]
        self._results = [torch.zeros(max_batch, self.q + 1, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._turn = 0
        self._sampling_staged = False  # the temperature buffer holds a sampled step's temperatures
        self._greedy: torch.Tensor | None = None  # eager mode: the last verify pass's [accepted, argmax]

    @property
    def max_batch(self) -> int:
        return self.graphs.buckets[-1]

    def capture(self, log) -> float:
        fns = {"prepare": self._prepare_fn}
        if self.uses_drafter and self.proposer.in_graph:
            fns["draft"] = self._draft_fn
        fns["target"] = self._target_fn
        if self.pipelined:
            fns["advance"] = self._advance_fn
        return self.graphs.capture(fns, self._fill_dummy, log)

    # ---- graphs ---------------------------------------------------------------------------------

    def _derive(self, v: DecodeViews, greedy: torch.Tensor | None) -> None:
        r = self.r
        decode_inputs(v.parts, greedy, r.scratch_block, r.block_size, r.mask_token_id, r.draft_window)

    def _prepare_fn(self, v: DecodeViews) -> None:
        self._derive(v, None)

    def _advance_fn(self, v: DecodeViews) -> None:
        """The chained step's inputs: each live row moved past what the previous verify pass accepted."""
        greedy = self.graphs.output("target", v.batch)[0] if self.graphs.use_graphs else self._greedy
        self._derive(v, greedy)

    def _target_fn(self, v: DecodeViews) -> tuple[torch.Tensor, torch.Tensor, DecodeStateMetadata | None]:
        r, bp, q = self.r, v.batch, v.q_len
        meta = AttentionMetadata(slot_mapping=v.slots, decode=DecodeMetadata(v.tables, v.seq_lens, v.kv_start, q))
        if self.recurrent:
            meta.state_decode = DecodeStateMetadata(v.state_slot, v.state_slot ^ 1, q)
        needs = r.needs
        with forward_context(meta):
            hidden, features = r.target(v.tokens, v.positions, needs.layer_ids)
        kept = needs.select(hidden, features) if self.uses_drafter else None
        if kept is not None:
            self.features[: bp * q].copy_(kept)
            if self.feature_tokens is not None:
                self.feature_tokens[: bp * q].copy_(v.tokens)
        logits = r.target.compute_logits(hidden)
        # Greedy acceptance inside the graph: [accepted, argmax_0..argmax_k] per row.
        argmax = logits.argmax(-1).view(bp, q)
        drafts = v.tokens.view(bp, q)[:, 1:]
        valid = torch.arange(q - 1, device=argmax.device)[None, :] < v.num_drafts[:, None]
        accepted = ((drafts == argmax[:, :-1]) & valid).to(torch.int32).cumprod(1).sum(1)
        if meta.state_decode is not None and meta.state_decode.speculative:  # commit the greedy acceptance
            r.target.commit_decode(meta.state_decode, accepted.to(torch.int64) + 1)
        return torch.cat([accepted[:, None].to(argmax.dtype), argmax], dim=1), logits, meta.state_decode

    def _draft_fn(self, v: DecodeViews) -> Drafts:
        bp, q = v.batch, v.q_len
        sampling = self.temperature is not None
        inputs = DecodeInputs(v, self.features, self.feature_tokens, self.temperature[:bp] if sampling else None,
                              self.draft_noise[:bp] if sampling else None)
        drafts = self.proposer.propose_decode(inputs, self.r.target)
        v.tokens.view(bp, q)[:, 1:].copy_(drafts.tokens)  # straight into the verify input
        return drafts

    def _fill_dummy(self, v: DecodeViews) -> None:
        """Every row padding (scratch block), for graph capture."""
        staging = self._stage(v.batch, [None] * v.batch, [0] * v.batch, [])
        self.graphs.upload(v.batch, staging)
        self._derive(self.graphs.views(v.batch), None)

    # ---- host side ------------------------------------------------------------------------------

    def _next_staging(self) -> torch.Tensor:
        """A staging buffer whose previous copy to the device has been carried out."""
        self._turn ^= 1
        event = self._staged[self._turn]
        if event is not None:
            event.synchronize()
        return self._staging[self._turn]

    def _staged_now(self) -> None:
        if self.r.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._staged[self._turn] = event

    def _stage(self, bp: int, rows: list[Sequence | None], num_drafts: list[int],
               items: list[ScheduledSeq] | None = None) -> torch.Tensor:
        """Write the host sections for rows (None: padding). With `items` (a fresh step) every row
        input is written and the committed feature rows handed to the drafter; without, only the
        draft counts and block tables (a chained step: the device advances the rest)."""
        staging = self._next_staging()
        h = self.graphs.host_views(staging, bp)
        tables = h["tables"].numpy()
        tables.fill(self.r.scratch_block)
        for b, seq in enumerate(rows):
            if seq is not None:
                table = seq.block_table[: tables.shape[1]]  # lookahead blocks may pass the last position
                tables[b, : len(table)] = table
        h["num_drafts"].numpy()[:] = [n if seq is not None else 0 for n, seq in zip(num_drafts, rows)]
        if items is not None:
            h["state_slot"].numpy()[:] = [seq.state_slot if seq is not None and seq.state_slot is not None
                                          else self.scratch_state for seq in rows]
            anchor, token, pos0, count, row0 = ([0] * bp for _ in range(5))
            for b, item in enumerate(items):
                seq = item.seq
                anchor[b] = seq.num_tokens - 1
                token[b] = seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1]
                pos0[b] = seq.drafter_computed
                if seq.feature_rows is not None:
                    row0[b], count[b] = seq.feature_rows
                    seq.drafter_computed += count[b]
                    seq.feature_rows = None
            for name, values in zip(ROW_INPUTS, (anchor, token, pos0, count, row0)):  # then num_drafts, tables
                h[name].numpy()[:] = values
        return staging

    def _launch(self, bp: int, rows: list[Sequence | None], num_drafts: list[int], chained: bool,
                host_items: list[ScheduledSeq] | None = None) -> _Launch:
        """Queue a step whose host sections are staged: derive the indices, draft, verify, copy back.
        `host_items`: the step's items, for a proposer that drafts on the host (outside the graphs)."""
        r, q = self.r, self.q
        v = self.graphs.upload(bp, self._staging[self._turn], "num_drafts" if chained else "anchor")
        self._staged_now()
        self.graphs.run("advance" if chained else "prepare", bp, self._advance_fn if chained else self._prepare_fn)
        drafts = None
        if host_items is not None:
            drafts = self.proposer.propose(host_items, r.step_context())
            if drafts is not None:
                drafting = [(b, item.num_drafts) for b, item in enumerate(host_items) if item.num_drafts]
                index = [b * q + 1 + i for b, n in drafting for i in range(n)]
                values = torch.cat([drafts.tokens[j, :n] for j, (_, n) in enumerate(drafting)])
                v.tokens.index_copy_(0, r._tensor(index), values)
        elif self.uses_drafter:
            drafts = self.graphs.run("draft", bp, self._draft_fn)
        greedy, logits, state = self.graphs.run("target", bp, self._target_fn)
        self._greedy = greedy
        if r.device.type == "cuda":
            result = self._results[self._turn][:bp]
            result.copy_(greedy[:bp], non_blocking=True)  # the step's one device-to-host copy
            event = torch.cuda.Event()
            event.record()
        else:
            result, event = greedy[:bp], None
        return _Launch(bp, rows, num_drafts, result, event, logits, state, drafts)

    def release_features(self, keep: set[int] | None = None) -> None:
        """Copy the committed feature rows of held sequences out of the shared buffer (before it is reused)."""
        for seq in self.holders:
            if not seq.finished and (keep is None or id(seq) not in keep):
                self.copy_out(seq)
        self.holders = []

    def copy_out(self, seq: Sequence) -> None:
        """seq's committed feature rows from the shared buffer into its pending_features."""
        if seq.feature_rows is None:
            return
        start, count = seq.feature_rows
        rows = self.features[start:start + count].clone()
        seq.pending_features = rows if seq.pending_features is None else torch.cat([seq.pending_features, rows])
        seq.feature_rows = None

    def drop_inflight(self) -> None:
        """Forget a chained step (it still runs, ahead of anything queued later; its results go unread)."""
        if self.inflight is not None:
            self.chained_dropped += 1
        self.inflight = None

    def _take_inflight(self, items: list[ScheduledSeq]) -> _Launch | None:
        """The chained step if it computes exactly this schedule for every item, else None."""
        launch = self.inflight
        if launch is None:
            return None
        row_of = {id(s): b for b, s in enumerate(launch.rows) if s is not None}
        for item in items:
            b = row_of.get(id(item.seq))
            if b is None or item.num_new != 1 or item.num_drafts != launch.num_drafts[b]:
                self.drop_inflight()
                return None
        self.inflight = None
        self.chained_used += 1
        keep = {id(item.seq) for item in items}
        launch.rows = [s if s is not None and id(s) in keep else None for s in launch.rows]
        return launch

    def _chainable(self, launch: _Launch) -> bool:
        """Whether the step after `launch` is already known up to its acceptance: every row greedy, with
        the same number of drafts however many tokens this step commits, and blocks for it allocated."""
        if not self.pipelined or (self.uses_drafter and not self.proposer.in_graph):
            return False
        seqs = [s for s in launch.rows if s is not None]
        if not seqs or not greedy_only(seqs):
            return False
        bs, q = self.r.block_size, self.q
        for seq in seqs:
            left = min(seq.max_tokens - seq.num_output, self.max_model_len - seq.num_tokens + 1)
            if left < 2 * q or len(seq.block_table) * bs < seq.num_tokens - 1 + 2 * q:
                return False
        return True

    def _launch_fresh(self, items: list[ScheduledSeq]) -> _Launch:
        bp = self.graphs.bucket(len(items))
        self.release_features(keep={id(i.seq) for i in items})
        if self.uses_drafter:
            self._take_pending(items)
            self._stage_sampling(items)
        rows: list[Sequence | None] = [i.seq for i in items] + [None] * (bp - len(items))
        num_drafts = [i.num_drafts for i in items] + [0] * (bp - len(items))
        self._stage(bp, rows, num_drafts, items)
        host = items if self.uses_drafter and not self.proposer.in_graph else None
        return self._launch(bp, rows, num_drafts, chained=False, host_items=host)

    def _take_pending(self, items: list[ScheduledSeq]) -> None:
        """Context a general-path step committed (e.g. a prefill): the proposer takes all but each sequence's
        last position now, eagerly; the last goes to the sequence's carry row, read by the step's graph."""
        pending = [i.seq for i in items if i.seq.pending_features is not None]
        if not pending:
            return
        self.proposer.write_pending(pending, self.r.step_context())
        for b, item in enumerate(items):
            seq = item.seq
            if seq.pending_features is None:
                continue
            row = self.carry_row0 + b
            self.features[row].copy_(seq.pending_features[-1])
            seq.feature_rows, seq.pending_features = (row, 1), None

    def _stage_sampling(self, items: list[ScheduledSeq]) -> None:
        """A proposer that samples its drafts: each row's temperature and its own Exp(1) draws (a seeded
        request draws the same numbers whatever shares the batch)."""
        if self.temperature is None:
            return
        sampled = [(b, i) for b, i in enumerate(items) if not i.seq.params.greedy and i.num_drafts]
        if not sampled and not self._sampling_staged:
            return  # the buffer already holds zeros: every row greedy
        temps = [0.0] * self.temperature.shape[0]
        for b, item in sampled:
            temps[b] = item.seq.params.temperature
            shape = (item.num_drafts, self.draft_noise.shape[-1])
            self.draft_noise[b, :item.num_drafts].copy_(exponential_noise(item.seq, shape, self.r.device))
        self.temperature.copy_(self.r._tensor(temps, torch.float32))
        self._sampling_staged = bool(sampled)

    def _launch_chained(self, prev: _Launch) -> _Launch:
        self._stage(prev.bp, prev.rows, prev.num_drafts)
        return self._launch(prev.bp, list(prev.rows), prev.num_drafts, chained=True)

    def _commit_recurrent(self, launch: _Launch, items: list[ScheduledSeq], committed: list[int],
                          greedy: bool) -> None:
        """The step committed each row's greedy acceptance into its spare slot; a sampled step commits
        its own counts there again (the read slot is untouched). The sequences then move to that slot."""
        if not greedy and launch.state is not None and launch.state.speculative:
            counts = [1] * launch.bp  # a fresh step: its rows are the items, in order
            counts[: len(items)] = committed
            self.r.target.commit_decode(launch.state, self.r._tensor(counts))
        for item in items:
            item.seq.state_slot ^= 1

    def execute(self, items: list[ScheduledSeq]) -> list[StepResult]:
        from blockspec.runner.model_runner import StepResult

        r, q = self.r, self.q
        seqs = [i.seq for i in items]
        launch = self._take_inflight(items)
        greedy = greedy_only(seqs)
        if launch is None:
            launch = self._launch_fresh(items)
        chained = greedy and self._chainable(launch)
        if chained:
            self.inflight = self._launch_chained(launch)
        row_of = {id(s): b for b, s in enumerate(launch.rows) if s is not None}
        if greedy:
            host = launch.wait().tolist()
            rows = []
            for seq in seqs:
                row = host[row_of[id(seq)]]
                rows.append((row[0], row[1:row[0] + 2], None))
        else:
            n = len(items)  # a fresh step: rows 0..n-1
            logits = launch.logits.view(launch.bp, q, -1)[:n]
            tokens_in = self.graphs.views(launch.bp).tokens.view(launch.bp, q)[:n]
            draft_probs = launch.drafts.dense_q(logits.shape[-1], n) if launch.drafts is not None else None
            rows = accept(seqs, [i.num_drafts for i in items], logits, tokens_in, r.device, draft_probs)
        results = [StepResult(item.seq, tokens, item.num_drafts, a, lps) for item, (a, tokens, lps) in zip(items, rows)]
        committed = [1 + res.num_accepted for res in results]
        if self.recurrent:
            self._commit_recurrent(launch, items, committed, greedy)
        else:
            r._commit_state(items, committed)
        holders = []
        for seq, n in zip(seqs, committed):
            seq.num_computed += n
            if not self.uses_drafter:
                continue
            if chained:  # the chained step's drafter pass projects these rows
                seq.drafter_computed += n
            else:
                seq.feature_rows = (row_of[id(seq)] * q, n)
                holders.append(seq)
        self.holders = holders
        return results
