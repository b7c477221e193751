import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from turbine.protocol.discovery import InstanceRecord
from turbine.protocol.generate import GenerateOutput, GenerateRequest, SamplingOptions, TopLogprob
from turbine.runtime import codec
from turbine.runtime.errors import DecodeError


def test_round_trip_nested_structs():
    req = GenerateRequest(
        request_id="r1",
        model="m",
        token_ids=[1, 2, 3],
        sampling=SamplingOptions(temperature=0.5, seed=7),
    )
    assert codec.decode(codec.encode(req), GenerateRequest) == req
    out = GenerateOutput(token_ids=[5], top_logprobs=[[TopLogprob(5, -0.1), TopLogprob(6, -2.5)]])
    assert codec.decode(codec.encode(out), GenerateOutput) == out


@given(
    token_ids=st.lists(st.integers(min_value=0, max_value=2**31), max_size=50),
    request_id=st.text(max_size=20),
    temperature=st.none() | st.floats(allow_nan=False),
)
def test_round_trip_property(token_ids, request_id, temperature):
    req = GenerateRequest(
        request_id=request_id, model="m", token_ids=token_ids, sampling=SamplingOptions(temperature=temperature)
    )
    assert codec.decode(codec.encode(req), GenerateRequest) == req


def test_decoder_is_cached_per_type():
    assert codec.decoder(GenerateRequest) is codec.decoder(GenerateRequest)
    assert codec.decoder(GenerateRequest) is not codec.decoder(GenerateOutput)


def test_unknown_fields_are_ignored():
    data = msgspec.msgpack.encode({"request_id": "r", "model": "m", "token_ids": [1], "from_the_future": {"x": 1}})
    assert codec.decode(data, GenerateRequest) == GenerateRequest(request_id="r", model="m", token_ids=[1])


def test_missing_field_is_named():
    data = msgspec.msgpack.encode({"model": "m", "token_ids": [1]})
    with pytest.raises(DecodeError, match=r"GenerateRequest.*missing required field `request_id`"):
        codec.decode(data, GenerateRequest)


def test_invalid_field_is_named():
    data = msgspec.msgpack.encode({"request_id": "r", "model": "m", "token_ids": [1, "two"]})
    with pytest.raises(DecodeError, match=r"token_ids\[1\]"):
        codec.decode(data, GenerateRequest)


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x92\x01", b"\xff" * 10, b"not msgpack at all"])
def test_garbage_raises_decode_error_only(data):
    with pytest.raises(DecodeError):
        codec.decode(data, InstanceRecord)
