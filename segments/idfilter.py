"""The id filter: a Bloom filter over the message-id index's keys, so that looking up an id
the index does not hold (every new id of an idempotent send) costs a few hashed bit tests in
C instead of a RocksDB multi-get (issue 13's ingest cost; docs/benchmarks.md).

It never misses an id that was added; it may answer "maybe" for one that was not (at most
~4.6 % however large it grows, ~2.3 % with one layer at its capacity, far less below it),
and such an id is then looked up in the index as before. The id index
(segments/idindex.py) owns it: it builds it from a scan of its keys in the background
when it opens (until then every lookup goes to RocksDB) and adds every key it puts. It is
a scalable Bloom filter: once its newest layer holds its capacity, a new layer of twice the
bits takes the new ids, so it grows without rescanning the index (a rescan held the GIL
for ~170 ns a key: over a second at 8 M ids, against the event loop and the writes).
Nothing of it is on disk: it is derived from the index, as the index is from the schedule
log.

A layer's bits live in a writable buffer (an anonymous mmap) whose length is a power of
two; an id sets ``PROBES`` bits: h = XXH3_64 of its UTF-8 bytes, h1 = the low 32 bits,
h2 = the high 32 bits | 1, bit i = (h1 + i * h2) mod the number of bits (bit b is bit
b % 8 of byte b // 8). ``filter_add`` (one layer, any writable buffer) and
``filter_maybe_layers`` (every layer at once, any buffers) are the native codec's
(segments/_codec.c), with their Python twins here.
"""

from __future__ import annotations

import math
import mmap
import threading

import xxhash

from qdelay.segments import native

PROBES = 7
BITS_PER_KEY = 8  # the first layer's, at capacity: 8-16 bits a key (the size is a power of two)
MIN_CAPACITY = 1 << 20  # 1 MiB of bits
FP_AT_CAPACITY = (1.0 - math.exp(-PROBES / BITS_PER_KEY)) ** PROBES  # ~2.3 %
LAYER_TIGHTENING = 0.5  # each layer's false-positive rate at capacity against the previous one's

_xxh = xxhash.xxh3_64_intdigest


def _mask(bits: bytes | bytearray | mmap.mmap | memoryview) -> int:
    n = len(bits)
    if n < 8 or n & (n - 1):
        raise ValueError("id filter: its length is not a power of two of at least 8 bytes")
    return n * 8 - 1


def _positions(h: int, mask: int) -> list[int]:
    h1, h2 = h & 0xFFFFFFFF, (h >> 32) | 1
    return [(h1 + i * h2) & mask for i in range(PROBES)]


def filter_add_py(bits: bytearray | mmap.mmap, keys: list[bytes]) -> None:
    """The Python twin of the native ``filter_add``: set each key's bits (in any writable
    buffer: a layer's bits are an anonymous mmap)."""
    if not isinstance(bits, (bytearray, mmap.mmap)) or not isinstance(keys, list):
        raise TypeError("filter_add: a bytearray (or mmap) and a list of keys")
    mask = _mask(bits)
    for key in keys:
        if not isinstance(key, bytes):
            raise TypeError("filter_add: keys must be bytes")
        for at in _positions(_xxh(key), mask):
            bits[at >> 3] |= 1 << (at & 7)


MAX_LAYERS = 64  # filter_maybe_layers' limit: 64 layers of ~1.7 times the ids each is far past any index


def filter_maybe_layers_py(layers: list, ids: list[str]) -> list[int]:
    """The Python twin of the native ``filter_maybe_layers``: the positions of the ids whose
    bits are all set in at least one of ``layers`` (buffers, each a filter of its own size)."""
    if not isinstance(layers, list) or not isinstance(ids, list):
        raise TypeError("filter_maybe_layers: a list of layers and a list of ids")
    if not 1 <= len(layers) <= MAX_LAYERS:
        raise ValueError("filter_maybe_layers: 1 to 64 layers")
    views, masks = [], []
    for layer in layers:  # in order, as the native side: a non-buffer, then a wrong size
        view = memoryview(layer).cast("B")
        masks.append(_mask(view))
        views.append(view)
    out = []
    for i, message_id in enumerate(ids):
        if not isinstance(message_id, str):
            raise TypeError("filter_maybe_layers: ids must be str")
        h = _xxh(message_id.encode())
        for view, mask in zip(views, masks, strict=True):
            if all(view[at >> 3] & (1 << (at & 7)) for at in _positions(h, mask)):
                out.append(i)
                break
    return out


