"""Tool-call parsers: model output text -> OpenAI tool calls, whole or streamed.

`--tool-call-parser NAME` picks how `tool_choice: auto` output is read; forced calls (`required`, a
named function) are read from the JSON their grammar makes, whatever the parser.
"""

from __future__ import annotations

from blockspec.errors import ConfigError
from blockspec.server.tool_parsers.base import CallDelta, Delta, NotACall, ToolCall, ToolParser
from blockspec.server.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from blockspec.server.tool_parsers.hermes import HermesParser
from blockspec.server.tool_parsers.llama3_json import Llama3JsonParser
from blockspec.server.tool_parsers.qwen3_coder import Qwen3CoderParser
from blockspec.server.tool_parsers.qwen3_xml import Qwen3XmlParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
    "qwen3_xml": Qwen3XmlParser,
    "llama3_json": Llama3JsonParser,
}


def check_tool_parser(name: str | None) -> None:
    if name is not None and name not in PARSERS:
        raise ConfigError(f"--tool-call-parser {name!r} is not supported: use one of {', '.join(PARSERS)}")


__all__ = ["PARSERS", "CallDelta", "Delta", "NamedCallParser", "NotACall", "RequiredCallsParser", "ToolCall",
           "ToolParser", "check_tool_parser"]
