"""The load predictors on known series: a constant, a ramp, a sine, a step, and noise around a
mean. Each expectation is what that predictor is for, and fails if it predicts otherwise."""

from __future__ import annotations

import math
import random

import pytest

from turbine.planner.predictors import (
    PREDICTORS,
    ArimaPredictor,
    ConstantPredictor,
    KalmanPredictor,
    MovingAveragePredictor,
    make_predictor,
)

CONSTANT = [100.0] * 30
RAMP = [5.0 + 10.0 * i for i in range(30)]  # next: 305
SINE = [100.0 + 50.0 * math.sin(2 * math.pi * i / 12) for i in range(48)]  # period: 12 intervals
STEP = [10.0] * 20 + [100.0] * 12


def fed(predictor, values):
    for v in values:
        predictor.add(v)
    return predictor


def one_step_errors(predictor, values, skip):
    """Mean absolute error of each one-step-ahead prediction after the first `skip` values."""
    errors = []
    for i, v in enumerate(values):
        if i >= skip:
            errors.append(abs(predictor.predict() - v))
        predictor.add(v)
    return sum(errors) / len(errors)


@pytest.mark.parametrize("name", PREDICTORS)
def test_every_predictor_predicts_a_constant_and_nothing_before_data(name):
    assert make_predictor(name).predict() == 0.0
    assert fed(make_predictor(name), CONSTANT).predict() == pytest.approx(100.0, rel=1e-6)


def test_constant_is_the_last_value_and_moving_average_the_window_mean():
    assert fed(ConstantPredictor(), RAMP).predict() == 295.0
    assert fed(MovingAveragePredictor(window=5), RAMP).predict() == pytest.approx(275.0)  # 255..295
    assert fed(MovingAveragePredictor(window=5), [3.0, 9.0]).predict() == 6.0


@pytest.mark.parametrize("predictor", [ArimaPredictor(), KalmanPredictor()], ids=["arima", "kalman"])
def test_trend_predictors_continue_a_ramp(predictor):
    assert fed(predictor, RAMP).predict() == pytest.approx(305.0, rel=0.01)


def test_arima_follows_a_sine_far_better_than_the_last_value():
    arima_error = one_step_errors(ArimaPredictor(), SINE, skip=44)
    constant_error = one_step_errors(ConstantPredictor(), SINE, skip=44)
    assert constant_error > 10  # the swing between intervals
    assert arima_error < 0.1 * constant_error


def test_after_a_step_each_predictor_settles_on_the_new_level():
    assert fed(ConstantPredictor(), STEP).predict() == 100.0
    assert fed(MovingAveragePredictor(window=5), STEP[:25]).predict() == 100.0  # 5 values after the step
    assert fed(MovingAveragePredictor(window=5), STEP[:24]).predict() == pytest.approx(82.0)
    assert fed(ArimaPredictor(), STEP).predict() == pytest.approx(100.0, rel=0.05)
    kalman = KalmanPredictor()
    trace = [fed(kalman, [v]).predict() for v in STEP]
    assert trace[19] == pytest.approx(10.0)
    assert trace[20] < 100.0  # it smooths: one value does not move it all the way
    assert trace[-1] == pytest.approx(100.0, rel=0.15)


def test_kalman_smooths_noise_better_than_the_last_value():
    rng = random.Random(7)
    noisy = [100.0 + rng.gauss(0, 10) for _ in range(80)]

    def error_from_mean(predictor):
        errors = []
        for i, v in enumerate(noisy):
            if i >= 10:
                errors.append(abs(predictor.predict() - 100.0))
            predictor.add(v)
        return sum(errors) / len(errors)

    assert error_from_mean(KalmanPredictor()) < 0.75 * error_from_mean(ConstantPredictor())


def test_arima_with_too_few_points_uses_the_last_value_and_predictions_are_never_negative():
    assert fed(ArimaPredictor(min_points=5), [1.0, 2.0, 3.0]).predict() == 3.0
    falling = [100.0 - 30.0 * i for i in range(5)]  # 100 .. -20 extrapolates below zero
    for name in PREDICTORS:
        assert fed(make_predictor(name), falling).predict() >= 0.0


def test_unknown_predictor_names_the_choices():
    with pytest.raises(ValueError, match="constant, moving-average, arima, kalman"):
        make_predictor("prophet")
