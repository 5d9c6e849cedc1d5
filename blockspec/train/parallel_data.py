"""Training data from several engine processes at once, sharing one device.

A small target leaves the GPU mostly idle while one engine generates: each step's Python
scheduling and bookkeeping, not the GPU, sets the pace (~235 samples/s for SmolLM2 on an H100
host). Shards are independent (a sample depends only on its index, its prompt and the seed), so
N processes each take every N-th missing shard, and throughput grows with the host's cores until
the GPU is busy (H100, 4 processes: ~200 samples/s with half the samples self-prompted, against ~90
for one; the GPU was then 100% busy). Each process gets a fixed KV cache size (--kv-cache-memory) so that engines
starting side by side do not each claim the whole card.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from blockspec.train.data import GenerationConfig, generate_data, missing_shards, shard_path
from blockspec.train.prompts import TrainPrompt

if TYPE_CHECKING:
    from blockspec.engine.engine import Engine

log = logging.getLogger("blockspec")
GIB = 1 << 30


@dataclass
class GeneratorSpec:
    """What a generator process needs to build its engine (everything picklable)."""

    target: str | None
    device: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    seed: int
    kv_cache_memory: int | None = None
    threads: int | None = None  # torch CPU threads in the process

    def engine(self) -> Engine:
        from blockspec.config import EngineConfig
        from blockspec.engine.engine import Engine

        return Engine(EngineConfig(model=self.target, device=self.device, max_num_seqs=self.max_num_seqs,
                                   max_num_batched_tokens=self.max_num_batched_tokens,
                                   max_model_len=self.max_model_len, seed=self.seed,
                                   kv_cache_memory=self.kv_cache_memory))


def kv_share(device: torch.device, workers: int, reserve: int = 2 * GIB) -> int | None:
    """Each CUDA generator's KV cache: an equal share of 80% of the free memory, less `reserve` for
    its weights, activations and graphs (None on CPU, where the engine's own default applies)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return max(GIB // 4, int(0.8 * free) // workers - reserve)


def _generate(spec: GeneratorSpec, prompts: list[TrainPrompt], cfg: GenerationConfig, data_dir: Path,
              shards: list[int]) -> int:
    """One generator process: its engine, its shards. Returns the number of shards it wrote."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    engine = spec.engine()
    try:
        generate_data(engine, prompts, cfg, data_dir, shards=shards, progress=False)
        return sum(shard_path(data_dir, s).is_file() for s in shards)
    finally:
        engine.release()


def split_shards(todo: list[int], workers: int) -> list[list[int]]:
    """Every N-th shard to each process, so a time limit leaves the early shards done."""
    return [todo[r::workers] for r in range(workers) if todo[r::workers]]


def generate_parallel(spec: GeneratorSpec, prompts: list[TrainPrompt], cfg: GenerationConfig, data_dir: Path,
                      workers: int) -> Path:
    """generate_data over `workers` processes (spawned: CUDA cannot be forked). A failure in any
    process (a bad setting, out of memory) is raised here once the others have stopped."""
    todo = missing_shards(data_dir, cfg)
    parts = split_shards(todo, workers)
    if not parts:
        return data_dir
    total = cfg.num_samples
    have = total - sum(min(cfg.shard_size, total - s * cfg.shard_size) for s in todo)
    ctx = mp.get_context("spawn")
    threads = spec.threads or max(1, (os.cpu_count() or 1) // len(parts))
    spec = dataclasses.replace(spec, threads=threads)
    log.info("generating %d shards in %d processes", len(todo), len(parts))
    with ctx.Pool(len(parts)) as pool, \
            tqdm(total=total, initial=have, desc="generating", unit="sample", dynamic_ncols=True) as bar:
        result = pool.starmap_async(_generate, [(spec, prompts, cfg, data_dir, p) for p in parts])
        while not result.ready():
            result.wait(2.0)
            done = sum(min(cfg.shard_size, total - s * cfg.shard_size) for s in todo
                       if shard_path(data_dir, s).is_file())
            bar.update(have + done - bar.n)
        written = result.get()  # re-raises a process's exception
    log.info("generation: %d shards written by %s", sum(written), written)
    return data_dir

