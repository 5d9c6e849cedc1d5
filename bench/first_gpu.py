"""First GPU measurement of the engine core (issue 2, point 8).

On a CUDA machine, in one run: copy bandwidth, then for the embedded SmolLM2-135M (real weights, bf16)
and a Qwen3-8B-shaped model with random bf16 weights (plus a 5-layer drafter of the
Qwen3-8B-DFlash-b16 shape, random weights):
  - autoregressive decode tok/s through the engine (batch 1, 512-token prompt, median of 3 runs after a warm-up);
  - the k = 15 step (draft + verify) and the drafter pass alone, as multiples of one AR step;
  - how many host synchronisations a step makes (torch's sync debug mode).
Random drafters accept almost nothing, so the k = 15 steps all carry 15 drafts: this times the
step, not speculation's benefit. Prints a table last and writes JSON to $OUT (or --out).

Usage: python bench/first_gpu.py --gguf /path/SmolLM2-135M-Instruct.Q4_1.gguf [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import torch

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def drafter_config(target: dict, layers: int, layer_ids: list[int], mask: int) -> dict:
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": target["vocab_size"],
        "hidden_size": target["hidden_size"], "intermediate_size": target["intermediate_size"],
        "num_hidden_layers": layers, "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target["num_key_value_heads"],
        "head_dim": target.get("head_dim") or target["hidden_size"] // target["num_attention_heads"],
        "rms_norm_eps": 1e-6, "rope_theta": target.get("rope_theta", 10000), "max_position_embeddings": 40960,
        "block_size": 16, "num_target_layers": target["num_hidden_layers"],
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": layer_ids},
    }


def write_dir(path: Path, config: dict, tokenizer_from: Path | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if tokenizer_from is not None:
        for f in tokenizer_from.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                (path / f.name).write_bytes(f.read_bytes())
    return path


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 10)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1000)
    return 2 * n / statistics.median(times)


def decode_run(engine: Engine, prompt: list[int], tokens: int) -> tuple[float, float, int]:
    """(decode tok/s, seconds per step, steps) of one greedy request."""
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))[0]
    st = out.stats
    return st.decode_tok_s, st.decode_time / max(st.steps, 1), st.steps


def median_runs(engine: Engine, prompt: list[int], tokens: int, runs: int = 3) -> dict:
    decode_run(engine, prompt, tokens)  # warm-up
    results = [decode_run(engine, prompt, tokens) for _ in range(runs)]
    return {"tok_s": statistics.median(r[0] for r in results),
            "step_ms": 1000 * statistics.median(r[1] for r in results),
            "steps": results[0][2], "runs": [round(r[0], 2) for r in results]}


def drafter_pass_ms(engine: Engine, prompt: list[int], tokens: int) -> float:
    """Median wall time of the drafter's block pass inside real steps (synchronised around it)."""
    dec = engine.runner.decode.graphs if engine.runner.decode is not None else None
    original = dec.run
    times: list[float] = []

    def timed(name, bp, fn):
        if name != "draft":
            return original(name, bp, fn)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = original(name, bp, fn)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        return out

    dec.run = timed
    try:
        decode_run(engine, prompt, tokens)
    finally:
        dec.run = original
    return 1000 * statistics.median(times)


def replay_ms(engine: Engine, name: str, reps: int = 50) -> float:
    """GPU time of one graph replay at batch 1 (no host work): the floor under a step."""
    dec = engine.runner.decode.graphs if engine.runner.decode is not None else None
    if dec is None or not dec.use_graphs:
        return float("nan")
    dec.run(name, 1, None)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        dec.run(name, 1, None)
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t0) / reps


