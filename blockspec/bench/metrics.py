"""Speculative-decoding and prefix-cache counters from a server's Prometheus /metrics, as deltas around a run.

When responses carry no per-request statistics (vLLM), tau and per-position acceptance still come
out of vLLM's counters: scrape before and after a block of requests, subtract; so does the prefix
cache's hit rate (vLLM reports cached tokens in responses only with --enable-prompt-tokens-details).
blockspec exports the same names. Only counters are read, so the deltas are exact for the block as
long as nothing else is sending requests to the server at the same time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import httpx

from blockspec.bench.client import SpecStats, api_root

PREFIX = "vllm:spec_decode_"
CACHE_COUNTERS = {"vllm:prefix_cache_queries": "prefix_queries", "vllm:prefix_cache_hits": "prefix_hits"}
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfa]+)")
_POSITION = re.compile(r'position="(\d+)"')


@dataclass
class SpecCounters:
    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_pos: dict[int, float] = field(default_factory=dict)
    prefix_queries: float = 0.0  # prompt tokens looked up in the prefix cache
    prefix_hits: float = 0.0  # and found there

    def minus(self, before: SpecCounters) -> SpecCounters:
        return SpecCounters(
            self.num_drafts - before.num_drafts, self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            {p: v - before.accepted_per_pos.get(p, 0.0) for p, v in self.accepted_per_pos.items()},
            self.prefix_queries - before.prefix_queries, self.prefix_hits - before.prefix_hits)

    def prefix_cache(self) -> dict[str, float] | None:
        """{queries, hits} of prompt tokens, or None when nothing was looked up."""
        return {"queries": self.prefix_queries, "hits": self.prefix_hits} if self.prefix_queries > 0 else None

    def to_spec(self) -> SpecStats | None:
        """vLLM's definitions: tau = 1 + accepted / drafts; rate at position i = accepted_i / drafts."""
        if self.num_drafts <= 0:
            return None
        per_pos = [int(round(self.accepted_per_pos.get(i, 0.0))) for i in range(len(self.accepted_per_pos))]
        steps = int(round(self.num_drafts))
        return SpecStats(steps=steps, committed=steps + self.num_accepted_tokens,
                         draft_tokens=int(round(self.num_draft_tokens)), accepted_per_position=per_pos,
                         source="metrics")


def parse_spec_counters(text: str) -> SpecCounters | None:
    """Sum vLLM's spec-decode and prefix-cache counters over all label sets; None when the server exports none."""
    c = SpecCounters()
    seen = False
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache_"):
            m = _LINE.match(line)
            name = CACHE_COUNTERS.get(m.group(1).removesuffix("_total")) if m else None
            if name:
                setattr(c, name, getattr(c, name) + float(m.group(3)))
                seen = True
            continue
        if not line.startswith(PREFIX):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        name = m.group(1)[len(PREFIX):].removesuffix("_total")
        labels, value = m.group(2) or "", float(m.group(3))
        if name == "num_accepted_tokens_per_pos":
            pos = _POSITION.search(labels)
            if pos:
                i = int(pos.group(1))
                c.accepted_per_pos[i] = c.accepted_per_pos.get(i, 0.0) + value
                seen = True
        elif name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            setattr(c, name, getattr(c, name) + value)
            seen = True
    return c if seen else None


async def scrape(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> SpecCounters | None:
    """The server's spec-decode counters now; None when /metrics is missing or has none."""
    try:
        resp = await client.get(api_root(base_url) + "/metrics", headers=headers, timeout=10.0)
    except (httpx.HTTPError, OSError):
        return None
    if resp.status_code != 200:
        return None
    return parse_spec_counters(resp.text)
