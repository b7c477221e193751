"""The planner's view of traffic: one interval's request rate, mean ISL and OSL, mean TTFT and
ITL and KV hit rate, from the frontend's Prometheus metrics.

- `FrontendScraper`: reads the frontend's `/metrics` text and takes the difference of its
  counters and histograms (`_sum`, `_count`) between two reads. A counter that went down (the
  frontend restarted) counts from zero, as Prometheus's increase() does.
- `PrometheusSource`: asks a Prometheus server that scrapes the frontend, through its HTTP API,
  for the same series' values (`sum(series)`, instant queries) at the interval's two ends, and
  takes the difference the same way. Not `increase()`: it extrapolates each series to the
  window's edges by its own rule (a counter is not extrapolated below zero), so a histogram's
  `_sum` and `_count` come out scaled differently and their ratio (the mean ISL) was 10-20 %
  off over a few seconds' window.

Series (turbine/frontend/metrics.py), summed over the models, or of `--model` only:
requests and ISL from `turbine_frontend_input_sequence_tokens` (count, sum), OSL from
`turbine_frontend_output_sequence_tokens`, TTFT and ITL from their histograms, the KV hit rate
as `turbine_frontend_cached_tokens_total` / the ISL sum (both counted when a request ends)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Requests waiting at the frontend for a worker below its busy thresholds (a gauge, read as it is now).
QUEUED = "turbine_frontend_queued_requests"
# Requests answered 503 model_asleep (a counter): demand for a model whose every worker sleeps.
ASLEEP = "turbine_frontend_model_asleep_rejections_total"

# What an interval needs: each is a counter or a histogram's _sum / _count.
SERIES = (
    "turbine_frontend_input_sequence_tokens_count",
    "turbine_frontend_input_sequence_tokens_sum",
    "turbine_frontend_output_sequence_tokens_sum",
    "turbine_frontend_time_to_first_token_seconds_count",
    "turbine_frontend_time_to_first_token_seconds_sum",
    "turbine_frontend_inter_token_latency_seconds_count",
    "turbine_frontend_inter_token_latency_seconds_sum",
    "turbine_frontend_cached_tokens_total",
)


@dataclass(frozen=True)
class Observation:
    """One interval's traffic at the frontend. Means are None when no request finished."""

    seconds: float
    requests: float  # requests finished in the interval
    isl: float | None
    osl: float | None
    ttft_s: float | None
    itl_s: float | None
    kv_hit_rate: float | None

    @property
    def request_rate(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    @classmethod
    def of(cls, seconds: float, d: dict[str, float]) -> Observation:
        def ratio(num: str, den: str) -> float | None:
            return d[num] / d[den] if d.get(den, 0) > 0 else None

        requests = d.get("turbine_frontend_input_sequence_tokens_count", 0.0)
        isl_sum = d.get("turbine_frontend_input_sequence_tokens_sum", 0.0)
        return cls(
            seconds=seconds, requests=requests,
            isl=ratio("turbine_frontend_input_sequence_tokens_sum", "turbine_frontend_input_sequence_tokens_count"),
            osl=ratio("turbine_frontend_output_sequence_tokens_sum", "turbine_frontend_input_sequence_tokens_count"),
            ttft_s=ratio("turbine_frontend_time_to_first_token_seconds_sum",
                         "turbine_frontend_time_to_first_token_seconds_count"),
            itl_s=ratio("turbine_frontend_inter_token_latency_seconds_sum",
                        "turbine_frontend_inter_token_latency_seconds_count"),
            kv_hit_rate=(min(1.0, d.get("turbine_frontend_cached_tokens_total", 0.0) / isl_sum) if isl_sum > 0
                         else None))


def parse_totals(text: str, model: str | None) -> dict[str, float]:
    """The SERIES' values in a /metrics text, summed over models (or of `model` only)."""
    totals = dict.fromkeys(SERIES, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals and (model is None or sample.labels.get("model") == model):
                if math.isfinite(sample.value):
                    totals[sample.name] += sample.value
    return totals


def parse_queued(text: str, model: str | None, series: str = QUEUED) -> int:
    """The frontend's queued requests (QUEUED, or another per-model series) in a /metrics text, summed
    over models (or of `model`)."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == series and (model is None or sample.labels.get("model") == model):
                if math.isfinite(sample.value):
                    total += sample.value
    return int(total)


def deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before per series; a series that went down (a restart) counts from zero."""
    return {k: (after[k] - before.get(k, 0.0)) if after[k] >= before.get(k, 0.0) else after[k] for k in after}


class FrontendScraper:
    def __init__(self, frontend_url: str, model: str | None, http: httpx.AsyncClient | None = None):
        self.url = frontend_url.rstrip("/") + "/metrics"
        self.model = model
        self.http = http or httpx.AsyncClient(timeout=10.0)
        self._last: tuple[float, dict[str, float]] | None = None

    async def read(self) -> dict[str, float]:
        resp = await self.http.get(self.url)
        resp.raise_for_status()
        return parse_totals(resp.text, self.model)

    async def queued(self) -> int:
        """Requests waiting at the frontend now for a worker below its busy thresholds."""
        resp = await self.http.get(self.url)
        resp.raise_for_status()
        return parse_queued(resp.text, self.model)

    async def asleep_rejections(self) -> int:
        """Requests answered 503 model_asleep so far (a counter)."""
        resp = await self.http.get(self.url)
        resp.raise_for_status()
        return parse_queued(resp.text, self.model, ASLEEP)

    async def start(self) -> None:
        """The first read: the next `observe` covers the time from now."""
        self._last = (time.monotonic(), await self.read())

    async def observe(self, interval_s: float) -> Observation:
        """The traffic since the previous read (`interval_s` is ignored: the reads' own times count)."""
        now, totals = time.monotonic(), await self.read()
        if self._last is None:
            self._last = (now, totals)
            return Observation.of(0.0, {})
        then, before = self._last
        self._last = (now, totals)
        return Observation.of(now - then, deltas(before, totals))

    async def close(self) -> None:
        await self.http.aclose()


class PrometheusSource:
    """The same interval from a Prometheus server's HTTP API (`/api/v1/query`)."""

    def __init__(self, prometheus_url: str, model: str | None, http: httpx.AsyncClient | None = None):
        self.url = prometheus_url.rstrip("/") + "/api/v1/query"
        self.model = model
        self.http = http or httpx.AsyncClient(timeout=10.0)
        self._last: float | None = None  # the end of the previous interval (unix time)

    async def start(self) -> None:
        """Reachable and answering; the next `observe` covers the time from now."""
        await self.query("vector(1)")
        self._last = time.time()

    async def query(self, promql: str, at: float | None = None) -> float:
        params = {"query": promql} if at is None else {"query": promql, "time": f"{at:.3f}"}
        resp = await self.http.get(self.url, params=params)
        resp.raise_for_status()
        body = resp.json()
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus refused {promql!r}: {body.get('error')}")
        result = body["data"]["result"]
        return float(result[0]["value"][1]) if result else 0.0

    def promql(self, series: str) -> str:
        return f'sum({series}{{model="{self.model}"}})' if self.model else f"sum({series})"

    async def queued(self) -> int:
        """Requests waiting at the frontend (its latest scrape) for a worker below its busy thresholds."""
        value = await self.query(self.promql(QUEUED))
        return int(value) if math.isfinite(value) else 0

    async def asleep_rejections(self) -> int:
        """Requests answered 503 model_asleep so far (the latest scrape of the counter)."""
        value = await self.query(self.promql(ASLEEP))
        return int(value) if math.isfinite(value) else 0

    async def totals(self, at: float) -> dict[str, float]:
        """Every series at one evaluation time (Prometheus's latest sample at or before it)."""
        values = {s: await self.query(self.promql(s), at) for s in SERIES}
        return {k: (v if math.isfinite(v) else 0.0) for k, v in values.items()}

    async def observe(self, interval_s: float) -> Observation:
        """The traffic since the previous observe (or start); the first time, the last `interval_s`."""
        at = time.time()
        since = self._last if self._last is not None else at - interval_s
        self._last = at
        before, after = await self.totals(since), await self.totals(at)
        return Observation.of(at - since, deltas(before, after))

    async def close(self) -> None:
        await self.http.aclose()
