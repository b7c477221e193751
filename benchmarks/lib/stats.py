"""Summaries of measured values: median, percentile, ratio, and their table format."""

from __future__ import annotations

import statistics


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(v: float | None, digits: int = 1) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (q in 0..100) by nearest rank; None values are left out."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
