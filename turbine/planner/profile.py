"""A worker's measured performance: the profile file the planner sizes the fleet from, and the
performance model it interpolates.

The file (JSON, `"format": "turbine-profile/1"`) is what `turbine profile` and `turbine mocker
calibrate` write (the same sweep, turbine/mocker/calibrate.py), and what the mocker's `--profile`
reads (its `timing` object):

    {"format": "turbine-profile/1", "source": "...",
     "engine": {"max_num_seqs": 128, "max_num_batched_tokens": 2048, "kv_tokens": 93184, "context_length": 2048},
     "prefill": [{"prompt_tokens": 128, "ms": 180.0}, {"prompt_tokens": 512, "ms": 640.0, "cached_tokens": 0}, ...],
     "decode": [{"batch": 1, "kv_tokens": 80, "ms": 30.1}, {"batch": 4, "kv_tokens": 2112, "ms": 38.0}, ...],
     "timing": {"step_base_ms": 27.3, "prefill_ms_per_token": 1.2, ...}}

- `prefill`: time to first token of one prompt alone, `cached_tokens` of it already in the KV
  cache (0 for a fresh prompt; only fresh points enter the model: the planner computes the
  effective prompt length after cache hits itself).
- `decode`: one decode step (the inter-token latency) with `batch` sequences decoding together
  and `kv_tokens` tokens of context in all.
- `engine`: the worker's limits (from its model card); `timing`: the mocker's fitted step-time
  coefficients (turbine/mocker/timing.py), which the planner uses only when the file has no points.

The model (`PerformanceModel`): prefill time is piecewise linear in the prompt tokens between the
measured points, extended along the end segments beyond them. Decode step time is interpolated on
the sweep's grid: for each measured batch size, piecewise linear in the context per sequence
(kv_tokens / batch); between batch sizes, linear in the batch; beyond the grid, along its edges.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Literal

import msgspec

FORMAT = "turbine-profile/1"


class PrefillPoint(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    prompt_tokens: int
    ms: float
    cached_tokens: int = 0


class DecodePoint(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    batch: int
    kv_tokens: int
    ms: float


class EngineLimits(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_tokens: int  # the KV cache's capacity in tokens (blocks x block size)
    context_length: int


class EngineProfile(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    format: Literal["turbine-profile/1"] = FORMAT
    source: str = ""
    engine: EngineLimits | None = None
    prefill: list[PrefillPoint] = []
    decode: list[DecodePoint] = []
    timing: dict[str, float | str] | None = None


def load_engine_profile(path: str | Path) -> EngineProfile:
    """Read and check a profile file; a problem raises ValueError naming the file and the field."""
    try:
        profile = msgspec.json.decode(Path(path).read_bytes(), type=EngineProfile)
    except OSError as exc:
        raise ValueError(f"cannot read profile {path}: {exc.strerror}") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"profile {path}: {exc}") from None
    for p in profile.prefill:
        if p.prompt_tokens < 1 or p.ms <= 0 or p.cached_tokens < 0:
            raise ValueError(f"profile {path}: prefill point {p}: prompt_tokens >= 1, ms > 0, cached_tokens >= 0")
    for d in profile.decode:
        if d.batch < 1 or d.kv_tokens < 0 or d.ms <= 0:
            raise ValueError(f"profile {path}: decode point {d}: batch >= 1, kv_tokens >= 0, ms > 0")
    PerformanceModel(profile, where=str(path))  # enough points for a model?
    return profile


def write_engine_profile(profile: EngineProfile, path: str | Path) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(profile), indent=2) + b"\n")


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise linear through (xs, ys) (xs sorted, distinct), extended along the end segments."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _averaged(pairs: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Sorted by x; repeated x values averaged."""
    by_x: dict[float, list[float]] = {}
    for x, y in pairs:
        by_x.setdefault(x, []).append(y)
    xs = sorted(by_x)
    return xs, [sum(by_x[x]) / len(by_x[x]) for x in xs]


class PerformanceModel:
    """Prefill time (ms) of a prompt and decode step time (ms) of a batch, from a profile."""

    def __init__(self, profile: EngineProfile, where: str = "profile"):
        self.profile = profile
        self.limits = profile.engine
        fresh = [(float(p.prompt_tokens), p.ms) for p in profile.prefill if p.cached_tokens == 0]
        self._prefill = _averaged(fresh) if fresh else None
        rows: dict[int, list[tuple[float, float]]] = {}
        for d in profile.decode:
            rows.setdefault(d.batch, []).append((d.kv_tokens / d.batch, d.ms))
        self._batches = sorted(rows)
        self._rows = [_averaged(rows[b]) for b in self._batches]
        timing = profile.timing or {}
        self._timing = {k: float(v) for k, v in timing.items() if not isinstance(v, str)}
        if self._prefill is None and "prefill_ms_per_token" not in self._timing:
            raise ValueError(f"{where}: no fresh prefill points (cached_tokens 0) and no timing coefficients")
        if self._prefill is not None and len(self._prefill[0]) < 2:
            raise ValueError(f"{where}: at least 2 prompt lengths are needed for the prefill model")
        if not self._batches and "decode_ms_per_seq" not in self._timing:
            raise ValueError(f"{where}: no decode points and no timing coefficients")

    def prefill_ms(self, prompt_tokens: float) -> float:
        """Time to first token of one prompt of this many tokens (not cached), alone."""
        if self._prefill is not None:
            return max(_interp(*self._prefill, prompt_tokens), 1e-3)
        t = self._timing
        return (t.get("step_base_ms", 0.0) + t.get("prefill_ms_per_token", 0.0) * prompt_tokens
                + t.get("prefill_ms_per_token_pair", 0.0) * prompt_tokens * prompt_tokens / 2)

    def decode_ms(self, batch: float, kv_tokens: float) -> float:
        """One decode step of `batch` sequences holding `kv_tokens` tokens of context in all."""
        if batch <= 0:
            return 0.0
        if self._batches:
            context = kv_tokens / batch
            values = [_interp(xs, ys, context) for xs, ys in self._rows]
            return max(_interp([float(b) for b in self._batches], values, batch), 1e-3)
        t = self._timing
        return (t.get("step_base_ms", 0.0) + t.get("decode_ms_per_seq", 0.0) * batch
                + t.get("decode_ms_per_kv_token", 0.0) * kv_tokens)
