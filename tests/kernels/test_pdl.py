"""Programmatic dependent launch (kernels/_triton.py): off where it cannot apply, and wired the same way in every
kernel that takes it (a kernel launched early that does not wait for its inputs would read stale data)."""

import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

from blockspec.kernels import _triton

pytest.importorskip("triton")

MODULES = ["activation", "gated_deltanet", "moe_grouped", "paged_attention", "quant_gemv", "quant_linear", "rms_norm",
           "rotary", "skinny_linear"]
# The step's own inputs, written before its first layer and never by the kernel just before another: a kernel may
# read these before its wait. Anything else read or written before the wait could be stale. Safe because a kernel
# starts only once the one before it released its dependents, and a kernel that finished has waited: so where every
# kernel releases after its own wait, all but the one before a starting kernel have finished. EARLY_RELEASERS release
# before their wait (a measured speed rule): what follows them may start while up to three kernels before it run
# (rope, batch-1 decode attention, its merge, before o_proj), never the step's first, whose inputs stay safe; the
# kernels after them read only the step's inputs and weights before their own wait, as this test checks of all.
STEP_INPUTS = ("SEQ_LENS", "KV_START", "Q_START")
EARLY_RELEASERS = ("_rms_norm_kernel", "_paged_attention_kernel", "_merge_splits_kernel")
# Helpers that load a layer's weights and scales only (no kernel of a step writes them): a kernel may call them, or
# helpers that call only them, before its wait, so that its weights are in flight while the kernel before it runs
# (quant_gemv's streamed launches).
WEIGHT_LOADERS = ("_span_bytes", "_span_scales", "_fp4_scales", "_rows_bytes", "_rows_scales", "_int4_words")


def loaders_called(names: dict, source: str, seen: set[str]) -> list[str]:
    """The jit helpers that `source` calls (looked up in `names`, the globals of the function it is from), directly
    or through other helpers (in their own modules' globals), and that load memory."""
    found = []
    for name in re.findall(r"\b(_\w+)\(", source):
        helper = names.get(name)
        if name in seen or not hasattr(helper, "fn"):
            continue
        seen.add(name)
        body = inspect.getsource(helper.fn)
        if "tl.load" in body:
            found.append(name)
        found += loaders_called(helper.fn.__globals__, body.split(":", 1)[1], seen)  # past its own signature
    return found


def test_pdl_is_off_for_cpu_tensors_and_when_disabled(monkeypatch):
    assert not _triton.pdl(torch.zeros(1))
    monkeypatch.setenv("BLOCKSPEC_PDL", "0")
    _triton._pdl_available.cache_clear()
    try:
        assert not _triton._pdl_available(0)
    finally:
        _triton._pdl_available.cache_clear()


@pytest.mark.parametrize("name", MODULES)
def test_every_pdl_kernel_waits_and_every_launch_passes_both_switches(name):
    module = importlib.import_module(f"blockspec.kernels.{name}")
    kernels = [v for v in vars(module).values() if hasattr(v, "arg_names") and hasattr(v, "fn")
               and "PDL" in v.arg_names and v.fn.__module__ == module.__name__]  # jit or interpreted functions
    assert kernels, f"{name} has no PDL kernel"
    for kernel in kernels:
        body = inspect.getsource(kernel.fn)
        assert "wait_for_inputs(PDL)" in body, f"{kernel.fn.__name__} takes PDL but never waits"
        wait = body.index("wait_for_inputs(PDL)")
        if "release_dependents(PDL)" in body[:wait]:
            assert kernel.fn.__name__ in EARLY_RELEASERS, \
                f"{kernel.fn.__name__} releases its dependents before its wait: see STEP_INPUTS' note first"
        early = re.findall(r"tl\.load\(\s*(\w+)", body[:wait])
        assert all(ptr in STEP_INPUTS for ptr in early) and "tl.store" not in body[:wait], \
            f"{kernel.fn.__name__} touches memory other than the step's inputs before its PDL wait: {early}"
        loading = loaders_called(kernel.fn.__globals__, body[:wait], {kernel.fn.__name__})
        assert all(name in WEIGHT_LOADERS for name in loading), \
            f"{kernel.fn.__name__} calls helpers that load before its PDL wait: {loading}"
    source = Path(module.__file__).read_text()
    launches = re.findall(r"launch_pdl=(\w+(?:\(\w+\))?)", source)
    switches = re.findall(r"\bPDL=(\w+(?:\(\w+\))?)", source)
    assert launches and sorted(launches) == sorted(switches), (name, launches, switches)
