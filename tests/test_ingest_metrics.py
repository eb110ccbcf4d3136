"""The ingest path's metrics, counted in plain numbers on the event loop (IngestCounts), are
exposed exactly as prometheus-client's Counter and Histogram exposed them before: names,
help, types, buckets and values; and a real server counts what it accepted."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from qdelay.server.metrics import LATENCY_BUCKETS, IngestCounts, Metrics
from qdelay.v1 import qdelay_pb2 as pb

# latencies on, between and beyond the bounds (le: a value equal to a bound is in its bucket)
SECONDS = [0.0, 0.00005, 0.0001, 0.00011, 0.00025, 0.0007, 0.001, 0.0015, 0.002, 0.05, 0.3, 2.5, 4.9, 5.0, 7.0, 120.0]


def reference(writes: list[tuple[int, int, float]]) -> CollectorRegistry:
    """The metrics as prometheus-client's own objects, fed the same writes."""
    r = CollectorRegistry()
    ingested = Counter("qdelay_ingested_messages", "Messages durably accepted (rate = ingest rate)", registry=r)
    size = Counter("qdelay_ingested_payload_bytes", "Payload bytes durably accepted", registry=r)
    seconds = Histogram(
        "qdelay_send_seconds", "Send/SendBatch latency until durable", buckets=LATENCY_BUCKETS, registry=r
    )
    for count, nbytes, s in writes:
        seconds.observe(s)
        ingested.inc(count)
        size.inc(nbytes)
    return r


def ours(writes: list[tuple[int, int, float]]) -> CollectorRegistry:
    r = CollectorRegistry(auto_describe=True)
    counts = IngestCounts(LATENCY_BUCKETS)
    r.register(counts)
    for count, nbytes, s in writes:
        counts.add(count, nbytes, s)
    return r


def without_created(text: str) -> list[str]:
    """The exposition's lines, with each ``_created`` sample's value (a clock reading) cut."""
    return [line.rsplit(" ", 1)[0] if "_created" in line.split(" ", 1)[0] else line for line in text.splitlines()]


@pytest.mark.parametrize("writes", [[], [(100, 10_000, s) for s in SECONDS], [(1, 7, 0.0003)] * 5 + [(3, 0, 9.0)]])
def test_the_same_exposition_as_prometheus_client(writes):
    for generate in (generate_latest, generate_openmetrics):
        want = without_created(generate(reference(writes)).decode())
        got = without_created(generate(ours(writes)).decode())
        assert sorted(got) == sorted(want)
        assert any("qdelay_send_seconds_created" in line for line in got)
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(ours(writes)).decode())}
    assert families["qdelay_ingested_messages"].type == "counter"
    assert families["qdelay_send_seconds"].type == "histogram"


def test_the_names_are_registered_once():
    """describe() names the series, so a second collector of one of them is refused."""
    m = Metrics()
    with pytest.raises(ValueError, match="qdelay_ingested_messages"):
        Counter("qdelay_ingested_messages", "again", registry=m.registry)


def test_a_server_counts_what_it_accepted(tmp_path):
    from serverproc import ServerProc

    with ServerProc(tmp_path / "s", args=["--metrics-listen", "127.0.0.1:0"]) as srv:
        c = srv.client()
        c.send_batch([pb.Message(subject="s", payload=p, delay_ms=60_000) for p in (b"abc", b"defgh")])
        c.send("s", b"x" * 10, delay_ms=60_000)
        port = int(srv.tail_log(100_000).split("metrics on 127.0.0.1:")[1].split()[0])
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }
        c.close()
    assert samples[("qdelay_ingested_messages_total", ())] == 3
    assert samples[("qdelay_ingested_payload_bytes_total", ())] == 18
    assert samples[("qdelay_send_seconds_count", ())] == 2
    assert samples[("qdelay_send_seconds_bucket", (("le", "+Inf"),))] == 2
    assert 0 < samples[("qdelay_send_seconds_sum", ())] < 60
