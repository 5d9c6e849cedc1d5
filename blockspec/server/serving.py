"""What chat and text completions share: submitting a request group, following its outputs,
aborting on disconnect, and the usage / speculative stats / logprobs pieces of a response.

A request with n choices (or several prompts) is a group of engine requests fed into one queue;
whoever stops listening (a disconnected client, a cancelled handler) aborts what is left of it, so
its KV blocks return to the pool at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from blockspec.engine.sequence import RequestStats, TokenLogprob
from blockspec.server.async_engine import AsyncEngine, RequestGroup, ShuttingDown, Update
from blockspec.server.errors import APIError, from_exception
from blockspec.server.metrics import ServerMetrics
from blockspec.server.served_models import ServedModels
from blockspec.server.server_config import ServerConfig

T = TypeVar("T")
DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MIN_LOGPROB = -9999.0  # JSON has no -inf


@dataclass
class ServerState:
    """Everything a request handler needs, created once per app."""

    engine: AsyncEngine
    models: ServedModels
    metrics: ServerMetrics
    config: ServerConfig
    template_ignores_tools: bool | None = None  # found out at the first request with tools


class _EngineStream(StreamingResponse):
    """SSE response that aborts its requests however it ends, even if the client left before the
    body iterator ever started (then no `finally` inside it would run)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse_response(state: ServerState, group: RequestGroup, content: AsyncIterator[str]) -> StreamingResponse:
    return _EngineStream(content, lambda: state.engine.abort(group.request_ids))


class ClientDisconnected(Exception):
    """The client went away before its (non-streaming) response was ready."""


def check_ready(state: ServerState) -> None:
    try:
        state.engine.check_ready()
    except Exception as exc:
        raise from_exception(exc) from None


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def submit(state: ServerState, group: RequestGroup, prepare: Callable[[Any], tuple[list, T]]) -> T:
    """Add the group's requests to the engine (400/503 as APIError); abort them if cancelled meanwhile."""
    try:
        return await state.engine.add(group, prepare)
    except asyncio.CancelledError:
        state.engine.abort(group.request_ids)
        raise
    except Exception as exc:
        raise from_exception(exc) from None


async def follow(state: ServerState, group: RequestGroup) -> AsyncIterator[Update]:
    """Yield the group's updates until all its requests finish; abort whatever is left on exit."""
    pending = set(range(len(group.request_ids)))
    try:
        while pending:
            update = await group.queue.get()
            if update.error is not None:
                pending.clear()  # a failure ends every request of the engine, so all of this group
                if isinstance(update.error, ShuttingDown):
                    raise APIError(503, "the server is shutting down; this request was stopped")
                raise APIError(500, f"the engine failed while running this request: {update.error}")
            assert update.output is not None
            if update.output.finished:
                pending.discard(update.index)
            yield update
    finally:
        if pending:  # the client went away (or the handler was cancelled): free the KV blocks now
            state.engine.abort([group.request_ids[i] for i in sorted(pending)])
            state.metrics.observe_aborted(len(pending))


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so aborting its requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the handler itself is cancelled (server shutdown)
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientDisconnected()


async def respond(state: ServerState, group: RequestGroup, raw: Request, run: Any, stream: bool) -> Response:
    """An SSE stream, or the collected JSON body (499 when the client left before it was ready)."""
    if stream:
        return sse_response(state, group, run.stream())
    try:
        body = await until_disconnected(raw, run.collect())
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(body)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@dataclass
class Choice:
    """One engine request's accumulated output, and what a stream has not sent yet."""

    index: int
    arrival: float
    prompt_tokens: int = 0
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_text: dict[int, str] = field(default_factory=dict)
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    first_token: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stats: RequestStats | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def absorb(self, update: Update, metrics: ServerMetrics) -> None:
        out = update.output
        assert out is not None
        now = time.perf_counter()
        if out.new_token_ids and self.first_token is None:
            self.first_token = now
        self.prompt_tokens = len(out.prompt_token_ids)
        self.text.append(out.new_text)
        self.token_ids.extend(out.new_token_ids)
        self.pending_ids.extend(out.new_token_ids)
        if out.new_logprobs:
            self.logprobs.extend(out.new_logprobs)
            self.pending_logprobs.extend(out.new_logprobs)
            self.token_text.update(update.token_text)
        self.stats = out.stats
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
            metrics.observe_finished(out.finish_reason or "stop", self.prompt_tokens, len(self.token_ids),
                                     self.arrival, self.first_token, now)

    def take_pending(self) -> tuple[list[int], list[TokenLogprob]]:
        ids, lps = self.pending_ids, self.pending_logprobs
        self.pending_ids, self.pending_logprobs = [], []
        return ids, lps


