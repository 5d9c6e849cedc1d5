"""`--tool-call-parser qwen3_xml`: the same XML calls (Qwen3.5/3.6), string values streamed as they
grow; a type vLLM does not know is read as a string."""

from __future__ import annotations

from blockspec.server.tool_parsers.xml_calls import XmlCallParser


class Qwen3XmlParser(XmlCallParser):
    stream_partial_strings = True
    literal_unknown_types = False
