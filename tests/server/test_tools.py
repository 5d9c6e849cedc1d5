"""tools / tool_choice: vLLM's checks (400 naming the problem), the JSON schema a forced call is held
to, and history tool calls handed to chat templates with dict arguments."""

from __future__ import annotations

import json

import pytest

from blockspec.server.errors import APIError
from blockspec.server.protocol import ChatCompletionRequest
from blockspec.server.server_config import ServerConfig
from blockspec.server.tool_parsers import PARSERS, NamedCallParser, RequiredCallsParser
from blockspec.server.tools import history_arguments_as_dicts, required_schema, tool_use

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
AUTO = ServerConfig(served_model_names=["m"], model_root="m", enable_auto_tool_choice=True, tool_call_parser="hermes")
PLAIN = ServerConfig(served_model_names=["m"], model_root="m")


def _use(config=AUTO, **body):
    return tool_use(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body), config)


def test_tool_choice_modes():
    assert _use() is None and _use(PLAIN, tool_choice="auto") is None  # no tools: nothing to choose
    auto = _use(tools=[WEATHER, NOW])
    assert auto.choice == "auto" and auto.structured() is None and isinstance(auto.parser("hermes"), PARSERS["hermes"])
    assert auto.tools[1] == {"type": "function", "function": {"name": "now", "description": None, "parameters": None}}
    assert _use(tools=[WEATHER], tool_choice="none").parser("hermes") is None
    named = _use(PLAIN, tools=[WEATHER, NOW], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                 parallel_tool_calls=False)
    assert (named.choice, named.function, named.parallel) == ("named", "get_weather", False)
    assert named.structured().value == WEATHER["function"]["parameters"]
    assert isinstance(named.parser(None), NamedCallParser)
    required = _use(PLAIN, tools=[WEATHER, NOW], tool_choice="required")
    assert required.structured().kind == "json_schema" and isinstance(required.parser(None), RequiredCallsParser)


@pytest.mark.parametrize("config, body, message", [
    (PLAIN, {"tools": [WEATHER]}, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'),
    (PLAIN, {"tools": [WEATHER], "tool_choice": "auto"}, "--enable-auto-tool-choice"),
    (AUTO, {"tool_choice": "required"}, "`tools` must be set"),
    (AUTO, {"tools": []}, "must not be an empty array"),
    (AUTO, {"tools": [WEATHER], "tool_choice": "any"}, "invalid value for tool_choice: 'any'"),
    (AUTO, {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "names the function 'nope', which is not in tools ('get_weather')"),
    (AUTO, {"tools": [WEATHER], "tool_choice": {"type": "function"}}, '{"type": "function", "function": {"name"'),
    (AUTO, {"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name must not be empty"),
])
def test_bad_tool_requests_are_400s(config, body, message):
    with pytest.raises(APIError) as err:
        _use(config, **body)
    assert err.value.status == 400 and message in err.value.message


def test_required_schema_is_vllms():
    defs_tool = {"type": "function", "function": {"name": "put", "parameters": {
        "type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}}, "$defs": {"Item": {"type": "string"}}}}}
    schema = required_schema(_use(tools=[WEATHER, NOW, defs_tool]).tools)
    assert schema == {
        "type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                            "parameters": WEATHER["function"]["parameters"]}, "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["now"]},
                            "parameters": {"type": "object", "properties": {}}}, "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["put"]}, "parameters": {
                "type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}}}},
             "required": ["name", "parameters"]}]},
        "$defs": {"Item": {"type": "string"}}}
    clash = {"type": "function", "function": {"name": "x", "parameters": {"$defs": {"Item": {"type": "integer"}}}}}
    with pytest.raises(APIError, match=r"\$defs.Item twice"):
        required_schema(_use(tools=[defs_tool, clash]).tools)
    # JSON that follows the schema is what RequiredCallsParser turns into calls
    content, calls = RequiredCallsParser().parse(json.dumps([{"name": "put", "parameters": {"item": "a"}}]))
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("put", {"item": "a"})]


def test_history_arguments_reach_templates_as_dicts():
    messages = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function", "function": {"name": "now", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    history_arguments_as_dicts(messages)
    assert [c["function"]["arguments"] for c in messages[0]["tool_calls"]] == [{"city": "Paris"}, {}]
    bad = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]
    with pytest.raises(APIError, match=r"messages\[0\].tool_calls\[0\].function.arguments is not valid JSON"):
        history_arguments_as_dicts(bad)
