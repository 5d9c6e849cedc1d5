"""Every error is OpenAI-shaped JSON with the right status: 400 / 401 / 404 / 503, never a 500."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY
from tests.server.server_helpers import start_server, tiny_engine_config, wait_healthy

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


@pytest.mark.parametrize("body, param, words", [
    ({**CHAT, "temperature": -1}, "temperature", "non-negative"),
    ({**CHAT, "top_p": 0}, "top_p", "top_p"),
    ({**CHAT, "max_tokens": 0}, "max_tokens", "at least 1"),
    ({**CHAT, "max_tokens": "many"}, "max_tokens", "integer"),
    ({**CHAT, "n": 0}, "n", "between"),
    ({**CHAT, "logprobs": True, "top_logprobs": 50}, "top_logprobs", "top_logprobs"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({**CHAT, "min_tokens": 9}, "min_tokens", "max_tokens"),
    ({**CHAT, "seed": 1 << 70}, "seed", "64 bits"),
    ({**CHAT, "logit_bias": {"5": 1.0}}, "logit_bias", "not supported"),
    ({**CHAT, "response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({**CHAT, "messages": []}, "messages", "empty"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages", "role"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages", "text only"),
    ({**CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "tokenize"),
    ({"model": "tiny"}, "messages", "required"),
])
def test_invalid_chat_parameters_are_400_naming_the_field(tiny_server, body, param, words):
    err = _error(httpx.post(tiny_server.v1 + "/chat/completions", json=body, timeout=30), 400)
    assert err["param"] == param and words in err["message"], err


def test_prompt_plus_max_tokens_over_max_model_len_gives_the_numbers(tiny_server):
    err = _error(httpx.post(tiny_server.v1 + "/chat/completions", json={**CHAT, "max_tokens": 600}, timeout=30), 400)
    assert "600" in err["message"] and "512" in err["message"] and err["param"] == "max_tokens"
    long_prompt = {"model": "tiny", "prompt": "x" * 600, "max_tokens": 1}
    err = _error(httpx.post(tiny_server.v1 + "/completions", json=long_prompt, timeout=30), 400)
    assert "600" in err["message"] and "512" in err["message"]


@pytest.mark.parametrize("raw", [b'{"model": "tiny", "messages": [', b"not json at all", b"[1, 2]", b""])
def test_malformed_json_is_400(tiny_server, raw):
    resp = httpx.post(tiny_server.v1 + "/chat/completions", content=raw,
                      headers={"content-type": "application/json"}, timeout=30)
    _error(resp, 400)


@pytest.mark.parametrize("body, param", [
    ({"model": "tiny", "prompt": ""}, "prompt"),
    ({"model": "tiny", "prompt": []}, "prompt"),
    ({"model": "tiny", "prompt": [1, 2, 100000]}, "prompt"),
    # ids past int64, echoed: refused before the echo's detokenizer reads them (it raised OverflowError: a 500)
    ({"model": "tiny", "prompt": [[1, 2], [142344693303439549152926629888, 3]], "echo": True}, "prompt"),
    ({"model": "tiny", "prompt": [5, 1000], "echo": True}, "prompt"),
    ({"model": "tiny", "prompt": "x", "suffix": "y"}, "suffix"),
    ({"model": "tiny", "prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ({"model": "tiny", "prompt": "x", "stop": [""]}, "stop"),
])
def test_invalid_completion_requests_are_400(tiny_server, body, param):
    assert _error(httpx.post(tiny_server.v1 + "/completions", json=body, timeout=30), 400)["param"] == param


def test_unknown_model_is_404_listing_served_names(tiny_server):
    for path, body in (("/chat/completions", {**CHAT, "model": "gpt-4"}), ("/completions", {"model": "gpt-4",
                                                                                          "prompt": "x"})):
        err = _error(httpx.post(tiny_server.v1 + path, json=body, timeout=30), 404)
        assert "gpt-4" in err["message"] and all(n in err["message"] for n in ("tiny", "tiny-2", "greedy"))
    _error(httpx.get(tiny_server.v1 + "/models/gpt-4", timeout=30), 404)


def test_unknown_fields_are_ignored_and_model_defaults_to_the_first_name(tiny_server):
    body = {"messages": CHAT["messages"], "max_tokens": 2, "cache_prompt": False, "foo": {"bar": [1]},
            "tool_choice": "auto", "parallel_tool_calls": True}
    resp = httpx.post(tiny_server.v1 + "/chat/completions", json=body, timeout=30)
    assert resp.status_code == 200 and resp.json()["model"] == "tiny"


def test_auth_on_every_endpoint_but_health(auth_server):
    url = auth_server.base_url
    assert httpx.get(url + "/health").status_code == 200
    for path in ("/v1/models", "/metrics", "/version", "/openapi.json"):
        assert _error(httpx.get(url + path), 401)["message"].startswith("missing API key")
        _error(httpx.get(url + path, headers={"Authorization": "Bearer wrong"}), 401)
        _error(httpx.get(url + path, headers={"Authorization": f"Basic {API_KEY}"}), 401)
        assert httpx.get(url + path, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    _error(httpx.post(url + "/v1/chat/completions", json=CHAT), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    assert good.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=2).choices


def test_503_while_loading_then_ready(tiny_models):
    from blockspec.engine.engine import Engine

    release = threading.Event()
    config = tiny_engine_config(tiny_models["llama"])

    def slow_factory():
        release.wait(30)
        return Engine(config)

    server = start_server(slow_factory, wait_ready=False)
    try:
        for method, path, body in (("GET", "/health", None), ("GET", "/v1/models", None),
                                   ("POST", "/v1/chat/completions", CHAT),
                                   ("POST", "/v1/completions", {"model": "tiny", "prompt": "x"})):
            err = _error(httpx.request(method, server.base_url + path, json=body, timeout=30), 503)
            assert "loading" in err["message"]
        assert httpx.get(server.base_url + "/version").status_code == 200
        assert httpx.get(server.base_url + "/metrics").status_code == 200
        release.set()
        wait_healthy(server.base_url, timeout=30)
        assert httpx.post(server.v1 + "/chat/completions", json=CHAT, timeout=30).status_code == 200
    finally:
        release.set()
        server.stop()


def test_openapi_lists_the_endpoints(tiny_server):
    spec = httpx.get(tiny_server.base_url + "/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/version", "/metrics"):
        assert path in spec["paths"]
    assert "ChatCompletionRequest" in spec["components"]["schemas"]
