"""No frame walking outside the frame reader (issue 18): production code reads frames
through ``qdelay.segments.reader`` and names header offsets through ``framing``.

A grep, not a type check: it looks for the tools of a hand-written walk (``check_at``,
the native ``scan``, unpacking a header, resyncing, header fields sliced by number). The
allowlist says why each remaining file still has one; an entry that no longer matches
fails too, so the list only shrinks.
"""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("segments", "server", "client", "tools", "replication", "qdelay", "bench")
WALKING = re.compile(
    r"check_at\(|codec\.scan\(|HEADER\.unpack_from|find_next_frame\(|iter_frames\(|"
    r"\[\s*(?:\w+\s*\+\s*)?(?:12|16|17|20|28)\s*:\s*(?:\w+\s*\+\s*)?(?:16|20|28|36)\s*\]"
)

ALLOWED = {
    "segments/framing.py": "defines the frame and its checks",
    "segments/reader.py": "the frame reader",
    "segments/segment.py": "Segment.read_frame/frames: one file's verified reads (to fold into the reader)",
    "segments/wal.py": "append_raw checks replicated bytes before writing them",
    "segments/records.py": "a checkpoint file is one frame",
    "server/engine.py": "DISPATCH records still in memory (pending_dispatch) are whole frames",
    "server/iterate.py": "being rewritten onto the reader (issue 18)",
    "tools/spark_source.py": "the Spark source's per-record twin (owned by the Spark work)",
    "replication/master.py": "reads a record's header for its sequence and time",
    "replication/slave.py": "checks replicated dispatch chunks",
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
