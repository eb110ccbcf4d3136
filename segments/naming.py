"""File names of every log (docs/formats.md, "Files and names"), in one place.

- message log: ``message/<base offset, 20 digits>.wal``
- schedule log: ``schedule/<YYYYMMDD>/<YYYYMMDDHHMM>.sched`` (UTC start of the due bucket)
- dispatch log: ``dispatch/<YYYYMMDD>/<YYYYMMDDHHMM>.disp`` (same bucket as its schedule segment)
- checkpoints: ``checkpoint/<name>.ckpt``

Schedule and dispatch segments are keyed by their bucket's start as whole minutes since
the Unix epoch; day folders keep any one directory to at most 1,440 files.
"""

from __future__ import annotations

import datetime as _dt
import os
import re

MESSAGE_DIR = "message"
SCHEDULE_DIR = "schedule"
DISPATCH_DIR = "dispatch"
CHECKPOINT_DIR = "checkpoint"

WAL_SUFFIX = ".wal"
SCHEDULE_SUFFIX = ".sched"
DISPATCH_SUFFIX = ".disp"
CHECKPOINT_SUFFIX = ".ckpt"
# the data folder's lock file (segments/folder_lock.py): held by the server using the folder
LOCK_FILE = "LOCK"
# message-log bytes a re-attached master cut as divergent (replication/slave.py), kept for
# the operator: ``diverged/<from offset, 20 digits>-<to offset, 20 digits>.wal``
DIVERGED_DIR = "diverged"
# checkpoint files of a slave's automatic full resync (replication/autoresync.py): the
# master epoch its message log was last compared with and found a prefix of that master's
# log; the request a running slave leaves for its re-executed self; the failures so far
FOLLOWED_FILE = "followed.ckpt"
RESYNC_REQUEST_FILE = "resync_request.ckpt"
RESYNC_FAILED_FILE = "resync_failed.ckpt"
# a resync's new folder while it is written (``<data>.resync-incoming``) holds this file:
# without it, such a folder is an old one a crash left between the swap and its rename
INCOMING_FILE = "INCOMING"
# a folder a resync wrote holds this file until the server first opened it and derived its
# indexes (a snapshot copies segments only): that derivation is then expected, not a sign of
# a loss or a crash (server/engine.py logs it at INFO instead of WARNING)
UNINDEXED_FILE = "UNINDEXED"
_DIVERGED_NAME = re.compile(r"^(\d{20})-(\d{20})\.wal$")


def diverged_name(start: int, end: int) -> str:
    return f"{start:020d}-{end:020d}{WAL_SUFFIX}"


def parse_diverged_name(name: str) -> tuple[int, int] | None:
    m = _DIVERGED_NAME.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


MS_PER_MINUTE = 60_000
_WAL_NAME = re.compile(r"^(\d{20})\.wal$")
_MINUTE_NAME = re.compile(r"^(\d{12})\.(sched|disp)$")
_DAY_NAME = re.compile(r"^\d{8}$")


def wal_name(base_offset: int) -> str:
    return f"{base_offset:020d}{WAL_SUFFIX}"


def parse_wal_name(name: str) -> int | None:
    m = _WAL_NAME.match(name)
    return int(m.group(1)) if m else None


def bucket_of(due_ms: int, scale_minutes: int = 1) -> int:
    """The bucket key (epoch minutes, a multiple of ``scale_minutes``) of a due time."""
    minute = due_ms // MS_PER_MINUTE
    return minute - minute % scale_minutes


def minute_stamp(bucket: int) -> str:
    t = _dt.datetime.fromtimestamp(bucket * 60, tz=_dt.UTC)
    return t.strftime("%Y%m%d%H%M")


def parse_minute_stamp(stamp: str) -> int:
    t = _dt.datetime.strptime(stamp, "%Y%m%d%H%M").replace(tzinfo=_dt.UTC)
    return int(t.timestamp()) // 60


def bucket_relpath(bucket: int, suffix: str) -> str:
    stamp = minute_stamp(bucket)
    return os.path.join(stamp[:8], stamp + suffix)


def list_wal(directory: str) -> list[tuple[int, str]]:
    """(base offset, path) of every message-log segment, by base offset."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        base = parse_wal_name(name)
        if base is not None:
            found.append((base, os.path.join(directory, name)))
    return sorted(found)


def list_buckets(directory: str, suffix: str) -> list[tuple[int, str]]:
    """(bucket, path) of every schedule or dispatch segment below ``directory``, by bucket."""
    if not os.path.isdir(directory):
        return []
    found = []
    for day in os.listdir(directory):
        day_dir = os.path.join(directory, day)
        if not _DAY_NAME.match(day) or not os.path.isdir(day_dir):
            continue
        for name in os.listdir(day_dir):
            m = _MINUTE_NAME.match(name)
            if m and name.endswith(suffix):
                found.append((parse_minute_stamp(m.group(1)), os.path.join(day_dir, name)))
    return sorted(found)
