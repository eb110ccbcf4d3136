"""The schedule index: a file of fixed-width entries beside each schedule segment
(docs/formats.md, "Schedule index"), so that Cancel and Get find a record, and whether it
was cancelled, without walking the segment (issue 13).

A bucket's records are appended in sequence order (the iterate service copies the message
log in order and skips replays), so an append-only file of one 32-byte entry per record
is sorted by sequence for free: a lookup is a binary search over a memory map of it
(``index_find``: ~log2(n) entries touched), whatever the minute's size, and nothing of it
stays in memory between lookups (a far-future message costs disk, not RAM). A MESSAGE's
entry carries its due time and a hash of its id (a batch of receipts is checked without
reading a record) and a CANCELLED flag, set in place when its tombstone is copied into
the bucket; a CANCEL's entry carries its target.

It is derived state, never a second source of truth: written by the schedule log's one
writer (``BucketLog.append``, under the iterate service's append lock) before the bytes
it describes, published after them, fsynced with its segment before the iterate
checkpoint, and re-derived from the segment at open when it is missing, torn, behind or
ahead of it, and for every segment a crash may have left a tail in (docs/recovery.md).

The codec is ``index_entries``, ``index_find``, ``index_gather`` and ``index_confirm``
(segments/_codec.c), with their Python twins here (``index_entries_py``, ``index_find_py``,
``index_gather_py``, ``index_confirm_py``; tests/test_codec_native.py).
"""

from __future__ import annotations

import collections
import mmap
import operator
import os
import struct
import threading
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from qdelay.errors import CorruptRecord
from qdelay.segments import framing, native, records
from qdelay.segments.framing import RecordKind
from qdelay.segments.reader import columns_past_damage, frame_length, frame_spans, gather, header

if TYPE_CHECKING:
    from qdelay.segments.segment import HandlePool, Segment

SUFFIX = ".sidx"  # beside ``<YYYYMMDDHHMM>.sched``: ``<YYYYMMDDHHMM>.sched.sidx``
ENTRY_SIZE = 32
# an entry: sequence; offset (48 bits) | kind << 48 | flags << 56; then by kind: a MESSAGE's
# due time and the xxh3-64 of its id, a CANCEL's target sequence and target due time
ENTRY = np.dtype([("seq", "<i8"), ("where", "<u8"), ("a", "<i8"), ("b", "<u8")])
OFFSET_BITS = 48
OFFSET_MASK = (1 << OFFSET_BITS) - 1
KIND_AT = 14  # the kind byte of an entry
FLAGS_AT = 15  # the flags byte of an entry
FLAGS_SHIFT = 56  # the same byte, within the entry's second word
CANCELLED = 1  # flags bit: a CANCEL of this MESSAGE follows in the segment
if ENTRY.itemsize != ENTRY_SIZE:
    raise AssertionError("the schedule index entry is 32 bytes (docs/formats.md)")

_ENTRY_STRUCT = struct.Struct("<qQqQ")  # one entry, as ENTRY
_MESSAGE = int(RecordKind.MESSAGE)
_CANCEL = int(RecordKind.CANCEL)
_CANCELLED_WORD = np.uint64(CANCELLED << FLAGS_SHIFT)
_NO_TARGETS = np.empty(0, dtype=np.int64)


def path_of(segment_path: str) -> str:
    return segment_path + SUFFIX


# --- the codec: native functions and their Python twins ---------------------------------------


def index_entries(data: bytes | bytearray | memoryview, base: int) -> bytes:
    """The entries of the whole frames at the start of ``data`` (file offset ``base``),
    frames this process verified or wrote (native when built)."""
    codec = native.codec
    return (codec.index_entries if codec is not None else index_entries_py)(data, base)


