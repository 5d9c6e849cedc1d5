"""`--tool-call-parser qwen3_coder`: Qwen3-Coder's XML calls; a parameter is streamed once its value
is whole, and streamed calls get `call_...` ids, as vLLM's parser does."""

from __future__ import annotations

import uuid

from blockspec.server.tool_parsers.xml_calls import XmlCallParser


class Qwen3CoderParser(XmlCallParser):
    def stream_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"
