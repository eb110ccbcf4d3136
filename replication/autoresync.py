"""A slave's automatic full resync (docs/operations.md §4.4, docs/internals.md "Automatic full resync").

A slave refused as behind retention (the master's cleaner deleted the message log it
needs: it was away longer than its hold, ``slave_hold_ms``) cannot catch up from the log;
``qdelay admin resync`` rebuilds its folder from the master's snapshot. This does the same
by itself, as safely, in three steps:

1. The puller (replication/slave.py), refused with OUT_OF_RANGE "behind retention", asks
   :func:`why_not` whether it may: ``auto_resync`` on, the server a slave, and its message
   log known to hold nothing the master lacks: it never held a record, or it was compared
   with this master's log at the master's current epoch (``checkpoint/followed.ckpt``,
   written when a Pull stream of that epoch was accepted, or by the resync that made the
   folder). One master per epoch, whose log only grows during it: a log found to be a prefix
   of it then is one still. A log last compared under another epoch (a former master, a
   slave of an earlier master) may hold records this master never had, which a resync would
   put out of sight: that case, like a divergence (ABORTED) and an auth refusal, is left to
   an operator, and the refusal says why.
2. It writes ``checkpoint/resync_request.ckpt`` (the master, the reason: :func:`request`)
   and asks the App to stop gracefully and execute itself again (same argv: same pid, same
   listen address); a duplicate of the folder lock's descriptor stays open across the exec
   (segments/folder_lock.py), so no other server can take the folder meanwhile.
3. The new process, before the engine opens anything (:func:`before_open`, called by the
   App through qdelay.replication.hooks), finds the request and resyncs the folder from that
   master as ``qdelay admin resync`` does (replication/snapshot.py: the master takes its
   hold for this slave, by the slave's name, before it sends the snapshot; the new folder is
   written beside the old one and swapped in once whole; the old one is moved to
   ``<data>.before-resync-<time>``, never deleted), then opens the new folder, whose lock it
   has held since it was created. A failure (the master gone, refusing, or stopping midway)
   leaves the old folder in place as it was: it is logged (ERROR), counted in
   ``checkpoint/resync_failed.ckpt``, and the server opens the old folder; refused again,
   the puller waits :func:`retry_delay` (2 s doubling to 5 min) before the next try; a
   folder a resync made that is refused again before it ever attached waits a minute.

Why a re-execution rather than replacing the folder under the running engine: the App
wires the engine into the service, the consumer registry, the metrics, the replication node
and the health watch, and each keeps its own view of it (threads, open files, the id
index, caches); a fresh process opens the new folder through the one start-up path every
other start takes, with nothing of the old folder's state left anywhere.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import grpc

from qdelay.errors import CorruptRecord
from qdelay.replication import common
from qdelay.segments import checkpoint, naming
from qdelay.segments.folder_lock import FolderLock
from qdelay.units import counted

log = logging.getLogger("qdelay.replication.resync")

RETRY_FIRST_S = 2.0
RETRY_MAX_S = 300.0
AGAIN_AFTER_RESYNC_S = 60.0
# this many resyncs in a row whose folder was refused again before it attached: the next is
# left to an operator (each keeps the folder before it aside, a copy of the schedule log)
MAX_UNATTACHED_RESYNCS = 3
SNAPSHOT_TIMEOUT_S = 3600.0

# a stop signal during start-up (abort): the Snapshot call under way is cancelled, and none
# begins after it; the copy can take up to SNAPSHOT_TIMEOUT_S, which a SIGTERM waited out
_aborted = threading.Event()
_active_lock = threading.Lock()
_active_call: grpc.Future | None = None


def _path(data_dir: str, name: str) -> str:
    return os.path.join(data_dir, naming.CHECKPOINT_DIR, name)


def _read(path: str) -> dict | None:
    try:
        return checkpoint.read(path)
    except (CorruptRecord, OSError, ValueError):
        return None


# --- what the running slave keeps -----------------------------------------------------------------
def note_followed(data_dir: str, epoch: int) -> None:
    """This folder's message log was found a prefix of the log of the master at ``epoch``."""
    checkpoint.write(_path(data_dir, naming.FOLLOWED_FILE), {"epoch": epoch})


def followed_epoch(data_dir: str) -> int | None:
    state = _read(_path(data_dir, naming.FOLLOWED_FILE)) or {}
    epoch = state.get("epoch")
    return epoch if isinstance(epoch, int) else None


def unattached_resyncs(data_dir: str) -> int:
    """How many full resyncs in a row made this folder and the ones before it, none of which
    a master's stream accepted since (0: a stream was accepted after the last resync)."""
    state = _read(_path(data_dir, naming.FOLLOWED_FILE)) or {}
    if not isinstance(state.get("resynced_ms"), int):
        return 0
    n = state.get("unattached", 1)
    return n if isinstance(n, int) and n > 0 else 1


def is_behind_retention(code: grpc.StatusCode, details: str) -> bool:
    """The one refusal an automatic resync answers (replication/master.py, check_hello and
    _wal_chunk)."""
    return code == grpc.StatusCode.OUT_OF_RANGE and details.startswith("behind retention")


