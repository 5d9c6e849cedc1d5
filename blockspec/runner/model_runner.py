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
from blockspec.engine.sampler import RowParams, apply_penalties, logprobs_of, probabilities
from blockspec.engine.scheduler import ScheduledSeq, SchedulerOutput
from blockspec.engine.sequence import Sequence, TokenLogprob
from blockspec.models.layers.attention import AttentionMetadata, forward_context
from blockspec.spec.dflash import DFlashDrafter, DraftMetadata
from blockspec.spec.synthetic import SyntheticProposer
from blockspec.spec.verify import verify_greedy, verify_sampled


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

    # ---- memory -------------------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        """Target plus drafter K/V bytes for one block of positions."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        per_token = sum(2 * a.num_kv_heads * a.head_dim for a in self.target.attention_layers)
        if self.drafter is not None:
            per_token += sum(2 * a.num_kv_heads * a.head_dim for a in self.drafter.attention_layers)
        return per_token * elem * self.block_size

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        layers = list(self.target.attention_layers)
        if self.drafter is not None:
            layers += list(self.drafter.attention_layers)
        for layer in layers:
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
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
        drafts = self._draft(items) if self.drafter is not None or self.synthetic is not None else None
        hidden, features, offsets = self._target(items, drafts)
        results = self._sample(items, hidden, offsets)
        committed = [item.num_new + (res.num_accepted if item.samples else 0) for item, res in zip(items, results)]
        commit_state = getattr(self.target, "commit_state", None)
        if commit_state is not None:
            # Recurrent layers (Gated DeltaNet, Mamba) keep a state per verified position during the
            # pass; each sequence continues from the state after its last committed position.
            commit_state([item.seq for item in items], committed)
        for item, start, n in zip(items, offsets, committed):
            self._advance(item, start, n, features)
        return results

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
        )
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
        logits = self.target.compute_logits(hidden[index_t.view(-1)]).float().view(len(rows), k + 1, -1)
        seqs = [items[b].seq for b in rows]
        params = [s.params for s in seqs]
        logits = self._mask_and_penalise(logits, seqs, items, rows, index_t)
        tokens_in = self._last_tokens[index_t]  # [R, K+1]: anchor, d1..dk
        draft_t = tokens_in[:, 1:]
        num_drafts = self._tensor([items[b].num_drafts for b in rows])
        accepted, out = verify_greedy(logits.argmax(-1), draft_t, num_drafts)
        sampled = [r for r, p in enumerate(params) if not p.greedy]
        if sampled:
            sub = self._tensor(sampled)
            row_params = RowParams.build([params[r] for r in sampled], self.device)
            probs = probabilities(logits[sub], row_params)
            # Each request draws exactly its own number of randoms, whatever the batch's padding.
            uniforms = torch.ones(len(sampled), k, device=self.device)
            for j, r in enumerate(sampled):
                n = items[rows[r]].num_drafts
                uniforms[j, :n] = self._rand(seqs[r], (n,))
            noise = torch.stack([self._rand(seqs[r], (logits.shape[-1],), exponential=True) for r in sampled])
            acc_s, out_s = verify_sampled(probs, draft_t[sub], num_drafts[sub], uniforms, noise)
            accepted = accepted.index_copy(0, sub, acc_s)
            out = out.index_copy(0, sub, out_s)
        host = torch.cat([accepted[:, None].to(out.dtype), out], dim=1).tolist()  # the step's one sync
        want_lp = [r for r, p in enumerate(params) if p.logprobs is not None]
        lps = self._logprobs(logits, out, host, want_lp, params) if want_lp else {}
        for r, b in enumerate(rows):
            a = host[r][0]
            results[b].num_accepted = a
            results[b].tokens = host[r][1:a + 2]
            results[b].logprobs = lps.get(r)
        return results

    def _mask_and_penalise(self, logits: torch.Tensor, seqs: list[Sequence], items: list[ScheduledSeq],
                           rows: list[int], index_t: torch.Tensor) -> torch.Tensor:
        """min_tokens (stop ids masked while too few tokens are out) and repetition-type penalties."""
        k1, vocab = logits.shape[1], logits.shape[2]
        for r, seq in enumerate(seqs):
            p = seq.params
            if p.min_tokens and seq.num_output < p.min_tokens and seq.stop_ids:
                n_masked = min(k1, p.min_tokens - seq.num_output)
                ids = self._tensor(sorted(i for i in seq.stop_ids if i < vocab))
                logits[r, :n_masked, ids] = float("-inf")
        penal = [r for r, s in enumerate(seqs) if s.params.has_penalties]
        if not penal:
            return logits
        counts = torch.zeros(len(penal), k1, vocab, device=self.device)
        prompt_mask = torch.zeros(len(penal), vocab, dtype=torch.bool, device=self.device)
        for j, r in enumerate(penal):
            seq = seqs[r]
            if seq.output_ids:
                out_ids = self._tensor(seq.output_ids)
                counts[j] += torch.bincount(out_ids, minlength=vocab)[:vocab].float()
            prompt_mask[j, self._tensor(seq.prompt_ids)] = True
            # Position i also sees drafts 1..i as if accepted (it only counts if they are).
            drafts = self._last_tokens[index_t[r, 1:]]
            onehot = torch.zeros(k1, vocab, device=self.device)
            onehot[1:].scatter_(1, drafts[:, None], 1.0)
            counts[j] += onehot.cumsum(0)
        sub = self._tensor(penal)
        logits[sub] = apply_penalties(logits[sub], counts, prompt_mask, [seqs[r].params for r in penal])
        return logits

    def _rand(self, seq: Sequence, shape: tuple[int, ...], exponential: bool = False) -> torch.Tensor:
        g = seq.generator
        t = torch.empty(shape, device=self.device, dtype=torch.float32)
        if exponential:
            return t.exponential_(generator=g)
        return t.uniform_(generator=g)

    def _logprobs(self, logits: torch.Tensor, out: torch.Tensor, host: list[list[int]], want: list[int],
                  params: list) -> dict[int, list[TokenLogprob]]:
        top = max(params[r].logprobs for r in want)
        result = {}
        for r in want:
            n = host[r][0] + 1
            chosen, ids, values = logprobs_of(logits[r, :n], out[r, :n], top)
            chosen, ids, values = chosen.tolist(), ids.tolist(), values.tolist()
            keep = params[r].logprobs
            result[r] = [TokenLogprob(host[r][1 + i], chosen[i], list(zip(ids[i][:keep], values[i][:keep])))
                         for i in range(n)]
        return result

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
