"""Training data: the target's own answers to the prompts, generated through our Engine, kept on disk.

Self-distillation: the drafter must predict what *this* target writes, so the target writes the
responses, batched through blockspec's engine. Sample i answers prompt i % P; the first pass over
the prompts is greedy (the distribution temperature-0 serving sees). Later passes sample only a short
lead-in (`sampled_prefix` tokens at `temperature`, per-sample seed, so the data is reproducible) and
continue greedily from it: the lead-in makes each pass a different answer, the greedy remainder is a
chain the drafter is later scored on (greedy acceptance), not noise around it. `sampled_prefix=0`
samples whole responses instead. With `self_prompts` > 0 that share of the later samples answers
a user message the target wrote itself, starting from one of our openers ("Complete the following
Python function ... def "), as Magpie-style self-instruct data is made: far more distinct prompts
than any hand-written set, in the target's own distribution; those answers are greedy throughout.
Samples are written in shards
(safetensors: flat token ids, response mask, offsets); a rerun skips finished shards, and asking
for more samples later only generates the missing ones.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from blockspec.engine.sampling_params import SamplingParams
from blockspec.errors import ConfigError
from blockspec.train.prompts import Opener, TrainPrompt, openers, pick_opener

if TYPE_CHECKING:
    from blockspec.engine.engine import Engine
    from blockspec.engine.outputs import RequestOutput

log = logging.getLogger("blockspec")
META = "meta.json"


@dataclass
class GenerationConfig:
    num_samples: int = 2048
    response_len: int = 256
    temperature: float = 0.7  # for passes after the first, greedy pass over the prompts
    top_p: float = 0.95
    sampled_prefix: int = 16  # later passes: sampled lead-in tokens, then greedy (0: sample throughout)
    self_prompts: float = 0.0  # share of later samples answering a user message the target wrote itself
    self_prompt_len: int = 128  # max tokens of such a message
    shard_size: int = 512
    seed: int = 0
    max_time_s: float | None = None  # stop after the shard that crosses this (not part of the data's identity)

    def identity(self) -> dict:
        """The settings that decide what the stored samples are (num_samples may grow)."""
        return {k: v for k, v in asdict(self).items() if k not in ("num_samples", "max_time_s")}


@dataclass
class Sample:
    ids: torch.Tensor  # int64 [S]: prompt + response token ids
    mask: torch.Tensor  # bool [S]: True where the target wrote the token (the loss region)


def greedy_params(max_tokens: int) -> SamplingParams:
    """Greedy token ids (no text: nothing reads it, and detokenizing costs host time per token)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False)


def sample_params(index: int, num_prompts: int, cfg: GenerationConfig) -> SamplingParams:
    """Greedy on the first pass over the prompts; afterwards the seeded sampled lead-in (or, with
    sampled_prefix 0, a whole sampled response)."""
    if index < num_prompts or cfg.temperature <= 0:
        return greedy_params(cfg.response_len)
    max_tokens = min(cfg.sampled_prefix, cfg.response_len) if cfg.sampled_prefix > 0 else cfg.response_len
    return SamplingParams(max_tokens=max_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                          seed=cfg.seed * 1_000_003 + index, detokenize=False)


def encode_prompts(engine: Engine, prompts: list[TrainPrompt], response_len: int) -> list[list[int]]:
    """Chat-templated token ids; prompts too long for prompt + response in max_model_len are dropped."""
    encoded, dropped = [], 0
    for p in prompts:
        ids = engine.encode(engine.apply_chat_template(p.messages))
        if len(ids) + response_len > engine.max_model_len:
            dropped += 1
            continue
        encoded.append(ids)
    if dropped:
        log.warning("skipped %d prompts longer than max_model_len %d - response length %d",
                    dropped, engine.max_model_len, response_len)
    if not encoded:
        raise ConfigError("no prompt fits max_model_len with the response length: shorten prompts or responses")
    return encoded


