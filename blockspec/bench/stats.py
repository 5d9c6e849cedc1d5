"""Turning timed requests into the numbers users compare: percentiles, medians of runs, tau.

Per (prompt class, concurrency) cell: speeds are computed per run and the median of the runs is
reported (runs after warm-up differ, seeds 004); latency percentiles pool every request of every run.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from blockspec.bench.client import RequestResult, SpecStats


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution_ms(values_s: list[float]) -> dict[str, float | None]:
    ms = [v * 1000 for v in values_s]
    return {"p50": percentile(ms, 50), "p95": percentile(ms, 95), "p99": percentile(ms, 99),
            "mean": statistics.fmean(ms) if ms else None}


def median(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


@dataclass
class RunResult:
    """One run: every request of one prompt class at one concurrency, and what /metrics said about it."""

    prompt_class: str
    concurrency: int
    index: int
    wall_s: float
    results: list[RequestResult]
    metrics_spec: SpecStats | None = None
    metrics_cache: dict[str, float] | None = None  # prefix-cache {queries, hits} deltas from /metrics
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def aggregate_tok_s(self) -> float | None:
        tokens = sum(r.output_tokens for r in self.ok)
        return tokens / self.wall_s if self.wall_s > 0 and tokens else None

    @property
    def tok_s_per_request(self) -> float | None:
        return median([r.tok_s for r in self.ok])


def combined_spec(runs: list[RunResult]) -> SpecStats | None:
    """Response statistics when the server gives them per request, else the /metrics deltas."""
    total = SpecStats()
    for run in runs:
        for r in run.ok:
            if r.spec is not None and r.spec.steps:
                total.add(r.spec)
    if total.steps:
        return total
    for run in runs:
        if run.metrics_spec is not None:
            total.add(run.metrics_spec)
    return total if total.steps else None


def prefix_cache_hit_rate(runs: list[RunResult]) -> tuple[float | None, str | None]:
    """(cached prompt tokens / prompt tokens, where it came from): from the responses' usage when every
    request reported cached_tokens, else from the /metrics deltas; (None, None) when neither says."""
    ok = [r for run in runs for r in run.ok]
    if ok and all(r.cached_tokens is not None and r.prompt_tokens for r in ok):
        return sum(r.cached_tokens for r in ok) / sum(r.prompt_tokens for r in ok), "response"
    counted = [run.metrics_cache for run in runs if run.metrics_cache]
    if counted:
        return sum(c["hits"] for c in counted) / sum(c["queries"] for c in counted), "metrics"
    return None, None


def spec_dict(spec: SpecStats | None) -> dict[str, Any] | None:
    if spec is None:
        return None
    return {"tau": spec.tau, "steps": spec.steps, "draft_tokens": spec.draft_tokens,
            "accepted_per_position": spec.accepted_per_position,
            "acceptance_per_position": spec.acceptance_rates(), "source": spec.source}


def summarize(runs: list[RunResult]) -> dict[str, Any]:
    """One row of the report: a prompt class at a concurrency, over all its runs."""
    first = runs[0]
    results = [r for run in runs for r in run.results]
    ok = [r for r in results if r.ok]
    per_prompt: dict[str, dict[str, Any]] = {}
    for pid in dict.fromkeys(r.prompt_id for r in ok):
        mine = [r for r in ok if r.prompt_id == pid]
        spec = SpecStats()
        for r in mine:
            if r.spec is not None:
                spec.add(r.spec)
        per_prompt[pid] = {"tok_s": median([r.tok_s for r in mine]), "output_tokens": median(
            [r.output_tokens for r in mine]), "tau": spec.tau}
    errors = [r.error for r in results if not r.ok]
    hit_rate, hit_source = prefix_cache_hit_rate(runs)
    return {
        "prompt_class": first.prompt_class,
        "concurrency": first.concurrency,
        "runs": len(runs),
        "requests": len(results),
        "errors": len(errors),
        "error_examples": list(dict.fromkeys(errors))[:3],
        "output_tokens": sum(r.output_tokens for r in ok),
        "tokens_from_usage": all(r.tokens_from_usage for r in ok) if ok else None,
        "tok_s_per_request": median([run.tok_s_per_request for run in runs]),
        "tok_s_per_request_runs": [run.tok_s_per_request for run in runs],
        "aggregate_tok_s": median([run.aggregate_tok_s for run in runs]),
        "aggregate_tok_s_runs": [run.aggregate_tok_s for run in runs],
        "decode_tok_s": median([r.decode_tok_s for r in ok]),
        "ttft_ms": distribution_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": distribution_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": distribution_ms([g for r in ok for g in r.itl]),
        "e2e_ms": distribution_ms([r.e2e for r in ok]),
        "spec": spec_dict(combined_spec(runs)),
        "prefix_cache_hit_rate": hit_rate,
        "prefix_cache_source": hit_source,
        "per_prompt": per_prompt,
    }
