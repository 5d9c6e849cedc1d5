"""Engine A/B on one machine: bench/hybrid_gpu.py from this tree and from another commit's tree, back to back with
the same arguments, then a table of the two side by side (ratios new / base) last.

Why: a change worth a few percent only shows against its base measured on the same machine in the same hour (copy
bandwidth, and with it every roofline share, differs 1-2% between H100s and between runs on one). The base tree is
exported with `git archive` into a temporary folder, so the working tree is never touched; each run is its own
process tree (hybrid_gpu.py puts its own repo root first on sys.path, the base's PYTHONPATH starts with its folder).

  python bench/ab_engine.py --base 6b17b85 -- --models coder30b,35b --skip-equality
  python bench/ab_engine.py --base HEAD -- --device cpu --tiny --tokens 8 --runs 1 --context 32 --models coder30b

--same-harness runs the base's blockspec/ under this tree's bench/ (the base's own bench/ otherwise): for a kernel
change, so that both sides are measured by the same scripts.

--rounds N alternates the two N times (new, base, new, base, ...) and compares medians over the rounds: a machine
drifts by about as much as a small change gains. Besides whole requests, the table gives each tree's batch-1 graph
replays (hybrid_gpu's graphs_ms: the AR step's graph, the k = 15 step's draft + target graphs), GPU time without
the host, the steadier measure of a kernel change.

JSON: --out (default $OUT, else bench/results/) gets new<i>/hybrid_gpu.json, base<i>/hybrid_gpu.json and
ab_engine.json.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO, check=True).stdout.strip()


def export_tree(commit: str, dest: Path) -> str:
    """blockspec/ and bench/ of `commit` under dest; returns its short hash."""
    short = git("rev-parse", "--short", commit)
    data = subprocess.run(["git", "archive", "--format=tar", short, "blockspec", "bench"], capture_output=True,
                          cwd=REPO, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    return short


def this_tree() -> str:
    """This tree's label: its commit, marked when blockspec/ or bench/ differ from it."""
    dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", "blockspec", "bench"))
    return git("rev-parse", "--short", "HEAD") + ("+working-tree" if dirty else "")


