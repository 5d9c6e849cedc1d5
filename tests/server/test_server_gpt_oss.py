"""A GPT-OSS target (MXFP4 experts) with its DFlash drafter behind the OpenAI API: the checkpoint's chat
template renders the harmony format, and `reasoning_effort` reaches it as a template argument as vLLM
passes it (the field wins over chat_template_kwargs; values outside vLLM's list are a 400)."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.server.server_helpers import start_server, tiny_engine_config
from tests.tiny_gpt_oss import save_tiny_gpt_oss_drafter, save_tiny_gpt_oss_mxfp4

# The shape of GPT-OSS's template (written for this test): the effort in the system message, default medium.
HARMONY = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


@pytest.fixture(scope="module")
def gpt_oss_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_server")
    target = save_tiny_gpt_oss_mxfp4(root / "target")
    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.chat_template = HARMONY
    tokenizer.save_pretrained(target)  # the checkpoint's own template
    drafter = save_tiny_gpt_oss_drafter(root / "drafter", target, block_size=8)
    running = start_server(tiny_engine_config(target, drafter, k=7))
    yield running, tokenizer
    running.stop()


def _prompt(server, **extra) -> httpx.Response:
    running, _ = server
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "return_meta_info": True, **extra}
    return httpx.post(running.v1 + "/chat/completions", json=body, timeout=60)


def test_reasoning_effort_reaches_the_chat_template(gpt_oss_server):
    tokenizer = gpt_oss_server[1]
    cases = [({}, "medium"), ({"reasoning_effort": "low"}, "low"),
             ({"chat_template_kwargs": {"reasoning_effort": "high"}}, "high"),
             ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}, "low")]
    for extra, effort in cases:
        resp = _prompt(gpt_oss_server, **extra)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert tokenizer.decode(body["prompt_token_ids"]) == (
            f"<|start|>system<|message|>Reasoning: {effort}<|end|><|start|>user<|message|>hi<|end|><|start|>assistant")
        assert body["usage"]["completion_tokens"] == 9 and body["meta_info"]["spec_verify_ct"] >= 1


def test_unknown_reasoning_effort_is_a_400(gpt_oss_server):
    resp = _prompt(gpt_oss_server, reasoning_effort="extreme")
    assert resp.status_code == 400 and "reasoning_effort" in resp.text
