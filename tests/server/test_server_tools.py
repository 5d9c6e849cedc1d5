"""Tool calls over HTTP: 400s, tools and history calls reaching the chat template, the note when the
template ignores tools, and the official openai client against the embedded SmolLM2 (a call, its
result, the answer), streaming and not."""

from __future__ import annotations

import json
import logging
import pkgutil

import httpx
import openai
import pytest

import blockspec.structured
from blockspec.config import EngineConfig, SpeculativeConfig
from tests.conftest import CHATML
from tests.server.server_helpers import start_server, tiny_engine_config

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
# A Qwen-style template in miniature: tools in the system turn, history calls read as dicts.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function.name }} city={{ c.function.arguments.city }}</tool_call>{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _grammar_engine_present() -> bool:
    """The grammar engine (issue 15's other half) lives beside the StructuredSpec contract."""
    return any(m.name != "spec" for m in pkgutil.iter_modules(blockspec.structured.__path__))


needs_grammar = pytest.mark.skipif(not _grammar_engine_present(), reason="needs the grammar engine (wt-structured)")


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(server.v1 + "/chat/completions", json={"messages": USER, "max_tokens": 2, **body}, timeout=60)


@pytest.mark.parametrize("body, param, message", [
    ({"tools": [WEATHER]}, "tool_choice", '"auto" tool choice requires --enable-auto-tool-choice'),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "names the function 'get_time', which is not in tools ('get_weather')"),
    ({"tools": [{"type": "function"}]}, "tools", "tools.0.function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "none"}}]}, "tools", "parameters"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools", "tools.0.type"),
    ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ({"tools": [WEATHER], "tool_choice": "none", "messages": [
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages", "arguments is not valid JSON"),
])
def test_bad_tool_requests_get_400_naming_the_problem(tiny_server, body, param, message):
    resp = _post(tiny_server, {"model": "tiny", **body})
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["param"] == param and message in error["message"], error


@pytest.fixture(scope="module")
def template_servers(tiny_models):
    """One server whose template renders tools, one whose template (ChatML) ignores them."""
    renders = start_server(tiny_engine_config(tiny_models["llama"], chat_template=TOOLS_TEMPLATE),
                           enable_auto_tool_choice=True, tool_call_parser="hermes")
    ignores = start_server(tiny_engine_config(tiny_models["llama"], chat_template=CHATML))
    yield renders, ignores
    renders.stop()
    ignores.stop()


def test_tools_and_history_calls_reach_the_template(template_servers, tiny_models):
    from transformers import AutoTokenizer

    renders, _ = template_servers
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    resp = _post(renders, {"messages": history, "tools": [WEATHER], "return_token_ids": True, "temperature": 0})
    assert resp.status_code == 200, resp.text
    prompt = AutoTokenizer.from_pretrained(tiny_models["llama"]).decode(resp.json()["prompt_token_ids"])
    assert json.dumps({**WEATHER, "function": {**WEATHER["function"]}}) in prompt  # the tool, as tojson writes it
    assert "<tool_call>get_weather city=Paris</tool_call>" in prompt  # arguments reached it as a dict
    assert "sunny, 21 C" in prompt
    assert renders.state.template_ignores_tools is False


def test_the_log_says_once_that_the_template_ignores_tools(template_servers, caplog):
    _, ignores = template_servers
    with caplog.at_level(logging.WARNING, logger="blockspec.server"):
        for _ in range(2):
            resp = _post(ignores, {"tools": [WEATHER], "tool_choice": "none"})
            assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["tool_calls"] == []
    notes = [r for r in caplog.records if "chat template ignores `tools`" in r.getMessage()]
    assert len(notes) == 1 and ignores.state.template_ignores_tools is True


# ---- the embedded SmolLM2-135M-Instruct with the openai client ----------------------------------

def _hermes_call(city: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": {"city": city}}) + "\n</tool_call>"


# Two examples teach the embedded model (whose template ignores tools) hermes' call format.
FEW_SHOT = [{"role": "system", "content": "Answer with a get_weather tool call."}]
for _city in ("London", "Tokyo"):
    FEW_SHOT += [{"role": "user", "content": f"Weather in {_city}?"},
                 {"role": "assistant", "content": _hermes_call(_city)}]


@pytest.fixture(scope="module")
def smol(default_model):
    """The embedded model with its DFlash drafter (several tokens per step reach the parser at once)."""
    from blockspec.loader.default_model import default_drafter_dir

    drafter = default_drafter_dir()
    spec = SpeculativeConfig(model=str(drafter), num_speculative_tokens=7) if drafter else SpeculativeConfig()
    server = start_server(EngineConfig(model=str(default_model), speculative=spec, max_model_len=1024),
                          served_model_names=["smol"], enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)
    server.stop()


def _stream_calls(stream) -> tuple[list[dict], str | None, str]:
    """Tool calls rebuilt from deltas the way clients do (by index), the finish reason, the content."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                if tc.id is not None:
                    assert tc.index not in calls and tc.type == "function" and tc.function.name
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                calls[tc.index]["arguments"] += tc.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish, content


def test_auto_tool_call_loop_with_the_openai_client(smol):
    kwargs = dict(model="smol", tools=[WEATHER], temperature=0, max_tokens=40)
    resp = smol.chat.completions.create(messages=[*FEW_SHOT, *USER], **kwargs)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    calls, finish, content = _stream_calls(smol.chat.completions.create(messages=[*FEW_SHOT, *USER], stream=True,
                                                                         **kwargs))
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]

    # the call and its result go back into the conversation; the model answers in text
    history = [*USER, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    answer = smol.chat.completions.create(messages=history, model="smol", tools=[WEATHER], tool_choice="none",
                                          temperature=0, max_tokens=8)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


@needs_grammar
@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_call_loop(smol, stream):
    """The embedded template ignores tools: the grammar alone makes the model call one."""
    kwargs = dict(model="smol", messages=USER, tools=[WEATHER], tool_choice="required", temperature=0,
                  max_tokens=60)
    if stream:
        calls, finish, _ = _stream_calls(smol.chat.completions.create(stream=True, **kwargs))
    else:
        choice = smol.chat.completions.create(**kwargs).choices[0]
        finish = choice.finish_reason
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls]
    assert finish == "tool_calls" and calls and all(c["name"] == "get_weather" for c in calls)
    assert all(isinstance(json.loads(c["arguments"])["city"], str) for c in calls)
    history = [*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls]}, *({"role": "tool", "tool_call_id": c["id"], "content": "Sunny"} for c in calls)]
    answer = smol.chat.completions.create(model="smol", messages=history, temperature=0, max_tokens=8)
    assert answer.choices[0].message.content


@needs_grammar
@pytest.mark.parametrize("stream", [False, True])
def test_named_function_call(smol, stream):
    kwargs = dict(model="smol", messages=USER, tools=[WEATHER], temperature=0, max_tokens=30,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        calls, finish, _ = _stream_calls(smol.chat.completions.create(stream=True, **kwargs))
    else:
        choice = smol.chat.completions.create(**kwargs).choices[0]
        finish = choice.finish_reason
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
    assert finish == "stop" and [c["name"] for c in calls] == ["get_weather"]  # OpenAI: "stop" for a named call
    assert isinstance(json.loads(calls[0]["arguments"])["city"], str)
