"""Hypothesis on the request plane's decoders: whatever bytes a peer sends, FrameReader raises
only FrameError and never buffers more than one frame's worth, and codec.decode raises only
DecodeError for every wire struct (arbitrary bytes, arbitrary well-formed msgpack, and msgpack
nested past the decoder's stack)."""

from __future__ import annotations

import struct

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turbine.protocol import embed, errors, frames, generate, kv_events, load_metrics, router
from turbine.protocol.frames import CHUNK, Frame
from turbine.runtime import codec
from turbine.runtime.errors import DecodeError
from turbine.runtime.request_plane import FrameError, FrameReader, encode_frame

MAX_FRAME = 1 << 16
_HEADER = 4

# Every struct a process decodes from a peer (request plane and event plane).
WIRE_TYPES = [
    frames.Frame, generate.GenerateRequest, generate.GenerateOutput, generate.ClearKvBlocksRequest,
    generate.StatusReply, errors.WorkerError, embed.EmbedRequest, embed.EmbedOutput, kv_events.KvEventBatch,
    kv_events.KvReplayRequest, kv_events.KvReplayChunk, load_metrics.LoadMetrics,
    *(obj for obj in vars(router).values() if isinstance(obj, type) and issubclass(obj, msgspec.Struct)
      and obj.__module__ == router.__name__),
]
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Any msgpack value: what a peer speaking msgpack, but not our schema, can send.
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12) | st.integers(-99, 99), inner,
                                                                max_size=5),
    max_leaves=30,
)


def _decode_only_raises_decode_error(data: bytes) -> None:
    for type_ in WIRE_TYPES:
        try:
            codec.decode(data, type_)
        except DecodeError:
            pass


@FUZZ
@given(st.binary(max_size=512))
def test_codec_arbitrary_bytes_raise_only_decode_error(data):
    _decode_only_raises_decode_error(data)


@FUZZ
@given(msgpack_values)
def test_codec_arbitrary_msgpack_raises_only_decode_error(value):
    _decode_only_raises_decode_error(msgspec.msgpack.encode(value))


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted({f for t in WIRE_TYPES for f in t.__struct_fields__})),
                       msgpack_values, max_size=8))
def test_codec_objects_with_wire_field_names_raise_only_decode_error(fields):
    """Objects that use the structs' own field names with any values get past the first key."""
    _decode_only_raises_decode_error(msgspec.msgpack.encode(fields))


@pytest.mark.parametrize("depth", [10_000, 1_000_000])
def test_codec_deep_nesting_is_a_decode_error(depth):
    """Found by fuzzing: an untyped field (kv_transfer_params, a text-mode message) nested past
    the decoder's stack raised RecursionError, which a worker answered as INTERNAL."""
    nested = b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]]
    enc = msgspec.msgpack.encode
    request = (b"\x84" + enc("request_id") + enc("r") + enc("model") + enc("m") + enc("token_ids") + enc([])
               + enc("kv_transfer_params") + b"\x81\xa1x" + nested)
    with pytest.raises(DecodeError, match="nested too deeply"):
        codec.decode(request, generate.GenerateRequest)
    output = b"\x82\xa9token_ids\x90\xb2kv_transfer_params\x81\xa1x" + nested
    with pytest.raises(DecodeError, match="nested too deeply"):
        codec.decode(output, generate.GenerateOutput)


@FUZZ
@given(chunks=st.lists(st.binary(max_size=300), max_size=12))
def test_frame_reader_arbitrary_bytes(chunks):
    """Only FrameError, and the reader never holds more than one frame (header + max) of input."""
    reader = FrameReader(MAX_FRAME)
    for chunk in chunks:
        try:
            reader.feed(chunk)
        except FrameError:
            return  # the connection is closed on the first bad frame
        assert len(reader._buf) <= _HEADER + MAX_FRAME


@FUZZ
@given(valid=st.lists(st.binary(max_size=100), max_size=3), garbage=st.binary(max_size=200),
       declared=st.integers(0, 2**32 - 1))
def test_frame_reader_garbage_after_valid_frames(valid, garbage, declared):
    """Good frames are returned, then anything after them is either more frames or a FrameError;
    a declared length over the limit is refused before its body arrives."""
    wire = b"".join(bytes(encode_frame(Frame(kind=CHUNK, stream_id=i, payload=p), MAX_FRAME))
                    for i, p in enumerate(valid))
    reader = FrameReader(MAX_FRAME)
    assert [f.payload for f in reader.feed(wire)] == valid
    try:
        reader.feed(struct.pack(">I", declared) + garbage)
    except FrameError as exc:
        assert declared > MAX_FRAME or declared <= len(garbage), exc
    else:
        assert declared <= MAX_FRAME
        assert len(reader._buf) <= _HEADER + MAX_FRAME


def test_frame_reader_huge_declared_length_buffers_nothing():
    reader = FrameReader(32 << 20)
    with pytest.raises(FrameError, match="exceeds max_frame_bytes"):
        reader.feed(struct.pack(">I", 2**32 - 1) + b"x" * 1000)
