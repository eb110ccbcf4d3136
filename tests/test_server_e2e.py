"""End-to-end: a real ``qdelay server`` process on 127.0.0.1, the Python client, no mocks."""

from __future__ import annotations

import itertools
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import grpc
import pytest
from conftest import wait_until
from disks import fill_disk, small_tmpfs
from serverproc import ServerProc

from qdelay import errors
from qdelay.client import Delivery
from qdelay.v1 import qdelay_pb2 as pb
from qdelay.v1 import qdelay_pb2_grpc as pb_grpc

ACK_TIMEOUT_MS = 1000
_subjects = itertools.count(1)


def subject() -> str:
    return f"t{next(_subjects)}.{int(time.time() * 1000) % 100000}"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@pytest.fixture(scope="module")
def server_args() -> list[str]:
    return [
        "--set",
        f"engine.ack_timeout_ms={ACK_TIMEOUT_MS}",
        "--set",
        "engine.retry_backoff_ms=0",
        "--metrics-listen",
        "127.0.0.1:0",
    ]


def group(client, subject: str, name: str = "default") -> dict:
    """The Stats row of a consumer group ({} while it has no open stream)."""
    rows = [g for g in client.stats()["groups"] if g["subject"] == subject and g["group"] == name]
    return rows[0] if rows else {}


def test_send_then_receive_at_due_time_not_before(client):
    s = subject()
    with client.subscribe(s) as consumer:
        r = client.send(s, b"hello", delay_ms=700, headers={"k": "v"})
        assert r.deliver_at_ms >= now_ms() + 400
        got = consumer.receive(1, timeout=10)
        received = now_ms()
        assert len(got) == 1
        d = got[0]
        assert type(d) is Delivery and d.group == "default"  # typed, not protobuf
        assert (d.message_id, d.subject, d.payload, d.headers) == (r.message_id, s, b"hello", {"k": "v"})
        assert d.attempt == 1 and d.deliver_at_ms == r.deliver_at_ms
        assert received >= r.deliver_at_ms, "delivered early"
        assert d.dispatched_at_ms >= r.deliver_at_ms
        assert received - r.deliver_at_ms < 2000
        consumer.ack(got)


def test_past_due_delivered_at_once(client):
    s = subject()
    with client.subscribe(s) as consumer:
        r = client.send(s, b"late", deliver_at_ms=now_ms() - 60_000)
        got = consumer.receive(1, timeout=5)
        assert [d.message_id for d in got] == [r.message_id]
        consumer.ack(got)


def test_batch_and_stream_sends(client):
    s = subject()
    due = now_ms() + 300
    receipts = client.send_batch([client.message(s, b"b%d" % i, deliver_at_ms=due) for i in range(100)])
    assert len(receipts) == 100
    seqs = [r.sequence for r in receipts]
    assert seqs == sorted(seqs) and len(set(seqs)) == 100
    # SendStream: several batches pipelined on one stream, one response per request, in order
    batches = [
        pb.SendBatchRequest(
            messages=[pb.Message(subject=s, payload=b"s%d-%d" % (k, i), delay_ms=300) for i in range(50)]
        )
        for k in range(4)
    ]
    stub = pb_grpc.DelayServiceStub(client.channel)
    responses = list(stub.SendStream(iter(batches), timeout=20))
    assert [len(r.receipts) for r in responses] == [50] * 4
    stream_seqs = [rc.sequence for r in responses for rc in r.receipts]
    assert stream_seqs == sorted(stream_seqs)
    many = client.send_many((client.message(s, b"m", delay_ms=300) for _ in range(2500)), batch_size=400)
    assert len(many) == 2500
    expected = (
        {r.message_id for r in receipts}
        | {rc.message_id for r in responses for rc in r.receipts}
        | {r.message_id for r in many}
    )
    with client.subscribe(s, max_in_flight=5000) as consumer:
        seen = set()
        deadline = time.monotonic() + 20
        while len(seen) < len(expected) and time.monotonic() < deadline:
            got = consumer.receive(len(expected) - len(seen), timeout=1)
            seen |= {d.message_id for d in got}
            consumer.ack(got)
        assert seen == expected


def test_stream_stops_at_first_bad_batch(client):
    s = subject()
    good = pb.SendBatchRequest(messages=[pb.Message(subject=s, payload=b"x", delay_ms=100)])
    bad = pb.SendBatchRequest(messages=[pb.Message(subject=s, payload=b"x")])  # no due time
    stub = pb_grpc.DelayServiceStub(client.channel)
    call = stub.SendStream(iter([good, bad, good]), timeout=10)
    got = []
    with pytest.raises(grpc.RpcError) as info:
        for resp in call:
            got.append(resp)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(got) == 1
    with client.subscribe(s) as consumer:
        delivered = consumer.receive(5, timeout=1.5)
        consumer.ack(delivered)
        assert len({d.message_id for d in delivered}) == 1  # only the batch before the bad one


