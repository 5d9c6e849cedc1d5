"""Arrival counters of the split-K kernels (skinny_linear, quant_gemv's rows kernel).

A tile's K split over programs: each stores its float32 sums, then counts its arrival; the last to arrive adds
the sums in split order (the same result whoever it is) and resets its tile's counter to zero for the next
launch. The counters are one zeroed buffer a device that must outlive every CUDA graph that replays such a
launch, so an eager launch (the warm-up's) allocates them, never a capture (whose pool the graph owns).
"""

from __future__ import annotations

import torch

ARRIVALS = 4096  # tiles a split-K launch may have: one counter each
_counters: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device) -> torch.Tensor:
    """The device's counters, zero between launches. One stream at a time: two split-K launches running
    concurrently on two streams would share them."""
    cnt = _counters.get(device)
    if cnt is None:
        cnt = _counters[device] = torch.zeros(ARRIVALS, dtype=torch.int32, device=device)
    return cnt


def can_split(x: torch.Tensor) -> bool:
    """Whether a split-K launch on x's device may run now: not while a graph is captured before the counters exist
    (they would be allocated from the graph's pool)."""
    return x.device in _counters or not (x.is_cuda and torch.cuda.is_current_stream_capturing())
