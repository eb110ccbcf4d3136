"""Slave side of replication: the puller.

One long-lived ``Replication.Pull`` stream to the master. The master pushes message-log
bytes as soon as they are committed (no polling), the dispatch-log bytes of every bucket
that grew, and its scheduling progress. The puller checks every frame (checksum,
sequence continuity) and writes it at the same offset (``MessageLog.append_raw``, one
fdatasync per batch), then reports the durable offset back -- which is what a master in
sync mode waits for. The slave's own iterate service builds its schedule log.

Failures: the stream is re-opened with exponential backoff (0.2 s .. 5 s, jittered).
A slave behind the master's retention gets OUT_OF_RANGE: it resyncs its folder by itself
when it may (replication/autoresync.py: ``auto_resync`` on, its log known to hold nothing
the master lacks; the server restarts itself for it), else it stays stopped with a clear
error (status, log) until an operator runs ``qdelay admin resync``. A slave whose log
diverges from the master's (ABORTED) finds the fork point, cuts its divergent tail
(saved under ``diverged/`` in the data folder and reported), and pulls again.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import random
import time

import grpc
import numpy as np
import xxhash

from qdelay.cancellation import cancel_and_wait
from qdelay.errors import InvariantViolation
from qdelay.replication import autoresync, common
from qdelay.segments import naming, reader, records
from qdelay.segments.framing import RecordKind
from qdelay.segments.naming import bucket_of
from qdelay.v1 import replication_pb2 as rpb
from qdelay.v1 import replication_pb2_grpc as rpb_grpc

log = logging.getLogger("qdelay.replication.slave")

MERGE_BYTES = 8 * 1024 * 1024
# put in a session's inbox when the master ends the stream without an error (None, before,
# read as "no end": the slave waited on a finished stream, still "connected", for ever)
_ENDED = object()


# A failed Pull stream that says the master is not up yet, restarting or out of reach (a
# WARNING: the puller tries again with backoff), not that it refused this slave (an ERROR).
# A lost status (the slave's write of its durable offset failing on a stream that a stopping
# master had just ended or a killed one broke) is a master restart too: it was logged as an
# ERROR before.
master_away = common.peer_away


class Puller:
    def __init__(self, node, master: str) -> None:
        self.node = node
        self.engine = node.engine
        self.cfg = node.cfg
        self.master = master
        self.token, self.ca, self.tls = common.slave_credentials(node.cfg)
        self.name = common.slave_name(self.cfg.data_dir)
        self.connected = False
        self.error = ""
        self.note = ""
        self.master_epoch = 0
        self.master_end = 0
        self.last_response = 0.0
        self.delays = collections.deque(maxlen=64)  # numpy arrays of per-record delays (ms)
        self.records_replicated = 0
        self._task: asyncio.Task | None = None
        self._stop = False
        self._last: tuple[int, int, int] | None = None  # last frame (offset, sequence, checksum)
        self._retarget: str | None = None
        self._followed: int | None = None  # the epoch in checkpoint/followed.ckpt (autoresync)
        # the writes to the engine under way on worker threads (_apply, a repair's truncation):
        # a cancelled await leaves its thread running, and stop() must not return (the
        # server then closes the engine) before they end
        self._writing: set[asyncio.Future] = set()

    # --- control ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.ensure_future(self.run())

    async def stop(self) -> None:
        self._stop = True
        # not try/await/except-CancelledError: that also swallowed the caller's own
        # cancellation (a cluster agent stopped while it stopped this puller went on and
        # started another one, and its stop waited for it for ever)
        await cancel_and_wait([self._task])
        if self._writing:
            await asyncio.wait(list(self._writing))
        self.connected = False

    async def _write(self, fn, *args):
        """``fn(*args)`` on a worker thread, as a write stop() waits for (see _writing); the
        executor's future itself, no task around it (this is the per-batch path)."""
        fut = asyncio.get_running_loop().run_in_executor(None, fn, *args)
        self._writing.add(fut)
        fut.add_done_callback(self._written)
        return await asyncio.shield(fut)

    def _written(self, fut: asyncio.Future) -> None:
        self._writing.discard(fut)
        if not fut.cancelled():
            fut.exception()  # seen by the awaiting session, or by nobody once it was cancelled

    def follow(self, master: str) -> None:
        """Switch to another master (told by a promotion or found among the peers)."""
        if master and master != self.master:
            log.warning("following a new master", extra={"old": self.master, "new": master})
            self._retarget = master
            if self._call is not None:
                self._call.cancel()

    _call = None

    def lag(self) -> tuple[int, int]:
        if not self.connected:
            return (-1, -1) if not self.master_end else (max(0, self.master_end - self.engine.wal.committed_offset), -1)
        lag_bytes = max(0, self.master_end - self.engine.wal.committed_offset)
        lag_ms = 0
        if lag_bytes and self.delays:
            lag_ms = int(self.delays[-1].max()) if len(self.delays[-1]) else 0
        return lag_bytes, lag_ms

    def delay_p99(self) -> int:
        if not self.delays:
            return -1
        return int(np.percentile(np.concatenate(list(self.delays)), 99))

    # --- the loop ----------------------------------------------------------------------------------
    async def run(self) -> None:
        backoff = 0.2
        while not self._stop:
            if self._retarget:
                self.master, self._retarget = self._retarget, None
            try:
                await self._session()
                # the master ended the stream without an error (a stopping master ends it with
                # UNAVAILABLE, Hub.end_streams): try again after the backoff, as for that
                backoff = 0.2
                self._set_error(f"master {self.master} ended the stream", logging.WARNING)
            except asyncio.CancelledError:
                if self._stop:
                    raise
                continue  # retargeted
            except grpc.aio.AioRpcError as e:
                code, details = e.code(), e.details()
                if self._retarget:
                    continue
                if code == grpc.StatusCode.ABORTED and details.startswith("diverged"):
                    try:
                        await self._repair()
                        self.error = ""
                        continue
                    except Exception as err:  # noqa: BLE001
                        self._set_error(f"cannot repair a divergent log: {err}")
                elif code == grpc.StatusCode.OUT_OF_RANGE:
                    backoff = 10.0
                    if autoresync.is_behind_retention(code, details):
                        wait = await self._auto_resync(details)
                        if wait is None:
                            return  # the server stops and starts again on a resynced folder
                        backoff = wait
                    else:
                        self._set_error(details)
                elif code == grpc.StatusCode.UNAUTHENTICATED:
                    self._set_error(f"the master refused this slave: {details}")
                else:
                    # a master not up yet or restarting (the usual start order, a rolling
                    # restart) is retried with backoff: a WARNING; refusals stay ERRORs
                    transient = master_away(e)
                    self._set_error(
                        f"master {self.master}: {code.name}: {details}", logging.WARNING if transient else logging.ERROR
                    )
                    await self._look_for_master()
            except _Stop as err:
                self._set_error(str(err))
                await self._look_for_master()
            except Exception as err:  # noqa: BLE001 - never let the puller die silently
                log.exception("replication session failed")
                self._set_error(f"replication failed: {err}")
            self.connected = False
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, 5.0 if backoff < 10 else 10.0)

    async def _auto_resync(self, details: str) -> float | None:
        """Refused as behind retention: resync by itself if it may (autoresync.why_not) and
        the backoff of earlier failures is over; None once the restart for it is asked for,
        else the seconds to wait before asking the master again (the refusal stays the
        error, with why it was not automatic, or when it is tried again)."""
        restart = self.node.restart_process
        why = await asyncio.to_thread(autoresync.why_not, self.cfg, self.engine, self.master_epoch)
        if not why and restart is None:
            why = "this server cannot restart itself (not run by 'qdelay server')"
        if why:
            self._set_error(f"{details} (not resynced automatically: {why})")
            return 10.0
        left, why_wait = await asyncio.to_thread(autoresync.retry_delay, self.cfg.data_dir)
        if left > 0:
            at = time.strftime("%H:%M:%S", time.localtime(time.time() + left))
            self._set_error(
                f"{details} ({why_wait}; tried again at {at})",
                logging.WARNING,  # a failure itself was the ERROR (autoresync.before_open)
            )
            return left
        reason = autoresync.without_advice(details)
        end = self.engine.wal.committed_offset
        log.warning(
            "starting an automatic full resync: %s; this server stops, resyncs its data folder from %s "
            "(the old one, its message log ending at offset %d, is moved aside, never deleted) and starts again",
            reason,
            self.master,
            end,
            extra={"master": self.master, "epoch": self.master_epoch},
        )
        await self._write(autoresync.request, self.cfg.data_dir, self.master, reason, self.master_epoch, end)
        self.error = f"automatic full resync from {self.master}: restarting"
        self.connected = False
        restart(f"automatic full resync from {self.master}")
        return None

    def _set_error(self, text: str, level: int = logging.ERROR) -> None:
        if text != self.error:
            log.log(level, "replication: %s (retrying)" if level < logging.ERROR else "replication: %s", text)
        self.error = text
        self.connected = False

    async def _look_for_master(self) -> None:
        """With peers configured: follow whichever peer is master with the highest epoch."""
        best = await self.node.find_master(exclude_self=True)
        if best is not None and best[0] != self.master and best[1] >= self.master_epoch:
            self.follow(best[0])

    async def _check_epochs(self, stub) -> None:
        st = await stub.Status(rpb.ReplicationStatusRequest(), timeout=5, metadata=common.metadata(self.token))
        engine = self.engine
        if st.role != "master":
            raise _Stop(f"the configured master {self.master} is {st.role} (epoch {st.epoch})")
        if engine.role == "joining":
            persisted = _persisted_role(engine)
            ok = st.epoch > engine.epoch or (persisted == "fenced" and st.epoch >= engine.epoch)
            if not ok:
                raise _Stop(
                    f"refusing to follow {self.master}: its epoch {st.epoch} is not above this server's "
                    f"({engine.epoch}, was {persisted}); start this server with --role master, or promote "
                    f"a server with a higher epoch"
                )
            await self._write(engine.set_role, "slave", st.epoch)
            self.note = f"re-attached as slave of {self.master} (epoch {st.epoch}); was {persisted}"
            log.warning(self.note)
        elif st.epoch > engine.epoch:
            await self._write(engine.set_role, "slave", st.epoch)
        elif st.epoch < engine.epoch:
            raise _Stop(
                f"the configured master {self.master} has epoch {st.epoch}, older than this slave's "
                f"{engine.epoch}: it is stale (a newer master exists)"
            )
        self.master_epoch = st.epoch

    def _hello(self) -> rpb.PullRequest:
        engine = self.engine
        wal = engine.wal
        if self._last is None or self._last[0] >= wal.committed_offset:
            self._last = common.last_frame(wal)
        req = rpb.PullRequest(
            slave_name=self.name,
            epoch=engine.epoch,
            end_offset=wal.committed_offset,
            durable_offset=wal.committed_offset,
        )
        if self._last is not None:
            req.last_frame_offset, req.last_sequence, req.last_frame_checksum = self._last
        for b in engine.dispatch.buckets():
            seg = engine.dispatch.get(b)
            if seg is None:
                continue
            size = seg.size
            req.dispatch.add(bucket=b, size=size, checksum=xxhash.xxh3_64_intdigest(seg.read(0, size) if size else b""))
        return req

    async def _session(self) -> None:
        channel = common.make_channel(
            self.master, tls=self.tls, ca=self.ca, server_name=self.cfg.replication_tls_server_name
        )
        try:
            stub = rpb_grpc.ReplicationStub(channel)
            await self._check_epochs(stub)
            hello = await asyncio.to_thread(self._hello)
            requests: asyncio.Queue = asyncio.Queue()
            await requests.put(hello)

            async def request_iter():
                while True:
                    item = await requests.get()
                    if item is None:
                        return
                    yield item

            call = self._call = stub.Pull(request_iter(), metadata=common.metadata(self.token))
            inbox: asyncio.Queue = asyncio.Queue(maxsize=256)

            async def receive() -> None:
                try:
                    async for resp in call:
                        await inbox.put(resp)
                    await inbox.put(_ENDED)
                except BaseException as err:  # noqa: BLE001
                    await inbox.put(err)

            receiver = asyncio.ensure_future(receive())
            try:
                while True:
                    item = await inbox.get()
                    batch = [item]
                    size = len(item.data) if isinstance(item, rpb.PullResponse) else 0
                    while not inbox.empty() and size < MERGE_BYTES and isinstance(batch[-1], rpb.PullResponse):
                        nxt = inbox.get_nowait()
                        batch.append(nxt)
                        size += len(nxt.data) if isinstance(nxt, rpb.PullResponse) else 0
                    good = [b for b in batch if isinstance(b, rpb.PullResponse)]
                    # the stream's end (_ENDED) or its error, after the responses before it
                    stop = batch[len(good)] if len(good) < len(batch) else None
                    if good:
                        if not self.connected:
                            self.connected = True
                            self.error = ""
                            log.info("replicating from %s", self.master)
                        durable = await self._write(self._apply, good)
                        await requests.put(rpb.PullRequest(durable_offset=durable))
                        if self._followed != self.master_epoch:
                            # the master accepted this log (its hello): a prefix of its own
                            epoch = self.master_epoch
                            await self._write(autoresync.note_followed, self.cfg.data_dir, epoch)
                            self._followed = epoch
                    if stop is not None:
                        if isinstance(stop, BaseException):
                            raise stop
                        return  # the master ended the stream
            finally:
                receiver.cancel()
                await requests.put(None)
                call.cancel()
                self._call = None
        finally:
            await channel.close()

    # --- applying ----------------------------------------------------------------------------------
    def _apply(self, batch: list) -> int:
        engine = self.engine
        wal = engine.wal
        now_ms = int(time.time() * 1000)
        data = bytearray()
        start = base = None
        stamps: list[int] = []

        def flush() -> None:
            nonlocal data, start, base
            if data:
                stamps.extend(wal.append_raw(bytes(data), start, base))
                self._remember_last(bytes(data), start)
            data, start, base = bytearray(), None, None

        for resp in batch:
            self.master_epoch = max(self.master_epoch, resp.master_epoch)
            self.master_end = max(self.master_end, resp.master_end_offset)
            self.last_response = time.monotonic()
            if resp.data:
                if start is not None and (resp.start_offset != start + len(data) or resp.segment_base != base):
                    flush()
                if start is None:
                    start, base = resp.start_offset, resp.segment_base
                data += resp.data
        flush()
        if stamps:
            done = int(time.time() * 1000)
            self.delays.append(done - np.asarray(stamps, dtype=np.int64))
            self.records_replicated += len(stamps)
        dirty = False
        for resp in batch:
            for chunk in resp.dispatch:
                dirty |= self._apply_dispatch(chunk)
        if dirty:
            engine.dispatch.sync()
        for resp in batch:
            if resp.HasField("progress"):
                p = resp.progress
                common.apply_progress(engine, p.done_before, list(p.reopened), p.sequence)
        del now_ms
        return wal.committed_offset

    def _remember_last(self, data: bytes, start: int) -> None:
        infos = common.frame_infos(data, start)
        if infos:
            off, seq, checksum, _size = infos[-1]
            self._last = (off, seq, checksum)

    def _apply_dispatch(self, chunk) -> bool:
        engine = self.engine
        disp = engine.dispatch
        b = chunk.bucket
        seg = disp.get(b)
        if seg is None:
            if not chunk.data or (engine.scheduler.is_done(b) and engine.schedule.get(b) is None):
                return False  # finished and already cleaned here: do not leave an orphan file
            seg = disp.get_or_create(b)
        if chunk.reset and seg.size:
            log.warning("dispatch log diverged from the master's; replacing it", extra={"bucket": b})
            seg.truncate(0)
        if seg.size != chunk.offset:
            raise InvariantViolation(
                f"dispatch bucket {b}: the master sent bytes for offset {chunk.offset}, this copy holds {seg.size}"
            )
        data = chunk.data
        reader.require_whole(reader.scan_columns(data), f"replicated dispatch chunk of bucket {b}", chunk.offset)
        if data:
            disp.append(b, data)
        return bool(data)

    # --- divergence ----------------------------------------------------------------------------------
    async def _repair(self) -> None:
        channel = common.make_channel(
            self.master, tls=self.tls, ca=self.ca, server_name=self.cfg.replication_tls_server_name
        )
        try:
            stub = rpb_grpc.ReplicationStub(channel)
            md = common.metadata(self.token)

            async def master_frames(offset: int, n: int):
                r = await stub.Frames(rpb.FramesRequest(offset=offset, max_frames=n), timeout=30, metadata=md)
                return [(f.offset, f.sequence, f.checksum, f.size) for f in r.frames], r

            fork = await find_fork(self.engine.wal, master_frames)
        finally:
            await channel.close()
        note = await self._write(truncate_divergent, self.engine, fork[0], fork[1])
        self.note = note
        self._last = None


