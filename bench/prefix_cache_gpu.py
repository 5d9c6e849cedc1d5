"""Prefix caching on the GPU through the Engine that `serve` builds (issue 16).

Models (random bf16 weights, load_format dummy): the Qwen3-8B shape (dense) and the Qwen3.6-27B shape (Gated
DeltaNet hybrid: hits resume from recurrent-state snapshots), each with a random z-lab-shaped DFlash drafter
(5 layers, block 16; k = --k, default 15). Per model, one engine with --no-enable-prefix-caching and then one
with the cache on (the default), built one after the other with the same flags:
  - shared prefix: a --prefix-token prefix (default 6000) plus a --turn-token turn (200) as request 1, the
    same prefix plus another turn as request 2 (a fresh random prefix every run, so request 1 misses): TTFT
    of each (add_request to the first token on the host), the ratio request 1 / request 2 (target >= 10 with
    the cache), the tokens found cached, and decode tok/s of request 2 (--tokens new tokens) on both engines
    (target: equal within noise);
  - an agent-like conversation: a --system-token system prompt, then --turns turns, each appending the
    model's own --reply-token reply and a new user message (about --turn-append tokens per turn in all);
    the cached engine plays it first, the uncached one replays the very same prompts: per-turn TTFT and
    cached tokens.
Medians of --runs runs after a warm-up request pair. Prints a short table last and writes
prefix_cache_gpu.json (commit, device, dtype, settings, every figure) under --out (default $OUT, else
bench/results).

Usage (repository root, on the GPU machine; the 27B needs about 60 GiB):
    python bench/prefix_cache_gpu.py [--models 8b,27b] [--runs 3] [--out DIR]
fla-core (the GPU delta rule) as for bench/hybrid_gpu.py:
    pip install -q --no-index --no-deps --target /tmp/site .whl/fla_core-0.6.0-*.whl && \\
        PYTHONPATH=/tmp/site:. python bench/prefix_cache_gpu.py
Anywhere, in seconds (tiny configs on the CPU, the whole flow; tests/bench/test_prefix_cache_gpu_script.py):
    python bench/prefix_cache_gpu.py --dry-run --out /tmp/p
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

import torch  # noqa: E402
from first_gpu import QWEN3_8B  # noqa: E402
from hybrid_gpu import CONFIGS, MASK_TOKEN, TINY, commit, scaled  # noqa: E402
from hybrid_parts import drafter_config, kv_cache_bytes, random_prompts, torch_dtype, write_model_dir  # noqa: E402

from blockspec.config import EngineConfig, SpeculativeConfig  # noqa: E402
from blockspec.engine.engine import Engine  # noqa: E402
from blockspec.engine.sampling_params import SamplingParams  # noqa: E402

MODELS = {"8b": ("Qwen3-8B", {**QWEN3_8B, "max_position_embeddings": 40960}, 151669),
          "27b": ("Qwen3.6-27B", CONFIGS["27b"], MASK_TOKEN["27b"])}
TTFT_TARGET = 10.0  # request 1 TTFT / request 2 TTFT with the cache (issue 16)
DRY_RUN = dict(prefix_tokens=96, turn_tokens=20, tokens=8, system_tokens=40, turns=3, turn_append=24,
               reply_tokens=4, runs=1, mamba_block_size=32)


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False)


def timed_request(engine: Engine, prompt: list[int], tokens: int, rid: str) -> dict[str, Any]:
    """One request alone: TTFT from add_request to its first token on the host, then decode to the end."""
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, greedy(tokens))
    ttft, final = None, None
    while final is None:
        for out in engine.step():
            if ttft is None and out.new_token_ids:
                ttft = time.perf_counter() - t0
            if out.finished:
                final = out
    st = final.stats
    return {"ttft_ms": 1000 * ttft, "cached_tokens": st.cached_tokens or 0, "prompt_tokens": len(prompt),
            "decode_tok_s": st.decode_tok_s, "tau": st.tau, "token_ids": final.token_ids}


def build(model_dir: Path, draft_dir: Path, args: argparse.Namespace, max_len: int, kv: int, cache: bool) -> Engine:
    spec = SpeculativeConfig(model=str(draft_dir), num_speculative_tokens=args.k, load_format="dummy") \
        if args.k else SpeculativeConfig()
    return Engine(EngineConfig(model=str(model_dir), device=args.device, dtype=args.dtype, max_model_len=max_len,
                               max_num_seqs=1, load_format="dummy", speculative=spec, kv_cache_memory=kv,
                               enable_prefix_caching=cache, max_num_batched_tokens=args.max_num_batched_tokens,
                               mamba_block_size=args.mamba_block_size,
                               prefill_cuda_graphs=args.prefill_cuda_graphs and args.device == "cuda"))


def shared_prefix(engine: Engine, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Request 1 = prefix + turn A, request 2 = prefix + turn B; a fresh prefix per run (medians)."""
    runs = []
    for run in range(args.runs + 1):  # run 0 warms up
        prefix = random_prompts(1, args.prefix_tokens, vocab, seed=1000 + run)[0]
        turns = random_prompts(2, args.turn_tokens, vocab, seed=2000 + run)
        first = timed_request(engine, prefix + turns[0], args.tokens, f"p{run}a")
        second = timed_request(engine, prefix + turns[1], args.tokens, f"p{run}b")
        if run:
            runs.append({"first": first, "second": second})
    med = {}
    for which in ("first", "second"):
        for key in ("ttft_ms", "cached_tokens", "decode_tok_s", "tau"):
            med[f"{which}_{key}"] = statistics.median(r[which][key] for r in runs)
    med["ttft_ratio"] = med["first_ttft_ms"] / med["second_ttft_ms"]
    med["runs"] = [{w: {k: v for k, v in r[w].items() if k != "token_ids"} for w in r} for r in runs]
    med["second_token_ids"] = runs[0]["second"]["token_ids"]  # compared across the two engines
    return med


