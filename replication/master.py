"""Master side of replication: the sync-ack tracker and what a slave stream is served.

Every attached slave has a :class:`SlaveSession`: where its stream has been sent up to,
what it reported durable, and which dispatch-log bytes it holds. The :class:`Hub`
answers three questions for the rest of the server:

- ``floor()`` (the cleaner): the lowest offset a slave confirmed (attached slaves, detached
  ones for ``slave_hold_ms`` and within ``slave_hold_bytes``, and a resync's start); the
  cleaner keeps the segment holding the record that ends there, which a reconnect compares
  (``check_hello``). The holds are saved in ``checkpoint/slave_holds.ckpt``
  (replication/holds.py) and restored at start, so a restart keeps them;
- ``wait(end_offset)`` (sync mode, the send path): resolve once a slave reported the
  bytes up to ``end_offset`` durable, or raise :class:`ReplicationTimeout` after
  ``replication_timeout_ms`` -- the write is then answered UNAVAILABLE, never acknowledged;
- ``stats()``: lag in bytes and milliseconds of the slowest attached slave;
- ``in_sync()``: the attached slaves that had, ``sync_bound_ms`` ago, everything the
  master had committed then (cluster mode writes their addresses to etcd's ``insync`` key,
  replication/cluster.py; ``Status`` marks them, any mode).

A stopping server ends its slaves' streams itself (:meth:`Hub.end_streams`), once they
confirmed everything committed and no sync write waits (3 s at most, never past the
shutdown deadline); a new stream is refused meanwhile. gRPC's stop used to wait its whole
grace period for them (a slave never ends its stream by itself).
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import logging
import time

import xxhash

from qdelay.errors import ReplicationTimeout
from qdelay.replication import common
from qdelay.replication.holds import Hold, HoldFile
from qdelay.segments import reader
from qdelay.v1 import replication_pb2 as rpb

log = logging.getLogger("qdelay.replication")

WINDOW_BYTES = 32 * 1024 * 1024  # sent but not yet confirmed durable, per slave
DISPATCH_SCAN_S = 0.02
PROGRESS_S = 0.25
IDLE_WAIT_S = 0.05
HOLD_SAVE_S = 1.0  # the holds file is replaced at most this often while acks come in
# ... and at least this often while a slave is attached, acks or not: an attached slave is
# saved as seen at the save, so after a kill its hold counts from at most this long before
HOLD_REFRESH_S = 60.0
# the stop: how long the master lets its attached slaves confirm its whole log before it ends
# their streams, and then waits for the streams to end
STOP_CATCH_UP_S = 3.0
STOP_DETACH_S = 1.0


class SlaveSession:
    def __init__(self, name: str, peer: str, offset: int) -> None:
        self.name = name
        self.peer = peer
        self.sent = offset
        self.acked = offset
        self.connected = True
        # wall clock (s): a detached slave's hold ages from here, across restarts too
        self.last_seen = time.time()
        self.known: dict[int, int] = {}  # dispatch bucket -> bytes the slave holds (-1: reset it)
        self.acked_event = asyncio.Event()
        # a snapshot for this slave is being sent (Hub.hold_for .. snapshot_sent): held
        # whatever its age, which counts from the copy's end (a copy can outlast slave_hold_ms)
        self.copying = False


class Hub:
    def __init__(self, engine, cfg) -> None:
        self.engine = engine
        self.cfg = cfg
        self.sync = cfg.replication == "sync"
        self.timeout = cfg.replication_timeout_ms / 1000.0
        self.hold = cfg.slave_hold_ms / 1000.0
        self.hold_bytes = cfg.slave_hold_bytes
        self.sessions: dict[str, SlaveSession] = {}
        # slaves whose hold ran out: dropped from ``sessions`` (so from Status and the holds
        # file; they were listed, detached, until the next restart), their names kept so that
        # a refusal can say why (``expired``); a name is forgotten when that slave attaches
        self._expired_names: set[str] = set()
        self._waiters: list[tuple[int, int, asyncio.Future]] = []
        self._tie = itertools.count()
        self.best_acked = 0
        self.sync_timeouts = 0
        self.sync_waits = 0
        self.holds = HoldFile(engine.config.data_dir)
        self._changes = 0  # bumped by every change of a hold; the saver compares it
        self._saved_changes = 0
        self._saved: dict[str, int] = {}  # name -> offset in the file (to see a hold lowered)
        self.holds_expired = 0
        self._saved_at = 0.0  # time.time() of the last save
        self.stopping = False  # the server stops: the Pull streams end (end_streams)
        self.sync_bound = cfg.sync_bound_ms / 1000.0
        # (monotonic, committed offset) while master at one epoch (event loop only): the
        # offset ``sync_bound`` ago that an in-sync slave has confirmed (``in_sync``)
        self._samples: collections.deque[tuple[float, int]] = collections.deque()
        self._samples_epoch = -1
        self._restore()

    # --- holds on disk ------------------------------------------------------------------------
    def _restore(self) -> None:
        holds, note = self.holds.load()
        if note:
            log.error("%s", note)
        now = time.time()
        for name, h in holds.items():
            s = SlaveSession(name, "restored", h.offset)
            s.connected = False
            s.last_seen = h.seen_ms / 1000.0
            self.sessions[name] = s
            if self._held(s, now, self.engine.wal.committed_offset):
                self._saved[name] = h.offset
                log.info(
                    "holding the message log for slave %s from offset %d (restored; away for %.0f s)",
                    name,
                    h.offset,
                    now - s.last_seen,
                    extra={"slave": name, "offset": h.offset},
                )
        self._expire(now)

    def _held(self, s: SlaveSession, now: float, end: int) -> bool:
        """Whether the cleaner keeps the log for ``s``: attached, or detached within both
        limits (``slave_hold_ms`` since it was last heard of, ``slave_hold_bytes`` behind)."""
        if s.connected or s.copying:
            return True
        if now - s.last_seen >= self.hold:
            return False
        return not self.hold_bytes or end - s.acked <= self.hold_bytes

    def _expire(self, now: float) -> None:
        """Drop (logged once) the detached slaves whose hold ran out; event loop only."""
        end = self.engine.wal.committed_offset
        for s in list(self.sessions.values()):
            if self._held(s, now, end):
                continue
            del self.sessions[s.name]
            self._expired_names.add(s.name)
            self._changes += 1
            self.holds_expired += 1
            if self.engine.role != "master":
                # the holds an old master kept for its slaves then (one of them, after a
                # failover, the new master): its advice below would send an operator to
                # resync a server that needs nothing
                log.info(
                    "hold for slave %s ended (away %.0f s; limits slave_hold_ms=%d, slave_hold_bytes=%d): this "
                    "server is %s now, so it only stops keeping its message log from offset %d",
                    s.name,
                    now - s.last_seen,
                    self.cfg.slave_hold_ms,
                    self.hold_bytes,
                    self.engine.role,
                    s.acked,
                    extra={"slave": s.name, "offset": s.acked},
                )
                continue
            log.warning(
                "hold expired for slave %s (away %.0f s, %d bytes behind; limits slave_hold_ms=%d, "
                "slave_hold_bytes=%d): the cleaner may delete the message log from offset %d; the slave "
                "will be refused as behind retention and need a full resync (automatic on the slave unless "
                "auto_resync = false; else 'qdelay admin resync')",
                s.name,
                now - s.last_seen,
                max(0, end - s.acked),
                self.cfg.slave_hold_ms,
                self.hold_bytes,
                s.acked,
                extra={"slave": s.name, "offset": s.acked},
            )

    def held_detached(self) -> int:
        """Detached slaves whose hold is still kept (metric ``qdelay_replication_slaves_held``)."""
        now, end = time.time(), self.engine.wal.committed_offset
        return sum(1 for s in list(self.sessions.values()) if not s.connected and self._held(s, now, end))

    def expired(self, name: str) -> bool:
        """Whether ``name`` was held and is no longer: dropped by the saver's last turn, or
        run out since (a slave asking right after its hold ran out must hear why, whether
        or not the saver has had its turn yet)."""
        s = self.sessions.get(name)
        if s is None:
            return name in self._expired_names
        return not self._held(s, time.time(), self.engine.wal.committed_offset)

    def listed(self) -> list[SlaveSession]:
        """The slaves Status lists: attached, or detached and still held (one whose hold ran
        out since the saver's last turn is left out already; the saver drops it)."""
        now, end = time.time(), self.engine.wal.committed_offset
        return [s for s in list(self.sessions.values()) if self._held(s, now, end)]

    def _holds_now(self) -> dict[str, Hold]:
        now = time.time()
        end = self.engine.wal.committed_offset
        out = {}
        for s in list(self.sessions.values()):
            if self._held(s, now, end):
                seen = now if s.connected or s.copying else s.last_seen
                out[s.name] = Hold(s.acked, int(seen * 1000))
        return out

    def _on_saved(self, holds: dict[str, Hold]) -> None:
        self._saved = {n: h.offset for n, h in holds.items()}

    def save(self) -> None:
        """Replace the holds file with the holds now (any thread; blocking: fsyncs)."""
        changes = self._changes
        self.holds.save(self._holds_now, self._on_saved)
        self._saved_changes = max(self._saved_changes, changes)
        self._saved_at = time.time()

    async def save_now(self) -> None:
        """Save on a worker thread; a failed save (a full disk) is logged, not raised: the
        holds stay in memory, the previous file stays, and the saver tries again."""
        try:
            await asyncio.to_thread(self.save)
        except OSError:
            log.exception("saving the slave holds failed; the previous file stays, retried in %g s", HOLD_SAVE_S)

    async def keep_saved(self) -> None:
        """The saver (a task on the event loop): expire holds, and save the file after a
        change, at most once every ``HOLD_SAVE_S`` (attached slaves' acks change it all the
        time; a second-old offset on disk only keeps a little more), and at least once every
        ``HOLD_REFRESH_S`` while a slave is attached."""
        while True:
            await asyncio.sleep(HOLD_SAVE_S)
            try:
                await self.save_if_changed()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a failed save keeps the previous file; retried
                log.exception("saving the slave holds failed")

    async def save_if_changed(self, final: bool = False) -> bool:
        """One turn of the saver: expire what ran out, save if anything changed, or if a
        slave is attached and the last save is ``HOLD_REFRESH_S`` old (or this is the save
        at the stop: ``final``), so that its time on disk stays recent."""
        now = time.time()
        self._expire(now)
        refresh = bool(self.live()) and (final or now - self._saved_at >= HOLD_REFRESH_S)
        if self._changes == self._saved_changes and not refresh:
            return False
        await self.save_now()
        return True

    # --- sessions -----------------------------------------------------------------------------
    def attach(self, name: str, peer: str, offset: int) -> SlaveSession:
        old = self.sessions.get(name)
        if old is not None and old.connected:
            log.warning("slave %s reconnected; dropping its previous stream", name)
            old.connected = False
        s = self.sessions[name] = SlaveSession(name, peer, offset)
        self._expired_names.discard(name)
        self._changes += 1
        log.info("slave attached", extra={"slave": name, "peer": peer, "offset": offset})
        return s

    def lowers_a_hold(self, name: str, offset: int) -> bool:
        """Whether the file holds ``name`` from above ``offset`` or not at all: then it is
        saved before the slave is served (a crash must not leave the higher hold)."""
        saved = self._saved.get(name)
        return saved is None or offset < saved

    def detach(self, session: SlaveSession) -> None:
        session.connected = False
        session.last_seen = time.time()
        if session.name not in self.sessions:
            # dropped as expired between its stream's end and this call (counted from its
            # last ack before): held from now, as any slave that just detached
            self.sessions[session.name] = session
            self._expired_names.discard(session.name)
        self._changes += 1
        log.info("slave detached", extra={"slave": session.name, "acked": session.acked})

    def hold_for(self, name: str, offset: int) -> SlaveSession:
        """Keep the message log from ``offset`` for a slave that is about to attach (resync);
        the caller saves the holds (``save_now``) before it hands the offset out, and calls
        ``snapshot_sent`` once the copy ends: until then the hold does not age (a copy of a
        large schedule log can take longer than ``slave_hold_ms``; counted from its start,
        the hold ran out midway, the cleaner deleted the offset the copy starts the slave
        at, and the resynced slave was refused as behind retention again, resync after
        resync)."""
        s = SlaveSession(name, "snapshot", offset)
        s.connected = False
        s.copying = True
        self.sessions[name] = s
        self._expired_names.discard(name)
        self._changes += 1
        return s

    def snapshot_sent(self, session: SlaveSession) -> None:
        """The copy that ``hold_for`` held the log for ended (sent whole, or broken off):
        the hold ages from now, as a slave's that just detached."""
        session.copying = False
        session.last_seen = time.time()
        self._changes += 1

    def on_ack(self, session: SlaveSession, offset: int) -> None:
        if offset > session.acked:
            session.acked = offset
            session.last_seen = time.time()
            self._changes += 1
            session.acked_event.set()
            if offset > self.best_acked:
                self.best_acked = offset
            self._release()

    def _release(self) -> None:
        best = max((s.acked for s in self.sessions.values() if s.connected), default=0)
        while self._waiters and self._waiters[0][0] <= best:
            _off, _n, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_result(None)

    def live(self) -> list[SlaveSession]:
        return [s for s in self.sessions.values() if s.connected]

    # --- the in-sync set ----------------------------------------------------------------------
    def sample(self) -> None:
        """Note the committed offset now (event loop; Node samples every ``IN_SYNC_SAMPLE_S``,
        and every ``in_sync`` call does). The samples start again at each new epoch as
        master: what this server had as a slave (or as an older master, whose tail may have
        been cut since) says nothing about what it has acknowledged as master."""
        engine = self.engine
        samples = self._samples
        if engine.role != "master":
            samples.clear()
            self._samples_epoch = -1
            return
        if engine.epoch != self._samples_epoch:
            samples.clear()
            self._samples_epoch = engine.epoch
        now = time.monotonic()
        samples.append((now, engine.wal.committed_offset))
        # keep the newest sample at or before now - sync_bound, and those after it
        while len(samples) > 1 and samples[1][0] <= now - self.sync_bound:
            samples.popleft()

    def in_sync(self) -> list[SlaveSession]:
        """The attached slaves whose confirmed offset reached what this master had committed
        ``sync_bound_ms`` ago (or when it became master at this epoch, if later): the ones
        that may take over without losing more than that bound's writes (in sync mode an
        acknowledged write is on the slave that confirmed it, which is not among these once it
        detached: the set says who is attached and current now, not where every write is).
        [] unless master."""
        self.sample()
        if not self._samples:
            return []
        target = self._samples[0][1]
        return [s for s in self.live() if s.acked >= target]

    def waiting(self) -> bool:
        """Whether a sync-mode write waits for a slave's confirmation."""
        return any(not fut.done() for _off, _n, fut in self._waiters)

    def _catching_up(self, end: int) -> bool:
        live = self.live()
        return bool(live) and (any(s.acked < end for s in live) or self.waiting())

    async def end_streams(self, deadline: float | None = None) -> None:
        """The stop: let the attached slaves confirm the whole log (at most
        ``STOP_CATCH_UP_S``, never past ``deadline``, the server's shutdown deadline; a write
        still waiting for a sync slave gets its answer), then end their Pull streams (each
        says the master is shutting down; the slave retries; a new one is refused) and wait
        for them to detach (``STOP_DETACH_S`` at most). A Pull stream never ends by itself:
        the server's stop waited its whole ``grace_seconds`` for them, and the holds saved
        at the stop had the slaves as seen that much before they last spoke."""
        now = time.monotonic()
        until = now + STOP_CATCH_UP_S if deadline is None else min(now + STOP_CATCH_UP_S, deadline)
        wal = self.engine.wal
        while time.monotonic() < until and self._catching_up(wal.committed_offset):
            await asyncio.sleep(0.01)
        self.stopping = True
        for s in self.live():
            s.acked_event.set()  # a stream waiting for acks looks at ``stopping`` now
        deadline = time.monotonic() + STOP_DETACH_S
        while self.live() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    # --- for the engine -----------------------------------------------------------------------
    def floor(self) -> int | None:
        """The lowest offset a held slave confirmed (the cleaner's thread; reads only)."""
        now = time.time()
        end = self.engine.wal.committed_offset
        offsets = [s.acked for s in list(self.sessions.values()) if self._held(s, now, end)]
        return min(offsets) if offsets else None

    async def wait(self, end_offset: int) -> None:
        if self.engine.role != "master":
            return
        if any(s.acked >= end_offset for s in self.sessions.values() if s.connected):
            return
        self.sync_waits += 1
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (end_offset, next(self._tie), fut))
        try:
            async with asyncio.timeout(self.timeout):
                await fut
        except TimeoutError:
            self.sync_timeouts += 1
            attached = len(self.live())
            log.error(
                "sync replication timeout",
                extra={"offset": end_offset, "slaves": attached, "timeouts": self.sync_timeouts},
            )
            raise ReplicationTimeout(
                f"sync replication: no slave confirmed the write within {self.timeout:g}s "
                f"({attached} slave(s) attached); it is durable on the master but NOT acknowledged: "
                f"retry with the same message_id"
            ) from None

    def lag(self) -> tuple[int, int]:
        """(bytes, ms) of the slowest attached slave; (-1, -1) when none is attached."""
        live = self.live()
        if not live:
            return -1, -1
        wal = self.engine.wal
        end = wal.committed_offset
        slowest = min(s.acked for s in live)
        lag_bytes = max(0, end - slowest)
        lag_ms = 0
        if lag_bytes:
            try:
                head = wal.read_raw(slowest, common.HS)
                if len(head) == common.HS:
                    lag_ms = max(0, int(time.time() * 1000) - reader.header(head).timestamp)
            except Exception:  # noqa: BLE001 - a stat must not fail the caller
                lag_ms = -1
        return lag_bytes, lag_ms


