"""Where a hybrid / MoE decode step spends its GPU time: per-kernel times inside the captured graphs.

For each model of bench/hybrid_gpu.py's CONFIGS named in --models (random bf16 weights, the engine
`serve` builds, a 5-layer random DFlash drafter), batch 1: the AR target graph (k = 0) and the k = 15
target (verify) and drafter graphs, each replayed under torch.profiler; kernels summed by name with
launches per replay, beside the replay's wall time. Prints tables last, JSON to $OUT (or --out).

Usage: python bench/profile_hybrid.py [--models 27b,4b,35b] [--top 25]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

import hybrid_parts as hp  # noqa: E402
from hybrid_gpu import mask_token, model_config  # noqa: E402
from profile_decode import kernel_table  # noqa: E402


def profile(key: str, work: Path, context: int) -> list[dict]:
    cfg = model_config(key, tiny=False)
    draft, _ = hp.drafter_config(cfg, mask_token(key, False))
    model_dir = hp.write_model_dir(work / key, cfg)
    draft_dir = hp.write_model_dir(work / f"{key}-draft", draft, tokenizer=False)
    max_len = context + 256
    kv = hp.kv_cache_bytes(cfg, draft, torch.bfloat16, 1, max_len)
    engine = hp.build_engine(model_dir, draft_dir, 15, "cuda", "bfloat16", max_len, 1, kv, None)
    prompt = hp.random_prompts(1, context, engine.model_config.vocab_size)[0]
    out = []
    for k in (0, 15):
        engine.set_num_speculative_tokens(k)
        engine.generate([prompt], hp.greedy(32))
        for name in ("target",) if k == 0 else ("target", "draft"):
            out.append({"model": key, "k": k} | kernel_table(engine, name))
    engine.release()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="27b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = ap.parse_args()
    tables = []
    with tempfile.TemporaryDirectory() as tmp:
        for key in args.models.split(","):
            tables += profile(key, Path(tmp), args.context)
            torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "profile_hybrid.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                                  "commit": os.environ.get("COMMIT"),
                                                                  "tables": tables}, indent=1))
    for t in tables:
        print(f"\n{t['model']} k={t['k']} {t['graph']}: wall {t['wall_us']} us, kernels {t['kernel_us']} us, "
              f"{t['launches']} launches")
        for name, us, n in t["kernels"][: args.top]:
            print(f"  {us:9.1f} us  x{n:<6} {name}")


if __name__ == "__main__":
    main()
