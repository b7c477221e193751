"""Prometheus text scraped from a Turbine process, and what the benchmarks read from it."""

from __future__ import annotations

import re
import statistics
import urllib.request


_METRIC_LINE = re.compile(r'^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$')


def scrape(url: str) -> list[tuple[str, dict, float]]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        m = _METRIC_LINE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        try:
            out.append((m.group(1), labels, float(m.group(3))))
        except ValueError:
            pass
    return out


def worker_spread(samples) -> dict:
    per = {labels["worker_id"]: 0.0 for _, labels, _ in samples if "worker_id" in labels}
    for name, labels, v in samples:
        if name == "turbine_worker_requests_total" and labels.get("outcome", "ok") in ("ok", "success", "finished"):
            per[labels.get("worker_id", "?")] = per.get(labels.get("worker_id", "?"), 0) + v
    if not per:  # outcome label values we do not know: count all outcomes
        for name, labels, v in samples:
            if name == "turbine_worker_requests_total":
                per[labels.get("worker_id", "?")] = per.get(labels.get("worker_id", "?"), 0) + v
    counts = sorted(per.values())
    return {"per_worker": counts, "min": counts[0] if counts else None, "max": counts[-1] if counts else None,
            "cv": (statistics.pstdev(counts) / statistics.fmean(counts)) if len(counts) > 1 and statistics.fmean(counts) else None}
