"""POST /v1/responses through the real frontend and real vLLM CPU workers (the shared
cluster), driven by the official `openai` client: create, stream, tools, and refusals."""

from __future__ import annotations

import openai
import pytest

from tests.integration.conftest import MODEL

QUESTION = "What is the capital of France? Answer in one sentence."


def test_create_answers_with_a_message_item(client):
    r = client.responses.create(model=MODEL, input=QUESTION, instructions="You are a geography teacher.",
                                max_output_tokens=24, temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output_text.strip()
    assert 0 < r.usage.output_tokens <= 24
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # Same text as the chat endpoint for the same conversation, greedy.
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": "You are a geography teacher."}, {"role": "user", "content": QUESTION}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_streamed_deltas_equal_the_final_text_and_the_unstreamed_text(client):
    kwargs = dict(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
                  max_output_tokens=24, temperature=0)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()  # the model stops well before max_output_tokens
    assert "".join(deltas) == final.output_text == whole.output_text and final.status == "completed"
    events = list(client.responses.create(stream=True, **kwargs))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


def test_previous_response_id_and_bad_input_are_named_400s_and_the_server_keeps_serving(client):
    for kwargs, param in [({"input": "hi", "previous_response_id": "resp_123"}, "previous_response_id"),
                          ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                           "input[0].content[0]"),
                          ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
                          ({"input": "hi", "store": True}, "store"),
                          ({"input": "hi", "extra_body": {"frobnicate": True}}, "frobnicate")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=MODEL, max_output_tokens=4, **kwargs)
        assert info.value.body["param"] == param
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=4).output_text
