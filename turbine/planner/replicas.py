"""Replica maths: how many workers of each role the predicted load needs to meet the TTFT and
ITL targets, given one engine's performance model (turbine/planner/profile.py). Pure functions
of numbers, so the tests check them against counts computed by hand.

**Prefill.** A prompt's effective length is its ISL less the KV-cache hits:
`isl_eff = isl x (1 - kv_hit_rate)`; one engine takes `s = prefill_ms(isl_eff)` for it. Prompts
queue at an engine, so TTFT = s + the wait. With Poisson arrivals and a fixed service time (an
M/D/1 queue) at utilisation rho the mean wait is `rho s / (2 (1 - rho))`; TTFT <= target T gives
`rho = 2 (T - s) / (2T - s)`, and one engine sustains `rho / s` prompts per second. When
`s >= T` no load meets the target; the engine is then planned at rho = 0.5 (TTFT ~ 1.5 s) and the
result says `reachable=False`.

**Decode.** A sequence's mean context while decoding is `isl + osl / 2`. One engine decodes a
batch of b sequences in `t(b) = decode_ms(b, b x context)` per token; the largest b with
`t(b) <= ITL target`, within max_num_seqs and with b x (isl + osl) tokens fitting the KV cache,
is its batch. Each request stays `osl x t(b)` in it, so by Little's law it sustains
`b / (osl x t(b))` requests per second. When even b = 1 misses the target, b = 1 and
`reachable=False`.

**Aggregated.** One engine prefills and decodes in the same steps, so each prompt it prefills
stalls every sequence it decodes: at `lam` requests per second the prefills take a share
`u = lam x s / 1000` of its time, and a sequence's mean gap between tokens is
`ITL = t(b) / (1 - u)` with `b = lam x osl x ITL / 1000` in the batch (Little's law). That is a
fixed point in ITL (iterated from `t(1) / (1 - u)`; it grows with `lam`, so it is bisected): the
engine sustains the largest `lam` whose ITL meets the target, whose batch fits (max_num_seqs, KV)
and whose prompts' M/D/1 TTFT `s + u s / (2 (1 - u))` meets the TTFT target. (Adding the two
roles' fractions, `rate / prefill rate + rate / decode rate`, plans each at its own target and
ignores that stall: on the mocker fleet it sized ~1.5 requests/s per engine where ~1 met the ITL.)
When even a trickle misses the targets, the fractions' sum is used and `reachable=False`.

**Replicas.** `ceil(rate / per-engine rate)` for prefill, decode and aggregated; with
square-root staffing (`--sqrt-staffing beta`, default 0: none), `ceil(R + beta sqrt(R))` for
`R = rate / per-engine rate`: the load a fleet meets varies around its mean by about the square
root of it (Poisson arrivals), so the spare kept grows with that, not with the load; a small fleet
keeps relatively more room (a rise within one start-up cannot be met by workers started after it
began), a large one relatively less.

**Clamping.** Each role to [min, max]; then, when the total is over the budget (max workers in
all), each role keeps its minimum and the budget left above the minimums is shared in proportion
to what each role wanted above its minimum, rounded down, the units left over going to the
largest remainders (ties: the role named first in ROLES)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from turbine.planner.connector import ROLES
from turbine.planner.profile import PerformanceModel

UNREACHABLE_RHO = 0.5


@dataclass(frozen=True)
class Load:
    """One interval's traffic (observed or predicted)."""

    request_rate: float  # requests per second
    isl: float  # mean prompt tokens
    osl: float  # mean generated tokens
    kv_hit_rate: float = 0.0  # share of prompt tokens served from the KV cache


@dataclass(frozen=True)
class EngineRate:
    """What one engine sustains under a target."""

    requests_per_s: float
    step_ms: float  # prefill: one prompt's time; decode: the token step at `batch`
    batch: int = 1
    reachable: bool = True


def prefill_rate(model: PerformanceModel, load: Load, ttft_ms: float) -> EngineRate:
    isl_eff = max(load.isl * (1.0 - min(max(load.kv_hit_rate, 0.0), 1.0)), 1.0)
    s = model.prefill_ms(isl_eff)
    if s >= ttft_ms:
        return EngineRate(UNREACHABLE_RHO * 1000.0 / s, s, reachable=False)
    rho = 2 * (ttft_ms - s) / (2 * ttft_ms - s)
    return EngineRate(rho * 1000.0 / s, s)