def why_not(cfg, engine, master_epoch: int) -> str:
    """Why this slave may not resync by itself now ("" when it may)."""
    if not cfg.auto_resync:
        return "auto_resync is off"
    if engine.role != "slave":
        return f"this server is {engine.role}"
    again = unattached_resyncs(cfg.data_dir)
    if again >= MAX_UNATTACHED_RESYNCS:
        # each resync keeps the folder before it aside: resyncing on would fill the disk
        return (
            f"the last {again} full resyncs in a row were refused again before they attached (is the "
            f"master's slave_hold_ms shorter than this slave's start?); fix that, then resync it by hand "
            f"(docs/operations.md 4.4)"
        )
    if engine.wal.committed_offset == 0:
        return ""  # a folder that never held a record has nothing to lose
    followed = followed_epoch(cfg.data_dir)
    if followed == master_epoch:
        return ""
    if followed is None:
        was = f"never compared with this master's at its epoch {master_epoch}"
    else:
        was = f"last compared with a master's at epoch {followed}, not this master's epoch {master_epoch}"
    return (
        f"its message log was {was}: it may "
        f"hold records this master never had (a former master, or a slave of an earlier one); "
        f"check, then resync it by hand (docs/operations.md 4.4)"
    )


def retry_delay(data_dir: str) -> tuple[float, str]:
    """(seconds still to wait before the next try, why): after failed tries, 2 s doubling to
    5 min from the last (``resync_failed.ckpt``); and a folder a resync made that is refused
    again before it ever attached (the master cleaned the resync's offset before this slave
    was back: ``slave_hold_ms`` shorter than its start?) waits ``AGAIN_AFTER_RESYNC_S`` from
    that resync, so that such a master cannot keep it copying snapshots back to back."""
    failed = _read(_path(data_dir, naming.RESYNC_FAILED_FILE)) or {}
    attempts = int(failed.get("attempts", 0) or 0)
    now = time.time()
    if attempts > 0:
        delay = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (attempts - 1))
        left = int(failed.get("at_ms", 0)) / 1000.0 + delay - now
        if left > 0:
            return (
                left,
                f"the automatic full resync failed {counted(attempts, 'time')}, last: {failed.get('error', '')}",
            )
    resynced = (_read(_path(data_dir, naming.FOLLOWED_FILE)) or {}).get("resynced_ms")
    if isinstance(resynced, int):
        left = resynced / 1000.0 + AGAIN_AFTER_RESYNC_S - now
        if left > 0:
            return left, (
                f"refused again {now - resynced / 1000.0:.0f} s after the full resync that made this folder, "
                f"before it attached: is the master's slave_hold_ms shorter than this slave's start?"
            )
    return 0.0, ""


def without_advice(details: str) -> str:
    """The master's refusal without its advice to the operator (to run the resync by hand)."""
    for advice in ("; stop the slave and run 'qdelay admin resync", "; run 'qdelay admin resync'"):
        details = details.split(advice)[0]
    return details


def request(data_dir: str, master: str, reason: str, epoch: int, end_offset: int) -> None:
    """Leave the request the re-executed server acts on before it opens the folder."""
    checkpoint.write(
        _path(data_dir, naming.RESYNC_REQUEST_FILE),
        {
            "master": master,
            "reason": reason,
            "epoch": epoch,
            "end_offset": end_offset,
            "requested_ms": int(time.time() * 1000),
        },
    )


# --- what the re-executed server does first -------------------------------------------------------
def before_open(cfg) -> None:
    """At start-up, before the engine opens the folder: act on a resync request. Never
    raises for a failed resync (the old folder is opened as it was, the failure counted)."""
    data_dir = cfg.data_dir
    _leftovers(data_dir)
    req_path = _path(data_dir, naming.RESYNC_REQUEST_FILE)
    if not os.path.exists(req_path):
        return
    req = _read(req_path) or {}
    master = str(req.get("master") or "")
    problem = ""
    role = (_read(_path(data_dir, "role.ckpt")) or {}).get("role", "slave")
    if not master:
        problem = f"the request {req_path} is unreadable"
    elif not cfg.auto_resync:
        problem = "auto_resync is off"
    elif not (cfg.role == "slave" or cfg.etcd):
        problem = "this server is started as a master (--role master)"
    elif role != "slave":
        problem = f"this folder's persisted role is {role}, not slave"
    if problem:
        _failed(data_dir, req_path, master, f"not done: {problem}")
        return
    started = time.monotonic()
    lock = FolderLock(data_dir, "qdelay server (automatic full resync)")
    try:
        info = _resync(cfg, master, lock)
    except Exception as err:  # noqa: BLE001 - any failure leaves the old folder, which opens
        lock.hand_over()
        if _aborted.is_set():
            _withdrawn(req_path, master)
        else:
            _failed(data_dir, req_path, master, _describe(err))
        return
    lock.release()  # the old folder's, now aside; the new one's is held for the engine
    moved = info["moved_old_to"]
    if moved:  # the request and failures went with the old folder: they are done there
        for name in (naming.RESYNC_REQUEST_FILE, naming.RESYNC_FAILED_FILE):
            try:
                os.unlink(_path(moved, name))
            except FileNotFoundError:
                pass
    log.info(
        "automatic full resync done from %s in %.1f s: %s, %s; the message log starts at offset %d "
        "(after sequence %d); the old folder %s",
        master,
        time.monotonic() - started,
        counted(info["files"], "segment file"),
        counted(info["bytes"], "byte"),
        info["offset"],
        info["sequence"],
        (
            f"(its message log ending at offset {req.get('end_offset', '?')}) was moved to {moved} (delete it "
            f"once this slave shows lag_bytes=0)"
            if moved
            else "held nothing to keep"
        ),
        extra={"master": master, "offset": info["offset"], "sequence": info["sequence"], "moved_old_to": moved},
    )


