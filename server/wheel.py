"""The in-memory timer: a compact index of the messages due within the loaded window.

qdelay's timer has two levels. Level 1 is on disk: one schedule segment per due bucket
(a minute by default), the slots of a wheel that spans years. Level 2 is this class: the
index entries of the buckets the loader has brought in, ``(due, sequence, offset,
bucket, subject)`` packed in numpy columns — 32 bytes a message, no Python object each.

Entries live in sorted *runs* (the slots of the inner wheel, kept in due order), plus a
small unsorted buffer of fresh single inserts. Firing a tick is a binary search per run
and a slice, whatever the number of entries due; an idle timer sleeps until the head of
the earliest run. When too many runs pile up, the smallest are merged (size-tiered, like
an LSM), so inserts cost amortised O(log n) and no pass ever touches the whole index.

Due times are honoured at ``tick_ms`` granularity, rounding *up*: an entry due at d
fires at the first tick boundary >= d, never before d.
"""

from __future__ import annotations

import array
from dataclasses import dataclass

import numpy as np

COLUMNS = ("due", "seq", "off", "bucket", "subj")
DTYPES = (np.int64, np.int64, np.int64, np.int32, np.int32)
ENTRY_BYTES = 32


@dataclass(slots=True)
class Entries:
    """A batch of index entries as parallel numpy columns."""

    due: np.ndarray
    seq: np.ndarray
    off: np.ndarray
    bucket: np.ndarray
    subj: np.ndarray

    def __len__(self) -> int:
        return len(self.due)

    @classmethod
    def empty(cls) -> Entries:
        return cls(*(np.empty(0, dtype=t) for t in DTYPES))

    @classmethod
    def concat(cls, parts: list[Entries]) -> Entries:
        if not parts:
            return cls.empty()
        if len(parts) == 1:
            return parts[0]
        return cls(*(np.concatenate([getattr(p, c) for p in parts]) for c in COLUMNS))

    def take(self, index: np.ndarray | slice) -> Entries:
        return Entries(self.due[index], self.seq[index], self.off[index], self.bucket[index], self.subj[index])

    def sorted(self) -> Entries:
        order = np.argsort(self.due, kind="stable")
        return self.take(order)

    def rows(self):
        """Python tuples (due, seq, off, bucket, subj): for the dispatcher's per-message work."""
        return zip(self.due.tolist(), self.seq.tolist(), self.off.tolist(), self.bucket.tolist(), self.subj.tolist())


class _Run:
    __slots__ = ("e", "cursor")

    def __init__(self, entries: Entries) -> None:
        self.e = entries
        self.cursor = 0

    def remaining(self) -> int:
        return len(self.e.due) - self.cursor


class _Fresh:
    """Unsorted single inserts, appended to typed arrays (8 + 8 + 8 + 4 + 4 bytes each)."""

    __slots__ = ("due", "seq", "off", "bucket", "subj")

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.due = array.array("q")
        self.seq = array.array("q")
        self.off = array.array("q")
        self.bucket = array.array("i")
        self.subj = array.array("i")

    def __len__(self) -> int:
        return len(self.due)

    def drain(self) -> Entries:
        e = Entries(
            np.frombuffer(self.due, dtype=np.int64).copy(),
            np.frombuffer(self.seq, dtype=np.int64).copy(),
            np.frombuffer(self.off, dtype=np.int64).copy(),
            np.frombuffer(self.bucket, dtype=np.int32).copy(),
            np.frombuffer(self.subj, dtype=np.int32).copy(),
        )
        self._reset()
        return e


