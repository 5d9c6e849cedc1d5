"""Host-side helpers about the device: moving small lists to it, and what it can run.

A plain `torch.tensor(values, device="cuda")` copies from pageable memory, which blocks the host;
staging through pinned memory and copying asynchronously keeps a step free of host syncs.
"""

from __future__ import annotations

import functools

import torch


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device, looked up once: kernel dispatch asks on every call."""
    props = _properties(device)
    return props.major, props.minor


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, looked up once: launch grids are sized from it."""
    return _properties(device).multi_processor_count


def _properties(device: torch.device):
    return _properties_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _properties_of(index: int):
    return torch.cuda.get_device_properties(index)


def upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
