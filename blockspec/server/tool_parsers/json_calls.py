"""Calls written as JSON objects, `{"name": ..., "arguments": {...}}` (hermes, llama3_json, and the
array a `tool_choice: required` request is constrained to)."""

from __future__ import annotations

import json

from blockspec.server.tool_parsers.base import CallProgress, NotACall
from blockspec.server.tool_parsers.partial_json import JsonSyntaxError, Node, member, parse_prefix, render


def parse_json(text: str, start: int = 0) -> Node | None:
    """parse_prefix, with a syntax error meaning 'not a call'."""
    try:
        return parse_prefix(text, start)
    except JsonSyntaxError as exc:
        raise NotACall(f"invalid JSON: {exc}") from None


def call_from_object(node: Node, argument_keys: tuple[str, ...]) -> CallProgress:
    """The call an object node holds: named once its name is complete and its arguments have begun.
    Arguments sent as a string holding JSON are read as that JSON, as vLLM does."""
    if node.kind != "object":
        raise NotACall(f"a tool call must be a JSON object, not {node.kind}")
    name = member(node, "name")
    arguments = next((m for key in argument_keys if (m := member(node, key)) is not None), None)
    if node.done and (name is None or arguments is None):
        raise NotACall(f"a tool call needs \"name\" and {' or '.join(map(repr, argument_keys))}")
    if name is None or name.value is None or not name.value.done or arguments is None or not arguments.colon:
        return CallProgress(None)
    if name.value.kind != "string":
        raise NotACall("a tool call's name must be a string")
    value = arguments.value
    if value is None:
        return CallProgress(name.value.text)
    if value.kind != "string":
        return CallProgress(name.value.text, render(value))
    if not value.done:
        return CallProgress(name.value.text)
    try:
        return CallProgress(name.value.text, json.dumps(json.loads(value.text), ensure_ascii=False))
    except json.JSONDecodeError:
        raise NotACall("a tool call's arguments string is not JSON") from None


def check_complete(node: Node | None, text: str, final: bool) -> None:
    """At the end of a call (`final`) its JSON must be whole, with nothing but whitespace after it."""
    if node is None:
        if final:
            raise NotACall("empty tool call")
        return
    if node.done:
        if text[node.end:].strip():
            raise NotACall("text after a tool call's JSON")
    elif final:
        raise NotACall("a tool call's JSON was cut off")
