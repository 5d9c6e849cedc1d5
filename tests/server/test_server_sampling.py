"""Request -> SamplingParams: defaults stack (generation config < override < alias < request)."""

from __future__ import annotations

import json

import pytest

from blockspec.server.errors import APIError
from blockspec.server.protocol import ChatCompletionRequest, CompletionRequest
from blockspec.server.sampling import for_choice, sampling_params
from blockspec.server.served_models import ServedModels, generation_config_defaults

MESSAGES = [{"role": "user", "content": "x"}]


def test_generation_config_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 256, "eos_token_id": 2}))
    assert generation_config_defaults("auto", tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                            "max_tokens": 256}
    assert generation_config_defaults("vllm", tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.9}))
    assert generation_config_defaults("auto", tmp_path) == {"temperature": 0.0}


def test_defaults_stack_and_only_sent_fields_override():
    models = ServedModels(["base"], {"fast": {"temperature": 0.0}})
    models.base_defaults = {"temperature": 0.6, "top_p": 0.9}
    _, base = models.resolve("base")
    _, fast = models.resolve("fast")
    assert sampling_params(ChatCompletionRequest(messages=MESSAGES), base).temperature == 0.6
    assert sampling_params(ChatCompletionRequest(messages=MESSAGES), fast).temperature == 0.0
    assert sampling_params(ChatCompletionRequest(messages=MESSAGES, temperature=1.2), fast).temperature == 1.2
    assert sampling_params(ChatCompletionRequest(messages=MESSAGES, temperature=None), fast).top_p == 0.9
    with pytest.raises(APIError) as err:
        models.resolve("other")
    assert err.value.status == 404 and "base, fast" in err.value.message


def test_max_tokens_defaults_and_choice_seeds():
    chat = sampling_params(ChatCompletionRequest(messages=MESSAGES, max_completion_tokens=5, max_tokens=9), {})
    assert chat.max_tokens == 5
    assert sampling_params(ChatCompletionRequest(messages=MESSAGES), {}).max_tokens is None  # room left
    assert sampling_params(CompletionRequest(prompt="x"), {}).max_tokens == 16  # OpenAI's legacy default
    params = sampling_params(CompletionRequest(prompt="x", seed=3, stop="END"), {})
    assert params.stop == ["END"]
    assert [for_choice(params, i).seed for i in range(3)] == [3, 4, 5]
    assert for_choice(params, 1).stop is not params.stop
