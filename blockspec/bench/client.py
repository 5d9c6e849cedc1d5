"""One streamed OpenAI-compatible request, timed chunk by chunk.

Works against blockspec, vLLM, SGLang and llama.cpp: it speaks plain /v1/chat/completions or
/v1/completions with `stream: true` and `stream_options.include_usage`, and reads whatever
speculative-decoding statistics the server attaches (blockspec's per-request stats, SGLang-style
`meta_info`, llama.cpp `timings`), ignoring what it does not recognise.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from blockspec.bench.prompts import Prompt


@dataclass
class SpecStats:
    """Speculative-decoding counts of one request or one block of requests.

    `steps` are verify passes; tau = committed tokens per step. accepted_per_position[i] counts
    steps whose draft i was accepted.
    """

    steps: int = 0
    committed: float = 0.0  # tokens committed by those steps (tau * steps)
    draft_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    source: str = ""

    @property
    def tau(self) -> float | None:
        return self.committed / self.steps if self.steps else None

    def acceptance_rates(self) -> list[float]:
        return [a / self.steps for a in self.accepted_per_position] if self.steps else []

    def add(self, other: SpecStats) -> None:
        self.steps += other.steps
        self.committed += other.committed
        self.draft_tokens += other.draft_tokens
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        mine = self.accepted_per_position + [0] * (n - len(self.accepted_per_position))
        theirs = other.accepted_per_position + [0] * (n - len(other.accepted_per_position))
        self.accepted_per_position = [a + b for a, b in zip(mine, theirs)]
        self.source = self.source or other.source


@dataclass
class RequestResult:
    prompt_id: str
    prompt_class: str
    ok: bool = False
    error: str | None = None
    start: float = 0.0  # perf_counter at send
    ttft: float | None = None  # seconds to the first content token
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between content chunks after the first
    output_tokens: int = 0
    tokens_from_usage: bool = False  # False: counted one token per content chunk (a lower bound)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (prefix-cache hits)
    text: str = ""
    finish_reason: str | None = None
    spec: SpecStats | None = None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def tok_s(self) -> float | None:
        """Output tokens over the whole request (what one user sees end to end)."""
        return self.output_tokens / self.e2e if self.ok and self.e2e > 0 and self.output_tokens else None

    @property
    def decode_tok_s(self) -> float | None:
        t = self.tpot
        return 1.0 / t if t else None

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in vars(self).items() if k not in ("spec", "text")}
        d.update(tpot=self.tpot, tok_s=self.tok_s, decode_tok_s=self.decode_tok_s, text_chars=len(self.text))
        if self.spec is not None:
            d["spec"] = {"tau": self.spec.tau, "steps": self.spec.steps,
                         "accepted_per_position": self.spec.accepted_per_position, "source": self.spec.source}
        return d


@dataclass
class RequestOptions:
    model: str
    endpoint: str = "chat"  # chat | completions
    max_tokens: int = 256
    temperature: float = 0.0
    ignore_eos: bool = False
    meta_info: bool = True  # ask for SGLang-style meta_info (blockspec and SGLang answer it)
    timeout_s: float = 600.0


def api_root(base_url: str) -> str:
    """'http://h:8000/v1/' and 'http://h:8000' both give 'http://h:8000' (where /metrics lives)."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def build_body(prompt: Prompt, opts: RequestOptions) -> dict[str, Any]:
    body: dict[str, Any] = {"model": opts.model, "max_tokens": prompt.max_tokens or opts.max_tokens,
                            "temperature": opts.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if opts.endpoint == "chat":
        body["messages"] = prompt.messages
    else:
        body["prompt"] = prompt.completion_text()
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.meta_info:
        body["return_meta_info"] = True
    return body


def _holder(obj: Any, key: str, depth: int = 3) -> dict[str, Any] | None:
    """The dict (obj or one nested a few levels deep, breadth first) that has `key`."""
    level = [obj]
    for _ in range(depth + 1):
        nxt = []
        for d in level:
            if isinstance(d, dict):
                if key in d:
                    return d
                nxt.extend(v for v in d.values() if isinstance(v, (dict, list)))
            elif isinstance(d, list):
                nxt.extend(v for v in d if isinstance(v, (dict, list)))
        level = nxt
    return None


def _num(d: dict[str, Any], key: str) -> float | None:
    v = d.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def spec_from_chunk(chunk: dict[str, Any], completion_tokens: int | None) -> SpecStats | None:
    """Speculative stats a server put into a response chunk, in any of the dialects we know."""
    stats = _holder(chunk, "accepted_per_position")
    if stats is not None and isinstance(stats["accepted_per_position"], list):  # blockspec per-request stats
        steps = int(_num(stats, "steps") or 0)
        tau = _num(stats, "tau")
        committed = tau * steps if tau is not None else steps + sum(stats["accepted_per_position"])
        return SpecStats(steps=steps, committed=committed, draft_tokens=int(_num(stats, "num_draft_tokens") or 0),
                         accepted_per_position=[int(a) for a in stats["accepted_per_position"]], source="response")
    holder = _holder(chunk, "meta_info")
    meta = holder["meta_info"] if holder else None
    if isinstance(meta, dict) and _num(meta, "spec_verify_ct"):
        steps = int(_num(meta, "spec_verify_ct") or 0)
        tau = _num(meta, "spec_accept_length")
        if tau is None and completion_tokens:
            tau = completion_tokens / steps
        return SpecStats(steps=steps, committed=(tau or 0.0) * steps, source="meta_info")
    timings = chunk.get("timings")
    if isinstance(timings, dict) and _num(timings, "draft_n"):  # llama.cpp: drafted counts only
        return SpecStats(draft_tokens=int(_num(timings, "draft_n") or 0), source="llama.cpp timings")
    return None


async def stream_request(client: httpx.AsyncClient, base_url: str, prompt: Prompt, opts: RequestOptions,
                         headers: dict[str, str]) -> RequestResult:
    """Send one streamed request and time it; never raises for server or network errors."""
    res = RequestResult(prompt.id, prompt.prompt_class)
    path = "/v1/chat/completions" if opts.endpoint == "chat" else "/v1/completions"
    url = api_root(base_url) + path
    body = build_body(prompt, opts)
    res.start = time.perf_counter()
    last = None
    chunks = 0
    usage_tokens = None
    spec = None
    try:
        async with client.stream("POST", url, json=body, headers=headers, timeout=opts.timeout_s) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                res.error = f"HTTP {resp.status_code}: {detail}"
                res.e2e = time.perf_counter() - res.start
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    continue
                now = time.perf_counter()
                if "error" in chunk and not chunk.get("choices"):
                    res.error = str(chunk["error"])[:300]
                    break
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    piece = delta.get("content") or delta.get("reasoning_content") or choice.get("text") or ""
                    if piece:
                        if res.ttft is None:
                            res.ttft = now - res.start
                        elif last is not None:
                            res.itl.append(now - last)
                        last = now
                        chunks += 1
                        res.text += piece
                    if choice.get("finish_reason"):
                        res.finish_reason = choice["finish_reason"]
                usage = chunk.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                    res.prompt_tokens = usage.get("prompt_tokens")
                    details = usage.get("prompt_tokens_details")
                    if isinstance(details, dict) and details.get("cached_tokens") is not None:
                        res.cached_tokens = int(details["cached_tokens"])
                found = spec_from_chunk(chunk, usage_tokens)
                if found is not None:
                    spec = found
    except (httpx.HTTPError, OSError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.e2e = time.perf_counter() - res.start
    res.output_tokens = usage_tokens if usage_tokens is not None else chunks
    res.tokens_from_usage = usage_tokens is not None
    res.spec = spec
    if res.error is None and res.ttft is None:
        res.error = "the stream ended without any output token"
    res.ok = res.error is None
    return res