class TimerWheel:
    """Not thread-safe: the scheduler guards it with its lock."""

    def __init__(self, tick_ms: int = 1, max_runs: int = 12) -> None:
        if tick_ms < 1:
            raise ValueError("tick_ms must be at least 1")
        self.tick_ms = tick_ms
        self.max_runs = max_runs
        self._runs: list[_Run] = []
        self._fresh = _Fresh()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, due: int, seq: int, off: int, bucket: int, subj: int) -> None:
        f = self._fresh
        f.due.append(due)
        f.seq.append(seq)
        f.off.append(off)
        f.bucket.append(bucket)
        f.subj.append(subj)
        self._size += 1

    def add_many(self, entries: Entries) -> None:
        if len(entries) == 0:
            return
        self._runs.append(_Run(entries.sorted()))
        self._size += len(entries)
        self._compact()

    def _settle(self) -> None:
        if len(self._fresh):
            self._runs.append(_Run(self._fresh.drain().sorted()))
            self._compact()

    def _compact(self) -> None:
        if len(self._runs) <= self.max_runs:
            return
        self._runs.sort(key=_Run.remaining)
        half = max(2, len(self._runs) // 2)
        small, self._runs = self._runs[:half], self._runs[half:]
        merged = Entries.concat([r.e.take(slice(r.cursor, None)) for r in small]).sorted()
        self._runs.append(_Run(merged))

    def fire_time(self, due: int) -> int:
        """When an entry due at ``due`` fires: the first tick boundary at or after it."""
        t = self.tick_ms
        return -(-due // t) * t

    def next_fire(self) -> int | None:
        """When the earliest entry fires (ms), or None when the wheel is empty."""
        self._settle()
        heads = [int(r.e.due[r.cursor]) for r in self._runs if r.cursor < len(r.e.due)]
        return self.fire_time(min(heads)) if heads else None

    def pop_due(self, now_ms: int, limit: int | None = None) -> Entries:
        """Remove and return the entries whose fire time has come, oldest first.

        With ``limit``, at most about that many (ties on the last due time may add a few):
        the earliest are taken, the rest stay for the next call.
        """
        self._settle()
        cutoff = (now_ms // self.tick_ms) * self.tick_ms
        ends = []
        total = 0
        for r in self._runs:
            k = int(np.searchsorted(r.e.due, cutoff, side="right"))
            ends.append(k)
            total += max(0, k - r.cursor)
        if total == 0:
            return Entries.empty()
        if limit is not None and total > limit:
            candidates = np.concatenate([r.e.due[r.cursor : k] for r, k in zip(self._runs, ends)])
            threshold = int(np.partition(candidates, limit - 1)[limit - 1])
            ends = [max(r.cursor, int(np.searchsorted(r.e.due, threshold, side="right"))) for r in self._runs]
        parts = []
        for r, k in zip(self._runs, ends):
            if k > r.cursor:
                parts.append(r.e.take(slice(r.cursor, k)))
                r.cursor = k
        self._runs = [r for r in self._runs if r.cursor < len(r.e.due)]
        out = Entries.concat(parts)
        self._size -= len(out)
        return out.sorted() if len(parts) > 1 else out

    def remove_where(self, bucket: int, seqs: set[int]) -> int:
        """Drop the entries of ``bucket`` whose sequence is in ``seqs`` (cancel, recovery)."""
        if not seqs:
            return 0
        self._settle()
        wanted = np.fromiter(seqs, dtype=np.int64, count=len(seqs))
        removed = 0
        for i, r in enumerate(self._runs):
            live = r.e.take(slice(r.cursor, None))
            drop = (live.bucket == bucket) & np.isin(live.seq, wanted)
            n = int(drop.sum())
            if n:
                self._runs[i] = _Run(live.take(~drop))
                removed += n
        self._runs = [r for r in self._runs if r.remaining() > 0]
        self._size -= removed
        return removed

    def holding(self, bucket: int, lo: int, hi: int, seqs: np.ndarray) -> np.ndarray:
        """Which of ``seqs`` (of ``bucket``, whose due times lie in [lo, hi)) are still in the
        wheel, as a mask: each run searched for that range of due times, not scanned."""
        found = np.zeros(len(seqs), dtype=bool)
        for r in self._runs:
            a = max(r.cursor, int(np.searchsorted(r.e.due, lo, "left")))
            b = int(np.searchsorted(r.e.due, hi, "left"))
            if b > a:
                found |= np.isin(seqs, r.e.seq[a:b][r.e.bucket[a:b] == bucket])
        f = self._fresh
        if len(f):
            fresh_seqs = np.array(f.seq, dtype=np.int64)
            found |= np.isin(seqs, fresh_seqs[np.array(f.bucket, dtype=np.int32) == bucket])
        return found

    def memory_bytes(self) -> int:
        return sum(len(r.e.due) for r in self._runs) * ENTRY_BYTES + len(self._fresh) * ENTRY_BYTES
