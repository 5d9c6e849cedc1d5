"""The k = 15 step of a quantized target with its drafter in bf16, fp8 and int4 (issue 14's k15 / AR target).

Why: in front of a 4-bit Qwen3-8B (4.9 GB a token) a bf16 z-lab drafter reads 2.1 GB and the target's 1.2 GB LM
head every step, which alone bounds the k15 / AR ratio near 1.68. --speculative-config "quantization" rounds the
drafter (and a copy of the head it drafts through) at load; this runs bench/hybrid_gpu.py once per (target format,
drafter format) pair, each in its own process, and prints one table: AR step and roofline share, the k15 step and
its ratio to AR, the bound the bytes alone set on that ratio, the verify step alone, and the drafter's bytes.

  python bench/draft_quant.py [--models 8b] [--quants int4,nvfp4] [--drafts none,fp8,rtn4] [--out DIR]
  python bench/draft_quant.py --device cpu --tiny --quants nvfp4 --drafts none,rtn4 --rtn-group-size 32 \
      -- --tokens 8 --runs 1 --context 32

Arguments after `--` go to hybrid_gpu.py as they are. JSON: --out (default $OUT, else bench/results/) gets
draft_quant.json (one row a pair) beside each run's own hybrid_gpu JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
# drafter label -> (--draft-quantization, RTN_NUM_BITS)
DRAFTS = {"none": (None, None), "fp8": ("fp8", None), "rtn8": ("rtn", "8"), "rtn4": ("rtn", "4")}


def run_pair(model: str, quant: str, draft: str, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    method, bits = DRAFTS[draft]
    group = str(args.rtn_group_size) if bits else None
    out = Path(args.out) / f"{model}_{quant}_{draft}"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(BENCH / "hybrid_gpu.py"), "--models", model, "--quant", quant, "--skip-equality",
           "--concurrency", "", "--device", args.device, "--out", str(out), *(["--tiny"] if args.tiny else []),
           *(["--draft-quantization", method] if method else []), *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("RTN_NUM_BITS", "RTN_GROUP_SIZE")}
    env.update({k: v for k, v in (("RTN_NUM_BITS", bits), ("RTN_GROUP_SIZE", group)) if v})
    print(f"== {model} {quant}, drafter {draft}: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, env=env, check=False)
    found = sorted(out.glob("hybrid_gpu*.json"))
    if not found:
        return {"model": model, "quant": quant, "draft": draft, "error": "no JSON written"}
    res = json.loads(found[0].read_text())
    m = (res.get("models") or [{}])[0]
    if "error" in m or "ar" not in m:
        return {"model": model, "quant": quant, "draft": draft, "error": m.get("error", "no AR figures")}
    k15 = m.get("k15", {}).get("uniform", {})
    verify = m.get("verify", {}).get("uniform", {})
    return {"model": model, "quant": quant, "draft": draft, "commit": res.get("commit"),
            "device": res.get("env", {}).get("device"), "copy_GBps": res.get("env", {}).get("copy_bandwidth_GBps"),
            "ar_ms": m["ar"]["step_ms"], "ar_tok_s": m["ar"]["tok_s"], "ar_fraction": m.get("ar_fraction"),
            "k15_ms": k15.get("step_ms"), "k15_over_ar": m.get("k15_over_ar"),
            "k15_bytes_over_ar": m.get("k15_bytes_over_ar"), "verify_ms": verify.get("step_ms"),
            "verify_over_ar": verify.get("over_ar"), "drafter_GB": (m.get("drafter_weight_bytes") or 0) / 1e9,
            "drafter_own_lm_head": m.get("drafter_own_lm_head"), "json": str(found[0])}


def table(rows: list[dict[str, Any]]) -> str:
    def f(v, spec):
        return format(v, spec) if isinstance(v, (int, float)) else "-"

    lines = ["| target | drafter | drafter GB | AR ms (roofline %) | k15 ms | k15/AR | bytes bound | verify/AR |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} {r['quant']} | {r['draft']} | {r['error']} |||||")
            continue
        lines.append(f"| {r['model']} {r['quant']} | {r['draft']} | {f(r['drafter_GB'], '.2f')} | "
                     f"{f(r['ar_ms'], '.3f')} ({f(100 * (r['ar_fraction'] or 0), '.0f')}%) | {f(r['k15_ms'], '.3f')} | "
                     f"{f(r['k15_over_ar'], '.2f')} | {f(r['k15_bytes_over_ar'], '.2f')} | "
                     f"{f(r['verify_over_ar'], '.2f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="8b")
    ap.add_argument("--quants", default="int4,nvfp4")
    ap.add_argument("--drafts", default="none,fp8,rtn4", help=f"drafter formats, of {', '.join(DRAFTS)}")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--rtn-group-size", type=int, default=128, help="RTN_GROUP_SIZE of the rtn drafters")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(BENCH / "results"))
    args = ap.parse_args(argv)
    unknown = [d for d in args.drafts.split(",") if d not in DRAFTS]
    if unknown:
        ap.error(f"unknown drafter formats {unknown}: use {', '.join(DRAFTS)}")
    rows = []
    for model in args.models.split(","):
        for quant in args.quants.split(","):
            for draft in args.drafts.split(","):
                rows.append(run_pair(model, quant, draft, args, extra))
                Path(args.out, "draft_quant.json").write_text(json.dumps({"rows": rows}, indent=1))
    print(table(rows), flush=True)
    return rows


if __name__ == "__main__":
    main()