def _prompts_digest(prompt_ids: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest()[:16]


def _check_meta(data_dir: Path, meta: dict) -> None:
    """Refuse to mix shards made under different settings (only num_samples may grow)."""
    path = data_dir / META
    if path.is_file():
        old = json.loads(path.read_text())
        diff = [k for k in meta if old.get(k) != meta[k]]
        if diff:
            raise ConfigError(f"{data_dir} holds data generated with other settings ({', '.join(diff)} differ): "
                              "pass a new --out (or --data-dir), or delete that directory")
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{META}.{os.getpid()}.tmp")  # atomic: parallel generators check it concurrently
    tmp.write_text(json.dumps(meta, indent=1))
    tmp.replace(path)


def shard_path(data_dir: Path, index: int) -> Path:
    return data_dir / f"shard-{index:05d}.safetensors"


def _shard_size(path: Path) -> int:
    """Samples in a finished shard (0 if absent), read from the header only."""
    if not path.is_file():
        return 0
    with safe_open(str(path), framework="pt") as f:
        return f.get_slice("index").get_shape()[0]


def missing_shards(data_dir: Path, cfg: GenerationConfig) -> list[int]:
    """Shards still to generate for cfg.num_samples (a short last shard from a smaller run counts)."""
    num_shards = -(-cfg.num_samples // cfg.shard_size)
    want = [min(cfg.shard_size, cfg.num_samples - s * cfg.shard_size) for s in range(num_shards)]
    return [s for s in range(num_shards) if _shard_size(shard_path(data_dir, s)) < want[s]]


def data_complete(data_dir: Path, cfg: GenerationConfig) -> bool:
    """True when the data exists for these settings, so no generation engine needs loading."""
    path = data_dir / META
    if not path.is_file():
        return False
    old = json.loads(path.read_text())
    same = all(old.get(k) == v for k, v in cfg.identity().items())
    return same and not missing_shards(data_dir, cfg)


def save_shard(path: Path, samples: list[Sample], indices: list[int]) -> None:
    lengths = torch.tensor([len(s.ids) for s in samples], dtype=torch.int64)
    tensors = {
        "tokens": torch.cat([s.ids for s in samples]).to(torch.int32),
        "mask": torch.cat([s.mask for s in samples]).to(torch.uint8),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        "index": torch.tensor(indices, dtype=torch.int64),
    }
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)  # a shard exists only when it is complete


def load_shard(path: Path) -> list[Sample]:
    t = load_file(str(path))
    off = t["offsets"].tolist()
    return [Sample(t["tokens"][a:b].long(), t["mask"][a:b].bool()) for a, b in zip(off[:-1], off[1:])]


def _drain(engine: Engine) -> dict[str, RequestOutput]:
    """Run the engine until every request finished: request id -> its final output."""
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def is_self_prompted(index: int, num_prompts: int, cfg: GenerationConfig) -> bool:
    """Whether sample `index` answers a self-written prompt (never in the first, greedy pass)."""
    return index >= num_prompts and random.Random(cfg.seed * 7919 + index).random() < cfg.self_prompts


def _user_turn(engine: Engine) -> str:
    """The chat template's text before a user message's content (system prompt and role header)."""
    mark = "\x00MSG\x00"
    return engine.apply_chat_template([{"role": "user", "content": mark}]).split(mark)[0]


def _self_prompts(engine: Engine, indices: list[int], cfg: GenerationConfig, limit: int) -> dict[int, list[int]]:
    """Sample index -> chat-templated ids of a user message the target wrote from a random opener
    (messages that make the prompt longer than `limit` tokens are left out, and so are openers too
    long to finish within `limit`: those samples keep their built-in prompt)."""
    if not indices:
        return {}
    choices: list[Opener] = openers()
    before = _user_turn(engine)
    starts = {o.text: engine.encode(before + o.text) for o in choices}
    picked = {}
    for i in indices:
        opener = pick_opener(choices, random.Random(cfg.seed * 104_729 + i))
        start = starts[opener.text]
        if len(start) + cfg.self_prompt_len > limit:
            continue
        picked[i] = opener
        params = SamplingParams(max_tokens=cfg.self_prompt_len, temperature=0.8, top_p=0.95,
                                seed=cfg.seed * 1_000_003 + i, stop=[opener.stop] if opener.stop else [])
        engine.add_request(f"ask-{i}", start, params)
    written = _drain(engine)
    out = {}
    for i, opener in picked.items():
        text = written[f"ask-{i}"].text.rstrip()
        if len(text.strip()) < 8:  # closed the message at once: the sample keeps its built-in prompt
            continue
        message = opener.text + text + ("\n" + opener.close if opener.close else "")
        ids = engine.encode(engine.apply_chat_template([{"role": "user", "content": message}]))
        if len(ids) <= limit:
            out[i] = ids
    return out


def _run_shard(engine: Engine, prompt_ids: list[list[int]], indices: list[int], cfg: GenerationConfig,
               bar: tqdm) -> list[Sample]:
    """The shard in waves of max_num_seqs, so the engine runs pure decode batches after each wave's
    prefill (requests trickling in as others finish would mix a prefill into nearly every step)."""
    wave = engine.config.max_num_seqs
    samples: list[Sample] = []
    for start in range(0, len(indices), wave):
        samples += _run_wave(engine, prompt_ids, indices[start:start + wave], cfg, bar)
    return samples


def _run_wave(engine: Engine, prompt_ids: list[list[int]], indices: list[int], cfg: GenerationConfig,
              bar: tqdm) -> list[Sample]:
    """Phases, each submitted whole: the self-written user messages (if any), then the answers (greedy,
    or sampled lead-ins), then the greedy continuations of the lead-ins that did not end the answer."""
    n = len(prompt_ids)
    own = _self_prompts(engine, [i for i in indices if is_self_prompted(i, n, cfg)], cfg,
                        engine.max_model_len - cfg.response_len)
    prompts = {i: own.get(i, prompt_ids[i % n]) for i in indices}
    for i in indices:
        params = greedy_params(cfg.response_len) if i in own else sample_params(i, n, cfg)
        engine.add_request(f"train-{i}", prompts[i], params)
    first = _drain(engine)
    responses = {i: first[f"train-{i}"].token_ids for i in indices}
    resume = [i for i in indices if i >= n and i not in own and first[f"train-{i}"].finish_reason == "length"
              and len(responses[i]) < cfg.response_len]
    for i in resume:  # continue greedily after the sampled lead-in
        engine.add_request(f"rest-{i}", prompts[i] + responses[i], greedy_params(cfg.response_len - len(responses[i])))
    rest = _drain(engine)
    samples = []
    for i in indices:
        prompt = prompts[i]
        resp = responses[i] + (rest[f"rest-{i}"].token_ids if f"rest-{i}" in rest else [])
        mask = torch.cat([torch.zeros(len(prompt), dtype=torch.bool), torch.ones(len(resp), dtype=torch.bool)])
        samples.append(Sample(torch.tensor(prompt + resp, dtype=torch.int64), mask))
        bar.update(1)
    return samples


def generate_data(engine: Engine, prompts: list[TrainPrompt], cfg: GenerationConfig, data_dir: Path,
                  shards: list[int] | None = None, progress: bool = True) -> Path:
    """Fill `data_dir` with cfg.num_samples target-written samples (resuming finished shards), or as
    many whole shards as fit in cfg.max_time_s; `shards` limits the work to those shard numbers
    (one generator process of several, train/parallel_data.py)."""
    start = time.perf_counter()
    prompt_ids = encode_prompts(engine, prompts, cfg.response_len)
    meta = {**cfg.identity(), "target": str(engine.model_dir), "prompts": _prompts_digest(prompt_ids),
            "num_prompts": len(prompt_ids)}
    if cfg.self_prompts > 0:
        meta["openers"] = hashlib.sha256(json.dumps([asdict(o) for o in openers()]).encode()).hexdigest()[:16]
    _check_meta(data_dir, meta)
    num_shards = -(-cfg.num_samples // cfg.shard_size)
    todo = missing_shards(data_dir, cfg)
    if shards is not None:
        todo = sorted(set(todo) & set(shards))
    have = sum(min(cfg.shard_size, cfg.num_samples - s * cfg.shard_size) for s in range(num_shards) if s not in todo)
    with tqdm(total=cfg.num_samples, initial=have, desc="generating", unit="sample", dynamic_ncols=True,
              disable=not progress) as bar:
        for s in todo:
            indices = list(range(s * cfg.shard_size, min((s + 1) * cfg.shard_size, cfg.num_samples)))
            samples = _run_shard(engine, prompt_ids, indices, cfg, bar)
            save_shard(shard_path(data_dir, s), samples, indices)
            if cfg.max_time_s is not None and time.perf_counter() - start > cfg.max_time_s:
                log.info("data generation stopped at its time limit after shard %d", s)
                break
    return data_dir


def load_samples(data_dir: Path, limit: int | None = None) -> list[Sample]:
    """Every stored sample (in shard order), or the first `limit`."""
    paths = sorted(data_dir.glob("shard-*.safetensors"))
    if not paths:
        raise ConfigError(f"no training data in {data_dir}: generate it first (blockspec train-drafter does)")
    samples: list[Sample] = []
    for p in paths:
        samples += load_shard(p)
        if limit is not None and len(samples) >= limit:
            return samples[:limit]
    return samples


def token_counts(samples: list[Sample], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in the responses (used to pick an unused mask token)."""
    resp = torch.cat([s.ids[s.mask] for s in samples]) if samples else torch.zeros(0, dtype=torch.int64)
    return torch.bincount(resp, minlength=vocab_size)