def index_entries_py(data: bytes | bytearray | memoryview, base: int) -> bytes:
    """The Python twin of the native ``index_entries``: per whole frame (walked by the
    headers' lengths), 32 bytes: sequence; offset | kind << 48 (flags 0); a MESSAGE's due
    time and xxh3-64 of its id, a CANCEL's target sequence and target due time, zeros for
    other kinds. ValueError for a MESSAGE or CANCEL body too short for its fields, or an
    offset past 48 bits."""
    data = bytes(data)
    spans = frame_spans(data)
    out = np.zeros(len(spans), dtype=ENTRY)
    if not spans:
        return out.tobytes()
    starts = np.array([s[0] for s in spans], dtype=np.int64)
    kinds = gather(data, starts, framing.KIND_AT, 1)
    lengths = gather(data, starts, framing.LENGTH_AT, 4)
    at = starts + base
    for k, (start, kind, length, off) in enumerate(zip(starts.tolist(), kinds.tolist(), lengths.tolist(), at.tolist())):
        if base < 0 or off > OFFSET_MASK:
            raise ValueError(f"index_entries: an offset does not fit the index's 48 bits (frame at {off})")
        body = start + framing.HEADER_SIZE
        if kind == _MESSAGE:
            if length < records.MESSAGE_FIXED.size:
                raise ValueError(f"index_entries: a MESSAGE body is shorter than its fixed part (frame at {off})")
            due, slen, ilen, _h, _p = records.MESSAGE_FIXED.unpack_from(data, body)
            if records.MESSAGE_FIXED.size + slen + ilen > length:
                raise ValueError(f"index_entries: a MESSAGE's id runs past its body (frame at {off})")
            mid = body + records.MESSAGE_FIXED.size + slen
            out[k]["a"] = due
            out[k]["b"] = xxhash.xxh3_64_intdigest(data[mid : mid + ilen])
        elif kind == _CANCEL:
            if length < records.CANCEL_FIXED.size:
                raise ValueError(f"index_entries: a CANCEL body is shorter than its fixed part (frame at {off})")
            due, target, _n = records.CANCEL_FIXED.unpack_from(data, body)
            out[k]["a"] = target
            out[k]["b"] = due & 0xFFFF_FFFF_FFFF_FFFF
    out["seq"] = gather(data, starts, framing.SEQUENCE_AT, 8)
    out["where"] = at.astype(np.uint64) | (kinds.astype(np.uint64) << np.uint64(OFFSET_BITS))
    return out.tobytes()


def index_find(entries: bytes | bytearray | memoryview | mmap.mmap, seqs: np.ndarray) -> np.ndarray:
    """The position of each of ``seqs`` among ``entries`` (ascending by sequence), or -1
    (native when built)."""
    codec = native.codec
    q = np.ascontiguousarray(seqs, dtype=np.int64)
    return np.frombuffer((codec.index_find if codec is not None else index_find_py)(entries, q), dtype=np.int64)


def index_find_py(entries: bytes | bytearray | memoryview | mmap.mmap, seqs: np.ndarray | bytes) -> bytes:
    """The Python twin of the native ``index_find``: a binary search per sequence over the
    entries' first fields (only ~log2(n) entries read), -1 where absent; ValueError unless
    ``entries`` holds whole entries and ``seqs`` int64s."""
    view = memoryview(entries).cast("B")
    q = np.frombuffer(seqs, dtype=np.uint8) if isinstance(seqs, bytes) else np.asarray(seqs)
    if len(view) % ENTRY_SIZE or q.nbytes % 8:
        raise ValueError("index_find: entries are not whole 32-byte entries or seqs not int64")
    q = np.frombuffer(q.tobytes(), dtype=np.int64)
    n = len(view) // ENTRY_SIZE

    def seq_at(i: int) -> int:
        return int.from_bytes(view[i * ENTRY_SIZE : i * ENTRY_SIZE + 8], "little", signed=True)

    out = []
    for want in q.tolist():
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi) // 2
            if seq_at(mid) < want:
                lo = mid + 1
            else:
                hi = mid
        out.append(lo if lo < n and seq_at(lo) == want else -1)
    return np.array(out, dtype=np.int64).tobytes()


