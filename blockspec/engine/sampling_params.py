"""Per-request sampling and stopping parameters (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field

from blockspec.errors import RequestError
from blockspec.structured.spec import StructuredSpec


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top logprobs per token (0: only the chosen token's)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only (no text, no stop strings), for bulk generation
    structured: StructuredSpec | None = None  # the grammar the output must follow (JSON schema, regex, ...)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self) -> None:
        checks = [
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "max_tokens must be at least 1"),
            (self.temperature >= 0, "temperature", "temperature must be non-negative"),
            (0 < self.top_p <= 1, "top_p", "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "top_k must be -1 (off), 0 (off) or positive"),
            (0 <= self.min_p <= 1, "min_p", "min_p must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty", "repetition_penalty must be positive"),
            (self.min_tokens >= 0, "min_tokens", "min_tokens must be non-negative"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             "min_tokens must not exceed max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "logprobs must be in [0, 20]"),
            (self.detokenize or not self.stop, "stop", "stop strings need detokenize=True"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise RequestError(message, param)
