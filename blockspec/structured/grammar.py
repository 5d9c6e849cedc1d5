"""A StructuredSpec as a grammar of the grammar engine (xgrammar), before any tokenizer is involved.

Building the grammar parses and checks the spec (an invalid JSON schema, regex or grammar raises a
RequestError that names the problem), so the server can refuse a bad request at once, and the
engine's compiler (compiler.py) only has to specialise a known-good grammar to its vocabulary.
"""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from blockspec.errors import RequestError
from blockspec.structured.spec import StructuredSpec

_ENGINE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+\.cc:\d+:\s*")  # "[12:00:00] /project/cpp/x.cc:83: "


def _reason(exc: Exception) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return _ENGINE_PREFIX.sub("", lines[0]) if lines else type(exc).__name__


def spec_key(spec: StructuredSpec) -> str:
    """A canonical string for caching: equal specs (dict key order aside) share one compiled grammar."""
    return json.dumps([spec.kind, spec.value], sort_keys=True, ensure_ascii=False)


def check_json_schema(schema: object) -> None:
    """Refuse what is not a JSON schema (the meta-schema of its draft, 2020-12 by default)."""
    import jsonschema

    if not isinstance(schema, (dict, bool)):
        raise RequestError(f"invalid JSON schema: a schema is a JSON object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise RequestError(f"invalid JSON schema{f' at {where}' if where else ''}: {exc.message}") from None


# String formats xgrammar generates; any other format would be dropped silently.
_FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
            "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}
_ARRAY_UNENFORCED = ("uniqueItems", "contains", "minContains", "maxContains")


def unenforced_keyword(schema: object) -> str | None:
    """The first keyword (with its path) of a schema that xgrammar accepts but does not enforce, if any:
    output could then violate the schema without an error anywhere."""

    def visit(node: object, path: str) -> str | None:
        if isinstance(node, list):
            return next((hit for i, item in enumerate(node) if (hit := visit(item, f"{path}/{i}"))), None)
        if not isinstance(node, dict):
            return None
        types = node.get("type")
        types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
        here = None
        if types & {"integer", "number"} and "multipleOf" in node:
            here = "multipleOf"
        elif "array" in types:
            here = next((k for k in _ARRAY_UNENFORCED if k in node), None)
        if here is None and "string" in types:
            if "format" in node and node["format"] not in _FORMATS:
                here = f"format {node['format']!r}"
            elif ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
                here = "minLength/maxLength with pattern or format"
        if here is not None:
            return f"{here} at {path or '/'}"
        return next((hit for key, value in node.items() if (hit := visit(value, f"{path}/{key}"))), None)

    return visit(schema, "")


def choice_ebnf(choices: list[str]) -> str:
    """The grammar of exactly one of the strings (JSON string escapes are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def is_ebnf(grammar: str) -> bool:
    """EBNF/GBNF rules are written `name ::= ...`; anything else is read as Lark (`name: ...`)."""
    return "::=" in grammar


def build_grammar(spec: StructuredSpec) -> xgr.Grammar:
    """The grammar engine's grammar for spec; RequestError naming the problem if spec is invalid."""
    kind, value = spec.kind, spec.value
    if kind == "json_object":  # OpenAI's JSON mode: any JSON object
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=True)
    if kind == "json_schema":
        check_json_schema(value)
        unsupported = unenforced_keyword(value)
        if unsupported is not None:
            raise RequestError(f"JSON schema keyword {unsupported} is not supported by the grammar engine (it would "
                               "not be enforced): remove it")
        return _engine_call("JSON schema", lambda: xgr.Grammar.from_json_schema(json.dumps(value), any_whitespace=True))
    if kind == "regex":
        if not isinstance(value, str) or not value or "\x00" in value:
            raise RequestError("invalid regex: it must be a non-empty string without NUL characters")
        return _engine_call("regex", lambda: xgr.Grammar.from_regex(value))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise RequestError("invalid choice: it must be a non-empty list of non-empty strings")
        return _engine_call("choice", lambda: xgr.Grammar.from_ebnf(choice_ebnf(value)))
    if kind == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise RequestError("invalid grammar: it must be a non-empty EBNF (root ::= ...) or Lark (start: ...) "
                               "string")
        if is_ebnf(value):
            return _engine_call("EBNF grammar", lambda: xgr.Grammar.from_ebnf(value))
        return _engine_call("Lark grammar", lambda: xgr.Grammar.from_lark(value))
    raise RequestError(f"unknown structured output kind {kind!r}: use json_schema, json_object, regex, choice or "
                       "grammar")


def _engine_call(what: str, build) -> xgr.Grammar:
    try:
        return build()
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar reports parse errors as RuntimeError
        raise RequestError(f"invalid {what}: {_reason(exc)}") from None
