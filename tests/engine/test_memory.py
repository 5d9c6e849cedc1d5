"""KV cache sizing rules (the CUDA measurements themselves run in tests/bench on a GPU)."""

from __future__ import annotations

import pytest

from blockspec.engine.memory import GIB, cuda_kv_budget, fixed_kv_budget, kv_shortfall
from blockspec.errors import OutOfMemoryError


def test_utilization_share_less_others_and_peak():
    assert cuda_kv_budget(80 * GIB, 0.5, 4 * GIB, 6 * GIB) == 30 * GIB


def test_fixed_kv_cache_memory_is_taken_as_given_when_it_fits():
    assert fixed_kv_budget(3 * GIB, 10 * GIB) == 3 * GIB


def test_fixed_kv_cache_memory_that_does_not_fit_names_the_flag():
    with pytest.raises(OutOfMemoryError, match="lower --kv-cache-memory"):
        fixed_kv_budget(12 * GIB, 10 * GIB)


def test_shortfall_message_names_the_fix():
    assert kv_shortfall("cuda", 4096, GIB, 2 * GIB) is None
    assert "--gpu-memory-utilization" in kv_shortfall("cuda", 4096, 2 * GIB, GIB)
    assert "--kv-cache-memory" in kv_shortfall("cpu", 4096, 2 * GIB, GIB)
