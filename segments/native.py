"""The optional C functions of the storage paths (segments/_codec.c) and the table of their
Python twins.

``codec`` is the compiled module, or None when it was not built (it is an optional
extension) or when ``QDELAY_NATIVE=0`` is set (to compare both in one benchmark run).
Callers look it up at each call (``native.codec``), so a test can switch it off. Every
function has a Python twin in segments/ (the ack ids': in server/ledger.py, whose format
they are) with the same signature and results, which stays
the reference; :func:`twins` names them and tests/test_codec_native.py runs each pair on
the same inputs. (The protobuf wire codec is qdelay/wire.py, with its own extension.)
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from qdelay.extensions import optional

codec: ModuleType | None = optional("qdelay.segments._codec")


def twins() -> dict[str, Callable[..., Any]]:
    """Every function of ``qdelay.segments._codec`` and its Python twin (imported here, not at
    the top: the twins' modules use this one)."""
    from qdelay.segments import framing, idfilter, idindex, reader, records, schedule_index, segment
    from qdelay.server import ledger, recent_ids  # the ack ids' format is the ack ledger's; the
    # recent-id table is the deduper's

    return {
        "frame_bodies": framing.frame_bodies_py,
        "scan": reader.scan_py,
        "gather": reader.gather_py,
        "route": reader.route_py,
        "read_messages": reader.read_messages_py,
        "dispatch_frames": records.encode_dispatch_frames_py,
        "ack_ids": ledger.ack_ids_py,
        "ack_sequences": ledger.ack_sequences_py,
        "ack_match": ledger.ack_match_py,
        "id_entries": idindex.id_entries_py,
        "filter_add": idfilter.filter_add_py,
        "filter_maybe_layers": idfilter.filter_maybe_layers_py,
        "recent_put": recent_ids.recent_put_py,
        "recent_find": recent_ids.recent_find_py,
        "recent_rehash": recent_ids.recent_rehash_py,
        "index_entries": schedule_index.index_entries_py,
        "index_find": schedule_index.index_find_py,
        "index_gather": schedule_index.index_gather_py,
        "index_confirm": schedule_index.index_confirm_py,
        "write_sync": segment.write_sync_py,
    }
