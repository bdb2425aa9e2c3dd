"""The gateway's metrics classes: histograms bucket exactly as prometheus_client's do, and the gauges read when
scraped show the state at that moment."""

from __future__ import annotations

import math

import prometheus_client
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from router.admission import Admission
from router.config import GatewayConfig, WorkerSpec
from router.metrics import LATENCY_BUCKETS, Counter, GatewayMetrics, Histogram
from router.pool import WorkerPool
from router.upstream import UpstreamPool

BOUNDS = (0.001, 0.01, 0.1, 1.0)


def _samples(registry: CollectorRegistry) -> list[tuple[str, list[tuple[str, str]], float]]:
    return sorted((s.name, sorted(s.labels.items()), s.value) for metric in registry.collect()
                  for s in metric.samples if not s.name.endswith("_created"))


@given(st.lists(st.one_of(st.sampled_from([*BOUNDS, *LATENCY_BUCKETS, 0.0, -1.0, math.inf, math.nan]),
                          st.floats(allow_nan=False, min_value=-10, max_value=1e4)), max_size=40))
def test_histogram_buckets_as_prometheus_client(values: list[float]) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = Histogram("h", "h", ["k"], buckets=BOUNDS, registry=ours)
    original = prometheus_client.Histogram("h", "h", ["k"], buckets=BOUNDS, registry=theirs)
    for value in values:
        mine.labels("a").observe(value)
        original.labels("a").observe(value)
    assert str(_samples(ours)) == str(_samples(theirs))  # str: NaN sums compare equal as text


@given(st.lists(st.tuples(st.sampled_from(["a", "b", ""]),
                          st.one_of(st.sampled_from([0, 1, 2.5, -1.0, math.inf]),
                                    st.floats(allow_nan=False, min_value=-10, max_value=1e6))), max_size=40))
def test_counter_as_prometheus_client(steps: list[tuple[str, float]]) -> None:
    """Counters add without prometheus_client's lock: the same samples, and the same errors (a negative amount,
    a labelled counter's parent)."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    pairs = [(Counter("c", "c", ["k"], registry=ours), prometheus_client.Counter("c", "c", ["k"], registry=theirs)),
             (Counter("u", "u", registry=ours), prometheus_client.Counter("u", "u", registry=theirs))]
    for label, amount in steps:
        for mine, original in pairs:
            outcomes: list[str | None] = []
            for counter in (mine, original):
                target = counter.labels(label) if label and counter._labelnames else counter
                try:
                    target.inc(amount)
                    outcomes.append(None)
                except ValueError as exc:
                    outcomes.append(str(exc))
            assert outcomes[0] == outcomes[1]
    assert str(_samples(ours)) == str(_samples(theirs))


def test_admission_gauges_read_when_scraped() -> None:
    metrics = GatewayMetrics()
    admission = Admission(10, 10_000, metrics)
    value = metrics.registry.get_sample_value
    with admission.admit(300) as admitted:
        with admission.admit(0) as second:
            second.hold(50)
            assert value("kvgate_requests_in_flight") == 2
            assert value("kvgate_request_bytes_in_flight") == 350
        admitted.hold(400)
        assert value("kvgate_requests_in_flight") == 1
        assert value("kvgate_request_bytes_in_flight") == 400
    assert value("kvgate_requests_in_flight") == 0
    assert value("kvgate_request_bytes_in_flight") == 0


async def test_worker_in_flight_read_when_scraped() -> None:
    metrics = GatewayMetrics()
    upstream = UpstreamPool(limit_per_host=4, connect_timeout=1)
    pool = WorkerPool(GatewayConfig(), upstream, metrics)
    url = "http://127.0.0.1:9"
    worker = pool.add(WorkerSpec(url))
    value = metrics.registry.get_sample_value
    assert value("kvgate_worker_in_flight_requests", {"worker": url}) == 0
    pool.acquire(worker)
    pool.acquire(worker)
    assert value("kvgate_worker_in_flight_requests", {"worker": url}) == 2
    pool.release(worker)
    assert value("kvgate_worker_in_flight_requests", {"worker": url}) == 1
    pool.release(worker)
    pool.remove(url)  # nothing in flight: forgotten at once, its series with it
    assert value("kvgate_worker_in_flight_requests", {"worker": url}) is None
    upstream.close()