def first_token(engine: Engine, rid: str, prompt: list[int]) -> None:
    """Add a 2-token greedy request and step until its first token is out (a hit's TTFT)."""
    engine.add_request(rid, prompt, greedy(2))
    while not any(out.new_token_ids for out in engine.step()):
        pass


def finish(engine: Engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def kernel_timeline(prof) -> dict[str, Any]:
    """Whether a profiled stretch waits on the GPU or on the host: from the profiler's events, the time before the
    first kernel starts (scheduling, metadata), the kernels' busy time (union of their intervals) and the idle time
    between the first and the last kernel (host launching slower than the GPU runs, or a sync), and the host calls
    that blocked longest (synchronising copies and waits)."""
    from torch.autograd import DeviceType
    events = list(prof.events())
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
    if not kernels:
        return {}
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    t0 = min(e.time_range.start for e in cpu)
    busy, cur_s, cur_e = 0.0, kernels[0][0], kernels[0][1]
    for s, e in kernels[1:]:
        if s > cur_e:
            busy, cur_s = busy + cur_e - cur_s, s
        cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = cur_e - kernels[0][0]
    waits = sorted(((e.time_range.end - e.time_range.start, e.name) for e in cpu
                    if any(w in e.name for w in ("Synchronize", "Memcpy", "_local_scalar_dense", "EventSync"))),
                   reverse=True)[:6]
    return {"before_first_kernel_ms": round((kernels[0][0] - t0) / 1000, 2), "kernel_busy_ms": round(busy / 1000, 2),
            "kernel_span_ms": round(span / 1000, 2), "gpu_idle_in_span_ms": round((span - busy) / 1000, 2),
            "kernels": len(kernels), "longest_host_waits": [[round(d / 1000, 2), n[:60]] for d, n in waits]}


def profile_hit(engine: Engine, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Where a hit's TTFT goes: GPU kernels (torch.profiler) from add_request to the first token of a request
    whose prefix is cached, top kernels by total time, and the host wall time beside their sum."""
    from torch.profiler import ProfilerActivity, profile
    prefix = random_prompts(1, args.prefix_tokens, vocab, seed=999)[0]
    turns = random_prompts(2, args.turn_tokens, vocab, seed=998)
    timed_request(engine, prefix + turns[0], 2, "prof-a")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        first_token(engine, "prof-b", prefix + turns[1])
        wall = time.perf_counter() - t0
    finish(engine)
    timeline = kernel_timeline(prof)
    rows = [(e.key, e.self_device_time_total, e.count) for e in prof.key_averages() if e.self_device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    top = [{"kernel": k[:90], "ms": round(t / 1000, 3), "calls": n} for k, t, n in rows[:15]]
    print(f"hit TTFT profile: wall {1000 * wall:.1f} ms, GPU kernels {total / 1000:.1f} ms; timeline {timeline}",
          flush=True)
    for row in top:
        print(f"  {row['ms']:8.3f} ms {row['calls']:5d}x {row['kernel']}", flush=True)
    # the host side of another hit: Python functions by own time (what the GPU waits on between launches)
    import cProfile
    import io
    import pstats
    prefix = random_prompts(1, args.prefix_tokens, vocab, seed=997)[0]
    timed_request(engine, prefix + turns[0], 2, "prof-c")
    host = cProfile.Profile()
    host.enable()
    first_token(engine, "prof-d", prefix + turns[1])
    host.disable()
    finish(engine)
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(20)
    print(text.getvalue()[-4000:], flush=True)
    return {"wall_ms": round(1000 * wall, 2), "gpu_kernel_ms": round(total / 1000, 2), "timeline": timeline, "top": top,
            "host_profile": text.getvalue()[-4000:]}


def conversation(engine: Engine, args: argparse.Namespace, vocab: int, prompts: list[list[int]] | None
                 ) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """The agent conversation (prompts=None: built from the engine's own replies), or a replay of `prompts`."""
    rows, played = [], []
    context = random_prompts(1, args.system_tokens, vocab, seed=7)[0]
    user = args.turn_append - args.reply_tokens
    for turn in range(args.turns):
        prompt = prompts[turn] if prompts is not None else context
        res = timed_request(engine, prompt, args.reply_tokens, f"c{turn}")
        played.append(prompt)
        rows.append({k: v for k, v in res.items() if k != "token_ids"})
        context = prompt + res["token_ids"] + random_prompts(1, user, vocab, seed=100 + turn)[0]
    return rows, played


def measure_model(key: str, args: argparse.Namespace, save) -> dict[str, Any]:
    name, cfg, mask = MODELS[key]
    if args.dry_run:
        cfg, mask = scaled(cfg, TINY), TINY["vocab_size"] - 2
    draft, _ = drafter_config(cfg, mask, layers=2 if args.dry_run else 5)
    res: dict[str, Any] = {"key": key, "model": name + (" (tiny)" if args.dry_run else ""), "config": cfg}
    work = Path(tempfile.mkdtemp(prefix=f"prefix-{key}-"))
    model_dir, draft_dir = write_model_dir(work / key, cfg), write_model_dir(work / "draft", draft, tokenizer=False)
    longest = max(args.prefix_tokens + args.turn_tokens, args.system_tokens + args.turns * args.turn_append)
    max_len = longest + max(args.tokens, args.reply_tokens) + 64
    kv = kv_cache_bytes(cfg, draft, torch_dtype(args.dtype), 2, max_len)  # room for both requests' blocks
    res["settings"] = {"max_model_len": max_len, "kv_cache_memory": kv, "k": args.k}
    replay: list[list[int]] | None = None
    for cache in (True, False):
        label = "cached" if cache else "uncached"
        t0 = time.perf_counter()
        engine = build(model_dir, draft_dir, args, max_len, kv, cache)
        part: dict[str, Any] = {"build_s": round(time.perf_counter() - t0, 1),
                                "state_bytes": getattr(engine, "state_bytes", 0)}
        res[label] = part
        vocab = engine.model_config.vocab_size
        part["shared_prefix"] = shared_prefix(engine, args, vocab)
        if args.profile and cache:
            part["hit_profile"] = profile_hit(engine, args, vocab)
        save(res)
        rows, played = conversation(engine, args, vocab, replay)
        replay = played  # the uncached engine replays exactly the cached engine's prompts
        part["conversation"] = rows
        part["prefix_cache"] = vars(engine.prefix_cache_stats).copy()
        engine.release()
        del engine
        gc.collect()
        save(res)
    c, u = res["cached"], res["uncached"]
    res["ttft_ratio"] = c["shared_prefix"]["ttft_ratio"]
    res["decode_tok_s_ratio"] = c["shared_prefix"]["second_decode_tok_s"] / u["shared_prefix"]["second_decode_tok_s"]
    res["conversation_ttft_speedup"] = [u_row["ttft_ms"] / c_row["ttft_ms"]
                                        for c_row, u_row in zip(c["conversation"], u["conversation"])]
    # greedy tokens of a request that hit vs the same request computed whole (on a GPU, bf16 may differ)
    res["hit_tokens_equal_uncached"] = c["shared_prefix"]["second_token_ids"] == u["shared_prefix"]["second_token_ids"]
    return res


def table(result: dict[str, Any]) -> str:
    lines = ["| model | req 1 TTFT ms | req 2 TTFT ms (cached tokens) | ratio (target >= 10) | decode tok/s "
             "cached / uncached | conversation TTFT ms, last turn cached / uncached | turns faster | same tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for m in result["models"]:
        if "error" in m:
            lines.append(f"| {m.get('model', m.get('key'))} | error: {m['error'][:80]} | | | | | | |")
            continue
        c, u = m["cached"], m["uncached"]
        sp = c["shared_prefix"]
        last_c, last_u = c["conversation"][-1], u["conversation"][-1]
        faster = sum(1 for s in m["conversation_ttft_speedup"][1:] if s > 1)
        lines.append(f"| {m['model']} | {sp['first_ttft_ms']:.1f} | {sp['second_ttft_ms']:.1f} "
                     f"({sp['second_cached_tokens']:.0f}) | {m['ttft_ratio']:.1f} | "
                     f"{sp['second_decode_tok_s']:.1f} / {u['shared_prefix']['second_decode_tok_s']:.1f} | "
                     f"{last_c['ttft_ms']:.1f} / {last_u['ttft_ms']:.1f} | {faster}/{len(c['conversation']) - 1} | "
                     f"{m['hit_tokens_equal_uncached']} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="8b,27b", help="comma-separated: 8b, 27b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--k", type=int, default=15, help="draft tokens per step (0: no drafter)")
    p.add_argument("--prefix-tokens", type=int, default=6000)
    p.add_argument("--turn-tokens", type=int, default=200)
    p.add_argument("--tokens", type=int, default=128, help="new tokens of the shared-prefix requests")
    p.add_argument("--system-tokens", type=int, default=2000, help="the conversation's first prompt")
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--turn-append", type=int, default=300, help="tokens each turn adds: the reply + a user message")
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--mamba-block-size", type=int, default=None, help="hybrids: tokens between state snapshots")
    p.add_argument("--profile", action="store_true", help="profile one hit's TTFT (top GPU kernels)")
    p.add_argument("--prefill-cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="the engines' --prefill-cuda-graphs (both engines alike; default on: the hit's short prefill "
                        "is host-bound without it)")
    p.add_argument("--dry-run", action="store_true", help="tiny configs on the CPU (float32), a few tokens")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.dry_run:
        for name, value in DRY_RUN.items():
            if p.get_default(name) == getattr(args, name):
                setattr(args, name, value)
        args.device, args.dtype = "cpu", "float32"
    args.models = [m for m in args.models.split(",") if m]
    bad = [m for m in args.models if m not in MODELS]
    if bad:
        p.error(f"unknown model(s) {bad}: use {', '.join(MODELS)}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out_dir = args.out or Path(os.environ.get("OUT") or BENCH / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "prefix_cache_gpu.json"
    if args.device == "cpu":
        torch.set_num_threads(1)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result: dict[str, Any] = {"commit": commit(), "device": device, "torch": torch.__version__,
                              "dtype": args.dtype, "settings": settings, "ttft_target": TTFT_TARGET, "models": []}

    def save(res: dict[str, Any]) -> None:  # what one model has measured so far, beside the finished ones
        path.write_text(json.dumps({**result, "models": [*result["models"], res]}, indent=1))

    for key in args.models:
        try:
            res = measure_model(key, args, save)
        except Exception as exc:
            traceback.print_exc()
            res = {"key": key, "model": MODELS[key][0], "error": f"{type(exc).__name__}: {exc}"[:600]}
        result["models"].append(res)
        path.write_text(json.dumps(result, indent=1))
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print(f"wrote {path}")
    print(table(result))
    return result


if __name__ == "__main__":
    main()
