"""`blockspec serve` with no MODEL (the embedded SmolLM2-135M-Instruct) against real clients: the
openai package and llama-benchy, fully offline."""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest

from tests.server.server_helpers import free_port, start_subprocess, stop_subprocess, wait_healthy

KEY = "real-model-key"
TEXT = ("the quick brown fox jumps over a lazy dog while seven old sailors sing about distant harbours and "
        "bright lanterns swinging in the evening wind")


@pytest.fixture(scope="module")
def default_model_dir() -> Path:
    from blockspec.loader.default_model import default_model_dir
    from blockspec.loader.errors import ModelLoadError

    try:
        return default_model_dir()  # converted once into the user's cache (~20 s the first time)
    except ModelLoadError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def real_server(default_model_dir):
    port = free_port()
    proc = start_subprocess(["--host", "127.0.0.1", "--port", str(port), "--api-key", KEY,
                             "--served-model-name", "smol", "--alias", "smol-greedy:temperature=0",
                             "--disable-uvicorn-access-log"])
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout=180, proc=proc)
    except Exception:
        code, out = stop_subprocess(proc)
        pytest.fail(f"blockspec serve did not start (exit {code}):\n{out}")
    yield f"http://127.0.0.1:{port}"
    code, out = stop_subprocess(proc)
    assert code == 0, out


def test_openai_client_chat_with_the_default_model(real_server):
    client = openai.OpenAI(base_url=real_server + "/v1", api_key=KEY, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["smol", "smol-greedy"]
    question = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    resp = client.chat.completions.create(model="smol", messages=question, max_tokens=12, temperature=0)
    answer = resp.choices[0].message.content
    assert "Paris" in answer
    stream = client.chat.completions.create(model="smol-greedy", messages=question, max_tokens=12, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answer


@pytest.fixture(scope="module")
def book_url(tmp_path_factory):
    """A plain-text 'book' served from 127.0.0.1, as llama-benchy's --book-url wants."""
    root = tmp_path_factory.mktemp("book")
    words = TEXT.split()
    lines = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)).capitalize() + "." for i in range(400)]
    (root / "book.txt").write_text("\n".join(lines))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a, **k: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/book.txt"
    httpd.shutdown()


def test_llama_benchy_runs_offline_against_the_server(real_server, default_model_dir, book_url, tmp_path):
    exe = shutil.which("llama-benchy", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("llama-benchy is not installed")
    env = {**os.environ, "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [exe, "--base-url", real_server + "/v1", "--api-key", KEY, "--model", "smol-greedy",
           "--tokenizer", str(default_model_dir / "tokenizer.json"), "--book-url", book_url,
           "--pp", "48", "--tg", "8", "--runs", "1", "--concurrency", "1", "2", "--latency-mode", "api",
           "--exit-on-first-fail", "--save-result", str(tmp_path / "result.json"), "--format", "json"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "Coherence test PASSED" in out and "Error" not in out, out
    assert (tmp_path / "result.json").is_file()
