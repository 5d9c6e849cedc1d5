"""Calls written as tagged regions (`<tool_call>...</tool_call>`): the frame hermes and the Qwen3 XML
formats share. Text before the first region is content; text between and after regions is dropped,
as vLLM's whole-response parsers do; each region's body is read by the format."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

from blockspec.server.tool_parsers.base import CallProgress, Scan, ToolParser, partial_tag


class TaggedParser(ToolParser):
    end_tags: dict[str, str]  # start tag -> the tag that closes its region

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._closed_calls: list[CallProgress] = []  # regions already closed: they never change
        self._resume = 0  # where the next look starts
        self._content_end: int | None = None  # the first region's start, once seen

    @abstractmethod
    def parse_body(self, start_tag: str, body: str, closed: bool, final: bool) -> CallProgress | None:
        """One region's call so far (None: the region holds no call); `closed`: its end tag was seen."""

    def scan(self, text: str, final: bool) -> Scan:
        calls = list(self._closed_calls)
        while True:
            start, tag = self._next_start(text, self._resume)
            if tag is None:
                held = 0 if final else partial_tag(text[self._resume:], tuple(self.end_tags))
                self._resume = len(text) - held
                return Scan(self._resume if self._content_end is None else self._content_end, calls)
            if self._content_end is None:
                self._content_end = start
            body_start = start + len(tag)
            end_tag = self.end_tags[tag]
            end = text.find(end_tag, body_start)
            if end == -1:
                body_end = len(text) if final else len(text) - partial_tag(text[body_start:], (end_tag,))
                self._resume = start
                call = self.parse_body(tag, text[body_start:body_end], closed=False, final=final)
                return Scan(self._content_end, calls + ([call] if call is not None else []))
            call = self.parse_body(tag, text[body_start:end], closed=True, final=final)
            if call is not None:
                self._closed_calls.append(call)
                calls.append(call)
            self._resume = end + len(end_tag)

    def _next_start(self, text: str, pos: int) -> tuple[int, str | None]:
        """The earliest start tag at or after `pos` (its position and itself), or (-1, None)."""
        best, found = len(text), None
        for tag in self.end_tags:
            i = text.find(tag, pos, best + len(tag))
            if i != -1 and i < best:
                best, found = i, tag
        return best if found is not None else -1, found
