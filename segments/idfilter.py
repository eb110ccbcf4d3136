"""The id filter: a Bloom filter over the message-id index's keys, so that looking up an id
the index does not hold (every new id of an idempotent send) costs a few hashed bit tests in
C instead of a RocksDB multi-get (issue 13's ingest cost; docs/benchmarks.md).

It never misses an id that was added; it may answer "maybe" for one that was not (about
2 % at its capacity, far less below it), and such an id is then looked up in the index as
before. The id index (segments/idindex.py) owns it: it adds every key it puts, builds it
from a scan of its keys in the background after a start (until then every lookup goes to
RocksDB), and builds a larger one the same way when it passes its capacity. Nothing of it is
on disk: it is derived from the index, as the index is from the schedule log.

The bits live in a bytearray whose length is a power of two; an id sets ``PROBES`` bits:
h = XXH3_64 of its UTF-8 bytes, h1 = the low 32 bits, h2 = the high 32 bits | 1, bit i =
(h1 + i * h2) mod the number of bits (bit b is bit b % 8 of byte b // 8). ``filter_add``
and ``filter_maybe`` are the native codec's (segments/_codec.c), with their Python twins
here.
"""

from __future__ import annotations

import xxhash

from qdelay.segments import native

PROBES = 7
BITS_PER_KEY = 8  # at capacity: between 8 and 16 bits a key (the size is a power of two)
MIN_CAPACITY = 1 << 20  # 1 MiB of bits

_xxh = xxhash.xxh3_64_intdigest


def _mask(bits: bytes | bytearray) -> int:
    n = len(bits)
    if n < 8 or n & (n - 1):
        raise ValueError("id filter: its length is not a power of two of at least 8 bytes")
    return n * 8 - 1


def _positions(h: int, mask: int) -> list[int]:
    h1, h2 = h & 0xFFFFFFFF, (h >> 32) | 1
    return [(h1 + i * h2) & mask for i in range(PROBES)]


def filter_add_py(bits: bytearray, keys: list[bytes]) -> None:
    """The Python twin of the native ``filter_add``: set each key's bits."""
    if not isinstance(bits, bytearray) or not isinstance(keys, list):
        raise TypeError("filter_add: a bytearray and a list of keys")
    mask = _mask(bits)
    for key in keys:
        if not isinstance(key, bytes):
            raise TypeError("filter_add: keys must be bytes")
        for at in _positions(_xxh(key), mask):
            bits[at >> 3] |= 1 << (at & 7)


def filter_maybe_py(bits: bytes | bytearray, ids: list[str]) -> list[int]:
    """The Python twin of the native ``filter_maybe``: the positions of the ids whose bits
    are all set."""
    if not isinstance(ids, list):
        raise TypeError("filter_maybe: ids must be a list")
    mask = _mask(bits)
    out = []
    for i, message_id in enumerate(ids):
        if not isinstance(message_id, str):
            raise TypeError("filter_maybe: ids must be str")
        if all(bits[at >> 3] & (1 << (at & 7)) for at in _positions(_xxh(message_id.encode()), mask)):
            out.append(i)
    return out


class IdFilter:
    """A Bloom filter sized for ``capacity`` ids; ``full`` once more were added."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(MIN_CAPACITY, capacity)
        nbits = 64
        while nbits < self.capacity * BITS_PER_KEY:
            nbits *= 2
        self.bits = bytearray(nbits // 8)
        self.count = 0

    @property
    def full(self) -> bool:
        return self.count > self.capacity

    def add(self, keys: list[bytes]) -> None:
        codec = native.codec
        (codec.filter_add if codec is not None else filter_add_py)(self.bits, keys)
        self.count += len(keys)

    def maybe(self, ids: list[str]) -> list[int]:
        """The positions in ``ids`` of those that may have been added (the others were not)."""
        codec = native.codec
        return (codec.filter_maybe if codec is not None else filter_maybe_py)(self.bits, ids)
