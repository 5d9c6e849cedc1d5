"""What a request constrains its output to; the engine enforces it with a grammar engine at every decode and verify position."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class StructuredSpec:
    """kind and its value: a JSON schema (dict), None (json_object), a regex (str), choices (list[str]) or an EBNF/Lark grammar (str)."""

    kind: StructuredKind
    value: Any = None
