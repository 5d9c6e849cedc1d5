"""The `blockspec train-drafter` subcommand: flags -> PipelineConfig -> pipeline.run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from blockspec.errors import ConfigError


def add_train_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `train-drafter` on blockspec's CLI."""
    p = subparsers.add_parser(
        "train-drafter", help="train a DFlash drafter for a target model",
        description="The target writes training responses through blockspec's engine, then a DFlash drafter "
                    "learns to draft them; the result is a z-lab checkpoint directory (--draft DIR).")
    p.add_argument("--target", "--model", dest="target", default=None,
                   help="target model directory or .gguf (default: the embedded SmolLM2-135M)")
    p.add_argument("--out", required=True, type=Path, help="output directory (drafter, data, logs)")
    g = p.add_argument_group("data")
    g.add_argument("--prompts", default="builtin", help="'builtin' and/or JSONL files, comma-separated")
    g.add_argument("--num-samples", type=int, default=2048, help="responses to generate")
    g.add_argument("--response-len", type=int, default=256, help="max tokens per response")
    g.add_argument("--temperature", type=float, default=0.7,
                   help="sampling temperature after the first (greedy) pass over the prompts")
    g.add_argument("--sampled-prefix", type=int, default=16,
                   help="later passes sample this many tokens, then continue greedily (0: sample throughout)")
    g.add_argument("--self-prompts", type=float, default=0.5,
                   help="share of later samples whose user message the target writes itself from a built-in "
                        "opener (more distinct prompts; 0: only --prompts)")
    g.add_argument("--gen-batch", type=int, default=None, help="sequences generated at once (default 256 GPU, 32 CPU)")
    g.add_argument("--gen-workers", type=int, default=1,
                   help="engine processes generating at once on the device (a small target is host-bound: "
                        "on a GPU with spare cores 4 generate several times faster than 1)")
    g.add_argument("--max-prompt-len", type=int, default=768, help="longer prompts are skipped")
    g.add_argument("--gen-minutes", type=float, default=None,
                   help="stop generating after the shard that crosses this many minutes")
    g.add_argument("--data-dir", type=Path, default=None, help="where data shards live (default OUT/data)")
    d = p.add_argument_group("drafter")
    d.add_argument("--arch", choices=("dflash", "dflash2"), default=None,
                   help="dflash (default; with --init-from: that drafter's own) | dflash2: DFlash 2 "
                        "(DFlash2DraftModel): grouped dynamic convolutions around every sublayer and a candidate "
                        "selector over the top-K tokens per slot, trained with a K-way loss; with --init-from a "
                        "DFlash 1 drafter, its shared weights start the DFlash 2 drafter")
    d.add_argument("--num-layers", type=int, default=None,
                   help="drafter decoder layers (default 2; with --init-from that drafter's, or its first N)")
    d.add_argument("--block-size", type=int, default=None, help="B: anchor + B-1 drafts (default 16; 8 for dflash2)")
    d.add_argument("--conv-kernel-size", type=int, default=2, help="dflash2: convolution taps")
    d.add_argument("--conv-group-size", type=int, default=16, help="dflash2: channels sharing a dynamic tap")
    d.add_argument("--selector-rank", type=int, default=64, help="dflash2: rank of the pairwise scores (z-lab: 256)")
    d.add_argument("--selector-top-k", type=int, default=16, help="dflash2: candidates kept per slot")
    d.add_argument("--target-layer-ids", default=None,
                   help="target layers to read, e.g. 1,8,14,21,27 (default: 5 spread from 1 to L-3)")
    d.add_argument("--init-from", type=Path, default=None,
                   help="start from this DFlash drafter (its weights and config: layers, block size, target "
                        "layers, mask token), e.g. to fine-tune a published drafter on your own prompts")
    d.add_argument("--mask-token-id", type=int, default=None, help="default: a special token the target never writes")
    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=int, default=4)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    t.add_argument("--num-anchors", type=int, default=64, help="random anchors (blocks) per sequence per step")
    t.add_argument("--labels", choices=("greedy", "data"), default="greedy",
                   help="greedy: learn the target's argmax chain (computed on the fly); data: the stored tokens")
    t.add_argument("--gamma", type=float, default=None, help="loss weight decay (default 7 for B = 16)")
    t.add_argument("--max-time", type=float, default=None, help="training wall-clock cap in minutes")
    t.add_argument("--eval-every", type=int, default=0, help="steps between tau evaluations (default: each epoch)")
    t.add_argument("--eval-prompts", type=int, default=16, help="prompts held out for the tau evaluation")
    t.add_argument("--eval-max-tokens", type=int, default=128)
    t.add_argument("--attention", default="auto",
                   help="auto | sdpa | flex (flex_attention, CUDA only; auto picks it for >= 4096 block queries)")
    t.add_argument("--device", default="auto", help="auto | cpu | cuda")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--resume", action="store_true", help="continue training from OUT/train_state.pt")
    p.set_defaults(func=cmd_train_drafter)


