"""Shared steps of the proposer oracle tests: a prefill through the runner, and the drafts of each decode step."""

from __future__ import annotations

from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams
from blockspec.engine.scheduler import ScheduledSeq, SchedulerOutput
from blockspec.engine.sequence import Sequence


def prefill(engine: Engine, ids: list[int], anchor: int, k: int) -> Sequence:
    """Run ids through the target (the runner captures their features), then append the anchor token."""
    engine.add_request("r", ids, SamplingParams(temperature=0, max_tokens=k + 1))
    seq = engine.requests["r"]
    engine.allocator.ensure(seq, len(ids) + k + 1)
    engine.runner.execute(SchedulerOutput([ScheduledSeq(seq, len(ids), 0)]))
    seq.output_ids.append(anchor)
    return seq


def decode_drafts(engine: Engine, monkeypatch, prompt: list[int], max_tokens: int
                  ) -> tuple[list[int], list[tuple[int, int, list[int]]]]:
    """Greedy generation of one prompt through the decode path; returns (prompt + output, and per step with
    drafts: (anchor position, number of drafts, the drafted tokens))."""
    decode, seen = engine.runner.decode, []
    original = decode._draft_fn

    def recording(v):
        drafts = original(v)
        seen.append((int(v.anchor[0]), int(v.num_drafts[0]), drafts.tokens[0].tolist()))
        return drafts

    monkeypatch.setattr(decode, "_draft_fn", recording)
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
    return prompt + out.token_ids, [(a, n, d[:n]) for a, n, d in seen if n]
