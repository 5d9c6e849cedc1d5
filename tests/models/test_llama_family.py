"""Our Llama/Qwen2/Qwen3 code against transformers' on the same random weights (fp32, CPU).

Logits must match for one-shot prefill, chunked prefill, and step-by-step decode through the paged
cache, which is exactly how the engine drives the model.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from blockspec.engine.sampling_params import SamplingParams
from blockspec.engine.scheduler import ScheduledSeq
from blockspec.engine.sequence import Sequence
from blockspec.loader.weights import load_weights
from blockspec.models.model_config import ModelConfig
from blockspec.models.registry import model_class
from blockspec.runner.model_runner import ModelRunner


def _ours(model_dir):
    cfg = ModelConfig.from_dir(model_dir)
    model = model_class(cfg)(cfg).eval()
    load_weights(model, model_dir, "cpu", torch.float32)
    runner = ModelRunner(model, None, torch.device("cpu"), torch.float32, block_size=16)
    runner.allocate_kv_cache(16)
    return model, runner


def _logits(runner, model, seq, n):
    hidden, _, _ = runner._target([ScheduledSeq(seq, n, 0)], None)
    seq.num_computed += n
    return model.compute_logits(hidden)


def _seq(ids, blocks):
    seq = Sequence("t", ids, SamplingParams(temperature=0), None, [], None)
    seq.block_table = list(blocks)
    return seq


@pytest.mark.parametrize("family", ["llama", "llama_tied", "qwen2", "qwen3"])
def test_logits_match_transformers(tiny_models, family):
    path = tiny_models[family]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model, runner = _ours(path)
    ids = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    with torch.inference_mode():
        # one-shot prefill, on scattered blocks
        full = _logits(runner, model, _seq(ids, [9, 2, 14]), len(ids))
        torch.testing.assert_close(full, ref, rtol=1e-4, atol=1e-4)
        # chunked prefill 16 + 13, then decode the rest one token at a time
        seq = _seq(ids, [3, 5, 0])
        parts = [_logits(runner, model, seq, 16), _logits(runner, model, seq, 13)]
        parts += [_logits(runner, model, seq, 1) for _ in range(len(ids) - 29)]
        torch.testing.assert_close(torch.cat(parts), ref, rtol=1e-4, atol=1e-4)


def test_smollm2_real_weights_match_transformers(default_model):
    """The embedded model (real SmolLM2-135M weights) on a short prompt."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(default_model)
    ids = tok.encode("The capital of France is", add_special_tokens=False)
    model, runner = _ours(default_model)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    with torch.inference_mode():
        ours = _logits(runner, model, _seq(ids, [1]), len(ids))
    torch.testing.assert_close(ours, ref, rtol=1e-3, atol=1e-3)
    assert ours[-1].argmax() == ref[-1].argmax()