class _Stop(Exception):
    pass


def _persisted_role(engine) -> str:
    from qdelay.segments import checkpoint

    try:
        return (checkpoint.read(engine.role_path) or {}).get("role", "slave")
    except Exception:  # noqa: BLE001
        return "slave"


def _own_frames(wal, offset: int, n: int):
    data = wal.read_raw(offset, 1024 * 1024)
    return common.frame_infos(data, offset)[:n]


async def find_fork(wal, master_frames) -> tuple[int, int]:
    """(offset, last sequence before it) where this log stops matching the master's.

    Starts at the base of this log's newest segment and steps back a segment at a time
    until a frame matches, then walks forward frame by frame. A log whose oldest record
    starts exactly where the master's log ends (it was resynced or cleaned up to there) is
    all beyond the master's end: the fork is its start."""
    segs = [s for s in wal.segments() if s.size > 0 and s.key < wal.committed_offset]
    if not segs:
        return wal.committed_offset, wal.committed_sequence
    i = len(segs) - 1
    while True:
        start = segs[i].key
        mine = await asyncio.to_thread(_own_frames, wal, start, 1)
        theirs, span = await master_frames(start, 1)
        if mine and theirs and mine[0] == theirs[0]:
            break
        if i == 0:
            if mine and not theirs and start == wal.first_offset and span.end_offset == start:
                # no record of the master's to compare, as for a slave resynced at the master's
                # end; append_raw checks that the master's next record follows this sequence
                return start, mine[0][1] - 1
            behind = (
                f" (the master's oldest segment starts at {span.first_offset})" if start < span.first_offset else ""
            )
            raise InvariantViolation(
                f"no common prefix with the master's log from offset {start}{behind}: "
                f"a full resync is needed ('qdelay admin resync')"
            )
        i -= 1
    pos = start
    last_seq = mine[0][1] - 1
    end = wal.committed_offset
    while pos < end:
        mine = await asyncio.to_thread(_own_frames, wal, pos, 2000)
        if not mine:
            break
        theirs, _ = await master_frames(pos, len(mine))
        for k, f in enumerate(mine):
            if k >= len(theirs) or theirs[k] != f:
                return f[0], last_seq
            last_seq = f[1]
        pos = mine[-1][0] + mine[-1][3]
    return pos, last_seq


