"""`blockspec tune`: sweep DFlash's k and MTP's N per prompt class against the autoregressive baseline, pick one.

In-process mode builds one engine per method, one after the other (a DFlash drafter for --draft DIR, the
target's own MTP head for mtp; the engine holds one proposer, and two engines at once would hold two
copies of the target), each at its largest k, and switches k between sweeps (k = 0 takes the proposer out
of the step entirely, so the baseline pays no drafting cost). The baseline is measured once, on the first
engine, and every method's speedup is over it; all points run the same prompts, one request at a time (the
conc=1 regime the choice of k matters for); each cell is the median of its runs. A requested method that
cannot run here (no drafter given, no `mtp.*` weights) is named in a note and the others are swept.
Against --base-url the server's proposer and k are fixed at start-up, so one call measures one method at
one k and merges it into the sweep already in --out: restart the server with the next configuration and
call tune again.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
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
from blockspec.bench.tune_report import (
    AR,
    JSON_NAME,
    choose,
    format_tune_table,
    point_order,
    speculative_config,
    write_tune_outputs,
)
from blockspec.config import METHODS, MTP_METHODS
from blockspec.errors import ConfigError

DEFAULT_KS = [4, 6, 8, 10, 12, 15]
DEFAULT_MTP_NS = [1, 2, 3, 4]  # MTP heads are trained for one step ahead: acceptance falls fast with N
SYNTHETIC = "synthetic"  # the method of points whose drafts came from --synthetic-accept


def method_list(text: str) -> list[str]:
    """--method: one method or a comma-separated list (dflash, mtp; vLLM's aliases of mtp map to it)."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in METHODS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"not a speculative method: {', '.join(bad) or repr(text)} (choose from "
                                         f"dflash, mtp or a comma-separated list such as dflash,mtp; "
                                         f"{', '.join(MTP_METHODS[1:])} are spellings of mtp)")
    return list(dict.fromkeys("mtp" if m in MTP_METHODS else m for m in names))


@dataclass
class TuneSettings:
    model: str | None = None
    draft: str | None = None
    methods: list[str] = field(default_factory=lambda: ["dflash"])  # dflash (--draft DIR), mtp (target's head)
    ks: list[int] = field(default_factory=lambda: list(DEFAULT_KS))  # DFlash's k
    ns: list[int] = field(default_factory=lambda: list(DEFAULT_MTP_NS))  # MTP's N
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

    def counts(self, method: str) -> list[int]:
        """The numbers of drafts per step to sweep for `method`: k for DFlash, N for MTP."""
        return self.ns if method == "mtp" else self.ks


@dataclass
class MethodPlan:
    """One method's part of an in-process sweep: the engine to build and the k (or N) values to run on it."""

    method: str  # dflash | mtp: the engine's proposer
    counts: list[int]  # k > 0 values (MTP: N)
    label: str  # the points' method: the proposer's, or "synthetic"
    block_size: int | None = None  # the DFlash drafter's


class EngineSweep:
    """Runs prompts one at a time through an in-process engine and records each request's stats."""

    def __init__(self, s: TuneSettings, max_k: int, method: str = "dflash") -> None:
        from blockspec.config import EngineConfig, SpeculativeConfig
        from blockspec.engine.engine import Engine

        draft = s.draft if method == "dflash" else None
        proposes = draft is not None or method == "mtp"
        spec = SpeculativeConfig(model=draft, num_speculative_tokens=max_k if proposes and max_k else None,
                                 method=method)
        self.engine = Engine(EngineConfig(model=s.model, speculative=spec, device=s.device, dtype=s.dtype,
                                          max_model_len=s.max_model_len, max_num_seqs=1,
                                          gpu_memory_utilization=s.gpu_memory_utilization,
                                          load_format=s.load_format, deterministic=s.deterministic))
        self.settings = s
        self.references: dict[str, list[int]] = {}  # prompt id -> greedy AR output (synthetic mode)
        self.counter = 0

    def close(self) -> None:
        """Free the engine's memory now, so that the next method's engine finds it (one target at a time)."""
        import torch

        engine, self.engine = self.engine, None
        cuda = engine.device.type == "cuda"
        engine.release()
        del engine
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

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


