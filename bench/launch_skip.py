"""What the small launches between a decode step's GEMMs cost: the step timed with kinds of them made no-ops.

Before folding a kind of launch into its neighbours (issue 14: the quantized Qwen3-8B step), this bounds the gain:
each variant builds the engine of bench/hybrid_gpu.py in a process of its own with the chosen launches turned into
no-ops, so its outputs are wrong and only its step times mean anything (the dense shapes have no data-dependent
launches). Kinds:
  - norm:  RMSNorm of 1-16 rows on the GPU (the decoder layers' input and post-attention norms, the final norm,
           the drafter's), the residual add of the fused form included;
  - rope:  rope_qk (q/k norm, rotary, the K/V cache write);
  - merge: the split-attention merge launch of paged_attention;
  - attn:  decode attention altogether (its split launch and the merge).
Each variant runs `hybrid_gpu.py --in-process --profile` with the arguments after `--` (launches per graph show
what was removed) in a temporary folder; prints the AR, k = 15 and verify step ms against the base variant and
writes $OUT/launch_skip.json (each variant's step ms, batch-1 graph replay ms and launches, the commit and device).

  python bench/launch_skip.py [--variants base,norm,rope,merge,attn,all] -- --models 8b --quant nvfp4 \\
      --draft-quantization rtn --skip-equality --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

KINDS = ("norm", "rope", "merge", "attn")


def skip(kinds: set[str]) -> None:
    """Turn the chosen launches into no-ops in this process."""
    import torch

    if "norm" in kinds:
        from blockspec.models.layers import norm

        forward = norm.RMSNorm.forward

        def no_norm(self, x: torch.Tensor, residual: torch.Tensor | None = None):
            if x.is_cuda and x.dim() == 2 and x.shape[0] <= 16:
                return x if residual is None else (x, residual)
            return forward(self, x, residual)

        norm.RMSNorm.forward = no_norm
    if "rope" in kinds:
        from blockspec.models import llama

        llama.rope_qk = lambda *args, **kwargs: None
    if "merge" in kinds:
        from blockspec.kernels import paged_attention as pa

        class NoLaunch:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: None

        pa._merge_splits_kernel = NoLaunch()
    if "attn" in kinds:
        from blockspec.models.layers import attention

        attention.paged_attention = lambda q, *args, **kwargs: torch.empty_like(q)


def child(variant: str, rest: list[str]) -> None:
    import hybrid_gpu

    skip(set(KINDS) if variant == "all" else set() if variant == "base" else {variant})
    hybrid_gpu.main(rest)


def variant_result(path: Path) -> tuple[dict, dict]:
    """From a variant's hybrid_gpu JSON (its one model): (AR / k15 / verify step ms, graph replay ms and launches per
    graph; the run's commit, device and settings)."""
    files = sorted(path.glob("hybrid_gpu*.json"))
    if not files:
        return {"error": "no result"}, {}
    res = json.loads(files[0].read_text())
    model = res["models"][0]
    out = {"error": model.get("error")}
    for key in ("ar", "k15", "verify"):
        entry = model.get(key, {})
        entry = entry.get("uniform", entry) if key != "ar" else entry
        out[f"{key}_ms"] = entry.get("step_ms")
    out["graphs_ms"] = model.get("graphs_ms")
    out["launches"] = {f"k{p['k']} {p['graph']}": p.get("launches") for p in model.get("profile", [])}
    return out, {k: res.get(k) for k in ("commit", "device", "dtype", "settings", "copy_bandwidth_GBps")}


def main() -> None:
    argv = sys.argv[1:]
    if argv and argv[0] == "--child":
        child(argv[1], argv[3:] if len(argv) > 2 and argv[2] == "--" else argv[2:])
        return
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="base,norm,rope,merge,attn,all")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    out = Path(os.environ.get("OUT", str(HERE / "results")))
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict] = {}
    info: dict = {}
    with tempfile.TemporaryDirectory(prefix="launch_skip_") as tmp:
        for variant in args.variants.split(","):
            where = Path(tmp) / variant
            cmd = [sys.executable, __file__, "--child", variant, "--", *rest, "--in-process", "--profile",
                   "--out", str(where)]
            print(f"== {variant}", flush=True)
            subprocess.run(cmd, check=False)
            rows[variant], run = variant_result(where)
            info = info or run
            (out / "launch_skip.json").write_text(json.dumps({**info, "args": rest, "variants": rows}, indent=1))
    base = rows.get("base", {})
    print(f"{'variant':8} {'AR ms':>8} {'k15 ms':>8} {'verify ms':>10}  (saved against base)  launches")
    for variant, r in rows.items():
        cells = []
        for key in ("ar_ms", "k15_ms", "verify_ms"):
            v, b = r.get(key), base.get(key)
            cells.append(f"{v:.3f}" if v is not None else "-")
            if v is not None and b is not None and variant != "base":
                cells[-1] += f" ({b - v:+.3f})"
        print(f"{variant:8} {cells[0]:>16} {cells[1]:>16} {cells[2]:>16}  {r.get('launches')} {r.get('error') or ''}")


if __name__ == "__main__":
    main()
