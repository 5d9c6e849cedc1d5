"""`blockspec tune`: sweep k per prompt class against the autoregressive baseline and pick k.

In-process mode builds one engine with the largest k, then switches k between sweeps (k = 0 takes
the drafter out of the step entirely, so the baseline pays no drafting cost). With --method mtp the
proposer is the target's own MTP head and k is its number of drafts N, swept the same way. Requests run one at a
time (the conc=1 regime the choice of k matters for); each cell is the median of its runs.
Against --base-url the server's k is fixed at start-up, so one call measures one k and merges it
into the sweep already in --out: restart the server with each k and call tune again.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blockspec.bench.bench_cmd import (
    BenchSettings,
    client_commit,
    default_out_dir,
    int_list,
    quiet_http_logs,
    run_bench,
)
from blockspec.bench.prompts import DEFAULT_CLASSES, Prompt, load_prompt_sets
from blockspec.bench.stats import median
from blockspec.bench.tune_report import JSON_NAME, choose, format_tune_table, speculative_config, write_tune_outputs
from blockspec.errors import ConfigError

DEFAULT_KS = [4, 6, 8, 10, 12, 15]
DEFAULT_MTP_NS = [1, 2, 3, 4]  # MTP heads are trained for one step ahead: acceptance falls fast with N


@dataclass
class TuneSettings:
    model: str | None = None
    draft: str | None = None
    method: str = "dflash"  # dflash (--draft DIR) | mtp (the target's own MTP head)
    ks: list[int] = field(default_factory=lambda: list(DEFAULT_KS))
    prompts: str = DEFAULT_CLASSES
    max_tokens: int = 256
    runs: int = 3
    warmup: int = 1
    temperature: float = 0.0
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    load_format: str = "auto"
    deterministic: bool = False  # --deterministic: batch-invariant kernels (models/deterministic.py)
    synthetic_accept: float | None = None  # drafts from the target's own output (clearly labelled)
    base_url: str | None = None
    api_key: str | None = None
    server_model: str | None = None


class EngineSweep:
    """Runs prompts one at a time through an in-process engine and records each request's stats."""

    def __init__(self, s: TuneSettings, max_k: int) -> None:
        from blockspec.config import EngineConfig, SpeculativeConfig
        from blockspec.engine.engine import Engine

        proposes = s.draft is not None or s.method == "mtp"
        spec = SpeculativeConfig(model=s.draft, num_speculative_tokens=max_k if proposes and max_k else None,
                                 method=s.method)
        self.engine = Engine(EngineConfig(model=s.model, speculative=spec, device=s.device, dtype=s.dtype,
                                          max_model_len=s.max_model_len, max_num_seqs=1,
                                          gpu_memory_utilization=s.gpu_memory_utilization,
                                          load_format=s.load_format, deterministic=s.deterministic))
        self.settings = s
        self.references: dict[str, list[int]] = {}  # prompt id -> greedy AR output (synthetic mode)
        self.counter = 0

    def text(self, prompt: Prompt) -> str:
        eng = self.engine
        if prompt.text is None and getattr(eng.tokenizer, "chat_template", None):
            return eng.apply_chat_template(prompt.messages)
        return prompt.completion_text()

    def use_k(self, k: int) -> None:
        eng, s = self.engine, self.settings
        if s.synthetic_accept is not None and k:
            eng.enable_synthetic_drafts({}, s.synthetic_accept, k)
        else:
            eng.set_num_speculative_tokens(k)

    def run(self, prompt: Prompt) -> dict[str, Any]:
        from blockspec.engine.sampling_params import SamplingParams

        eng, s = self.engine, self.settings
        self.counter += 1
        rid = f"tune-{self.counter}"
        if eng.synthetic is not None:
            eng.synthetic.references[rid] = self.references.get(prompt.id, [])
        params = SamplingParams(max_tokens=prompt.max_tokens or s.max_tokens, temperature=s.temperature, seed=0)
        eng.add_request(rid, self.text(prompt), params)
        final = None
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished and out.request_id == rid:
                    final = out
        if final is None:
            raise ConfigError(f"the engine did not finish request for prompt {prompt.id}")
        if eng.num_speculative_tokens == 0 and s.synthetic_accept is not None:
            self.references.setdefault(prompt.id, list(final.token_ids))
        st = final.stats
        return {"prompt_id": prompt.id, "decode_tok_s": st.decode_tok_s or None, "steps": st.steps,
                "decode_tokens": st.decode_tokens, "accepted_per_position": list(st.accepted_per_position),
                "completion_tokens": st.completion_tokens}


