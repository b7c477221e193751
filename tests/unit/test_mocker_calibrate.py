"""The calibration fit: exact on exact data, never negative, and a clear error when the
sweep cannot separate the coefficients."""

import pytest

from turbine.mocker.calibrate import Measurement, fit
from turbine.mocker.timing import TimingProfile, attention_pairs

TRUTH = TimingProfile(step_base_ms=12.0, prefill_ms_per_token=0.8, prefill_ms_per_token_pair=4e-4,
                      decode_ms_per_seq=1.5, decode_ms_per_kv_token=0.004)


def measured(profile: TimingProfile, prefill=(), decode=(), cached=()) -> list[Measurement]:
    """`prefill`: prompt lengths; `cached`: (new, cached) pairs; `decode`: (batch, kv tokens)."""
    ms = [Measurement(ms=profile.step_ms(p, attention_pairs(p, 0), 0, 0), prefill_tokens=p) for p in prefill]
    ms += [Measurement(ms=profile.step_ms(p, attention_pairs(p, c), 0, 0), prefill_tokens=p, cached_tokens=c)
           for p, c in cached]
    ms += [Measurement(ms=profile.step_ms(0, 0, b, k), decode_seqs=b, decode_kv_tokens=k) for b, k in decode]
    return ms


def test_fit_recovers_the_coefficients_of_exact_measurements():
    coefficients = fit(measured(TRUTH, prefill=[32, 128, 512, 2048], cached=[(128, 512), (128, 1024)],
                                decode=[(1, 100), (1, 600), (8, 800), (8, 4800), (32, 3000)]))
    for name, value in coefficients.items():
        assert value == pytest.approx(getattr(TRUTH, name), rel=1e-6), name


def test_a_coefficient_that_would_fit_negative_is_held_at_zero():
    # Prefill that grows slower than linearly would want a negative quadratic term.
    data = [Measurement(ms=10 + 30 * p ** 0.5, prefill_tokens=p) for p in (16, 64, 256, 1024)]
    data += measured(TRUTH, decode=[(1, 100), (4, 900), (16, 2000)])
    coefficients = fit(data)
    assert coefficients["prefill_ms_per_token_pair"] == 0.0
    assert all(v >= 0 for v in coefficients.values())


def test_a_sweep_without_variety_is_refused():
    with pytest.raises(ValueError, match="vary the sweep"):
        fit(measured(TRUTH, prefill=[128, 128], decode=[(4, 400), (4, 400)]))
