"""The message-id index: message id -> (deliver_at_ms, sequence) of the newest message
that carried it, for Cancel / Get by id and for idempotent send (issue 13).

It lives on disk (a far-future message must cost disk, not RAM) in RocksDB, through
``rocksdict``: an LSM tree gives batched inserts at about a microsecond a key, point
lookups that read a block or two (bloom filters skip the upper levels' files without the
key; the last level, which holds most keys, has none, since the id filter in
segments/idfilter.py turns new ids away first and a lookup that gets here is a hit), and
crash safety, with memory bounded by the memtable and block cache rather than by the
number of keys. Hand-writing sorted runs, compaction and filters would be that library
again. Reads use pread, not mmap, so the index does not show up in the server's RSS.

It is derived state, never a second source of truth: the iterate service puts the id of
every MESSAGE it copies to the schedule log, and syncs the index's WAL before each
iterate checkpoint, so after a crash the replay from the checkpoint puts what was lost. A
write error (a full disk) disables the index instead of stopping the iterate service; by-id
calls then answer UNAVAILABLE until a restart rebuilds it.
If the folder is missing, or was left half-built, the engine rebuilds it from the
schedule segments (``rebuild``); see docs/recovery.md.

An id reused after delivery maps to the newest message (puts happen in sequence order).
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import shutil
import struct
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from rocksdict import (
    BlockBasedOptions,
    Cache,
    DBCompressionType,
    Options,
    Rdict,
    ReadOptions,
    WriteBatch,
    WriteOptions,
)

from qdelay.errors import Unavailable
from qdelay.segments import framing, native, records
from qdelay.segments.framing import RecordKind
from qdelay.segments.idfilter import IdFilter
from qdelay.segments.reader import Damage, walk_reads

if TYPE_CHECKING:
    from qdelay.segments.bucket_log import BucketLog

log = logging.getLogger("qdelay.segments.idindex")

_VALUE = np.dtype([("due", "<i8"), ("seq", "<i8")])
_PAIR = struct.Struct("<qq")  # one value: the same two fields
# a MESSAGE frame's fields, from the frame's start (the body layout is named in records.py)
_SUBJECT_LEN_AT = framing.HEADER_SIZE + records.MESSAGE_SUBJECT_LEN_AT
_ID_LEN_AT = framing.HEADER_SIZE + records.MESSAGE_ID_LEN_AT
_SUBJECT_AT = framing.HEADER_SIZE + records.MESSAGE_FIXED.size
BUILT_MARK = "BUILT"  # written once the index covers every schedule segment
# The block cache: the data blocks read last (the index and filter blocks are kept by the
# open table readers, outside it: ~1.3 B a key at 10 bits a key of filter, ~0.3 B with the
# last level's left out). RocksDB's own default is the same 32 MiB; named here so that the
# memory is bounded by a figure we set.
# A larger one buys little: a lookup that misses it reads one 4 KiB block from the page
# cache (~0.3 us more than a hit here), and at 3 M ids 128 MiB (every block cached) was
# ~12 % faster a lookup than 32 MiB (docs/benchmarks.md, "Cost against the number of
# pending messages").
CACHE_BYTES = 32 * 1024 * 1024
# The memtable: keys put since the last flush to an SST file, in RAM (skip list and arena);
# two at most (one flushing). RocksDB's default 64 MiB, or the 16 MiB used until 26 Nov,
# was most of the server's RSS growth over 1 M far-future messages (~15 MB of memtable at
# the end of bench.compare's memory scenario); 4 MiB flushes every ~130,000 ids (a short
# background write) at no measured cost to ingest or to by-id lookups (docs/benchmarks.md,
# "Memory per pending message and the dedupe bookkeeping").
MEMTABLE_BYTES = 4 * 1024 * 1024
# Frames indexed per write: the keys and values of one write are small Python objects
# (~100 B an id) in pymalloc's arenas, which go back to the kernel only when wholly free. A
# 16 MiB read of the iterate service is ~200,000 ids: put at once, they spread ~10 MB of
# arenas that a few survivors then pinned (RSS 3.7 B a pending message more at 1 M); 8,192
# at a time still ~1 MB of them a write, 1,024 ~0.1 MB, at no ingest cost measured (one
# WriteBatch and lock a thousand ids; docs/benchmarks.md, "RSS per pending message").
PUT_CHUNK = 1024
# A memtable holding at least this much when ingest goes idle is written out to an SST then
# (flush_idle) and its memory handed back, instead of staying in RAM until ingest fills it:
# at the end of a burst it held 0.5-3 MB, a quarter of the index's RSS at 1 M pending.
# Smaller ones are kept: a server idling between trickles of sends would otherwise write
# a tiny SST (a file, and compaction work) each time; with this floor an idle flush writes
# at least a quarter of what a full memtable does, so at most 4x the files of full flushes.
IDLE_FLUSH_BYTES = 1024 * 1024


def _get_many(db: Rdict, keys: list[bytes]) -> list[bytes | None]:
    """The value of each key, or None (rocksdict's multi-get; its stubs type it as one value)."""
    return cast("list[bytes | None]", db.get(cast(Any, keys)))


def _i64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


def id_entries_py(
    data: bytes | memoryview, starts: np.ndarray, dues: np.ndarray, seqs: np.ndarray
) -> tuple[list, list]:
    """The Python twin of the native ``id_entries``: the index's (keys, values) of the
    MESSAGE frames starting at ``starts`` of ``data`` (int64 arrays or their bytes): per
    frame with a non-empty id, its id's bytes and (due, sequence) packed as two
    little-endian i64, in frame order. ValueError if an id runs past the data."""
    st, du, sq = (
        np.frombuffer(a, dtype=np.int64) if isinstance(a, bytes) else np.asarray(a) for a in (starts, dues, seqs)
    )
    if not (len(st) == len(du) == len(sq)):
        raise ValueError("id_entries: starts, dues and seqs are not int64 arrays of one length")
    keys: list[bytes] = []
    values: list[bytes] = []
    for s, due, seq in zip(st.tolist(), du.tolist(), sq.tolist()):
        if s < 0 or s > len(data) - _SUBJECT_AT:
            raise ValueError(f"id_entries: a frame at {s} runs past the data")
        slen = int.from_bytes(data[s + _SUBJECT_LEN_AT : s + _SUBJECT_LEN_AT + 2], "little")
        ilen = int.from_bytes(data[s + _ID_LEN_AT : s + _ID_LEN_AT + 2], "little")
        at = s + _SUBJECT_AT + slen
        if at + ilen > len(data):
            raise ValueError(f"id_entries: the id of the frame at {s} runs past the data")
        if ilen:
            keys.append(bytes(data[at : at + ilen]))
            values.append(_PAIR.pack(due, seq))
    return keys, values


# IdIndex.memory(): stats key -> RocksDB property
_MEMORY_PROPERTIES = {
    "id_index_memtable_bytes": "rocksdb.cur-size-all-mem-tables",
    "id_index_block_cache_bytes": "rocksdb.block-cache-usage",
    "id_index_table_readers_bytes": "rocksdb.estimate-table-readers-mem",
}


class IdIndex:
    def __init__(self, path: str, cache_bytes: int = CACHE_BYTES) -> None:
        self.path = path
        os.makedirs(path, exist_ok=True)
        opt = Options(raw_mode=True)
        opt.create_if_missing(True)
        opt.set_write_buffer_size(MEMTABLE_BYTES)
        opt.set_max_write_buffer_number(2)
        table = BlockBasedOptions()
        table.set_bloom_filter(10, False)
        table.set_block_cache(Cache(cache_bytes))
        opt.set_block_based_table_factory(table)
        # No bloom filter in the last level's files (most of the keys): the id filter
        # (segments/idfilter.py) answers the new ids first, so a lookup that reaches RocksDB
        # is nearly always a hit, which the last level's filter would not spare a block
        # read. It cut the table readers from 1.28 to 0.22-0.32 MB at 1 M ids with the
        # re-send (every id a hit) no dearer (docs/benchmarks.md, "RSS per pending message").
        opt.set_optimize_filters_for_hits(True)
        opt.set_compression_type(DBCompressionType.none())  # ids are short and random: not worth the CPU
        # (no bloom filter over the memtables: it halved the cost of looking up a missing key
        # but added ~0.15 us to every put, and the id filter now answers those lookups)
        self._db = Rdict(path, opt)
        # Its own WAL on but not synced per write (the page cache survives a process kill);
        # sync() makes it durable before each iterate checkpoint. A failed write (a full
        # disk) disables the index rather than the iterate service (see _fail).
        self._wo = WriteOptions()
        self.puts = 0  # frames put (by one thread at a time: the iterate service's, or a rebuild)
        # ``puts`` as the last sync() read it before its flush: sync() runs on the iterate
        # checkpoint's thread while the iterate thread puts. A count of unsynced puts set to
        # 0 after the flush dropped the puts made during it, and the next checkpoint's sync,
        # finding none, skipped its flush (ingest had stopped): that checkpoint moved past
        # records whose ids were in the index's unsynced WAL alone, and a power loss then
        # lost those ids for good (the replay starts after them): NOT_FOUND by id, and a
        # re-send written twice
        self._synced_puts = 0
        self.failed: str | None = None  # why the index stopped (a write error); restart rebuilds
        # The id filter (segments/idfilter.py) in front of lookups: None until a scan of the
        # keys has built it (started by start_filter() when the server opens, whatever its
        # role, or else by the first lookup); it grows by layers past its capacity, so that
        # scan is the only one (``scans`` counts them). Every put adds its keys to it, or to
        # the one being built, under _filter_lock with the write, so that the scan's
        # iterator, made under that lock, sees every key that was written before and not
        # added to the new filter.
        self._filter: IdFilter | None = None
        self._building: IdFilter | None = None
        self._filter_lock = threading.Lock()
        self._scan: threading.Thread | None = None
        self.scans = 0
        self._closing = False

    @property
    def built(self) -> bool:
        return os.path.exists(os.path.join(self.path, BUILT_MARK))

    def mark_built(self) -> None:
        with open(os.path.join(self.path, BUILT_MARK), "w") as f:
            f.write("1\n")
            f.flush()
            os.fsync(f.fileno())

    def _fail(self, err: BaseException) -> None:
        """A write failed (e.g. a full disk): stop indexing rather than stop the iterate
        service; drop the built mark so that the next start rebuilds the index."""
        if self.failed is None:
            self.failed = str(err)
            log.error("id index disabled after a write error; a restart rebuilds it", extra={"error": str(err)})
            try:
                os.unlink(os.path.join(self.path, BUILT_MARK))
            except OSError:
                pass

    def put_frames(
        self,
        cols_data: bytes | memoryview,
        starts: np.ndarray,
        dues: np.ndarray,
        seqs: np.ndarray,
        keep_newer: bool = False,
    ) -> None:
        """Index the MESSAGE frames starting at ``starts`` of ``cols_data``, given in
        sequence order; ``keep_newer``: an id already indexed with a later sequence keeps
        it (a rebuild reads buckets out of sequence order)."""
        n = len(starts)
        if n == 0 or self.failed is not None:
            return
        try:
            for at in range(0, n, PUT_CHUNK):
                end = at + PUT_CHUNK
                self._put_frames(cols_data, starts[at:end], dues[at:end], seqs[at:end], keep_newer)
        except Exception as err:  # noqa: BLE001 - any storage error of the library
            self._fail(err)

    def _put_frames(
        self, cols_data: bytes | memoryview, starts: np.ndarray, dues: np.ndarray, seqs: np.ndarray, keep_newer: bool
    ) -> None:
        codec = native.codec
        entries = codec.id_entries if codec is not None else id_entries_py
        keys, values = entries(cols_data, _i64(starts), _i64(dues), _i64(seqs))
        if keep_newer and keys:
            unpack = _PAIR.unpack
            kept = [
                (k, v)
                for k, v, now in zip(keys, values, _get_many(self._db, keys))
                if now is None or unpack(now)[1] <= unpack(v)[1]
            ]
            keys, values = [k for k, _v in kept], [v for _k, v in kept]
        wb = WriteBatch(raw_mode=True)
        collections.deque(map(wb.put, keys, values), maxlen=0)  # the loop in C: ~0.2 us a key less
        with self._filter_lock:
            for f in (self._filter, self._building):
                if f is not None:
                    f.add(keys)  # before the write: the filter may say "maybe", never "no", for a key
            self._db.write(wb, self._wo)
        self.puts += len(starts)  # after the write: sync() flushes what it counts

    def flush_idle(self) -> bool:
        """Write the memtables out to an SST if they hold at least IDLE_FLUSH_BYTES (the
        caller: nothing more to index for now), waiting for it; returns whether it did.
        What they held stays durable either way (the WAL until now, the SST after). A
        failed flush (a full disk) disables the index, as a failed put does."""
        if self.failed is not None:
            return False
        try:
            if int(self._db.property_int_value("rocksdb.cur-size-all-mem-tables") or 0) < IDLE_FLUSH_BYTES:
                return False
            self._db.flush(True)
        except Exception as err:  # noqa: BLE001 - any storage error of the library
            self._fail(err)
            return False
        return True

    def start_filter(self) -> None:
        """Build the id filter in the background now, unless it is built or being built.

        The server calls this when it opens, whatever its role: a slave never looks ids up,
        so its filter was first built by the first write after its promotion, whose scan of
        every key (~0.3 us a key, in Python) then held the GIL against that write and the
        next ones (bench.admin: 10-30 ms for the first write at 100,000 ids); a master's
        first writes after a restart paid the same."""
        if self._filter is None and self._building is None and self._scan is None:
            with self._filter_lock:
                if self._building is None:
                    self._start_scan(int(1.5 * self._estimate_keys()))

    @property
    def filter_keys(self) -> int:
        """Ids in the id filter (0 until its scan at the start is done)."""
        f = self._filter
        return f.count if f is not None else 0

    @property
    def filter_layers(self) -> int:
        """Layers of the id filter (0 until its scan at the start is done; one more each
        time it passes a capacity)."""
        f = self._filter
        return f.layers if f is not None else 0

    def memory(self) -> dict[str, int]:
        """Bytes the index holds in memory, by RocksDB's own figures (its memtables, block
        cache and table readers: bounded, whatever the number of ids) and the id filter's
        layers (~1-2 bytes an id): what a server's RSS owes the index."""
        f = self._filter
        out = {"id_filter_bytes": f.nbytes if f is not None else 0}
        for key, prop in _MEMORY_PROPERTIES.items():
            try:
                out[key] = int(self._db.property_int_value(prop) or 0)
            except Exception:  # noqa: BLE001 - a closed or failed index: figures only
                out[key] = 0
        return out

    def _start_scan(self, capacity: int) -> None:
        """Build a filter of ``capacity`` from a scan of the keys, in the background
        (_filter_lock held: the new filter gets every put from now on, the scan the rest)."""
        if self._closing:
            return
        self.scans += 1
        building = self._building = IdFilter(capacity)
        self._scan = threading.Thread(target=self._fill, args=(building,), name="qdelay-id-filter", daemon=True)
        self._scan.start()

    def _fill(self, building: IdFilter) -> None:
        try:
            # a scan reads every block once: kept out of the block cache, which it would fill
            # (32 MiB, 3 B a message at 10 M) with blocks no lookup asked for
            scan = ReadOptions()
            scan.fill_cache(False)  # type: ignore[call-arg]  # (rocksdict's stub leaves out its bool)
            with self._filter_lock:  # after the last put that did not add to ``building``
                keys = iter(cast("Iterable[bytes]", self._db.keys(read_opt=scan)))  # raw mode: bytes
            # chunks gathered by islice, the loop in C: 250 -> 170 ns a key (it holds the GIL)
            while chunk := list(itertools.islice(keys, 4096)):
                if self._closing:
                    return
                building.add(chunk)
            with self._filter_lock:
                self._filter, self._building = building, None
            log.info("id filter built", extra={"keys": building.count, "bytes": building.nbytes})
        except Exception as err:  # noqa: BLE001 - lookups go on through RocksDB alone
            with self._filter_lock:
                self._building = None
            log.warning("id filter not built", extra={"error": str(err)})

    def rebuild(self, schedule: BucketLog) -> int:
        """Index every MESSAGE of the schedule segments (after a loss of the index, or on
        a data folder older than it); returns how many. A damaged segment is indexed
        around its damage: every verified record, as the loader delivers them (a corrupt
        stretch is skipped and reading resumes after it; a torn or zeroed tail ends it)."""
        count = 0
        for bucket in schedule.buckets():
            seg = schedule.get(bucket)
            if seg is None:
                continue
            for part in walk_reads(seg.read, 0, seg.size, 4 * 1024 * 1024):
                if isinstance(part, Damage):
                    log.warning(
                        "id index rebuild skips damage",
                        extra={"path": seg.path, "offset": part.offset, "end": part.end, "reason": part.reason},
                    )
                    continue
                rows = part.kinds == RecordKind.MESSAGE
                self.put_frames(part.data, part.starts[rows], part.dues[rows], part.seqs[rows], keep_newer=True)
                count += int(rows.sum())
        self.sync()
        self.mark_built()
        return count

    def _usable(self) -> None:
        if self.failed is not None:
            raise Unavailable(f"the message-id index is disabled after a write error ({self.failed}); restart")

    def get(self, message_id: str) -> tuple[int, int] | None:
        """(deliver_at_ms, sequence) of the newest message with this id, or None."""
        self._usable()
        v = self._db.get(message_id.encode())
        return None if v is None else _PAIR.unpack(v)

    def get_many(self, message_ids: Iterable[str]) -> list[tuple[int, int] | None]:
        self._usable()
        ids = message_ids if isinstance(message_ids, list) else list(message_ids)
        if not ids:
            return []
        filt = self._filter
        if filt is None:
            self.start_filter()
            found = _get_many(self._db, list(map(str.encode, ids)))
        else:
            maybe = filt.maybe(ids)  # the others are certainly not in the index
            found = [None] * len(ids)
            if maybe:
                for k, v in zip(maybe, _get_many(self._db, [ids[k].encode() for k in maybe])):
                    found[k] = v
        if found.count(None) == len(found):  # the common case of new ids: nothing to unpack
            return cast("list[tuple[int, int] | None]", found)
        unpack = _PAIR.unpack
        return [None if v is None else unpack(v) for v in found]

    def _estimate_keys(self) -> int:
        try:
            return int(self._db.property_int_value("rocksdb.estimate-num-keys") or 0)
        except Exception:  # noqa: BLE001 - only sizes the filter
            return 0

    def holds(self, message_ids: list[str], dues: list[int], seqs: list[int]) -> list[bool]:
        """Whether each id maps to exactly this (due, sequence), i.e. that message is in the
        schedule log with that id and due time (what the index holds comes from its MESSAGE
        record); one multi-get and a bytes comparison each, no value decoded. False also
        for an id reused since (the index keeps the newest): the caller looks further."""
        self._usable()
        n = len(message_ids)
        if n == 0:
            return []
        want = np.empty(n, dtype=_VALUE)
        want["due"] = dues
        want["seq"] = seqs
        wb = want.tobytes()
        got = _get_many(self._db, [m.encode() for m in message_ids])
        return [v == wb[16 * i : 16 * i + 16] for i, v in enumerate(got)]

    def sync(self) -> None:
        """Make every put so far durable (called before the iterate checkpoint moves)."""
        puts = self.puts  # before the flush: every put it counts was written before it
        if puts == self._synced_puts or self.failed is not None:
            return
        try:
            self._db.flush_wal(True)
        except Exception as err:  # noqa: BLE001 - any storage error of the library
            self._fail(err)
            return
        self._synced_puts = puts

    def close(self) -> None:
        self._closing = True
        scan = self._scan
        if scan is not None:
            scan.join()  # its iterator must not outlive the database
        try:
            self._db.close()  # flushes the memtable, if it can
        except Exception as err:  # noqa: BLE001 - e.g. a full disk: the replay puts it again
            log.warning("id index closed without its last flush", extra={"error": str(err)})

    @staticmethod
    def destroy(path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)
