"""segments/idindex.py on its own: MESSAGE frames put as id -> (due, sequence); a message
without an id is left out; a rebuild (keep_newer) never replaces a newer sequence."""

from __future__ import annotations

import numpy as np

from qdelay.segments import framing, idindex, records
from qdelay.segments.framing import RecordKind
from qdelay.segments.idindex import IdIndex


def _frames(items: list[tuple[str, int, int]]) -> tuple[bytes, np.ndarray, np.ndarray, np.ndarray]:
    """(data, starts, dues, sequences) of MESSAGE frames for (id, due, sequence) items."""
    data, starts = b"", []
    for mid, due, seq in items:
        body = records.encode_message(b"sub.j", mid.encode(), b"", b"payload", due)
        starts.append(len(data))
        data += framing.encode(RecordKind.MESSAGE, seq, 0, body)
    dues = np.array([d for _m, d, _s in items], dtype=np.int64)
    seqs = np.array([s for _m, _d, s in items], dtype=np.int64)
    return data, np.array(starts, dtype=np.int64), dues, seqs


def test_put_frames_indexes_ids_skips_empty_ones_and_keeps_newer_on_rebuild(tmp_path):
    index = IdIndex(str(tmp_path / "ids"))
    try:
        index.put_frames(*_frames([("a", 100, 1), ("", 200, 2), ("ccc", 300, 3), ("a", 400, 4)]))
        assert index.get("a") == (400, 4)  # puts in sequence order: the newest message wins
        assert index.get("ccc") == (300, 3)
        assert index.get("") is None and index.get("b") is None
        # a rebuild reads buckets out of sequence order: an older message must not win
        index.put_frames(*_frames([("a", 50, 2), ("ccc", 900, 9), ("dd", 10, 1)]), keep_newer=True)
        assert index.get_many(["a", "ccc", "dd", "zz"]) == [(400, 4), (900, 9), (10, 1), None]
        assert index.holds(["a", "a", "dd"], [400, 100, 10], [4, 1, 1]) == [True, False, True]
    finally:
        index.close()


def test_put_frames_in_chunks_indexes_every_frame_and_newest_wins_across_chunks(tmp_path, monkeypatch):
    # a large read is put PUT_CHUNK frames at a time (bounded transient Python objects);
    # an id repeated in a later chunk still maps to its newest message
    monkeypatch.setattr(idindex, "PUT_CHUNK", 3)
    index = IdIndex(str(tmp_path / "ids"))
    try:
        items = [(f"m{i}", 100 + i, i + 1) for i in range(10)] + [("m0", 999, 11)]
        index.put_frames(*_frames(items))
        assert index.puts == 11
        assert index.get("m0") == (999, 11)
        assert index.get_many([f"m{i}" for i in range(1, 10)]) == [(100 + i, i + 1) for i in range(1, 10)]
    finally:
        index.close()


def test_flush_idle_writes_a_large_enough_memtable_out_and_keeps_every_id(tmp_path, monkeypatch):
    path = str(tmp_path / "ids")
    index = IdIndex(path)
    try:
        empty = index.memory()["id_index_memtable_bytes"]  # a new memtable's first block
        index.put_frames(*_frames([(f"m{i}", 100 + i, i + 1) for i in range(100)]))
        held = index.memory()["id_index_memtable_bytes"]
        assert 0 < held < idindex.IDLE_FLUSH_BYTES
        assert not index.flush_idle()  # too small to be worth an SST: kept
        assert index.memory()["id_index_memtable_bytes"] == held
        monkeypatch.setattr(idindex, "IDLE_FLUSH_BYTES", held)
        assert index.flush_idle()
        assert index.memory()["id_index_memtable_bytes"] == empty
        assert index.get_many(["m0", "m99"]) == [(100, 1), (199, 100)]
    finally:
        index.close()
    index = IdIndex(path)
    try:
        assert index.get("m50") == (150, 51)
    finally:
        index.close()


class _PutDuringFlush:
    """Stands in for the index's database: its first WAL flush lets another put in while it
    runs (the iterate thread putting while the checkpoint's thread syncs); counts flushes."""

    def __init__(self, index: IdIndex, db) -> None:
        self.index, self.db, self.flushes = index, db, 0

    def __getattr__(self, name: str):
        return getattr(self.db, name)

    def flush_wal(self, sync: bool) -> None:
        self.flushes += 1
        self.db.flush_wal(sync)
        if self.flushes == 1:
            self.index.put_frames(*_frames([("late", 700, 7)]))  # written after that flush


def test_a_put_made_while_sync_flushes_is_flushed_by_the_next_sync(tmp_path):
    index = IdIndex(str(tmp_path / "ids"))
    db = index._db
    try:
        index.put_frames(*_frames([("a", 100, 1)]))
        index._db = spy = _PutDuringFlush(index, db)
        index.sync()
        assert spy.flushes == 1
        # the next checkpoint covers "late": its sync must flush it (it skipped the flush,
        # its count of unsynced puts zeroed after the first flush)
        index.sync()
        assert spy.flushes == 2
        index.sync()  # nothing put since: no flush
        assert spy.flushes == 2
    finally:
        index._db = db
        index.close()
