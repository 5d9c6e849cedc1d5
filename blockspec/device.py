"""Moving small host-side lists (step metadata, per-request parameters) to the device.

A plain `torch.tensor(values, device="cuda")` copies from pageable memory, which blocks the host;
staging through pinned memory and copying asynchronously keeps a step free of host syncs.
"""

from __future__ import annotations

import torch


def upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
