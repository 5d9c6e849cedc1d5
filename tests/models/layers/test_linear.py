"""layers/linear.py: which norms let the projection after them launch before their own PDL wait."""

import pytest
import torch

from blockspec.kernels import rms_norm as rms_norm_module
from blockspec.models.layers import linear, norm
from blockspec.models.layers.quant_linear import QuantLinear


@pytest.fixture
def early_flags(monkeypatch):
    """The release_early each rms_norm call got (the call itself runs as before)."""
    flags: list[bool] = []

    def spy(*args, release_early: bool = False, **kwargs):
        flags.append(release_early)
        return rms_norm_module.rms_norm(*args, release_early=release_early, **kwargs)

    monkeypatch.setattr(linear, "rms_norm", spy)
    monkeypatch.setattr(norm, "rms_norm", spy)
    return flags


@pytest.mark.parametrize("rows, early", [(1, False), (2, True), (16, True), (17, False)])
def test_norm_before_a_quantized_projection_releases_early_at_2_to_16_rows(early_flags, rows, early):
    proj = QuantLinear("int4", 64, 32, 32, dtype=torch.bfloat16)
    ln = norm.RMSNorm(64).to(torch.bfloat16)
    out = linear.folded_linear(torch.randn(rows, 64, dtype=torch.bfloat16), proj, ln)
    assert out.shape == (rows, 32)
    assert early_flags == [early]


def test_a_norm_module_keeps_the_late_release(early_flags):
    """Before a bf16 projection, an MoE router or a Gated DeltaNet input the early release lost (rms_norm.py)."""
    norm.RMSNorm(64)(torch.randn(16, 64))
    assert early_flags == [False]
