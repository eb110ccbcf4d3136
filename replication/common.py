"""Shared pieces of replication: channels (TLS, token), frame walking, scheduling progress."""

from __future__ import annotations

import os

import grpc

from qdelay.segments import framing, reader

HEADER = framing.HEADER
HS = framing.HEADER_SIZE
MAX_MESSAGE = 80 * 1024 * 1024


def slave_name(data_dir: str) -> str:
    """The name a slave gives its master (its hello, and ``qdelay admin resync``'s snapshot
    request): the master's hold for the resync is then the one the slave's stream takes over."""
    return f"{os.uname().nodename}:{os.path.abspath(data_dir)}"


def peer_away(err: grpc.RpcError) -> bool:
    """A failed call to another server (a slave's Pull stream to its master, a call to etcd)
    that says the peer is down, restarting or out of reach, not that it refused:
    ``client.batching.peer_away`` (UNAVAILABLE, DEADLINE_EXCEEDED, a lost status), its one
    definition, imported on a failure only: the server does not load the client package."""
    from qdelay.client.batching import peer_away as away

    return away(err)


def channel_options() -> list[tuple]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE),
        ("grpc.max_send_message_length", MAX_MESSAGE),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]


def read_token(token_file: str | None) -> str | None:
    """The first token of a token file (the one a slave or admin presents)."""
    if not token_file:
        return None
    with open(token_file, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                return line
    return None


def file_problem(path: str, token: bool = False) -> str | None:
    """Why a file named on a command line (``qdelay admin``, ``qdelay spark``) cannot be
    used, None when it can: checked before any call or job, so that a wrong path is one
    line naming it, not a traceback; a ``token`` file must also hold a token (else the
    calls go without one and are refused UNAUTHENTICATED)."""
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        return f"{path}: cannot read it: {e.strerror}"
    if token:
        try:
            found = read_token(path)
        except UnicodeDecodeError:
            return f"{path} is not a text file (a token file holds a token a line, UTF-8)"
        if found is None:
            return f"{path} holds no token (its first line that is not blank or a # comment is the token)"
    return None


def slave_credentials(cfg) -> tuple[str | None, bytes | None, bool]:
    """(token, CA bytes, use TLS) a server uses to call its master or peers."""
    token = read_token(cfg.replication_token_file or cfg.auth_token_file)
    ca = None
    if cfg.replication_tls_ca:
        with open(cfg.replication_tls_ca, "rb") as f:
            ca = f.read()
    tls = bool(ca) or bool(cfg.tls_cert)
    if tls and ca is None and cfg.tls_cert:
        with open(cfg.tls_cert, "rb") as f:  # a cluster sharing one self-signed certificate
            ca = f.read()
    return token, ca, tls


def make_channel(
    target: str, *, tls: bool = False, ca: bytes | None = None, server_name: str | None = None, aio: bool = True
):
    opts = channel_options()
    if server_name:
        opts.append(("grpc.ssl_target_name_override", server_name))
    mod = grpc.aio if aio else grpc
    if tls:
        return mod.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=ca), opts)
    return mod.insecure_channel(target, opts)


def metadata(token: str | None) -> tuple:
    return (("authorization", f"Bearer {token}"),) if token else ()


def whole_frames(data: bytes) -> int:
    """Length of the longest prefix of ``data`` made of whole frames (headers only)."""
    return reader.whole_frames(data)


def frame_infos(data: bytes, base: int) -> list[tuple[int, int, int, int]]:
    """(offset, sequence, checksum, size) of the whole frames in ``data`` (no checksum check)."""
    return reader.frame_spans(data, base)


def last_frame(wal) -> tuple[int, int, int] | None:
    """(offset, sequence, checksum) of the last committed frame of a message log, or None."""
    end = wal.committed_offset
    segs = [s for s in wal.segments() if s.key < end and s.size > 0]
    if not segs:
        return None
    seg = segs[-1]
    last = None
    pos = seg.key
    stop = min(seg.key + seg.size, end)
    while pos < stop:
        data = wal.read_raw(pos, 8 * 1024 * 1024)
        infos = frame_infos(data, pos)
        if not infos:
            break
        last = infos[-1]
        pos = last[0] + last[3]
    return None if last is None else (last[0], last[1], last[2])


def first_sequence(wal) -> int:
    data = wal.read_raw(wal.first_offset, HS)
    if len(data) < HS:
        return 0
    return reader.frame_sequence(data)


def master_progress(engine) -> tuple[int, list[int], int]:
    """(done_before, reopened, sequence): the master's scheduling state, consistent with every
    record up to ``sequence`` (read under the iterate's append lock, so no record is half
    accounted; the sequence read may lag, which only makes the slave more careful)."""
    with engine.iterate.append_lock:
        seq = engine.iterate.sequence
        done_before, reopened = engine.scheduler.progress()
        return done_before, reopened, seq


def apply_progress(engine, done_before: int, reopened, sequence: int) -> None:
    """Slave: adopt the master's scheduling progress, keeping buckets that records the master
    had not accounted for (sequence above ``sequence``) went to."""
    with engine.iterate.append_lock:
        seen = engine.slave_records
        for b in [b for b, s in seen.items() if s <= sequence]:
            del seen[b]
        # the master's view, exactly (it may even move back: a bucket the master has not
        # finished is loaded on promotion), plus buckets of records it had not seen yet
        engine.scheduler.adopt_progress(done_before, set(reopened) | set(seen))
