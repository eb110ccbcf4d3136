"""OS-level thread names: a Python thread's name is only Python's; ``top -H``, ``py-spy``,
``/proc/<pid>/task/<tid>/comm`` and bench's per-thread CPU see "python" for every thread
of the server unless the kernel is told. Linux only (``prctl(PR_SET_NAME)``); elsewhere
a no-op."""

from __future__ import annotations

import ctypes
import sys
import threading
from types import FrameType
from typing import Any

PR_SET_NAME = 15
#: the kernel keeps 15 bytes of a thread's name (16 with the NUL)
MAX_NAME_BYTES = 15


def os_name(python_name: str) -> bytes:
    """The OS name a thread of this Python name carries: without the ``qdelay-`` prefix
    every server thread shares (it would use half of the kernel's 15 bytes), cut to 15."""
    return python_name.removeprefix("qdelay-").encode("utf-8", "replace")[:MAX_NAME_BYTES]


def name_os_threads() -> bool:
    """From now on, every thread the threading module starts in this process (ours, thread
    pools', gRPC's Python pollers) sets its OS name from its Python name as it starts.
    Returns False where the OS has no such call (nothing is changed)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False

    def first_event(frame: FrameType, event: str, arg: Any) -> None:
        # threading.setprofile's hook runs in each new thread at its first event: name the
        # thread, then take the hook off that thread at once (it would otherwise run on
        # every call and return of the thread)
        sys.setprofile(None)
        prctl(PR_SET_NAME, ctypes.c_char_p(os_name(threading.current_thread().name)), 0, 0, 0)

    threading.setprofile(first_event)
    return True
