"""Measuring a drafter the way it will serve: through our Engine, at temperature 0.

tau (tokens committed per verify step) and per-position acceptance come from the engine's own
request statistics over a batch of prompts; speed is batch-1 decode tok/s of the same prompts with
and without the drafter, side by side, plus whether the two outputs are token-identical.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.engine.outputs import RequestOutput
from blockspec.engine.sampling_params import SamplingParams
from blockspec.spec.dflash import DFlashDrafter


def tau_from_outputs(outputs: Sequence[RequestOutput], k: int) -> dict[str, Any]:
    """Aggregate tau and per-position acceptance rate (accepted drafts at position i per step)."""
    steps = sum(o.stats.steps for o in outputs)
    tokens = sum(o.stats.decode_tokens for o in outputs)
    per_pos = [0] * k
    for o in outputs:
        for i, n in enumerate(o.stats.accepted_per_position[:k]):
            per_pos[i] += n
    return {"tau": tokens / steps if steps else 0.0, "steps": steps, "decode_tokens": tokens,
            "prompts": len(outputs), "k": k,
            "acceptance_per_position": [round(n / steps, 4) if steps else 0.0 for n in per_pos]}


def measure_tau(engine: Engine, prompts: Sequence[str | list[int]], max_tokens: int) -> dict[str, Any]:
    """Greedy generation of all prompts together; tau over every verify step."""
    outputs = engine.generate(list(prompts), SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return tau_from_outputs(outputs, engine.num_speculative_tokens)


def chat_texts(engine: Engine, conversations: Sequence[list[dict[str, str]]]) -> list[str]:
    return [engine.apply_chat_template(messages) for messages in conversations]


class TauEvaluator:
    """Periodic evaluation during training: copy the training weights into the engine's drafter."""

    def __init__(self, engine: Engine, prompts: Sequence[str], max_tokens: int) -> None:
        if engine.runner.proposer is None:
            raise ValueError("the evaluation engine needs a drafter")
        self.engine, self.prompts, self.max_tokens = engine, list(prompts), max_tokens

    @torch.no_grad()
    def __call__(self, drafter: DFlashDrafter) -> dict[str, Any]:
        self.engine.runner.proposer.load_state_dict(drafter.state_dict())
        self.engine.reset_prefix_cache()  # cached blocks hold the old weights' drafter context
        t0 = time.perf_counter()
        result = measure_tau(self.engine, self.prompts, self.max_tokens)
        result["eval_s"] = round(time.perf_counter() - t0, 2)
        return result


@dataclass
class SpeedRun:
    tok_s: float
    decode_tokens: int
    decode_s: float
    outputs: list[list[int]]
    tau: float | None = None


def _batch1(engine: Engine, prompts: Sequence[str], max_tokens: int) -> SpeedRun:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    engine.generate([prompts[0]], params)  # warm-up
    outs = [engine.generate([p], params)[0] for p in prompts]
    tokens = sum(o.stats.decode_tokens for o in outs)
    seconds = sum(o.stats.decode_time for o in outs)
    tau = tau_from_outputs(outs, engine.num_speculative_tokens)["tau"] if engine.num_speculative_tokens else None
    return SpeedRun(tokens / seconds if seconds else 0.0, tokens, seconds, [o.token_ids for o in outs], tau)


def measure_speed(target: str | None, drafter_dir: Path, conversations: Sequence[list[dict[str, str]]],
                  max_tokens: int, device: str, k: int | None = None, **engine_kw: Any) -> dict[str, Any]:
    """Batch-1 greedy decode tok/s, autoregressive vs DFlash, on the same prompts, one engine at a time."""
    common = dict(model=target, device=device, max_num_seqs=1, **engine_kw)
    ar = Engine(EngineConfig(**common))
    texts = chat_texts(ar, conversations)
    ar_run = _batch1(ar, texts, max_tokens)
    info = {"device": str(ar.device), "dtype": str(ar.dtype).removeprefix("torch.")}
    ar.release()
    del ar
    spec = SpeculativeConfig(model=str(drafter_dir), num_speculative_tokens=k)
    sp = Engine(EngineConfig(**common, speculative=spec))
    sp_run = _batch1(sp, texts, max_tokens)
    info["k"] = sp.num_speculative_tokens
    sp.release()
    del sp
    same = sum(a == b for a, b in zip(ar_run.outputs, sp_run.outputs))
    return {**info, "prompts": len(texts), "max_tokens": max_tokens,
            "ar_tok_s": round(ar_run.tok_s, 2), "dflash_tok_s": round(sp_run.tok_s, 2),
            "speedup": round(sp_run.tok_s / ar_run.tok_s, 3) if ar_run.tok_s else 0.0,
            "tau": round(sp_run.tau or 0.0, 3), "identical_outputs": f"{same}/{len(texts)}",
            "ar_decode_tokens": ar_run.decode_tokens, "dflash_decode_tokens": sp_run.decode_tokens}
