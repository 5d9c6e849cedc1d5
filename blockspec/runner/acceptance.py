"""From a verify pass's logits to committed tokens: request rules, then greedy or rejection sampling.

Works on a padded batch [R, K+1, V] of verified positions. Request rules come first (min_tokens masks
the stop tokens, presence/frequency/repetition penalties count the drafts before each position as if
accepted: a position only matters if they were). The only device-to-host copy of a step is here.
"""

from __future__ import annotations

import torch

from blockspec.device import upload
from blockspec.engine.sampler import RowParams, apply_penalties, logprobs_of, probabilities
from blockspec.engine.sequence import Sequence, TokenLogprob
from blockspec.spec.verify import verify_greedy, verify_sampled
from blockspec.structured.bitmask import apply_bitmask, verify_bitmask


def greedy_only(seqs: list[Sequence]) -> bool:
    """True when plain argmax acceptance is the whole rule for every row (the in-graph fast path)."""
    return all(s.params.greedy and not s.params.has_penalties and s.params.logprobs is None and s.grammar is None
               and not _min_tokens_left(s) for s in seqs)


def _min_tokens_left(seq: Sequence) -> bool:
    """min_tokens still masks the stop tokens of this sequence."""
    return bool(seq.params.min_tokens and seq.num_output < seq.params.min_tokens and seq.stop_ids)


def accept(seqs: list[Sequence], num_drafts: list[int], logits: torch.Tensor, tokens_in: torch.Tensor,
           device: torch.device, draft_probs: torch.Tensor | None = None
           ) -> list[tuple[int, list[int], list[TokenLogprob] | None]]:
    """Per row: (accepted drafts a, the a + 1 committed tokens, their log-probs if asked).

    logits [R, K+1, V] at the verified positions; tokens_in [R, K+1] = anchor, d_1..d_K; draft_probs
    [R, K, V] the q sampled drafts were drawn from (None: greedy drafts, q one-hot).
    """
    logits = _rules(logits.float(), seqs, tokens_in, num_drafts, device)
    params = [s.params for s in seqs]
    k = tokens_in.shape[1] - 1
    drafts = tokens_in[:, 1:]
    nd = upload(num_drafts, torch.int64, device)
    accepted, out = verify_greedy(logits.argmax(-1), drafts, nd)
    sampled = [r for r, p in enumerate(params) if not p.greedy]
    if sampled:
        sub = upload(sampled, torch.int64, device)
        probs = probabilities(logits[sub], RowParams.build([params[r] for r in sampled], device))
        # Each request draws exactly its own number of randoms, whatever the batch's padding.
        uniforms = torch.ones(len(sampled), k, device=device)
        for j, r in enumerate(sampled):
            uniforms[j, :num_drafts[r]] = _rand(seqs[r], (num_drafts[r],), device)
        noise = torch.stack([_rand(seqs[r], (logits.shape[-1],), device, exponential=True) for r in sampled])
        q = None if draft_probs is None else draft_probs[sub]
        acc_s, out_s = verify_sampled(probs, drafts[sub], nd[sub], uniforms, noise, q)
        accepted = accepted.index_copy(0, sub, acc_s)
        out = out.index_copy(0, sub, out_s)
    host = torch.cat([accepted[:, None].to(out.dtype), out], dim=1).tolist()  # the step's one sync
    want = [r for r, p in enumerate(params) if p.logprobs is not None]
    lps = _logprobs(logits, out, host, want, params) if want else {}
    return [(row[0], row[1:row[0] + 2], lps.get(r)) for r, row in enumerate(host)]


def _request_rules(logits: torch.Tensor, seqs: list[Sequence], tokens_in: torch.Tensor,
                   device: torch.device) -> torch.Tensor:
    k1, vocab = logits.shape[1], logits.shape[2]
    for r, seq in enumerate(seqs):
        p = seq.params
        if _min_tokens_left(seq):
            n_masked = min(k1, p.min_tokens - seq.num_output)
            ids = upload(sorted(i for i in seq.stop_ids if i < vocab), torch.int64, device)
            logits[r, :n_masked, ids] = float("-inf")
    penal = [r for r, s in enumerate(seqs) if s.params.has_penalties]
    if not penal:
        return logits
    counts = torch.zeros(len(penal), k1, vocab, device=device)
    prompt_mask = torch.zeros(len(penal), vocab, dtype=torch.bool, device=device)
    for j, r in enumerate(penal):
        seq = seqs[r]
        if seq.output_ids:
            counts[j] += torch.bincount(upload(seq.output_ids, torch.int64, device), minlength=vocab)[:vocab].float()
        prompt_mask[j, upload(seq.prompt_ids, torch.int64, device)] = True
        onehot = torch.zeros(k1, vocab, device=device)
        onehot[1:].scatter_(1, tokens_in[r, 1:, None], 1.0)
        counts[j] += onehot.cumsum(0)
    sub = upload(penal, torch.int64, device)
    logits[sub] = apply_penalties(logits[sub], counts, prompt_mask, [seqs[r].params for r in penal])
    return logits


def _rules(logits: torch.Tensor, seqs: list[Sequence], tokens_in: torch.Tensor, num_drafts: list[int],
           device: torch.device) -> torch.Tensor:
    """The grammar, then the request rules. Structured output keeps at each verified position only the
    tokens its grammar state allows (the drafts before it taken as accepted); where the request rules
    leave the grammar nothing (min_tokens masking the stop token of a complete grammar), it wins."""
    masks = verify_bitmask(seqs, tokens_in, num_drafts, logits.shape[-1])
    if masks is None:
        return _request_rules(logits, seqs, tokens_in, device)
    masked = apply_bitmask(logits, masks)
    if not any(_min_tokens_left(s) for s in seqs):
        return _request_rules(masked, seqs, tokens_in, device)
    ruled = _request_rules(masked.clone(), seqs, tokens_in, device)
    return torch.where(torch.isinf(ruled).all(-1, keepdim=True), masked, ruled)


def _rand(seq: Sequence, shape: tuple[int, ...], device: torch.device, exponential: bool = False) -> torch.Tensor:
    t = torch.empty(shape, device=device, dtype=torch.float32)
    return t.exponential_(generator=seq.generator) if exponential else t.uniform_(generator=seq.generator)


def _logprobs(logits: torch.Tensor, out: torch.Tensor, host: list[list[int]], want: list[int],
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
