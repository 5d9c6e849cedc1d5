"""Structured outputs over HTTP: every request dialect (response_format, structured_outputs, guided_*)
constrains the tiny model's output; bad constraints and conflicts are 400s naming the problem; the
backend flags take xgrammar or auto and refuse anything else."""

from __future__ import annotations

import json
import re
import shlex

import httpx
import openai
import pytest

from blockspec.cli import build_parser
from blockspec.errors import ConfigError
from blockspec.server.args import build_server_config

CHAT = {"model": "greedy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
# A random model fills any whitespace slot of a JSON object for ever; a top-level enum has none.
ANSWER = {"enum": ["yes", "no", {"n": 1}]}
DIGITS = r"[0-9]{3}-[0-9]{2}"


def _chat(server, body: dict) -> httpx.Response:
    return httpx.post(server.v1 + "/chat/completions", json=body, timeout=60)


def _text(resp: httpx.Response) -> tuple[str, str]:
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


@pytest.mark.parametrize("fields, check", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}}, "answer"),
    ({"structured_outputs": {"json": ANSWER}}, "answer"),
    ({"structured_outputs": {"json": json.dumps(ANSWER)}}, "answer"),
    ({"guided_json": ANSWER}, "answer"),
    ({"response_format": {"type": "json_object"}}, "object"),
    ({"structured_outputs": {"json_object": True}}, "object"),
    ({"structured_outputs": {"regex": DIGITS}}, "digits"),
    ({"guided_regex": DIGITS}, "digits"),
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, "colour"),
    ({"guided_choice": ["red", "green", "blue"]}, "colour"),
    ({"structured_outputs": {"grammar": 'root ::= "<" [a-c]{2,4} ">"'}}, "tag"),
    ({"guided_grammar": 'start: "<" /[a-c]{2,4}/ ">"'}, "tag"),
    ({"response_format": {"type": "text"}, "guided_choice": ["red", "green", "blue"]}, "colour"),
])
def test_every_dialect_constrains_the_output(tiny_server, fields, check):
    text, finish = _text(_chat(tiny_server, {**CHAT, **fields, "max_tokens": 120}))
    assert finish == "stop", text
    if check == "answer":
        assert json.loads(text) in ANSWER["enum"]
    elif check == "object":
        assert isinstance(json.loads(text), dict)
    elif check == "digits":
        assert re.fullmatch(DIGITS, text)
    elif check == "colour":
        assert text in ("red", "green", "blue")
    else:
        assert re.fullmatch(r"<[a-c]{2,4}>", text)


def test_completions_and_streaming_follow_the_constraint(tiny_server):
    resp = httpx.post(tiny_server.v1 + "/completions", timeout=60,
                      json={"model": "greedy", "prompt": "x", "max_tokens": 20, "guided_regex": DIGITS})
    assert re.fullmatch(DIGITS, resp.json()["choices"][0]["text"])
    client = openai.OpenAI(base_url=tiny_server.v1, api_key="none", max_retries=0)
    whole = client.chat.completions.create(model="greedy", messages=CHAT["messages"], max_tokens=20,
                                           extra_body={"structured_outputs": {"regex": DIGITS}})
    stream = client.chat.completions.create(model="greedy", messages=CHAT["messages"], max_tokens=20, stream=True,
                                            extra_body={"structured_outputs": {"regex": DIGITS}})
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == whole.choices[0].message.content and re.fullmatch(DIGITS, streamed)


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs", "invalid regex"),
    ({"guided_regex": "[z-a]"}, "guided_regex", "invalid regex"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs", "undefined_rule"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar", "Lark"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_json": {"type": "integer", "multipleOf": 2}}, "guided_json", "multipleOf"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice", "conflicting"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "conflicting"),
    ({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}}, "structured_outputs",
     "disable_any_whitespace"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a+"}, "guided_decoding_backend", "xgrammar"),
])
def test_bad_constraints_are_400_naming_the_problem(tiny_server, fields, param, words):
    resp = _chat(tiny_server, {**CHAT, **fields})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and words in err["message"], err


def _serve_args(flags: str):
    return build_parser().parse_args(["serve", "m", *shlex.split(flags)])


@pytest.mark.parametrize("flags", ['--structured-outputs-config \'{"backend": "xgrammar"}\'',
                                   '--structured-outputs-config \'{"backend": "auto", "disable_fallback": true}\'',
                                   "--guided-decoding-backend xgrammar", "--structured-outputs-config.backend auto"])
def test_backend_flags_accept_xgrammar_and_auto(flags):
    build_server_config(_serve_args(flags))


@pytest.mark.parametrize("flags, words", [
    ('--structured-outputs-config \'{"backend": "guidance"}\'', "'guidance' is not available"),
    ("--guided-decoding-backend outlines", "'outlines' is not available"),
    ("--structured-outputs-config xgrammar", "not valid JSON"),
    ('--structured-outputs-config \'{"disable_any_whitespace": true}\'', "disable_any_whitespace"),
])
def test_backend_flags_refuse_others_clearly(flags, words):
    with pytest.raises(ConfigError, match=words):
        build_server_config(_serve_args(flags))
