"""POST /v1/completions: raw prompt(s) (text or token ids) -> engine, streamed (SSE) or whole.

Several prompts and n > 1 both work: choice `j * n + i` is sample i of prompt j, as in OpenAI's API.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from blockspec.server.async_engine import RequestGroup
from blockspec.server.errors import APIError, bad_request, error_body
from blockspec.server.protocol import MAX_PROMPTS, CompletionRequest
from blockspec.server.sampling import for_choice, sampling_params
from blockspec.server.serving import (
    DONE,
    Choice,
    ServerState,
    check_ready,
    completion_logprobs,
    follow,
    meta_info,
    respond,
    spec_decode_stats,
    sse,
    submit,
    usage,
)


def split_prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """The request's prompts: one string, one token-id list, or a batch of either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request", "prompt")
    return list(prompt)  # type: ignore[arg-type]


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request) -> Response:
    arrival = time.perf_counter()
    check_ready(state)
    name, defaults = state.models.resolve(req.model)
    params = sampling_params(req, defaults)
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.echo and req.logprobs is not None:
        raise bad_request("echo with logprobs would need prompt logprobs, which blockspec does not compute yet",
                          "echo")
    prompts = split_prompts(req.prompt)
    n = req.n
    request_id = f"cmpl-{uuid.uuid4().hex}"
    group = RequestGroup([f"{request_id}-{k}" for k in range(len(prompts) * n)])

    def prepare(engine: Any) -> tuple[list, list[tuple[str, list[int]]]]:
        encoded = []
        for p in prompts:
            ids = engine.encode(p) if isinstance(p, str) else list(p)
            text = p
            if not isinstance(p, str):
                if req.echo:  # the decode reads the ids before add_request checks them
                    engine.check_prompt_ids(ids)
                text = engine.tokenizer.decode(ids) if req.echo else ""
            encoded.append((text, ids))
        items = [(ids, for_choice(params, i)) for _, ids in encoded for i in range(n)]
        return items, encoded

    encoded = await submit(state, group, prepare)
    run = _Completion(state, req, name, request_id, group, encoded, arrival)
    return await respond(state, group, raw, run, req.stream)


class _Completion:
    def __init__(self, state: ServerState, req: CompletionRequest, model: str, request_id: str,
                 group: RequestGroup, encoded: list[tuple[str, list[int]]], arrival: float) -> None:
        self.state, self.req, self.model, self.id, self.group = state, req, model, request_id, group
        self.encoded, self.arrival = encoded, arrival
        self.created = int(time.time())
        self.choices = [Choice(k, arrival) for k in range(len(encoded) * req.n)]
        self.offsets = [0] * len(self.choices)  # text already sent per choice (logprob text_offset)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for _, ids in self.encoded)

    def _prompt_of(self, c: Choice) -> tuple[str, list[int]]:
        return self.encoded[c.index // self.req.n]

    def _choice(self, c: Choice, text: str, ids: list[int], lps: list, final: bool) -> dict[str, Any]:
        offset = self.offsets[c.index]
        self.offsets[c.index] += len(text)
        choice: dict[str, Any] = {
            "index": c.index, "text": text,
            "logprobs": completion_logprobs(lps, c.token_text, offset) if self.req.logprobs is not None else None,
            "finish_reason": c.finish_reason if final else None}
        if final:
            choice["stop_reason"] = c.stop_reason
        if self.req.return_token_ids:
            choice["token_ids"] = ids
        return choice

    async def collect(self) -> dict[str, Any]:
        async with contextlib.aclosing(follow(self.state, self.group)) as updates:
            async for update in updates:
                self.choices[update.index].absorb(update, self.state.metrics)
        choices = []
        for c in self.choices:
            prompt_text, prompt_ids = self._prompt_of(c)
            text = (prompt_text if self.req.echo else "") + "".join(c.text)
            if self.req.echo:
                self.offsets[c.index] = len(prompt_text)
            choice = self._choice(c, "", c.token_ids, c.logprobs, final=True)
            choice["text"] = text
            if self.req.return_token_ids:
                choice["prompt_token_ids"] = prompt_ids
            choices.append(choice)
        body: dict[str, Any] = {"id": self.id, "object": "text_completion", "created": self.created,
                                "model": self.model, "choices": choices,
                                "usage": usage(self.prompt_tokens, self.choices, self.req.n),
                                "spec_decode": spec_decode_stats(self.choices)}
        if self.req.return_meta_info:
            body["meta_info"] = meta_info(self.id, self.prompt_tokens, self.choices, self.arrival)
        return body

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        chunk = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                 "choices": choices, **extra}
        opts = self.req.stream_options
        if opts and opts.continuous_usage_stats and "usage" not in chunk:
            chunk["usage"] = usage(self.prompt_tokens, self.choices, self.req.n)
        return chunk

    def _prompt_chunk(self, c: Choice) -> dict[str, Any]:
        """The echoed prompt and/or its token ids, before the choice's first output."""
        prompt_text, prompt_ids = self._prompt_of(c)
        choice = self._choice(c, prompt_text if self.req.echo else "", [], [], final=False)
        if self.req.return_token_ids:
            choice["prompt_token_ids"] = prompt_ids
        return self._chunk([choice])

    async def stream(self) -> AsyncIterator[str]:
        req = self.req
        started = [not (req.echo or req.return_token_ids)] * len(self.choices)
        try:
            async with contextlib.aclosing(follow(self.state, self.group)) as updates:
                async for update in updates:
                    c = self.choices[update.index]
                    if not started[c.index]:
                        started[c.index] = True
                        yield sse(self._prompt_chunk(c))
                    c.absorb(update, self.state.metrics)
                    text = update.output.new_text
                    if not text and not c.finished:
                        continue  # half a character: its token ids go out with the next text
                    ids, lps = c.take_pending()
                    extra = {"spec_decode": spec_decode_stats([c])} if c.finished else {}
                    yield sse(self._chunk([self._choice(c, text, ids, lps, final=c.finished)], **extra))
        except APIError as exc:
            yield sse(error_body(exc.status, exc.message, exc.param))
            yield DONE
            return
        final: dict[str, Any] = {}
        if req.stream_options and req.stream_options.include_usage:
            final["usage"] = usage(self.prompt_tokens, self.choices, self.req.n)
            final["spec_decode"] = spec_decode_stats(self.choices)
        if req.return_meta_info:
            final["meta_info"] = meta_info(self.id, self.prompt_tokens, self.choices, self.arrival)
        if final:
            yield sse(self._chunk([], **final))
        yield DONE
