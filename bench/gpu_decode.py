"""Batch-1 decode on one GPU, side by side with what users would run instead (issue 5).

In one run, bf16, batch 1, medians of --runs runs after a warm-up:
  - measured copy bandwidth and each model's roofline tok/s (weight bytes per token);
  - a Qwen3-8B-shaped model with random weights: blockspec autoregressive (contexts 512 and 8192),
    Hugging Face transformers `generate` with a static cache + torch.compile, the z-lab reference loop
    (`dflash_generate`, block size 1), blockspec's k = 15 verify step and drafter pass (5 layers, the
    Qwen3-8B-DFlash-b16 shape) as multiples of its autoregressive step, and blockspec with synthetic
    drafts (the target's own greedy tokens, corrupted to a chosen acceptance; labelled synthetic);
  - SmolLM2-135M (real weights) with the shipped drafter when there is one: blockspec AR and DFlash,
    the z-lab loop with the same drafter weights, transformers static + compile; tau as measured.
Prints a table last and writes gpu_decode.json under $OUT (or --out).

Each engine's KV cache is a fixed --kv-cache-memory sized for its max_num_seqs full-length sequences (not
a share of the card), and no engine outlives its measurements, so the defaults fit an 80 GB H100 as well
as an H200 (GPU_UTIL=0.45 brings back the old utilisation-share sizing).

Usage: python bench/gpu_decode.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf [--draft DIR] [--tokens 128] [--runs 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))  # first_gpu.py sits beside this script
from first_gpu import QWEN3_8B, copy_bandwidth, drafter_config, replay_ms, write_dir  # noqa: E402

from blockspec.models.model_config import read_config_json  # noqa: E402

MAX_NUM_SEQS = 4


def free() -> None:
    """Drop what the last measurement left: compiled graphs (transformers' static-cache compile keeps the
    model and its CUDA-graph pools alive), unreachable engines, the allocator's cached blocks."""
    torch.compiler.reset()
    gc.collect()
    torch.cuda.empty_cache()


def median_of(fn: Callable[[], float], runs: int) -> tuple[float, list[float]]:
    fn()  # warm-up
    values = [fn() for _ in range(runs)]
    return statistics.median(values), values


def ours(engine: Engine, prompt: list[int], tokens: int) -> Callable[[], float]:
    def run() -> float:
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))[0]
        run.stats, run.tokens = out.stats, out.token_ids
        return out.stats.decode_tok_s
    return run


def timed_generate(fn: Callable[[], int]) -> Callable[[], float]:
    """tok/s of a callable that decodes and returns how many tokens it produced (prefill included)."""
    def run() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = fn()
        torch.cuda.synchronize()
        return n / (time.perf_counter() - t0)
    return run


def hf_model(model_dir: Path, random_weights: bool):
    import transformers

    if random_weights:
        cfg = transformers.AutoConfig.from_pretrained(model_dir)
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    return model.eval()


def hf_static_compile(model, prompt: list[int], tokens: int) -> Callable[[], float]:
    ids = torch.tensor([prompt], device="cuda")
    # transformers compiles the forward itself (reduce-overhead, CUDA graphs) when the cache is static.
    model.generation_config.cache_implementation = "static"

    def gen() -> int:
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        return out.shape[1] - ids.shape[1]
    return timed_generate(gen)


def zlab_loop(model, drafter, prompt: list[int], tokens: int, block_size: int | None) -> Callable[[], float]:
    from dflash.model import dflash_generate

    ids = torch.tensor([prompt], device="cuda")

    def run() -> float:
        res = dflash_generate(drafter, model, ids, max_new_tokens=tokens, stop_token_ids=None, temperature=0.0,
                              block_size=block_size, return_stats=True)
        run.tau = statistics.mean(res.acceptance_lengths) if res.acceptance_lengths else 1.0
        return 1.0 / res.time_per_output_token
    return run


def zlab_drafter(draft_dir: Path, random_weights: bool):
    from dflash.model import DFlashDraftModel
    from transformers import AutoConfig

    if random_weights:
        cfg = AutoConfig.from_pretrained(draft_dir)
        with torch.device("cuda"):
            return DFlashDraftModel(cfg).to(torch.bfloat16).eval()
    return DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.bfloat16).cuda().eval()


def kv_memory(model_dir: Path, draft: Path | None, max_len: int) -> int:
    """Bytes of K/V (bf16, target + drafter) for MAX_NUM_SEQS sequences of max_len, with verify room and 10%."""
    import hybrid_parts

    target = read_config_json(model_dir)
    drafter = read_config_json(draft) if draft else None
    return hybrid_parts.kv_cache_bytes(target, drafter, torch.bfloat16, MAX_NUM_SEQS, max_len)


