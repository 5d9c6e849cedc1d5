"""POST /v1/chat/completions: messages -> chat template -> engine, streamed (SSE) or whole."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from blockspec.errors import RequestError
from blockspec.server.async_engine import RequestGroup
from blockspec.server.choice_output import ChoiceOutput
from blockspec.server.errors import APIError, bad_request, error_body
from blockspec.server.protocol import ROLES, ChatCompletionRequest, ChatMessage
from blockspec.server.sampling import for_choice, sampling_params
from blockspec.server.serving import (
    DONE,
    Choice,
    ServerState,
    chat_logprobs,
    check_ready,
    follow,
    meta_info,
    respond,
    spec_decode_stats,
    sse,
    submit,
    usage,
)
from blockspec.server.tools import ToolUse, history_arguments_as_dicts, tool_use

log = logging.getLogger("blockspec.server")

# apply_chat_template arguments a request may not set through chat_template_kwargs.
RESERVED_TEMPLATE_ARGS = {"conversation", "messages", "tokenize", "add_generation_prompt", "return_dict",
                          "chat_template", "tools"}


def normalize_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: text parts joined, roles checked."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    out = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise bad_request(f"messages[{i}].role {m.role!r} is not one of {', '.join(sorted(ROLES))}", "messages")
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type")
                if kind not in ("text", "input_text") or not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{i}] has a {kind!r} content part: blockspec serves text only "
                                      "(parts of type 'text' with a 'text' string)", "messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        msg: dict[str, Any] = {"role": m.role, "content": content if content is not None else ""}
        for key in ("name", "tool_calls", "tool_call_id"):
            value = getattr(m, key)
            if value is not None:
                msg[key] = value
        out.append(msg)
    history_arguments_as_dicts(out)
    return out


def template_kwargs(req: ChatCompletionRequest, defaults: dict[str, Any], use: ToolUse | None) -> dict[str, Any]:
    kwargs = {**defaults.get("chat_template_kwargs", {}), **(req.chat_template_kwargs or {})}
    reserved = sorted(RESERVED_TEMPLATE_ARGS & kwargs.keys())
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    if req.reasoning_effort is not None:  # as vLLM: the field wins, and "none" also turns thinking off
        if "enable_thinking" not in (req.chat_template_kwargs or {}):
            kwargs["enable_thinking"] = req.reasoning_effort != "none"
        kwargs["reasoning_effort"] = req.reasoning_effort
    if use is not None:
        kwargs["tools"] = use.tools
    return kwargs


def note_template_ignores_tools(state: ServerState, engine: Any, messages: list[dict[str, Any]],
                                kwargs: dict[str, Any], prompt: str) -> None:
    """Say once in the log when the chat template leaves `tools` out of the prompt."""
    if state.template_ignores_tools is not None or "tools" not in kwargs:
        return
    without = {k: v for k, v in kwargs.items() if k != "tools"}
    try:
        state.template_ignores_tools = engine.apply_chat_template(messages, **without) == prompt
    except Exception:  # a template that needs its tools: it renders them
        state.template_ignores_tools = False
    if state.template_ignores_tools:
        log.warning("the chat template ignores `tools`: the model is not told about them. tool_choice \"required\" "
                    "and named functions are still enforced by the grammar; \"auto\" calls come only from a model "
                    "that knows its call format")


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request) -> Response:
    arrival = time.perf_counter()
    check_ready(state)
    name, defaults = state.models.resolve(req.model)
    use = tool_use(req, state.config)
    params = sampling_params(req, defaults)
    forced = use.structured() if use is not None else None
    if forced is not None:
        if params.structured is not None:
            raise bad_request(f"tool_choice {req.tool_choice!r} and response_format / structured_outputs both "
                              "constrain the output: use one", "tool_choice")
        params.structured = forced
    messages = normalize_messages(req.messages)
    kwargs = template_kwargs(req, defaults, use)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    group = RequestGroup([f"{request_id}-{i}" for i in range(req.n)])

    def prepare(engine: Any) -> tuple[list, tuple[str, list[int]]]:
        try:
            prompt = engine.apply_chat_template(messages, **kwargs)
        except RequestError:
            raise
        except Exception as exc:  # jinja errors, raise_exception() in templates, malformed tool calls
            raise RequestError(f"the chat template failed on these messages: {type(exc).__name__}: {exc}",
                               "messages") from None
        note_template_ignores_tools(state, engine, messages, kwargs, prompt)
        ids = engine.encode(prompt)
        return [(ids, for_choice(params, i)) for i in range(req.n)], (prompt, ids)

    prompt, prompt_ids = await submit(state, group, prepare)
    chat = _Chat(state, req, use, name, request_id, group, prompt, prompt_ids, arrival)
    return await respond(state, group, raw, chat, req.stream)


class _Chat:
    """One chat completion in flight: its choices, and how to render them."""

    def __init__(self, state: ServerState, req: ChatCompletionRequest, use: ToolUse | None, model: str,
                 request_id: str, group: RequestGroup, prompt: str, prompt_ids: list[int], arrival: float) -> None:
        self.state, self.req, self.model, self.id, self.group = state, req, model, request_id, group
        self.prompt, self.prompt_ids, self.arrival = prompt, prompt_ids, arrival
        self.created = int(time.time())
        self.choices = [Choice(i, arrival) for i in range(req.n)]
        self.outputs = [ChoiceOutput.create(state.config, prompt, use) for _ in range(req.n)]

    async def collect(self) -> dict[str, Any]:
        async with contextlib.aclosing(follow(self.state, self.group)) as updates:
            async for update in updates:
                self.choices[update.index].absorb(update, self.state.metrics)
        choices = []
        for c, output in zip(self.choices, self.outputs):
            message = output.message("".join(c.text))
            logprobs = chat_logprobs(c.logprobs, c.token_text) if self.req.logprobs else None
            choice: dict[str, Any] = {"index": c.index, "message": message, "logprobs": logprobs,
                                      "finish_reason": output.finish_reason(c.finish_reason),
                                      "stop_reason": c.stop_reason}
            if self.req.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        body: dict[str, Any] = {"id": self.id, "object": "chat.completion", "created": self.created,
                                "model": self.model, "choices": choices,
                                "usage": usage(len(self.prompt_ids), self.choices, self.req.n)}
        if self.req.return_token_ids:
            body["prompt_token_ids"] = self.prompt_ids
        body["spec_decode"] = spec_decode_stats(self.choices)
        if self.req.return_meta_info:
            body["meta_info"] = meta_info(self.id, len(self.prompt_ids), self.choices, self.arrival)
        return body

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                 "choices": choices, **extra}
        opts = self.req.stream_options
        if opts and opts.continuous_usage_stats and "usage" not in chunk:
            chunk["usage"] = usage(len(self.prompt_ids), self.choices, self.req.n)
        return chunk

    def _role_chunk(self, c: Choice) -> dict[str, Any]:
        extra = {"prompt_token_ids": self.prompt_ids} if self.req.return_token_ids and c.index == 0 else {}
        return self._chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}], **extra)

    async def stream(self) -> AsyncIterator[str]:
        req = self.req
        started = [False] * len(self.choices)
        try:
            async with contextlib.aclosing(follow(self.state, self.group)) as updates:
                async for update in updates:
                    c = self.choices[update.index]
                    if not started[c.index]:  # like vLLM: the role chunk comes with the first output, so a
                        started[c.index] = True  # client's time-to-first-response includes the prefill
                        yield sse(self._role_chunk(c))
                    c.absorb(update, self.state.metrics)
                    chunk = self._delta_chunk(c, update.output.new_text)
                    if chunk is not None:
                        yield sse(chunk)
        except APIError as exc:
            yield sse(error_body(exc.status, exc.message, exc.param))
            yield DONE
            return
        opts = req.stream_options
        final: dict[str, Any] = {}
        if opts and opts.include_usage:
            final["usage"] = usage(len(self.prompt_ids), self.choices, self.req.n)
            final["spec_decode"] = spec_decode_stats(self.choices)
        if req.return_meta_info:
            final["meta_info"] = meta_info(self.id, len(self.prompt_ids), self.choices, self.arrival)
        if final:
            yield sse(self._chunk([], **final))
        yield DONE

    def _delta_chunk(self, c: Choice, new_text: str) -> dict[str, Any] | None:
        """The chunk for a choice's new output, or None while there is nothing to show yet."""
        output = self.outputs[c.index]
        delta = output.feed(new_text, final=c.finished)
        if not (delta or c.finished):
            return None  # e.g. half a UTF-8 character, a tag not yet whole: its token ids go out with the next text
        ids, lps = c.take_pending()
        choice: dict[str, Any] = {"index": c.index, "delta": delta,
                                  "logprobs": chat_logprobs(lps, c.token_text) if self.req.logprobs else None,
                                  "finish_reason": output.finish_reason(c.finish_reason)}
        if c.finished:
            choice["stop_reason"] = c.stop_reason
        if self.req.return_token_ids:
            choice["token_ids"] = ids
        extra = {"spec_decode": spec_decode_stats([c])} if c.finished else {}
        return self._chunk([choice], **extra)
