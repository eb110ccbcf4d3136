"""Checkpoint files: one framed JSON record, replaced atomically.

Write: temp file, fsync, rename over the old one, fsync the directory. A reader thus
sees the old checkpoint or the new one, never a mix; a checksum failure (a disk that
lies) is reported, not guessed around.
"""

from __future__ import annotations

import json
import os
import time

from qdelay.errors import CorruptRecord
from qdelay.segments import framing, reader
from qdelay.segments.framing import FrameError, RecordKind
from qdelay.segments.segment import fsync_dir


def encode(state: dict, timestamp: int) -> bytes:
    """A checkpoint file's content: one CHECKPOINT frame whose body is a JSON object."""
    body = json.dumps(state, sort_keys=True, separators=(",", ":")).encode()
    return framing.encode(RecordKind.CHECKPOINT, 0, timestamp, body)


def decode(data: bytes) -> dict:
    """The state a checkpoint file's bytes hold; :class:`FrameError` (or ValueError for a
    body that is not JSON) when they are not one whole CHECKPOINT frame of a JSON object."""
    frame = reader.sole_frame(data)
    if frame.kind != RecordKind.CHECKPOINT:
        raise FrameError(0, f"kind {frame.kind} is not a checkpoint")
    state = json.loads(frame.body)
    if not isinstance(state, dict):
        raise FrameError(framing.HEADER_SIZE, "checkpoint body is not a JSON object")
    return state


def write(path: str, state: dict) -> None:
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp"
    data = encode(state, int(time.time() * 1000))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(directory)


def read(path: str) -> dict | None:
    """The saved state, or None when no checkpoint was ever written."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    try:
        return decode(data)
    except (FrameError, ValueError) as err:
        offset = getattr(err, "offset", 0)
        raise CorruptRecord(path, offset, str(err)) from None
