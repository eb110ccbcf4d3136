"""Dead letters: a message that used its ``max_attempts`` for a group is copied to the
dead-letter subject, then closed for that group.

The copy goes through the message log like any send; only once it is durable is the
original closed for the group with a DEAD_LETTERED dispatch record, so a crash in between
delivers the original again rather than losing it. From the moment it is decided until
the copy is written (or refused), Cancel refuses the message (``writing``).

The scheduler thread decides (``add``, lock held), takes the decided copies (``take``,
lock held) and writes them (``write``: the record read back and submitted, no lock).
What happens then is posted back on the scheduler's queue (``post``) and applied by its
thread: the WAL writer thread, which completes the copy, never takes the scheduler lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from qdelay.errors import CorruptRecord, QdelayError
from qdelay.segments import records
from qdelay.server.buckets import BucketBook, BucketState
from qdelay.server.groups import GroupTable
from qdelay.server.ledger import AckLedger, Item
from qdelay.server.loader import Loader

if TYPE_CHECKING:
    from qdelay.server.scheduler import SchedulerConfig

log = logging.getLogger("qdelay.scheduler")

# (message, its sequence, the group's name, attempts made, done(error)): writes the copy
DeadLetter = Callable[[records.Message, int, str, int, Callable[[Exception | None], None]], None]
# (seq, item, decided at, message id) -> whether the close was recorded (False: stopped)
Close = Callable[[int, Item, int, bytes], bool]
Work = tuple[int, Item, int, BucketState, str]  # (seq, item, decided at, its bucket, group name)


class DeadLetters:
    def __init__(
        self,
        cfg: SchedulerConfig,
        book: BucketBook,
        groups: GroupTable,
        ledger: AckLedger,
        loader: Loader,
        copy: DeadLetter | None,
        close: Close,
        post: Callable[[Callable[[], None]], None],
        clock: Callable[[], int],
    ) -> None:
        self.cfg = cfg
        self.book = book
        self.groups = groups
        self.ledger = ledger
        self.loader = loader
        self.copy = copy
        self.close = close
        self.post = post  # runs a function on the scheduler thread, lock held
        self.clock = clock
        self.writing: set[int] = set()  # dead-letter copy decided or being written: cancel refused
        self._todo: list[tuple[int, Item, int]] = []
        self.dead_lettered = 0

    def add(self, seq: int, item: Item, now: int) -> None:
        """``seq`` failed ``max_attempts`` times for the group of ``item`` (lock held)."""
        self.writing.add(seq)
        self._todo.append((seq, item, now))

    def take(self) -> list[Work]:
        """The copies decided so far (lock held); those of deleted groups or buckets, or
        with nowhere to write them, are dropped."""
        todo, self._todo = self._todo, []
        work = []
        for seq, item, now in todo:
            st = self.book.get(item[2])
            g = self.groups.by_gid(item[6])
            if st is None or self.copy is None or g is None:
                self.writing.discard(seq)
                continue
            work.append((seq, item, now, st, g.name))
        return work

    def write(self, work: list[Work]) -> None:
        """Read back and submit each copy (no lock held)."""
        for seq, item, now, st, name in work:
            self._write(seq, item, now, st, name)

    def _write(self, seq: int, item: Item, now: int, st: BucketState, name: str) -> None:
        off, attempt, gid = item[1], item[4], item[6]
        try:
            msg = records.decode_message(st.seg.read_frame(off).body)
        except CorruptRecord as err:
            log.error(
                "corrupt schedule record; it cannot be dead-lettered", extra={"path": err.path, "offset": err.offset}
            )
            self.post(lambda: self._unreadable(seq, st, gid))
            return
        mid = msg.message_id.encode()
        if self.copy is None:
            return
        try:

            def done(error: Exception | None) -> None:  # on the WAL writer thread
                self.post(lambda: self._copied(seq, item, now, mid, error))

            self.copy(msg, seq, name, attempt - 1, done)
        except QdelayError as err:
            log.warning("dead-letter write refused; will retry", extra={"error": str(err)})
            self.post(lambda: self._retry(seq, item, now))

    # --- applied on the scheduler thread (posted) ---------------------------------------------------

    def _unreadable(self, seq: int, st: BucketState, gid: int) -> None:
        self.writing.discard(seq)
        st.owe(gid, -1)
        self.loader.count_corrupt(1)

    def _copied(self, seq: int, item: Item, now: int, mid: bytes, error: Exception | None) -> None:
        self.writing.discard(seq)
        if error is not None:  # try again later; the message stays pending meanwhile
            self._retry(seq, item, self.clock())
        elif self.close(seq, item, now, mid):
            self.dead_lettered += 1

    def _retry(self, seq: int, item: Item, at: int) -> None:
        self.writing.discard(seq)
        self.ledger.retry_at(at + self.cfg.retry_backoff_ms, seq, item)
