"""The scheduler's latency histograms expose what prometheus_client's Histogram would."""
from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.scheduler.metrics import _ITL_BUCKETS, LatencyHistogram, SchedulerMetrics


def _samples(text: bytes) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text.decode())
            for s in fam.samples if not s.name.endswith("_created")}


def test_the_histogram_exposes_the_client_librarys_buckets_count_and_sum():
    rng = random.Random(0)
    # every bound itself (a value equal to a bound counts in that bucket), both ends, noise
    values = [*_ITL_BUCKETS, 0.0, 1e-9, 99.0, *(rng.expovariate(20) for _ in range(500))]
    ours = LatencyHistogram("vllm:inter_token_latency_seconds", "doc", _ITL_BUCKETS, "m")
    theirs_registry = CollectorRegistry()
    theirs = Histogram("vllm:inter_token_latency_seconds", "doc", ["model_name"],
                       buckets=_ITL_BUCKETS, registry=theirs_registry).labels("m")
    ours_registry = CollectorRegistry()
    ours_registry.register(ours)
    for v in values:
        ours.observe(v)
        theirs.observe(v)
    got, want = _samples(generate_latest(ours_registry)), _samples(generate_latest(theirs_registry))
    assert got.keys() == want.keys() and len(got) == len(_ITL_BUCKETS) + 3
    for key, value in want.items():
        assert abs(got[key] - value) <= 1e-9 * max(1.0, abs(value)), key


def test_the_service_metrics_expose_the_four_vllm_histograms():
    m = SchedulerMetrics("m", lambda: None)
    m.ttft.observe(0.2)
    m.itl.observe(0.01)
    m.itl.observe(0.03)
    text = _samples(m.exposition())
    label = (("model_name", "m"),)
    assert text[("vllm:inter_token_latency_seconds_count", label)] == 2
    assert text[("vllm:time_to_first_token_seconds_count", label)] == 1
    assert text[("vllm:e2e_request_latency_seconds_count", label)] == 0
    assert text[("vllm:request_queue_time_seconds_sum", label)] == 0
