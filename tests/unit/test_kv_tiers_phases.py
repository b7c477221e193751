"""benchmarks/kv_tiers/kv_tiers.py's split of a turn group's TTFT: the servers' histograms (sum and count) and the
connector's step counters, differenced between two scrapes and averaged per request."""

from benchmarks.kv_tiers.kv_tiers import phase_means_ms, phase_sums


def samples(ttft_sum: float, count: float, load_sum: float) -> list[tuple[str, dict, float]]:
    return [
        ("turbine_frontend_time_to_first_token_seconds_sum", {"model": "m"}, ttft_sum + 0.01 * count),
        ("turbine_frontend_time_to_first_token_seconds_count", {"model": "m"}, count),
        ("turbine_frontend_time_to_first_token_seconds_bucket", {"le": "1"}, count),  # not a sum
        ("vllm:time_to_first_token_seconds_sum", {"engine": "0"}, ttft_sum),
        ("vllm:time_to_first_token_seconds_count", {"engine": "0"}, count),
        ("vllm:request_queue_time_seconds_sum", {"engine": "0"}, 0.0),
        ("vllm:request_queue_time_seconds_count", {"engine": "0"}, count),
        ("vllm:request_prefill_time_seconds_sum", {"engine": "0"}, ttft_sum - 0.005 * count),
        ("vllm:request_prefill_time_seconds_count", {"engine": "0"}, count),
        ("turbine_kvbm_step_load_seconds_total", {"engine": "0"}, load_sum),
    ]


def test_a_turn_groups_means_come_from_the_differences_between_two_scrapes():
    before = phase_sums(samples(ttft_sum=4.0, count=8, load_sum=0.0))   # after the first turns
    after = phase_sums(samples(ttft_sum=6.0, count=24, load_sum=1.6))   # 16 returning turns of 125 ms, 100 ms loads
    means = phase_means_ms(before, after)
    assert round(means["engine_ttft"], 6) == 125.0
    assert round(means["frontend_ttft"], 6) == 135.0
    assert round(means["engine_prefill"], 6) == 120.0
    assert means["engine_queue"] == 0.0
    assert round(means["kvbm_step_load"], 6) == 100.0  # a counter, divided by the requests vLLM counted
    assert means["kvbm_step_save"] == 0.0


def test_no_requests_in_between_gives_no_mean():
    same = phase_sums(samples(ttft_sum=4.0, count=8, load_sum=0.5))
    assert all(v is None for v in phase_means_ms(same, same).values())
