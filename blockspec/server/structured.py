"""The request fields that constrain the output, mapped to one StructuredSpec (or a 400 naming the problem).

Clients say the same thing in three dialects: OpenAI's `response_format`, vLLM's `structured_outputs`
and vLLM's older `guided_*` fields. At most one constraint may be given; it is parsed and checked here
(JSON schema against its meta-schema, regex and grammar by the grammar engine's parser), so a bad one
is refused before the request reaches the engine.
"""

from __future__ import annotations

import json
from typing import Any

from blockspec.errors import RequestError
from blockspec.server.errors import bad_request
from blockspec.server.protocol import SamplingRequest
from blockspec.structured.backend import backend_problem
from blockspec.structured.grammar import build_grammar
from blockspec.structured.spec import StructuredSpec

# structured_outputs options blockspec does not implement: refused when set rather than silently ignored.
_UNSUPPORTED_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                        "structural_tag")


def _schema(value: Any, param: str) -> dict[str, Any]:
    """A JSON schema given as an object or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise bad_request(f"{param} is not valid JSON ({exc.msg} at position {exc.pos}): send the schema as "
                              "a JSON object", param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be a JSON schema object", param)
    return value


def _from_response_format(req: SamplingRequest) -> tuple[str, StructuredSpec] | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return "response_format", StructuredSpec("json_object")
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise bad_request("response_format of type json_schema needs json_schema.schema (the JSON schema)",
                          "response_format")
    return "response_format", StructuredSpec("json_schema", fmt.json_schema.json_schema)


def _specs(sent: dict[str, tuple[str, Any]]) -> list[tuple[str, StructuredSpec]]:
    """(request field, spec) for each constraint field that was sent: field -> (kind, value or None)."""
    found = []
    for param, (kind, value) in sent.items():
        if value is None:
            continue
        if kind == "json_schema":
            value = _schema(value, param)
        elif kind == "choice":
            value = list(value)
        found.append((param, StructuredSpec(kind, value)))
    return found


def _from_structured_outputs(req: SamplingRequest) -> list[tuple[str, StructuredSpec]]:
    so = req.structured_outputs
    if so is None:
        return []
    for option in _UNSUPPORTED_OPTIONS:
        if getattr(so, option):
            raise bad_request(f"structured_outputs.{option} is not supported by blockspec: leave it out",
                              "structured_outputs")
    found = _specs({"structured_outputs.json": ("json_schema", so.json_schema),
                    "structured_outputs.regex": ("regex", so.regex),
                    "structured_outputs.choice": ("choice", so.choice),
                    "structured_outputs.grammar": ("grammar", so.grammar)})
    if so.json_object:
        found.append(("structured_outputs.json_object", StructuredSpec("json_object")))
    return found


def _from_guided(req: SamplingRequest) -> list[tuple[str, StructuredSpec]]:
    return _specs({"guided_json": ("json_schema", req.guided_json), "guided_regex": ("regex", req.guided_regex),
                   "guided_choice": ("choice", req.guided_choice), "guided_grammar": ("grammar", req.guided_grammar)})


def structured_spec(req: SamplingRequest) -> StructuredSpec | None:
    """The one output constraint of a request, checked; None when it asks for free text."""
    problem = backend_problem(req.guided_decoding_backend) if req.guided_decoding_backend is not None else None
    if problem is not None:
        raise bad_request(problem, "guided_decoding_backend")
    found = _from_structured_outputs(req) + _from_guided(req)
    from_format = _from_response_format(req)
    if from_format is not None:
        found.insert(0, from_format)
    if not found:
        return None
    if len(found) > 1:
        names = [name for name, _ in found]
        raise bad_request(f"conflicting output constraints: {', '.join(names)}; send only one of them", names[1])
    param, spec = found[0]
    try:
        build_grammar(spec)
    except RequestError as exc:
        raise bad_request(f"{param}: {exc}", param.split(".")[0]) from None
    return spec
