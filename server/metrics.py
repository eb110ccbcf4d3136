"""Prometheus metrics of a server (prometheus-client), on their own registry.

Counters and histograms are updated by the service and the consumer registry; the ingest
path's (messages, payload bytes, send latency) are plain numbers the event loop adds to
once a batch (IngestCounts), exposed at scrape time; gauges that the engine owns (pending,
wheel size, iterate lag, in flight, redeliveries ...) are read from ``engine.stats()`` at
scrape time by a custom collector, so they cost nothing between scrapes.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import socket
import threading
import time
from collections.abc import Sequence
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

log = logging.getLogger("qdelay.metrics")

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LATENESS_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# engine.stats() key -> (metric name, help, kind)
ENGINE_STATS = {
    "pending": ("qdelay_pending_messages", "Scheduled messages not yet delivered or cancelled", "gauge"),
    "wheel_size": ("qdelay_wheel_size", "Message indexes loaded in the in-memory timer wheel", "gauge"),
    "iterate_lag_bytes": ("qdelay_iterate_lag_bytes", "Message-log bytes not yet copied to the schedule log", "gauge"),
    "iterate_steps": (
        "qdelay_iterate_steps",
        "Steps of the iterate service (each copies what the message log committed since the last)",
        "counter",
    ),
    "iterate_lag_records": ("qdelay_iterate_lag_records", "Message-log records not yet in the schedule log", "gauge"),
    "in_flight": ("qdelay_in_flight_deliveries", "Deliveries handed to consumers and not yet acknowledged", "gauge"),
    "retrying": (
        "qdelay_retrying_deliveries",
        "Deliveries whose ack timeout passed, waiting out their retry's backoff (in the groups' backlog)",
        "gauge",
    ),
    "redeliveries": ("qdelay_redeliveries", "Deliveries repeated after an ack timeout", "counter"),
    "dispatched": ("qdelay_dispatched", "Deliveries handed to consumers", "counter"),
    "dead_lettered": (
        "qdelay_dead_lettered",
        "Deliveries that used max_attempts for their group and were moved to DLQ.<subject>",
        "counter",
    ),
    "disk_full_waits": (
        "qdelay_disk_full_waits",
        "Schedule-log and dispatch-log writes that found the disk full and were tried "
        "again later (nothing is lost; alert on any increase)",
        "counter",
    ),
    "epoch": ("qdelay_epoch", "Replication epoch of this server", "gauge"),
    "id_filter_keys": (
        "qdelay_id_filter_keys",
        "Message ids in the id filter in front of the id index (0 until its scan at start-up is done)",
        "gauge",
    ),
    "id_filter_layers": (
        "qdelay_id_filter_layers",
        "Layers of the id filter: 1 after its scan at start-up, one more (twice the bits of "
        "the one before; no rescan) each time the newest is full",
        "gauge",
    ),
    "id_filter_bytes": ("qdelay_id_filter_bytes", "Bytes of the id filter's layers", "gauge"),
    "id_index_memtable_bytes": (
        "qdelay_id_index_memtable_bytes",
        "Bytes of the id index's RocksDB memtables (flushed to disk when full)",
        "gauge",
    ),
    "id_index_block_cache_bytes": (
        "qdelay_id_index_block_cache_bytes",
        "Bytes of the id index's RocksDB block cache in use",
        "gauge",
    ),
    "id_index_table_readers_bytes": (
        "qdelay_id_index_table_readers_bytes",
        "Bytes of the id index's RocksDB table readers (index and filter blocks of its files)",
        "gauge",
    ),
    "replication_lag_bytes": ("qdelay_replication_lag_bytes", "Bytes the slowest slave is behind (-1: none)", "gauge"),
    "replication_lag_ms": (
        "qdelay_replication_lag_ms",
        "Replication lag in milliseconds: on a master, how old the oldest record the "
        "slowest slave lacks is; on a slave, how far behind its master it applies (-1: none)",
        "gauge",
    ),
    "sync_timeouts": (
        "qdelay_replication_sync_timeouts",
        "Sync-mode writes answered without a slave's confirmation in time",
        "counter",
    ),
    "slaves_attached": ("qdelay_replication_slaves_attached", "Slaves connected to this master", "gauge"),
    "slaves_in_sync": (
        "qdelay_replication_slaves_in_sync",
        "Attached slaves that had, sync_bound_ms ago, everything this master had committed (who may take over "
        "losing at most that bound's writes): 0 with slaves configured means a failover now could lose writes",
        "gauge",
    ),
    "slaves_held": (
        "qdelay_replication_slaves_held",
        "Detached slaves this master still keeps its message log for (slave_hold_ms, slave_hold_bytes)",
        "gauge",
    ),
    "holds_saves": (
        "qdelay_replication_holds_saves",
        "Saves of checkpoint/slave_holds.ckpt (at most one a second while slaves confirm, and at the stop)",
        "counter",
    ),
    "holds_save_seconds": (
        "qdelay_replication_holds_save_seconds",
        "Time the saves of checkpoint/slave_holds.ckpt took (their fsyncs included)",
        "counter",
    ),
    "holds_save_cpu_seconds": (
        "qdelay_replication_holds_save_cpu_seconds",
        "CPU time the saves of checkpoint/slave_holds.ckpt took (the saving thread's)",
        "counter",
    ),
    "slave_holds_expired": (
        "qdelay_replication_slave_holds_expired",
        "Holds for detached slaves that ran out since the start: such a slave needs a resync if its log was cleaned",
        "counter",
    ),
    "replication_delay_p99_ms": (
        "qdelay_replication_delay_p99_ms",
        "Slave: p99 of record age when applied, recent window (ms)",
        "gauge",
    ),
    "replication_connected": ("qdelay_replication_connected", "Slave: 1 while connected to its master", "gauge"),
    # cluster mode (replication/cluster.py)
    "cluster_lease_renewals": ("qdelay_cluster_lease_renewals", "etcd lease renewals that succeeded", "counter"),
    "cluster_lease_renew_failures": (
        "qdelay_cluster_lease_renew_failures",
        "etcd lease renewals that failed (timeout, etcd unreachable)",
        "counter",
    ),
    "cluster_leader_changes": (
        "qdelay_cluster_leader_changes",
        "Times this server took its shard's leadership",
        "counter",
    ),
    "cluster_self_fences": (
        "qdelay_cluster_self_fences",
        "Times this master stopped acknowledging because it could not renew its lease in time",
        "counter",
    ),
    "cluster_lease_ok": ("qdelay_cluster_lease_ok", "1 while this master can prove its leadership lease", "gauge"),
}


# per-group gauges carry (subject, group) labels for the groups with the most due and in
# flight only: a label set that grows with the number of groups would grow the scrape too
TOP_GROUPS = 20


class EngineCollector:
    def __init__(self, engine, extra=None, consumers=None) -> None:
        self.engine = engine
        self.extra = extra  # callable -> dict of more gauges (name -> (help, value))
        self.consumers = consumers  # the consumer registry: subscribers per group

    def describe(self):
        return []  # names are dynamic; do not call collect() at registration

    def collect(self):
        try:
            stats = self.engine.stats()
        except Exception:  # noqa: BLE001 - a scrape must not break the server
            log.exception("engine.stats() failed during a scrape")
            stats = {}
        for key, (name, text, kind) in ENGINE_STATS.items():
            value = stats.get(key)
            if isinstance(value, bool):
                value = int(value)
            if not isinstance(value, (int, float)):
                continue
            family: CounterMetricFamily | GaugeMetricFamily
            if kind == "counter":
                family = CounterMetricFamily(name, text)
            else:
                family = GaugeMetricFamily(name, text)
            family.add_metric([], value)
            yield family
        role = stats.get("role")
        if role:
            family = GaugeMetricFamily("qdelay_role", "1 for the role this server has", labels=["role"])
            family.add_metric([str(role)], 1)
            yield family
        mode = stats.get("replication_mode")
        if mode:
            family = GaugeMetricFamily(
                "qdelay_replication_mode", "1 for the replication mode (async, sync)", labels=["mode"]
            )
            family.add_metric([str(mode)], 1)
            yield family
        yield from self._groups()
        extra = {}
        if self.extra is not None:
            try:
                extra = self.extra()
            except Exception:  # noqa: BLE001
                log.exception("extra metrics failed during a scrape")
        for name, (text, value) in extra.items():
            family = GaugeMetricFamily(name, text)
            family.add_metric([], value)
            yield family

    def _groups(self):
        groups_of = getattr(self.engine, "groups", None)
        if groups_of is None:
            return
        try:
            groups = groups_of()
        except Exception:  # noqa: BLE001 - a scrape must not break the server
            log.exception("engine.groups() failed during a scrape")
            return
        reg = self.consumers
        backlog = GaugeMetricFamily(
            "qdelay_group_backlog",
            f"Due deliveries waiting for a consumer group, in memory or on disk (top {TOP_GROUPS} groups)",
            labels=["subject", "group"],
        )
        flying = GaugeMetricFamily(
            "qdelay_group_in_flight",
            f"Deliveries to a consumer group not yet acknowledged (top {TOP_GROUPS} groups)",
            labels=["subject", "group"],
        )
        on_disk = GaugeMetricFamily(
            "qdelay_group_backlog_on_disk",
            f"1 while a group holds more due messages than group_max_ready (top {TOP_GROUPS} groups)",
            labels=["subject", "group"],
        )
        top = sorted(groups, key=lambda g: g["backlog"] + g["in_flight"], reverse=True)[:TOP_GROUPS]
        for g in top:
            labels = [g["subject"], g["group"]]
            backlog.add_metric(labels, g["backlog"])
            flying.add_metric(labels, g["in_flight"])
            on_disk.add_metric(labels, int(g["spilled"]))
        yield backlog
        yield flying
        yield on_disk
        yield GaugeMetricFamily("qdelay_groups", "Consumer groups", value=len(groups))
        if reg is not None:
            alone = [g for g in groups if reg.consumers(g["subject"], g["group"]) == 0]
            yield GaugeMetricFamily(
                "qdelay_due_without_consumer",
                "Due deliveries held in memory (ready, or waiting out a retry's backoff) for "
                "groups that have no consumer connected",
                value=sum(g["ready"] + g["retrying"] for g in alone),
            )
            yield GaugeMetricFamily(
                "qdelay_groups_without_consumer",
                "Consumer groups with no consumer connected that hold due messages (in memory or on disk)",
                value=sum(1 for g in alone if g["ready"] or g["spilled"] or g["retrying"]),
            )


def histogram_family(
    name: str, text: str, bounds: Sequence[float], counts: Sequence[int], total: float
) -> HistogramMetricFamily:
    """A histogram's family at scrape time from its ``counts`` a bucket (not cumulative: one
    a bound, then one above every bound) and the sum of what it observed: the buckets
    cumulative, labelled as prometheus-client labels them (BulkHistogram, IngestCounts)."""
    labels = (*map(floatToGoString, bounds), "+Inf")
    family = HistogramMetricFamily(name, text)
    family.add_metric([], list(zip(labels, itertools.accumulate(counts), strict=True)), total)
    return family


class BulkHistogram:
    """A histogram fed in bulk (numpy), exposed at scrape time: ~0.05 µs per observation
    instead of prometheus-client's ~3 µs, for per-delivery figures on the hot path."""

    def __init__(self, name: str, text: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.text = text
        self.bounds = np.asarray(buckets, dtype=np.float64)
        self.counts = np.zeros(len(buckets) + 1, dtype=np.int64)  # last: above the largest bound
        self.sum = 0.0
        self.lock = threading.Lock()

    def observe_many(self, values) -> None:
        arr = np.asarray(values, dtype=np.float64)
        if not arr.size:
            return
        idx = np.searchsorted(self.bounds, arr, side="left")  # le semantics: value <= bound
        counts = np.bincount(idx, minlength=len(self.counts))
        with self.lock:
            self.counts += counts
            self.sum += float(arr.sum())

    def observe(self, value: float) -> None:
        self.observe_many((value,))

    def describe(self):
        return []

    def collect(self):
        with self.lock:
            counts = self.counts.tolist()
            total = self.sum
        yield histogram_family(self.name, self.text, self.bounds.tolist(), counts, total)


class IngestCounts:
    """The ingest path's metrics (``qdelay_ingested_messages``, ``qdelay_ingested_payload_bytes``
    and the ``qdelay_send_seconds`` histogram), counted in plain numbers by their one writer,
    the event loop (DelayService._admitted, once a batch is durable), and exposed at scrape
    time with the names, help, buckets and samples (``_total``, ``_bucket``, ``_count``,
    ``_sum``, ``_created``) that prometheus-client's Counter and Histogram give them.

    Why not those: each ``inc``/``observe`` takes a lock (one per value: three for a batch,
    plus the histogram's walk over its bounds in Python), ~4 % of the event loop's
    instructions on the SendStream path for three numbers a batch (docs/benchmarks.md).
    A scrape (the metrics thread) reads them without a lock: each number is read whole,
    and the buckets are copied in one C call (``list.copy``, under the GIL), so ``_count``
    (the last bucket's cumulative count) always matches the buckets; ``_sum`` may miss the
    observation being made, as prometheus-client's own histogram may."""

    MESSAGES = ("qdelay_ingested_messages", "Messages durably accepted (rate = ingest rate)")
    BYTES = ("qdelay_ingested_payload_bytes", "Payload bytes durably accepted")
    SECONDS = ("qdelay_send_seconds", "Send/SendBatch latency until durable")

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = tuple(float(b) for b in buckets)
        if list(self.bounds) != sorted(self.bounds) or self.bounds[-1] == float("inf"):
            raise ValueError("ingest metrics: finite bucket bounds in increasing order")
        self.messages = 0
        self.payload_bytes = 0
        self._buckets = [0] * (len(self.bounds) + 1)  # not cumulative; the last: above every bound
        self._seconds = 0.0
        self._created = time.time()

    def add(self, count: int, size: int, seconds: float) -> None:
        """A write of ``count`` messages of ``size`` payload bytes was durable ``seconds``
        after it was admitted (on the event loop)."""
        self.messages += count
        self.payload_bytes += size
        self._buckets[bisect.bisect_left(self.bounds, seconds)] += 1  # le: value <= bound
        self._seconds += seconds

    def describe(self):
        return self._families(0, 0, [0] * len(self._buckets), 0.0)

    def collect(self):
        buckets = self._buckets.copy()
        return self._families(self.messages, self.payload_bytes, buckets, self._seconds)

    def _families(self, messages: int, size: int, buckets: list[int], seconds: float):
        created = self._created if getattr(prometheus_metrics, "_use_created", True) else None
        histogram = histogram_family(*self.SECONDS, self.bounds, buckets, seconds)
        if created is not None:
            histogram.samples.append(Sample(histogram.name + "_created", {}, created, None, None))
        return [
            CounterMetricFamily(*self.MESSAGES, value=float(messages), created=created),
            CounterMetricFamily(*self.BYTES, value=float(size), created=created),
            histogram,
        ]


# how often the endpoint's thread looks whether it is to stop: close() waits for that look.
# prometheus_client's start_http_server serves with socketserver's default, 0.5 s, so every
# stop of a server with --metrics-listen took 0.25-0.5 s more, blocking the event loop
HTTP_POLL_S = 0.05


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        pass  # a line on stderr per scrape


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # messages and payload bytes durably accepted, and the latency of their writes
        self.ingest = IngestCounts(LATENCY_BUCKETS)
        r.register(self.ingest)
        self.requests = Counter("qdelay_requests", "RPCs served", ["method", "code"], registry=r)
        self.refused = Counter("qdelay_refused_messages", "Messages refused", ["reason"], registry=r)
        self.fsync_seconds = Histogram(
            "qdelay_wal_fsync_seconds", "Message-log fdatasync latency", buckets=LATENCY_BUCKETS, registry=r
        )
        self.lateness = BulkHistogram(
            "qdelay_dispatch_lateness_seconds",
            "Delivery hand-over to a consumer stream minus the due time (first attempts)",
            LATENESS_BUCKETS,
        )
        r.register(self.lateness)
        self.delivered = Counter("qdelay_delivered", "Deliveries written to consumer streams", registry=r)
        self.acks = Counter("qdelay_acks", "Acknowledgements received from consumers", registry=r)
        self.consumers = None  # set by the app: a gauge callback
        self._http: WSGIServer | None = None

    def attach(self, engine, extra=None, consumers=None) -> None:
        self.registry.register(EngineCollector(engine, extra, consumers))
        log_obj = getattr(engine, "message_log", None) or getattr(engine, "wal", None)
        if log_obj is not None and hasattr(log_obj, "on_fsync"):
            log_obj.on_fsync = self.fsync_seconds.observe

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on a daemon thread (what prometheus_client's start_http_server
        does, IPv6 included, but polled every HTTP_POLL_S for close())."""
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]

        class Server(ThreadingWSGIServer):
            address_family = family

        server = make_server(str(sockaddr[0]), port, make_wsgi_app(self.registry), Server, handler_class=_QuietHandler)
        threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": HTTP_POLL_S}, name="qdelay-metrics", daemon=True
        ).start()
        self._http = server
        return server.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