def test_cancel_before_due_never_delivered_and_after_delivery(client):
    s = subject()
    keep = client.send(s, b"keep", delay_ms=500)
    drop = client.send(s, b"drop", delay_ms=500)
    assert client.cancel(drop) == "CANCELLED"
    assert client.cancel(drop) == "ALREADY_CANCELLED"
    assert client.state_name(client.get(drop)) == "CANCELLED"
    with client.subscribe(s) as consumer:
        got = consumer.receive(1, timeout=5)
        consumer.ack(got)
        got += consumer.receive(1, timeout=1.5)
        consumer.ack(got)
        assert {d.message_id for d in got} == {keep.message_id}
    wait_until(lambda: client.state_name(client.get(keep)) == "DELIVERED", what="the ack applied")
    assert client.cancel(keep) == "ALREADY_DELIVERED"


def test_get_states(client):
    s = subject()
    r = client.send(s, b"payload", delay_ms=300, headers={"a": "b"})
    st = client.get(r)
    assert client.state_name(st) == "PENDING"
    assert st.payload == b"payload" and st.subject == s and st.headers == {"a": "b"}
    assert st.deliver_at_ms == r.deliver_at_ms
    with client.subscribe(s) as consumer:
        got = consumer.receive(1, timeout=5)
        consumer.ack(got)
        wait_until(lambda: client.state_name(client.get(r)) == "DELIVERED", what="the ack applied")
    st = client.get(r)
    assert client.state_name(st) == "DELIVERED"
    assert st.delivered_at_ms >= r.deliver_at_ms
    bogus = pb.Receipt(message_id="nope", deliver_at_ms=r.deliver_at_ms, sequence=r.sequence)
    assert client.state_name(client.get(bogus)) == "NOT_FOUND"
    assert client.cancel(bogus) == "NOT_FOUND"
    assert client.state_name(client.get(pb.Receipt(message_id="x", deliver_at_ms=1, sequence=10**12))) == "NOT_FOUND"


def test_redelivery_after_no_ack(client):
    s = subject()
    r = client.send(s, b"again", delay_ms=0)
    with client.subscribe(s) as consumer:
        first = consumer.receive(1, timeout=5)
        assert [d.attempt for d in first] == [1]
        second = consumer.receive(1, timeout=ACK_TIMEOUT_MS / 1000 + 5)
        assert [(d.message_id, d.attempt) for d in second] == [(r.message_id, 2)]
        assert second[0].ack_id != first[0].ack_id
        consumer.ack(second)
        assert consumer.receive(1, timeout=ACK_TIMEOUT_MS / 1000 + 1) == []


def test_redelivered_to_another_consumer_when_one_leaves(client):
    s = subject()
    r = client.send(s, b"x", delay_ms=0)
    a = client.subscribe(s)
    got = a.receive(1, timeout=5)
    assert len(got) == 1
    a.close()
    with client.subscribe(s) as b:
        again = b.receive(1, timeout=ACK_TIMEOUT_MS / 1000 + 5)
        assert [(d.message_id, d.attempt) for d in again] == [(r.message_id, 2)]
        b.ack(again)


def test_two_consumers_share_the_load(client):
    s = subject()
    a = client.subscribe(s, group="workers", max_in_flight=200)
    b = client.subscribe(s, group="workers", max_in_flight=200)
    try:
        wait_until(lambda: group(client, s, "workers").get("consumers") == 2, what="both streams open")
        client.send_many((client.message(s, b"w", delay_ms=200) for _ in range(3000)), batch_size=500)
        counts = {"a": set(), "b": set()}
        deadline = time.monotonic() + 20
        while len(counts["a"] | counts["b"]) < 3000 and time.monotonic() < deadline:
            for name, cons in (("a", a), ("b", b)):
                got = cons.receive(1, timeout=0.05)
                counts[name] |= {d.message_id for d in got}
                cons.ack(got)
        assert len(counts["a"] | counts["b"]) == 3000
        assert len(counts["a"]) > 300 and len(counts["b"]) > 300, {k: len(v) for k, v in counts.items()}
    finally:
        a.close()
        b.close()


def test_late_subscriber_gets_what_became_due(client):
    s = subject()
    receipts = client.send_batch([client.message(s, b"%d" % i, delay_ms=100) for i in range(50)])
    last_due = max(r.deliver_at_ms for r in receipts)
    wait_until(lambda: now_ms() > last_due + 100, what="the messages due")  # nobody subscribed meanwhile
    with client.subscribe(s) as consumer:
        got = consumer.receive(50, timeout=5)
        assert {d.message_id for d in got} == {r.message_id for r in receipts}
        assert all(d.attempt == 1 for d in got)
        consumer.ack(got)


