"""A chat request's `tools` and `tool_choice`: what they ask for (checked as vLLM checks them, 400
otherwise), the JSON schema that forces a call, and the reader that finds the calls in the output.

`auto` lets the model choose and reads its calls with `--tool-call-parser`, so it needs
`--enable-auto-tool-choice`. `required` and a named function need no flag: the output is
constrained by a JSON schema (vLLM's: an array of {"name", "parameters"} with anyOf over the tools,
or the named function's parameters), and that JSON is turned into tool calls.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Literal

from blockspec.server.errors import bad_request
from blockspec.server.protocol import ChatCompletionRequest
from blockspec.server.server_config import ServerConfig
from blockspec.server.tool_parsers import PARSERS, NamedCallParser, RequiredCallsParser, ToolParser
from blockspec.structured.spec import StructuredSpec

CHOICES = ("none", "auto", "required")
NAMED_USAGE = 'use {"type": "function", "function": {"name": "my_function"}}'
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolUse:
    """What a request asks of tools: `choice` none / auto / required / named (then `function`)."""

    tools: list[dict[str, Any]]  # as the chat template receives them
    choice: Literal["none", "auto", "required", "named"]
    function: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def structured(self) -> StructuredSpec | None:
        """The JSON schema a forced call's output must follow (None: the model writes freely)."""
        if self.choice == "required":
            return StructuredSpec("json_schema", required_schema(self.tools))
        if self.choice == "named":
            return StructuredSpec("json_schema", _parameters(self._tool(self.function)) or NO_PARAMETERS)
        return None

    def parser(self, parser_name: str | None) -> ToolParser | None:
        """A fresh reader of one choice's calls (None: the output is all content)."""
        if self.choice == "required":
            return RequiredCallsParser(self.tools)
        if self.choice == "named":
            return NamedCallParser(self.tools, self.function)
        if self.choice == "auto" and parser_name is not None:
            return PARSERS[parser_name](self.tools)
        return None

    def _tool(self, name: str | None) -> dict[str, Any]:
        return next(t for t in self.tools if t["function"]["name"] == name)


def tool_use(req: ChatCompletionRequest, config: ServerConfig) -> ToolUse | None:
    """The request's tool use (None without tools); 400 on what vLLM refuses."""
    choice = req.tool_choice
    if req.tools is None:  # "auto" without tools has nothing to choose from: plain output (clients send it)
        if choice not in (None, "none", "auto"):
            raise bad_request(f"tool_choice {choice!r} needs tools: when using `tool_choice`, `tools` must be set",
                              "tool_choice")
        return None
    if not req.tools:
        raise bad_request("`tools` must not be an empty array: give at least one tool or leave the field out", "tools")
    tools = [tool.model_dump() for tool in req.tools]
    for i, tool in enumerate(tools):
        if not tool["function"]["name"]:
            raise bad_request(f"tools[{i}].function.name must not be empty", "tools")
    parallel = req.parallel_tool_calls is not False
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        return ToolUse(tools, "named", _named_function(choice, tools), parallel)
    if choice not in CHOICES:
        raise bad_request(f"invalid value for tool_choice: {choice!r}; use \"none\", \"auto\", \"required\" or a "
                          f"named function ({NAMED_USAGE})", "tool_choice")
    if choice == "auto" and not (config.enable_auto_tool_choice and config.tool_call_parser):
        raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                          '(or send tool_choice "none", "required" or a named function)', "tool_choice")
    return ToolUse(tools, choice, None, parallel)


def _named_function(choice: dict[str, Any], tools: list[dict[str, Any]]) -> str:
    function = choice.get("function")
    if choice.get("type", "function") != "function" or not isinstance(function, dict):
        raise bad_request(f"invalid value for tool_choice: {choice!r}; {NAMED_USAGE}", "tool_choice")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"tool_choice.function.name must be a function's name; {NAMED_USAGE}", "tool_choice")
    names = [t["function"]["name"] for t in tools]
    if name not in names:
        raise bad_request(f"tool_choice names the function {name!r}, which is not in tools "
                          f"({', '.join(map(repr, names))})", "tool_choice")
    return name


def _parameters(tool: dict[str, Any]) -> dict[str, Any] | None:
    return tool["function"].get("parameters")


def required_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's schema for `tool_choice: required`: a non-empty array of calls, each one of the tools'
    {"name", "parameters"}; the tools' `$defs` move to the top so their references resolve."""
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        name = tool["function"]["name"]
        params = copy.deepcopy(_parameters(tool)) or copy.deepcopy(NO_PARAMETERS)
        for key, schema in params.pop("$defs", {}).items():
            if key in defs and defs[key] != schema:
                raise bad_request(f"tools define $defs.{key} twice, differently: give the definitions distinct "
                                  "names", "tools")
            defs[key] = schema
        variants.append({"properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if defs:
        schema["$defs"] = defs
    return schema


def history_arguments_as_dicts(messages: list[dict[str, Any]]) -> None:
    """Assistant tool calls' arguments, sent as JSON strings, become the dicts chat templates expect
    (as vLLM does); 400 when one is not JSON."""
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if message["role"] != "assistant" or not isinstance(calls, list):
            continue
        converted = []
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise bad_request(f"messages[{i}].tool_calls[{j}] needs a function with a name", "messages")
            arguments = function.get("arguments") or {}
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError as exc:
                    raise bad_request(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON "
                                      f"({exc.msg})", "messages") from None
            converted.append({**call, "function": {**function, "arguments": arguments}})
        message["tool_calls"] = converted
