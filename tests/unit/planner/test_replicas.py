"""Replica maths and the performance model on a made-up profile whose numbers are easy to follow
by hand (each expected count is worked out in the comment above it)."""

from __future__ import annotations

import pytest

from turbine.planner.profile import (
    DecodePoint,
    EngineLimits,
    EngineProfile,
    PerformanceModel,
    PrefillPoint,
    load_engine_profile,
    write_engine_profile,
)
from turbine.planner.replicas import Load, agg_rate, clamp, decode_rate, engines, prefill_rate, size

# Prefill: 1 ms per prompt token. Decode step: batch 1: 10 ms at 100 tokens of context per
# sequence, 20 ms at 1100; batch 8: 24 ms and 40 ms.
PROFILE = EngineProfile(
    source="test",
    engine=EngineLimits(max_num_seqs=16, max_num_batched_tokens=2048, kv_tokens=100_000, context_length=4096),
    prefill=[PrefillPoint(prompt_tokens=100, ms=100.0), PrefillPoint(prompt_tokens=1000, ms=1000.0),
             PrefillPoint(prompt_tokens=1000, ms=5.0, cached_tokens=900)],  # cached: not in the model
    decode=[DecodePoint(batch=1, kv_tokens=100, ms=10.0), DecodePoint(batch=1, kv_tokens=1100, ms=20.0),
            DecodePoint(batch=8, kv_tokens=800, ms=24.0), DecodePoint(batch=8, kv_tokens=8800, ms=40.0)])
MODEL = PerformanceModel(PROFILE)
LOAD = Load(request_rate=5.0, isl=1000, osl=200, kv_hit_rate=0.5)


def test_the_model_interpolates_and_extends_the_sweep():
    assert MODEL.prefill_ms(500) == pytest.approx(500.0)
    assert MODEL.prefill_ms(2000) == pytest.approx(2000.0)  # along the last segment
    assert MODEL.decode_ms(1, 600) == pytest.approx(15.0)  # halfway in context
    assert MODEL.decode_ms(8, 8 * 600) == pytest.approx(32.0)
    assert MODEL.decode_ms(4.5, 4.5 * 600) == pytest.approx(23.5)  # halfway in batch: (15 + 32) / 2
    assert MODEL.decode_ms(15, 15 * 100) == pytest.approx(10 + 14 * 2)  # beyond: 2 ms more per sequence


def test_prefill_rate_meets_the_ttft_target_in_an_md1_queue():
    # isl_eff = 1000 x (1 - 0.5) = 500 tokens -> s = 500 ms; T = 1000 ms:
    # rho = 2 (1000 - 500) / (2000 - 500) = 2/3; rate = (2/3) / 0.5 s = 4/3 per second.
    rate = prefill_rate(MODEL, LOAD, ttft_ms=1000)
    assert rate.step_ms == pytest.approx(500.0) and rate.reachable
    assert rate.requests_per_s == pytest.approx(4 / 3)
    # No cache hits: s = 1000 ms >= T: unreachable, planned at rho 0.5 -> 0.5 per second.
    cold = prefill_rate(MODEL, Load(5.0, 1000, 200, 0.0), ttft_ms=1000)
    assert not cold.reachable and cold.requests_per_s == pytest.approx(0.5)


def test_decode_rate_is_the_largest_batch_under_the_itl_target_by_littles_law():
    # context = 1000 + 200/2 = 1100 -> t(b) = 20 + (b - 1) x 20/7 ms; ITL 30 ms -> b <= 4.5 -> b = 4,
    # t = 20 + 60/7 = 28.571 ms; rate = 4 / (200 x 0.028571 s) = 0.7 per second.
    rate = decode_rate(MODEL, LOAD, itl_ms=30)
    assert rate.batch == 4 and rate.step_ms == pytest.approx(20 + 60 / 7)
    assert rate.requests_per_s == pytest.approx(0.7)
    # A KV cache of 3600 tokens holds 3 sequences of 1000 + 200: b = 3, t = 20 + 40/7,
    # rate = 3 / (200 x 0.025714) = 0.5833.
    small = PerformanceModel(EngineProfile(engine=EngineLimits(max_num_seqs=16, max_num_batched_tokens=2048,
                                                               kv_tokens=3600, context_length=4096),
                                           prefill=PROFILE.prefill, decode=PROFILE.decode))
    assert decode_rate(small, LOAD, itl_ms=30).batch == 3
    assert decode_rate(small, LOAD, itl_ms=30).requests_per_s == pytest.approx(3000 / (200 * (20 + 40 / 7)))
    # 15 ms < t(1) = 20 ms: unreachable, one sequence at a time.
    assert not decode_rate(MODEL, LOAD, itl_ms=15).reachable


