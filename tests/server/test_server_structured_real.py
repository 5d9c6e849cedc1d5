"""The embedded SmolLM2-135M-Instruct with its shipped DFlash drafter, served in-process: JSON-schema
output validates (jsonschema) on 20 prompts through the official openai client, half of them streamed."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from blockspec.config import EngineConfig, SpeculativeConfig
from tests.server.server_helpers import start_server

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["person", "place", "animal", "food", "object"]},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["name", "kind", "rating"],
}
SUBJECTS = ["Paris", "a golden retriever", "pizza", "Albert Einstein", "a hammer", "Mount Everest", "sushi",
            "a cat", "Marie Curie", "a bicycle", "Tokyo", "an elephant", "chocolate cake", "a violin",
            "the Amazon river", "Ada Lovelace", "a penguin", "a teapot", "Rome", "an apple"]


@pytest.fixture(scope="module")
def smol_server(default_model):
    from blockspec.loader.default_model import default_drafter_dir

    drafter = default_drafter_dir()
    if drafter is None:
        pytest.skip("no drafter ships for the embedded model")
    config = EngineConfig(model=str(default_model), device="cpu", max_model_len=512, max_num_seqs=20,
                          speculative=SpeculativeConfig(model=str(drafter), num_speculative_tokens=4))
    running = start_server(config, served_model_names=["smol"])
    yield running
    running.stop()


def _ask(client: openai.OpenAI, subject: str, stream: bool) -> tuple[str, str | None]:
    request = dict(model="smol", max_tokens=96, temperature=0,
                   messages=[{"role": "user", "content": f"Describe {subject} as a JSON object."}],
                   response_format={"type": "json_schema", "json_schema": {"name": "card", "schema": SCHEMA}})
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        return choice.message.content, choice.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(**request, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_json_schema_output_validates_on_20_prompts(smol_server):
    client = openai.OpenAI(base_url=smol_server.v1, api_key="none", max_retries=0, timeout=300)
    with ThreadPoolExecutor(len(SUBJECTS)) as pool:  # all in one batch: the engine verifies them together
        outputs = list(pool.map(lambda i: _ask(client, SUBJECTS[i], stream=i % 2 == 1), range(len(SUBJECTS))))
    for subject, (text, finish) in zip(SUBJECTS, outputs):
        assert finish == "stop", (subject, text)
        jsonschema.validate(json.loads(text), SCHEMA)