def decode_rate(model: PerformanceModel, load: Load, itl_ms: float) -> EngineRate:
    osl = max(load.osl, 1.0)
    context = load.isl + osl / 2
    max_batch = 1024
    if model.limits is not None:
        max_batch = model.limits.max_num_seqs
        max_batch = min(max_batch, max(1, int(model.limits.kv_tokens // max(load.isl + osl, 1.0))))
    best: EngineRate | None = None
    for b in range(1, max_batch + 1):
        t = model.decode_ms(b, b * context)
        if t > itl_ms:
            break  # step time grows with the batch
        rate = b * 1000.0 / (osl * t)
        if best is None or rate >= best.requests_per_s:
            best = EngineRate(rate, t, b)
    if best is None:
        t = model.decode_ms(1, context)
        return EngineRate(1000.0 / (osl * t), t, 1, reachable=False)
    return best


def agg_rate(model: PerformanceModel, load: Load, ttft_ms: float, itl_ms: float) -> EngineRate:
    """What one aggregated engine sustains (the rule in the module's docstring); `batch`: its mean
    concurrency there, `step_ms`: its mean ITL there."""
    isl_eff = max(load.isl * (1.0 - min(max(load.kv_hit_rate, 0.0), 1.0)), 1.0)
    s = model.prefill_ms(isl_eff)
    osl = max(load.osl, 1.0)
    context = load.isl + osl / 2
    max_batch = 1024
    if model.limits is not None:
        max_batch = min(model.limits.max_num_seqs, max(1, int(model.limits.kv_tokens // max(load.isl + osl, 1.0))))

    def itl_at(lam: float) -> tuple[float, float] | None:
        """(ITL, batch) at `lam` requests/s, or None when it misses a target or the batch does not fit."""
        u = lam * s / 1000.0
        if u >= 1.0 or s + u * s / (2 * (1 - u)) > ttft_ms:
            return None
        itl = model.decode_ms(1, context) / (1 - u)
        for _ in range(200):
            b = max(1.0, lam * osl * itl / 1000.0)
            if b > max_batch:
                return None
            nxt = model.decode_ms(b, b * context) / (1 - u)
            if nxt > itl_ms:
                return None
            if abs(nxt - itl) < 1e-6:
                break
            itl = nxt
        return itl, max(1.0, lam * osl * itl / 1000.0)

    lo, hi = 0.0, 1000.0 / s
    if itl_at(1e-6) is None:
        p, d = prefill_rate(model, load, ttft_ms), decode_rate(model, load, itl_ms)
        rate = 1.0 / (1.0 / p.requests_per_s + 1.0 / d.requests_per_s)
        return EngineRate(rate, d.step_ms, d.batch, reachable=False)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if itl_at(mid) is not None else (lo, mid)
    itl, b = itl_at(lo) or (model.decode_ms(1, context), 1.0)
    return EngineRate(lo, itl, max(1, math.floor(b)))


@dataclass(frozen=True)
class Sizing:
    """The replicas a load needs per role, before clamping, and why."""

    replicas: dict[str, int]
    prefill: EngineRate | None = None
    decode: EngineRate | None = None
    agg: EngineRate | None = None  # mode agg: one engine doing both


def engines(rate: float, per_engine: float, beta: float = 0.0) -> int:
    """Engines for `rate` when each takes `per_engine`: ceil(R + beta sqrt(R)), R = rate / per_engine."""
    r = rate / per_engine
    return math.ceil(r + beta * math.sqrt(r) - 1e-9)


def size(mode: str, model: PerformanceModel, load: Load, ttft_ms: float, itl_ms: float,
         decode_model: PerformanceModel | None = None, beta: float = 0.0) -> Sizing:
    """Workers per role for `load` in `mode` ("agg", "disagg", "prefill", "decode").
    `decode_model`: the decode workers' model when it differs from the prefill workers'; `beta`:
    square-root staffing's spare (the module's docstring)."""
    rate = max(load.request_rate, 0.0)
    need_prefill = mode in ("agg", "disagg", "prefill")
    need_decode = mode in ("agg", "disagg", "decode")
    p = prefill_rate(model, load, ttft_ms) if need_prefill else None
    d = decode_rate(decode_model or model, load, itl_ms) if need_decode else None
    a = None
    if mode == "agg":
        a = agg_rate(model, load, ttft_ms, itl_ms)
        replicas = {"agg": engines(rate, a.requests_per_s, beta)}
    else:
        replicas = {}
        if p is not None:
            replicas["prefill"] = engines(rate, p.requests_per_s, beta)
        if d is not None:
            replicas["decode"] = engines(rate, d.requests_per_s, beta)
    return Sizing(replicas, p, d, a)


def clamp(wanted: dict[str, int], minimum: dict[str, int], maximum: dict[str, int],
          budget: int | None) -> dict[str, int]:
    """Each role within [minimum, maximum], then the total within the budget (rule above)."""
    out = {}
    for role, n in wanted.items():
        n = max(n, minimum.get(role, 0))
        out[role] = min(n, maximum[role]) if role in maximum else n
    if budget is None or sum(out.values()) <= budget:
        return out
    floors = {r: minimum.get(r, 0) for r in out}
    spare = budget - sum(floors.values())
    if spare < 0:
        raise ValueError(f"the minimums {floors} need more than the budget of {budget} workers")
    above = {r: out[r] - floors[r] for r in out}
    total_above = sum(above.values())
    shares = {r: spare * above[r] / total_above for r in out}
    result = {r: floors[r] + math.floor(shares[r]) for r in out}
    left = budget - sum(result.values())
    order = sorted(out, key=lambda r: (-(shares[r] - math.floor(shares[r])), ROLES.index(r)))
    for r in order[:left]:
        result[r] += 1
    return result