class _Layer:
    """One Bloom filter: ``nbits`` bits (a power of two) that hold ``capacity`` ids."""

    __slots__ = ("bits", "capacity", "count")

    def __init__(self, nbits: int, capacity: int) -> None:
        self.capacity = capacity
        # anonymous memory, zero until touched: a bytearray is zeroed at once under the GIL
        # (4 MiB 12 ms, 32 MiB 80 ms on this 2-core machine under load) in the put that
        # makes the layer; these pages are mapped as ids first set their bits
        self.bits = mmap.mmap(-1, nbits // 8)
        self.count = 0


def layer_bits_per_key(layer: int) -> float:
    """Bits an id that give layer ``layer`` (0 = the first) the false-positive rate
    ``FP_AT_CAPACITY * LAYER_TIGHTENING ** layer`` at its capacity, with ``PROBES`` probes:
    p = (1 - e^(-k/b))^k solved for b. 8 for the first, then ~9.3, 10.8, 12.3, 14.1 ..."""
    p = FP_AT_CAPACITY * LAYER_TIGHTENING**layer
    return -PROBES / math.log(1.0 - p ** (1.0 / PROBES))


def first_layer_bits(capacity: int) -> int:
    """The first layer's bits: the power of two of at least ``BITS_PER_KEY`` a key."""
    nbits = 64
    while nbits < capacity * BITS_PER_KEY:
        nbits *= 2
    return nbits


def next_layer(bits: int, layer: int) -> tuple[int, int]:
    """(bits, capacity) of layer ``layer`` >= 1 after one of ``bits`` bits: twice the bits,
    and as many ids as keep its rate at capacity to ``layer_bits_per_key(layer)`` (~1.7 times
    the ids of the layer before). Doubling the bits rather than the ids keeps the layers
    powers of two without rounding each up: at 10 M ids 1 + 2 + 4 + 8 MiB, not 1 + 4 + 8 + 16."""
    bits *= 2
    return bits, int(bits / layer_bits_per_key(layer))


class IdFilter:
    """A scalable Bloom filter (Almeida et al., 2007) of layers: the first sized for
    ``capacity`` ids, each next one of twice the bits and a false-positive rate
    ``LAYER_TIGHTENING`` times lower at its capacity (``next_layer``). Ids are added to the
    newest layer until it holds its capacity, then a new layer is made (in memory, at once:
    nothing is rescanned); a lookup asks every layer. The rate of the whole is at most the
    sum of the layers' rates at capacity, below ``FP_AT_CAPACITY / (1 - LAYER_TIGHTENING)``
    (~4.6 %) however many layers it grows, and far less when the first layer was sized for
    what it holds."""

    def __init__(self, capacity: int) -> None:
        first = max(MIN_CAPACITY, capacity)  # the first layer's capacity
        # replaced, never mutated in place, so a lookup without the owner's lock sees a whole list
        self._layers: list[_Layer] = [_Layer(first_layer_bits(first), first)]
        self.count = 0
        # adds come from two threads while the owner's scan runs (its chunks, and the puts):
        # two of them making the next layer at once would drop one's layer and its ids
        self._adding = threading.Lock()

    @property
    def layers(self) -> int:
        return len(self._layers)

    @property
    def nbytes(self) -> int:
        return sum(len(layer.bits) for layer in self._layers)

    def add(self, keys: list[bytes]) -> None:
        codec = native.codec
        add = codec.filter_add if codec is not None else filter_add_py
        with self._adding:
            while keys:
                layer = self._layers[-1]
                room = layer.capacity - layer.count
                if room <= 0:
                    nbits, capacity = next_layer(len(layer.bits) * 8, len(self._layers))
                    self._layers = [*self._layers, _Layer(nbits, capacity)]
                    continue
                part = keys if len(keys) <= room else keys[:room]
                add(layer.bits, part)
                layer.count += len(part)
                self.count += len(part)
                keys = keys[len(part) :]

    def maybe(self, ids: list[str]) -> list[int]:
        """The positions in ``ids`` of those that may have been added (the others were not),
        in order: those one of the layers may hold, in one native call (``filter_maybe_layers``:
        each id hashed once, the layers' first probes prefetched a run of ids at a time)."""
        codec = native.codec
        maybe = codec.filter_maybe_layers if codec is not None else filter_maybe_layers_py
        return maybe([layer.bits for layer in self._layers], ids)
