"""Loader fixtures: the real SmolLM2 GGUF, converted once per session, and transformers' reading of it.

Helpers that write GGUFs and build loadable models live in loader_helpers.py.
"""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from blockspec.loader.default_model import default_gguf_path
    from blockspec.loader.errors import ModelLoadError

    try:
        return default_gguf_path()
    except ModelLoadError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf, tmp_path_factory) -> Path:
    """The default model converted once per session into a private cache."""
    from blockspec.loader.default_model import default_model_dir

    return default_model_dir(cache_dir=tmp_path_factory.mktemp("blockspec-cache"))


@pytest.fixture(scope="session")
def smollm2_oracle(smollm2_gguf):
    """transformers' own dequantization of the same GGUF: the reference for ours."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    return model.eval()