def truncate_divergent(engine, offset: int, last_sequence: int) -> str:
    """Cut everything from ``offset``: the message log, and the schedule records it produced.

    Runs with the iterate service stopped. The cut bytes are kept in ``diverged/`` of the
    data folder for the operator. Dispatch logs are fixed by the master's checksums."""
    wal = engine.wal
    end = wal.committed_offset
    if offset >= end:
        return ""
    it = engine.iterate
    it.stop()
    try:
        cut = bytearray()
        pos = offset
        while pos < end:
            data = wal.read_raw(pos, 8 * 1024 * 1024)
            if not data:
                break
            cut += data
            pos += len(data)
        folder = os.path.join(engine.config.data_dir, naming.DIVERGED_DIR)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, naming.diverged_name(offset, end))
        with open(path, "wb") as f:
            f.write(cut)
            f.flush()
            os.fsync(f.fileno())
        touched: set[int] = set()
        first = last = None
        scale = engine.config.scale_minutes
        for fr in reader.frames(bytes(cut)):
            first = fr.sequence if first is None else first
            last = fr.sequence
            if fr.kind == RecordKind.MESSAGE:
                touched.add(bucket_of(records.message_due(fr.body), scale))
            elif fr.kind == RecordKind.CANCEL:
                touched.add(bucket_of(records.decode_cancel(fr.body).deliver_at_ms, scale))
        for b in sorted(touched):
            seg = engine.schedule.get(b)
            if seg is None:
                continue
            keep, keep_seq = 0, -1
            for fr in seg.frames():
                if fr.sequence > last_sequence:
                    break
                keep, keep_seq = fr.offset + fr.size, fr.sequence
            if keep < seg.size:
                engine.schedule.truncate(b, keep)  # its index is re-derived with it
            seg.last_sequence = keep_seq
        wal.truncate_to(offset, last_sequence)
        engine.log_cut_to(last_sequence)  # lookups no longer wait for the cut records
        if it.offset > offset:
            it.offset = it.saved_offset = offset
        it.sequence = min(it.sequence, last_sequence)
        it.checkpoint()
    finally:
        it._stop.clear()
        it.start()
    note = (
        f"divergent tail truncated: {end - offset} bytes at offset {offset} (sequences {first}..{last}); kept in {path}"
    )
    log.warning(note)
    return note
