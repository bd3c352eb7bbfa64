"""Prometheus metrics of the scheduler, under vLLM's names so existing dashboards work.

Gauges and totals are read from `Scheduler.stats()` at scrape time (one source of truth);
latency histograms are observed by the service as tokens are published.
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

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
        yield counter("pagedserve:steps", "Model steps planned.", s.steps_total)
        yield counter("pagedserve:steps_planned_ahead",
                      "Steps planned while the step before ran (async scheduling).",
                      s.steps_planned_ahead_total)


class LatencyHistogram:
    """A Prometheus histogram of one label set, observed by the service's loop alone.

    The inter-token histogram takes one observation per running sequence per step. The
    client library's Histogram takes a lock and walks its buckets for each; this one
    bisects into a list of counts (docs/overhead.md, the scheduler's output path). Its
    exposition has the same buckets, count and sum (tests/scheduler/test_metrics.py),
    without the `_created` series.
    """

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], model: str) -> None:
        self.name, self.doc, self.model = name, doc, model
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)       # the last one: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # A bucket counts the values <= its bound ("le").
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def collect(self):
        counts, total = list(self.counts), self.sum
        family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        buckets, cumulative = [], 0
        for bound, n in zip((*self.bounds, float("inf")), counts):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric([self.model], buckets, total)
        yield family

    def describe(self):
        return []


class SchedulerMetrics:
    def __init__(self, model: str, stats: Callable[[], object]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(model, stats))
        self.ttft = LatencyHistogram("vllm:time_to_first_token_seconds", "Time to first token.",
                                     _TTFT_BUCKETS, model)
        self.itl = LatencyHistogram("vllm:inter_token_latency_seconds",
                                    "Time between output tokens.", _ITL_BUCKETS, model)
        self.e2e = LatencyHistogram("vllm:e2e_request_latency_seconds", "Arrival to last token.",
                                    _E2E_BUCKETS, model)
        self.queue = LatencyHistogram("vllm:request_queue_time_seconds",
                                      "Arrival to first scheduled.", _E2E_BUCKETS, model)
        for histogram in (self.ttft, self.itl, self.e2e, self.queue):
            self.registry.register(histogram)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
