"""What every tool-call parser shares: turning successive looks at a growing output into OpenAI deltas.

A parser only says, for the text so far, how much of it is plain content and how far each call has
got (`scan`). This class does the rest the same way for all formats: content deltas, one header per
call (id, name) when its name is certain, argument pieces as they become certain, and the whole
response from one look at the finished text. Because the streamed pieces and the whole response
come from the same scan, their concatenation is the whole response's arguments string.
"""

from __future__ import annotations

import logging
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("blockspec.server")


class NotACall(ValueError):
    """The output broke the call format: it is returned as content instead."""


def random_tool_call_id() -> str:
    """vLLM's tool call id."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class CallProgress:
    """How far one call has got: its name once certain, and the certain prefix of its arguments."""

    name: str | None
    arguments: str = ""


@dataclass
class Scan:
    content_end: int  # text[:content_end] is plain content
    calls: list[CallProgress]


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class CallDelta:
    """One call's piece of a stream chunk: its header (id, name) the first time, then argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
            function["name"] = self.name
        if self.arguments is not None:
            function["arguments"] = self.arguments
        out["function"] = function
        return out


@dataclass
class Delta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class ToolParser(ABC):
    """Reads one choice's output: either streamed (`feed` ... `finish`) or whole (`parse`), not both."""

    header_has_arguments = False  # vLLM's XML parsers send `arguments: ""` with the name

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []
        self._text = ""
        self._content_sent = 0
        self._ids: list[str] = []
        self._args_sent: list[str] = []
        self._diverged: set[int] = set()  # calls whose arguments changed after streaming (not sent further)
        self._as_content = False  # the output broke the format before any call went out: all content
        self._stopped = False  # ... after a call went out: the rest is dropped

    @abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """Content and calls of `text`; `final`: nothing more will come. Raises NotACall."""

    def stream_id(self) -> str:
        return random_tool_call_id()

    def whole_id(self) -> str:
        return random_tool_call_id()

    def tool_parameters(self, name: str) -> dict[str, Any]:
        """The JSON schema of the parameters of the tool called `name` ({} if unknown)."""
        for tool in self.tools:
            function = tool.get("function") or {}
            if function.get("name") == name:
                return function.get("parameters") or {}
        return {}

    @property
    def called(self) -> bool:
        """Whether a streamed call has gone out."""
        return bool(self._ids)

    def feed(self, text: str) -> Delta:
        self._text += text
        return self._advance(final=False)

    def finish(self, text: str = "") -> Delta:
        """The last text: what was held back (a possible tag start, an unfinished call) is settled."""
        self._text += text
        return self._advance(final=True)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole output -> (content, calls); output that is not a well-formed call is all content."""
        try:
            scan = self.scan(text, final=True)
        except NotACall as exc:
            log.info("tool call not parsed (%s); returned as content", exc)
            return text or None, []
        calls = [ToolCall(self.whole_id(), c.name, c.arguments) for c in scan.calls if c.name is not None]
        if not calls:
            return text or None, []
        return text[:scan.content_end] or None, calls

    def _advance(self, final: bool) -> Delta:
        if self._stopped:
            return Delta()
        if not self._as_content:
            try:
                scan = self.scan(self._text, final)
            except NotACall as exc:
                if self._ids:
                    log.warning("a streamed tool call broke off (%s); the rest of the output is dropped", exc)
                    self._stopped = True
                    return Delta()
                self._as_content = True
        if self._as_content:
            return self._content_delta(len(self._text))
        named = [c for c in scan.calls if c.name is not None]
        content_end = len(self._text) if final and not named and not self._ids else scan.content_end
        delta = self._content_delta(content_end)
        for i, call in enumerate(named):
            piece = self._call_delta(i, call)
            if piece is not None:
                delta.calls.append(piece)
        return delta

    def _content_delta(self, end: int) -> Delta:
        start, self._content_sent = self._content_sent, max(self._content_sent, end)
        return Delta(content=self._text[start:end])

    def _call_delta(self, index: int, call: CallProgress) -> CallDelta | None:
        assert call.name is not None
        piece = CallDelta(index)
        if index == len(self._ids):
            self._ids.append(self.stream_id())
            self._args_sent.append("")
            piece.id, piece.name = self._ids[index], call.name
            if self.header_has_arguments:
                piece.arguments = ""
        sent = self._args_sent[index]
        if len(call.arguments) > len(sent) and index not in self._diverged:
            if not call.arguments.startswith(sent):
                log.warning("tool call %d: its arguments changed after they were streamed; not sending more", index)
                self._diverged.add(index)
                return piece if piece.id is not None else None
            piece.arguments = (piece.arguments or "") + call.arguments[len(sent):]
            self._args_sent[index] = call.arguments
        return piece if piece.id is not None or piece.arguments is not None else None


def partial_tag(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that may be the start of one of `tags` (held back)."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best
