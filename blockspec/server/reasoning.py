"""`--reasoning-parser qwen3`: split `<think>...</think>` off into `reasoning_content`, streaming too.

Whether the output starts inside a thought is read from the prompt, not guessed from the output:
Qwen3.5/3.6 templates open `<think>` in the generation prompt (the model then writes only the
closing tag), while `enable_thinking=false` closes it there (the output is all content). A
thought cut off by max_tokens therefore stays reasoning (content null), as vLLM users expect.
Tags may arrive split across stream deltas; a possible partial tag is held back until it resolves.
"""

from __future__ import annotations

from blockspec.server.tool_parsers.base import partial_tag
from blockspec.structured.reasoning_tags import REASONING_TAGS as PARSERS
from blockspec.structured.reasoning_tags import check_reasoning_parser as check_parser

__all__ = ["PARSERS", "ReasoningParser", "check_parser"]


class ReasoningParser:
    def __init__(self, name: str, prompt: str) -> None:
        self.open_tag, self.close_tag = PARSERS[name]
        self.in_reasoning = prompt.rfind(self.open_tag) > prompt.rfind(self.close_tag)
        self._held = ""
        self._seen_text = False  # an opening tag only counts before any content

    def feed(self, delta: str) -> tuple[str, str]:
        """Text delta -> (reasoning delta, content delta)."""
        text = self._held + delta
        self._held = ""
        reasoning, content = [], []
        while text:
            if self.in_reasoning:
                end = text.find(self.close_tag)
                if end == -1:
                    keep = partial_tag(text, (self.close_tag,))
                    reasoning.append(text[:len(text) - keep])
                    self._held = text[len(text) - keep:]
                    break
                reasoning.append(text[:end])
                text = text[end + len(self.close_tag):]
                self.in_reasoning = False
                self._seen_text = True
                continue
            if not self._seen_text:
                stripped = text.lstrip()
                if stripped.startswith(self.open_tag):
                    text = stripped[len(self.open_tag):]
                    self.in_reasoning = True
                    continue
                if self.open_tag.startswith(stripped):
                    self._held = text  # maybe the start of an opening tag: wait for more
                    break
            self._seen_text = True
            content.append(text)
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """Flush held-back text at the end of the output."""
        held, self._held = self._held, ""
        return (held, "") if self.in_reasoning else ("", held)

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """Whole output -> (reasoning_content, content), None where empty."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        reasoning, content = r1 + r2, c1 + c2
        return reasoning or None, content or None

