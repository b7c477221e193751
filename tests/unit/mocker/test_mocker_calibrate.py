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


# `turbine mocker calibrate` against the real vLLM CPU worker (SmolLM2-135M, 2 cores),
# 2026-11-26: (ms, prefill tokens, cached tokens, decode seqs, decode KV tokens).
REAL_SWEEP = [(65.8, 32, 0, 0, 0), (181.8, 128, 0, 0, 0), (745.0, 512, 0, 0, 0), (1767.5, 1024, 0, 0, 0),
              (249.1, 128, 512, 0, 0), (306.3, 128, 1024, 0, 0),
              (32.3, 0, 0, 1, 80), (32.7, 0, 0, 1, 528), (37.7, 0, 0, 1, 1040),
              (31.0, 0, 0, 4, 320), (37.3, 0, 0, 4, 2112), (44.5, 0, 0, 4, 4160),
              (53.7, 0, 0, 16, 1280), (77.4, 0, 0, 16, 8448), (111.9, 0, 0, 16, 16640)]


def test_the_fit_keeps_short_steps_as_accurate_as_long_ones():
    """A real sweep: long prefills must not buy their accuracy with the 30 ms decode steps'
    (an absolute least-squares fit was 20 % off on single-sequence decode)."""
    data = [Measurement(ms=ms, prefill_tokens=p, cached_tokens=c, decode_seqs=b, decode_kv_tokens=k)
            for ms, p, c, b, k in REAL_SWEEP]
    profile = TimingProfile(**fit(data))
    for m in data:
        predicted = profile.step_ms(m.prefill_tokens, attention_pairs(m.prefill_tokens, m.cached_tokens),
                                    m.decode_seqs, m.decode_kv_tokens)
        assert abs(predicted / m.ms - 1) < 0.12, m
