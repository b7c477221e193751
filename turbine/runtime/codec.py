"""msgpack encode/decode of msgspec Structs with cached decoders and one error type."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from turbine.runtime.errors import DecodeError

T = TypeVar("T")

# msgspec encoders are type-agnostic, so a single one serves every struct.
_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder] = {}


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def encode_into(obj: Any, buf: bytearray, offset: int) -> None:
    """Encode into `buf` starting at `offset` (buf is resized to fit), avoiding a copy."""
    _encoder.encode_into(obj, buf, offset)


def decoder(type_: type[T]) -> msgspec.msgpack.Decoder:
    """The cached msgpack decoder for `type_`."""
    dec = _decoders.get(type_)
    if dec is None:
        dec = _decoders[type_] = msgspec.msgpack.Decoder(type_)
    return dec


def decode(data: bytes | bytearray | memoryview, type_: type[T]) -> T:
    """Decode msgpack `data` into `type_`; any bad input raises DecodeError.

    Unknown fields are ignored; a missing or mistyped field is named in the message,
    e.g. "invalid GenerateRequest: Object missing required field `request_id`".
    """
    dec = _decoders.get(type_) or decoder(type_)
    try:
        return dec.decode(data)
    except msgspec.ValidationError as exc:
        raise DecodeError(f"invalid {_name(type_)}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise DecodeError(f"undecodable {_name(type_)}: {exc}") from None
    except RecursionError:  # an untyped (Any) field nested past the decoder's stack (found by fuzzing)
        raise DecodeError(f"undecodable {_name(type_)}: nested too deeply") from None


def _name(type_: Any) -> str:
    return getattr(type_, "__name__", repr(type_))