def engine(model_dir: Path, draft: Path | None, k: int, dummy: bool, max_len: int) -> Engine:
    spec = SpeculativeConfig(model=str(draft), num_speculative_tokens=k, load_format="dummy" if dummy else "auto") \
        if draft else SpeculativeConfig()
    util = os.environ.get("GPU_UTIL")
    memory = {"gpu_memory_utilization": float(util)} if util else {"kv_cache_memory": kv_memory(model_dir, draft,
                                                                                                 max_len)}
    return Engine(EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16", max_model_len=max_len,
                               max_num_seqs=MAX_NUM_SEQS, load_format="dummy" if dummy else "auto", speculative=spec,
                               **memory))


def bytes_read(model: torch.nn.Module) -> int:
    """Weight bytes a decode step reads: every parameter once, but of an untied input embedding table only the
    token's row (a tied one is read whole, as the LM head). From the script's first version to b31cec9 the whole
    untied table was counted: the Qwen3-8B roofline held 1.24 GB the step never reads, so AR/roofline read ~8%
    high."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.model.embed_tokens.weight
    if model.lm_head_weight is not table:
        total -= (table.shape[0] - 1) * table.shape[1] * table.element_size()
    return total


def eight_b(work: Path, smol: Path, bw: float, tokens: int, runs: int) -> dict:
    q8 = write_dir(work / "qwen3-8b", QWEN3_8B, tokenizer_from=smol)
    q8_draft = write_dir(work / "qwen3-8b-draft", drafter_config(QWEN3_8B, 5, [1, 9, 17, 25, 33], 151669))
    gen = torch.Generator().manual_seed(0)
    res: dict = {"model": "Qwen3-8B shape, random bf16 weights"}
    weights = None
    for ctx in (512, 8192):
        prompt = torch.randint(100, 30000, (ctx,), generator=gen).tolist()
        eng = engine(q8, None, 0, True, 8192 + tokens + 64)
        weights = bytes_read(eng.runner.target)
        ar_run = ours(eng, prompt, tokens)
        tok_s, values = median_of(ar_run, runs)
        ar_tokens = ar_run.tokens
        res[f"blockspec_ar_tok_s_ctx{ctx}"] = round(tok_s, 1)
        res[f"blockspec_ar_runs_ctx{ctx}"] = [round(x, 1) for x in values]
        res[f"blockspec_ar_graph_ms_ctx{ctx}"] = round(replay_ms(eng, "target"), 3)
        if ctx == 512:
            prompt512 = prompt
            reference = {"syn": ar_tokens}  # the synthetic drafts below: the target's own greedy tokens
        eng.release()
        del eng, ar_run  # the closure holds the engine: its weights and graph pools would outlive it
        free()
        spec = engine(q8, q8_draft, 15, True, 8192 + tokens + 64)
        run = ours(spec, prompt, tokens)
        median_of(run, 1)
        step_ms = 1000 * run.stats.decode_time / max(run.stats.steps, 1)
        res[f"k15_greedy_equals_ar_ctx{ctx}"] = run.tokens == ar_tokens
        ar_step_ms = 1000 / res[f"blockspec_ar_tok_s_ctx{ctx}"]
        res[f"k15_step_ms_ctx{ctx}"] = round(step_ms, 3)
        res[f"k15_step_over_ar_ctx{ctx}"] = round(step_ms / ar_step_ms, 3)
        res[f"verify_graph_ms_ctx{ctx}"] = round(replay_ms(spec, "target"), 3)
        res[f"draft_graph_ms_ctx{ctx}"] = round(replay_ms(spec, "draft"), 3)
        spec.release()
        del spec, run
        free()
    # Synthetic acceptance: drafts are the target's own greedy tokens, each right with probability 0.8.
    syn = engine(q8, None, 0, True, 4096)
    syn.enable_synthetic_drafts(reference, 0.8, 15)

    def run_syn() -> float:
        syn.add_request("syn", prompt512, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        final = None
        while syn.has_unfinished_requests():
            for out in syn.step():
                final = out
        run_syn.stats, run_syn.tokens = final.stats, final.token_ids
        return final.stats.decode_tok_s

    res["synthetic_accept_prob"] = 0.8
    res["synthetic_tok_s"] = round(median_of(run_syn, runs)[0], 1)
    res["synthetic_tau"] = round(run_syn.stats.tau, 2)
    res["synthetic_greedy_equals_ar"] = run_syn.tokens == reference["syn"]
    syn.release()
    syn = None  # noqa: F841 (free it before the references load; run_syn reaches it only through this name)
    free()
    prompt = prompt512
    # References: transformers static cache + compile, and the z-lab loop at block size 1 (autoregressive).
    hf = hf_model(q8, random_weights=True)
    drafter = zlab_drafter(q8_draft, random_weights=True)
    res["zlab_loop_ar_tok_s"] = round(median_of(zlab_loop(hf, drafter, prompt, tokens, 1), runs)[0], 1)
    res["hf_static_compile_tok_s"] = round(median_of(hf_static_compile(hf, prompt, tokens), runs)[0], 1)
    del hf, drafter
    free()
    res["weight_bytes"] = weights
    res["roofline_tok_s"] = round(bw / weights, 1)
    res["blockspec_ar_over_roofline"] = round(res["blockspec_ar_tok_s_ctx512"] / res["roofline_tok_s"], 3)
    res["blockspec_ar_over_hf"] = round(res["blockspec_ar_tok_s_ctx512"] / res["hf_static_compile_tok_s"], 2)
    return res


def smollm2(smol: Path, draft: Path | None, bw: float, tokens: int, runs: int) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol)
    text = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that returns the n-th "
                                     "Fibonacci number, with a docstring and type hints."}],
                                   tokenize=False, add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    res: dict = {"model": "SmolLM2-135M-Instruct (real weights)", "drafter": str(draft) if draft else None}
    eng = engine(smol, None, 0, False, 4096)
    weights = bytes_read(eng.runner.target)
    ar_run = ours(eng, prompt, tokens)
    res["blockspec_ar_tok_s"] = round(median_of(ar_run, runs)[0], 1)
    res["blockspec_ar_graph_ms"] = round(replay_ms(eng, "target"), 3)
    ar_tokens = ar_run.tokens
    eng.release()
    del eng, ar_run  # the closure holds the engine
    free()
    if draft is not None:
        spec = engine(smol, draft, 15, False, 4096)
        run = ours(spec, prompt, tokens)
        res["blockspec_dflash_tok_s"] = round(median_of(run, runs)[0], 1)
        res["blockspec_dflash_tau"] = round(run.stats.tau, 2)
        res["dflash_greedy_equals_ar"] = run.tokens == ar_tokens
        spec.release()
        del spec, run
        free()
    hf = hf_model(smol, random_weights=False)
    if draft is not None:
        drafter = zlab_drafter(draft, random_weights=False)
        run = zlab_loop(hf, drafter, prompt, tokens, None)
        res["zlab_loop_dflash_tok_s"] = round(median_of(run, runs)[0], 1)
        res["zlab_loop_dflash_tau"] = round(run.tau, 2)
        res["blockspec_dflash_over_zlab"] = round(res["blockspec_dflash_tok_s"] / res["zlab_loop_dflash_tok_s"], 2)
    res["hf_static_compile_tok_s"] = round(median_of(hf_static_compile(hf, prompt, tokens), runs)[0], 1)
    del hf
    free()
    res["weight_bytes"] = weights
    res["roofline_tok_s"] = round(bw / weights, 1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--draft", default=None, help="SmolLM2 drafter (default: the shipped one, if any)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--section", choices=["smollm2", "8b"], default=None,
                    help="run one section in this process (default: each in its own subprocess, so one "
                         "section's CUDA graph pools and compiled models cannot starve the next)")
    args = ap.parse_args()
    if args.section is None:
        results = []
        for section in ("smollm2", "8b"):
            part = Path(tempfile.mkdtemp())
            cmd = [sys.executable, __file__, "--gguf", args.gguf, "--out", str(part), "--tokens", str(args.tokens),
                   "--runs", str(args.runs), "--section", section] + (["--draft", args.draft] if args.draft else [])
            subprocess.run(cmd, check=True)
            results += json.loads((part / "gpu_decode.json").read_text())["results"]
        bw = None
    else:
        from blockspec.loader.default_model import default_drafter_dir
        from blockspec.loader.weights import resolve_model_path

        smol = resolve_model_path(args.gguf)
        draft = Path(args.draft) if args.draft else default_drafter_dir()
        bw = copy_bandwidth()
        if args.section == "smollm2":
            results = [smollm2(smol, draft, bw, args.tokens, args.runs)]
        else:
            results = [eight_b(Path(tempfile.mkdtemp()), smol, bw, args.tokens, args.runs)]
    out = {"commit": os.environ.get("COMMIT", "unknown"), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "dtype": "bfloat16", "batch": 1, "tokens": args.tokens, "runs": args.runs,
           "copy_bandwidth_GBs": round((bw or copy_bandwidth()) / 1e9, 1), "results": results}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_decode.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    print(f"\n{out['device']}  commit {out['commit']}  copy {out['copy_bandwidth_GBs']} GB/s  bf16 batch 1")
    for r in results:
        print(f"-- {r['model']}")
        for key, value in r.items():
            if key != "model" and not key.endswith("_runs_ctx512") and not key.endswith("_runs_ctx8192"):
                print(f"   {key:36s} {value}")


if __name__ == "__main__":
    main()
