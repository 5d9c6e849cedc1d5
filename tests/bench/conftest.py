"""bench tests run torch on one intra-op thread: on a shared 2-core machine, two spinning OpenMP
threads next to the server's event loop made every engine step about 10x slower."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
