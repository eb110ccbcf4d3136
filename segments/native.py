"""The optional C twins of the per-record loops of the ingest and dispatch paths (segments/_codec.c).

``codec`` is the compiled module, or None when it was not built (it is an optional
extension) or when ``QDELAY_NATIVE=0`` is set (to compare both in one benchmark run).
Callers look it up at each call (``native.codec``), so a test can switch it off. Every
function has a Python twin that stays the reference; tests/test_codec_native.py checks
that both give the same bytes.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

codec: ModuleType | None = None
if os.environ.get("QDELAY_NATIVE", "1") != "0":
    try:
        codec = importlib.import_module("qdelay.segments._codec")
    except ImportError:  # not built: the Python twins run
        codec = None
