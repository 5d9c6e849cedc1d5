"""The XML call format of Qwen3-Coder and Qwen3.5/3.6 (`qwen3_coder`, `qwen3_xml`):

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

Values are text; the tool's JSON schema says what each one is (integer, number, boolean, object ...)
and the value is converted to that JSON type, as vLLM does, falling back to the text itself. The
`<tool_call>` wrapper may be missing, and so may `</parameter>` (the next tag ends the value).
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from blockspec.server.tool_parsers.base import CallProgress, NotACall, partial_tag
from blockspec.server.tool_parsers.tagged import TaggedParser

FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
CONTAINER_TYPES = ("object", "array", "arr", "sequence")


class XmlCallParser(TaggedParser):
    end_tags = {"<tool_call>": "</tool_call>", FUNCTION: FUNCTION_END}
    header_has_arguments = True
    stream_partial_strings = False  # qwen3_xml streams a string value as it grows; qwen3_coder waits for it
    literal_unknown_types = True  # a type outside vLLM's known names: try a Python literal (qwen3_coder)

    def parse_body(self, start_tag: str, body: str, closed: bool, final: bool) -> CallProgress | None:
        done = closed or final
        if start_tag != FUNCTION:
            i = body.find(FUNCTION)
            if i == -1:
                return None if done else CallProgress(None)
            body = body[i + len(FUNCTION):]
            end = body.find(FUNCTION_END)
            if end != -1:
                body, done = body[:end], True
            elif not done:
                body = body[:len(body) - partial_tag(body, (FUNCTION_END,))]
        k = body.find(">")
        if k == -1:
            if done:
                raise NotACall("a <function= tag is not closed")
            return CallProgress(None)
        name = body[:k]
        if not name:
            raise NotACall("a function without a name")
        return CallProgress(name, self._arguments(name, body[k + 1:], done))

    def _arguments(self, name: str, text: str, done: bool) -> str:
        """The certain prefix of the arguments JSON of the parameters in `text`."""
        props = self.properties(name)
        params: dict[str, Any] = {}
        pos = 0
        partial: tuple[str, str] | None = None  # a parameter whose value is still being written
        while (start := text.find(PARAMETER, pos)) != -1:
            value_start = text.find(">", start) + 1
            if value_start == 0:
                if done:
                    raise NotACall("a <parameter= tag is not closed")
                break
            key = text[start + len(PARAMETER):value_start - 1]
            ends = [e for e in (text.find(PARAMETER_END, value_start), text.find(PARAMETER, value_start)) if e != -1]
            if not ends and not done:
                partial = key, text[value_start:]
                break
            pos = min(ends) if ends else len(text)
            params[key] = self.convert(_trim(text[value_start:pos]), _schema_type(props, key))
        if done:
            return json.dumps(params, ensure_ascii=False)
        head = json.dumps(params, ensure_ascii=False)[:-1] if params else ""
        if partial is None or not self.stream_partial_strings:
            return head
        key, raw = partial
        head = (head + ", " if params else "{") + json.dumps(key, ensure_ascii=False) + ": "
        raw = raw[:len(raw) - partial_tag(raw, (PARAMETER_END, PARAMETER, FUNCTION_END))]
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw  # maybe the newline before the closing tag
        if _schema_type(props, key) not in STRING_TYPES or "null".startswith(raw.lower()):
            return head  # not a string, or maybe null: wait for the whole value
        return head + json.dumps(raw, ensure_ascii=False)[:-1]

    def properties(self, name: str) -> dict[str, Any]:
        params = self.tool_parameters(name)
        props = params.get("properties", params) if isinstance(params, dict) else {}
        return props if isinstance(props, dict) else {}

    def convert(self, value: str, kind: str) -> Any:
        """A parameter's text as the JSON value its schema type asks for (the text if it is not one)."""
        if value.lower() == "null":
            return None
        if kind in STRING_TYPES:
            return value
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            try:
                return int(value)
            except ValueError:
                return value
        if kind.startswith(("num", "float")):
            try:
                number = float(value)
            except ValueError:
                return value
            if not math.isfinite(number):
                return value
            return int(number) if number.is_integer() else number
        if kind in ("boolean", "bool", "binary"):
            return value.lower() == "true"
        if kind in CONTAINER_TYPES or kind.startswith(("dict", "list")):
            try:
                return _json_safe(json.loads(value))
            except ValueError:
                return _literal(value)
        return _literal(value) if self.literal_unknown_types else value


def _schema_type(props: dict[str, Any], key: str) -> str:
    """The parameter's JSON schema type, lower case ('string' when the schema does not say)."""
    if key not in props:
        return "string"
    kind = props[key].get("type", "string") if isinstance(props[key], dict) else "string"
    if isinstance(kind, list):  # ["integer", "null"]: the first that is not null
        kind = next((k for k in kind if k != "null"), "string")
    return str(kind).strip().lower()


def _trim(value: str) -> str:
    """The value without the newline after its opening tag and the one before its closing tag."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _literal(value: str) -> Any:
    """A Python literal written as the value (single-quoted lists...), if it is one and fits JSON."""
    try:
        return _json_safe(ast.literal_eval(value))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


def _json_safe(value: Any) -> Any:
    """`value` itself if it is valid JSON (no NaN, no sets or bytes); raises ValueError otherwise."""
    json.dumps(value, allow_nan=False)
    return value
