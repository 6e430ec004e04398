"""Prometheus metrics with vLLM's names and meanings, so existing vLLM dashboards work.

Per-request histograms and counters are observed by the server as requests
finish; engine state (running/waiting, KV blocks, prefix cache) is read from
AsyncEngine.stats() at scrape time (an engine still loading is left out), the
KV cache's configuration from AsyncEngine.cache_info() as the info gauge
vllm:cache_config_info (value 1, the facts in its labels). Each app gets its own
CollectorRegistry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (seconds)
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class _EngineCollector(Collector):
    """Engine state as gauges/counters, read at scrape time."""

    def __init__(self, engines: Callable[[], dict[str, Any]]) -> None:
        self.engines = engines

    def collect(self) -> Iterator[Any]:
        labels = ["model_name"]
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Requests in the running batch.", labels=labels
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled.", labels=labels
        )
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV cache usage (1 = 100%).", labels=labels
        )
        gpu_usage = GaugeMetricFamily(
            "vllm:gpu_cache_usage_perc", "KV cache usage (1 = 100%; old name).", labels=labels
        )
        used = GaugeMetricFamily(
            "edgellm:kv_blocks_used", "KV cache blocks held by live requests.", labels=labels
        )
        free = GaugeMetricFamily(
            "edgellm:kv_blocks_free", "KV cache blocks not held by a live request.", labels=labels
        )
        total = GaugeMetricFamily(
            "edgellm:kv_blocks_total", "KV cache blocks in all.", labels=labels
        )
        hit_rate = GaugeMetricFamily(
            "vllm:gpu_prefix_cache_hit_rate",
            "Prefix cache hit rate over all lookups (tokens).",
            labels=labels,
        )
        queries = CounterMetricFamily(
            "vllm:prefix_cache_queries", "Prefix cache lookups, in tokens.", labels=labels
        )
        hits = CounterMetricFamily(
            "vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", labels=labels
        )
        preempt = CounterMetricFamily("vllm:num_preemptions", "Preempted requests.", labels=labels)
        cache_info: GaugeMetricFamily | None = None
        for name, engine in self.engines().items():
            info = {"model_name": name, "engine": "0", **engine.cache_info()}
            if cache_info is None:  # an info gauge: value 1, the facts in the labels (as vLLM's)
                cache_info = GaugeMetricFamily(
                    "vllm:cache_config_info",
                    "Information of the KV cache configuration.",
                    labels=list(info),
                )
            cache_info.add_metric(list(info.values()), 1.0)
            s = engine.stats()
            total_blocks = float(s["kv_blocks_total"])
            held = float(s["kv_blocks_held"])
            running.add_metric([name], s["num_running"])
            waiting.add_metric([name], s["num_waiting"] + s.get("num_pending_adds", 0))
            usage.add_metric([name], held / total_blocks if total_blocks else 0.0)
            gpu_usage.add_metric([name], held / total_blocks if total_blocks else 0.0)
            used.add_metric([name], held)
            free.add_metric([name], total_blocks - held)
            total.add_metric([name], total_blocks)
            q, h = float(s["prefix_cache_queries"]), float(s["prefix_cache_hits"])
            hit_rate.add_metric([name], h / q if q else 0.0)
            queries.add_metric([name], q)
            hits.add_metric([name], h)
            preempt.add_metric([name], s.get("num_preemptions", 0))
        yield from (
            running,
            waiting,
            usage,
            gpu_usage,
            used,
            free,
            total,
            hit_rate,
            queries,
            hits,
            preempt,
        )
        if cache_info is not None:
            yield cache_info


class ServerMetrics:
    def __init__(self, engines: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        labels = ["model_name"]
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token (from arrival).",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            labels,
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Time from arrival to first scheduling.",
            labels,
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.prefill = Histogram(
            "vllm:request_prefill_time_seconds",
            "First scheduling to first token.",
            labels,
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.decode = Histogram(
            "vllm:request_decode_time_seconds",
            "First token to last token.",
            labels,
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.prompt_len = Histogram(
            "vllm:request_prompt_tokens",
            "Prompt tokens per request.",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.gen_len = Histogram(
            "vllm:request_generation_tokens",
            "Generated tokens per request.",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated.", labels, registry=r
        )
        self.success = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason.",
            labels + ["finished_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "edgellm:requests_rejected", "Requests refused, by HTTP status.", ["status"], registry=r
        )
        self.inflight = Gauge(
            "edgellm:requests_in_flight",
            "Admitted engine requests (prompts x n) not yet finished or aborted.",
            labels,
            registry=r,
        )
        r.register(_EngineCollector(engines))

    def observe_finished(self, model: str, arrival: float, m: Any, finish_reason: str) -> None:
        """One finished sub-request: arrival is the server's receipt time (monotonic), m its
        RequestMetrics."""
        self.success.labels(model, finish_reason).inc()
        if m is None:
            return
        self.prompt_tokens.labels(model).inc(m.num_prompt_tokens)
        self.generation_tokens.labels(model).inc(m.num_generated_tokens)
        self.prompt_len.labels(model).observe(m.num_prompt_tokens)
        self.gen_len.labels(model).observe(m.num_generated_tokens)
        if m.finished is not None:
            self.e2e.labels(model).observe(max(m.finished - arrival, 0.0))
        if m.first_scheduled is not None:
            self.queue.labels(model).observe(max(m.first_scheduled - arrival, 0.0))
            if m.first_token is not None:
                self.prefill.labels(model).observe(max(m.first_token - m.first_scheduled, 0.0))
        if m.first_token is not None:
            self.ttft.labels(model).observe(max(m.first_token - arrival, 0.0))
            if m.finished is not None:
                self.decode.labels(model).observe(max(m.finished - m.first_token, 0.0))
                if m.num_generated_tokens > 1:
                    self.tpot.labels(model).observe(
                        (m.finished - m.first_token) / (m.num_generated_tokens - 1)
                    )

    def render(self) -> bytes:
        return generate_latest(self.registry)