def point_from_requests(method: str, k: int, cls: str, runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One (method, k, class) cell: median over runs of the per-run median decode tok/s; tau over everything."""
    reqs = [r for run in runs for r in run]
    steps = sum(r["steps"] for r in reqs)
    width = max((len(r["accepted_per_position"]) for r in reqs), default=0)
    accepted = [sum(r["accepted_per_position"][i] for r in reqs if i < len(r["accepted_per_position"]))
                for i in range(width)]
    return {"method": method, "k": k, "prompt_class": cls,
            "tok_s": median([median([r["decode_tok_s"] for r in run]) for run in runs]),
            "tok_s_runs": [median([r["decode_tok_s"] for r in run]) for run in runs],
            "tau": sum(r["decode_tokens"] for r in reqs) / steps if steps else None,
            "acceptance_per_position": [a / steps for a in accepted] if steps else [],
            "requests": len(reqs), "mean_output_tokens": sum(r["completion_tokens"] for r in reqs) / max(len(reqs), 1)}


def _unavailable(method: str, s: TuneSettings) -> str | None:
    """Why `method` cannot be swept here (None: it can), without building an engine."""
    if method == "dflash":
        return None if s.draft or s.synthetic_accept is not None else "no drafter given (pass --draft DIR)"
    from blockspec.loader.weights import resolve_model_path
    from blockspec.spec.mtp import mtp_unavailable

    return mtp_unavailable(resolve_model_path(s.model), load=s.load_format != "dummy")


def _in_range(method: str, s: TuneSettings, notes: list[str]) -> MethodPlan:
    """The method's k (or N) values the proposer can draft, the others named in a note."""
    counts = sorted({k for k in s.counts(method) if k > 0})
    block = None
    if method == "mtp":
        from blockspec.spec.mtp import MAX_DRAFTS

        limit, why = MAX_DRAFTS, f"at most {MAX_DRAFTS} MTP drafts per step"
    elif s.draft:
        from blockspec.spec.dflash import DrafterConfig

        block = DrafterConfig.from_dir(Path(s.draft)).block_size
        limit, why = block - 1, f"the drafter's block_size is {block} (k <= {block - 1})"
    else:
        limit, why = None, ""
    if limit is not None and any(k > limit for k in counts):
        name = "N" if method == "mtp" else "k"
        notes.append(f"{name} {', '.join(str(k) for k in counts if k > limit)} skipped: {why}")
        counts = [k for k in counts if k <= limit]
    label = SYNTHETIC if s.synthetic_accept is not None else method
    return MethodPlan(method, counts, label, block)


def plan_methods(s: TuneSettings, notes: list[str]) -> list[MethodPlan]:
    """One plan per method that can run (a lone dflash without a drafter: the baseline alone, as a note says).
    Refuses a lone method that cannot run, and a list of which none can."""
    if s.synthetic_accept is not None:
        if len(s.methods) > 1:
            raise ConfigError("--synthetic-accept replaces the proposer's drafts with synthetic ones, so there is "
                              "nothing to compare between methods: pass one --method")
        if s.temperature != 0:
            raise ConfigError("--synthetic-accept needs --temperature 0 (drafts follow the greedy output)")
        notes.append(f"SYNTHETIC drafts: the target's own greedy continuation, each draft kept with probability "
                     f"{s.synthetic_accept}; tok/s shows what the verify path would give at that acceptance, "
                     "not what a real drafter gives")
    why = {m: _unavailable(m, s) for m in s.methods}
    if len(s.methods) == 1:
        method = s.methods[0]
        if why[method] is None:
            return [_in_range(method, s, notes)]
        if method == "mtp":
            raise ConfigError(why[method])
        notes.append("no drafter given: measured the autoregressive baseline (k = 0) only; pass --draft DIR "
                     "(a DFlash checkpoint) to sweep k, or --method mtp for a target with an MTP head")
        return [MethodPlan(method, [], method)]
    if all(why.values()):
        raise ConfigError("none of the methods can run here: " + "; ".join(f"{m}: {w}" for m, w in why.items()))
    for method, reason in why.items():
        if reason:
            notes.append(f"{method} not swept: {reason}")
    return [_in_range(m, s, notes) for m in s.methods if why[m] is None]


def _sweep_ks(sweep: EngineSweep, method: str, ks: list[int], sets: dict[str, list[Prompt]], bar) -> list[dict]:
    s = sweep.settings
    points = []
    for k in ks:
        sweep.use_k(k)
        first = next(iter(sets.values()))[0]
        for _ in range(s.warmup):
            sweep.run(first)
        label = method if k else AR
        for cls, prompts in sets.items():
            runs = []
            for r in range(s.runs):
                if bar is not None:
                    bar.set_description(f"{label} k={k} {cls} run {r + 1}/{s.runs}")
                run = []
                for p in prompts:
                    run.append(sweep.run(p))
                    if bar is not None:
                        bar.update(1)
                runs.append(run)
            point = point_from_requests(label, k, cls, runs)
            if label == "dflash":
                point["draft"] = s.draft
            points.append(point)
    return points


def sweep_in_process(s: TuneSettings, sets: dict[str, list[Prompt]], notes: list[str],
                     quiet: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    plans = plan_methods(s, notes)
    runnable = [p for p in plans if p.counts] or plans[:1]  # an engine only for methods with k to run
    total = (1 + sum(len(p.counts) for p in runnable)) * s.runs * sum(len(p) for p in sets.values())
    bar = None
    if not quiet:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)
    points: list[dict[str, Any]] = []
    env: dict[str, Any] = {}
    try:
        for i, plan in enumerate(runnable):
            sweep = EngineSweep(s, max(plan.counts, default=0), plan.method)
            try:
                if not env:
                    env = {"device": f"{sweep.engine.device.type} {str(sweep.engine.dtype).removeprefix('torch.')}",
                           "model_path": str(sweep.engine.model_dir)}
                ks = plan.counts if i else [0, *plan.counts]  # one baseline, on the first engine
                points += _sweep_ks(sweep, plan.label, ks, sets, bar)
            finally:
                sweep.close()
    finally:
        if bar is not None:
            bar.close()
    env["block_size"] = next((p.block_size for p in plans if p.block_size), None)
    return points, env


def sweep_remote(s: TuneSettings, sets: dict[str, list[Prompt]], quiet: bool) -> list[dict[str, Any]]:
    """Measure the server's current configuration as the single method and k given with --method and --k."""
    if len(s.methods) != 1:
        raise ConfigError("a server runs one proposer, so with --base-url tune measures one --method per call: "
                          "start the server with one --speculative-config, pass its --method and --k, then restart "
                          "it with the other method and call again with the same --out (each call merges into the "
                          "table there); or drop --base-url to sweep every method in-process")
    method = s.methods[0]
    counts = s.counts(method)
    if len(counts) != 1:
        raise ConfigError("with --base-url, tune measures the k the server runs: pass exactly one --k (MTP: its N; "
                          "0 for a server without speculation) and call again after restarting the server with the "
                          "next k")
    quiet_http_logs()
    bench = BenchSettings(base_url=s.base_url, api_key=s.api_key, model=s.server_model, prompts=s.prompts,
                          concurrency=[1], max_tokens=s.max_tokens, runs=s.runs, warmup=s.warmup,
                          temperature=s.temperature)
    data = asyncio.run(run_bench(bench, quiet=quiet))
    points = []
    k = counts[0]
    for row in data["results"]:
        spec = row.get("spec") or {}
        point = {"method": method if k else AR, "k": k, "prompt_class": row["prompt_class"],
                 "tok_s": row["decode_tok_s"], "tau": spec.get("tau") or (1.0 if k == 0 else None),
                 "acceptance_per_position": spec.get("acceptance_per_position") or [],
                 "requests": row["requests"], "errors": row["errors"], "model": data["model"]}
        if k and method == "dflash":
            point["draft"] = s.draft
        points.append(point)
    return points


def merge_points(old: list[dict[str, Any]], new: list[dict[str, Any]], old_method: str = "dflash"
                 ) -> list[dict[str, Any]]:
    """Earlier base-url points plus this call's (which replace any of the same method, k and class). Points
    written before tune recorded methods get theirs from the old document's (`old_method`)."""
    for p in old:
        p.setdefault("method", AR if p["k"] == 0 else old_method)
    keep = {(p["method"], p["k"], p["prompt_class"]): p for p in [*old, *new]}  # the later call's point wins
    merged = list(keep.values())
    order = point_order(merged)
    classes = list(dict.fromkeys(p["prompt_class"] for p in [*old, *new]))
    return sorted(merged, key=lambda p: (order.index((p["method"], p["k"])), classes.index(p["prompt_class"])))


def describe_proposers(methods: list[str], points: list[dict[str, Any]], s: TuneSettings) -> str | None:
    """The header's "+ ..." part: the proposers the points ran (None: the baseline alone)."""
    draft = s.draft or next((p["draft"] for p in points if p.get("draft")), None)
    names = {"mtp": "the target's MTP head", "dflash": draft or "a DFlash drafter", SYNTHETIC: "synthetic drafts"}
    return " / ".join(names[m] for m in methods) or None


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
            old = json.loads(previous.read_text())
            points = merge_points(old.get("points", []), points, old.get("method", "dflash"))
            notes.append(f"merged with the earlier points in {previous}")
        mode, env = "base-url", {"device": s.base_url, "model_path": points[0].get("model") if points else None}
    else:
        points, env = sweep_in_process(s, sets, notes, quiet)
        mode = "in-process"
    chosen = choose(points)
    pick = chosen["best_speculative"]
    config = None
    if pick is not None and s.synthetic_accept is None:
        draft = next((p.get("draft") for p in points if (p["method"], p["k"]) == (pick["method"], pick["k"])
                      and p.get("draft")), None) or s.draft
        config = speculative_config(draft, pick["k"], pick["method"])
        if config is None and pick["method"] == "dflash":
            notes.append("pass --draft DIR to have the --speculative-config line printed with the drafter path")
    settings = {k: v for k, v in vars(s).items() if k != "api_key"}
    methods = [m for m in dict.fromkeys(p["method"] for p in points) if m != AR]
    return {"tool": "blockspec tune", "started_at": started, "client_commit": client_commit(), "mode": mode,
            "model": s.model or s.server_model or env.get("model_path") or "embedded default",
            "drafter": describe_proposers(methods, points, s), "methods": methods,
            "device": env["device"], "settings": settings,
            "synthetic": None if s.synthetic_accept is None else {"accept_prob": s.synthetic_accept},
            "points": points, **chosen, "speculative_config": config, "notes": notes}


def add_tune_parser(sub: argparse._SubParsersAction) -> None:
    from blockspec.cli import add_deterministic_arg  # cli imports the bench parsers

    p = sub.add_parser("tune", help="sweep k (DFlash) and N (MTP) per prompt class against the autoregressive "
                                    "baseline",
                       description="Run the engine in-process (or measure a server with --base-url), sweep "
                                   "num_speculative_tokens per prompt class with k = 0 as the baseline (DFlash's k, "
                                   "MTP's N, or both in one table with --method dflash,mtp), report tau, tok/s and "
                                   "speedup, and print the --speculative-config of the best to serve with.")
    p.add_argument("--model", default=None, help="HF model directory or .gguf (default: the embedded model)")
    p.add_argument("--draft", default=None, help="DFlash drafter directory (DFlash 1 or 2)")
    p.add_argument("--method", type=method_list, default=["dflash"], metavar="METHOD[,METHOD]",
                   help="dflash (the --draft drafter; default), mtp (the target checkpoint's own MTP head: "
                        "Qwen3-Next, Qwen3.5/3.6; vLLM's qwen3_next_mtp and qwen3_5_mtp spell it too), or both, "
                        "dflash,mtp: one engine per method in turn, one baseline, one table, the best of either "
                        "recommended (a method that cannot run here is noted and skipped)")
    p.add_argument("--k", type=int_list, default=None,
                   help=f"DFlash k values to sweep (default {','.join(map(str, DEFAULT_KS))}); with --method mtp "
                        "alone, MTP's N (as --n)")
    p.add_argument("--n", type=int_list, default=None,
                   help=f"MTP N values to sweep (default {','.join(map(str, DEFAULT_MTP_NS))})")
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
    p.add_argument("--base-url", default=None,
                   help="measure a running server at its method and k instead (one --method and one --k per call; "
                        "calls with the same --out merge into one table)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--server-model", default=None, help="model name to request with --base-url")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: tune-results/DATE-TIME)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=cmd_tune)


def draft_counts(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """(DFlash's k values, MTP's N values) from --k and --n; --k is N when mtp is the only method."""
    methods = args.method
    if methods == ["mtp"]:
        if args.k is not None and args.n is not None:
            raise ConfigError("with --method mtp alone, --k is MTP's N: pass --k or --n, not both")
        return list(DEFAULT_KS), args.n or args.k or list(DEFAULT_MTP_NS)
    if args.n is not None and "mtp" not in methods:
        raise ConfigError("--n sets MTP's N: add mtp to --method (e.g. --method dflash,mtp), or drop --n")
    return args.k or list(DEFAULT_KS), args.n or list(DEFAULT_MTP_NS)


def cmd_tune(args: argparse.Namespace) -> int:
    if "mtp" in args.method and "dflash" not in args.method and args.draft is not None:
        raise ConfigError("--method mtp drafts with the target's own MTP head: drop --draft (or pass "
                          "--method dflash,mtp to compare the drafter with it)")
    ks, ns = draft_counts(args)
    s = TuneSettings(model=args.model, draft=args.draft, methods=args.method, ks=ks, ns=ns, prompts=args.prompts,
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
