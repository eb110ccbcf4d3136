"""Reading MESSAGE records back for delivery, at offsets an index already knows.

The dispatcher knows each record's sequence and file offset (from the timer wheel); it
reads one run of nearby records with one pread and checks and splits them column-wise:
one call of the native codec (``read_messages``) or its Python twin
:func:`qdelay.segments.reader.read_messages_py`. A record that fails a check is read again on its own and, if still
bad, reported and never served (at-least-once allows skipping nothing else).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from qdelay.errors import CorruptRecord
from qdelay.segments import native, records
from qdelay.segments.framing import RecordKind
from qdelay.segments.reader import read_messages_py

if TYPE_CHECKING:
    from qdelay.segments.segment import Segment

log = logging.getLogger("qdelay.scheduler")

RUN_BYTES = 256 * 1024  # offsets closer than this share one read
READ_AHEAD = 16 * 1024  # read past the last offset of a run: most records are smaller

# (message ids, payloads, headers): one entry per record asked for; None where it cannot be served
Read = tuple[list[Any], list[Any], list[Any]]


def read_messages(seg: Segment, seqs: list[int], offs: list[int]) -> Read:
    """Message ids (bytes), payloads and headers (dict or None) of the records of ``seg``
    at ``offs`` (expected to carry ``seqs``), each in the input's order; the id is None for
    a record that cannot be served.

    Records are read with one pread per run of offsets less than RUN_BYTES apart and
    checked column-wise; one that fails is read again on its own and, if still bad,
    reported and skipped.
    """
    n = len(seqs)
    o = np.array(offs, dtype=np.int64)
    in_order = n < 2 or bool((o[1:] > o[:-1]).all())
    order = None if in_order else np.argsort(o, kind="stable")
    so = o if order is None else o[order]
    sseq = np.array(seqs if order is None else [seqs[k] for k in order.tolist()], dtype=np.int64)
    mids: list[Any] = [None] * n
    payloads: list[Any] = [None] * n
    headers: list[Any] = [None] * n
    failed: list[int] = []
    i = 0
    while i < n:
        first = int(so[i])
        j = int(np.searchsorted(so, first + RUN_BYTES, side="left"))
        data = seg.read(first, int(so[j - 1]) - first + READ_AHEAD)
        failed += _check_run(data, so[i:j] - first, sseq[i:j], mids, payloads, headers, i)
        i = j
    for k in failed:  # longer than what was read, or really corrupt: the slow, fully checked path
        mids[k], payloads[k], raw = _read_one(seg, int(sseq[k]), int(so[k]))
        if raw is not None:
            headers[k] = _headers(raw, int(sseq[k]), int(so[k]), mids, k)
    if order is not None:  # back to the input's order
        back = order.tolist()
        m2: list[Any] = [None] * n
        p2: list[Any] = [None] * n
        h2: list[Any] = [None] * n
        for pos, k in enumerate(back):
            m2[k], p2[k], h2[k] = mids[pos], payloads[pos], headers[pos]
        mids, payloads, headers = m2, p2, h2
    return mids, payloads, headers


def _check_run(
    data: bytes, rel: np.ndarray, seqs: np.ndarray, mids: list, payloads: list, headers: list, base: int
) -> list[int]:
    """Check and split the records at offsets ``rel`` of ``data`` (one read): fill
    ``mids``/``payloads``/``headers`` from position ``base`` on, return the positions
    (from ``base``) that failed a check and were left empty."""
    codec = native.codec
    check = codec.read_messages if codec is not None else read_messages_py
    got_mids, got_payloads, raw_headers, bad = check(
        data, np.ascontiguousarray(rel, dtype=np.int64), np.ascontiguousarray(seqs, dtype=np.int64)
    )
    n = len(rel)
    mids[base : base + n] = got_mids
    payloads[base : base + n] = got_payloads
    if raw_headers.count(None) != n:
        for k, raw in enumerate(raw_headers):
            if raw is not None:
                headers[base + k] = _headers(raw, int(seqs[k]), int(rel[k]), mids, base + k)
    return [base + k for k in bad]


def _headers(raw: bytes, seq: int, off: int, mids: list, k: int) -> dict[str, str] | None:
    """Decode a checked record's header block; a malformed one makes the record
    unservable (``mids[k] = None``)."""
    try:
        return records.decode_headers(raw)
    except ValueError as err:
        log.error(
            "malformed headers in a schedule record; it cannot be delivered",
            extra={"offset": off, "sequence": seq, "reason": str(err)},
        )
        mids[k] = None
        return None


def _read_one(seg: Segment, seq: int, off: int) -> tuple[bytes | None, bytes | None, bytes | None]:
    """(message id, payload, raw headers or None) of one record read and checked on its
    own, or (None, None, None) if it cannot be served."""
    try:
        f = seg.read_frame(off)
    except CorruptRecord as err:
        log.error(
            "corrupt schedule record; it cannot be delivered",
            extra={"path": err.path, "offset": err.offset, "reason": err.reason},
        )
        return None, None, None
    if f.sequence != seq or f.kind != RecordKind.MESSAGE:
        log.error(
            "schedule record is not the indexed message; it cannot be delivered",
            extra={"offset": off, "sequence": seq, "found": f.sequence},
        )
        return None, None, None
    body = f.body
    slen = mlen = hlen = plen = -1
    if len(body) >= records.MESSAGE_FIXED.size:
        _due, slen, mlen, hlen, plen = records.MESSAGE_FIXED.unpack_from(body, 0)
    a = records.MESSAGE_FIXED.size + slen
    if slen < 0 or a + mlen + hlen + plen != len(body):
        log.error("malformed schedule record; it cannot be delivered", extra={"offset": off, "sequence": seq})
        return None, None, None
    return body[a : a + mlen], body[a + mlen + hlen :], (body[a + mlen : a + mlen + hlen] if hlen else None)
