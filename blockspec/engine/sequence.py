"""One request's state as it moves through the engine, and the statistics it reports."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from blockspec.engine.detokenizer import IncrementalDetokenizer
from blockspec.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from blockspec.structured.matcher import GrammarMatcher
    from blockspec.structured.reasoning_gate import ReasoningGatedGrammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestStats:
    """What a request did: the numbers the CLI prints and the server returns."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    steps: int = 0  # verify steps (decode steps); the prefill that samples the first token is not one
    decode_tokens: int = 0  # tokens committed by those verify steps
    num_draft_tokens: int = 0
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache at admission (None: not yet admitted)
    accepted_per_position: list[int] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_accepted_tokens(self) -> int:
        return sum(self.accepted_per_position)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify step (1.0 for plain decoding)."""
        return self.decode_tokens / self.steps if self.steps else 0.0

    @property
    def prefill_time(self) -> float:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return 0.0
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float:
        if self.first_token_time is None:
            return 0.0
        end = self.finish_time if self.finish_time is not None else time.perf_counter()
        return end - self.first_token_time

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_time if self.decode_time > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "tau": round(self.tau, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "steps": self.steps,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "cached_tokens": self.cached_tokens or 0,
            "prefill_time_s": round(self.prefill_time, 6),
            "decode_time_s": round(self.decode_time, 6),
            "decode_tok_s": round(self.decode_tok_s, 3),
        }


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class Sequence:
    """Token ids, cache position, drafter context and detokenizer of one request.

    Invariants: positions [0, num_computed) have K/V in the target cache; positions
    [0, drafter_computed) have K/V in the drafter's context cache; `pending_features` holds the
    target's context features of positions [drafter_computed, num_computed), waiting for the
    drafter's next pass to project them. A sequence admitted on a prefix-cache hit starts with both
    counters at the hit's length: its first blocks are shared, with their drafter context.
    """

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 detokenizer: IncrementalDetokenizer | None, eos_ids: list[int],
                 generator: torch.Generator | None) -> None:
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # prefix-cache keys of its full blocks (engine/block_hash.py)
        self.num_cached_blocks = 0  # leading blocks of block_table already offered to the prefix cache
        self.restore_snapshot: int | None = None  # hybrids: state snapshot to load into state_slot before it runs
        self.state_slot: int | None = None  # hybrid models' recurrent-state slot (engine/state_pool.py)
        self.num_computed = 0
        self.drafter_computed = 0
        self.pending_features: torch.Tensor | None = None
        self.feature_rows: tuple[int, int] | None = None  # (start, count) in the decode path's feature buffer
        self.detokenizer = detokenizer
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.eos_ids = set(eos_ids)
        self.generator = generator
        # structured output: the grammar state after output_ids (behind the reasoning, with a reasoning parser)
        self.grammar: GrammarMatcher | ReasoningGatedGrammar | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[TokenLogprob] = []
        self.stats = RequestStats(prompt_tokens=len(prompt_ids))
        self._stop_tail = ""  # text searched for stop strings

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens or 1

    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer else ""

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def reset_for_recompute(self) -> None:
        """After preemption: every position must be recomputed, in the target and the drafter."""
        self.num_computed = 0
        self.drafter_computed = 0
        self.pending_features = None
        self.feature_rows = None
        self.status = SequenceStatus.WAITING

    def append_token(self, token_id: int) -> str:
        """Commit one generated token, apply the stop rules, and return its text delta."""
        self.output_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.advance(token_id)
        self.stats.completion_tokens = len(self.output_ids)
        delta = self.detokenizer.add(token_id) if self.detokenizer else ""
        p = self.params
        # The runner masks stop tokens until min_tokens are out, so a stop token here is final.
        if token_id in self.stop_ids:
            self.finish_reason = "stop"
            self.stop_reason = token_id if token_id in p.stop_token_ids else None
        elif p.stop and delta:
            delta = self._check_stop_strings(delta)
        if self.finish_reason is None and self.num_output >= self.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None and not isinstance(self.stop_reason, str) and self.detokenizer:
            delta += self.detokenizer.flush()  # a stop string already cut the text
        return delta

    def _check_stop_strings(self, delta: str) -> str:
        assert self.detokenizer is not None
        text = self.detokenizer.text
        longest = max(len(s) for s in self.params.stop)
        window_start = max(0, len(text) - len(delta) - longest + 1)
        best: tuple[int, str] | None = None
        for s in self.params.stop:
            i = text.find(s, window_start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return delta
        i, s = best
        cut = i + len(s) if self.params.include_stop_str_in_output else i
        kept_before = len(text) - len(delta)
        self.detokenizer.text = text[:cut]
        self.finish_reason, self.stop_reason = "stop", s
        return text[kept_before:cut] if cut > kept_before else ""
