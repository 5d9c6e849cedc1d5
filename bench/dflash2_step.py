"""DFlash 2's drafter step on the embedded SmolLM2 (GPU): the selector walk and the grouped convolutions as their
kernels (kernels/selector_walk.py, kernels/grouped_conv.py) against their definitions in spec/dflash2.py (a few
small ops each), with the shipped DFlash 1 drafter beside them. On a 135M target the drafter's small kernels are a
large share of a step, so this is where their launches show.

Batch 1, greedy, HumanEval prompts x 256 tokens (ignore_eos), the engine as `generate` builds it; per variant the
median over --runs passes of ms per decode step and tok/s. Prints a table last; JSON to $OUT (else bench/results/).

  python bench/dflash2_step.py --drafter DIR [--prompts 4] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import blockspec.spec.dflash2 as dflash2
from blockspec.bench.prompts import humaneval
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.sampling_params import SamplingParams
from blockspec.loader.default_model import default_drafter_dir


def measure(drafter: Path, k: int, prompts: int, runs: int) -> dict:
    engine = Engine(EngineConfig(device="cuda", max_num_seqs=4, max_model_len=2048, gpu_memory_utilization=0.3,
                                 speculative=SpeculativeConfig(model=str(drafter), num_speculative_tokens=k)))
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    texts = [engine.apply_chat_template(p.messages) for p in humaneval(prompts)]
    engine.generate(texts[:1], params)  # warm-up
    ms, tok_s, tau = [], [], []
    for _ in range(runs):
        t0, steps, tokens = time.perf_counter(), 0, 0
        for text in texts:
            out = engine.generate([text], params)[0]
            steps, tokens = steps + out.stats.steps, tokens + len(out.token_ids)
        wall = time.perf_counter() - t0
        ms.append(1e3 * wall / steps)
        tok_s.append(tokens / wall)
        tau.append(tokens / steps)
    engine.release()
    del engine
    torch.cuda.empty_cache()
    return {"k": k, "ms_per_step": round(statistics.median(ms), 3), "tok_s": round(statistics.median(tok_s), 1),
            "tokens_per_step": round(statistics.median(tau), 2), "runs_ms": [round(v, 3) for v in ms]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", type=Path, required=True, help="a DFlash 2 drafter for SmolLM2-135M-Instruct")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    kernels = dflash2.use_triton
    rows = {}
    for name, drafter, k, use in (("dflash2, kernels", args.drafter, 7, kernels),
                                  ("dflash2, definitions", args.drafter, 7, lambda x: False),
                                  ("dflash1 (shipped)", default_drafter_dir(), 15, kernels)):
        dflash2.use_triton = use  # the walk's and the convolution's dispatch read it
        rows[name] = measure(drafter, k, args.prompts, args.runs)
        print(name, rows[name], flush=True)
    dflash2.use_triton = kernels
    result = {"commit": os.environ.get("COMMIT", "?"), "device": torch.cuda.get_device_name(), "dtype": "bfloat16",
              "settings": {"prompts": args.prompts, "runs": args.runs, "max_tokens": 256, "batch": 1},
              "rows": rows}
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).resolve().parent / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "dflash2_step.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{result['device']}, commit {result['commit']}, {args.prompts} HumanEval prompts x 256 tokens, batch 1")
    print(f"{'variant':22s} {'k':>3s} {'ms/step':>8s} {'tok/s':>7s} {'tokens/step':>11s}")
    for name, r in rows.items():
        print(f"{name:22s} {r['k']:3d} {r['ms_per_step']:8.3f} {r['tok_s']:7.1f} {r['tokens_per_step']:11.2f}")


if __name__ == "__main__":
    main()
