"""Load predictors: given the values one series took in past intervals (request count, mean ISL,
mean OSL, KV hit rate), what will it be in the next one.

Every predictor has `add(value)` (the newest observation), `forecast(steps)` (the next `steps`
values) and `predict()` (the next value; before any observation, 0). They are chosen by name (`--predictor`, `make_predictor`):

- `constant`: the last value (what a planner without prediction assumes).
- `moving-average`: the mean of the last `window` values (smooths noise, lags a trend).
- `arima`: an ARIMA(2,1,0) model (statsmodels) refitted on the last `history` values each
  interval; it continues a trend and follows a periodic swing. Until `min_points` values, and when
  a fit fails, the last value. (2,1,0): an AR(2) on the differences, which is exact for a
  constant, a ramp and a sampled sine (x_t = 2cos(w) x_t-1 - x_t-2), and adapts within a few
  points after a step; the other orders tried (1,1,1), (2,1,1), (2,0,0) with drift missed one of
  those four, see tests/unit/planner/test_predictors.py.
- `kalman`: a local-linear-trend Kalman filter (state: level and slope), written out here: it is
  a 2x2 filter, too small to want a library (filterpy is unmaintained since 2018). Its noise
  settings (Dynamo's defaults: level 1.0, slope 0.1, observation 10) only matter as ratios;
  the first state is diffuse, so it follows the data at once.

Predictions are never negative (they are counts, lengths and rates)."""

from __future__ import annotations

import logging
import math
import warnings
from collections import deque
from typing import Protocol

log = logging.getLogger("turbine.planner")

PREDICTORS = ("constant", "moving-average", "arima", "kalman")


class Predictor(Protocol):
    def add(self, value: float) -> None: ...

    def predict(self) -> float: ...

    def forecast(self, steps: int) -> list[float]: ...


class _OneStep:
    """For predictors whose forecast is flat: every step ahead is the next value."""

    def forecast(self, steps: int) -> list[float]:
        return [self.predict()] * steps  # type: ignore[attr-defined]


class ConstantPredictor(_OneStep):
    def __init__(self) -> None:
        self._last = 0.0

    def add(self, value: float) -> None:
        self._last = float(value)

    def predict(self) -> float:
        return max(0.0, self._last)


class MovingAveragePredictor(_OneStep):
    def __init__(self, window: int = 5) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self._values: deque[float] = deque(maxlen=window)

    def add(self, value: float) -> None:
        self._values.append(float(value))

    def predict(self) -> float:
        return max(0.0, sum(self._values) / len(self._values)) if self._values else 0.0


class ArimaPredictor:
    ORDER = (2, 1, 0)

    def __init__(self, history: int = 64, min_points: int = 5) -> None:
        self._values: deque[float] = deque(maxlen=history)
        self.min_points = min_points
        self.fallbacks = 0  # fits that failed (the last value was used)

    def add(self, value: float) -> None:
        self._values.append(float(value))

    def predict(self) -> float:
        return self.forecast(1)[0]

    def forecast(self, steps: int) -> list[float]:
        if not self._values:
            return [0.0] * steps
        last = self._values[-1]
        flat = [max(0.0, last)] * steps
        if len(self._values) < self.min_points:
            return flat
        values = list(self._values)
        if max(values) - min(values) < 1e-9 * max(1.0, abs(last)):
            return flat  # a flat series: nothing to fit (and the fit would be singular)
        from statsmodels.tsa.arima.model import ARIMA  # loaded only when this predictor is used

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # convergence chatter on short series
                ahead = [float(v) for v in ARIMA(values, order=self.ORDER, trend="n").fit().forecast(steps)]
        except Exception as exc:  # a degenerate series: say so, keep planning
            self.fallbacks += 1
            log.warning("ARIMA fit failed (%s); predicting the last value", exc)
            return flat
        if not all(math.isfinite(v) for v in ahead):
            self.fallbacks += 1
            return flat
        return [max(0.0, v) for v in ahead]


class KalmanPredictor:
    def __init__(self, q_level: float = 1.0, q_trend: float = 0.1, r: float = 10.0) -> None:
        if min(q_level, q_trend) < 0 or r <= 0:
            raise ValueError("noise settings: q_level, q_trend >= 0 and r > 0")
        self.q_level, self.q_trend, self.r = q_level, q_trend, r
        self._x: list[float] | None = None  # [level, slope]
        self._p = [[0.0, 0.0], [0.0, 0.0]]

    def add(self, value: float) -> None:
        z = float(value)
        if self._x is None:
            big = 1e4 * (z * z + 1.0)  # diffuse: the first observations set the state
            self._x, self._p = [z, 0.0], [[big, 0.0], [0.0, big]]
            return
        # Predict: level += slope; P = F P F' + Q with F = [[1, 1], [0, 1]].
        (lvl, slope), ((a, b), (c, d)) = self._x, self._p
        lvl += slope
        a, b, c, d = a + b + c + d + self.q_level, b + d, c + d, d + self.q_trend
        # Update with the observation of the level (H = [1, 0]).
        s = a + self.r
        k0, k1 = a / s, c / s
        innovation = z - lvl
        self._x = [lvl + k0 * innovation, slope + k1 * innovation]
        self._p = [[(1 - k0) * a, (1 - k0) * b], [c - k1 * a, d - k1 * b]]

    def predict(self) -> float:
        return self.forecast(1)[0]

    def forecast(self, steps: int) -> list[float]:
        if self._x is None:
            return [0.0] * steps
        lvl, slope = self._x
        return [max(0.0, lvl + k * slope) for k in range(1, steps + 1)]


def make_predictor(name: str) -> Predictor:
    if name == "constant":
        return ConstantPredictor()
    if name == "moving-average":
        return MovingAveragePredictor()
    if name == "arima":
        return ArimaPredictor()
    if name == "kalman":
        return KalmanPredictor()
    raise ValueError(f"unknown predictor {name!r}; choose from {', '.join(PREDICTORS)}")
