"""A quantized MoE target end to end on the fused path (the grouped MoE kernels dequantizing the experts in
registers): compressed-tensors NVFP4 and int4 checkpoints of a tiny Qwen3-MoE, written by the
compressed-tensors package (tests/loader/quant_helpers.py). The fused path gives the reference path's logits,
and greedy DFlash equals greedy autoregressive decoding on it. On a GPU, or on CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams
from blockspec.kernels._triton import kernel_device
from blockspec.models.layers import moe
from blockspec.models.layers.quant_linear import QuantExperts
from tests.conftest import save_tiny_drafter
from tests.engine.test_lossless import run_all
from tests.loader.quant_helpers import write_ct_checkpoint
from tests.loader.quant_model import load_quantized
from tests.models.test_quantized_models import _our_logits
from tests.tiny_hybrid import save_tiny_hybrid

pytest.importorskip("compressed_tensors")
DEVICE = kernel_device()
pytestmark = pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU, or Triton with TRITON_INTERPRET=1")
FORMATS = ("nvfp4", "int4_asym_g32")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_moe")
    src = save_tiny_hybrid(root / "src", "qwen3_moe", num_layers=3)  # layers 0 and 2 MoE, 1 dense
    out = {fmt: write_ct_checkpoint(src, root / fmt, fmt)[0] for fmt in FORMATS}
    out["drafter"] = save_tiny_drafter(root / "draft", AutoConfig.from_pretrained(src), target_layer_ids=[0, 2])
    return out


def _count_fused(monkeypatch) -> list[int]:
    calls: list[int] = []
    orig = moe.moe_experts
    monkeypatch.setattr(moe, "moe_experts", lambda *a, **kw: calls.append(a[0].shape[0]) or orig(*a, **kw))
    return calls


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_path_gives_the_reference_logits(checkpoints, fmt, monkeypatch):
    model = load_quantized(checkpoints[fmt])
    experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert len(experts) == 2
    ids = torch.randint(0, 256, (19,), generator=torch.Generator().manual_seed(3)).tolist()
    calls = _count_fused(monkeypatch)
    fused = _our_logits(model, ids)
    assert calls == [16, 16] + [1, 1] * 3  # every MoE layer of the prefill and the decode steps fused
    for m in experts:
        m.backend = "reference"
    calls.clear()
    want = _our_logits(model, ids)
    assert calls == []
    torch.testing.assert_close(fused, want, rtol=1e-4, atol=1e-4)


def test_greedy_dflash_equals_autoregressive_on_the_fused_path(checkpoints, monkeypatch):
    calls = _count_fused(monkeypatch)
    target = str(checkpoints["nvfp4"])
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["hello world", "The quick brown fox"]
    ar = run_all(Engine(EngineConfig(model=target, device="cpu")), prompts, greedy)
    assert len(prompts) in calls  # the batched decode steps took the fused kernels
    calls.clear()
    spec = SpeculativeConfig(model=str(checkpoints["drafter"]), num_speculative_tokens=4)
    engine = Engine(EngineConfig(model=target, device="cpu", speculative=spec, max_num_batched_tokens=24))
    assert run_all(engine, prompts, greedy) == ar
    assert any(t in (5, 10) for t in calls)  # verify blocks of (k + 1) x batch tokens were fused too
