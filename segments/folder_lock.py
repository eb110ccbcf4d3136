"""One server per data folder: an exclusive advisory lock on ``<data>/LOCK``.

Nothing stopped a second ``qdelay server`` (a unit started twice, a typo in --data-dir)
from opening a folder a running server writes: its recovery cut the running server's
preallocated message-log tail, and it could go on appending to the same log. The engine
takes this lock before it reads anything and holds it until it closes; ``qdelay admin
resync`` takes it before it moves a folder aside. The kernel drops it when the process
ends, however it ends, so a crash never leaves a stale lock. The file holds the holder's
pid, for the message only. ``qdelay inspect`` and the Spark source only read: they take
no lock.
"""

from __future__ import annotations

import fcntl
import os

from qdelay.errors import FolderInUse
from qdelay.segments import naming


class FolderLock:
    """Held from construction until :meth:`release` (or the process's end)."""

    def __init__(self, root: str, user: str = "qdelay server") -> None:
        self._fd: int | None = None
        path = os.path.join(root, naming.LOCK_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise FolderInUse(
                f"data folder {root} is in use by another process (pid {holder}, holding {path}); "
                f"stop it before starting {user} on this folder"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None

    def __del__(self) -> None:  # an engine whose opening failed half-way lets go of it
        self.release()
