"""Every tool-call parser on fixed outputs of its format: the whole response (as vLLM's parser gives
it), and streams split at every character position whose deltas add up to that response."""

from __future__ import annotations

import json
import re

import pytest

from blockspec.server.tool_parsers import PARSERS, NamedCallParser, RequiredCallsParser, ToolParser
from blockspec.server.tool_parsers.base import CallDelta

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
    "metric": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"},
    "when": {"type": ["string", "null"]}, "level": {"type": "custom"}}}}},
    {"type": "function", "function": {"name": "now", "parameters": None}}]
CHATCMPL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def whole(parser: ToolParser, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parser.parse(text)
    for call in calls:
        assert CHATCMPL_ID.fullmatch(call.id)
        assert call.to_dict()["type"] == "function"
    return content, [(c.name, c.arguments) for c in calls]


def streamed(parser: ToolParser, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]], list[CallDelta]]:
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    content = "".join(d.content for d in deltas)
    calls: dict[int, list] = {}
    pieces_seen = [c for d in deltas for c in d.calls]
    for c in pieces_seen:
        if c.id is not None:
            assert c.index == len(calls) and c.name, "a header comes once per call, in order"
            calls[c.index] = [c.name, ""]
        else:
            assert c.index in calls, "arguments only after the call's header"
        calls[c.index][1] += c.arguments or ""
    return content or None, [tuple(calls[i]) for i in sorted(calls)], pieces_seen


def check_streams(make, text: str, expected) -> list[CallDelta]:
    """The whole response is `expected`; so is every stream of the same text, however it is split."""
    assert whole(make(), text) == expected
    for cut in range(len(text) + 1):
        assert streamed(make(), [text[:cut], text[cut:]])[:2] == expected, cut
    content, calls, deltas = streamed(make(), list(text))
    assert (content, calls) == expected
    return deltas


def _args(**kw) -> str:
    return json.dumps(kw, ensure_ascii=False)


HERMES = [
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
     '<tool_call>\n{"name": "now", "arguments": "{\\"tz\\": \\"UTC\\"}"}\n</tool_call>',
     ("Let me check.\n", [("get_weather", _args(city="Paris", days=3)), ("now", _args(tz="UTC"))])),
    ('<tool_call>{"arguments": {"q": [1,2.50,{"e":"\\u00e9\\ud83d\\ude00"}]},"name":"now"}</tool_call>',
     (None, [("now", _args(q=[1, 2.5, {"e": "é😀"}]))])),
    ('<tool_call>\n{"name": "now", "arguments": {}}\n', (None, [("now", "{}")])),  # unclosed at the end
    ("plain answer, a < sign and <tool_ca", ("plain answer, a < sign and <tool_ca", [])),
    ('<tool_call>{"name": "now", oops}</tool_call>', ('<tool_call>{"name": "now", oops}</tool_call>', [])),
    ('<tool_call>{"name": "now"}</tool_call>', ('<tool_call>{"name": "now"}</tool_call>', [])),
]
# Broken after a call's header could already have been streamed: the whole response is all content
# (vLLM); a stream cannot take its header back, so it stops there.
BROKEN_LATE = [
    ("hermes", '<tool_call>{"name": "now", "arguments": {"a": 1}'),
    ("llama3_json", '{"name": "now", "parameters": {}} and more'),
    ("llama3_json", '{"name": "now", "parameters": {}}; {"x": 1}'),
]

XML_CALL = ("Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=temp>\n21.5\n</parameter>\n<parameter=metric>\nTrue\n"
            "</parameter>\n<parameter=opts>\n{\"unit\": \"C\"}\n</parameter>\n<parameter=tags>\n['a', 'b']\n"
            "</parameter>\n<parameter=when>\nnull\n</parameter>\n<parameter=extra>\n42\n</parameter>\n"
            "<parameter=level>\n[1]\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=now>\n</function>\n</tool_call>")
XML_ARGS = dict(city="San Francisco", days=3, temp=21.5, metric=True, opts={"unit": "C"}, tags=["a", "b"], when=None,
                extra="42")
