"""The `blockspec` command: generate | serve (more subcommands arrive with their issues).

Every user error ends as one `error: ...` line and exit code 2; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from blockspec.bench import add_bench_parsers
from blockspec.config import DEFAULT_MAMBA_BLOCK_SIZE, DEFAULT_MAMBA_CACHE_SNAPSHOTS, MAMBA_CACHE_MODES
from blockspec.errors import BlockspecError
from blockspec.train.cmd import add_train_parser

log = logging.getLogger("blockspec")


def _size(text: str) -> int:
    """'4GiB', '512MiB', '2G', or plain bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4GiB, 512MiB)") from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine (vLLM's names)."""
    p.add_argument("--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2-135M)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--draft", default=None, help="z-lab DFlash drafter directory")
    p.add_argument("--no-draft", action="store_true", help="plain autoregressive decoding")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="k (default: block_size - 1)")
    p.add_argument("--draft-window", type=int, default=None, help="drafter context window in tokens")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-memory", type=_size, default=None,
                   help="KV cache size, e.g. 2GiB (CPU default 1GiB; on CUDA it replaces --gpu-memory-utilization)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chat-template", default=None)
    p.add_argument("--load-format", default="auto", help="auto | dummy (random weights)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--prefill-cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay a CUDA graph for one sequence's prefill of up to 512 new tokens (a prefix-cache hit's "
                        "turn, a short prompt), whose eager launches wait on the host; dense and MoE targets "
                        "(default: on, except with --enforce-eager or --deterministic)")
    add_deterministic_arg(p)
    add_prefix_caching_args(p)


def add_deterministic_arg(p: argparse.ArgumentParser) -> None:
    """--deterministic / --no-deterministic (serve, generate, tune)."""
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=False,
                   help="batch-invariant kernels: every token's arithmetic is the same whatever shares its step "
                        "(k, batch, other sequences), so greedy output with speculation is bit for bit the output "
                        "without it, at any batch size; dense Llama-family targets (Llama, SmolLM, Qwen2, Qwen3), "
                        "Qwen3-MoE, GPT-OSS and the Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5/3.6), unquantized or "
                        "int4 / int8 / FP8 / NVFP4 / MXFP4; costs 14-23%% on an 8B decode step (default: off)")


def add_prefix_caching_args(p: argparse.ArgumentParser) -> None:
    """vLLM's prefix-caching flags (serve, generate, plan)."""
    c = p.add_argument_group("prefix caching")
    c.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share the K/V of prompt prefixes between requests (default: on, as vLLM v1)")
    c.add_argument("--mamba-cache-mode", choices=MAMBA_CACHE_MODES, default="align",
                   help="hybrids: save the recurrent state every --mamba-block-size prompt tokens (align), at every "
                        "block (all) or never (none: no prefix-cache hits for hybrids)")
    c.add_argument("--mamba-block-size", type=int, default=None,
                   help=f"hybrids: tokens between state snapshots, a multiple of --block-size (default "
                        f"{DEFAULT_MAMBA_BLOCK_SIZE})")
    c.add_argument("--mamba-cache-snapshots", type=int, default=DEFAULT_MAMBA_CACHE_SNAPSHOTS,
                   help="hybrids: state snapshots kept (least recently used go first), each the size of one "
                        "sequence's recurrent state (the start-up log shows the bytes)")


def engine_config_from_args(args: argparse.Namespace):
    from blockspec.config import EngineConfig, SpeculativeConfig

    draft = None if args.no_draft else args.draft
    if draft is None and not args.no_draft and args.model is None:
        # The embedded model comes with its trained drafter (blockspec/drafters/), when one ships.
        from blockspec.loader.default_model import default_drafter_dir

        found = default_drafter_dir()
        draft = None if found is None else str(found)
    spec = SpeculativeConfig(model=draft, num_speculative_tokens=args.num_speculative_tokens,
                             draft_window=args.draft_window)
    return EngineConfig(model=args.model, tokenizer=args.tokenizer, chat_template=args.chat_template,
                        speculative=spec, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory=args.kv_cache_memory,
                        block_size=args.block_size, seed=getattr(args, "seed", None) or 0,
                        load_format=args.load_format, enforce_eager=args.enforce_eager,
                        enable_prefix_caching=args.enable_prefix_caching, mamba_cache_mode=args.mamba_cache_mode,
                        mamba_block_size=args.mamba_block_size, mamba_cache_snapshots=args.mamba_cache_snapshots,
                        deterministic=args.deterministic, prefill_cuda_graphs=args.prefill_cuda_graphs)


def cmd_generate(args: argparse.Namespace) -> int:
    from blockspec.engine.engine import Engine
    from blockspec.engine.sampling_params import SamplingParams

    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    config = engine_config_from_args(args)
    if args.model is None and config.speculative.model is None and not args.no_draft:
        print("note: no default drafter ships yet for the embedded model; decoding without speculation",
              file=sys.stderr)
    engine = Engine(config)
    text = prompt if args.raw else engine.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    out = engine.generate([text], params)[0]
    st = out.stats
    if args.json:
        stats = {k: v for k, v in st.to_dict().items()}
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "stats": stats}))
    else:
        print(out.text)
        print(f"[{st.completion_tokens} tokens, {st.decode_tok_s:.1f} tok/s decode, tau {st.tau:.2f} over "
              f"{st.steps} steps, k={engine.num_speculative_tokens}, prefill {st.prefill_time * 1000:.0f} ms, "
              f"{engine.device.type} {str(engine.dtype).removeprefix('torch.')}]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockspec", description="DFlash speculative-decoding LLM server")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion for one prompt")
    g.add_argument("prompt", nargs="?", default=None, help="prompt text (default: read stdin)")
    add_engine_args(g)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=cmd_generate)
    from blockspec.server.args import add_serve_parser
    add_serve_parser(sub)
    add_bench_parsers(sub)
    add_train_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BlockspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
