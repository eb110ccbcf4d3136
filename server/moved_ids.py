"""The ids a Reschedule moved that the id index may not hold yet: id -> (due, sequence) of
the MESSAGE record the move wrote, for by-id lookups (Engine.resolve_ids, get_now).

Why: a by-id lookup must find the message a Reschedule just wrote (a Get or Cancel by id
right after a Reschedule by id answers about the moved message). The id index holds it
once the iterate service has copied the move, so by-id lookups used to wait for every
Reschedule's append to be copied: each by-id batch after one hurried the service into a
step of its own, where by receipt the steps gather several batches. Now a Reschedule's
append is left out of what by-id lookups wait for (MessageLog.committed_past_tombstones,
as the Cancels' tombstones are: the old message stays claimed until its tombstone is
copied), and its ids are here until copied. A lookup asks here first, then the index,
and takes the newer of the two; only one that finds a moved message not yet copied waits
for its copy (its record must be in its minute's segment to be read), wherever it found it:
the index holds a step's ids before the step's records are in their segments
(Engine._index_get_many).

Entries leave once the iterate service has copied their sequence (``floor``: the index
holds them then): a batch at a time, in the order they were written. The table is held
by this process's master term only: a change of role makes every lookup wait for what
was committed before it (Engine._claims_from), so the engine clears it then.

Any thread: the event loop adds, lookups run there and on worker threads; one lock, held
for dictionary operations only.
"""

from __future__ import annotations

import collections
import threading


class MovedIds:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, tuple[int, int]] = {}
        self._batches: collections.deque[tuple[int, list[str]]] = collections.deque()  # (last sequence, ids)

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, moved: list[tuple[str, int, int]], floor: int) -> None:
        """``moved``: (id, new due time, new sequence) of one Reschedule append, committed;
        ``floor``: the sequence the iterate service has copied up to now."""
        if not moved:
            return
        with self._lock:
            self._prune(floor)
            by_id = self._by_id
            for mid, due, seq in moved:
                old = by_id.get(mid)
                if old is None or old[1] < seq:
                    by_id[mid] = (due, seq)
            self._batches.append((max(seq for _mid, _due, seq in moved), [mid for mid, _due, _seq in moved]))

    def get_many(self, ids: list[str], floor: int) -> list[tuple[int, int] | None]:
        """(due, sequence) of each id's newest move not yet copied (None: none). Ask before
        the index: an entry dropped meanwhile is one the index holds."""
        with self._lock:
            self._prune(floor)
            by_id = self._by_id
            return [by_id.get(m) for m in ids] if by_id else [None] * len(ids)

    def clear(self) -> None:
        with self._lock:
            self._by_id.clear()
            self._batches.clear()

    def _prune(self, floor: int) -> None:
        batches, by_id = self._batches, self._by_id
        while batches and batches[0][0] <= floor:
            _last, ids = batches.popleft()
            for mid in ids:
                got = by_id.get(mid)
                if got is not None and got[1] <= floor:  # (a later move of it stays)
                    del by_id[mid]
