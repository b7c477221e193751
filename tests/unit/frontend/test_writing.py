"""What every API's writer counts (pipeline.Writing) and which deltas a stream shows (Delta.shown):
one place for both, used by chat/completions, batches, Responses and Anthropic's Messages."""

from __future__ import annotations

import pytest

from turbine.frontend.deltas import Delta, ToolCallDelta, TokenLogprob
from turbine.frontend.metrics import FrontendMetrics
from turbine.frontend.pipeline import Writing


def sample(metrics: FrontendMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name, {"model": "m"}) or 0.0


def test_a_stream_that_ends_before_done_is_a_disconnect_and_a_whole_response_never_is():
    metrics = FrontendMetrics()
    model = metrics.of("m")
    with Writing(model) as writing:
        assert sample(metrics, "turbine_frontend_inflight_requests") == 1
        writing.done = True
    with pytest.raises(GeneratorExit):
        with Writing(model):  # the client left mid-stream: the writer's generator is closed
            raise GeneratorExit
    with Writing(model, stream=False):
        pass
    assert sample(metrics, "turbine_frontend_inflight_requests") == 0
    assert sample(metrics, "turbine_frontend_request_duration_seconds_count") == 3
    assert sample(metrics, "turbine_frontend_disconnected_clients_total") == 1


def test_a_stream_shows_every_delta_that_carries_output():
    assert not Delta(0).shown()
    for delta in (Delta(0, text="a"), Delta(0, reasoning="r"), Delta(0, finish_reason="stop"),
                  Delta(0, tool_calls=[ToolCallDelta(0, name="f")]), Delta(0, logprobs=[TokenLogprob(1, -0.1, [])])):
        assert delta.shown(), delta