def usage(prompt_tokens: int, choices: list[Choice], n: int = 1) -> dict[str, Any]:
    """OpenAI's usage; choices hold n samples per prompt in a row, and a prompt's cached tokens are those
    its first sample found in the prefix cache (the prompt is counted once, as in prompt_tokens)."""
    completion = sum(len(c.token_ids) for c in choices)
    cached = sum(c.stats.cached_tokens or 0 for c in choices[::n] if c.stats is not None)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def merged_stats(choices: list[Choice]) -> RequestStats:
    """One RequestStats over all choices (itself when there is one)."""
    stats = [c.stats for c in choices if c.stats is not None]
    if len(stats) == 1:
        return stats[0]
    width = max((len(s.accepted_per_position) for s in stats), default=0)
    per_pos = [sum(s.accepted_per_position[i] for s in stats if i < len(s.accepted_per_position))
               for i in range(width)]

    def pick(values: list[float | None], fn: Callable) -> float | None:
        known = [v for v in values if v is not None]
        return fn(known) if known else None

    return RequestStats(
        prompt_tokens=max((s.prompt_tokens for s in stats), default=0),
        completion_tokens=sum(s.completion_tokens for s in stats), steps=sum(s.steps for s in stats),
        decode_tokens=sum(s.decode_tokens for s in stats), num_draft_tokens=sum(s.num_draft_tokens for s in stats),
        accepted_per_position=per_pos, arrival_time=min((s.arrival_time for s in stats), default=0.0),
        first_scheduled_time=pick([s.first_scheduled_time for s in stats], min),
        first_token_time=pick([s.first_token_time for s in stats], min),
        cached_tokens=pick([s.cached_tokens for s in stats], max),
        finish_time=pick([s.finish_time for s in stats], max))


def spec_decode_stats(choices: list[Choice]) -> dict[str, Any]:
    return merged_stats(choices).to_dict()


def meta_info(request_id: str, prompt_tokens: int, choices: list[Choice], arrival: float) -> dict[str, Any]:
    """SGLang's meta_info: z-lab's `dflash benchmark openai` reads spec_accept_length / spec_verify_ct."""
    stats = merged_stats(choices)
    first = choices[0]
    reason: dict[str, Any] | None = None
    if first.finish_reason is not None:
        reason = {"type": first.finish_reason}
        if first.finish_reason == "stop" and first.stop_reason is not None:
            reason["matched"] = first.stop_reason
        elif first.finish_reason == "length":
            reason["length"] = len(first.token_ids)
    return {"id": request_id, "finish_reason": reason, "prompt_tokens": prompt_tokens,
            "completion_tokens": sum(len(c.token_ids) for c in choices),
            "spec_accept_length": round(stats.tau, 4), "spec_verify_ct": stats.steps,
            "e2e_latency": round(time.perf_counter() - arrival, 6)}


def _lp(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def chat_logprobs(lps: list[TokenLogprob], token_text: dict[int, str]) -> dict[str, Any]:
    """OpenAI chat format: content = [{token, logprob, bytes, top_logprobs}]."""

    def entry(token_id: int, value: float) -> dict[str, Any]:
        text = token_text.get(token_id, "")
        return {"token": text, "logprob": _lp(value), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps]}


def completion_logprobs(lps: list[TokenLogprob], token_text: dict[int, str], offset: int) -> dict[str, Any]:
    """Legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        text = token_text.get(lp.token_id, "")
        tokens.append(text)
        values.append(_lp(lp.logprob))
        tops.append({token_text.get(t, ""): _lp(v) for t, v in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
