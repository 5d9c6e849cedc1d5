"""`--tool-call-parser hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the format
of Hermes 2 Pro, Qwen2.5 and Qwen3 chat templates."""

from __future__ import annotations

from blockspec.server.tool_parsers.base import CallProgress
from blockspec.server.tool_parsers.json_calls import call_from_object, check_complete, parse_json
from blockspec.server.tool_parsers.tagged import TaggedParser


class HermesParser(TaggedParser):
    end_tags = {"<tool_call>": "</tool_call>"}

    def parse_body(self, start_tag: str, body: str, closed: bool, final: bool) -> CallProgress | None:
        node = parse_json(body)
        check_complete(node, body, closed or final)
        return CallProgress(None) if node is None else call_from_object(node, ("arguments",))
