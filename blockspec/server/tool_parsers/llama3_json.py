"""`--tool-call-parser llama3_json`: Llama 3.x's JSON calls, `{"name": ..., "parameters": {...}}`,
optionally after `<|python_tag|>`, several separated by `;`. Output that starts otherwise is content."""

from __future__ import annotations

from typing import Any

from blockspec.server.tool_parsers.base import CallProgress, NotACall, Scan, ToolParser
from blockspec.server.tool_parsers.json_calls import call_from_object, parse_json
from blockspec.server.tool_parsers.partial_json import skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._calls_start: int | None = None  # where the calls begin, once the output's start says so
        self._plain = False  # the output starts with something else: all content

    def scan(self, text: str, final: bool) -> Scan:
        if self._plain:
            return Scan(len(text), [])
        if self._calls_start is None:
            start = skip_ws(text, 0)
            head = text[start:start + len(PYTHON_TAG)]
            if text.startswith(PYTHON_TAG, start):
                self._calls_start = start + len(PYTHON_TAG)
            elif text.startswith("{", start):
                self._calls_start = start
            elif final or not PYTHON_TAG.startswith(head):
                self._plain = True
                return Scan(len(text), [])
            else:
                return Scan(0, [])  # whitespace, or maybe the start of the python tag: wait
        return Scan(0, self._calls(text, self._calls_start, final))

    def _calls(self, text: str, start: int, final: bool) -> list[CallProgress]:
        calls = []
        while True:
            node = parse_json(text, start)
            if node is None:
                return calls
            if final and not node.done:
                raise NotACall("a tool call's JSON was cut off")
            calls.append(call_from_object(node, ("arguments", "parameters")))
            if not node.done:
                return calls
            start = skip_ws(text, node.end)
            if start == len(text):
                return calls
            if text[start] != ";":
                raise NotACall("llama3_json calls are separated by ';'")
            start += 1
