"""Turning an API request into the engine's SamplingParams, with defaults and clear 400s.

Only fields the client actually sent override the model's / alias's defaults; `null` counts as not
sent (several clients send every field, unset ones as null).
"""

from __future__ import annotations

from typing import Any

from blockspec.engine.sampling_params import SamplingParams
from blockspec.errors import RequestError
from blockspec.server.errors import bad_request
from blockspec.server.protocol import (
    MAX_N,
    MAX_TOP_LOGPROBS,
    SEED_RANGE,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
)
from blockspec.server.structured import structured_spec

# Request field -> SamplingParams field, for the plain one-to-one ones.
_DIRECT = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "ignore_eos", "min_tokens", "include_stop_str_in_output", "skip_special_tokens")


def _value(req: SamplingRequest, defaults: dict[str, Any], key: str) -> Any:
    value = getattr(req, key, None)
    return defaults.get(key) if value is None else value


def check_request(req: SamplingRequest) -> None:
    """Request-level checks that are not sampling-parameter ranges."""
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {req.n}", "n")
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by blockspec", "logit_bias")
    if req.seed is not None and not SEED_RANGE[0] <= req.seed <= SEED_RANGE[1]:
        raise bad_request("seed must fit in 64 bits", "seed")


def sampling_params(req: ChatCompletionRequest | CompletionRequest, defaults: dict[str, Any]) -> SamplingParams:
    """The engine parameters of one request (400 on any value the engine would refuse)."""
    check_request(req)
    kwargs: dict[str, Any] = {}
    for key in _DIRECT:
        value = _value(req, defaults, key)
        if value is not None:
            kwargs[key] = value
    stop = _value(req, defaults, "stop")
    if stop is not None:
        kwargs["stop"] = [stop] if isinstance(stop, str) else list(stop)
        if any(not s for s in kwargs["stop"]):
            raise bad_request("stop strings must not be empty", "stop")
    if req.stop_token_ids:
        kwargs["stop_token_ids"] = list(req.stop_token_ids)
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        kwargs["max_tokens"] = max_tokens if max_tokens is not None else defaults.get("max_tokens")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        if req.logprobs:
            top = req.top_logprobs or 0
            if not 0 <= top <= MAX_TOP_LOGPROBS:
                raise bad_request(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
            kwargs["logprobs"] = top
    else:
        max_tokens = req.max_tokens if req.max_tokens is not None else defaults.get("max_tokens", 16)
        kwargs["max_tokens"] = max_tokens
        if req.logprobs is not None:
            if not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
                raise bad_request(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "logprobs")
            kwargs["logprobs"] = req.logprobs
    params = SamplingParams(**kwargs, structured=structured_spec(req))
    try:
        params.validate()
    except RequestError as exc:
        raise bad_request(str(exc), exc.param) from None
    return params


def for_choice(params: SamplingParams, index: int) -> SamplingParams:
    """A copy for choice `index` of n: a fixed seed still gives n different samples."""
    copy = SamplingParams(**vars(params))
    copy.stop = list(params.stop)
    copy.stop_token_ids = list(params.stop_token_ids)
    if params.seed is not None and index:
        copy.seed = (params.seed + index) % (1 << 63)
    return copy
