"""Server fixtures: the tiny random Qwen3 (byte tokenizer, ChatML) with its tiny DFlash drafter,
served for real on 127.0.0.1. Loading takes well under a second, so variants are cheap."""

from __future__ import annotations

import pytest

from tests.server.server_helpers import start_server, tiny_engine_config

API_KEY = "test-key-123"


@pytest.fixture(scope="session")
def tiny_server(tiny_models, tiny_drafter):
    """No auth; names tiny + tiny-2 (aliases) and `greedy` (temperature 0 by default); k = 4."""
    running = start_server(tiny_engine_config(tiny_models["qwen3"], tiny_drafter, max_num_seqs=32),
                           served_model_names=["tiny", "tiny-2"], aliases={"greedy": {"temperature": 0.0}})
    yield running
    running.stop()


@pytest.fixture(scope="session")
def auth_server(tiny_models):
    running = start_server(tiny_engine_config(tiny_models["llama"]), api_keys=[API_KEY])
    yield running
    running.stop()
