"""Choosing the proposer and its k from a sweep, and writing the sweep out (table, tune.json, tune.md, plot).

Every point carries its method: "ar" (k = 0, the autoregressive baseline, measured once), "dflash" (k
drafts of a DFlash drafter) or "mtp" (N drafts of the target's own MTP head; its N is the point's k). The
best (method, k) per class is the fastest measured; the overall choice maximises the geometric mean of
the per-class speedups over the one baseline, so no single class with large absolute tok/s dominates and
both methods are judged against the same yardstick. The recommended `--speculative-config` is the best
speculative point's, even when plain decoding won, and says so: a sweep with a weak proposer should still
tell the user what to try.
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
AR = "ar"  # the method of the k = 0 points
COUNT_NAME = {"dflash": "k", "mtp": "N"}  # what each method calls its number of drafts per step


def _key(p: dict[str, Any]) -> tuple[str, int]:
    return p["method"], p["k"]


def _by(points: list[dict[str, Any]]) -> dict[tuple[str, int, str], dict[str, Any]]:
    return {(*_key(p), p["prompt_class"]): p for p in points}


def point_label(method: str, k: int) -> str:
    """'AR', 'dflash k=8', 'mtp N=2'."""
    return "AR" if method == AR else f"{method} {COUNT_NAME.get(method, 'k')}={k}"


def add_speedups(points: list[dict[str, Any]]) -> None:
    base = {p["prompt_class"]: p["tok_s"] for p in points if p["method"] == AR and p["tok_s"]}
    for p in points:
        b = base.get(p["prompt_class"])
        p["speedup"] = p["tok_s"] / b if b and p["tok_s"] else None


def geomean(values: list[float]) -> float | None:
    vals = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def point_order(points: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """(method, k) rows: the baseline first, then each method in the order it was swept, k ascending."""
    methods = list(dict.fromkeys(p["method"] for p in points))
    methods.sort(key=lambda m: m != AR)
    return sorted({_key(p) for p in points}, key=lambda mk: (methods.index(mk[0]), mk[1]))


def _pick(row: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if row is None else {"method": row["method"], "k": row["k"]}


def choose(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Best (method, k) per class and overall, from points with method, k, prompt_class, tok_s (speedups added
    here). `best_speculative` is the best point with k > 0 whatever the method; `summary` has one row per
    (method, k)."""
    add_speedups(points)
    classes = list(dict.fromkeys(p["prompt_class"] for p in points))
    order = point_order(points)
    cell = _by(points)
    per_class = {}
    for cls in classes:
        measured = [cell[(*mk, cls)] for mk in order if (*mk, cls) in cell and cell[(*mk, cls)]["tok_s"]]
        per_class[cls] = _pick(max(measured, key=lambda p: p["tok_s"])) if measured else None
    summary = []
    for method, k in order:
        row = [cell[(method, k, c)] for c in classes if (method, k, c) in cell]
        speed = [p["tok_s"] for p in row if p["tok_s"]]
        taus = [p["tau"] for p in row if p["tau"]]
        summary.append({"method": method, "k": k, "mean_tok_s": sum(speed) / len(speed) if speed else None,
                        "mean_tau": sum(taus) / len(taus) if taus else None,
                        "speedup": geomean([p["speedup"] for p in row if p.get("speedup")])})
    has_base = any(s["method"] == AR for s in summary)

    def score(s: dict[str, Any]) -> float:
        return (s["speedup"] if has_base else s["mean_tok_s"]) or 0.0

    spec = [s for s in summary if s["method"] != AR]
    return {"best_per_class": per_class, "best": _pick(max(summary, key=score) if summary else None),
            "best_speculative": _pick(max(spec, key=score) if spec else None), "summary": summary}


def speculative_config(draft: str | None, k: int | None, method: str = "dflash") -> str | None:
    """The --speculative-config (vLLM's spelling) to serve the chosen point with: N drafts of the target's own
    MTP head, or k drafts of the DFlash drafter at `draft`."""
    if method == "mtp" and k:
        return json.dumps({"method": "mtp", "num_speculative_tokens": k})
    if method != "dflash" or not draft or not k:
        return None
    return json.dumps({"method": "dflash", "model": str(draft), "num_speculative_tokens": k})


def _cell(p: dict[str, Any] | None) -> str:
    if p is None:
        return "-"
    return f"{fmt(p['tok_s'])}/{fmt(p['tau'], 2)}"


def count_header(data: dict[str, Any]) -> str:
    """The k column's name: k for DFlash, N for MTP, both where both were swept."""
    names = list(dict.fromkeys(COUNT_NAME[s["method"]] for s in data["summary"] if s["method"] in COUNT_NAME))
    return " or ".join(names) or "k"


def table_rows(data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    points = data["points"]
    classes = list(dict.fromkeys(p["prompt_class"] for p in points))
    cell = _by(points)
    header = ["method", count_header(data), *classes, "mean tok/s", "mean tau", "speedup"]
    rows = []
    for s in data["summary"]:
        m, k = s["method"], s["k"]
        rows.append([m, str(k), *(_cell(cell.get((m, k, c))) for c in classes), fmt(s["mean_tok_s"]),
                     fmt(s["mean_tau"], 2), "-" if s["speedup"] is None else f"{s['speedup']:.2f}x"])
    return header, rows


def verdict_lines(data: dict[str, Any]) -> list[str]:
    lines = []
    per = {c: pick for c, pick in data["best_per_class"].items() if pick}
    if per:
        lines.append("best per class: " + ", ".join(f"{c} {point_label(**pick)}" for c, pick in per.items()))
    best, spec = data["best"], data["best_speculative"]
    if best is not None:
        row = next(s for s in data["summary"] if _key(s) == _key(best))
        gain = f" ({row['speedup']:.2f}x over autoregressive, geometric mean)" if row["speedup"] else ""
        lines.append(f"best overall: {point_label(**best)}{gain}")
    if best is not None and best["method"] == AR and spec is not None:
        lines.append(f"speculation did not beat plain decoding here; the best speculative point was "
                     f"{point_label(**spec)} (serve without speculation, or train/choose a better drafter)")
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
          "- cells: decode tok/s / tau (tokens committed per verify step); method ar (k = 0) is the autoregressive "
          "baseline, one for every method; k counts a DFlash drafter's drafts per step, N the MTP head's", ""]
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
        title = f"{Path(str(data['model'])).name}: decode tok/s against {count_header(data)}"
        if plot_tok_s_vs_k(data["points"], out_dir / PNG_NAME, title):
            files["plot"] = str(out_dir / PNG_NAME)
    files["json"] = str(out_dir / JSON_NAME)
    files["markdown"] = str(out_dir / MD_NAME)
    data["files"] = files
    (out_dir / MD_NAME).write_text(tune_markdown(data))
    (out_dir / JSON_NAME).write_text(json.dumps(data, indent=1))
    return files
