"""GPT-OSS against transformers' gpt_oss on tiny random configs (fp32, CPU).

Both checkpoint layouts: bf16 stacks as transformers saves them, and MXFP4 experts (`*_blocks` /
`*_scales`, which transformers dequantizes with its own code). Logits must match for one-shot prefill,
chunked prefill and token-by-token decode through the paged runner, with a sliding window (8) short
enough that the windowed layers matter; greedy generation through the engine's decode path must equal
transformers' generate; the cache-free dense pass (drafter training) must give transformers' hidden states.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

from blockspec.config import EngineConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams
from blockspec.engine.scheduler import ScheduledSeq
from blockspec.engine.sequence import Sequence
from blockspec.models.gpt_oss import GptOssForCausalLM
from blockspec.models.layers.quant_linear import QuantExperts
from blockspec.models.layers.rotary import RotaryEmbedding
from blockspec.models.model_config import ModelConfig
from blockspec.train.features import target_features
from tests.tiny_gpt_oss import save_tiny_gpt_oss, save_tiny_gpt_oss_mxfp4, tiny_config

TOL = dict(rtol=1e-4, atol=1e-4)
LAYOUTS = ("bf16", "mxfp4")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    return {"bf16": save_tiny_gpt_oss(root / "bf16"), "mxfp4": save_tiny_gpt_oss_mxfp4(root / "mxfp4")}


@pytest.fixture(scope="module")
def models(checkpoints):
    """(transformers' model, our engine) per layout; transformers dequantizes the MXFP4 experts itself."""
    out = {}
    for layout, path in checkpoints.items():
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                               attn_implementation="eager").float().eval()
        out[layout] = hf, Engine(EngineConfig(model=str(path), device="cpu", dtype="float32"))
    return out


def _seq(ids, blocks):
    seq = Sequence("t", ids, SamplingParams(temperature=0), None, [], None)
    seq.block_table = list(blocks)
    return seq


def _step(engine, seq, n):
    hidden, _, _ = engine.runner._target([ScheduledSeq(seq, n, 0)], None)
    seq.num_computed += n
    return engine.runner.target.compute_logits(hidden)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_match_transformers(models, layout):
    hf, engine = models[layout]
    if layout == "mxfp4":
        assert isinstance(engine.runner.target.model.layers[0].mlp.experts, QuantExperts)
    ids = torch.randint(0, 256, (83,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    assert ref.std() > 0.1  # the random model is not degenerate
    with torch.inference_mode():
        full = _step(engine, _seq(ids, [9, 2, 14, 20, 7, 11]), len(ids))  # one-shot prefill, scattered blocks
        torch.testing.assert_close(full, ref, **TOL)
        seq = _seq(ids, [3, 5, 0, 1, 4, 6])  # chunked prefill 16 + 45 + 13, then decode one by one
        parts = [_step(engine, seq, n) for n in (16, 45, 13)] + [_step(engine, seq, 1) for _ in range(len(ids) - 74)]
        torch.testing.assert_close(torch.cat(parts), ref, **TOL)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_decode_path_equals_transformers_generate(models, layout):
    """The engine's uniform decode path (paged kernel with sinks and window) over a ragged batch."""
    hf, engine = models[layout]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 19)]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == want


def test_dense_pass_for_drafter_training(models):
    """Whole sequences without a cache (train/features.py): sinks and the window in the dense path."""
    hf, engine = models["bf16"]
    ids = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = hf(input_ids=ids, output_hidden_states=True)
        feats, _ = target_features(engine.runner.target, ids, [0, 1])
    torch.testing.assert_close(feats, torch.cat([out.hidden_states[1], out.hidden_states[2]], dim=-1), **TOL)


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_rotary_matches_transformers(truncate):
    cfg = tiny_config(rope_parameters={**tiny_config().rope_parameters, "truncate": truncate})
    ours = ModelConfig.from_dict(cfg.to_dict() | {"architectures": ["GptOssForCausalLM"]})
    rotary = RotaryEmbedding(ours.head_dim, 512, ours.rope_theta, ours.rope_scaling)
    positions = torch.tensor([0, 1, 7, 100, 300, 511])
    cos, sin = GptOssRotaryEmbedding(cfg)(torch.zeros(1), positions[None])
    half = ours.head_dim // 2
    torch.testing.assert_close(rotary.cos[positions, :half], cos[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rotary.sin[positions, :half], sin[0], rtol=1e-5, atol=1e-6)


def test_config_fields(checkpoints):
    cfg = ModelConfig.from_dir(checkpoints["mxfp4"])
    assert cfg.architecture == "GptOssForCausalLM" and cfg.sliding_window == 8
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2
    assert cfg.moe.num_experts == 8 and cfg.moe.intermediate_size == 32 and cfg.moe.top_k == 2
    assert cfg.moe.bias and cfg.moe.swiglu_limit == 7.0 and cfg.moe.norm_topk_prob
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
    # transformers' defaults where config.json leaves the pattern out
    raw = {**cfg.raw, "layer_types": None}
    assert ModelConfig.from_dict(raw).layer_types == ["sliding_attention", "full_attention"] * 2
    layers = [layer.self_attn.attn for layer in GptOssForCausalLM(cfg, 64).model.layers]
    assert [a.sliding_window for a in layers] == [8, None, 8, None] and all(a.sinks is not None for a in layers)