def _leftovers(data_dir: str) -> None:
    """What a resync (automatic or by hand) interrupted by a crash left beside the folder,
    dealt with and said at the next start, not at the next resync (which may never come):
    the folder that was in place before, left at ``<data>.resync-incoming`` by a crash
    between the swap and its rename, sat there with nothing in the log to say so."""
    from qdelay.replication.snapshot import incoming_path, tidy_incoming

    incoming = incoming_path(data_dir)
    if not os.path.isdir(data_dir) or not os.path.exists(incoming):
        return
    lock = FolderLock(data_dir, "qdelay server")  # a resync by hand holds it while it writes there
    try:
        _, moved = tidy_incoming(data_dir)
    finally:
        lock.hand_over()  # to the resync below, or the engine
    if moved:
        log.warning(
            "found %s without its INCOMING mark, left by a full resync interrupted around its swap (the "
            "folder that was in place before it, or a whole copy not swapped in): moved to %s, kept; delete it "
            "once this server shows lag_bytes=0",
            incoming,
            moved,
            extra={"moved_to": moved},
        )
    else:
        log.info("removed %s, the partial copy of a full resync that was interrupted", incoming)


def _resync(cfg, master: str, lock: FolderLock) -> dict:
    from qdelay.replication.snapshot import write_snapshot
    from qdelay.v1 import replication_pb2 as rpb
    from qdelay.v1 import replication_pb2_grpc as rpb_grpc

    global _active_call
    token, ca, tls = common.slave_credentials(cfg)
    ch = common.make_channel(master, tls=tls, ca=ca, server_name=cfg.replication_tls_server_name, aio=False)
    try:
        with _active_lock:
            if _aborted.is_set():
                raise _Stopped("stopped by a signal before it began")
            stream = _active_call = rpb_grpc.ReplicationStub(ch).Snapshot(
                rpb.SnapshotRequest(slave_name=common.slave_name(cfg.data_dir)),
                timeout=SNAPSHOT_TIMEOUT_S,
                metadata=common.metadata(token),
            )
        try:
            return write_snapshot(cfg.data_dir, stream, hand_over=True, lock=lock)
        finally:
            with _active_lock:
                _active_call = None
    finally:
        ch.close()


class _Stopped(Exception):
    pass


def abort() -> None:
    """A stop signal while the server starts (any thread): a resync under way is abandoned
    (its incoming copy removed, the old folder left as it was; the server then stops before
    opening it) and none begins. The request is withdrawn, not counted as a failure: refused
    again once started, the slave asks for a resync anew."""
    with _active_lock:
        _aborted.set()
        call = _active_call
    if call is not None:
        call.cancel()


def _withdrawn(req_path: str, master: str) -> None:
    os.unlink(req_path)
    log.warning(
        "automatic full resync from %s stopped by a signal: the copy is abandoned, the folder stays as it was "
        "and this server stops; refused again as behind retention once started, it resyncs then",
        master,
        extra={"master": master},
    )


def _describe(err: BaseException) -> str:
    if isinstance(err, grpc.RpcError):
        return f"{err.code().name}: {err.details()}"  # type: ignore[attr-defined]
    return f"{type(err).__name__}: {err}"


def _failed(data_dir: str, req_path: str, master: str, reason: str) -> None:
    """The request is consumed; the failure counted (the puller's backoff) and logged."""
    failed = _read(_path(data_dir, naming.RESYNC_FAILED_FILE)) or {}
    attempts = int(failed.get("attempts", 0) or 0) + 1
    checkpoint.write(
        _path(data_dir, naming.RESYNC_FAILED_FILE),
        {"attempts": attempts, "error": reason, "master": master, "at_ms": int(time.time() * 1000)},
    )
    os.unlink(req_path)
    delay = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** max(0, attempts - 1))
    log.error(
        "automatic full resync from %s failed: %s; this server opens its folder as it was%s",
        master or "(unknown master)",
        reason,
        f" and tries again once refused, {delay:g} s from now at the earliest (attempt {attempts})",
        extra={"master": master, "attempts": attempts},
    )
