"""No frame walking outside the frame reader (issue 18): production code reads frames
through ``qdelay.segments.reader`` and names header offsets through ``framing``.

A grep, not a type check: it looks for the tools of a hand-written walk (``check_at``,
the native ``scan``, unpacking a header, resyncing, header fields sliced by number). The
allowlist says why each remaining file still has one (the frame's definition and the
reader itself; code being rewritten onto the reader); an entry that no longer matches
fails too, so the list only shrinks. Everything else reads frames through the reader's
functions (``read_columns``/``read_frames``/``read_frame``/``segment_frames`` on a
segment, ``walk_reads`` on a file, ``walk``/``frames``/``frame_at``/``scan_columns`` on a
buffer, ``require_whole``/``sole_frame``/``header`` on bytes from elsewhere).
"""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("segments", "server", "client", "tools", "replication", "qdelay", "bench")
WALKING = re.compile(
    r"check_at\(|codec\.scan\(|HEADER\.unpack_from|find_next_frame\(|iter_frames\(|next_frame\(|framing\.scan\(|"
    r"\[\s*(?:\w+\s*\+\s*)?(?:12|16|17|20|28)\s*:\s*(?:\w+\s*\+\s*)?(?:16|20|28|36)\s*\]"
)

ALLOWED = {
    "segments/framing.py": "defines the frame: its layout, encoder and check_at, the one check of one frame",
    "segments/reader.py": "the frame reader",
}


def _walkers() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for folder in FOLDERS:
        for dirpath, _dirs, names in os.walk(os.path.join(ROOT, folder)):
            for name in names:
                if not name.endswith(".py") or name.endswith("_pb2.py") or name.endswith("_pb2_grpc.py"):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, ROOT)
                with open(path, encoding="utf-8") as f:
                    hits = [f"{n}: {line.strip()}" for n, line in enumerate(f, 1) if WALKING.search(line)]
                if hits:
                    found[rel] = hits
    return found


def test_no_frame_walking_outside_the_reader():
    found = _walkers()
    outside = {path: hits for path, hits in found.items() if path not in ALLOWED}
    assert outside == {}, "frames walked outside segments/reader.py (read through the reader instead)"


def test_the_allowlist_only_shrinks():
    stale = sorted(set(ALLOWED) - set(_walkers()))
    assert stale == [], f"no frame walking left in {stale}: take them off ALLOWED"
