"""partial_json: every prefix of a JSON text renders to a prefix of json.dumps(json.loads(text)), and
the whole text renders to exactly that (what vLLM sends as a call's arguments)."""

from __future__ import annotations

import json
import random

import pytest

from blockspec.server.tool_parsers.partial_json import JsonSyntaxError, parse_prefix, render

FIXED = [
    '{"city": "Paris", "days": 3}',
    '{ "a" :[1,2.50 ,-0.0, 1e3, 1E-2, true,false ,null] , "b":{"c":{}} ,"d":[]}',
    '{"s": "tab\\tquote\\" slash\\/ \\u00e9 \\ud83d\\ude00 \\n"}',
    '[{"name": "f", "parameters": {"x": "y"}}]',
    '"just a string"',
    "[12345]",
    '{"emoji": "😀", "cjk": "天气"}',
]


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["int", "float", "str", "lit"] + (["obj", "arr"] if depth < 3 else []))
    if kind == "int":
        return rng.randint(-10**6, 10**6)
    if kind == "float":
        return rng.choice([0.5, -2.25, 1e-7, 3.0e21, 123.456])
    if kind == "str":
        return "".join(rng.choice('ab "\\\n\té😀/\x01') for _ in range(rng.randint(0, 6)))
    if kind == "lit":
        return rng.choice([True, False, None])
    if kind == "arr":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}{rng.choice('xy')}": _random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def _random_texts(n: int) -> list[str]:
    rng = random.Random(0)
    texts = []
    for _ in range(n):
        value = {"v": _random_value(rng)}
        seps = rng.choice([(",", ":"), (", ", ": "), (" ,\n", " :  ")])
        texts.append(json.dumps(value, ensure_ascii=rng.random() < 0.5, separators=seps, indent=rng.choice([None, 1])))
    return texts


@pytest.mark.parametrize("text", FIXED + _random_texts(40))
def test_every_prefix_renders_to_a_prefix_of_the_canonical_text(text):
    canonical = json.dumps(json.loads(text), ensure_ascii=False)
    node = parse_prefix(text)
    assert node is not None and node.done and render(node) == canonical
    previous = ""
    for cut in range(len(text)):
        node = parse_prefix(text[:cut])
        shown = render(node) if node is not None else ""
        assert canonical.startswith(shown), (cut, shown)
        assert shown.startswith(previous), (cut, shown, previous)  # it never takes anything back
        previous = shown


@pytest.mark.parametrize("text", ['{"a" 1}', '{"a": 1,}', "[1 2]", '{"a": tru}', '{"a": "x\\q"}', '"\x01"', "01",
                                  "{'a': 1}", '{"a": -}', "[1.]"])
def test_invalid_json_is_refused(text):
    with pytest.raises(JsonSyntaxError):
        node = parse_prefix(text)
        if node is not None and node.done and node.end < len(text):  # trailing garbage is the caller's check
            raise JsonSyntaxError("trailing text")


def test_unfinished_tokens_are_held_back():
    assert render(parse_prefix('{"n": 12')) == '{"n": '  # the number may grow
    assert render(parse_prefix('{"s": "ab\\u00')) == '{"s": "ab'  # half an escape
    assert render(parse_prefix('{"s": "\\ud83d')) == '{"s": "'  # a surrogate waiting for its pair
    assert render(parse_prefix('{"t": tr')) == '{"t": '
    assert render(parse_prefix('[1, ')) == "[1, "
    assert parse_prefix("   ") is None
