"""JSON that is still being generated: parse a prefix, and render what is already certain of it.

A streamed tool call must send its arguments in pieces whose concatenation is the arguments string
the whole (non-streamed) response carries: `json.dumps(json.loads(text), ensure_ascii=False)`,
as vLLM writes it. `render` gives that canonical text for every finished token of a prefix and
stops before anything the next characters could still change (a number that may grow, an escape
cut in half), so successive renders of a growing text only ever extend each other.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_WS = " \t\n\r"
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]*')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_PREFIX = re.compile(r"-?(?:0|[1-9][0-9]*)?(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?")
_ESCAPES = set('"\\/bfnrt')
_HEX = set("0123456789abcdefABCDEF")
_LITERALS = ("true", "false", "null")


class JsonSyntaxError(ValueError):
    """The text can no longer become valid JSON."""


@dataclass
class Node:
    """One JSON value, complete (`done`) or cut off by the end of the text so far."""

    kind: str  # object | array | string | number | literal
    done: bool = False
    text: str = ""  # string: the decoded characters so far; number / literal: its source text
    items: list = field(default_factory=list)  # array: [Node]; object: [Member]
    trailing_comma: bool = False  # object / array: a ',' was read and the next item has not started
    end: int = 0  # just past the value in the source (once done)


@dataclass
class Member:
    key: Node
    colon: bool = False
    value: Node | None = None


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def parse_prefix(text: str, start: int = 0) -> Node | None:
    """The value that starts at `start` (after whitespace); None if nothing has started yet."""
    i = skip_ws(text, start)
    return None if i == len(text) else _value(text, i)


def _value(text: str, i: int) -> Node:
    c = text[i]
    if c == "{":
        return _container(text, i, "object")
    if c == "[":
        return _container(text, i, "array")
    if c == '"':
        return _string(text, i)
    if c == "-" or c.isdigit():
        return _number(text, i)
    if c in "tfn":
        return _literal(text, i)
    raise JsonSyntaxError(f"unexpected {c!r} at {i}")


def _string(text: str, i: int) -> Node:
    j = i + 1
    high = -1  # where a \uD800-\uDBFF escape ends: its pair (still to come) decides the character
    while True:
        run_end = _STRING_RUN.match(text, j).end()
        if run_end > j:
            j, high = run_end, -1
        if j == len(text):
            break
        c = text[j]
        if c == '"':
            return Node("string", done=True, text=json.loads(text[i:j + 1]), end=j + 1)
        if c != "\\":
            raise JsonSyntaxError(f"control character in a string at {j}")
        if j + 1 == len(text):
            break
        if text[j + 1] in _ESCAPES:
            j, high = j + 2, -1
            continue
        if text[j + 1] != "u":
            raise JsonSyntaxError(f"invalid escape at {j}")
        digits = text[j + 2:j + 6]
        if not set(digits) <= _HEX:
            raise JsonSyntaxError(f"invalid \\u escape at {j}")
        if len(digits) < 4:
            break
        j += 6
        high = j if 0xD800 <= int(digits, 16) <= 0xDBFF else -1
    safe = j - 6 if high == j else j
    return Node("string", text=json.loads(text[i:safe] + '"'))


def _number(text: str, i: int) -> Node:
    if _NUMBER_PREFIX.fullmatch(text, i):
        return Node("number", text=text[i:])  # it may still grow
    m = _NUMBER.match(text, i)
    if m is None:
        raise JsonSyntaxError(f"invalid number at {i}")
    return Node("number", done=True, text=m.group(), end=m.end())


def _literal(text: str, i: int) -> Node:
    rest = text[i:i + 5]
    for word in _LITERALS:
        if rest.startswith(word):
            return Node("literal", done=True, text=word, end=i + len(word))
        if word.startswith(rest):
            return Node("literal", text=rest)
    raise JsonSyntaxError(f"invalid literal at {i}")


def _container(text: str, i: int, kind: str) -> Node:
    node = Node(kind)
    close = "}" if kind == "object" else "]"
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == close:
        node.done, node.end = True, j + 1
        return node
    while j < len(text):
        if kind == "object":
            value = _member(text, j, node)
        else:
            value = _value(text, j)
            node.items.append(value)
        node.trailing_comma = False
        if value is None or not value.done:
            return node
        j = skip_ws(text, value.end)
        if j == len(text):
            return node
        if text[j] == close:
            node.done, node.end = True, j + 1
            return node
        if text[j] != ",":
            raise JsonSyntaxError(f"expected ',' or {close!r} at {j}")
        node.trailing_comma = True
        j = skip_ws(text, j + 1)
    return node


def _member(text: str, j: int, node: Node) -> Node | None:
    """Read one `"key": value` into `node`; returns the value (None while it has not started)."""
    if text[j] != '"':
        raise JsonSyntaxError(f"expected a key at {j}")
    member = Member(_string(text, j))
    node.items.append(member)
    if not member.key.done:
        return None
    j = skip_ws(text, member.key.end)
    if j == len(text):
        return None
    if text[j] != ":":
        raise JsonSyntaxError(f"expected ':' at {j}")
    member.colon = True
    j = skip_ws(text, j + 1)
    if j == len(text):
        return None
    member.value = _value(text, j)
    return member.value


def render(node: Node) -> str:
    """The canonical text (json.dumps, ensure_ascii=False) of what is certain of `node`."""
    if node.kind == "string":
        quoted = json.dumps(node.text, ensure_ascii=False)
        return quoted if node.done else quoted[:-1]
    if node.kind == "number":
        return json.dumps(json.loads(node.text)) if node.done else ""
    if node.kind == "literal":
        return node.text if node.done else ""
    if node.kind == "object":
        parts = [_render_member(m) for m in node.items]
        opening, closing = "{", "}"
    else:
        parts = [render(v) for v in node.items]
        opening, closing = "[", "]"
    out = opening + ", ".join(parts) + (", " if node.trailing_comma else "")
    return out + closing if node.done else out


def _render_member(member: Member) -> str:
    out = render(member.key)
    if member.colon:
        out += ": "
    if member.value is not None:
        out += render(member.value)
    return out


def member(node: Node, key: str) -> Member | None:
    """The first member of an object node whose (complete) key is `key`."""
    for m in node.items:
        if m.key.done and m.key.text == key:
            return m
    return None
