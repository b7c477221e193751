"""The committed profile of the real vLLM CPU worker (SmolLM2-135M, 2 cores; `turbine profile`,
see its `source`): a usable performance model for the planner, and a timing the mocker reads."""

from __future__ import annotations

from pathlib import Path

from turbine.mocker.timing import load_profile
from turbine.planner.profile import PerformanceModel, load_engine_profile
from turbine.planner.replicas import Load, decode_rate, prefill_rate

FIXTURE = Path(__file__).parents[2] / "fixtures" / "profile_smollm2_cpu.json"


def test_the_vllm_cpu_profile_is_a_usable_model():
    profile = load_engine_profile(FIXTURE)
    assert "vllm" in profile.source and profile.engine.max_num_seqs == 16
    model = PerformanceModel(profile)
    lengths = sorted({p.prompt_tokens for p in profile.prefill if not p.cached_tokens})
    times = [model.prefill_ms(n) for n in lengths]
    assert times == sorted(times) and times[-1] > 4 * times[0]  # longer prompts take longer
    assert model.decode_ms(16, 16 * 600) > model.decode_ms(1, 600)  # a bigger batch takes longer per step
    load = Load(request_rate=1.0, isl=512, osl=64)
    assert prefill_rate(model, load, ttft_ms=5000).reachable
    assert decode_rate(model, load, itl_ms=1000).batch >= 4
    assert load_profile(FIXTURE).step_base_ms >= 0  # the mocker runs it too
