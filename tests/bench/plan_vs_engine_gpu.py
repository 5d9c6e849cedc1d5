"""GPU check (not collected by pytest): `blockspec plan`'s memory figures against the engine's own
start-up measurement on the same flags. Random weights (load_format dummy) in real shapes.

Run on a CUDA machine: python tests/bench/plan_vs_engine_gpu.py [--out DIR]. Prints one JSON line per
case: the engine's measured step peak (weights + activations) and KV budget next to plan's estimate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from blockspec.bench.plan import PlanInputs, make_plan  # noqa: E402
from blockspec.config import EngineConfig, SpeculativeConfig  # noqa: E402
from blockspec.engine import memory  # noqa: E402
from tests.bench.configs import QWEN3_8B, QWEN3_8B_DRAFT  # noqa: E402

SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
           "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
           "vocab_size": 49152, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}


def write_model(path: Path, config: dict, tokenizer: bool) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if tokenizer:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(["<|im_end|>"])
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>").save_pretrained(path)
    return str(path)


def case(name: str, model: str, draft: str | None, k: int, max_len: int, batched: int) -> dict:
    from blockspec.engine.engine import Engine

    seen: dict = {}
    peak_fn, budget_fn = memory.profile_step_peak, memory.cuda_kv_budget

    def peak(engine):
        seen["peak"] = peak_fn(engine)
        return seen["peak"]

    def budget(total, util, others, step_peak):
        seen.update(total=total, others=others)
        return budget_fn(total, util, others, step_peak)

    memory.profile_step_peak, memory.cuda_kv_budget = peak, budget
    try:
        spec = SpeculativeConfig(model=draft, num_speculative_tokens=k if draft else None)
        engine = Engine(EngineConfig(model=model, speculative=spec, max_model_len=max_len, max_num_seqs=16,
                                     max_num_batched_tokens=batched, load_format="dummy",
                                     gpu_memory_utilization=0.9))
        per_block = engine.runner.kv_bytes_per_block()
        kv_engine = engine.allocator.num_blocks * per_block if hasattr(engine.allocator, "num_blocks") else None
        weights = sum(p.numel() * p.element_size() for p in engine.runner.target.parameters())
        if engine.runner.proposer is not None:
            weights += sum(p.numel() * p.element_size() for p in engine.runner.proposer.parameters())
    finally:
        memory.profile_step_peak, memory.cuda_kv_budget = peak_fn, budget_fn
    plan = make_plan(PlanInputs(model=model, draft=draft, num_speculative_tokens=k, max_model_len=max_len,
                                max_num_seqs=16, max_num_batched_tokens=batched, memory_bytes=seen["total"],
                                gpu_memory_utilization=0.9))
    mem = plan["memory"]
    gib = 1 << 30
    row = {"case": name, "batched_tokens": batched, "k": k,
           "engine_weights_gib": weights / gib, "plan_weights_gib": mem["weight_bytes"] / gib,
           "engine_activation_gib": (seen["peak"] - weights) / gib,
           "plan_activation_gib": mem["activation_estimate_bytes"] / gib,
           "engine_others_gib": seen["others"] / gib, "plan_reserve_gib": mem["cuda_reserve_bytes"] / gib,
           "engine_kv_budget_gib": (kv_engine or 0) / gib, "plan_kv_budget_gib": mem["kv_budget_bytes"] / gib,
           "plan_kv_per_block": plan["kv"]["bytes_per_token"] * 16, "engine_kv_per_block": per_block}
    del engine
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        q8 = write_model(root / "q8", QWEN3_8B, True)
        q8d = write_model(root / "q8d", QWEN3_8B_DRAFT, False)
        smol = write_model(root / "smol", SMOLLM2, True)
        for batched in (2048, 8192):
            rows.append(case("qwen3-8b+dflash", q8, q8d, 15, 32768, batched))
            print(json.dumps(rows[-1]), flush=True)
        rows.append(case("qwen3-8b", q8, None, 0, 32768, 2048))
        print(json.dumps(rows[-1]), flush=True)
        rows.append(case("smollm2", smol, None, 0, 8192, 2048))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "plan_vs_engine.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