def config_from_args(args: argparse.Namespace):
    from blockspec.train.data import GenerationConfig
    from blockspec.train.pipeline import PipelineConfig
    from blockspec.train.trainer import TrainConfig

    for name in ("num_samples", "response_len", "num_layers", "epochs", "batch_size", "num_anchors", "gen_workers"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.self_prompts <= 1:
        raise ConfigError("--self-prompts must be between 0 and 1")
    if args.sampled_prefix < 0:
        raise ConfigError("--sampled-prefix must be 0 or more")
    if args.arch == "dflash" and args.init_from is not None and _architecture(args.init_from) == "DFlash2DraftModel":
        raise ConfigError(f"--arch dflash cannot start from the DFlash 2 drafter in {args.init_from} (its convolutions "
                          "and selector have no DFlash 1 counterpart): leave out --arch to fine-tune it as DFlash 2")
    if args.block_size is None:
        args.block_size = 8 if args.arch == "dflash2" else 16
    if args.block_size < 2:
        raise ConfigError("--block-size must be at least 2 (one anchor and one draft)")
    dflash2 = None
    if args.arch == "dflash2":
        names = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
        dflash2 = {name: getattr(args, name) for name in names}
        bad = [name for name, value in dflash2.items() if value < 1]
        if bad:
            raise ConfigError(f"--{bad[0].replace('_', '-')} must be at least 1")
    gen = GenerationConfig(num_samples=args.num_samples, response_len=args.response_len,
                           temperature=args.temperature, sampled_prefix=args.sampled_prefix,
                           self_prompts=args.self_prompts, seed=args.seed,
                           max_time_s=None if args.gen_minutes is None else args.gen_minutes * 60)
    train = TrainConfig(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, num_anchors=args.num_anchors,
                        gamma=args.gamma, labels=args.labels, eval_every=args.eval_every, attention=args.attention,
                        seed=args.seed,
                        max_time_s=None if args.max_time is None else args.max_time * 60)
    return PipelineConfig(out=args.out, target=args.target, prompts=args.prompts, data_dir=args.data_dir,
                          generation=gen, training=train, num_layers=args.num_layers, block_size=args.block_size,
                          dflash2=dflash2,
                          target_layer_ids=args.target_layer_ids, mask_token_id=args.mask_token_id,
                          gen_batch=args.gen_batch, gen_workers=args.gen_workers, init_from=args.init_from,
                          max_prompt_len=args.max_prompt_len,
                          eval_prompts=args.eval_prompts, eval_max_tokens=args.eval_max_tokens,
                          device=args.device, resume=args.resume, seed=args.seed)


def _architecture(drafter_dir: Path) -> str | None:
    """The drafter's architecture as its config.json names it (None when it cannot be read: the pipeline
    then says what is wrong with the directory)."""
    try:
        return json.loads((drafter_dir / "config.json").read_text())["architectures"][0]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from blockspec.train.pipeline import run

    summary = run(config_from_args(args))
    ev = summary.get("heldout_eval") or {}
    tau = f", held-out tau {ev['tau']:.2f}" if ev else ""
    print(json.dumps(summary["training"] | {"heldout_tau": ev.get("tau")}))
    print(f"drafter written to {args.out}{tau}: use it with --draft {args.out}")
    return 0
