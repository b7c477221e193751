"""One profile file for the planner and the mocker: what `turbine mocker calibrate` / `turbine
profile` write is read by the planner's performance model (the measured points) and by the
mocker's --profile (the fitted timing)."""

from __future__ import annotations

import pytest

from turbine.mocker.calibrate import Measurement, engine_profile, fit
from turbine.mocker.timing import TimingProfile, load_profile
from turbine.planner.profile import PerformanceModel, load_engine_profile, write_engine_profile
from turbine.protocol.discovery import ModelCard

CARD = ModelCard(name="m", namespace="turbine", component="backend", endpoint="generate", instance_id="w1",
                 tokenizer_path="/nowhere", context_length=2048, kv_block_size=128, total_kv_blocks=728,
                 max_num_seqs=128, max_num_batched_tokens=2048)
TRUE = TimingProfile(step_base_ms=20, prefill_ms_per_token=1.0, prefill_ms_per_token_pair=0.0, decode_ms_per_seq=2.0,
                     decode_ms_per_kv_token=0.01)


def measured() -> list[Measurement]:
    out = [Measurement(ms=TRUE.step_ms(p, p * p / 2, 0, 0), prefill_tokens=p) for p in (32, 128, 512, 1024)]
    out.append(Measurement(ms=TRUE.step_ms(128, 128 * (512 + 64), 0, 0), prefill_tokens=128, cached_tokens=512))
    for b in (1, 4, 16):
        for ctx in (80, 530):
            out.append(Measurement(ms=TRUE.step_ms(0, 0, b, b * ctx), decode_seqs=b, decode_kv_tokens=b * ctx))
    return out


def test_the_calibration_file_serves_the_planner_and_the_mocker(tmp_path):
    path = tmp_path / "profile.json"
    ms = measured()
    write_engine_profile(engine_profile(CARD, ms, TimingProfile(**fit(ms), source="test sweep")), path)
    planner = PerformanceModel(load_engine_profile(path))
    assert planner.limits.kv_tokens == 728 * 128 and planner.limits.max_num_seqs == 128
    assert planner.prefill_ms(128) == pytest.approx(TRUE.step_ms(128, 128 * 64, 0, 0), rel=1e-3)  # a measured point
    assert planner.decode_ms(4, 4 * 530) == pytest.approx(TRUE.step_ms(0, 0, 4, 4 * 530), rel=1e-3)
    assert planner.decode_ms(8, 8 * 300) == pytest.approx(TRUE.step_ms(0, 0, 8, 8 * 300), rel=1e-3)  # linear truth
    mocker = load_profile(path)
    assert mocker.source == "test sweep"
    assert mocker.step_ms(100, 5000, 3, 900) == pytest.approx(TRUE.step_ms(100, 5000, 3, 900), rel=1e-3)


def test_the_mocker_refuses_an_engine_profile_without_timing(tmp_path):
    path = tmp_path / "points-only.json"
    path.write_text('{"format": "turbine-profile/1", "prefill": [{"prompt_tokens": 10, "ms": 5}]}')
    with pytest.raises(ValueError, match="no 'timing'"):
        load_profile(path)
    path.write_text('{"format": "turbine-profile/9"}')
    with pytest.raises(ValueError, match="unknown profile format"):
        load_profile(path)
