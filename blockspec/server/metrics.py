"""/metrics: Prometheus text with vLLM's metric names, so existing dashboards and scrapers work.

Engine-wide numbers (running/waiting requests, KV usage, token and speculative-decoding counters)
are read at scrape time from the snapshot the engine worker publishes after every step; request
latencies (TTFT, TPOT, end-to-end) are measured where the client sees them, in the HTTP layer.
Each app has its own registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from blockspec.server.async_engine import AsyncEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)


class _EngineCollector(Collector):
    """Gauges and counters read from the engine worker's latest snapshot."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self.engine.snapshot
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).", s.kv_usage)
        yield counter("vllm:prompt_tokens", "Prefilled prompt tokens.", s.prompt_tokens)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("vllm:generation_tokens", "Generated tokens.", s.generation_tokens)
        yield counter("vllm:spec_decode_num_drafts", "Speculative draft blocks verified.", s.num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", s.num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.num_accepted_tokens)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each draft position.",
                                      labels=["model_name", "position"])
        for pos, value in enumerate(s.accepted_per_pos):
            per_pos.add_metric([self.model_name, str(pos)], value)
        yield per_pos


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine, model_name))
        r, labels = self.registry, ["model_name"]
        self.request_success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                                       ["model_name", "finished_reason"], registry=r)
        self.request_errors = Counter("blockspec:request_errors", "Requests answered with an error, by HTTP status.",
                                      ["model_name", "status"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (from request arrival).",
                              labels, buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Mean time per output token after the first.",
                              labels, buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency from arrival to last token.",
                             labels, buckets=E2E_BUCKETS, registry=r)
        self.prompt_len = Histogram("vllm:request_prompt_tokens", "Prompt length per request.", labels,
                                    buckets=TOKEN_BUCKETS, registry=r)
        self.output_len = Histogram("vllm:request_generation_tokens", "Generated tokens per request.", labels,
                                    buckets=TOKEN_BUCKETS, registry=r)

    def observe_finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                         arrival: float, first_token: float | None, finished: float) -> None:
        """One finished engine request (one choice); times are time.perf_counter() values."""
        m = self.model_name
        self.request_success.labels(m, finish_reason).inc()
        self.prompt_len.labels(m).observe(prompt_tokens)
        self.output_len.labels(m).observe(completion_tokens)
        self.e2e.labels(m).observe(finished - arrival)
        if first_token is not None:
            self.ttft.labels(m).observe(first_token - arrival)
            if completion_tokens > 1:
                self.tpot.labels(m).observe((finished - first_token) / (completion_tokens - 1))

    def observe_aborted(self, count: int) -> None:
        self.request_success.labels(self.model_name, "abort").inc(count)

    def observe_error(self, status: int) -> None:
        self.request_errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
