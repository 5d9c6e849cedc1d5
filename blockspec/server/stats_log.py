"""A periodic log line like vLLM's: throughput, queue, KV usage and what speculation is doing.

Users tune k by watching the draft acceptance rate in the server log (seed 002), so it is printed
with vLLM's wording; `--disable-log-stats` turns it off. Nothing is printed while the server idles.
"""

from __future__ import annotations

import asyncio
import logging
import time

from blockspec.server.async_engine import AsyncEngine, EngineSnapshot

log = logging.getLogger("blockspec.server")


def format_stats(prev: EngineSnapshot, cur: EngineSnapshot, seconds: float) -> list[str]:
    """The lines for one interval (empty when nothing ran)."""
    prompt = cur.prompt_tokens - prev.prompt_tokens
    generated = cur.generation_tokens - prev.generation_tokens
    busy = cur.num_running or cur.num_waiting
    if not (prompt or generated or busy):
        return []
    seconds = max(seconds, 1e-9)
    lines = [f"Avg prompt throughput: {prompt / seconds:.1f} tokens/s, Avg generation throughput: "
             f"{generated / seconds:.1f} tokens/s, Running: {cur.num_running} reqs, Waiting: {cur.num_waiting} reqs, "
             f"KV cache usage: {cur.kv_usage * 100:.1f}%, Prefix cache hit rate: {hit_rate(prev, cur) * 100:.1f}%"]
    drafts = cur.num_drafts - prev.num_drafts
    if drafts > 0:
        drafted = cur.num_draft_tokens - prev.num_draft_tokens
        accepted = cur.num_accepted_tokens - prev.num_accepted_tokens
        per_pos = [(c - p) / drafts for c, p in zip(cur.accepted_per_pos, prev.accepted_per_pos
                                                     or (0,) * len(cur.accepted_per_pos))]
        lines.append(
            f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, Accepted throughput: "
            f"{accepted / seconds:.2f} tokens/s, Drafted throughput: {drafted / seconds:.2f} tokens/s, "
            f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, Per-position acceptance rate: "
            f"{', '.join(f'{r:.3f}' for r in per_pos)}, Avg Draft acceptance rate: "
            f"{100 * accepted / max(drafted, 1):.1f}%")
    return lines


def hit_rate(prev: EngineSnapshot, cur: EngineSnapshot) -> float:
    """Prompt tokens found in the prefix cache over those looked up, in the interval."""
    queries = cur.prefix_cache_queries - prev.prefix_cache_queries
    return (cur.prefix_cache_hits - prev.prefix_cache_hits) / queries if queries else 0.0


async def log_stats_forever(engine: AsyncEngine, interval: float = 10.0) -> None:
    prev, then = engine.snapshot, time.monotonic()
    while True:
        await asyncio.sleep(interval)
        cur, now = engine.snapshot, time.monotonic()
        for line in format_stats(prev, cur, now - then):
            log.info(line)
        prev, then = cur, now