class PullServer:
    """Serves one slave stream (the body of Replication.Pull on a master)."""

    def __init__(self, node) -> None:
        self.node = node
        self.engine = node.engine
        self.hub: Hub = node.hub
        self.batch = node.cfg.replication_batch_bytes

    def check_hello(self, hello, name: str = "") -> None:
        """Raise (code, message) when the slave cannot continue from where it is."""
        wal = self.engine.wal
        end = hello.end_offset
        committed = wal.committed_offset
        if end > committed:
            raise _Refuse(
                "ABORTED",
                f"diverged: the slave's message log ends at {end}, beyond the master's "
                f"end {committed}; the slave truncates its divergent tail",
            )
        first = wal.first_offset
        # at the boundary (end == first) the slave's last record, which the check below
        # compares, is in a segment the master deleted: the logs cannot be compared there
        # ("diverged" sent the slave to a repair that found no common record)
        if end < first or (hello.last_sequence and hello.last_frame_offset < first):
            need = end if end < first else hello.last_frame_offset
            what = "" if end < first else " (its last record, where the two logs are compared)"
            why = (
                " (the master's hold for this slave expired: slave_hold_ms / slave_hold_bytes)"
                if self.hub.expired(name)
                else ""
            )
            raise _Refuse(
                "OUT_OF_RANGE",
                f"behind retention: the slave needs message-log offset {need}{what} but the master's oldest "
                f"segment starts at {first}{why}; stop the slave and run "
                f"'qdelay admin resync --data-dir DIR --master HOST:PORT', then start it again",
            )
        if hello.last_sequence:
            head = wal.read_raw(hello.last_frame_offset, common.HS)
            ok = len(head) == common.HS
            if ok:
                h = reader.header(head)
                ok = (
                    h.sequence == hello.last_sequence
                    and h.checksum == hello.last_frame_checksum
                    and hello.last_frame_offset + common.HS + h.length == end
                )
            if not ok:
                raise _Refuse(
                    "ABORTED",
                    f"diverged: the slave's last record (sequence {hello.last_sequence} at "
                    f"offset {hello.last_frame_offset}) differs from the master's",
                )

    def dispatch_states(self, hello, session: SlaveSession) -> None:
        disp = self.engine.dispatch
        for st in hello.dispatch:
            seg = disp.get(st.bucket)
            ok = False
            if seg is not None and seg.synced_size >= st.size:
                data = seg.read(0, st.size) if st.size else b""
                ok = xxhash.xxh3_64_intdigest(data) == st.checksum
            session.known[st.bucket] = st.size if ok else -1

    def dispatch_chunks(self, session: SlaveSession, budget: int) -> list:
        disp = self.engine.dispatch
        out = []
        try:
            buckets = disp.buckets()
        except RuntimeError:  # the dict changed while sorting: next scan
            return out
        known = session.known
        for b in [b for b, k in known.items() if k == -1 and disp.get(b) is None]:
            out.append(rpb.DispatchChunk(bucket=b, offset=0, data=b"", reset=True))
            known[b] = 0
        for b in buckets:
            seg = disp.get(b)
            if seg is None:
                continue
            have = known.get(b, 0)
            reset = have == -1
            if reset:
                have = 0
            synced = seg.synced_size
            if synced <= have and not reset:
                continue
            data = seg.read(have, min(synced - have, budget)) if synced > have else b""
            n = common.whole_frames(data)
            if n == 0 and not reset:
                continue
            out.append(rpb.DispatchChunk(bucket=b, offset=have, data=data[:n], reset=reset))
            known[b] = have + n
            budget -= n
            if budget <= 0:
                break
        return out

    async def serve(self, request_iterator, context):
        engine = self.engine
        hello = await request_iterator.__anext__()
        name = hello.slave_name or context.peer()
        if hello.epoch > engine.epoch:
            await self.node.fence(hello.epoch, "", f"slave {name} knows epoch {hello.epoch}")
        if self.hub.stopping:  # refused before it attaches
            raise _Refuse("UNAVAILABLE", "the master is shutting down; the slave will reconnect")
        if engine.role != "master":
            raise _Refuse(
                "FAILED_PRECONDITION",
                f"this server is {engine.role} at epoch {engine.epoch}, not a master; pull from the current master",
            )
        self.check_hello(hello, name)
        lowered = self.hub.lowers_a_hold(name, hello.end_offset)
        session = self.hub.attach(name, context.peer(), hello.end_offset)
        if lowered:  # on disk before the slave relies on it (a crash now must not lose it)
            await self.hub.save_now()
        self.node.slave_attached()
        await asyncio.to_thread(self.dispatch_states, hello, session)

        async def read_acks() -> None:
            try:
                async for req in request_iterator:
                    self.hub.on_ack(session, req.durable_offset)
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the stream ended
                pass
            finally:
                # seen now: a hold counts from when its stream ended, not from its last ack
                # (an idle slave's could be older than slave_hold_ms: the saver, running before
                # ``detach``, dropped its hold at once)
                session.last_seen = time.time()
                session.connected = False
                session.acked_event.set()

        reader = asyncio.ensure_future(read_acks())
        wal = engine.wal
        last_scan = 0.0
        last_progress = 0.0
        try:
            while session.connected:
                if self.hub.stopping:
                    raise _Refuse("UNAVAILABLE", "the master is shutting down; the slave will reconnect")
                if engine.role != "master":
                    raise _Refuse("FAILED_PRECONDITION", f"this server is now {engine.role} at epoch {engine.epoch}")
                committed = wal.committed_offset
                resp = None
                if session.sent < committed and session.sent - session.acked < WINDOW_BYTES:
                    resp = self._wal_chunk(session)
                now = time.monotonic()
                if now - last_scan >= DISPATCH_SCAN_S:
                    last_scan = now
                    chunks = self.dispatch_chunks(session, self.batch)
                    if chunks:
                        resp = resp or rpb.PullResponse()
                        resp.dispatch.extend(chunks)
                if now - last_progress >= PROGRESS_S:
                    last_progress = now
                    done_before, reopened, seq = common.master_progress(engine)
                    resp = resp or rpb.PullResponse()
                    resp.progress.done_before = done_before
                    resp.progress.reopened.extend(reopened)
                    resp.progress.sequence = seq
                if resp is not None:
                    resp.master_epoch = engine.epoch
                    resp.master_end_offset = committed
                    resp.master_time_ms = int(time.time() * 1000)
                    await context.write(resp)
                    continue
                if session.sent - session.acked >= WINDOW_BYTES:
                    session.acked_event.clear()
                    try:
                        async with asyncio.timeout(IDLE_WAIT_S):
                            await session.acked_event.wait()
                    except TimeoutError:
                        pass
                else:
                    await asyncio.to_thread(wal.wait_commit, session.sent, IDLE_WAIT_S)
        finally:
            reader.cancel()
            self.hub.detach(session)

    def _wal_chunk(self, session: SlaveSession):
        wal = self.engine.wal
        start = session.sent
        if start < wal.first_offset:
            raise _Refuse(
                "OUT_OF_RANGE",
                f"behind retention: offset {start} was cleaned (oldest {wal.first_offset}); run 'qdelay admin resync'",
            )
        seg = wal.segment_at(start)
        if seg is not None and start >= seg.key + seg.size:
            seg = wal.segment_at(seg.key + seg.size)
        data = wal.read_raw(start, self.batch)
        n = common.whole_frames(data)
        if n == 0 and data:
            length = reader.frame_length(data) if len(data) >= common.HS else 0
            data = wal.read_raw(start, common.HS + length)
            n = common.whole_frames(data)
        if n == 0:
            return None
        session.sent = start + n
        base = seg.key if seg is not None and seg.key <= start else start
        return rpb.PullResponse(start_offset=start, segment_base=base, data=data[:n])


class _Refuse(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