def point_from_requests(k: int, cls: str, runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One (k, class) cell: median over runs of the per-run median decode tok/s; tau over everything."""
    reqs = [r for run in runs for r in run]
    steps = sum(r["steps"] for r in reqs)
    width = max((len(r["accepted_per_position"]) for r in reqs), default=0)
    accepted = [sum(r["accepted_per_position"][i] for r in reqs if i < len(r["accepted_per_position"]))
                for i in range(width)]
    return {"k": k, "prompt_class": cls,
            "tok_s": median([median([r["decode_tok_s"] for r in run]) for run in runs]),
            "tok_s_runs": [median([r["decode_tok_s"] for r in run]) for run in runs],
            "tau": sum(r["decode_tokens"] for r in reqs) / steps if steps else None,
            "acceptance_per_position": [a / steps for a in accepted] if steps else [],
            "requests": len(reqs), "mean_output_tokens": sum(r["completion_tokens"] for r in reqs) / max(len(reqs), 1)}


def sweep_in_process(s: TuneSettings, sets: dict[str, list[Prompt]], notes: list[str],
                     quiet: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    ks = sorted({k for k in s.ks if k > 0})
    block = None
    if s.method == "mtp":
        from blockspec.spec.mtp import MAX_DRAFTS

        dropped = [k for k in ks if k > MAX_DRAFTS]
        if dropped:
            notes.append(f"N {', '.join(map(str, dropped))} skipped: at most {MAX_DRAFTS} MTP drafts per step")
        ks = [k for k in ks if k <= MAX_DRAFTS]
    elif s.draft:
        from blockspec.spec.dflash import DrafterConfig

        block = DrafterConfig.from_dir(Path(s.draft)).block_size
        dropped = [k for k in ks if k > block - 1]
        if dropped:
            notes.append(f"k {', '.join(map(str, dropped))} skipped: the drafter's block_size is {block} "
                         f"(k <= {block - 1})")
        ks = [k for k in ks if k <= block - 1]
    elif s.synthetic_accept is None:
        notes.append("no drafter given: measured the autoregressive baseline (k = 0) only; pass --draft DIR "
                     "(a DFlash checkpoint) to sweep k")
        ks = []
    if s.synthetic_accept is not None:
        if s.temperature != 0:
            raise ConfigError("--synthetic-accept needs --temperature 0 (drafts follow the greedy output)")
        notes.append(f"SYNTHETIC drafts: the target's own greedy continuation, each draft kept with probability "
                     f"{s.synthetic_accept}; tok/s shows what the verify path would give at that acceptance, "
                     "not what a real drafter gives")
    sweep = EngineSweep(s, max(ks, default=0))
    eng = sweep.engine
    ks_all = [0, *ks]
    total = len(ks_all) * s.runs * sum(len(p) for p in sets.values())
    bar = None
    if not quiet:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)
    points = []
    try:
        for k in ks_all:
            sweep.use_k(k)
            first = next(iter(sets.values()))[0]
            for _ in range(s.warmup):
                sweep.run(first)
            for cls, prompts in sets.items():
                runs = []
                for r in range(s.runs):
                    if bar is not None:
                        bar.set_description(f"k={k} {cls} run {r + 1}/{s.runs}")
                    run = []
                    for p in prompts:
                        run.append(sweep.run(p))
                        if bar is not None:
                            bar.update(1)
                    runs.append(run)
                points.append(point_from_requests(k, cls, runs))
    finally:
        if bar is not None:
            bar.close()
    env = {"device": f"{eng.device.type} {str(eng.dtype).removeprefix('torch.')}", "model_path": str(eng.model_dir),
           "block_size": block}
    return points, env


def sweep_remote(s: TuneSettings, sets: dict[str, list[Prompt]], quiet: bool) -> list[dict[str, Any]]:
    """Measure the server's current configuration as the single k given with --k."""
    if len(s.ks) != 1:
        raise ConfigError("with --base-url, tune measures the k the server runs: pass exactly one --k (0 for a "
                          "server without a drafter) and call again after restarting the server with the next k")
    quiet_http_logs()
    bench = BenchSettings(base_url=s.base_url, api_key=s.api_key, model=s.server_model, prompts=s.prompts,
                          concurrency=[1], max_tokens=s.max_tokens, runs=s.runs, warmup=s.warmup,
                          temperature=s.temperature)
    data = asyncio.run(run_bench(bench, quiet=quiet))
    points = []
    k = s.ks[0]
    for row in data["results"]:
        spec = row.get("spec") or {}
        points.append({"k": k, "prompt_class": row["prompt_class"], "tok_s": row["decode_tok_s"],
                       "tau": spec.get("tau") or (1.0 if k == 0 else None),
                       "acceptance_per_position": spec.get("acceptance_per_position") or [],
                       "requests": row["requests"], "errors": row["errors"], "model": data["model"]})
    return points


def merge_points(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier base-url points plus this call's (which replace any of the same k and class)."""
    keep = {(p["k"], p["prompt_class"]): p for p in old}
    keep.update({(p["k"], p["prompt_class"]): p for p in new})
    order = list(dict.fromkeys(p["prompt_class"] for p in [*old, *new]))
    return sorted(keep.values(), key=lambda p: (p["k"], order.index(p["prompt_class"])))


def run_tune(s: TuneSettings, out_dir: Path | None = None, quiet: bool = False) -> dict[str, Any]:
    """The whole sweep; returns the results document (written by the caller)."""
    if s.runs < 1:
        raise ConfigError("--runs must be at least 1")
    sets = load_prompt_sets(s.prompts)
    notes: list[str] = []
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    if s.base_url:
        if s.deterministic:
            raise ConfigError("--deterministic sets the in-process engine's kernels; with --base-url the server's mode "
                              "is fixed at its start: start it with `blockspec serve --deterministic`")
        points = sweep_remote(s, sets, quiet)
        previous = out_dir / JSON_NAME if out_dir is not None else None
        if previous is not None and previous.is_file():
            points = merge_points(json.loads(previous.read_text()).get("points", []), points)
            notes.append(f"merged with the earlier points in {previous}")
        mode, env = "base-url", {"device": s.base_url, "model_path": points[0].get("model") if points else None}
    else:
        points, env = sweep_in_process(s, sets, notes, quiet)
        mode = "in-process"
    chosen = choose(points)
    spec_k = chosen["best_k"] or chosen["best_speculative_k"]
    config = speculative_config(s.draft, spec_k, s.method) if s.synthetic_accept is None else None
    if s.draft is None and s.method != "mtp" and spec_k and s.base_url:
        notes.append("pass --draft DIR to have the --speculative-config line printed with the drafter path")
    settings = {k: v for k, v in vars(s).items() if k != "api_key"}
    return {"tool": "blockspec tune", "started_at": started, "client_commit": client_commit(), "mode": mode,
            "model": s.model or s.server_model or env.get("model_path") or "embedded default",
            "drafter": "the target's MTP head" if s.method == "mtp" else s.draft, "method": s.method,
            "device": env["device"], "settings": settings,
            "synthetic": None if s.synthetic_accept is None else {"accept_prob": s.synthetic_accept},
            "points": points, **chosen, "speculative_config": config, "notes": notes}


def add_tune_parser(sub: argparse._SubParsersAction) -> None:
    from blockspec.cli import add_deterministic_arg  # cli imports the bench parsers

    p = sub.add_parser("tune", help="sweep k per prompt class against the autoregressive baseline",
                       description="Run the engine in-process (or measure a server with --base-url), sweep "
                                   "num_speculative_tokens per prompt class with k = 0 as the baseline, report tau, "
                                   "tok/s and speedup, and print the --speculative-config to serve with.")
    p.add_argument("--model", default=None, help="HF model directory or .gguf (default: the embedded model)")
    p.add_argument("--draft", default=None, help="DFlash drafter directory (DFlash 1 or 2)")
    p.add_argument("--method", choices=("dflash", "mtp"), default="dflash",
                   help="mtp: draft with the target checkpoint's own MTP head (Qwen3-Next, Qwen3.5/3.6), sweeping "
                        "its N drafts per step as k")
    p.add_argument("--k", type=int_list, default=None,
                   help=f"k values to sweep (default {','.join(map(str, DEFAULT_KS))}; for --method mtp, N: "
                        f"{','.join(map(str, DEFAULT_MTP_NS))})")
    p.add_argument("--prompts", default=DEFAULT_CLASSES, help="as for bench: classes, humaneval, FILE.jsonl, NAME:N")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="warm-up requests per k")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--load-format", default="auto", help="auto | dummy (random weights: timing only)")
    add_deterministic_arg(p)
    p.add_argument("--synthetic-accept", type=float, default=None, metavar="P",
                   help="no drafter: draft the target's own output, each token kept with probability P "
                        "(labelled synthetic; times the verify path)")
    p.add_argument("--base-url", default=None, help="measure a running server at its k instead (one --k per call)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--server-model", default=None, help="model name to request with --base-url")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: tune-results/DATE-TIME)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=cmd_tune)


def cmd_tune(args: argparse.Namespace) -> int:
    if args.method == "mtp" and args.draft is not None:
        raise ConfigError("--method mtp drafts with the target's own MTP head: drop --draft")
    ks = args.k or (DEFAULT_MTP_NS if args.method == "mtp" else DEFAULT_KS)
    s = TuneSettings(model=args.model, draft=args.draft, method=args.method, ks=ks, prompts=args.prompts,
                     max_tokens=args.max_tokens,
                     runs=args.runs, warmup=args.warmup, temperature=args.temperature, device=args.device,
                     dtype=args.dtype, max_model_len=args.max_model_len,
                     gpu_memory_utilization=args.gpu_memory_utilization, load_format=args.load_format,
                     deterministic=args.deterministic, synthetic_accept=args.synthetic_accept,
                     base_url=args.base_url, api_key=args.api_key,
                     server_model=args.server_model)
    out = args.out or default_out_dir("tune")
    data = run_tune(s, out, quiet=args.quiet or args.json)
    write_tune_outputs(data, out)
    print(json.dumps(data) if args.json else format_tune_table(data))
    return 0
