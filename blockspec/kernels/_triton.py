"""Whether Triton kernels can run for a given tensor (CUDA tensor and Triton importable)."""

from __future__ import annotations

import torch

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # CPU-only installs use the PyTorch references
    HAVE_TRITON = False


def use_triton(x: torch.Tensor) -> bool:
    """Inference only: the kernels have no backward, so training (grad enabled) takes the references."""
    return HAVE_TRITON and x.is_cuda and not torch.is_grad_enabled()
