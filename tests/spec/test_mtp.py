"""The target's own MTP head as a proposer: drafts against a hand-written reference, greedy == AR, refusals.

Tiny random hybrids with a random MTP head written into their checkpoints: Qwen3.5 as the VLM wrapper with
the head under `model.language_model.mtp.` (the layout that crashed vLLM on the Jetson thread), dense;
Qwen3-Next with it under `mtp.`, its layer a sparse MoE block.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from blockspec.cli import build_parser
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams
from blockspec.errors import ConfigError
from blockspec.server.args import build_engine_config
from tests.engine.test_lossless import run_all as run_greedy
from tests.spec.proposer_helpers import decode_drafts
from tests.tiny_hybrid import save_tiny_hybrid
from tests.tiny_mtp import add_mtp_head, reference_drafts

PROMPTS = ["hello world", "The quick brown fox jumps over", "def f(n):\n    return"]
LAYOUTS = {"qwen3_5": ("model.language_model.mtp.", {}), "qwen3_next": ("mtp.", {"decoder_sparse_step": 1})}


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("mtp")
    out = {}
    for family, (prefix, overrides) in LAYOUTS.items():
        path = save_tiny_hybrid(root / family, family, num_layers=4, **overrides)
        head = add_mtp_head(path, family, prefix)
        cls = transformers.Qwen3_5ForConditionalGeneration if family == "qwen3_5" else transformers.AutoModelForCausalLM
        out[family] = (path, head, cls.from_pretrained(path, dtype=torch.float32).eval())
    return out


def mtp_engine(path, n: int, **kwargs) -> Engine:
    spec = SpeculativeConfig.from_json(json.dumps({"method": "mtp", "num_speculative_tokens": n}))
    return Engine(EngineConfig(model=str(path), device="cpu", speculative=spec, **kwargs))


def run_all(engine: Engine, prompts: list[str], max_tokens: int = 24) -> dict[str, list[int]]:
    return run_greedy(engine, prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


@pytest.mark.parametrize("family", list(LAYOUTS))
def test_decode_path_drafts_match_reference(mtp_models, family, monkeypatch):
    """Every step's drafts on the in-graph decode path (context pass over the committed rows, then N - 1
    one-token passes) equal the reference head's greedy chain for the same prefix."""
    path, head, hf = mtp_models[family]
    engine = mtp_engine(path, 3)
    assert engine.runner.proposer.method == "mtp" and engine.num_speculative_tokens == 3
    full, seen = decode_drafts(engine, monkeypatch, engine.encode(PROMPTS[1]), 14)
    assert len(seen) >= 4
    for anchor, n, drafts in seen:
        assert drafts == reference_drafts(hf, head, full[:anchor + 1], n), anchor


def test_general_path_drafts_match_reference(mtp_models, monkeypatch):
    """The ragged general path (chunked prefill beside decoding sequences) drafts the same chains."""
    path, head, hf = mtp_models["qwen3_5"]
    engine = mtp_engine(path, 2, max_num_batched_tokens=8)
    engine.runner.decode = None  # every step through the general path
    proposer, seen = engine.runner.proposer, []
    original = proposer.propose

    def recording(items, ctx):
        drafts = original(items, ctx)
        drafting = [item for item in items if item.num_drafts]
        for row, item in enumerate(drafting):
            seen.append((item.seq.request_id, item.seq.num_tokens - 1, item.num_drafts,
                         drafts.tokens[row, :item.num_drafts].tolist()))
        return drafts

    monkeypatch.setattr(proposer, "propose", recording)
    outputs = run_all(engine, PROMPTS[:2], max_tokens=10)
    assert len({rid for rid, *_ in seen}) == 2
    for rid, anchor, n, drafts in seen:
        full = engine.encode(PROMPTS[int(rid[1:])]) + outputs[rid]
        assert drafts == reference_drafts(hf, head, full[:anchor + 1], n), (rid, anchor)


@pytest.mark.parametrize("family", list(LAYOUTS))
def test_greedy_mtp_equals_autoregressive(mtp_models, family):
    path = mtp_models[family][0]
    ar = run_all(Engine(EngineConfig(model=str(path), device="cpu")), PROMPTS)
    for n in (1, 3):
        engine = mtp_engine(path, n, max_num_batched_tokens=16)
        assert run_all(engine, PROMPTS) == ar, n
        assert engine.allocator.num_free == engine.allocator.num_blocks
    engine.set_num_speculative_tokens(2)  # tune sweeps N like DFlash's k
    assert engine.runner.decode.k == 2 and run_all(engine, PROMPTS) == ar


def test_a_prefix_cache_hit_keeps_the_mtp_drafts(mtp_models, monkeypatch):
    """A second turn on the first turn's cached blocks: the head's context K/V ride on them (a finishing
    request writes its last positions into the head's cache), so each step drafts what an uncached engine
    drafts, and the output is the same."""
    path = mtp_models["qwen3_5"][0]
    cached, plain = mtp_engine(path, 3), mtp_engine(path, 3, enable_prefix_caching=False)
    turn1 = cached.encode(" ".join(PROMPTS) * 2)
    first = run_all(cached, [turn1], max_tokens=6)
    turn2 = turn1 + first["r0"] + cached.encode(" and then")
    hits = cached.prefix_cache_stats.hits
    got = decode_drafts(cached, monkeypatch, turn2, 10)
    assert cached.prefix_cache_stats.hits - hits >= 16
    assert got == decode_drafts(plain, monkeypatch, turn2, 10)