QWEN3_CODER = [
    (XML_CALL, ("Sure.\n", [("get_weather", _args(**XML_ARGS, level=[1])), ("now", "{}")])),
    # no <tool_call> wrapper, no </parameter>: the next tag ends a value (vLLM's fallbacks)
    ("<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\nthree\n</function>",
     (None, [("get_weather", _args(city="Paris", days="three"))])),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome", (None, [("get_weather", _args(city="Rome"))])),
    ("no call: a <function without its =", ("no call: a <function without its =", [])),
    ("<tool_call>\n<function=get_weather\n</tool_call>", ("<tool_call>\n<function=get_weather\n</tool_call>", [])),
]
QWEN3_XML = [
    (XML_CALL, ("Sure.\n", [("get_weather", _args(**XML_ARGS, level="[1]")), ("now", "{}")])),
    ('<tool_call>\n<function=get_weather>\n<parameter=city>\nA "quoted"\n\nname\n\n</parameter>\n</function>\n'
     '</tool_call>', (None, [("get_weather", _args(city='A "quoted"\n\nname\n'))])),
]
LLAMA3_JSON = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "arguments": {}}',
     (None, [("get_weather", _args(city="Paris")), ("now", "{}")])),
    ('<|python_tag|>{"name": "now", "parameters": {"tz": "UTC"}}', (None, [("now", _args(tz="UTC"))])),
    ('  {"name": "now", "parameters": {}}  ', (None, [("now", "{}")])),
    ('The answer is {"a": 1}', ('The answer is {"a": 1}', [])),
    ('{"answer": 42}', ('{"answer": 42}', [])),
]


@pytest.mark.parametrize("name, cases", [("hermes", HERMES), ("qwen3_coder", QWEN3_CODER),
                                         ("qwen3_xml", QWEN3_XML), ("llama3_json", LLAMA3_JSON)])
def test_parser_whole_and_split_at_every_character(name, cases):
    for text, expected in cases:
        check_streams(lambda: PARSERS[name](TOOLS), text, expected)


@pytest.mark.parametrize("name, text", BROKEN_LATE)
def test_output_broken_after_a_call_started(name, text):
    assert whole(PARSERS[name](TOOLS), text) == (text, [])
    for cut in range(len(text) + 1):
        content, calls, _ = streamed(PARSERS[name](TOOLS), [text[:cut], text[cut:]])
        assert content == (None if calls else text)  # all content, or the calls it had begun and no more


def test_stream_ids_and_headers_follow_vllm():
    text = QWEN3_CODER[0][0]
    coder = [d for d in streamed(PARSERS["qwen3_coder"](TOOLS), [text])[2] if d.id]
    assert all(CALL_ID.fullmatch(d.id) for d in coder)  # vLLM's qwen3_coder streams call_ ids
    assert coder[0].to_dict()["function"] == {"name": "get_weather", "arguments": coder[0].arguments}
    header = streamed(PARSERS["hermes"](TOOLS), ['<tool_call>{"name": "now", "arguments": '])[2][0]
    assert CHATCMPL_ID.fullmatch(header.id)
    assert header.to_dict() == {"index": 0, "id": header.id, "type": "function", "function": {"name": "now"}}
    assert CallDelta(1, arguments='{"a').to_dict() == {"index": 1, "function": {"arguments": '{"a'}}


def test_xml_string_values_stream_as_they_grow():
    head = "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Fran"
    for name, shown in (("qwen3_xml", '{"city": "San Fran'), ("qwen3_coder", "")):
        parser = PARSERS[name](TOOLS)
        pieces = [c.arguments or "" for ch in head for c in parser.feed(ch).calls]
        assert "".join(pieces) == shown  # qwen3_coder sends a value once it is whole
        rest = [c.arguments or "" for c in parser.finish("cisco\n</parameter>\n</function>").calls]
        assert "".join(pieces + rest) == _args(city="San Francisco")


def test_forced_calls_read_the_grammar_json():
    required = ('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                '{"name": "now", "parameters": {}}]')
    check_streams(lambda: RequiredCallsParser(TOOLS), required,
                  (None, [("get_weather", _args(city="Paris")), ("now", "{}")]))
    for broken in ('[{"name": "now", "parameters": {}}', "[]", '[{"name": "now"}]', '{"name": "now"}'):
        assert whole(RequiredCallsParser(TOOLS), broken) == (broken, [])  # cut off or not calls: content
    named = '{"city": "Paris", "days": 2}'
    check_streams(lambda: NamedCallParser(TOOLS, "get_weather"), named, (None, [("get_weather", named)]))
