"""`blockspec plan` on the command line: flags (serve's names), the table, and --json."""

from __future__ import annotations

import argparse
import json
from typing import Any

from blockspec.bench.plan import PlanInputs, make_plan
from blockspec.bench.presets import PRESETS
from blockspec.engine.memory import GIB
from blockspec.errors import BlockspecError


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _kib(n: float) -> str:
    return f"{n / 1024:.1f} KiB"


def format_plan(p: dict[str, Any]) -> str:
    m, d, kv, mem, fit, roof, serve = (p["model"], p["drafter"], p["kv"], p["memory"], p["fit"], p["roofline"],
                                       p["serve"])
    lines = [f"blockspec plan: {m['architecture'] or m['model_type']} ({m['path']}), {p['dtype']}, "
             f"k={p['num_speculative_tokens']}, max_model_len {p['max_model_len']}, max_num_seqs {p['max_num_seqs']}"]
    w = (f"weights          target {_gib(m['weight_bytes'])} ({m['weight_bytes'] / 1e9:.2f} GB, "
         f"{m['total_params'] / 1e9:.3f} B params")
    if m["active_params"] != m["total_params"]:
        w += f", {m['active_params'] / 1e9:.3f} B active"
    w += f", from {m['bytes_source']})"
    if d:
        w += f"  drafter {_gib(d['weight_bytes'])} ({d['total_params'] / 1e6:.1f} M params"
        w += f"; {'; '.join(d['notes'])})" if d.get("notes") else ")"
    lines.append(w)
    k_line = f"KV per token     target {_kib(kv['target_bytes_per_token'])} ({m['full_attention_layers']} layers)"
    if d:
        k_line += f"  drafter {_kib(kv['drafter_bytes_per_token'])} ({d['full_attention_layers']} layers)"
    k_line += f"  total {_kib(kv['bytes_per_token'])}"
    lines.append(k_line)
    if m["linear_attention_layers"]:
        extra = f", {kv['state_checkpoints']} checkpoints" if kv["state_checkpoints"] else ""
        snaps = (f" + {kv['state_snapshots']} prefix-cache snapshots every {kv['state_snapshot_interval']} tokens "
                 f"({_gib(kv['state_snapshot_bytes'])})" if kv["state_snapshots"] else "")
        lines.append(f"recurrent state  {kv['state_bytes_per_seq'] / 2**20:.1f} MiB per sequence "
                     f"({m['linear_attention_layers']} linear-attention layers{extra}); "
                     f"{p['max_num_seqs']} sequences x 2 slots + a scratch pair{snaps} = "
                     f"{_gib(kv['state_pool_bytes'])}, allocated before the KV cache")
    lines.append(f"one full sequence {_gib(kv['bytes_per_full_sequence'])} of KV ({p['max_model_len']} tokens)")
    if mem.get("total_bytes"):
        lines.append(f"memory           {mem['device']}: {_gib(mem['total_bytes'])} x {mem['gpu_memory_utilization']:g}"
                     f" - weights {_gib(mem['weight_bytes'])}"
                     + (f" - state {_gib(mem['state_pool_bytes'])}" if mem["state_pool_bytes"] else "")
                     + f" - activations ~{_gib(mem['activation_estimate_bytes'])}"
                     f" - CUDA reserve {_gib(mem['cuda_reserve_bytes'])} = KV {_gib(mem['kv_budget_bytes'])}"
                     f" ({mem['kv_tokens']} tokens)")
        lines.append(f"fits             {fit['max_sequences_at_max_model_len']} sequences at {p['max_model_len']} "
                     f"tokens; {p['max_num_seqs']} sequences up to {fit['max_model_len_at_max_num_seqs']} tokens")
        ctx = fit["table"]
        lines.append("context          " + " ".join(f"{r['context']:>8}" for r in ctx))
        lines.append("max sequences    " + " ".join(f"{r['max_sequences']:>8}" for r in ctx))
    if roof.get("bandwidth_gbs"):
        r = (f"roofline         {roof['bandwidth_gbs']:g} GB/s: AR {roof['ar_tok_s']:.1f} tok/s (empty context), "
             f"{roof['ar_tok_s_at_max_model_len']:.1f} tok/s at {p['max_model_len']} tokens")
        lines.append(r)
        if roof.get("dflash_tok_s_at_tau"):
            lines.append("DFlash bound     " + ", ".join(f"tau {t}: {v:.1f} tok/s"
                                                         for t, v in roof["dflash_tok_s_at_tau"].items())
                         + " (memory-bound ceiling; compute ignored)")
    notes = m.get("notes", [])
    for n in notes:
        lines.append(f"note             {n}")
    if serve["would_start"] is None:
        lines.append("serve            unknown: no device memory given (--memory-gb or --device-preset)")
    elif serve["would_start"]:
        lines.append("serve            would start with these flags")
    else:
        lines.append("serve            would NOT start:")
        lines.extend(f"  - {r}" for r in serve["reasons"])
    lines.extend(f"warning          {w}" for w in serve["warnings"])
    return "\n".join(lines)


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="memory fit and roofline from config files (no weights read)",
                       description="Read config.json files only and print weight bytes, KV bytes per token, "
                                   "the context x concurrency that fits, the roofline tok/s and whether `serve` "
                                   "with these flags would start (exit status 1 when it would not).")
    p.add_argument("--model", default=None, help="HF model directory (config.json suffices; default: embedded model)")
    p.add_argument("--draft", default=None, help="DFlash drafter directory")
    p.add_argument("--speculative-config", default=None, help="serve's JSON, as an alternative to --draft")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="k (default: block_size - 1)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--memory-gb", type=float, default=None, help="device memory in GiB (as torch/nvidia-smi report)")
    bw = p.add_mutually_exclusive_group()
    bw.add_argument("--bandwidth-gbs", type=float, default=None, help="memory bandwidth in GB/s for the roofline")
    bw.add_argument("--device-preset", choices=sorted(PRESETS), default=None,
                    help="memory and bandwidth of a known device")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    from blockspec.cli import add_prefix_caching_args

    add_prefix_caching_args(p)
    p.set_defaults(func=cmd_plan)


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    draft, k, draft_quantization = args.draft, args.num_speculative_tokens, None
    if args.speculative_config:
        from blockspec.config import SpeculativeConfig

        spec = SpeculativeConfig.from_json(args.speculative_config)
        draft = draft or spec.model
        k = k if k is not None else spec.num_speculative_tokens
        draft_quantization = spec.quantization
    return PlanInputs(model=args.model, draft=draft, draft_quantization=draft_quantization, num_speculative_tokens=k,
                      gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
                      max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                      block_size=args.block_size, dtype=args.dtype,
                      memory_bytes=int(args.memory_gb * GIB) if args.memory_gb else None,
                      bandwidth_gbs=args.bandwidth_gbs, device_preset=args.device_preset,
                      enable_prefix_caching=args.enable_prefix_caching, mamba_cache_mode=args.mamba_cache_mode,
                      mamba_block_size=args.mamba_block_size, mamba_cache_snapshots=args.mamba_cache_snapshots)


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        plan = make_plan(inputs_from_args(args))
    except (OSError, KeyError, ValueError) as exc:
        raise BlockspecError(f"cannot read the model configs ({exc}): pass HF directories with config.json") from None
    if args.json:
        print(json.dumps(plan))
    else:
        print(format_plan(plan))
    return 0 if plan["serve"]["would_start"] is not False else 1