def syncs_per_step(engine: Engine, prompt: list[int]) -> float:
    """Synchronising CUDA calls per decode step, counted by torch's sync debug mode."""
    engine.add_request("sync-check", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.step()  # prefill
    steps = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    return len(syncs) / max(steps, 1)


def measure(name: str, target_dir: Path, draft_dir: Path, load_format: str, ctx: int, tokens: int) -> dict:
    common = dict(model=str(target_dir), device="cuda", dtype="bfloat16", max_model_len=4096,
                  max_num_seqs=4, load_format=load_format)
    draft = SpeculativeConfig(model=str(draft_dir), num_speculative_tokens=15, load_format="dummy")
    gen = torch.Generator().manual_seed(0)
    ar = Engine(EngineConfig(**common))
    prompt = torch.randint(100, min(ar.model_config.vocab_size, 30000), (ctx,), generator=gen).tolist()
    t0 = time.perf_counter()
    ar_stats = median_runs(ar, prompt, tokens)
    ar_syncs = syncs_per_step(ar, prompt)
    gpu_ar = replay_ms(ar, "target")
    del ar
    gc.collect()
    torch.cuda.empty_cache()
    spec = Engine(EngineConfig(**common, speculative=draft))
    sp_stats = median_runs(spec, prompt, tokens)
    draft_ms = drafter_pass_ms(spec, prompt, tokens)
    sp_syncs = syncs_per_step(spec, prompt)
    gpu_verify, gpu_draft = replay_ms(spec, "target"), replay_ms(spec, "draft")
    weights = sum(p.numel() * p.element_size() for p in spec.runner.target.parameters())
    del spec
    gc.collect()
    torch.cuda.empty_cache()
    step = sp_stats["step_ms"]
    return {
        "model": name, "context": ctx, "tokens": tokens, "weight_bytes": weights,
        "ar_tok_s": round(ar_stats["tok_s"], 2), "ar_step_ms": round(ar_stats["step_ms"], 3),
        "ar_runs": ar_stats["runs"],
        "k15_step_ms": round(step, 3), "k15_draft_ms": round(draft_ms, 3), "k15_verify_ms": round(step - draft_ms, 3),
        "k15_step_over_ar": round(step / ar_stats["step_ms"], 3),
        "verify_over_ar": round((step - draft_ms) / ar_stats["step_ms"], 3),
        "draft_over_ar": round(draft_ms / ar_stats["step_ms"], 3),
        "gpu_ar_graph_ms": round(gpu_ar, 3), "gpu_verify_graph_ms": round(gpu_verify, 3),
        "gpu_draft_graph_ms": round(gpu_draft, 3),
        "syncs_per_step_ar": ar_syncs, "syncs_per_step_k15": sp_syncs,
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    from blockspec.loader.weights import resolve_model_path

    smol = resolve_model_path(args.gguf)
    smol_cfg = json.loads((smol / "config.json").read_text())
    smol_draft = write_dir(work / "smol-draft", drafter_config(smol_cfg, 2, [1, 27], 0))
    q8 = write_dir(work / "qwen3-8b", QWEN3_8B, tokenizer_from=smol)
    q8_draft = write_dir(work / "qwen3-8b-draft", drafter_config(QWEN3_8B, 5, [1, 9, 17, 25, 33], 151669))
    # Random drafter weights for SmolLM2 too: no trained drafter ships yet.
    bw = copy_bandwidth()
    rows = [measure("SmolLM2-135M (real weights, random drafter)", smol, smol_draft, "auto", 512, args.tokens)]
    rows.append(measure("Qwen3-8B shape (random weights)", q8, q8_draft, "dummy", 512, args.tokens))
    for r in rows:
        r["roofline_tok_s"] = round(bw / r["weight_bytes"], 1)
        r["ar_over_roofline"] = round(r["ar_tok_s"] / r["roofline_tok_s"], 3)
    commit = os.environ.get("COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                       capture_output=True, text=True).stdout.strip()
    result = {"commit": commit, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "dtype": "bfloat16", "batch": 1, "copy_bandwidth_GBs": round(bw / 1e9, 1),
              "note": "drafters have random weights (acceptance ~0): k=15 steps time the step, not the speedup",
              "results": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "first_gpu.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(f"\n{result['device']}  commit {commit}  copy {result['copy_bandwidth_GBs']} GB/s  bf16 batch 1 ctx 512")
    print(f"{'model':45s} {'AR tok/s':>9s} {'roofline':>9s} {'AR ms':>7s} {'k15 step':>9s} {'draft':>7s} "
          f"{'verify/AR':>9s} {'draft/AR':>8s} {'syncs':>6s} {'gAR':>6s} {'gVer':>6s} {'gDr':>6s}")
    for r in rows:
        print(f"{r['model']:45s} {r['ar_tok_s']:9.1f} {r['roofline_tok_s']:9.1f} {r['ar_step_ms']:7.2f} "
              f"{r['k15_step_ms']:9.2f} {r['k15_draft_ms']:7.2f} {r['verify_over_ar']:9.2f} {r['draft_over_ar']:8.2f} "
              f"{r['syncs_per_step_k15']:6.1f} {r['gpu_ar_graph_ms']:6.2f} {r['gpu_verify_graph_ms']:6.2f} "
              f"{r['gpu_draft_graph_ms']:6.2f}")


if __name__ == "__main__":
    main()
