"""A real small disk for the ENOSPC tests: a tmpfs of a given size, and a way to fill it."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(parent: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (e.g. "1m") under ``parent``; skips the test where mounting
    is not allowed (it needs root / CAP_SYS_ADMIN)."""
    mount_point = parent / "small"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill up ({done.stderr.strip()})")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill_disk(directory: Path | str, chunk: int = 4096) -> str:
    """Write a file of 0xff into ``directory`` until the disk is full; returns its path
    (delete it to free the space)."""
    filler = os.path.join(directory, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while os.write(fd, b"\xff" * chunk):
            pass
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)
    return filler
