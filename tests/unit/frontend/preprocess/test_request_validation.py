import json

import pytest

from turbine.frontend.preprocess.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    decode_request,
    prompts_of,
    validate_chat,
    validate_completion,
)

MSG = [{"role": "user", "content": "hi"}]


def chat(**kw):
    body = {"model": "m", "messages": MSG, **kw}
    req = decode_request(json.dumps(body).encode(), ChatCompletionRequest)
    validate_chat(req)
    return req


def completion(**kw):
    body = {"model": "m", "prompt": "p", **kw}
    req = decode_request(json.dumps(body).encode(), CompletionRequest)
    validate_completion(req)
    return req


@pytest.mark.parametrize("kw,param", [
    ({"temperature": 2.5}, "temperature"), ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"min_p": 2}, "min_p"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"), ({"min_tokens": -1}, "min_tokens"),
    ({"stop": ""}, "stop"), ({"stop": ["a", ""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": 1}, "top_logprobs"),
    ({"seed": 2**64}, "seed"), ({"temperature": "x"}, "temperature"), ({"n": 1.5}, "n"),
    ({"messages": []}, "messages"), ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
])
def test_invalid_chat_parameters_name_the_parameter(kw, param):
    with pytest.raises(RequestError) as info:
        chat(**kw)
    assert info.value.status == 400
    assert info.value.param == param
    assert info.value.body()["error"]["param"] == param


def test_valid_chat_passes():
    req = chat(temperature=0.5, top_p=0.9, top_k=-1, n=2, stop=["x"], logprobs=True, top_logprobs=3,
               stream=True, stream_options={"include_usage": True})
    assert req.n == 2 and req.stream_options.include_usage


def test_missing_field_and_malformed_json():
    with pytest.raises(RequestError) as info:
        decode_request(b'{"model": "m"}', ChatCompletionRequest)
    assert info.value.param == "messages"
    with pytest.raises(RequestError) as info:
        decode_request(b"{nope", ChatCompletionRequest)
    assert "malformed JSON" in info.value.message


def test_unknown_fields_are_refused_naming_them():
    with pytest.raises(RequestError) as info:
        chat(some_future_field=1)
    assert info.value.param == "some_future_field"


@pytest.mark.parametrize("prompt,expected", [
    ("text", ["text"]), ([1, 2, 3], [[1, 2, 3]]), (["text"], ["text"]), ([[4, 5]], [[4, 5]]),
    (["a", "b"], ["a", "b"]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_completion_prompt_forms(prompt, expected):
    assert prompts_of(completion(prompt=prompt)) == expected


@pytest.mark.parametrize("kw,param", [
    ({"prompt": []}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": ["a", [1]]}, "prompt"),
    ({"prompt": [1, -1]}, "prompt"), ({"prompt": [1, True]}, "prompt"), ({"prompt": [1, 2.0]}, "prompt"),
    ({"prompt": [[1], [2, "a"]]}, "prompt"), ({"logprobs": 21}, "logprobs"),
    ({"suffix": "s"}, "suffix"),
])
def test_invalid_completion(kw, param):
    with pytest.raises(RequestError) as info:
        completion(**kw)
    assert info.value.param == param
