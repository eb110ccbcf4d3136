"""The hand-written protobuf wire codec's contract with ``proto/qdelay/v1/qdelay.proto``.

The native codec (segments/_codec.c) parses SendBatchRequest and writes SubscribeResponse
and SendBatchRequest bytes itself, with the field numbers named once in its source and
exported as ``WIRE_FIELDS``. They are checked here against the generated descriptors when
the server or a client imports this module (start-up) and in tests/test_codec_native.py:
a ``.proto`` change that the C code does not follow fails loudly instead of putting wrong
bytes on the wire.
"""

from __future__ import annotations

from types import ModuleType

from qdelay.errors import InvariantViolation
from qdelay.segments import native
from qdelay.v1 import qdelay_pb2 as pb

ONE_BYTE_TAG = 15  # the codec writes every tag as one byte: fields 1-15


def mismatches(fields: dict[str, int]) -> list[str]:
    """What is wrong with ``fields`` (full field name -> number) against the descriptors."""
    pool = pb.DESCRIPTOR.pool
    out = []
    for full, number in sorted(fields.items()):
        message, _, name = full.rpartition(".")
        try:
            desc = pool.FindMessageTypeByName(message)
        except KeyError:
            out.append(f"{full}: no message {message} in the .proto")
            continue
        field = desc.fields_by_name.get(name)
        if field is None:
            out.append(f"{full}: no such field in the .proto")
        elif field.number != number:
            out.append(f"{full}: the codec uses field {number}, the .proto says {field.number}")
        elif number > ONE_BYTE_TAG:
            out.append(f"{full}: field {number} needs a tag of two bytes, the codec writes one")
    return out


def check(codec: ModuleType | type | None = None) -> None:
    """Raise :class:`InvariantViolation` unless the native codec (``native.codec`` by
    default; nothing to check when it is not built or switched off) follows the .proto."""
    codec = native.codec if codec is None else codec
    if codec is None:
        return
    fields = getattr(codec, "WIRE_FIELDS", None)
    if not fields:
        raise InvariantViolation("the native codec names no WIRE_FIELDS: rebuild it (make setup)")
    bad = mismatches(fields)
    if bad:
        raise InvariantViolation("the native codec does not follow proto/qdelay/v1/qdelay.proto: " + "; ".join(bad))


check()
