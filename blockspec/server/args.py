"""`blockspec serve [MODEL] [flags]`: vLLM's `serve` flags, so a seed's `vllm serve ...` command runs
with only the program name swapped.

Flags that mean something to blockspec keep vLLM's meaning. vLLM flags that do not apply (kernel
backends, parallelism, load formats) are accepted with one warning line each, never an error:
users paste whole launch scripts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

from blockspec.cli import add_engine_args, engine_config_from_args
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.errors import ConfigError
from blockspec.server.reasoning import PARSERS, check_parser
from blockspec.server.served_models import check_defaults, parse_alias
from blockspec.server.server_config import ServerConfig
from blockspec.server.tool_parsers import PARSERS as TOOL_PARSERS
from blockspec.server.tool_parsers import check_tool_parser

log = logging.getLogger("blockspec.server")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

# vLLM flags blockspec accepts and ignores: (flags, takes a value, why it does not apply).
_KERNELS = "blockspec picks its own kernels"
_ONE_GPU = "blockspec runs one model on one GPU"
_NOT_YET = "not implemented in blockspec yet"
IGNORED_FLAGS: list[tuple[tuple[str, ...], bool, str]] = [
    (("--trust-remote-code",), False, "blockspec runs its own model code, never a checkpoint's"),
    (("--attention-backend",), True, _KERNELS),
    (("--moe-backend",), True, _KERNELS),
    (("--language-model-only",), False, "blockspec always loads the language model only (vision weights are "
                                        "skipped)"),
    (("--prefix-caching-hash-algo",), True, "blocks are always keyed by SHA-256"),
    (("--tensor-parallel-size", "-tp"), True, _ONE_GPU),
    (("--pipeline-parallel-size", "-pp"), True, _ONE_GPU),
    (("--data-parallel-size", "-dp"), True, _ONE_GPU),
    (("--distributed-executor-backend",), True, _ONE_GPU),
    (("--enable-expert-parallel",), False, _ONE_GPU),
    (("--disable-custom-all-reduce",), False, _ONE_GPU),
    (("--enable-chunked-prefill",), False, "chunked prefill is always on"),
    (("--async-scheduling",), False, "the scheduler's design is fixed"),
    (("--scheduling-policy",), True, "the scheduler is first-come first-served"),
    (("--disable-log-requests",), False, "blockspec does not log request contents"),
    (("--enable-log-requests",), False, "blockspec does not log request contents"),
    (("--swap-space",), True, "preempted requests are recomputed, not swapped"),
    (("--cpu-offload-gb",), True, _NOT_YET),
    (("--compilation-config", "-O"), True, _KERNELS),
    (("--max-seq-len-to-capture",), True, _KERNELS),
    (("--max-cudagraph-capture-size",), True, _KERNELS),
    (("--num-gpu-blocks-override",), True, "KV blocks come from --gpu-memory-utilization"),
    (("--calculate-kv-scales",), False, "the KV cache is not quantized"),
    (("--limit-mm-per-prompt",), True, "blockspec serves text only"),
    (("--mm-processor-kwargs",), True, "blockspec serves text only"),
    (("--download-dir",), True, "no model hub is used: pass a local directory"),
    (("--revision",), True, "no model hub is used: pass a local directory"),
    (("--tokenizer-revision",), True, "no model hub is used: pass a local directory"),
    (("--tokenizer-mode",), True, "blockspec always uses the fast tokenizer"),
    (("--hf-overrides",), True, _NOT_YET),
    (("--safetensors-load-strategy",), True, "weights always stream tensor by tensor to the device"),
    (("--model-loader-extra-config",), True, "weights always stream tensor by tensor to the device"),
    (("--max-logprobs",), True, "logprobs are capped at 20"),
    (("--logprobs-mode",), True, "logprobs are the raw model's"),
    (("--chat-template-content-format",), True, "text parts are joined into one string"),
    (("--enable-lora",), False, _NOT_YET),
    (("--enable-sleep-mode",), False, _NOT_YET),
    (("--disable-frontend-multiprocessing",), False, "the server and engine share one process already"),
    (("--enable-force-include-usage",), False, "ask with stream_options.include_usage"),
    (("--enable-prompt-tokens-details",), False, "usage.prompt_tokens_details.cached_tokens is always reported"),
    (("--return-tokens-as-token-ids",), False, "ask with return_token_ids"),
    (("--enable-request-id-headers",), False, _NOT_YET),
    (("--disable-fastapi-docs",), False, _NOT_YET),
    (("--allowed-origins",), True, "CORS is " + _NOT_YET),
    (("--allowed-methods",), True, "CORS is " + _NOT_YET),
    (("--allowed-headers",), True, "CORS is " + _NOT_YET),
    (("--ssl-keyfile",), True, "TLS is " + _NOT_YET + ": put a reverse proxy in front"),
    (("--ssl-certfile",), True, "TLS is " + _NOT_YET + ": put a reverse proxy in front"),
    (("--mamba-ssm-cache-dtype",), True, _NOT_YET),
    (("--mamba-cache-dtype",), True, _NOT_YET),
]
SUPPORTED_LOAD_FORMATS = ("auto", "dummy")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float", "bf16", "fp16", "fp32")


def _dest(flags: tuple[str, ...]) -> str:
    return "ignored_" + flags[0].lstrip("-").replace("-", "_")


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    from blockspec.structured.backend import BACKEND

    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (vLLM's flags)",
        description="Serve MODEL (default: the embedded SmolLM2-135M-Instruct) over an OpenAI-compatible API. "
                    "Takes vLLM's `serve` flags.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF model directory or .gguf file (overrides --model)")
    add_engine_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all interfaces)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: $VLLM_API_KEY)")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients use as `model` (several: aliases; default: MODEL as given)")
    s.add_argument("--alias", action="append", default=[], metavar="NAME[:key=value,...]",
                   help="one more served name with its own default sampling parameters, e.g. fast:temperature=0")
    s.add_argument("--speculative-config", default=None,
                   help='JSON, e.g. {"method": "dflash", "model": "/draft", "num_speculative_tokens": 15, '
                        '"max_model_len": 1024, "quantization": "rtn"} (DFlash 1 or 2 drafters; "quantization": '
                        'fp8 or rtn (RTN_NUM_BITS, RTN_GROUP_SIZE) rounds the drafter at load), or {"method": "mtp", '
                        '"num_speculative_tokens": 3} (the checkpoint\'s own MTP head: Qwen3-Next, Qwen3.5/3.6)')
    s.add_argument("--kv-cache-dtype", default="auto", help="auto: the model dtype")
    s.add_argument("--quantization", "-q", default=None,
                   help="the checkpoint's quantization method (vLLM's names: compressed-tensors, modelopt, "
                        "modelopt_fp4, fp8, gptq, awq, auto-round); checked against what the checkpoint declares")
    s.add_argument("--reasoning-parser", default=None, choices=sorted(PARSERS),
                   help="put <think>...</think> into reasoning_content")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model call tools on its own (tool_choice "auto", the default when tools are '
                        "given); needs --tool-call-parser")
    s.add_argument("--tool-call-parser", default=None, metavar="{" + ",".join(TOOL_PARSERS) + "}",
                   help="how the model writes tool calls: hermes (Qwen2.5/Qwen3), qwen3_coder and qwen3_xml "
                        "(Qwen3-Coder, Qwen3.5/3.6), llama3_json")
    s.add_argument("--generation-config", default="auto",
                   help="sampling defaults: auto (the model's generation_config.json), vllm (none), or a folder")
    s.add_argument("--override-generation-config", default=None, help='JSON, e.g. {"temperature": 0.6}')
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                   help=f'structured outputs (JSON schema, regex, choice, grammar), e.g. {{"backend": '
                        f'"{BACKEND}"}}: backend {BACKEND} or auto (others are refused)')
    s.add_argument("--structured-outputs-config.backend", "--guided-decoding-backend", dest="structured_backend",
                   default=None, metavar="BACKEND", help=f"{BACKEND} or auto")
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    s.add_argument("--disable-uvicorn-access-log", action="store_true")
    s.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic throughput / draft-acceptance log line")
    ig = p.add_argument_group("vLLM flags accepted and ignored (one warning each)",
                              " ".join(flags[0] for flags, _, _ in IGNORED_FLAGS))
    for flags, takes_value, _ in IGNORED_FLAGS:
        if takes_value:
            ig.add_argument(*flags, dest=_dest(flags), default=None, help=argparse.SUPPRESS)
        else:
            ig.add_argument(*flags, dest=_dest(flags), action=argparse.BooleanOptionalAction, default=None,
                            help=argparse.SUPPRESS)
    p.set_defaults(func=run_serve)
    return p


def warn_ignored(args: argparse.Namespace) -> list[str]:
    """One warning line per ignored flag given; returns the lines (also logged)."""
    lines = []
    for flags, takes_value, why in IGNORED_FLAGS:
        value = getattr(args, _dest(flags), None)
        if value is not None:
            shown = f"{flags[0]} {value}" if takes_value else flags[0]
            lines.append(f"warning: {shown} is ignored: {why}")
    if args.load_format not in SUPPORTED_LOAD_FORMATS:
        lines.append(f"warning: --load-format {args.load_format} is ignored: weights always stream tensor by "
                     "tensor to the device")
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        lines.append(f"warning: --kv-cache-dtype {args.kv_cache_dtype} is ignored: the KV cache is kept in the "
                     "model dtype (quantized KV is not implemented yet)")
    elif args.kv_cache_dtype != "auto":
        lines.append(f"warning: --kv-cache-dtype {args.kv_cache_dtype} is ignored: the KV cache is kept in the "
                     "model dtype (set --dtype)")
    for line in lines:
        log.warning(line)
    return lines


def build_engine_config(args: argparse.Namespace) -> EngineConfig:
    if args.model_tag is not None:
        args.model = args.model_tag
    if args.load_format not in SUPPORTED_LOAD_FORMATS:
        args.load_format = "auto"
    config = engine_config_from_args(args)
    config.generation_config = "vllm" if args.generation_config == "vllm" else "auto"
    config.quantization = args.quantization
    config.reasoning_parser = args.reasoning_parser  # constrained output starts after the reasoning
    if args.speculative_config is not None:
        if args.draft is not None or args.num_speculative_tokens is not None or args.draft_window is not None:
            raise ConfigError("--speculative-config and --draft/--num-speculative-tokens/--draft-window say the "
                              "same thing: use one")
        config.speculative = SpeculativeConfig.from_json(args.speculative_config)
        if args.no_draft:
            config.speculative = SpeculativeConfig()
        elif not config.speculative.enabled:
            log.warning("warning: --speculative-config names no draft \"model\": decoding without speculation")
    if args.model is None and not config.speculative.enabled and not args.no_draft:
        log.info("note: no drafter found for the embedded model; decoding without speculation")
    return config


def check_structured_outputs(args: argparse.Namespace) -> None:
    """--structured-outputs-config / --guided-decoding-backend: the one grammar engine, or a clear refusal."""
    from blockspec.structured.backend import BACKEND, backend_problem

    backends = [args.structured_backend] if args.structured_backend is not None else []
    if args.structured_outputs_config is not None:
        try:
            config = json.loads(args.structured_outputs_config)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--structured-outputs-config is not valid JSON ({exc.msg}): pass e.g. "
                              f'\'{{"backend": "{BACKEND}"}}\'') from None
        if not isinstance(config, dict):
            raise ConfigError("--structured-outputs-config must be a JSON object, e.g. "
                              f'\'{{"backend": "{BACKEND}"}}\'')
        unknown = sorted(set(config) - {"backend", "disable_fallback"})
        if unknown:
            raise ConfigError(f"--structured-outputs-config: {', '.join(unknown)} not supported by blockspec "
                              "(it takes backend and disable_fallback)")
        if "backend" in config:
            backends.append(config["backend"])
    for backend in backends:
        problem = backend_problem(backend)
        if problem is not None:
            raise ConfigError(problem)


def build_server_config(args: argparse.Namespace) -> ServerConfig:
    check_parser(args.reasoning_parser)
    check_tool_parser(args.tool_call_parser)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ConfigError(f"--enable-auto-tool-choice needs --tool-call-parser (one of {', '.join(TOOL_PARSERS)})")
    names = args.served_model_name or [args.model if args.model is not None else DEFAULT_MODEL_NAME]
    aliases: dict[str, dict[str, Any]] = {}
    for text in args.alias:
        name, defaults = parse_alias(text)
        if name in aliases:
            raise ConfigError(f"--alias {name} is given twice")
        aliases[name] = defaults
    override: dict[str, Any] = {}
    if args.override_generation_config:
        try:
            override = json.loads(args.override_generation_config)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--override-generation-config is not valid JSON ({exc.msg})") from None
        if not isinstance(override, dict):
            raise ConfigError("--override-generation-config must be a JSON object")
        if "max_new_tokens" in override:
            override["max_tokens"] = override.pop("max_new_tokens")
        override = check_defaults(override, "--override-generation-config")
    if args.generation_config not in ("auto", "vllm") and not os.path.isdir(args.generation_config):
        raise ConfigError(f"--generation-config {args.generation_config}: not auto, vllm or a folder")
    check_structured_outputs(args)
    key = args.api_key if args.api_key is not None else os.environ.get("VLLM_API_KEY") or None
    return ServerConfig(
        served_model_names=names, model_root=args.model or DEFAULT_MODEL_NAME, host=args.host, port=args.port,
        api_keys=[key] if key else [], aliases=aliases, reasoning_parser=args.reasoning_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
        generation_config=args.generation_config, override_generation_config=override,
        uvicorn_log_level=args.uvicorn_log_level, access_log=not args.disable_uvicorn_access_log,
        log_stats=not args.disable_log_stats)


def run_serve(args: argparse.Namespace) -> int:
    from blockspec.server.launch import bind_socket, serve

    warn_ignored(args)
    engine_config = build_engine_config(args)
    server_config = build_server_config(args)
    sock = bind_socket(server_config.host, server_config.port)  # a busy port fails before any import

    def build_engine():
        from blockspec.engine.engine import Engine

        return Engine(engine_config)

    return serve(server_config, build_engine, sock)
