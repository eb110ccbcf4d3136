"""Loading the optional C extensions (``qdelay._wire``, ``qdelay.segments._codec``).

Each is optional: where it was not built, or ``QDELAY_NATIVE=0`` is set (tests compare the
two paths), the Python twins beside it run instead.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def optional(name: str) -> ModuleType | None:
    """The extension module ``name``, or None when it is not built or switched off."""
    if os.environ.get("QDELAY_NATIVE", "1") == "0":
        return None
    try:
        return importlib.import_module(name)
    except ImportError:  # not built: the Python twins run
        return None
