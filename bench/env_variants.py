"""Engine variants of this tree that differ only in environment switches, measured on one machine in alternating
rounds, each against the first variant: bench/ab_engine.py for a change that a kernel flag read from the environment
turns on or off (several at once, without a tree per variant).

Why: a change worth ~1% shows only beside its base in the same hour on the same GPU, and several related switches
(which launches release their dependents early, say) are cheaper to compare in one job than as a tree each. Each run
is bench/hybrid_gpu.py in its own process with the variant's variables set; the table compares the medians over the
rounds, with the batch-1 graph replay times (GPU time without the host) beside the requests.

  python bench/env_variants.py --rounds 2 --variant base: --variant nopdl:BLOCKSPEC_PDL=0 \\
      -- --models 8b --quant nvfp4 --draft-quantization rtn --skip-equality --runs 3

A variant is NAME:VAR=VALUE;VAR=VALUE (values may hold commas; an empty list runs the environment as it is). JSON:
--out (default $OUT, else bench/results/) gets <name><round>/hybrid_gpu.json and env_variants.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import ab_engine  # noqa: E402


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """'NAME:VAR=VALUE;VAR=VALUE' -> (NAME, {VAR: VALUE})."""
    name, _, spec = text.partition(":")
    if not name:
        raise SystemExit(f"--variant {text!r}: give it a name (NAME:VAR=VALUE;...)")
    env = {}
    for item in filter(None, spec.split(";")):
        var, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--variant {text!r}: {item!r} is not VAR=VALUE")
        env[var] = value
    return name, env


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", required=True, help="NAME:VAR=VALUE;... (the first is the base)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(BENCH / "results"))
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    variants = [parse_variant(v) for v in args.variant]
    if len({name for name, _ in variants}) != len(variants):
        raise SystemExit("--variant names must differ")
    out = Path(args.out)
    label = ab_engine.this_tree()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in variants}
    for i in range(args.rounds):
        for name, env in variants:
            runs[name].append(ab_engine.run(ab_engine.REPO, f"{label} {name}", rest, out / f"{name}{i}", env))
    medians = {name: ab_engine.median_of_rounds(r) for name, r in runs.items()}
    base_name = variants[0][0]
    tables, results = [], {}
    for name, env in variants[1:]:
        rows = ab_engine.compare(medians[name], medians[base_name])
        results[name] = {"env": env, "rows": rows}
        tables.append(ab_engine.table(rows, name, base_name))
    res = {"commit": label, "args": rest, "rounds": args.rounds, "device": medians[base_name].get("device"),
           "base": {"name": base_name, "env": variants[0][1]}, "variants": results}
    out.mkdir(parents=True, exist_ok=True)
    (out / "env_variants.json").write_text(json.dumps(res, indent=1))
    print("\n\n".join(tables))
    return res


if __name__ == "__main__":
    main()