def index_gather(views: list[memoryview], seqs: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``index_find`` over several indexes at once (native when built): ``seqs`` grouped by
    index, ``counts[i]`` of them searched in ``views[i]``; (each one's position in its index
    or -1, the entries found, in order, as rows of four uint64 words)."""
    codec = native.codec
    fn = codec.index_gather if codec is not None else index_gather_py
    q = np.ascontiguousarray(seqs, dtype=np.int64)
    positions, found = fn(views, q, np.ascontiguousarray(counts, dtype=np.int64))
    return np.frombuffer(positions, dtype=np.int64), np.frombuffer(found, dtype="<u8").reshape(-1, 4)


def index_gather_py(views: list, seqs: np.ndarray | bytes, counts: np.ndarray | bytes) -> tuple[bytes, bytes]:
    """The Python twin of the native ``index_gather``: ``index_find_py`` in each view for its
    share of ``seqs`` (int64, grouped by view, ``counts`` int64 one per view), then the
    entries found; ValueError unless the counts add up to the sequences, one per view, and
    each view holds whole entries."""
    raw_q, raw_c = (a.tobytes() if isinstance(a, np.ndarray) else bytes(a) for a in (seqs, counts))
    if len(raw_q) % 8 or len(raw_c) % 8:
        raise ValueError("index_gather: seqs and counts are not int64")
    q, c = np.frombuffer(raw_q, dtype=np.int64), np.frombuffer(raw_c, dtype=np.int64)
    views = list(views)
    if len(c) != len(views):
        raise ValueError("index_gather: not one count per view")
    if bool((c < 0).any()) or int(c.sum()) != len(q):
        raise ValueError("index_gather: the counts do not add up to the sequences")
    positions: list[bytes] = []
    found: list[bytes] = []
    at = 0
    for view, k in zip(views, c.tolist()):
        entries = memoryview(view).cast("B")
        if len(entries) % ENTRY_SIZE:
            raise ValueError("index_gather: a view is not whole 32-byte entries")
        pos = np.frombuffer(index_find_py(entries, q[at : at + k].tobytes()), dtype=np.int64)
        positions.append(pos.tobytes())
        found += [bytes(entries[p * ENTRY_SIZE : (p + 1) * ENTRY_SIZE]) for p in pos.tolist() if p >= 0]
        at += k
    return b"".join(positions), b"".join(found)


def index_confirm(views: list, counts: list[int], seqs: list[int], dues: list[int], ids: list[str]) -> list[int]:
    """Of a few receipts (``seqs``, ``dues``, ``ids``, grouped by index, ``counts[i]`` of them
    in ``views[i]``), the position of each one's MESSAGE entry in its index, -1 where the
    index does not hold exactly that MESSAGE (sequence, due time, a non-empty id of that
    hash): ``index_gather`` and the comparison of its entries in one call, with lists in
    and out (native when built)."""
    codec = native.codec
    return (codec.index_confirm if codec is not None else index_confirm_py)(views, counts, seqs, dues, ids)


def index_confirm_py(views: list, counts: list, seqs: list, dues: list, ids: list) -> list[int]:
    """The Python twin of the native ``index_confirm``: TypeError unless the five are lists,
    the ids str and the rest ints; ValueError unless there is one count per view, one due
    time and id per sequence, the counts add up to the sequences and each view holds whole
    entries; OverflowError for a number past int64."""
    if not all(isinstance(a, list) for a in (views, counts, seqs, dues, ids)):
        raise TypeError("index_confirm: views, counts, seqs, dues and ids must be lists")
    if len(counts) != len(views):
        raise ValueError("index_confirm: not one count per view")
    if len(dues) != len(seqs) or len(ids) != len(seqs):
        raise ValueError("index_confirm: not one due time and one id per sequence")
    if not all(isinstance(i, str) for i in ids):
        raise TypeError("index_confirm: ids must be str")
    left = len(seqs)
    for c in map(_i64, counts):
        if c < 0 or c > left:
            raise ValueError("index_confirm: the counts do not add up to the sequences")
        left -= c
    if left:
        raise ValueError("index_confirm: the counts do not add up to the sequences")
    q, want = [_i64(x) for x in seqs], [_i64(x) for x in dues]
    out: list[int] = []
    at = 0
    for view, c in zip(views, counts):
        entries = memoryview(view).cast("B")
        if len(entries) % ENTRY_SIZE:
            raise ValueError("index_confirm: a view is not whole 32-byte entries")
        pos = np.frombuffer(index_find_py(entries, np.array(q[at : at + c], dtype=np.int64).tobytes()), dtype=np.int64)
        for i, p in zip(range(at, at + c), pos.tolist()):
            if p >= 0:
                _seq, where, due, id_hash = _ENTRY_STRUCT.unpack_from(entries, p * ENTRY_SIZE)
                mid = ids[i].encode()
                if where >> OFFSET_BITS & 0xFF != _MESSAGE or due != want[i] or not mid:
                    p = -1
                elif xxhash.xxh3_64_intdigest(mid) != id_hash:
                    p = -1
            out.append(p)
        at += c
    return out


def _i64(x: object) -> int:
    """``x`` as the native codec reads an int64 (``__index__``): TypeError for a non-int,
    OverflowError past int64."""
    v = operator.index(x)  # type: ignore[arg-type]
    if not -(1 << 63) <= v < 1 << 63:
        raise OverflowError("index_confirm: a number does not fit int64")
    return v


def _flag_targets(entries: np.ndarray) -> np.ndarray:
    """Set CANCELLED on the MESSAGE entries of ``entries`` (contiguous, in sequence order)
    that a CANCEL among them targets; return the targets not found among them."""
    cancels = np.flatnonzero(entries["where"] >> np.uint64(OFFSET_BITS) & np.uint64(0xFF) == _CANCEL)
    if not len(cancels):
        return np.empty(0, dtype=np.int64)
    targets = entries["a"][cancels]
    if len(cancels) == len(entries):
        # tombstones alone (a Cancel's append to its targets' minute: one a minute a
        # CancelBatch touches, each ~70-130 us of the iterate thread): none of their
        # targets is among them, no search of them needed
        return targets
    pos = index_find(entries.tobytes(), targets)
    hit = pos >= 0
    rows = pos[hit]
    is_msg = (entries["where"][rows] >> np.uint64(OFFSET_BITS) & np.uint64(0xFF)) == _MESSAGE
    entries["where"][rows[is_msg]] |= _CANCELLED_WORD
    return targets[~hit]


# --- one segment's index file ---------------------------------------------------------------


class Found:
    """What the index says of a batch of sequences: per sequence, whether it has an entry,
    and of those that have, the entries' fields."""

    __slots__ = ("hit", "positions", "offsets", "kinds", "flags", "a", "b")

    def __init__(self, hit: np.ndarray, rows: np.ndarray, positions: np.ndarray | None = None) -> None:
        self.hit = hit  # bool per asked sequence
        # of those that have an entry, its place among the index's entries (IndexFile.flags_at)
        self.positions = np.zeros(0, dtype=np.int64) if positions is None else positions
        where = rows["where"]
        self.offsets = (where & np.uint64(OFFSET_MASK)).astype(np.int64)
        self.kinds = (where >> np.uint64(OFFSET_BITS) & np.uint64(0xFF)).astype(np.int64)
        self.flags = (where >> np.uint64(FLAGS_SHIFT)).astype(np.int64)
        self.a = rows["a"].astype(np.int64)  # MESSAGE: due time; CANCEL: target sequence
        self.b = rows["b"]  # MESSAGE: id hash (uint64); CANCEL: target due time


# Readers keep a memory map of the index files they looked up last, at most this many:
# mapping and unmapping a file per lookup cost ~50-120 us (the syscalls, a page fault per
# entry touched, and the unmap's TLB shootdown across the server's threads), more than the
# search. A map holds only the pages a search touched (file-backed, clean: the kernel may
# drop them), and a far-future minute nobody looks up is never mapped.
MAX_MAPS = 64
_maps: collections.OrderedDict[int, IndexFile] = collections.OrderedDict()
_maps_lock = threading.Lock()


class IndexFile:
    """The index of one schedule segment. ``count`` entries are published (they describe
    records already in the segment); readers look at those only. One writer (the schedule
    log's, under the iterate service's append lock); readers on any thread."""

    __slots__ = ("path", "pool", "count", "_dirty", "_map")

    def __init__(self, path: str, pool: HandlePool, count: int = 0) -> None:
        self.path = path
        self.pool = pool  # the segments' HandlePool
        self.count = count
        self._dirty = False
        # (a read-only map of the file, the entries it covers), kept while this file is among
        # the MAX_MAPS last looked up; replaced (never closed under a reader: it closes when
        # the last reader drops it) when the published entries outgrow it
        self._map: tuple[mmap.mmap, int] | None = None

    def _mapped(self, n: int) -> mmap.mmap:
        """A map of the file covering at least its ``n`` published entries."""
        m = self._map
        if m is None or m[1] < n:
            fd = self.pool.acquire(self.path)
            try:
                size = os.fstat(fd).st_size
                # shared and writable: the writer sets CANCELLED flags through it (readers
                # only read); its dirty pages are written back by ``sync``'s fdatasync
                mm = mmap.mmap(fd, size - size % ENTRY_SIZE, access=mmap.ACCESS_WRITE)
            finally:
                self.pool.release(fd)
            m = self._map = (mm, len(mm) // ENTRY_SIZE)
        with _maps_lock:
            _maps[id(self)] = self
            _maps.move_to_end(id(self))
            while len(_maps) > MAX_MAPS:
                _maps.popitem(last=False)[1]._map = None
        return m[0]

    def _unmap(self) -> None:
        self._map = None
        with _maps_lock:
            _maps.pop(id(self), None)

    # -- writing --

    def write_ahead(self, data: bytes | bytearray, base: int) -> int:
        """Write the entries of ``data`` (whole frames about to be appended to the segment
        at ``base``) past the published ones, and flag the targets of its cancels; return
        how many entries to publish once the segment holds the bytes. Safe to repeat after
        a failed write (the same place is written again)."""
        raw = index_entries(data, base)
        n = len(raw) // ENTRY_SIZE
        if not n:
            return 0
        # an append of messages alone (nearly every one) is written as index_entries made
        # it: the copy, the look for targets and the bytes again cost ~15 us an append
        # (bench.iterate: a checkpoint flushes ~60 of them)
        if (np.frombuffer(raw, dtype=np.uint8)[KIND_AT::ENTRY_SIZE] == _CANCEL).any():
            entries = np.frombuffer(raw, dtype=ENTRY).copy()
            missing = _flag_targets(entries)
            raw = entries.tobytes()
        else:
            missing = _NO_TARGETS
        pool = self.pool
        fd = pool.acquire(self.path, create=True)
        try:
            if len(missing) and self.count:
                # targets copied in earlier appends: their flags set in place (a byte each;
                # set before the tombstone reaches the segment, which is harmless: the
                # tombstone is already durable in the message log, and the replay after a
                # crash writes it again)
                self._set_flags(*self._find(np.asarray(missing, dtype=np.int64), self.count))
            _pwrite_all(fd, raw, self.count * ENTRY_SIZE)
        finally:
            pool.release(fd)
        self._dirty = True
        return n

    @staticmethod
    def _set_flags(view: memoryview, positions: np.ndarray) -> None:
        """CANCELLED into the flags byte of the entries at ``positions`` (-1: none) of
        ``view`` (what ``_find`` searched), through the map: a pwrite each cost ~3 us, half
        the iterate thread's work per tombstone."""
        positions = positions[positions >= 0]
        if len(positions):
            flags = np.frombuffer(view, dtype=np.uint8)
            flags[positions * ENTRY_SIZE + FLAGS_AT] = CANCELLED

    def publish(self, n: int) -> None:
        self.count += n

    def sync(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        with self.pool.fd(self.path) as fd:
            os.fdatasync(fd)

    def rebuild(self, seg: Segment) -> int:
        """Derive the whole index from the segment ``seg`` (verified frames; a corrupt one is
        stepped over) and write it durably; return the entries written."""
        parts = []
        pos, stop = 0, seg.size
        while pos < stop:
            cols, pos = columns_past_damage(seg, pos, stop)
            if cols is not None and len(cols):
                parts.append(index_entries(memoryview(cols.data)[: cols.end], cols.base))
        entries = np.frombuffer(b"".join(parts), dtype=ENTRY).copy()
        _flag_targets(entries)
        self._unmap()
        self.pool.forget(self.path)
        # a new file renamed over the old one: a reader's map of the old one stays valid
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(entries.tobytes())
            f.flush()
            os.fdatasync(f.fileno())
        os.replace(tmp, self.path)
        self.pool.forget(self.path)
        self.count = len(entries)
        self._dirty = False
        return self.count

    def matches(self, seg: Segment) -> bool:
        """Whether the file describes exactly the segment's records as far as its length and
        last entries tell: whole entries, the last two ascending, and the last one's record
        ends where the segment ends, with that sequence (a missing, torn, behind or ahead
        file does not). Two small reads: cheap enough for every segment at open."""
        try:
            size = os.path.getsize(self.path)
        except FileNotFoundError:
            return False
        if size % ENTRY_SIZE or (size == 0) != (seg.size == 0):
            return False
        if size == 0:
            return True
        with open(self.path, "rb") as f:
            tail = np.frombuffer(os.pread(f.fileno(), 2 * ENTRY_SIZE, max(0, size - 2 * ENTRY_SIZE)), dtype=ENTRY)
        last = tail[-1]
        offset = int(last["where"]) & OFFSET_MASK
        if len(tail) == 2 and not (tail[0]["seq"] < last["seq"] and int(tail[0]["where"]) & OFFSET_MASK < offset):
            return False  # not ascending: not what the writer appends
        head = seg.read(offset, framing.HEADER_SIZE) if offset < seg.size else b""
        if len(head) < framing.HEADER_SIZE:
            return False
        h = header(head)
        ok = h.sequence == int(last["seq"]) and offset + framing.HEADER_SIZE + frame_length(head) == seg.size
        if ok:
            self.count = size // ENTRY_SIZE
        return ok

    def delete(self) -> None:
        self._unmap()
        self.pool.forget(self.path)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    # -- reading --

    def _find(self, q: np.ndarray, n: int) -> tuple[memoryview, np.ndarray]:
        """(a view of the mapped entries, the position of each of ``q`` in it or -1), ``n``
        entries published. The map kept from an earlier lookup answers when it holds every
        sequence asked for or they lie below its last entry: a tombstone appended since (each
        Cancel appends one) does not make every reader map the file again, which cost a
        fresh map's page faults and the old one's unmap per Cancel."""
        m = self._map
        if m is not None and 0 < m[1] < n:
            k = m[1]
            view = memoryview(m[0])[: k * ENTRY_SIZE]
            pos = index_find(view, q)
            last = int.from_bytes(view[(k - 1) * ENTRY_SIZE : (k - 1) * ENTRY_SIZE + 8], "little", signed=True)
            if not bool(((pos < 0) & (q > last)).any()):
                self._mapped(k)  # counted as looked up (kept among the last MAX_MAPS)
                return view, pos
        view = memoryview(self._mapped(n))[: n * ENTRY_SIZE]
        return view, index_find(view, q)

    def searchable(self, highest: int) -> memoryview:
        """The published entries to search for sequences up to ``highest`` (``_find``'s view
        without the search, for ``index_gather``): the map kept from an earlier lookup when
        every entry appended since has a higher sequence (a tombstone each Cancel appends
        does not make every reader map the file again), else a map of them all."""
        n = self.count
        if n == 0:
            return memoryview(b"")
        try:
            m = self._map
            if m is not None and 0 < m[1] < n:
                k = m[1]
                view = memoryview(m[0])[: k * ENTRY_SIZE]
                if highest <= int.from_bytes(
                    view[(k - 1) * ENTRY_SIZE : (k - 1) * ENTRY_SIZE + 8], "little", signed=True
                ):
                    self._mapped(k)  # counted as looked up (kept among the last MAX_MAPS)
                    return view
            return memoryview(self._mapped(n))[: n * ENTRY_SIZE]
        except FileNotFoundError:
            raise CorruptRecord(self.path, 0, "the schedule index is missing (it is rebuilt at start)") from None

    def entry(self, seq: int) -> tuple[int, int, int, int, int] | None:
        """``lookup`` of one sequence without arrays of results: its published entry as
        (offset, kind, flags, a, b), or None. A Get makes two single lookups; the arrays
        of a ``Found`` cost ~20 us of numpy calls each, the search itself ~2 us."""
        n = self.count
        if n == 0:
            return None
        try:
            view, found = self._find(np.array([seq], dtype=np.int64), n)
        except FileNotFoundError:
            raise CorruptRecord(self.path, 0, "the schedule index is missing (it is rebuilt at start)") from None
        pos = int(found[0])
        if pos < 0:
            return None
        _seq, where, a, b = _ENTRY_STRUCT.unpack_from(view, pos * ENTRY_SIZE)
        return where & OFFSET_MASK, where >> OFFSET_BITS & 0xFF, where >> FLAGS_SHIFT, a, b

    def lookup(self, seqs: np.ndarray | list[int]) -> Found:
        """The published entries of ``seqs``: a binary search each over a memory map of the
        file, then the found entries read (a few pages touched, whatever the file's size)."""
        pos, words = self.entries(seqs)
        hit = pos >= 0
        return Found(hit, words.view(ENTRY)[:, 0], pos[hit])

    def entries(self, seqs: np.ndarray | list[int]) -> tuple[np.ndarray, np.ndarray]:
        """``lookup`` as raw arrays: (the position of each of ``seqs`` among the published
        entries, -1 where absent; the entries of those found, in order, as rows of four
        uint64 words: sequence, where, a, b). Plain words rather than ENTRY records: a
        caller searching many indexes (a batch of duplicates over many minutes) joins
        them and decodes the fields once, and joining records cost ~7 us an array."""
        q = np.asarray(seqs, dtype=np.int64)
        n = self.count
        if n == 0 or not len(q):
            return np.full(len(q), -1, dtype=np.int64), np.zeros((0, 4), dtype=np.uint64)
        try:
            view, pos = self._find(q, n)
        except FileNotFoundError:
            raise CorruptRecord(self.path, 0, "the schedule index is missing (it is rebuilt at start)") from None
        words = np.frombuffer(view, dtype="<u8", count=len(view) // 8).reshape(-1, 4)
        return pos, words[pos[pos >= 0]]  # a copy

    def flags_at(self, positions: np.ndarray) -> np.ndarray:
        """The flags byte of the published entries at ``positions`` (from ``lookup``), read
        now through the map: no search. Entries are only appended, so a position stays its
        entry's; the writer sets a flag in place (``write_ahead``)."""
        positions = np.asarray(positions, dtype=np.int64)
        if not len(positions):
            return np.zeros(0, dtype=np.int64)
        m = self._flags_map(int(positions.max()))
        return np.frombuffer(m, dtype=np.uint8)[positions * ENTRY_SIZE + FLAGS_AT].astype(np.int64)

    def flags_of(self, positions: list[int]) -> list[int]:
        """``flags_at`` of a few positions, as a list: each flag byte read from the map as an
        int (no arrays; a gathered ``cancel()`` batch's closed-state look)."""
        if not positions:
            return []
        m = self._flags_map(max(positions))
        return [m[p * ENTRY_SIZE + FLAGS_AT] for p in positions]

    def _flags_map(self, top: int) -> mmap.mmap:
        """A map holding the entry at position ``top``: the map ``lookup`` found it in (or a
        later one), else the file mapped to its published count. Mapping the file afresh
        because tombstones were appended since would cost a page fault per entry read."""
        kept = self._map
        if kept is not None and top < kept[1]:
            return self._mapped(kept[1])
        try:
            return self._mapped(self.count)
        except FileNotFoundError:
            raise CorruptRecord(self.path, 0, "the schedule index is missing (it is rebuilt at start)") from None


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n == 0:
            raise OSError("pwrite wrote nothing")
        view = view[n:]
        offset += n


def id_hashes(message_ids: list[str]) -> np.ndarray:
    """The xxh3-64 of each id's bytes (what a MESSAGE's entry holds), as uint64."""
    # maps of C functions, no Python frame per id (a CancelBatch hashes a thousand)
    hashes = map(xxhash.xxh3_64_intdigest, map(str.encode, message_ids))
    return np.fromiter(hashes, dtype=np.uint64, count=len(message_ids))
