"""What one speculative step costs with each proposer, as a multiple of the plain decode step (issue 18).

On the Qwen3.6-27B shape (random bf16 weights, load_format="dummy", through the Engine `serve` builds),
batch 1, a --context-token prompt: for each proposer an engine is built, its AR step (k = 0) and its k-step
are timed on the same engine, and the ratio step(k) / step(AR) is reported:
  - DFlash 1: a z-lab-shaped drafter (5 layers of the target's width, block 16), k = 15;
  - DFlash 2: the same backbone with sliding-window (2048) non-causal layers, two-tap grouped dynamic
    convolutions (groups of 16) and a candidate selector (rank 256, top 16), block 8, k = 7;
  - MTP: the checkpoint's own head (one gated-attention layer of the target, pre-norms, fc), N = 1..4.
Random drafts are always rejected, so every step verifies a full block: the step time is the proposer
pass plus the (k + 1)-token verify, which is what the ratio is meant to show. Each row is the median
of --runs requests after a warm-up. Writes proposer_cost.json to --out (default $OUT, else bench/results)
and prints a table last.

Usage (repository root, on the GPU machine):
    python bench/proposer_cost_gpu.py [--runs 3] [--tokens 64] [--context 1024] [--mtp 1,2,3,4]
Anywhere, in seconds (tiny shapes, the whole flow; tests/bench/test_proposer_cost_script.py runs it):
    python bench/proposer_cost_gpu.py --device cpu --tiny --tokens 6 --runs 1 --context 24 --out /tmp/p
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

import hybrid_parts as hp  # noqa: E402
from hybrid_gpu import CONFIGS, MASK_TOKEN, TINY, commit, scaled  # noqa: E402

# z-lab's DFlash 2 drafter for the 27B (Qwen3.8-27B-DFlash2: five sliding-window layers, block 8)
DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
DFLASH2_WINDOW = 2048


def target_config(tiny: bool) -> dict[str, Any]:
    cfg = scaled(CONFIGS["27b"], TINY) if tiny else json.loads(json.dumps(CONFIGS["27b"]))
    cfg["text_config"]["mtp_num_hidden_layers"] = 1  # the published checkpoints carry one MTP layer
    return cfg


def drafter2_config(target: dict[str, Any], mask: int, layers: int, tiny: bool) -> dict[str, Any]:
    draft, _ = hp.drafter_config(target, mask, layers)
    window = 12 if tiny else DFLASH2_WINDOW
    selector = {**DFLASH2, "selector_rank": 8, "selector_top_k": 4} if tiny else DFLASH2
    return {**draft, "architectures": ["DFlash2DraftModel"], "block_size": 8, "is_causal": False,
            "layer_types": ["sliding_attention"] * layers, "sliding_window": window, "use_sliding_window": True,
            "dflash_config": {**draft["dflash_config"], **selector, "block_size": 8}}


def build(model_dir: Path, spec: dict[str, Any], args: argparse.Namespace, max_len: int):
    from blockspec.config import EngineConfig, SpeculativeConfig
    from blockspec.engine.engine import Engine

    speculative = SpeculativeConfig(model=spec.get("model"), num_speculative_tokens=spec["k"],
                                    method=spec["method"], load_format="dummy")
    memory = {"kv_cache_memory": args.kv_cache_memory} if args.kv_cache_memory else \
        {"gpu_memory_utilization": args.gpu_memory_utilization}
    return Engine(EngineConfig(model=str(model_dir), device=args.device, dtype=args.dtype, max_model_len=max_len,
                               max_num_seqs=1, load_format="dummy", speculative=speculative,
                               enforce_eager=args.enforce_eager, **memory))


def measure(engine, ks: list[int], prompt: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """AR step and each k's step on one engine, medians of --runs requests."""
    def request() -> dict[str, Any]:
        return hp.one_request(engine, prompt, args.tokens)

    def warmup() -> dict[str, Any]:
        return hp.one_request(engine, prompt, min(args.tokens, 16))

    out: dict[str, Any] = {}
    proposer = engine.proposer
    out["proposer_weight_bytes"] = sum(p.numel() * p.element_size() for p in proposer.parameters())
    for k in ks:
        engine.set_num_speculative_tokens(k)
        out[f"k{k}"] = hp.median_runs(request, args.runs, warmup)
    engine.set_num_speculative_tokens(0)
    out["ar"] = hp.median_runs(request, args.runs, warmup)
    for k in ks:
        out[f"k{k}"]["over_ar"] = out[f"k{k}"]["step_ms"] / out["ar"]["step_ms"]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    work = Path(tempfile.mkdtemp(prefix="proposer-cost-"))
    tiny = args.tiny
    if tiny and args.device == "cpu":
        torch.set_num_threads(1)  # tiny matrices: thread hand-offs would cost more than the work
    cfg = target_config(tiny)
    mask = TINY["vocab_size"] - 2 if tiny else MASK_TOKEN["27b"]
    layers = 2 if tiny else 5
    model_dir = hp.write_model_dir(work / "target", cfg)
    d1, _ = hp.drafter_config(cfg, mask, layers)
    d1_dir = hp.write_model_dir(work / "dflash", d1, tokenizer=False)
    d2_dir = hp.write_model_dir(work / "dflash2", drafter2_config(cfg, mask, layers, tiny), tokenizer=False)
    max_len = args.context + args.tokens + 64
    prompt = hp.random_prompts(1, args.context, int(cfg["text_config"]["vocab_size"]))[0]
    mtp = sorted(args.mtp)
    proposers = {
        "dflash": ({"method": "dflash", "model": str(d1_dir), "k": 15}, [15]),
        "dflash2": ({"method": "dflash", "model": str(d2_dir), "k": 7}, [7]),
        "mtp": ({"method": "mtp", "k": max(mtp)}, mtp),
    }
    res: dict[str, Any] = {"tool": "bench/proposer_cost_gpu.py", "commit": commit(), "model": "Qwen3.6-27B"
                           + (" (tiny)" if tiny else ""), "config": cfg,
                           "settings": {k: v for k, v in vars(args).items() if k != "out"}, "proposers": {}}
    res["device"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    for name, (spec, ks) in proposers.items():
        if name not in args.proposers:
            continue
        t0 = time.perf_counter()
        try:
            engine = build(model_dir, spec, args, max_len)
            res["proposers"][name] = measure(engine, ks, prompt, args)
            engine.release()
            del engine
        except Exception as exc:  # an OOM or a failure is recorded; the next proposer still runs
            res["proposers"][name] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
        res["proposers"][name]["wall_s"] = round(time.perf_counter() - t0, 1)
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        save(res, args.out)
    return res


def save(res: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "proposer_cost.json").write_text(json.dumps(res, indent=2))


def table(res: dict[str, Any]) -> str:
    s = res["settings"]
    lines = [f"{res['model']} on {res['device']}, {s['dtype']}, batch 1, context {s['context']}, {s['tokens']} "
             f"tokens, median of {s['runs']}, commit {res['commit']}",
             "| proposer | k | AR step ms | k-step ms | k-step / AR step | proposer weights |",
             "|---|---|---|---|---|---|"]
    for name, r in res["proposers"].items():
        if "ar" not in r:
            lines.append(f"| {name} | - | {r.get('error', 'not measured')} | | | |")
            continue
        for key in (k for k in r if k.startswith("k") and k[1:].isdigit()):
            lines.append(f"| {name} | {key[1:]} | {r['ar']['step_ms']:.2f} | {r[key]['step_ms']:.2f} "
                         f"| {r[key]['over_ar']:.2f} | {r['proposer_weight_bytes'] / 2**30:.2f} GiB |")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--proposers", default="dflash,dflash2,mtp")
    ap.add_argument("--mtp", default="1,2,3,4", help="MTP drafts per step to time")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (the whole flow in seconds; for CPU tests)")
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (default: 0.9 of the card on cuda)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    args.proposers = [p for p in args.proposers.split(",") if p]
    args.mtp = [int(n) for n in args.mtp.split(",") if n]
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cpu" and args.kv_cache_memory is None:
        args.kv_cache_memory = 64 * hp.MIB
    args.out = args.out or Path(os.environ.get("OUT") or BENCH / "results")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    res = run(args)
    save(res, args.out)
    print(table(res))
    return res


if __name__ == "__main__":
    main()
