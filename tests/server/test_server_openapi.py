"""/openapi.json states the constraints the server enforces, and a bounded schemathesis run against it
(examples, coverage and fuzzing phases) finds no 5xx.

The ranges in the schema are documentation (pydantic does not enforce them: the server's own checks
do, with their own messages), so the probe below keeps the two in step: for every stated bound, the
value on the bound is taken and the value just past it is a 400), without generating anything.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from blockspec.server.errors import APIError
from blockspec.server.protocol import SEED_RANGE, ChatCompletionRequest, CompletionRequest
from blockspec.server.sampling import sampling_params
from tests.server.server_helpers import start_server, tiny_engine_config

BASE = {"model": "tiny", "max_tokens": 1}
BODIES = {"ChatCompletionRequest": (ChatCompletionRequest, {**BASE, "messages": [{"role": "user", "content": "x"}]}),
          "CompletionRequest": (CompletionRequest, {**BASE, "prompt": "x"})}
NEEDS = {"top_logprobs": {"logprobs": True}}  # a field only valid together with another


def _bounds(schema: dict) -> list[tuple[str, str, float, bool]]:
    """(request model, field, value, whether it is allowed) around every stated numeric bound."""
    cases = []
    for model in BODIES:
        for field, prop in schema["components"]["schemas"][model]["properties"].items():
            integer = "integer" in str(prop)
            if field == "seed":  # 64-bit bounds do not survive a float: checked exactly below
                continue
            step = 1 if integer else 0.01
            if "minimum" in prop:
                cases += [(model, field, prop["minimum"], True), (model, field, prop["minimum"] - step, False)]
            if "exclusiveMinimum" in prop:
                cases += [(model, field, prop["exclusiveMinimum"] + step, True),
                          (model, field, prop["exclusiveMinimum"], False)]
            if "maximum" in prop:
                cases += [(model, field, prop["maximum"], True), (model, field, prop["maximum"] + step, False)]
    return cases


def test_stated_ranges_are_the_enforced_ones(tiny_server):
    schema = httpx.get(tiny_server.base_url + "/openapi.json", timeout=30).json()
    cases = _bounds(schema)
    assert {f for _, f, _, _ in cases} >= {"temperature", "top_p", "top_k", "min_p", "n", "max_tokens",
                                           "presence_penalty", "repetition_penalty", "top_logprobs", "logprobs"}
    low, high = SEED_RANGE
    cases += [(m, "seed", v, ok) for m in BODIES for v, ok in ((low, True), (high, True), (low - 1, False),
                                                                  (high + 1, False))]
    for model, field, value, allowed in cases:
        request, body = BODIES[model]
        value = int(value) if float(value).is_integer() else value
        req = request(**{**body, **NEEDS.get(field, {}), field: value})
        try:
            sampling_params(req, {})
        except APIError as exc:
            assert not allowed and exc.status == 400, (model, field, value, exc.message)
        else:
            assert allowed, (model, field, value)


def test_served_names_and_roles_are_enums(tiny_server):
    schema = httpx.get(tiny_server.base_url + "/openapi.json", timeout=30).json()
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["model"]["anyOf"][0]["enum"] == ["tiny", "tiny-2", "greedy"]
    assert schema["components"]["schemas"]["ResponseFormat"]["properties"]["type"]["enum"] == [
        "text", "json_object", "json_schema"]
    roles = schema["components"]["schemas"]["ChatMessage"]["properties"]["role"]["enum"]
    body = {**BODIES["ChatCompletionRequest"][1], "messages": [{"role": role, "content": "x"} for role in roles]}
    assert httpx.post(tiny_server.v1 + "/chat/completions", json=body, timeout=60).status_code == 200


@pytest.fixture(scope="module")
def small_server(tiny_models, tiny_drafter):
    """A short max_model_len keeps every generated request cheap (n up to 64, max_tokens up to the limit)."""
    running = start_server(tiny_engine_config(tiny_models["qwen3"], tiny_drafter, max_model_len=64, max_num_seqs=64),
                           served_model_names=["tiny"])
    yield running
    running.stop()


def test_schemathesis_finds_no_server_errors(small_server, tmp_path):
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("schemathesis is not installed (pip install -e '.[test]')")
    command = [exe, "run", small_server.base_url + "/openapi.json", "--phases", "examples,coverage,fuzzing",
               "--checks", "not_a_server_error", "--max-time", "20", "--max-examples", "25", "--seed", "7",
               "--workers", "1", "--request-timeout", "30", "--no-color"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    tail = run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    assert "Fuzzing" in run.stdout and "Coverage" in run.stdout, tail
    # every generated case passed the server-error check: "No issues found", or (when schemathesis adds a
    # warning, e.g. that most generated chat requests were refused with 4xx: a loose schema, not a failure)
    # the summary's "N generated, N passed"
    counts = re.search(r"(\d+) generated, (\d+) passed(.*)", run.stdout)
    assert "No issues found" in run.stdout or (counts is not None and counts[1] == counts[2] and int(counts[1]) > 0
                                               and "fail" not in counts[3] and "error" not in counts[3]), tail