def _bad_inputs(s):
    big = 4 * 1024 * 1024
    return {
        "subject empty": pb.Message(subject="", delay_ms=0),
        "subject chars": pb.Message(subject="a b", delay_ms=0),
        "subject long": pb.Message(subject="a" * 256, delay_ms=0),
        "payload": pb.Message(subject=s, payload=b"x" * (big + 1), delay_ms=0),
        "headers count": pb.Message(subject=s, headers={f"k{i}": "v" for i in range(65)}, delay_ms=0),
        "header key": pb.Message(subject=s, headers={"k" * 129: "v"}, delay_ms=0),
        "headers size": pb.Message(subject=s, headers={"k": "v" * 16384}, delay_ms=0),
        "message_id long": pb.Message(subject=s, message_id="m" * 129, delay_ms=0),
        "message_id chars": pb.Message(subject=s, message_id="m\u00e9", delay_ms=0),
        "no due time": pb.Message(subject=s),
        "delay too far": pb.Message(subject=s, delay_ms=2 * 365 * 86400 * 1000 + 1),
        "deliver_at too far": pb.Message(subject=s, deliver_at_ms=now_ms() + 2 * 365 * 86400 * 1000 + 60_000),
        "delay overflow": pb.Message(subject=s, delay_ms=2**63 - 1),
    }


