"""Prometheus metrics of the scheduler, under vLLM's names so existing dashboards work.

Gauges and totals are read from `Scheduler.stats()` at scrape time (one source of truth);
latency histograms are observed by the service as tokens are published.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0)


class _StatsCollector:
    """Exposes the block manager and scheduler figures of one Scheduler."""

    def __init__(self, model: str, stats: Callable[[], object]) -> None:
        self.model = model
        self.stats = stats

    def describe(self):
        return []

    def collect(self):
        s = self.stats()
        if s is None:
            return
        lbl = ["model_name"]
        val = [self.model]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=lbl)
            g.add_metric(val, float(value))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=lbl)
            c.add_metric(val, float(value))
            return c

        total = max(1, s.gpu_blocks_total)
        cpu_total = max(1, s.cpu_blocks_total)
        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be admitted.", s.num_waiting)
        yield gauge("vllm:num_requests_swapped", "Requests swapped out to the CPU pool.",
                    s.num_swapped)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of GPU KV blocks in use (0-1).",
                    s.gpu_blocks_used / total)
        yield gauge("pagedserve:gpu_blocks_used", "GPU KV blocks referenced by sequences.",
                    s.gpu_blocks_used)
        yield gauge("pagedserve:gpu_blocks_total", "GPU KV blocks in the pool.", s.gpu_blocks_total)
        yield gauge("pagedserve:cpu_blocks_used", "CPU swap blocks in use.", s.cpu_blocks_used)
        yield gauge("pagedserve:cpu_cache_usage_perc", "Fraction of CPU swap blocks in use (0-1).",
                    s.cpu_blocks_used / cpu_total)
        yield counter("vllm:num_preemptions", "Preemptions (swap or recompute).", s.num_preemptions)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                      s.prefix_cache_hits)
        yield counter("vllm:prompt_tokens", "Prompt tokens processed.", s.prompt_tokens_total)
        yield counter("vllm:generation_tokens", "Tokens generated.", s.generation_tokens_total)
        yield counter("pagedserve:swapped_out_blocks", "Blocks moved GPU -> CPU.",
                      s.swapped_out_blocks_total)
        yield counter("pagedserve:swapped_in_blocks", "Blocks moved CPU -> GPU.",
                      s.swapped_in_blocks_total)


class SchedulerMetrics:
    def __init__(self, model: str, stats: Callable[[], object]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(model, stats))
        lbl = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", lbl,
                              buckets=_TTFT_BUCKETS, registry=self.registry).labels(model)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.",
                             lbl, buckets=_ITL_BUCKETS, registry=self.registry).labels(model)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", lbl,
                             buckets=_E2E_BUCKETS, registry=self.registry).labels(model)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled.",
                               lbl, buckets=_E2E_BUCKETS, registry=self.registry).labels(model)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
