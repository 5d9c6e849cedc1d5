"""Calls a request forces (`tool_choice` "required" or a named function): the grammar makes the output
JSON, and these read that JSON as calls, as vLLM does. A named function's output is its arguments
object as written; a required call's output is `[{"name": ..., "parameters": {...}}, ...]`."""

from __future__ import annotations

from typing import Any

from blockspec.server.tool_parsers.base import CallProgress, NotACall, Scan, ToolParser
from blockspec.server.tool_parsers.json_calls import call_from_object, check_complete, parse_json


class NamedCallParser(ToolParser):
    def __init__(self, tools: list[dict[str, Any]] | None, name: str) -> None:
        super().__init__(tools)
        self.name = name

    def scan(self, text: str, final: bool) -> Scan:
        """The call starts with its first output (after any reasoning), as in vLLM's stream."""
        return Scan(0, [CallProgress(self.name if text or final else None, text)])


class RequiredCallsParser(ToolParser):
    def scan(self, text: str, final: bool) -> Scan:
        node = parse_json(text)
        check_complete(node, text, final)
        if node is None:
            return Scan(0, [])
        if node.kind != "array":
            raise NotACall("tool_choice 'required' output must be a JSON array of calls")
        if node.done and not node.items:
            raise NotACall("tool_choice 'required' output holds no call")
        return Scan(0, [call_from_object(item, ("parameters",)) for item in node.items])
