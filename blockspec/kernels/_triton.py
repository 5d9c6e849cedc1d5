"""Whether Triton kernels can run for a given tensor (CUDA tensor and Triton importable).

With TRITON_INTERPRET=1 (and triton installed) CPU tensors take the Triton path too, through
Triton's interpreter: the kernels' logic can be tested on a machine without a GPU.
"""

from __future__ import annotations

import os

import torch

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # CPU-only installs use the PyTorch references
    HAVE_TRITON = False

INTERPRET = HAVE_TRITON and os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(x: torch.Tensor) -> bool:
    """Inference only: the kernels have no backward, so training (grad enabled) takes the references."""
    return HAVE_TRITON and (x.is_cuda or INTERPRET) and not torch.is_grad_enabled()


def kernel_device() -> str | None:
    """Where kernel tests run: 'cuda', 'cpu' under the interpreter, or None (skip)."""
    if HAVE_TRITON and torch.cuda.is_available():
        return "cuda"
    return "cpu" if INTERPRET else None
