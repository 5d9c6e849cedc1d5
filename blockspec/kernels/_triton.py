"""Whether Triton kernels can run for a given tensor (CUDA tensor and Triton importable).

With TRITON_INTERPRET=1 (and triton installed) CPU tensors take the Triton path too, through
Triton's interpreter: the kernels' logic can be tested on a machine without a GPU.
"""

from __future__ import annotations

import functools
import os

import torch

from blockspec.device import cuda_capability

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


def pdl(x: torch.Tensor) -> bool:
    """Whether kernels on x's device launch with programmatic dependent launch (PDL, Hopper and later): a
    kernel's programs are launched while the previous kernel finishes and wait in `wait_for_inputs`, hiding the
    launch gap between the hundreds of few-microsecond kernels of a decode step (Qwen3-8B int4 on an H100:
    AR step 3.20 -> 3.09 ms). Prefetching the weights into L2 before the wait made it slower (3.33 ms) and was
    dropped. BLOCKSPEC_PDL=0 turns it off. The kernel's PDL constexpr and its launch_pdl keyword must come from
    this one answer: a kernel launched early that does not wait would read stale inputs."""
    return x.is_cuda and _pdl_available(x.device.index if x.device.index is not None else torch.cuda.current_device())


@functools.cache
def _pdl_available(index: int) -> bool:
    if not HAVE_TRITON or INTERPRET or os.environ.get("BLOCKSPEC_PDL", "1") == "0":
        return False
    try:
        from triton.language.extra.cuda import gdc_wait  # noqa: F401  (Triton >= 3.4)
    except ImportError:
        return False
    return cuda_capability(torch.device("cuda", index)) >= (9, 0)


if HAVE_TRITON:
    import triton.language as tl

    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # older Triton: PDL stays off (pdl() is False), the branches below never compile
        gdc_launch_dependents = gdc_wait = None

    @triton.jit
    def wait_for_inputs(PDL: tl.constexpr):
        """Under PDL: wait until the previous kernel has finished and its writes are visible (nothing of it may
        be read or overwritten before this)."""
        if PDL:
            gdc_wait()

    @triton.jit
    def release_dependents(PDL: tl.constexpr):
        """Under PDL: the next kernel's programs may start arriving once every program of this one got here.
        Called late (before the final stores), so that they are placed on the SMs this kernel is leaving: early
        arrivals sit where there happened to be room and stay there, unbalancing the next kernel's wave. Three
        small launches call it before their wait where that measured faster (rms_norm.releases_early,
        paged_attention.decode_releases_early): the GEMM after them loads its first weights meanwhile
        (tests/kernels/test_pdl.py says why the step's inputs stay safe to read before a wait)."""
        if PDL:
            gdc_launch_dependents()
