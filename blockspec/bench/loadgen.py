"""Closed-loop load: N requests through C concurrent streams, the way chat users and agents load a server.

Each of C workers sends its next request as soon as its previous one finishes, so exactly C
requests are in flight until the queue drains. Prompts are cycled to fill the queue.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

import httpx

from blockspec.bench.client import RequestOptions, RequestResult, stream_request
from blockspec.bench.prompts import Prompt


async def run_block(client: httpx.AsyncClient, base_url: str, prompts: list[Prompt], num_requests: int,
                    concurrency: int, opts: RequestOptions, headers: dict[str, str],
                    on_done: Callable[[RequestResult], None] | None = None) -> tuple[list[RequestResult], float]:
    """Send `num_requests` requests (prompts cycled) with `concurrency` in flight; returns results in
    queue order and the wall time from the first send to the last response."""
    queue = list(itertools.islice(itertools.cycle(prompts), num_requests))
    results: list[RequestResult | None] = [None] * len(queue)
    order = iter(range(len(queue)))

    async def worker() -> None:
        for i in order:  # the shared iterator hands each index to exactly one worker
            results[i] = await stream_request(client, base_url, queue[i], opts, headers)
            if on_done is not None:
                on_done(results[i])

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(queue))))))
    wall = time.perf_counter() - start
    return [r for r in results if r is not None], wall
