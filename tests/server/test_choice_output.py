"""One choice's message and stream deltas: reasoning first, then tool calls from the content;
parallel_tool_calls=false keeps the first call; finish_reason as vLLM sets it."""

from __future__ import annotations

import json

from blockspec.server.choice_output import ChoiceOutput
from blockspec.server.reasoning import ReasoningParser
from blockspec.server.tools import ToolUse

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": None, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
PROMPT = "<|im_start|>assistant\n"
THINK_THEN_CALLS = ("<think>The user wants weather.</think>\n\n<tool_call>\n<function=get_weather>\n"
                    "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n"
                    "</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
                    "</function>\n</tool_call>")


def _output(choice="auto", parallel=True, function=None) -> ChoiceOutput:
    use = ToolUse(TOOLS, choice, function, parallel)
    return ChoiceOutput(ReasoningParser("qwen3", PROMPT), use.parser("qwen3_coder"), use)


def _stream(output: ChoiceOutput, pieces: list[str]) -> dict:
    reasoning, content, calls = "", "", {}
    for i, piece in enumerate(pieces):
        delta = output.feed(piece, final=i == len(pieces) - 1)
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"name": None, "arguments": ""})
            entry["name"] = call["function"].get("name", entry["name"])
            entry["arguments"] += call["function"].get("arguments", "")
    return {"reasoning": reasoning, "content": content, "calls": [calls[i] for i in sorted(calls)]}


def test_reasoning_then_tool_calls_whole_and_streamed():
    message = _output().message(THINK_THEN_CALLS)
    assert message["reasoning_content"] == "The user wants weather."
    assert message["content"] == "\n\n"  # what came between </think> and the first call, as vLLM keeps it
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert calls == [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome"})]
    for size in (1, 3, 7, len(THINK_THEN_CALLS)):
        output = _output()
        got = _stream(output, [THINK_THEN_CALLS[i:i + size] for i in range(0, len(THINK_THEN_CALLS), size)])
        assert got["reasoning"] == message["reasoning_content"] and got["content"] == message["content"]
        assert got["calls"] == [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                for c in message["tool_calls"]]
        assert output.finish_reason("stop") == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first_call():
    output = _output(parallel=False)
    assert len(output.message(THINK_THEN_CALLS)["tool_calls"]) == 1
    assert len(_stream(_output(parallel=False), list(THINK_THEN_CALLS))["calls"]) == 1


def test_finish_reason_and_content_by_tool_choice():
    plain = _output()
    assert plain.message("<think>hm</think>no call")["content"] == "no call"
    assert plain.finish_reason("length") == "length"
    named = _output("named", function="get_weather")
    message = named.message('{"city": "Oslo"}')
    assert message["content"] == "" and message["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert named.finish_reason("stop") == "stop"  # OpenAI: a named function call finishes with "stop"
    required = _output("required")
    assert required.message('[{"name": "get_weather", "parameters": {}}]')["content"] == ""
    assert required.finish_reason("stop") == "tool_calls"
    cut_off = _output("required")
    assert cut_off.message('[{"name": "get_wea')["content"] == '[{"name": "get_wea'  # not a call: content
    assert cut_off.finish_reason("length") == "length"