def test_an_aggregated_engine_counts_the_stall_its_prefills_put_on_its_decodes():
    # s = 500 ms per prompt: at lam/s prefills take u = 0.5 lam of the time; t(b) = 120/7 + (20/7) b with
    # b = lam x 200 x ITL / 1000, and ITL = t(b) / (1 - u) -> ITL = (120/7) / (1 - (15/14) lam);
    # ITL <= 30 ms -> lam <= (3/7)(14/15) = 0.4 per second, b = 0.2 x 0.4 x 30 = 2.4, TTFT 562.5 ms.
    rate = agg_rate(MODEL, LOAD, ttft_ms=1000, itl_ms=30)
    assert rate.reachable and rate.requests_per_s == pytest.approx(0.4, rel=1e-6)
    assert rate.step_ms == pytest.approx(30.0, rel=1e-6) and rate.batch == 2
    # The two roles' fractions added up (each at its own target) would say 1 / (3/4 + 1/0.7) = 0.46 per second.
    assert 1 / (1 / prefill_rate(MODEL, LOAD, 1000).requests_per_s + 1 / decode_rate(MODEL, LOAD, 30).requests_per_s) \
        == pytest.approx(0.4590, abs=1e-4)
    # 15 ms < t(1): no rate meets it.
    assert not agg_rate(MODEL, LOAD, ttft_ms=1000, itl_ms=15).reachable


def test_replicas_per_mode():
    # prefill: 5 / (4/3) = 3.75 -> 4; decode: 5 / 0.7 = 7.14 -> 8; agg: 5 / 0.4 = 12.5 -> 13 (above).
    assert size("disagg", MODEL, LOAD, 1000, 30).replicas == {"prefill": 4, "decode": 8}
    assert size("prefill", MODEL, LOAD, 1000, 30).replicas == {"prefill": 4}
    assert size("decode", MODEL, LOAD, 1000, 30).replicas == {"decode": 8}
    assert size("agg", MODEL, LOAD, 1000, 30).replicas == {"agg": 13}
    # Exactly 4/3 per second needs exactly one prefill engine (no rounding up past a whole one).
    assert size("prefill", MODEL, Load(4 / 3, 1000, 200, 0.5), 1000, 30).replicas == {"prefill": 1}
    assert size("agg", MODEL, Load(0.0, 1000, 200, 0.5), 1000, 30).replicas == {"agg": 0}


def test_square_root_staffing_keeps_a_spare_that_grows_with_the_root_of_the_load():
    # prefill 5 / (4/3): R = 3.75 -> 3.75 + sqrt(3.75) = 5.69 -> 6; decode R = 7.14 -> 9.81 -> 10; agg
    # R = 12.5 -> 16.04 -> 17. Relative spare: 60 % for prefill's 3.75, 36 % for agg's 12.5.
    assert size("disagg", MODEL, LOAD, 1000, 30, beta=1.0).replicas == {"prefill": 6, "decode": 10}
    assert size("agg", MODEL, LOAD, 1000, 30, beta=1.0).replicas == {"agg": 17}
    assert size("agg", MODEL, LOAD, 1000, 30, beta=0.5).replicas == {"agg": 15}  # 12.5 + 1.77
    assert size("agg", MODEL, Load(0.0, 1000, 200, 0.5), 1000, 30, beta=1.0).replicas == {"agg": 0}
    assert engines(4.0, 1.0, 1.0) == 6 and engines(1.0, 1.0, 1.0) == 2 and engines(4.0, 1.0) == 4


def test_clamp_to_min_max_then_share_the_budget_in_proportion():
    assert clamp({"agg": 0}, {"agg": 1}, {"agg": 8}, None) == {"agg": 1}
    assert clamp({"agg": 11}, {"agg": 1}, {"agg": 8}, None) == {"agg": 8}
    # Budget 8 for prefill 6 + decode 10, minimums 1 + 1: spare 6 shared as 5:9 ->
    # 2.14 and 3.86 -> 2 and 3, the unit left goes to decode (remainder .86): prefill 3, decode 5.
    assert clamp({"prefill": 6, "decode": 10}, {"prefill": 1, "decode": 1}, {}, 8) == {"prefill": 3, "decode": 5}
    assert clamp({"prefill": 2, "decode": 3}, {"prefill": 1, "decode": 1}, {}, 8) == {"prefill": 2, "decode": 3}
    with pytest.raises(ValueError, match="budget"):
        clamp({"prefill": 6, "decode": 10}, {"prefill": 3, "decode": 3}, {}, 5)


def test_a_profile_file_round_trips_and_bad_ones_are_refused(tmp_path):
    path = tmp_path / "profile.json"
    write_engine_profile(PROFILE, path)
    assert load_engine_profile(path) == PROFILE
    path.write_text('{"format": "turbine-profile/1", "prefill": [{"prompt_tokens": 10, "ms": 5}], "decode": []}')
    with pytest.raises(ValueError, match="2 prompt lengths"):
        load_engine_profile(path)
    path.write_text('{"format": "turbine-profile/1", "prefill": [], "decode": [], "extra": 1}')
    with pytest.raises(ValueError, match="extra"):
        load_engine_profile(path)
    path.write_text('{"prefill": [{"prompt_tokens": 10, "ms": -5}]}')
    with pytest.raises(ValueError, match="ms > 0"):
        load_engine_profile(path)
