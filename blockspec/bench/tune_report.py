"""Choosing k from a sweep, and writing the sweep out (table, tune.json, tune.md, tok/s-vs-k plot).

The best k per class is the fastest one measured; the overall choice maximises the geometric mean
of the per-class speedups over the autoregressive baseline (k = 0), so no single class with large
absolute tok/s dominates. The recommended `--speculative-config` uses the best k > 0 even when
plain decoding won, and says so: a sweep with a weak drafter should still tell the user what to try.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from blockspec.bench.plots import plot_tok_s_vs_k, plots_available
from blockspec.bench.report import fmt, markdown_table, render_table

JSON_NAME = "tune.json"
MD_NAME = "tune.md"
PNG_NAME = "tok_s_vs_k.png"


def _by(points: list[dict[str, Any]]) -> dict[tuple[int, str], dict[str, Any]]:
    return {(p["k"], p["prompt_class"]): p for p in points}


def add_speedups(points: list[dict[str, Any]]) -> None:
    base = {p["prompt_class"]: p["tok_s"] for p in points if p["k"] == 0 and p["tok_s"]}
    for p in points:
        b = base.get(p["prompt_class"])
        p["speedup"] = p["tok_s"] / b if b and p["tok_s"] else None


def geomean(values: list[float]) -> float | None:
    vals = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def choose(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Best k per class and overall, from points with k, prompt_class, tok_s (speedups added here)."""
    add_speedups(points)
    classes = list(dict.fromkeys(p["prompt_class"] for p in points))
    ks = sorted({p["k"] for p in points})
    cell = _by(points)
    per_class = {}
    for cls in classes:
        measured = [(cell[(k, cls)]["tok_s"], k) for k in ks if (k, cls) in cell and cell[(k, cls)]["tok_s"]]
        per_class[cls] = max(measured)[1] if measured else None
    summary = []
    for k in ks:
        row = [cell[(k, c)] for c in classes if (k, c) in cell]
        speed = [p["tok_s"] for p in row if p["tok_s"]]
        taus = [p["tau"] for p in row if p["tau"]]
        summary.append({"k": k, "mean_tok_s": sum(speed) / len(speed) if speed else None,
                        "mean_tau": sum(taus) / len(taus) if taus else None,
                        "speedup": geomean([p["speedup"] for p in row if p.get("speedup")])})
    has_base = any(s["k"] == 0 for s in summary)

    def score(s: dict[str, Any]) -> float:
        return (s["speedup"] if has_base else s["mean_tok_s"]) or 0.0

    best = max(summary, key=score)["k"] if summary else None
    spec = [s for s in summary if s["k"] > 0]
    best_spec = max(spec, key=score)["k"] if spec else None
    return {"best_k_per_class": per_class, "best_k": best, "best_speculative_k": best_spec, "by_k": summary}


def speculative_config(draft: str | None, k: int | None, method: str = "dflash") -> str | None:
    """The --speculative-config to serve the chosen k with (N drafts of the target's own MTP head)."""
    if method == "mtp" and k:
        return json.dumps({"method": "mtp", "num_speculative_tokens": k})
    if not draft or not k:
        return None
    return json.dumps({"method": "dflash", "model": str(draft), "num_speculative_tokens": k})


def _cell(p: dict[str, Any] | None) -> str:
    if p is None:
        return "-"
    return f"{fmt(p['tok_s'])}/{fmt(p['tau'], 2)}"


def table_rows(data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    points = data["points"]
    classes = list(dict.fromkeys(p["prompt_class"] for p in points))
    cell = _by(points)
    header = ["k", *classes, "mean tok/s", "mean tau", "speedup"]
    rows = []
    for s in data["by_k"]:
        k = s["k"]
        rows.append([str(k), *(_cell(cell.get((k, c))) for c in classes), fmt(s["mean_tok_s"]),
                     fmt(s["mean_tau"], 2), "-" if s["speedup"] is None else f"{s['speedup']:.2f}x"])
    return header, rows


def verdict_lines(data: dict[str, Any]) -> list[str]:
    lines = []
    per = data["best_k_per_class"]
    if per:
        lines.append("best k per class: " + ", ".join(f"{c} {k}" for c, k in per.items()))
    if data["best_k"] is not None:
        best = next(s for s in data["by_k"] if s["k"] == data["best_k"])
        gain = f" ({best['speedup']:.2f}x over autoregressive, geometric mean)" if best["speedup"] else ""
        lines.append(f"best k overall: {data['best_k']}{gain}")
    if data["best_k"] == 0 and data["best_speculative_k"]:
        lines.append(f"speculation did not beat plain decoding here; the best speculative k was "
                     f"{data['best_speculative_k']} (serve without a drafter, or train/choose a better drafter)")
    if data.get("speculative_config"):
        lines.append(f"serve with: --speculative-config '{data['speculative_config']}'")
    lines.extend(f"note: {n}" for n in data.get("notes", []))
    return lines


def format_tune_table(data: dict[str, Any]) -> str:
    head = (f"blockspec tune: {data['model']} + {data['drafter'] or 'no drafter'} ({data['mode']}, {data['device']}, "
            f"max_tokens {data['settings']['max_tokens']}, median of {data['settings']['runs']} runs; "
            f"cells: decode tok/s / tau)")
    if data.get("synthetic"):
        head += f"\nSYNTHETIC DRAFTS (acceptance {data['synthetic']['accept_prob']}): timings of the verify path only"
    header, rows = table_rows(data)
    out = [head, render_table(header, rows), *verdict_lines(data)]
    if data.get("files"):
        out.append("wrote " + ", ".join(data["files"].values()))
    return "\n".join(out)


def tune_markdown(data: dict[str, Any]) -> str:
    header, rows = table_rows(data)
    md = [f"# blockspec tune: {data['model']}", "",
          f"- drafter: {data['drafter'] or 'none'}; mode: {data['mode']}; device: {data['device']}",
          f"- date: {data['started_at']}; commit: {data.get('client_commit') or 'unknown'}",
          f"- prompts: {data['settings']['prompts']}; max_tokens {data['settings']['max_tokens']}; temperature "
          f"{data['settings']['temperature']}; median of {data['settings']['runs']} runs",
          "- cells: decode tok/s / tau (tokens committed per verify step); k = 0 is the autoregressive baseline", ""]
    if data.get("synthetic"):
        md += [f"**Synthetic drafts** (acceptance probability {data['synthetic']['accept_prob']}): the drafts are "
               "the target's own continuation corrupted at random, so this times the verify path, not a drafter.", ""]
    md += [markdown_table(header, rows), ""]
    md += [f"- {line}" for line in verdict_lines(data)] + [""]
    if data.get("files", {}).get("plot"):
        md += [f"![tok/s against k]({PNG_NAME})", ""]
    return "\n".join(md)


def write_tune_outputs(data: dict[str, Any], out_dir: Path) -> dict[str, str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    if plots_available():
        title = f"{Path(str(data['model'])).name}: decode tok/s against k"
        if plot_tok_s_vs_k(data["points"], out_dir / PNG_NAME, title):
            files["plot"] = str(out_dir / PNG_NAME)
    files["json"] = str(out_dir / JSON_NAME)
    files["markdown"] = str(out_dir / MD_NAME)
    data["files"] = files
    (out_dir / MD_NAME).write_text(tune_markdown(data))
    (out_dir / JSON_NAME).write_text(json.dumps(data, indent=1))
    return files
