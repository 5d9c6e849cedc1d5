"""`blockspec bench`: one command from server URL to table, JSON, Markdown and plots.

Order of work: discover the model, warm up, then for each prompt class and concurrency run the
requests `--runs` times, scraping /metrics around every run so tau is known even when responses
carry no statistics. A class x concurrency cell is reported as the median of its runs.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from blockspec.bench.client import RequestOptions, RequestResult, api_root, stream_request
from blockspec.bench.loadgen import run_block
from blockspec.bench.metrics import scrape
from blockspec.bench.prompts import DEFAULT_CLASSES, Prompt, load_prompt_sets
from blockspec.bench.report import format_bench_table, write_bench_outputs
from blockspec.bench.stats import RunResult, summarize
from blockspec.errors import BlockspecError, ConfigError

API_KEY_ENV = ("VLLM_API_KEY", "BLOCKSPEC_API_KEY", "OPENAI_API_KEY")


@dataclass
class BenchSettings:
    base_url: str
    api_key: str | None = None
    model: str | None = None
    prompts: str = DEFAULT_CLASSES
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 8, 16])
    max_tokens: int = 256
    runs: int = 3
    warmup: int = 3
    temperature: float = 0.0
    endpoint: str = "chat"
    ignore_eos: bool = False
    meta_info: bool = True
    requests_per_run: int | None = None  # default: max(prompts in the class, concurrency)
    timeout_s: float = 600.0


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"need non-negative integers: {text!r}")
    return values


def client_commit() -> str | None:
    """The blockspec checkout's commit, recorded with every result (DESIGN.md section 4)."""
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def discover_model(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> tuple[str, Any]:
    """The first model the server lists (and the raw listing, kept in the results)."""
    url = api_root(base_url) + "/v1/models"
    try:
        resp = await client.get(url, headers=headers, timeout=30.0)
    except (httpx.HTTPError, OSError) as exc:
        raise BlockspecError(f"cannot reach {url} ({type(exc).__name__}: {exc}): is the server running "
                             "and is --base-url right?") from None
    if resp.status_code == 401:
        raise BlockspecError(f"{url} answered 401 Unauthorized: pass --api-key")
    if resp.status_code != 200:
        raise BlockspecError(f"{url} answered HTTP {resp.status_code}: pass --model NAME")
    listing = resp.json()
    models = [m.get("id") for m in listing.get("data", []) if m.get("id")]
    if not models:
        raise BlockspecError(f"{url} lists no models: pass --model NAME")
    return models[0], listing


class Progress:
    """A tqdm bar on stderr (or nothing when quiet)."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.bar = None
        if not quiet:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)

    def label(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_description(text)

    def done(self, res: RequestResult) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if res.tok_s:
                self.bar.set_postfix_str(f"{res.tok_s:.1f} tok/s" + (f", tau {res.spec.tau:.2f}"
                                                                       if res.spec and res.spec.tau else ""))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def requests_for(prompts: list[Prompt], concurrency: int, override: int | None) -> int:
    return override or max(len(prompts), concurrency)


async def run_sequential(client: httpx.AsyncClient, s: BenchSettings, opts: RequestOptions,
                         headers: dict[str, str], queue: list[Prompt], progress: Progress
                         ) -> tuple[list[RequestResult], float]:
    """Concurrency 1 with a /metrics scrape around every request, so each prompt gets its own tau
    even from servers whose responses carry no statistics. Wall time excludes the scrapes."""
    results = []
    for prompt in queue:
        before = await scrape(client, s.base_url, headers)
        res = await stream_request(client, s.base_url, prompt, opts, headers)
        if res.spec is None and before is not None:
            after = await scrape(client, s.base_url, headers)
            res.spec = after.minus(before).to_spec() if after is not None else None
        progress.done(res)
        results.append(res)
    return results, sum(r.e2e for r in results)


async def run_cell(client: httpx.AsyncClient, s: BenchSettings, opts: RequestOptions, headers: dict[str, str],
                   cls: str, prompts: list[Prompt], concurrency: int, progress: Progress) -> list[RunResult]:
    """All runs of one prompt class at one concurrency, each bracketed by /metrics scrapes."""
    runs = []
    n = requests_for(prompts, concurrency, s.requests_per_run)
    for i in range(s.runs):
        progress.label(f"{cls} c={concurrency} run {i + 1}/{s.runs}")
        before = await scrape(client, s.base_url, headers)
        if concurrency == 1 and before is not None:
            queue = [prompts[j % len(prompts)] for j in range(n)]
            results, wall = await run_sequential(client, s, opts, headers, queue, progress)
        else:
            results, wall = await run_block(client, s.base_url, prompts, n, concurrency, opts, headers,
                                            progress.done)
        after = await scrape(client, s.base_url, headers)
        delta = after.minus(before) if before is not None and after is not None else None
        runs.append(RunResult(cls, concurrency, i, wall, results, delta.to_spec() if delta else None,
                              metrics_cache=delta.prefix_cache() if delta else None))
    return runs


async def run_bench(s: BenchSettings, quiet: bool = False) -> dict[str, Any]:
    """Run the whole benchmark; returns the results document (not yet written anywhere)."""
    sets = load_prompt_sets(s.prompts)
    if s.runs < 1:
        raise ConfigError("--runs must be at least 1")
    if not s.concurrency or min(s.concurrency) < 1:
        raise ConfigError("--concurrency values must be at least 1")
    headers = auth_headers(s.api_key)
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    limits = httpx.Limits(max_connections=max(s.concurrency) + 4, max_keepalive_connections=max(s.concurrency) + 4)
    async with httpx.AsyncClient(limits=limits, timeout=s.timeout_s) as client:
        listing = None
        model = s.model
        if model is None:
            model, listing = await discover_model(client, s.base_url, headers)
        opts = RequestOptions(model=model, endpoint=s.endpoint, max_tokens=s.max_tokens, temperature=s.temperature,
                              ignore_eos=s.ignore_eos, meta_info=s.meta_info, timeout_s=s.timeout_s)
        all_prompts = [p for ps in sets.values() for p in ps]
        warm = []
        for i in range(s.warmup):
            warm.append(await stream_request(client, s.base_url, all_prompts[i % len(all_prompts)], opts, headers))
        if warm and not any(r.ok for r in warm):
            raise BlockspecError(f"every warm-up request failed, e.g. {warm[0].error}")
        total = sum(s.runs * requests_for(ps, c, s.requests_per_run) for ps in sets.values() for c in s.concurrency)
        progress = Progress(total, quiet)
        runs: list[list[RunResult]] = []
        try:
            for cls, prompts in sets.items():
                for c in s.concurrency:
                    runs.append(await run_cell(client, s, opts, headers, cls, prompts, c, progress))
        finally:
            progress.close()
    settings = asdict(s)
    settings.pop("api_key")
    return {
        "tool": "blockspec bench",
        "started_at": started,
        "base_url": s.base_url,
        "model": model,
        "client_commit": client_commit(),
        "settings": settings,
        "server_models": listing,
        "warmup_errors": [r.error for r in warm if not r.ok],
        "results": [summarize(cell) for cell in runs],
        "raw": [{"prompt_class": run.prompt_class, "concurrency": run.concurrency, "run": run.index,
                 "wall_s": run.wall_s, "metrics_spec": None if run.metrics_spec is None else
                 {"steps": run.metrics_spec.steps, "accepted_per_position": run.metrics_spec.accepted_per_position},
                 "requests": [r.to_dict() for r in run.results]} for cell in runs for run in cell],
    }


def default_out_dir(kind: str) -> Path:
    return Path(f"{kind}-results") / dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark any OpenAI-compatible server (blockspec, vLLM, SGLang, llama.cpp)",
                       description="Stream requests per prompt class and concurrency; report TTFT, TPOT, ITL, "
                                   "end-to-end latency, tok/s, errors and speculative acceptance; write JSON, "
                                   "Markdown and PNG plots. Exit status 1 when any request failed.")
    p.add_argument("--base-url", required=True, help="server URL, e.g. http://localhost:8000 (a /v1 suffix is fine)")
    p.add_argument("--api-key", default=None,
                   help="bearer token (default: $VLLM_API_KEY, $BLOCKSPEC_API_KEY or $OPENAI_API_KEY)")
    p.add_argument("--model", default=None, help="model name to request (default: the first in /v1/models)")
    p.add_argument("--prompts", default=DEFAULT_CLASSES,
                   help="comma-separated: code, reasoning, dialogue, prose, json, humaneval, FILE.jsonl; "
                        "NAME:N keeps the first N prompts")
    p.add_argument("--concurrency", type=int_list, default=[1, 4, 8, 16], help="e.g. 1,4,8,16")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--runs", type=int, default=3, help="runs per class and concurrency (the median is reported)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up requests before measuring")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly --max-tokens tokens (vLLM extension)")
    p.add_argument("--no-meta-info", action="store_true", help="do not send return_meta_info")
    p.add_argument("--requests-per-run", type=int, default=None,
                   help="requests per run (default: max(prompts in the class, concurrency))")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: bench-results/DATE-TIME)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=cmd_bench)


def quiet_http_logs() -> None:
    """httpx logs every request at INFO, which the CLI enables; the progress bar says enough."""
    logging.getLogger("httpx").setLevel(logging.WARNING)


def cmd_bench(args: argparse.Namespace) -> int:
    quiet_http_logs()
    key = args.api_key or next((os.environ[v] for v in API_KEY_ENV if os.environ.get(v)), None)
    s = BenchSettings(base_url=args.base_url, api_key=key, model=args.model, prompts=args.prompts,
                      concurrency=args.concurrency, max_tokens=args.max_tokens, runs=args.runs, warmup=args.warmup,
                      temperature=args.temperature, endpoint=args.endpoint, ignore_eos=args.ignore_eos,
                      meta_info=not args.no_meta_info, requests_per_run=args.requests_per_run, timeout_s=args.timeout)
    data = asyncio.run(run_bench(s, quiet=args.quiet or args.json))
    write_bench_outputs(data, args.out or default_out_dir("bench"))
    if args.json:
        summary = {k: v for k, v in data.items() if k != "raw"}
        print(json.dumps(summary))
    else:
        print(format_bench_table(data))
    return 0 if all(r["errors"] == 0 for r in data["results"]) else 1