def test_bad_inputs_refused_whole_and_nothing_delivered(client):
    s = subject()
    stub = pb_grpc.DelayServiceStub(client.channel)
    pending_before = client.stats()["pending"]
    for name, bad in _bad_inputs(s).items():
        good = pb.Message(subject=s, payload=b"good", delay_ms=0)
        with pytest.raises(grpc.RpcError) as info:
            stub.SendBatch(pb.SendBatchRequest(messages=[good, bad]), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert "messages[1]" in info.value.details(), (name, info.value.details())
        with pytest.raises(errors.InvalidArgument):
            client.send_batch([bad])
        with pytest.raises(grpc.RpcError) as info:
            stub.Send(pb.SendRequest(message=bad), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
    with pytest.raises(errors.InvalidArgument, match="empty batch"):
        client.send_batch([])
    with pytest.raises(errors.InvalidArgument, match="limit 10000"):
        client.send_batch([client.message(s, delay_ms=0) for _ in range(10_001)])
    with pytest.raises(errors.InvalidArgument, match="message: required"):
        client._call(stub.Send, pb.SendRequest(), 5)
    with pytest.raises(errors.InvalidArgument, match="receipt"):
        client._call(stub.Cancel, pb.CancelRequest(), 5)
    with client.subscribe(s) as consumer:
        assert consumer.receive(1, timeout=1.5) == []
    assert client.stats()["pending"] == pending_before


def test_errors_a_new_user_meets_name_the_field_and_its_unit_in_words(client):
    """What a user who breaks a limit reads: INVALID_ARGUMENT, the field, the figure with its
    unit in words and the limit's config key. A SendBatch over the limit said only
    'messages: 10001 in one batch, limit 10000' (10001 what? which setting?)."""
    s = subject()
    stub = pb_grpc.DelayServiceStub(client.channel)
    cases = {
        "batch over the limit": (
            lambda: stub.SendBatch(pb.SendBatchRequest(messages=[pb.Message(subject=s, delay_ms=0)] * 10_001)),
            "messages: 10001 messages in one batch, limit 10000 messages (limits.max_batch)",
        ),
        "cancel batch over the limit": (
            lambda: stub.CancelBatch(pb.CancelBatchRequest(requests=[pb.CancelRequest(message_id="m")] * 10_001)),
            "requests: 10001 cancel requests in one batch, limit 10000 requests (limits.max_batch)",
        ),
        "an empty receipt": (
            lambda: stub.Cancel(pb.CancelRequest(receipt=pb.Receipt())),
            "receipt.message_id: required",
        ),
        "no receipt": (
            lambda: stub.Get(pb.GetRequest()),
            "receipt or message_id: required",
        ),
        "a delay beyond 2 years": (
            lambda: stub.Send(pb.SendRequest(message=pb.Message(subject=s, delay_ms=3 * 365 * 86_400_000))),
            "message.delay_ms: 94608000000 ms (3 years) is beyond the limit of 2 years (max_delay_ms=63072000000)",
        ),
    }
    for name, (call, want) in cases.items():
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert want in info.value.details(), (name, info.value.details())


def test_an_int_delay_is_refused_not_taken_as_milliseconds(client):
    """``send(..., delay=30)`` meant as 30 seconds was taken as 30 ms: the message fell due at
    once. ``delay`` takes a timedelta; ms go as ``delay_ms``. Nothing is written."""
    s = subject()
    with pytest.raises(
        errors.InvalidArgument, match=r"^delay: a datetime.timedelta, not int \(for milliseconds use delay_ms=30\)"
    ):
        client.send(s, b"x", delay=30)
    r = client.send(s, b"x", delay=timedelta(seconds=30))
    assert r.deliver_at_ms >= now_ms() + 25_000
    with pytest.raises(errors.InvalidArgument, match=r"^delay: a datetime.timedelta"):
        client.reschedule(r, delay=60)
    assert client.get(r).deliver_at_ms == r.deliver_at_ms  # not moved
    assert client.cancel(r) == "CANCELLED"
    assert client.get(message_id=r.message_id).state == "CANCELLED"  # the one message of the subject


def test_a_second_server_on_a_folder_in_use_is_refused_before_recovery(server, client):
    """A second ``qdelay server`` on the folder a running one writes (a unit started twice,
    a copied command line) ran recovery on it first: it cut the running server's
    preallocated message-log tail, then died in a RocksDB "While lock file" traceback (or,
    with ``engine.id_index = false``, served the same log as a second master). The folder's
    lock (segments/folder_lock.py) refuses it first: exit 1, one line naming the folder and
    the holder, and no byte of the running server's files changes."""
    import subprocess
    import sys

    client.send("lock.check", b"x", delay_ms=600_000)
    wal_dir = server.data_dir / "message"
    before = {p.name: p.read_bytes() for p in wal_dir.iterdir()}
    proc = subprocess.run(
        [sys.executable, "-m", "qdelay.cli", "server", "--data-dir", str(server.data_dir), "--listen", "127.0.0.1:0"]
        + ["--set", "engine.id_index=false"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "qdelay listening" not in proc.stdout, (proc.stdout, proc.stderr)
    want = f"qdelay server: data folder {server.data_dir} is in use by another process (pid {server.proc.pid}, "
    assert want in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert {p.name: p.read_bytes() for p in wal_dir.iterdir()} == before
    assert client.send("lock.check", b"y", delay_ms=600_000).sequence > 0  # the running one is unharmed


def test_a_corrupt_message_log_refuses_to_open_saying_what_to_do(tmp_path):
    """A flipped byte inside the message log: the server refuses to open it (corruption =
    fail, docs/recovery.md row 3), and said only "corrupt record in F at offset N: checksum
    mismatch", leaving the operator to find the setting docs/recovery.md names. The line now
    says the two ways on; the second one, as written there, opens the folder."""
    import subprocess
    import sys

    import byte_surgery
    from serverproc import ServerProc

    data = tmp_path / "data"
    with ServerProc(data) as srv, srv.client() as c:
        c.send_many(c.message("rot.s", b"x" * 100, delay_ms=600_000) for _ in range(20))
    (wal,) = (data / "message").iterdir()
    byte_surgery.flip_byte(str(wal), 1000)
    cp = subprocess.run(
        [sys.executable, "-m", "qdelay.cli", "server", "--data-dir", str(data), "--listen", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cp.returncode == 1 and "qdelay listening" not in cp.stdout, cp.stdout
    line = cp.stderr.splitlines()[-1]
    assert line.startswith(f"qdelay server: corrupt record in {wal} at offset "), line
    assert "restore the file from a replica, or start with --set engine.corruption=truncate to cut it at " in line
    with ServerProc(data, args=["--set", "engine.corruption=truncate"]) as srv, srv.client() as c:
        assert c.send("rot.s", b"after", delay_ms=600_000).sequence > 0
    assert (data / "message" / (wal.name + ".broken")).exists()


def test_an_address_in_use_is_said_in_words_not_a_traceback(server, tmp_path):
    """A second server on a port already taken (a second `make run`) printed grpcio's
    RuntimeError traceback; a metrics port taken printed '[Errno 98] Address already in use'
    without the address. Both now exit 1 with 'qdelay server: cannot ... on HOST:PORT: ...'."""
    import subprocess
    import sys

    metrics_port = int(server.log_path.read_text().split("metrics on 127.0.0.1:")[1].split()[0])
    for args, want in (
        (["--listen", server.address], f"qdelay server: cannot listen on {server.address}: the address is in use"),
        (
            ["--listen", "127.0.0.1:0", "--metrics-listen", f"127.0.0.1:{metrics_port}"],
            f"qdelay server: cannot serve metrics on 127.0.0.1:{metrics_port}: Address already in use",
        ),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "qdelay.cli", "server", "--data-dir", str(tmp_path / "second"), *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 1 and "qdelay listening" not in proc.stdout, proc.stdout
        assert "Traceback" not in proc.stderr and want in proc.stderr, proc.stderr


def test_max_payload_accepted(client):
    s = subject()
    payload = bytes(range(256)) * (4 * 1024 * 1024 // 256)
    r = client.send(s, payload, delay_ms=0)
    with client.subscribe(s) as consumer:
        got = consumer.receive(1, timeout=10)
        assert [d.payload == payload for d in got] == [True]
        consumer.ack(got)
    assert r.message_id


def test_bad_subscribe_refused(client):
    with client.subscribe("bad subject") as consumer:
        with pytest.raises(errors.InvalidArgument, match="subject"):
            consumer.receive(1, timeout=5)


def test_overload_gives_resource_exhausted(tmp_path):
    with ServerProc(tmp_path / "data", args=["--ingest-queue-messages", "10"]) as srv:
        c = srv.client(retries=0)
        s = subject()

        def one(_):
            try:
                c.send_batch([c.message(s, b"x" * 1000, delay_ms=60_000) for _ in range(10)])
                return "ok"
            except errors.ResourceExhausted as e:
                assert "ingest queue full" in str(e)
                return "full"

        with ThreadPoolExecutor(32) as pool:
            outcomes = list(pool.map(one, range(400)))
        assert "ok" in outcomes and "full" in outcomes, outcomes.count("ok")
        c.close()


def test_free_space_guard(tmp_path):
    data = tmp_path / "data"
    with ServerProc(data) as srv:
        c = srv.client()
        s = subject()
        due_soon = c.send(s, b"soon", delay_ms=1500)
        later = c.send(s, b"later", delay_ms=60_000)
        c.close()
    with ServerProc(data, args=["--min-free-bytes", str(1 << 62)]) as srv:
        c = srv.client(retries=0)
        with pytest.raises(errors.ResourceExhausted, match="free space") as info:
            c.send(s, b"refused", delay_ms=0)
        # the way out it names is the right one (it said "raise the limit" of a floor)
        assert str(info.value).endswith("needed for new messages; free some space, or lower min_free_bytes")
        assert c.cancel(later) == "CANCELLED"  # cancels pass the soft guard
        with c.subscribe(s) as consumer:  # delivery goes on
            got = consumer.receive(2, timeout=5)
            assert [d.message_id for d in got] == [due_soon.message_id]
            consumer.ack(got)
        c.close()


def test_health_reflection_stats_metrics(server, client):
    assert client.health() == "SERVING"
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    resp = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
    names = {s.name for s in resp.list_services_response.service}
    assert {"qdelay.v1.DelayService", "grpc.health.v1.Health"} <= names
    st = client.stats()
    assert st["role"] == "master" and st["replication_lag_bytes"] == -1
    log = server.log_path.read_text()
    port = int(log.split("metrics on 127.0.0.1:")[1].split()[0])
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for name in (
        "qdelay_ingested_messages_total",
        "qdelay_wal_fsync_seconds_bucket",
        "qdelay_iterate_lag_bytes",
        "qdelay_wheel_size",
        "qdelay_pending_messages",
        "qdelay_dispatch_lateness_seconds_bucket",
        "qdelay_redeliveries_total",
        "qdelay_dead_lettered_total",
        "qdelay_groups",
        "qdelay_group_backlog",
        "qdelay_group_in_flight",
        "qdelay_due_without_consumer",
    ):
        assert name in text, name


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_the_metrics_endpoint_closes_at_once_after_a_scrape():
    """Every stop of a server with --metrics-listen took 0.25-0.5 s more, on the event loop:
    prometheus_client's start_http_server serves with socketserver's 0.5 s poll, and its
    shutdown() waits for the poll to end. Right after a scrape the poll has just begun, so
    close() took ~0.5 s every time; the endpoint now polls every HTTP_POLL_S (0.05 s)."""
    from qdelay.server.metrics import Metrics

    m = Metrics()
    port = m.serve("127.0.0.1", 0)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert b"qdelay_ingested_messages_total" in r.read()
    t0 = time.perf_counter()
    m.close()
    took = time.perf_counter() - t0
    assert took < 0.25, took
    m.close()  # again: nothing to do
    # and the port is free again
    again = Metrics()
    assert again.serve("127.0.0.1", port) == port
    again.close()


def test_every_metric_the_docs_name_is_exported_by_that_name(server, client):
    """An alert written from docs/api.md or docs/operations.md must match a series: the docs
    named counters without the `_total` prometheus_client gives them (an alert on
    `qdelay_disk_full_waits` never fires; the series is `qdelay_disk_full_waits_total`). A
    standalone server exports most; the cluster and slave ones are checked against the
    names the collector gives them (server/metrics.py ENGINE_STATS)."""
    import re
    from pathlib import Path

    from prometheus_client.parser import text_string_to_metric_families

    from qdelay.server.metrics import ENGINE_STATS

    assert client.create_group(subject(), "g")  # the per-group gauges are there once a group is
    port = int(server.log_path.read_text().split("metrics on 127.0.0.1:")[1].split()[0])
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    exported = set()
    for family in text_string_to_metric_families(text):
        exported.update(sample.name for sample in family.samples)
        # a histogram by its base name; a labelled counter with no sample yet by its series
        exported.add(family.name + ("_total" if family.type == "counter" else ""))
    exported.update(name + ("_total" if kind == "counter" else "") for name, _text, kind in ENGINE_STATS.values())
    docs = Path(__file__).resolve().parent.parent / "docs"
    named = {
        (doc, m)
        for doc in ("api.md", "operations.md")
        for m in re.findall(r"qdelay_[a-z0-9_]+", (docs / doc).read_text())
    }
    assert len(named) > 30
    missing = sorted((doc, m) for doc, m in named if m not in exported)
    assert missing == [], missing


def test_group_gauges_and_the_dead_letter_counter_have_the_right_values(tmp_path):
    """Per-group backlog and in-flight gauges, the groups/due without a consumer, and the
    dead-letter counter, read back for groups in a known state (docs/api.md, metrics)."""
    args = ["--set", "engine.max_attempts=1", "--metrics-listen", "127.0.0.1:0"]
    with ServerProc(tmp_path / "data", args=args) as srv:
        port = int(srv.log_path.read_text().split("metrics on 127.0.0.1:")[1].split()[0])
        c = srv.client(timeout=20)
        s = subject()
        assert c.create_group(s, "busy") and c.create_group(s, "idle")
        c.send_batch([c.message(s, b"m", delay_ms=0) for _ in range(5)])

        def gauges() -> dict[str, float]:
            m = scrape(port)
            out = {
                f"{name}:{g}": m.get((name, (("group", g), ("subject", s))), -1.0)
                for name in ("qdelay_group_backlog", "qdelay_group_in_flight")
                for g in ("busy", "idle")
            }
            for name in ("qdelay_due_without_consumer", "qdelay_groups_without_consumer", "qdelay_groups"):
                out[name] = m[(name, ())]
            out["dead_lettered"] = m[("qdelay_dead_lettered_total", ())]
            return out

        consumer = c.subscribe(s, group="busy", max_in_flight=3)  # credit for 3 of the 5
        got = consumer.receive(3, timeout=10)
        assert len(got) == 3
        want = {
            "qdelay_group_backlog:busy": 2,  # due, waiting for credit
            "qdelay_group_in_flight:busy": 3,
            "qdelay_group_backlog:idle": 5,  # no consumer: all of it waits
            "qdelay_group_in_flight:idle": 0,
            "qdelay_due_without_consumer": 5,
            "qdelay_groups_without_consumer": 1,
            "qdelay_groups": 2,
            "dead_lettered": 0,
        }
        assert wait_until(lambda: gauges() == want, timeout=10, what=f"metrics {want}")
        # the stream ends with its 3 unacknowledged: handed back, and with max_attempts = 1
        # moved to DLQ.<subject>; the other 2 of the 5 were handed to nobody and stay due
        consumer.close()
        want.update(
            {
                "qdelay_group_in_flight:busy": 0,
                "qdelay_due_without_consumer": 7,
                "qdelay_groups_without_consumer": 2,
                "dead_lettered": 3,
            }
        )
        assert wait_until(lambda: gauges() == want, timeout=10, what=f"metrics {want}")
        c.close()


def test_sigterm_clean_exit_and_restart_keeps_pending(tmp_path):
    data = tmp_path / "data"
    srv = ServerProc(data).start()
    c = srv.client()
    s = subject()
    r = c.send(s, b"survives", delay_ms=1500)
    c.close()
    assert srv.stop() == 0
    assert "stopped" in srv.tail_log()
    srv.start()
    try:
        c = srv.client()
        assert c.state_name(c.get(r)) == "PENDING"
        with c.subscribe(s) as consumer:
            got = consumer.receive(1, timeout=10)
            assert [d.message_id for d in got] == [r.message_id]
            consumer.ack(got)
        c.close()
    finally:
        assert srv.stop() == 0


def test_slave_refuses_writes(tmp_path):
    with ServerProc(tmp_path / "data", args=["--role", "slave", "--master", "127.0.0.1:9"]) as srv:
        c = srv.client(retries=0)
        with pytest.raises(errors.FailedPrecondition):
            c.send("a.b", b"x", delay_ms=0)
        assert c.stats()["role"] == "slave"
        c.close()
        # the example pointed at a slave (the runbook's B after a failover left it as is)
        # printed a FailedPrecondition traceback; it says in a line to use the master
        import os
        import subprocess
        import sys

        path = os.path.join(
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "python", "example.py"
        )
        cp = subprocess.run([sys.executable, path, srv.address], capture_output=True, text=True, timeout=60)
        assert cp.returncode == 1 and "Traceback" not in cp.stderr, cp.stderr
        lines = cp.stderr.splitlines()
        assert len(lines) == 1 and f"the server at {srv.address} takes no writes" in lines[0], lines
        assert "the master" in lines[0], lines[0]


def test_python_example_runs(server):
    import os
    import subprocess
    import sys

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "python", "example.py")
    result = subprocess.run([sys.executable, path, server.address], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "received 1001 messages; cancelled one delivered: False" in result.stdout


def test_python_example_with_no_server_says_so_in_a_line():
    """examples/python/example.py run before the server (or at a wrong address) printed an
    Unavailable traceback; it says in one line that nothing answers there and exits 1."""
    import os
    import subprocess
    import sys

    from ports import free_port

    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "python", "example.py")
    cp = subprocess.run([sys.executable, path, address], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 1 and cp.stdout == "", cp.stdout + cp.stderr
    lines = cp.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in cp.stderr, cp.stderr
    assert f"no qdelay server answers at {address}" in lines[0] and "make run" in lines[0], lines[0]


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs, so that ENOSPC is real."""
    with small_tmpfs(tmp_path, "16m") as mount_point:
        yield mount_point


def test_disk_full_refused_then_recovers(small_disk):
    import os

    args = ["--min-free-bytes", "0", "--set", "min_free_bytes_hard=0", "--set", "engine.segment_bytes=1048576"]
    with ServerProc(small_disk / "data", args=args) as srv:
        c = srv.client(retries=0)
        s = subject()
        first = c.send_batch([c.message(s, b"a" * 1000, delay_ms=0) for _ in range(10)])
        filler = fill_disk(small_disk, 65536)
        # the message log's preallocated zeros (1 MiB ahead of its last record) are
        # written into first; then every batch is refused
        taken = []
        with pytest.raises(errors.ResourceExhausted):
            for _ in range(20):
                taken += c.send_batch([c.message(s, b"b" * 1000, delay_ms=0) for _ in range(200)])
        assert len(taken) <= 1000
        for _ in range(2):
            with pytest.raises(errors.ResourceExhausted):
                c.send_batch([c.message(s, b"b" * 1000, delay_ms=0) for _ in range(200)])
        os.unlink(filler)
        second = c.send_batch([c.message(s, b"c" * 1000, delay_ms=0) for _ in range(10)])
        expected = {r.message_id for r in first + taken + second}
        with c.subscribe(s) as consumer:
            seen = set()
            deadline = time.monotonic() + 10
            while not expected <= seen and time.monotonic() < deadline:
                got = consumer.receive(500, timeout=1)
                seen |= {d.message_id for d in got}
                consumer.ack(got)
        assert seen == expected  # nothing of the refused batches, everything acknowledged
        c.close()
    assert srv.proc.returncode == 0


def test_acks_while_the_disk_is_full_are_recorded_once_space_is_freed(small_disk):
    """The dispatch log cannot take the acks' records while the disk is full: the server
    keeps them, stays healthy, and writes them when space is back, so a restart delivers
    none of those messages again."""
    import os

    args = ["--min-free-bytes", "0", "--set", "min_free_bytes_hard=0"]
    with ServerProc(small_disk / "data", args=args + ["--metrics-listen", "127.0.0.1:0"]) as srv:
        c = srv.client(retries=0)
        s = subject()
        sent = c.send_batch([c.message(s, b"a" * 100, delay_ms=0) for _ in range(20)])
        port = int(srv.log_path.read_text().split("metrics on 127.0.0.1:")[1].split()[0])
        filler = fill_disk(small_disk, 65536)
        with c.subscribe(s) as consumer:
            seen = []
            deadline = time.monotonic() + 10
            while len(seen) < 20 and time.monotonic() < deadline:
                got = consumer.receive(50, timeout=1)
                seen += got
                consumer.ack(got)
            assert sorted(d.message_id for d in seen) == sorted(r.message_id for r in sent)
            # the dispatch log's writes fail and are kept for later
            wait_until(lambda: "DISPATCH records wait for free space" in srv.tail_log(100_000), what="a full disk")
            assert c.health() == "SERVING"
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            waits = [
                float(line.split()[1]) for line in text.splitlines() if line.startswith("qdelay_disk_full_waits_total ")
            ]
            assert waits and waits[0] > 0, "the retries show in the metrics"
            os.unlink(filler)
            wait_until(lambda: "DISPATCH records written again" in srv.tail_log(100_000), what="the kept records")
        c.close()
    assert srv.proc.returncode == 0
    with ServerProc(small_disk / "data", args=args) as again:
        c = again.client(retries=0)
        with c.subscribe(s) as consumer:
            assert consumer.receive(50, timeout=2) == []  # every ack reached the dispatch log
        c.close()


def test_client_retries_unavailable_then_raises_it():
    import socket

    from qdelay.client import Client

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    c = Client(f"127.0.0.1:{port}", retries=2, retry_backoff=0.01, timeout=2)
    started = time.monotonic()
    with pytest.raises(errors.Unavailable) as info:
        c.send("a.b", b"x", delay_ms=0)
    assert info.value.attempts == 3 and info.value.code == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - started < 10
    with pytest.raises(errors.Unavailable):
        c.send_many([c.message("a.b", b"x", delay_ms=0)])
    c.close()


def test_client_never_retries_invalid_and_send_many_reports_progress(client):
    s = subject()
    msgs = [client.message(s, b"ok", delay_ms=60_000) for _ in range(250)]
    msgs.append(pb.Message(subject="bad subject", delay_ms=0))
    with pytest.raises(errors.InvalidArgument) as info:
        client.send_many(msgs, batch_size=100, max_in_flight=1)
    assert info.value.attempts == 1
    assert len(info.value.receipts) == 200  # the two batches before the refused one
    assert [r.message_id for r in info.value.receipts] == [m.message_id for m in msgs[:200]]


def test_send_many_of_outgoing_tuples(client):
    """The bulk path's own encoding: what Get gives back is what was sent (both kinds of due
    time, headers, ids given or made); a tuple that cannot be encoded stops the call after
    the batches before it were answered, and nothing of its batch is written."""
    from qdelay.client import Outgoing

    s = subject()
    at = now_ms() + 3_600_000
    msgs = [
        Outgoing(s, b"p%d" % i, deliver_at_ms=at + i)
        if i % 2
        else Outgoing(s, b"p%d" % i, delay_ms=3_600_000, message_id=f"given-{i}", headers={"k": str(i)})
        for i in range(30)
    ]
    receipts = client.send_many(msgs, batch_size=7, max_in_flight=2)
    assert len(receipts) == 30 and [r.message_id for r in receipts][0::2] == [f"given-{i}" for i in range(0, 30, 2)]
    for i in (0, 1, 28, 29):
        got = client.get(receipts[i])
        assert client.state_name(got) == "PENDING" and got.payload == b"p%d" % i
        assert got.headers == ({} if i % 2 else {"k": str(i)})
        if i % 2:
            assert got.deliver_at_ms == at + i == receipts[i].deliver_at_ms
    bad = msgs[:14] + [Outgoing(s, "not bytes", delay_ms=0)] + msgs[:5]
    with pytest.raises(errors.InvalidArgument, match="Outgoing") as info:
        client.send_many(bad, batch_size=7, max_in_flight=1)
    assert len(info.value.receipts) == 14  # the two batches before the one holding it


def test_send_many_opens_a_new_stream_every_half_timeout_and_keeps_order(server):
    """send_many ends its stream after timeout/2 and goes on with a new one: receipts stay
    complete, in input order, with increasing sequences."""
    from qdelay.client import Client

    # each stream ends after timeout/2, so the last batch of a stream has timeout/2 to be
    # answered: 0.4 s was missed at load 25, 0.5 s at load 10 (a full suite beside 4 others)
    c = Client(server.address, timeout=2.0)
    s = subject()
    calls = []
    real = c._stream_batches  # one call per SendStream opened

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    c._stream_batches = counting

    def slow():  # ~4.5 s of messages: several streams of 1 s each
        for i in range(300):
            if i % 10 == 0:
                time.sleep(0.15)
            yield c.message(s, b"x", delay_ms=60_000, message_id=f"order-{i}")

    receipts = c.send_many(slow(), batch_size=10, max_in_flight=3)
    assert [r.message_id for r in receipts] == [f"order-{i}" for i in range(300)]
    seqs = [r.sequence for r in receipts]
    assert seqs == sorted(seqs) and len(set(seqs)) == 300
    assert len(calls) >= 3
    c.close()


def test_compact_receipts(client):
    """compact_receipts: first_sequence + packed due times; ids are required."""
    s = subject()
    stub = pb_grpc.DelayServiceStub(client.channel)
    due = now_ms() + 60_000
    msgs = [pb.Message(subject=s, payload=b"c", message_id=f"cr-{i}", deliver_at_ms=due + i) for i in range(5)]
    resp = stub.SendBatch(pb.SendBatchRequest(messages=msgs, compact_receipts=True), timeout=10)
    assert len(resp.receipts) == 0 and list(resp.deliver_at_ms) == [due + i for i in range(5)]
    last = client.get(("cr-4", due + 4, resp.first_sequence + 4))
    assert client.state_name(last) == "PENDING" and last.message_id == "cr-4"
    before = client.stats()["pending"]
    bad = msgs[:2] + [pb.Message(subject=s, payload=b"c", delay_ms=10)]
    with pytest.raises(grpc.RpcError) as info:
        stub.SendBatch(pb.SendBatchRequest(messages=bad, compact_receipts=True), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages[2].message_id: required with compact_receipts" in info.value.details()
    assert client.stats()["pending"] == before  # nothing written
