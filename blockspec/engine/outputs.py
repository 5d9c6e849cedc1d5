"""What the engine hands back after each step, per request."""

from __future__ import annotations

from dataclasses import dataclass, field

from blockspec.engine.sequence import RequestStats, TokenLogprob


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # the whole completion so far
    new_token_ids: list[int]  # committed by this step
    text: str  # the whole completion text so far
    new_text: str  # delta since the previous output
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: int | str | None
    stats: RequestStats
    new_logprobs: list[TokenLogprob] | None = None


@dataclass
class SpecDecodeCounters:
    """Cumulative speculative-decoding counters (vLLM's metric names use these)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
