"""The frontend's bulk histogram observation (turbine.frontend.metrics.observe_many) against
prometheus_client's own `observe`: the same exposition, values on every bucket boundary included."""

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from turbine.frontend.metrics import _LATENCY_BUCKETS, FrontendMetrics, observe_many


def _histogram():
    registry = CollectorRegistry()
    h = Histogram("gaps_seconds", "gaps", ["model"], buckets=_LATENCY_BUCKETS, registry=registry)
    return registry, h.labels("m")


def _exposition(registry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_observe_many_counts_as_observe_does_on_every_boundary():
    amounts = [0.0, 1e-6, *_LATENCY_BUCKETS, *(b * 1.0001 for b in _LATENCY_BUCKETS), 61.0, 1e9, 0.0123, 0.0123]
    one_by_one, a = _histogram()
    for amount in amounts:
        a.observe(amount)
    bulk, b = _histogram()
    observe_many(b, amounts)
    assert _exposition(bulk) == _exposition(one_by_one)
    assert 'gaps_seconds_count{model="m"} 36.0' in _exposition(bulk)


def test_observe_many_adds_to_what_is_there_and_takes_nothing():
    one_by_one, a = _histogram()
    bulk, b = _histogram()
    for h in (a, b):
        h.observe(0.3)
    for amount in (0.004, 0.02, 7.0):
        a.observe(amount)
    observe_many(b, [0.004, 0.02, 7.0])
    observe_many(b, [])
    assert _exposition(bulk) == _exposition(one_by_one)


def test_the_frontends_itl_histogram_takes_a_bulk_observation():
    metrics = FrontendMetrics()
    observe_many(metrics.of("model-a").itl, [0.01, 0.02, 0.03])
    text = generate_latest(metrics.registry).decode()
    assert 'turbine_frontend_inter_token_latency_seconds_count{model="model-a"} 3.0' in text
    assert 'turbine_frontend_inter_token_latency_seconds_bucket{le="0.025",model="model-a"} 2.0' in text
