"""One server per data folder: an exclusive advisory lock on ``<data>/LOCK``.

Nothing stopped a second ``qdelay server`` (a unit started twice, a typo in --data-dir)
from opening a folder a running server writes: its recovery cut the running server's
preallocated message-log tail, and it could go on appending to the same log. The engine
takes this lock before it reads anything and holds it until it closes; ``qdelay admin
resync`` takes it before it moves a folder aside. The kernel drops it when the process
ends, however it ends, so a crash never leaves a stale lock. The file holds the holder's
pid, for the message only. ``qdelay inspect`` and the Spark source only read: they take
no lock.

Handing a held lock on without a gap (the automatic full resync, replication/autoresync.py):
a server that re-executes itself keeps a duplicate of its lock's descriptor open across
``exec`` (:meth:`FolderLock.keep_across_exec`, named in ``$QDELAY_FOLDER_LOCK``), and a lock
taken by one part of a process can be handed to the next (:meth:`FolderLock.hand_over`): a
later ``FolderLock`` on the same file in this process adopts the held descriptor instead of
asking the kernel again (which a second open of the file would be refused: ``flock`` locks
belong to the open file, not to the process).
"""

from __future__ import annotations

import fcntl
import os
import threading

from qdelay.errors import FolderInUse
from qdelay.segments import naming

INHERIT_ENV = "QDELAY_FOLDER_LOCK"
# held descriptors waiting to be adopted, by (st_dev, st_ino) of the LOCK file they lock
_handed: dict[tuple[int, int], int] = {}
_handed_lock = threading.Lock()
_inherited_read = False


def _take_inherited() -> None:
    """Once per process: the descriptor a re-executed server kept for us (``$QDELAY_FOLDER_LOCK``,
    ``FD:DEV:INO``), if it is still open on that file; the variable is removed so that no
    child of this process claims it."""
    global _inherited_read
    if _inherited_read:
        return
    _inherited_read = True
    value = os.environ.pop(INHERIT_ENV, "")
    try:
        fd, dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat(fd)
    except (ValueError, OSError):
        return
    if (st.st_dev, st.st_ino) == (dev, ino):
        os.set_inheritable(fd, False)
        _handed[(dev, ino)] = fd


def _adopt(fd: int) -> int | None:
    """A handed-over descriptor locking the same file as ``fd`` (then ``fd`` is closed)."""
    st = os.fstat(fd)
    with _handed_lock:
        _take_inherited()
        held = _handed.pop((st.st_dev, st.st_ino), None)
    if held is not None:
        os.close(fd)
    return held


class FolderLock:
    """Held from construction until :meth:`release` (or the process's end)."""

    def __init__(self, root: str, user: str = "qdelay server") -> None:
        self._fd: int | None = None
        path = os.path.join(root, naming.LOCK_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        held = _adopt(fd)
        if held is not None:  # this process holds it already (handed over, or across exec)
            self._fd = held
            return
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

    def hand_over(self) -> None:
        """Keep the lock held, for the next ``FolderLock`` on this file in this process to
        adopt (this object no longer owns it)."""
        if self._fd is not None:
            st = os.fstat(self._fd)
            with _handed_lock:
                _take_inherited()
                _handed[(st.st_dev, st.st_ino)] = self._fd
            self._fd = None

    def keep_across_exec(self) -> str:
        """A duplicate of the lock's descriptor that stays open across ``exec`` (the lock
        stays held by it after :meth:`release`); returns the value for ``$QDELAY_FOLDER_LOCK``
        that lets the new program adopt it."""
        assert self._fd is not None, "the lock is not held"
        fd = os.dup(self._fd)
        os.set_inheritable(fd, True)
        st = os.fstat(fd)
        return f"{fd}:{st.st_dev}:{st.st_ino}"

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None

    def __del__(self) -> None:  # an engine whose opening failed half-way lets go of it
        self.release()
