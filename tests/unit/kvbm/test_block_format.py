"""The block file format: round trip, and every kind of damage is refused."""

import pytest

from turbine.kvbm.block import HEADER_SIZE, Block, CorruptBlock, decode, encode, file_name, hash_of_name, read_file


def test_round_trip_keeps_every_field():
    b = Block(0xFFFF_FFFF_FFFF_FFFF, 0x1234, 16, bytes(range(256)) * 4)
    assert decode(encode(b), b.block_hash) == b
    root = Block(7, None, 3, b"xyz")
    assert decode(encode(root), 7) == root  # a chain's first block: no parent, distinct from parent 0
    assert len(encode(root)) == HEADER_SIZE + 3


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "truncate_header", "grow",
                                    "magic", "wrong_hash"])
def test_damage_is_detected(damage, tmp_path):
    b = Block(42, 41, 16, b"\x01" * 1000)
    raw = bytearray(encode(b))
    expected = 42
    if damage == "flip_payload":
        raw[HEADER_SIZE + 500] ^= 0x40
    elif damage == "flip_header":
        raw[24] ^= 0x01  # the token count
    elif damage == "truncate":
        raw = raw[:-1]
    elif damage == "truncate_header":
        raw = raw[:HEADER_SIZE - 1]
    elif damage == "grow":
        raw += b"\x00"
    elif damage == "magic":
        raw[0:4] = b"XXXX"
    elif damage == "wrong_hash":
        expected = 43  # a file renamed onto another block's name
    with pytest.raises(CorruptBlock):
        decode(bytes(raw), expected)
    for buffer in (None, lambda n: memoryview(bytearray(n))):  # the file readers find the same damage
        with pytest.raises(CorruptBlock):
            _read(tmp_path, raw, expected, buffer)


def _read(tmp_path, raw, expected_hash, buffer=None) -> Block:
    path = tmp_path / "block.kvb"
    path.write_bytes(bytes(raw))
    with open(path, "rb", buffering=0) as f:
        return read_file(f, expected_hash, buffer)


def test_a_file_is_read_straight_into_the_buffer_given_or_into_bytes(tmp_path):
    b = Block(0x77, 0x76, 16, bytes(range(256)) * 40)
    into = memoryview(bytearray(len(b.data)))
    asked = []
    got = _read(tmp_path, encode(b), 0x77, lambda n: asked.append(n) or into)
    assert got == b and got.data is into and asked == [len(b.data)]
    assert _read(tmp_path, encode(b), 0x77, lambda n: None) == b  # no buffer: bytes of its own
    assert _read(tmp_path, encode(b), 0x77) == b


def test_names():
    assert file_name(0xAB) == "00000000000000ab.kvb"
    assert hash_of_name(file_name(2**64 - 1)) == 2**64 - 1
    assert hash_of_name(".00000000000000ab.123.abc.tmp") is None
    assert hash_of_name("notahexnumber000.kvb") is None


def test_block_checks_itself():
    with pytest.raises(ValueError):
        Block(-1, None, 1, b"")
    with pytest.raises(ValueError):
        Block(1, 2**64, 1, b"")
    with pytest.raises(ValueError):
        Block(1, None, 0, b"")
    with pytest.raises(TypeError):
        Block(1, None, 1, bytearray(b"x"))


def test_a_memoryview_payload_is_written_as_its_bytes():
    """The vLLM connector's blocks on a GPU are views of pinned host memory: the same file as bytes give."""
    raw = bytearray(b"kv" * 64)
    view = Block(0x5, 0x4, 16, memoryview(raw))
    assert view.nbytes == 128 and encode(view) == encode(Block(0x5, 0x4, 16, bytes(raw)))
    assert decode(encode(view), 0x5).data == bytes(raw)
    with pytest.raises(ValueError, match="one contiguous run of bytes"):
        Block(0x5, None, 16, memoryview(raw).cast("H"))
    with pytest.raises(TypeError, match="bytes or a memoryview"):
        Block(0x5, None, 16, bytearray(raw))


def test_a_file_cut_short_after_its_size_was_taken_is_corrupt(tmp_path, monkeypatch):
    """The reader takes the file's size, then reads: a file truncated in between is refused, not a crash."""
    import os

    b = Block(0x78, None, 16, b"\x02" * 100)
    monkeypatch.setattr(os, "fstat", lambda fd: os.stat_result((0,) * 6 + (HEADER_SIZE + 100,) + (0,) * 3))
    with pytest.raises(CorruptBlock, match="shorter than"):
        _read(tmp_path, encode(b)[:HEADER_SIZE - 4], 0x78, lambda n: memoryview(bytearray(n)))
    with pytest.raises(CorruptBlock, match="shrank while read"):
        _read(tmp_path, encode(b)[:HEADER_SIZE + 50], 0x78, lambda n: memoryview(bytearray(n)))
