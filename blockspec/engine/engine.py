"""The engine: add requests, step, read outputs. Everything runs through one step function.

A step is "schedule -> draft -> verify in one target pass -> accept"; plain autoregressive decoding
is the k = 0 case of the same step. The engine is single-threaded by design: the server drives it
from one worker thread and talks to it through queues.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from blockspec.config import EngineConfig
from blockspec.engine.detokenizer import IncrementalDetokenizer
from blockspec.engine.kv_cache import PrefixCacheStats
from blockspec.engine.memory import load_peak, plan_kv_blocks, start_load_peak
from blockspec.engine.outputs import RequestOutput, SpecDecodeCounters
from blockspec.engine.sampling_params import SamplingParams
from blockspec.engine.scheduler import Scheduler
from blockspec.engine.sequence import Sequence
from blockspec.engine.state_pool import allocate_state, block_allocator, resize_for_k
from blockspec.errors import ConfigError, OutOfMemoryError, RequestError
from blockspec.kernels import lane_order
from blockspec.loader.quant.config import declared_quantization
from blockspec.loader.quant.online import draft_head_copy, online_scheme
from blockspec.loader.tokenizer import load_eos_token_ids, load_tokenizer
from blockspec.loader.weights import load_weights, resolve_model_path
from blockspec.models import deterministic
from blockspec.models.model_config import ModelConfig
from blockspec.models.registry import model_class
from blockspec.runner.model_runner import ModelRunner
from blockspec.spec.dflash import DFlashDrafter, DrafterConfig
from blockspec.spec.proposer import Proposer
from blockspec.spec.synthetic import SyntheticProposer

log = logging.getLogger("blockspec")


def build_module(factory, device: torch.device, dtype: torch.dtype):
    """Construct a module directly on `device` in `dtype` (no full-precision CPU copy first)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            module = factory()
    finally:
        torch.set_default_dtype(previous)
    return module.eval().requires_grad_(False)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self.device = config.resolve_device()
        self.model_dir: Path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.dtype = config.resolve_dtype(self.device, self.model_config.torch_dtype)
        self.tokenizer = load_tokenizer(self.model_dir, config.tokenizer, config.chat_template)
        self.eos_ids = load_eos_token_ids(self.model_dir, self.tokenizer) if config.generation_config != "vllm" \
            else [self.tokenizer.eos_token_id]
        self.max_model_len = self._max_model_len()
        torch.manual_seed(config.seed)

        try:
            load_base = start_load_peak(self.device)
            drafter = self._load_drafter()
            target = self._load_target()
            if drafter is not None and drafter.online is not None and draft_head_copy():
                drafter.copy_head(target.lm_head_weight)  # once the target's head exists
            # the configured proposer, kept when k is set to 0 or drafts turn synthetic, so it can come back
            self.proposer: Proposer | None = drafter if drafter is not None else self._load_mtp(target)
            # device bytes at the load's peak over those held before it (None off CUDA): weights + what loading
            # briefly held beside them; the start-up report prints it beside the weights
            self.load_peak_bytes: int | None = load_peak(self.device, load_base)
        except torch.OutOfMemoryError:
            raise OutOfMemoryError(self._weights_oom_message()) from None
        self.num_speculative_tokens = self._initial_k()
        self.synthetic: SyntheticProposer | None = None  # benchmark/test mode: drafts from known tokens
        # the proposer's K/V is planned and allocated even at k = 0, so a later k > 0 finds it
        self.runner = ModelRunner(target, self.proposer, self.device, self.dtype, config.block_size,
                                  config.speculative.draft_window)
        allocate_state(self)  # hybrid models: recurrent-state slots, before the KV cache is sized
        num_blocks = plan_kv_blocks(self)
        self.runner.allocate_kv_cache(num_blocks)
        if not self.num_speculative_tokens:
            self.runner.proposer = None
        self.runner.num_speculative_tokens = self.num_speculative_tokens
        self._prepare_decode()
        self.allocator = block_allocator(self, num_blocks)  # + a state slot per sequence for hybrids
        self.allocator.tracks_drafter = self.runner.keeps_context
        self.scheduler = Scheduler(self.allocator, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, self.num_speculative_tokens)
        self._set_lookahead()
        self.requests: dict[str, Sequence] = {}
        self.spec_counters = SpecDecodeCounters(accepted_per_pos=[0] * self.num_speculative_tokens)
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(config.seed)

    # ---- loading ------------------------------------------------------------------------------

    def _weights_oom_message(self) -> str:
        files = list(self.model_dir.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files) / (1 << 30)
        free = torch.cuda.mem_get_info(self.device)[0] / (1 << 30) if self.device.type == "cuda" else 0.0
        return (f"the model's weights ({size:.1f} GiB on disk) do not fit on {self.device} ({free:.1f} GiB free): "
                "free the GPU, use a smaller model, or a lower-precision --dtype")

    def _max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        want = self.config.max_model_len or limit
        if want > limit:
            raise ConfigError(f"--max-model-len {want} exceeds the model's max_position_embeddings {limit}: lower it")
        return want

    def _load_target(self) -> torch.nn.Module:
        from blockspec.loader.quant import deferred_linears, detect_quantization, finalize_quantized, quantize_model

        cls = model_class(self.model_config)
        rope_len = self.max_model_len + self.config.block_size  # verify blocks may look past the end
        quant = detect_quantization(self.model_dir, self.config.quantization)
        if self.config.deterministic:
            refusal = deterministic.problem(cls, self.model_config.architecture,
                                            None if quant is None else quant.description)
            if refusal is not None:
                raise ConfigError(refusal)
        # quantized: linear weights are placed by quantize_model, never in full precision first
        with deferred_linears() if quant is not None else contextlib.nullcontext():
            model = build_module(lambda: cls(self.model_config, max_positions=rope_len), self.device, self.dtype)
        if quant is not None:
            quantize_model(model, quant, self.device, self.dtype)
            if self.config.deterministic:  # the layouts the layers were built in, before any weight is read
                refusal = deterministic.problem(cls, self.model_config.architecture, quant.description,
                                                deterministic.quantized_schemes(model))
                if refusal is not None:
                    raise ConfigError(refusal)
        if self.config.load_format != "dummy":
            load_weights(model, self.model_dir, self.device, self.dtype)
        elif quant is not None:
            finalize_quantized(model)
        if quant is not None and not self.config.deterministic:
            ordered = lane_order.order_model(model)
            if ordered:
                log.info("%d NVFP4 layers stored in the mma kernels' lane order", ordered)
        if self.config.deterministic:
            model.set_deterministic(True)
        log.info("numerics: %s", deterministic.report(self.config.deterministic, self.device))
        return model

    def _initial_k(self) -> int:
        """num_speculative_tokens as configured: a DFlash drafter's block_size - 1 by default, 1 for MTP."""
        proposer, k = self.proposer, self.config.speculative.num_speculative_tokens
        if proposer is None:
            return 0
        if k is None:
            k = proposer.max_drafts if proposer.method.startswith("dflash") else 1
        self._check_k(k, proposer)
        return k

    @staticmethod
    def _check_k(k: int, proposer: Proposer) -> None:
        limit = proposer.max_drafts
        if limit is not None and k > limit:
            what = "the drafter's block_size - 1" if proposer.method.startswith("dflash") else "the MTP maximum"
            raise ConfigError(f"num_speculative_tokens {k} exceeds {what} = {limit}: lower it")

    def _load_mtp(self, target: torch.nn.Module) -> Proposer | None:
        """The target checkpoint's own MTP head, when --speculative-config asks for method mtp."""
        spec = self.config.speculative
        if spec.method != "mtp":
            return None
        from blockspec.spec.mtp import build_mtp

        if spec.model is not None and Path(spec.model).resolve() != self.model_dir.resolve():
            raise ConfigError(f"method \"mtp\" drafts with the served checkpoint's own MTP head, but \"model\" names "
                              f"{spec.model}: drop \"model\" (or name the served model)")
        rope_len = self.max_model_len + self.config.block_size
        return build_mtp(self.model_config, target, self.model_dir, rope_len, self.device, self.dtype,
                         load=self.config.load_format != "dummy")

    def _load_drafter(self) -> DFlashDrafter | None:
        spec = self.config.speculative
        if spec.model is None or spec.method != "dflash":
            return None
        draft_dir = Path(spec.model)
        if not draft_dir.is_dir():
            raise ConfigError(f"draft model {spec.model} is not a directory: pass a z-lab DFlash checkpoint directory")
        cfg = DrafterConfig.from_dir(draft_dir)
        cfg.check_target(self.model_config)
        rope_len = self.max_model_len + cfg.block_size
        declared, source = declared_quantization(draft_dir)
        if declared is not None:
            method = declared.get("quant_method") or "a quantization"
            raise ConfigError(f"draft model {spec.model} is stored quantized ({source} declares {method}); "
                              "blockspec reads DFlash drafters in bf16 / fp16 / fp32 and quantizes them itself: "
                              "point \"model\" at the unquantized drafter and add \"quantization\": \"fp8\" (or "
                              "\"rtn\") to --speculative-config")
        drafter = build_module(lambda: DFlashDrafter(cfg, rope_len), self.device, self.dtype)
        if "dummy" not in (self.config.load_format, spec.load_format):
            load_weights(drafter, draft_dir, self.device, self.dtype)
        if spec.quantization is not None:  # its layers now (their bf16 freed before the target loads), its head later
            drafter.quantize_online(online_scheme(spec.quantization))
        return drafter

    def enable_synthetic_drafts(self, references: dict[str, list[int]], accept_prob: float, k: int) -> None:
        """Benchmark/test mode: drafts come from known continuations (see spec/synthetic.py)."""
        synthetic = SyntheticProposer(references, accept_prob, self.model_config.vocab_size, self.config.seed)
        self._use_proposer(synthetic, k)

    def set_num_speculative_tokens(self, k: int) -> None:
        """Change k between requests (`blockspec tune` sweeps it; for MTP it is N); k = 0 decodes without
        a proposer. Synthetic drafts end: the configured proposer drafts again.

        The proposer's weights and KV cache stay allocated; the step's static buffers and CUDA graphs
        are rebuilt for the new block size.
        """
        if k and self.proposer is None:
            raise ConfigError("k > 0 needs a proposer: pass --draft, or a --speculative-config with a drafter "
                              "\"model\" or \"method\": \"mtp\"")
        if k < 0:
            raise ConfigError(f"num_speculative_tokens {k} must be 0 or more")
        if k:
            self._check_k(k, self.proposer)
        self._use_proposer(self.proposer, k)

    def _use_proposer(self, proposer: Proposer | None, k: int) -> None:
        if self.has_unfinished_requests():
            raise ConfigError("k can only change while no request is running")
        self.synthetic = proposer if isinstance(proposer, SyntheticProposer) else None
        self.runner.proposer = proposer if k else None
        resize_for_k(self, k)  # checkpoint mode keeps k + 1 states per slot
        # cached blocks hold drafter context only if the drafter ran; snapshots may have been re-made
        self.reset_prefix_cache()
        self.allocator.tracks_drafter = self.runner.keeps_context
        self.num_speculative_tokens = self.scheduler.k = self.runner.num_speculative_tokens = k
        self.spec_counters = SpecDecodeCounters(accepted_per_pos=[0] * k)
        self._prepare_decode()
        self._set_lookahead()

    def _prepare_decode(self) -> None:
        """The runner's CUDA-graph fast paths for the current proposer and k (at start-up and when k changes)."""
        c = self.config
        self.runner.prepare_decode(c.max_num_seqs, self.max_model_len, not c.enforce_eager, log.info,
                                   c.max_num_batched_tokens if c.uses_prefill_graphs() else 0)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block and state snapshot (vLLM's name). Call it after changing the target's
        or the drafter's weights in place: cached K/V and drafter context were computed with the old ones."""
        self.allocator.reset_cache()

    def _set_lookahead(self) -> None:
        decode = self.runner.decode
        self.scheduler.lookahead = decode.q if decode is not None and decode.pipelined else 0

    # ---- requests -----------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], **kwargs) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("this model has no chat template: pass --chat-template or use a raw prompt", "messages")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)

    def check_prompt_ids(self, ids: list[int]) -> None:
        """RequestError unless `ids` is a non-empty prompt of this vocabulary's token ids (before anything, a
        detokenizer included, reads them: an id past int64 overflows there)."""
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:  # (a generator over a 6,000-token prompt: ~0.5 ms of a hit's TTFT)
            raise RequestError(f"prompt token ids must be in [0, {vocab})", "prompt")

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=False) if prompt else []

    @functools.cached_property
    def grammar_compiler(self):
        """Structured output's compiler for this model's vocabulary, built by the first request that needs it."""
        from blockspec.structured.compiler import GrammarCompiler

        return GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_ids)

    @functools.cached_property
    def reasoning_tokens(self):
        """The reasoning parser's tag ids, for grammars that start after the reasoning; None without a
        parser, or where the tokenizer has no single end token (then grammars start at the first token)."""
        from blockspec.structured.reasoning_tags import reasoning_tokens

        if self.config.reasoning_parser is None:
            return None
        found = reasoning_tokens(self.tokenizer, self.config.reasoning_parser)
        if found is None:
            log.warning("the tokenizer has no single token for the end of reasoning of --reasoning-parser %s: "
                        "structured outputs are enforced from the first output token, thought included",
                        self.config.reasoning_parser)
        return found

    def _grammar(self, spec, prompt_ids: list[int]):
        """A new sequence's grammar; behind its reasoning where a reasoning parser is set."""
        matcher = self.grammar_compiler.matcher(spec)
        tags = self.reasoning_tokens
        if tags is None:
            return matcher
        from blockspec.structured.reasoning_gate import ReasoningGatedGrammar

        return ReasoningGatedGrammar(matcher, tags.end_id, ended=tags.ended_in(prompt_ids))

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """Queue a request; raises RequestError (with the numbers) if it cannot run."""
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already running", "request_id")
        params = dataclasses.replace(params)  # the engine fills in max_tokens: never touch the caller's copy
        params.validate()
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_prompt_ids(ids)
        room = self.max_model_len - len(ids)
        if room < 1:
            raise RequestError(f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}: "
                               "shorten the prompt or raise --max-model-len", "prompt")
        if params.max_tokens is None:
            params.max_tokens = room
        elif params.max_tokens > room:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
                               f"{len(ids) + params.max_tokens} exceeds max_model_len {self.max_model_len}: "
                               "lower max_tokens or shorten the prompt", "max_tokens")
        generator = self._generator
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens) if params.detokenize else None
        seq = Sequence(request_id, ids, params, detok, self.eos_ids, generator)
        if params.structured is not None:
            seq.grammar = self._grammar(params.structured, ids)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; False if it is unknown or already done."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        seq.finish_reason = "abort"
        self._finish(seq)
        return True

    def _finish(self, seq: Sequence) -> None:
        if self.allocator.enable_caching and seq.block_table:
            self.runner.complete_context(seq)  # its last blocks complete for the prefix cache
        self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        return self.allocator.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prompt tokens looked up in the prefix cache and found there (vLLM's queries / hits)."""
        return self.allocator.stats

    def release(self) -> None:
        """Give the KV cache (and the allocator's cached GPU memory) back now, before another engine plans
        its memory: the runner and its decode step reference each other, so dropping the engine frees
        them only when a garbage collection happens to run."""
        self.runner.allocate_kv_cache(0)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if not sched.items:
            return []
        now = time.perf_counter()
        for item in sched.items:
            if item.seq.stats.first_scheduled_time is None:
                item.seq.stats.first_scheduled_time = now
        results = self.runner.execute(sched)
        outputs = []
        now = time.perf_counter()
        for res in results:
            if res.tokens:
                outputs.append(self._commit(res.seq, res.tokens, res.num_drafts, res.num_accepted, res.logprobs, now))
        self.allocator.step_done([item.seq for item in sched.items])  # completed blocks join the prefix cache
        return outputs

    def _commit(self, seq: Sequence, tokens: list[int], num_drafts: int, num_accepted: int,
                logprobs, now: float) -> RequestOutput:
        decoding = seq.num_output > 0
        new_ids: list[int] = []
        delta = ""
        for tok in tokens:
            new_ids.append(tok)
            delta += seq.append_token(tok)
            if seq.finish_reason is not None:
                break
        st = seq.stats
        if decoding:
            st.steps += 1
            st.decode_tokens += len(new_ids)
            st.num_draft_tokens += num_drafts
            if not st.accepted_per_position:
                st.accepted_per_position = [0] * self.num_speculative_tokens
            for i in range(min(num_accepted, len(new_ids))):
                st.accepted_per_position[i] += 1
                self.spec_counters.accepted_per_pos[i] += 1
            if num_drafts:
                self.spec_counters.num_drafts += 1
                self.spec_counters.num_draft_tokens += num_drafts
                self.spec_counters.num_accepted_tokens += min(num_accepted, len(new_ids))
        elif st.first_token_time is None:
            st.first_token_time = now
        if logprobs:
            seq.logprobs.extend(logprobs[:len(new_ids)])
        if seq.finish_reason is not None:
            st.finish_time = now
            self._finish(seq)
            self.requests.pop(seq.request_id, None)
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_ids, token_ids=list(seq.output_ids),
            new_token_ids=new_ids, text=seq.text, new_text=delta, finished=seq.finished,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, stats=st,
            new_logprobs=logprobs[:len(new_ids)] if logprobs else None)

    def generate(self, prompts: Iterable[str | list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[RequestOutput]:
        """Run prompts to completion together (continuous batching); outputs in prompt order."""
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids) and self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]