def run(root: Path, label: str, args: list[str], out: Path, extra_env: dict[str, str] | None = None
        ) -> dict[str, Any]:
    """hybrid_gpu.py of the tree at `root` in a process of its own (`extra_env` on top of this environment)."""
    env = dict(os.environ, **(extra_env or {}), COMMIT=label,
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(root / "bench" / "hybrid_gpu.py"), *args, "--out", str(out)]
    print(f"== {label}: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, cwd=root, env=env, check=False)
    found = sorted(out.glob("hybrid_gpu*.json"))
    return json.loads(found[0].read_text()) if found else {"error": f"{label}: no JSON written"}


def _median(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def median_of_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One hybrid_gpu result whose compared figures are the medians over several runs of the same tree (the first
    run's everything else)."""
    if len(rounds) == 1:
        return rounds[0]
    out = json.loads(json.dumps(rounds[0]))
    for m in out.get("models", []):
        same = [next((x for x in r.get("models", []) if x.get("key") == m.get("key")), {}) for r in rounds]
        for path in (("ar", "tok_s"), ("ar_fraction",), ("k15", "uniform", "step_ms"), ("verify", "uniform", "step_ms"),
                     ("verify", "uniform", "fraction"), ("graphs_ms", "ar_target"), ("graphs_ms", "k15_draft"),
                     ("graphs_ms", "k15_target")):
            values = []
            for x in same:
                for key in path:
                    x = x.get(key) if isinstance(x, dict) else None
                values.append(x)
            holder = m
            for key in path[:-1]:
                holder = holder.setdefault(key, {})
            holder[path[-1]] = _median(values)
    return out


def compare(new: dict[str, Any], base: dict[str, Any]) -> list[dict[str, Any]]:
    """One row a model measured in both runs: AR tok/s and roofline share, the k = 15 step, the verify step."""
    base_models = {m.get("key"): m for m in base.get("models", [])}
    rows = []
    for m in new.get("models", []):
        b = base_models.get(m.get("key"))
        if b is None or "ar" not in m or "ar" not in b:
            rows.append({"model": m.get("model"), "error": m.get("error") or (b or {}).get("error") or "not in both"})
            continue
        row = {"model": m["model"], "ar_tok_s": [m["ar"]["tok_s"], b["ar"]["tok_s"]],
               "ar_fraction": [m.get("ar_fraction"), b.get("ar_fraction")],
               "k15_ms": [m["k15"]["uniform"]["step_ms"], b["k15"]["uniform"]["step_ms"]]}
        if "verify" in m and "verify" in b:
            row["verify_ms"] = [m["verify"]["uniform"]["step_ms"], b["verify"]["uniform"]["step_ms"]]
            row["verify_fraction"] = [m["verify"]["uniform"].get("fraction"), b["verify"]["uniform"].get("fraction")]
        graphs = [m.get("graphs_ms") or {}, b.get("graphs_ms") or {}]
        row["ar_graph_ms"] = [g.get("ar_target") for g in graphs]
        row["k15_graphs_ms"] = [None if g.get("k15_target") is None or g.get("k15_draft") is None
                                else g["k15_target"] + g["k15_draft"] for g in graphs]
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], new: str, base: str) -> str:
    def cell(pair: list[float] | None, fmt: str, higher_better: bool) -> str:
        if not pair or None in pair:
            return "-"
        ratio = pair[0] / pair[1] if pair[1] else float("nan")
        return f"{pair[0]:{fmt}} / {pair[1]:{fmt}} ({ratio:.3f}{'' if higher_better else ' time'})"

    def share(pair: list[float] | None) -> str:
        return "-" if not pair or None in pair else f"{100 * pair[0]:.1f}% / {100 * pair[1]:.1f}%"

    lines = [f"new {new} / base {base}",
             "| model | AR tok/s | AR % of roofline | k15 step ms | verify ms (uniform) | verify % | AR graph ms | "
             "k15 graphs ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['error']} | | | | | | |")
            continue
        lines.append(f"| {r['model']} | {cell(r['ar_tok_s'], '.1f', True)} | {share(r['ar_fraction'])} | "
                     f"{cell(r['k15_ms'], '.2f', False)} | {cell(r.get('verify_ms'), '.2f', False)} | "
                     f"{share(r.get('verify_fraction'))} | {cell(r.get('ar_graph_ms'), '.3f', False)} | "
                     f"{cell(r.get('k15_graphs_ms'), '.3f', False)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit to compare against (anything git rev-parse takes)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(BENCH / "results"))
    ap.add_argument("--rounds", type=int, default=1, help="alternate the two trees this many times; medians")
    ap.add_argument("--same-harness", action="store_true", help="the base's blockspec/ under this tree's bench/")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    out = Path(args.out)
    new_label = this_tree()
    with tempfile.TemporaryDirectory(prefix="ab_base_") as tmp:
        base_label = export_tree(args.base, Path(tmp))
        if args.same_harness:
            shutil.rmtree(Path(tmp) / "bench")
            shutil.copytree(BENCH, Path(tmp) / "bench", ignore=shutil.ignore_patterns("results", "__pycache__"))
            base_label += "+this-bench"
        news, bases = [], []
        for i in range(args.rounds):
            suffix = "" if args.rounds == 1 else str(i)
            news.append(run(REPO, new_label, rest, out / f"new{suffix}"))
            bases.append(run(Path(tmp), base_label, rest, out / f"base{suffix}"))
    new, base = median_of_rounds(news), median_of_rounds(bases)
    rows = compare(new, base)
    res = {"new": new_label, "base": base_label, "args": rest, "rounds": args.rounds, "device": new.get("device"),
           "copy_bandwidth_GBps": [new.get("copy_bandwidth_GBps"), base.get("copy_bandwidth_GBps")], "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab_engine.json").write_text(json.dumps(res, indent=1))
    print(table(rows, new_label, base_label))
    return res


if __name__ == "__main__":
    main()
