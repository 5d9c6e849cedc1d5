"""Engine and speculative-decoding settings, with vLLM's names and meanings."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from blockspec.errors import ConfigError
from blockspec.structured.reasoning_tags import check_reasoning_parser

MAMBA_CACHE_MODES = ("align", "all", "none")
DEFAULT_MAMBA_BLOCK_SIZE = 256  # tokens between the state snapshots of a hybrid's cached prompt (align mode)
DEFAULT_MAMBA_CACHE_SNAPSHOTS = 16

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16,
          "float": torch.float32}


# vLLM's method names: "mtp" (and its older per-model spellings) runs the target checkpoint's own MTP head
MTP_METHODS = ("mtp", "qwen3_next_mtp", "qwen3_5_mtp")
METHODS = ("dflash", *MTP_METHODS)


@dataclass
class SpeculativeConfig:
    """`--speculative-config` JSON: {"method": "dflash", "model": ..., "num_speculative_tokens": k,
    "max_model_len": drafter context window}, or {"method": "mtp", "num_speculative_tokens": N}."""

    model: str | None = None
    num_speculative_tokens: int | None = None  # None: the drafter's block_size - 1; 1 for MTP
    method: str = "dflash"  # dflash (DFlash 1 and 2 drafter checkpoints) | mtp (the target's own head)
    draft_window: int | None = None  # drafter sees at most this many context tokens
    load_format: str = "auto"  # dummy: random drafter weights in the checkpoint's shapes (benchmarks)
    # "quantization" (vLLM's key): the drafter's weights rounded at load by an online method, fp8 or rtn
    # (RTN_NUM_BITS / RTN_GROUP_SIZE), its drafting LM head a rounded copy of the target's (loader/quant/online.py)
    quantization: str | None = None

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        try:
            raw: dict[str, Any] = json.loads(text)
        except json.JSONDecodeError as exc:
            example = """'{"method": "dflash", "model": "/draft", "num_speculative_tokens": 15}'"""
            raise ConfigError(f"--speculative-config is not valid JSON ({exc.msg}): e.g. {example}") from None
        if not isinstance(raw, dict):
            raise ConfigError("--speculative-config must be a JSON object")
        method = raw.get("method", "dflash")
        if method not in METHODS:
            raise ConfigError(f"speculative method {method!r} is not supported: blockspec runs \"dflash\" (DFlash 1 "
                              f"and 2 drafters) and \"mtp\" (the target's own MTP head; also spelled "
                              f"{', '.join(repr(m) for m in MTP_METHODS[1:])})")
        method = "mtp" if method in MTP_METHODS else method
        k = raw.get("num_speculative_tokens")
        window = raw.get("max_model_len", raw.get("draft_window"))
        model = raw.get("model")
        if method == "mtp" and window is not None:
            raise ConfigError("\"max_model_len\" (the drafter context window) applies to DFlash drafters, "
                              "not to method \"mtp\": drop it")
        quantization = raw.get("quantization")
        if quantization is not None and not isinstance(quantization, str):
            raise ConfigError(f"--speculative-config \"quantization\" must be a method name such as \"fp8\", not "
                              f"{quantization!r}")
        if quantization is not None and method == "mtp":
            raise ConfigError("\"quantization\" applies to a DFlash drafter's own weights; method \"mtp\" drafts "
                              "with the target's head, stored as the target is: drop it")
        return cls(model=model, num_speculative_tokens=None if k is None else int(k),
                   draft_window=None if window is None else int(window), method=method,
                   quantization=None if quantization is None else quantization.lower())

    @property
    def enabled(self) -> bool:
        """Whether a proposer is configured (a drafter checkpoint, or the target's MTP head)."""
        return self.method == "mtp" or self.model is not None


@dataclass
class EngineConfig:
    model: str | None = None  # None: the embedded default model
    tokenizer: str | None = None
    chat_template: str | None = None
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes; CPU default 1 GiB; on CUDA overrides the utilization share
    seed: int = 0
    enforce_eager: bool = False
    load_format: str = "auto"  # auto | dummy (random weights in the checkpoint's shapes)
    generation_config: str = "auto"  # auto: the model's generation_config.json | vllm: ignore it
    # --quantization: checked against what the checkpoint declares (the checkpoint's own format is used)
    quantization: str | None = None
    enable_prefix_caching: bool = True  # as vLLM v1: full KV blocks shared by the hash of their prefix
    # Hybrids (Gated DeltaNet): prefix-cache hits resume from recurrent-state snapshots taken at block
    # boundaries of prompts: every mamba_block_size tokens (align), every block (all), or never (none).
    mamba_cache_mode: str = "align"
    mamba_block_size: int | None = None  # None: DEFAULT_MAMBA_BLOCK_SIZE
    mamba_cache_snapshots: int = DEFAULT_MAMBA_CACHE_SNAPSHOTS  # snapshot entries kept (LRU), each one sequence's state
    # --reasoning-parser: a constrained request's grammar starts after the reasoning-end token (as vLLM)
    reasoning_parser: str | None = None
    # --deterministic: batch-invariant kernels in the target (models/deterministic.py), so greedy output is the
    # same bits for any k and batch; dense, MoE, GPT-OSS and Gated DeltaNet hybrid targets, unquantized or
    # quantized (others are refused)
    deterministic: bool = False
    # --prefill-cuda-graphs: one sequence's prefill of up to 512 new tokens (a prefix-cache hit's turn, a short
    # prompt) replays a CUDA graph (runner/prefill_graphs.py; dense and MoE targets); None: on unless
    # --enforce-eager or --deterministic (whose bit-equality tests run the eager prefill)
    prefill_cuda_graphs: bool | None = None

    def uses_prefill_graphs(self) -> bool:
        """--prefill-cuda-graphs as given, or its default: on where the CUDA graphs are."""
        if self.prefill_cuda_graphs is not None:
            return self.prefill_cuda_graphs
        return not (self.enforce_eager or self.deterministic)

    def snapshot_interval(self) -> int:
        """Tokens between a hybrid prompt's state snapshots; 0 when none are taken."""
        if not self.enable_prefix_caching or self.mamba_cache_mode == "none" or self.mamba_cache_snapshots == 0:
            return 0
        if self.mamba_cache_mode == "all":
            return self.block_size
        return self.mamba_block_size or max(DEFAULT_MAMBA_BLOCK_SIZE, self.block_size)

    def num_state_snapshots(self) -> int:
        """Snapshot entries a hybrid target allocates beside its state slots."""
        return self.mamba_cache_snapshots if self.snapshot_interval() else 0

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda requested but no CUDA GPU is visible: use --device cpu")
        if dev.type not in ("cpu", "cuda"):
            raise ConfigError(f"--device {self.device!r} is not supported: use cpu or cuda")
        return dev

    def resolve_dtype(self, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
        if self.dtype != "auto":
            if self.dtype not in DTYPES:
                raise ConfigError(f"--dtype {self.dtype!r} is not one of auto, float32, bfloat16, float16")
            dtype = DTYPES[self.dtype]
            if device.type == "cpu" and dtype == torch.float16:
                raise ConfigError("--dtype float16 is not supported on CPU: use float32 or bfloat16")
            return dtype
        if device.type == "cpu":
            return torch.float32  # CPU runs are the correctness reference
        if checkpoint_dtype in ("float16", "bfloat16"):
            return DTYPES[checkpoint_dtype]
        return torch.bfloat16

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError("--max-num-seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("--max-num-batched-tokens must be at least 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("--gpu-memory-utilization must be in (0, 1]")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ConfigError("--block-size must be one of 8, 16, 32, 64, 128")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("--max-model-len must be at least 2")
        check_reasoning_parser(self.reasoning_parser)
        if self.prefill_cuda_graphs is True and self.enforce_eager:
            raise ConfigError("--prefill-cuda-graphs captures CUDA graphs, which --enforce-eager turns off: drop one "
                              "of the two")
        k = self.speculative.num_speculative_tokens
        if k is not None and k < 0:
            raise ConfigError("num_speculative_tokens must be non-negative")
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"--load-format {self.load_format!r}: blockspec reads auto (safetensors/GGUF) or dummy")
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ConfigError(f"--mamba-cache-mode {self.mamba_cache_mode!r}: use one of "
                              f"{', '.join(MAMBA_CACHE_MODES)}")
        if self.mamba_block_size is not None and (self.mamba_block_size < 1 or self.mamba_block_size % self.block_size):
            raise ConfigError(f"--mamba-block-size {self.mamba_block_size} must be a positive multiple of --block-size "
                              f"{self.block_size} (snapshots sit on block boundaries)")
        if self.mamba_cache_snapshots < 0:
            raise ConfigError("--mamba-cache-snapshots must be non-negative")
        if self.quantization is not None:
            from blockspec.loader.quant.config import check_flag

            check_flag(self.quantization)
        if self.speculative.quantization is not None:
            from blockspec.loader.quant.online import draft_head_copy, online_scheme

            online_scheme(self.speculative.quantization)  # a known method, and RTN_* readable
            draft_head_copy()  # BLOCKSPEC_DRAFT_HEAD readable, before anything loads