def test_method_spellings_and_refusals(mtp_models, tiny_models, tmp_path):
    for method in ("mtp", "qwen3_next_mtp", "qwen3_5_mtp"):
        spec = SpeculativeConfig.from_json(json.dumps({"method": method, "num_speculative_tokens": 2}))
        assert (spec.method, spec.num_speculative_tokens, spec.enabled) == ("mtp", 2, True)
    with pytest.raises(ConfigError, match="eagle3.*not supported.*mtp"):
        SpeculativeConfig.from_json('{"method": "eagle3", "model": "/x"}')
    with pytest.raises(ConfigError, match="max_model_len"):
        SpeculativeConfig.from_json('{"method": "mtp", "max_model_len": 64}')
    with pytest.raises(ConfigError, match="has none"):
        mtp_engine(tiny_models["qwen3"], 2)  # a Qwen3 target has no MTP head
    bare = save_tiny_hybrid(tmp_path / "bare", "qwen3_5", num_layers=2)
    with pytest.raises(ConfigError, match="no MTP weights"):
        mtp_engine(bare, 2)
    path = mtp_models["qwen3_5"][0]
    packed = shutil.copytree(path, tmp_path / "packed")
    tensors = load_file(packed / "model.safetensors")
    tensors["model.language_model.mtp.fc.weight"] = tensors["model.language_model.mtp.fc.weight"].to(
        torch.float8_e4m3fn)
    save_file(tensors, packed / "model.safetensors")
    with pytest.raises(ConfigError, match="MTP head quantized"):
        mtp_engine(packed, 2)
    spec = SpeculativeConfig.from_json(json.dumps({"method": "mtp", "model": str(tmp_path)}))
    with pytest.raises(ConfigError, match="drop \"model\""):
        Engine(EngineConfig(model=str(path), device="cpu", speculative=spec))
    with pytest.raises(ConfigError, match="exceeds the MTP maximum"):
        mtp_engine(path, 16)
    args = build_parser().parse_args(["serve", str(path), "--speculative-config",
                                      '{"method": "qwen3_5_mtp", "num_speculative_tokens": 2}'])
    assert build_engine_config(args).speculative.method == "mtp"


@pytest.mark.parametrize("prefix", ["mtp.", "language_model.mtp.", "model.mtp."])
def test_other_head_layouts_load(mtp_models, prefix, tmp_path, monkeypatch):
    """The VLM wrapper's head under its other published prefixes (Qwen3.5's own checkpoints: top-level `mtp.`;
    re-packaged uploads: `language_model.mtp.`): the same weights load, and the drafts equal the reference's."""
    path, head, hf = mtp_models["qwen3_5"]
    moved = shutil.copytree(path, tmp_path / "moved")
    tensors = load_file(moved / "model.safetensors")
    old = "model.language_model.mtp."
    tensors = {prefix + n[len(old):] if n.startswith(old) else n: t for n, t in tensors.items()}
    assert sum(n.startswith(prefix) for n in tensors) > 5 and not any(n.startswith(old) for n in tensors)
    save_file(tensors, moved / "model.safetensors")
    engine = mtp_engine(moved, 3)
    full, seen = decode_drafts(engine, monkeypatch, engine.encode(PROMPTS[2]), 8)
    assert seen
    for anchor, n, drafts in seen:
        assert drafts == reference_drafts(hf, head, full[:anchor + 1], n), anchor


def test_mtp_unavailable_answers_as_the_engine_would(mtp_models, tiny_models, tmp_path):
    """`tune` asks mtp_unavailable before building an engine for the head: it must give the engine's answer."""
    from blockspec.spec.mtp import mtp_unavailable

    bare = save_tiny_hybrid(tmp_path / "bare", "qwen3_5", num_layers=2)
    for path in (tiny_models["qwen3"], bare):
        with pytest.raises(ConfigError) as refused:
            mtp_engine(path, 2)
        assert mtp_unavailable(path) == str(refused.value)
    for path, _, _ in mtp_models.values():
        assert mtp_unavailable(path) is None
    assert mtp_unavailable(bare, load=False) is None  # random weights: a head in the checkpoint's shapes
    assert mtp_engine(bare, 2, load_format="dummy").proposer.method == "mtp"


@pytest.mark.parametrize("indexed", [False, True], ids=["no-index", "index-without-it"])
def test_head_in_a_sidecar_file_loads(mtp_models, indexed, tmp_path, monkeypatch):
    """NVFP4 re-packs ship the head as model_mtp.safetensors beside model.safetensors, with no index or with an
    index that does not list it: the head loads from it (and the target ignores it), drafting as the reference."""
    import json

    path, head, hf = mtp_models["qwen3_5"]
    moved = shutil.copytree(path, tmp_path / "moved")
    tensors = load_file(moved / "model.safetensors")
    mtp = {n: t for n, t in tensors.items() if ".mtp." in f".{n}"}
    assert len(mtp) > 5
    save_file({n: t for n, t in tensors.items() if n not in mtp}, moved / "model.safetensors")
    save_file(mtp, moved / "model_mtp.safetensors")
    if indexed:
        (moved / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {n: "model.safetensors" for n in tensors if n not in mtp}}))
    engine = mtp_engine(moved, 3)
    full, seen = decode_drafts(engine, monkeypatch, engine.encode(PROMPTS[2]), 8)
    assert seen
    for anchor, n, drafts in seen:
        assert drafts == reference_drafts(hf, head, full[:anchor + 1], n), anchor
