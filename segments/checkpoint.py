"""Checkpoint files: one framed JSON record, replaced atomically.

Write: temp file, fsync, rename over the old one, fsync the directory. A reader thus
sees the old checkpoint or the new one, never a mix; a checksum failure (a disk that
lies) is reported, not guessed around.
"""

from __future__ import annotations

import os
import time

from qdelay.errors import CorruptRecord
from qdelay.segments import records
from qdelay.segments.framing import FrameError
from qdelay.segments.segment import fsync_dir


def write(path: str, state: dict) -> None:
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp"
    data = records.encode_checkpoint(state, int(time.time() * 1000))
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
        return records.decode_checkpoint(data)
    except (FrameError, ValueError) as err:
        offset = getattr(err, "offset", 0)
        raise CorruptRecord(path, offset, str(err)) from None
