import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turbine.protocol.frames import CHUNK, Frame
from turbine.runtime.errors import FrameTooLarge
from turbine.runtime.request_plane import FrameError, FrameReader, encode_frame

MAX_FRAME = 1 << 20


@settings(max_examples=50, deadline=None)
@given(
    payloads=st.lists(st.binary(max_size=300), min_size=1, max_size=8),
    cuts=st.lists(st.integers(min_value=1, max_value=50), max_size=30),
)
def test_frame_reader_reassembles_any_split(payloads, cuts):
    frames = [Frame(kind=CHUNK, stream_id=i, payload=p) for i, p in enumerate(payloads)]
    wire = b"".join(bytes(encode_frame(f, MAX_FRAME)) for f in frames)
    reader, got, pos = FrameReader(MAX_FRAME), [], 0
    for cut in cuts:
        got += reader.feed(wire[pos : pos + cut])
        pos += cut
    got += reader.feed(wire[pos:])
    assert got == frames


def test_frame_reader_rejects_oversized_length_before_body():
    with pytest.raises(FrameError, match="exceeds max_frame_bytes"):
        FrameReader(100).feed(struct.pack(">I", 101))


def test_frame_reader_rejects_undecodable_frame():
    with pytest.raises(FrameError, match="Frame"):
        FrameReader(100).feed(struct.pack(">I", 1) + b"\xc1")


def test_encode_frame_refuses_oversized_frame():
    with pytest.raises(FrameTooLarge):
        encode_frame(Frame(kind=CHUNK, stream_id=1, payload=b"x" * 200), 100)
