"""PNG plots for bench and tune reports (matplotlib, headless).

matplotlib is optional: without it the reports are written without plots and say so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plots_available() -> bool:
    return _pyplot() is not None


def _finish(plt, fig, ax, path: Path, empty_note: str | None) -> None:
    if empty_note:
        ax.text(0.5, 0.5, empty_note, ha="center", va="center", transform=ax.transAxes, wrap=True)
    elif ax.get_legend_handles_labels()[0]:
        ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tok_s_vs_concurrency(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    """Aggregate (solid) and per-request (dashed) output tok/s against concurrency, one colour per class."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    classes = list(dict.fromkeys(r["prompt_class"] for r in rows))
    for i, cls in enumerate(classes):
        mine = sorted((r for r in rows if r["prompt_class"] == cls), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in mine]
        color = f"C{i % 10}"
        ax.plot(xs, [r["aggregate_tok_s"] or 0 for r in mine], "o-", color=color, label=f"{cls} aggregate")
        ax.plot(xs, [r["tok_s_per_request"] or 0 for r in mine], "s--", color=color, alpha=0.7,
                label=f"{cls} per request")
    concs = sorted({r["concurrency"] for r in rows})
    if len(concs) > 1 and concs[-1] / max(concs[0], 1) >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(concs, [str(c) for c in concs])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tok/s")
    ax.set_title(title)
    _finish(plt, fig, ax, path, None if rows else "no results")
    return True


def plot_acceptance(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    """Acceptance rate per draft position, one line per prompt class (lowest concurrency measured)."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = 0
    for i, cls in enumerate(dict.fromkeys(r["prompt_class"] for r in rows)):
        mine = sorted((r for r in rows if r["prompt_class"] == cls and r.get("spec")), key=lambda r: r["concurrency"])
        rates = mine[0]["spec"]["acceptance_per_position"] if mine else []
        if not rates:
            continue
        tau = mine[0]["spec"]["tau"]
        ax.plot(range(1, len(rates) + 1), rates, "o-", color=f"C{i % 10}",
                label=f"{cls} (tau {tau:.2f}, c={mine[0]['concurrency']})")
        drawn += 1
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    note = None if drawn else ("no per-position acceptance reported\n(no speculative decoding, or a server "
                               "without per-position statistics)")
    _finish(plt, fig, ax, path, note)
    return True


def plot_tok_s_vs_k(points: list[dict[str, Any]], path: Path, title: str) -> bool:
    """Tune: tok/s against k (or MTP's N) per prompt class, one colour per class and one line style per method;
    every method's line starts at the autoregressive baseline (method "ar", k = 0)."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    classes = list(dict.fromkeys(p["prompt_class"] for p in points))
    methods = list(dict.fromkeys(p["method"] for p in points if p["method"] != "ar")) or ["ar"]
    for i, cls in enumerate(classes):
        base = [p for p in points if p["prompt_class"] == cls and p["method"] == "ar" and p["tok_s"]]
        for j, method in enumerate(methods):
            mine = sorted((p for p in points if p["prompt_class"] == cls and p["method"] == method and p["tok_s"]
                           and method != "ar"), key=lambda p: p["k"])
            mine = base + mine
            label = cls if len(methods) == 1 else f"{cls} ({method})"
            ax.plot([p["k"] for p in mine], [p["tok_s"] for p in mine], "o" + ("-", "--", ":", "-.")[j % 4],
                    color=f"C{i % 10}", label=label)
    ks = sorted({p["k"] for p in points})
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("k (num_speculative_tokens; MTP's N; 0 = autoregressive)")
    ax.set_ylabel("decode tok/s")
    ax.set_title(title)
    _finish(plt, fig, ax, path, None if points else "no results")
    return True
