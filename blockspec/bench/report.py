"""Bench reports: the terminal table, results.json, report.md and the PNG plots.

The JSON holds everything (settings, every row, every request) so runs can be compared later; the
Markdown is what gets pasted into an issue; the table is what the terminal shows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from blockspec.bench.plots import plot_acceptance, plot_tok_s_vs_concurrency, plots_available

JSON_NAME = "results.json"
MD_NAME = "report.md"
PNG_CONCURRENCY = "tok_s_vs_concurrency.png"
PNG_ACCEPTANCE = "acceptance_per_position.png"


def fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def render_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.rjust(w) for h, w in zip(header, widths))
    body = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join([line, "  ".join("-" * w for w in widths), *body])


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


SUMMARY_HEADER = ["class", "conc", "req", "err", "tok/s/req", "agg tok/s", "TTFT p50", "TTFT p95", "TPOT p50",
                  "TPOT p95", "ITL p50", "ITL p99", "E2E p50", "tau", "cache hit"]


def summary_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    out = []
    for r in rows:
        spec = r.get("spec") or {}
        out.append([r["prompt_class"], str(r["concurrency"]), str(r["requests"]), str(r["errors"]),
                    fmt(r["tok_s_per_request"]), fmt(r["aggregate_tok_s"]),
                    fmt(r["ttft_ms"]["p50"], 0), fmt(r["ttft_ms"]["p95"], 0),
                    fmt(r["tpot_ms"]["p50"]), fmt(r["tpot_ms"]["p95"]),
                    fmt(r["itl_ms"]["p50"]), fmt(r["itl_ms"]["p99"]), fmt(r["e2e_ms"]["p50"], 0),
                    fmt(spec.get("tau"), 2), pct(r.get("prefix_cache_hit_rate"))])
    return out


def format_bench_table(data: dict[str, Any]) -> str:
    head = (f"blockspec bench: {data['model']} at {data['base_url']} ({data['settings']['endpoint']}, "
            f"max_tokens {data['settings']['max_tokens']}, T={data['settings']['temperature']}, "
            f"median of {data['settings']['runs']} runs; times in ms)")
    lines = [head, render_table(SUMMARY_HEADER, summary_rows(data["results"]))]
    sources = {r["spec"]["source"] for r in data["results"] if r.get("spec")}
    lines.append(f"tau source: {', '.join(sorted(sources))}" if sources else
                 "tau: the server reported no speculative-decoding statistics")
    cache = {r["prefix_cache_source"] for r in data["results"] if r.get("prefix_cache_source")}
    lines.append(f"cache hit source: {', '.join(sorted(cache))}" if cache else
                 "cache hit: the server reported no prefix-cache statistics")
    errors = [e for r in data["results"] for e in r["error_examples"]]
    if errors:
        lines.append(f"errors, e.g.: {errors[0]}")
    if data.get("files"):
        lines.append("wrote " + ", ".join(data["files"].values()))
    return "\n".join(lines)


def bench_markdown(data: dict[str, Any]) -> str:
    s = data["settings"]
    rows = data["results"]
    md = [f"# blockspec bench: {data['model']}", "",
          f"- server: `{data['base_url']}` ({s['endpoint']} endpoint)",
          f"- date: {data['started_at']}; client commit: {data.get('client_commit') or 'unknown'}",
          f"- prompts: {s['prompts']}; max_tokens {s['max_tokens']}; temperature {s['temperature']}; "
          f"ignore_eos {s['ignore_eos']}",
          f"- concurrency {', '.join(map(str, s['concurrency']))}; {s['warmup']} warm-up requests; "
          f"median of {s['runs']} runs per cell",
          "- tok/s/req: output tokens / end-to-end time of each request (median); agg tok/s: all output tokens "
          "/ wall time of the run; TTFT/TPOT/ITL/E2E in ms over every request; cache hit: prompt tokens found "
          "in the server's prefix cache / prompt tokens", "",
          "## Summary", "", markdown_table(SUMMARY_HEADER, summary_rows(rows)), ""]
    low = min((r["concurrency"] for r in rows), default=None)
    per_prompt = [(r["prompt_class"], pid, v) for r in rows if r["concurrency"] == low
                  for pid, v in r["per_prompt"].items()]
    if per_prompt:
        md += [f"## Per prompt at concurrency {low}", "",
               markdown_table(["class", "prompt", "tok/s", "output tokens", "tau"],
                              [[c, p, fmt(v["tok_s"]), fmt(v["output_tokens"], 0), fmt(v["tau"], 2)]
                               for c, p, v in per_prompt]), ""]
    spec_rows = [r for r in rows if r.get("spec") and r["spec"]["acceptance_per_position"]]
    if spec_rows:
        width = max(len(r["spec"]["acceptance_per_position"]) for r in spec_rows)
        md += ["## Acceptance per draft position", "",
               markdown_table(["class", "conc", "tau", "source"] + [str(i + 1) for i in range(width)],
                              [[r["prompt_class"], str(r["concurrency"]), fmt(r["spec"]["tau"], 2),
                                r["spec"]["source"]] + [fmt(a, 3) for a in r["spec"]["acceptance_per_position"]]
                               + [""] * (width - len(r["spec"]["acceptance_per_position"])) for r in spec_rows]), ""]
    else:
        md += ["No per-position acceptance was reported (no speculative decoding, or the server gives none).", ""]
    errs = [(r["prompt_class"], r["concurrency"], e) for r in rows for e in r["error_examples"]]
    if errs:
        md += ["## Errors", ""] + [f"- {c} @ {n}: `{e}`" for c, n, e in errs] + [""]
    pngs = [f for f in (data.get("files") or {}).values() if f.endswith(".png")]
    if pngs:
        md += ["## Plots", ""] + [f"![{Path(f).stem}]({Path(f).name})" for f in pngs] + [""]
    return "\n".join(md)


def write_bench_outputs(data: dict[str, Any], out_dir: Path) -> dict[str, str]:
    """Write results.json, report.md and the plots into out_dir; returns {kind: path}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    if plots_available():
        title = f"{data['model']}: output tok/s"
        if plot_tok_s_vs_concurrency(data["results"], out_dir / PNG_CONCURRENCY, title):
            files["plot_concurrency"] = str(out_dir / PNG_CONCURRENCY)
        if plot_acceptance(data["results"], out_dir / PNG_ACCEPTANCE, f"{data['model']}: acceptance per position"):
            files["plot_acceptance"] = str(out_dir / PNG_ACCEPTANCE)
    else:
        data.setdefault("notes", []).append("matplotlib is not installed: no PNG plots (pip install matplotlib)")
    files["json"] = str(out_dir / JSON_NAME)
    files["markdown"] = str(out_dir / MD_NAME)
    data["files"] = files
    (out_dir / MD_NAME).write_text(bench_markdown(data))
    (out_dir / JSON_NAME).write_text(json.dumps(data, indent=1))
    return files
