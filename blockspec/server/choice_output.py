"""How one chat choice's text becomes its message, whole or as stream deltas: `<think>` is split off
first (--reasoning-parser), then tool calls are read from what is left (the content)."""

from __future__ import annotations

from typing import Any

from blockspec.server.reasoning import ReasoningParser
from blockspec.server.server_config import ServerConfig
from blockspec.server.tool_parsers import ToolParser
from blockspec.server.tools import ToolUse


class ChoiceOutput:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, use: ToolUse | None) -> None:
        self.reasoning, self.tools, self.use = reasoning, tools, use
        self.called = False  # a tool call was found (streamed or whole)

    @classmethod
    def create(cls, config: ServerConfig, prompt: str, use: ToolUse | None) -> ChoiceOutput:
        """The server's parsers for one choice of a request with this prompt and tool use."""
        reasoning = ReasoningParser(config.reasoning_parser, prompt) if config.reasoning_parser else None
        return cls(reasoning, use.parser(config.tool_call_parser) if use is not None else None, use)

    def feed(self, text: str, final: bool = False) -> dict[str, Any]:
        """The delta fields (reasoning_content, content, tool_calls) of new text; `final`: the last."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        if final and self.reasoning:
            r, c = self.reasoning.finish()
            reasoning, content = reasoning + r, content + c
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        calls = []
        if self.tools is not None:
            parsed = self.tools.finish(content) if final else self.tools.feed(content)
            content = parsed.content
            calls = [c.to_dict() for c in parsed.calls if self._parallel_ok(c.index)]
            self.called = self.tools.called
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta

    def message(self, text: str) -> dict[str, Any]:
        """The whole message of a finished choice."""
        reasoning, content = self.reasoning.parse(text) if self.reasoning else (None, text)
        calls = []
        if self.tools is not None:
            content, found = self.tools.parse(content or "")
            calls = [c.to_dict() for i, c in enumerate(found) if self._parallel_ok(i)]
            self.called = bool(calls)
            if self.called and self.use is not None and self.use.forced:
                content = ""  # vLLM's forced calls carry an empty content
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning:
            message["reasoning_content"] = reasoning
        message["tool_calls"] = calls
        return message

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """"tool_calls" when the model called tools (not for a named function: OpenAI says "stop")."""
        if self.called and self.use is not None and self.use.choice != "named" and engine_reason is not None:
            return "tool_calls"
        return engine_reason

    def _parallel_ok(self, index: int) -> bool:
        """parallel_tool_calls=false keeps only the first call, as vLLM does."""
        return index == 0 or self.use is None or self.use.parallel

