"""The replication figures of engine.stats() are exported as Prometheus metrics (real
master and slave processes, scraped over HTTP)."""

from __future__ import annotations

import re
import urllib.request

import pytest
from conftest import wait_until
from serverproc import ServerProc

from qdelay import errors

METRICS = ["--metrics-listen", "127.0.0.1:0"]


def scrape(srv: ServerProc, prefix: str = "qdelay_replication") -> dict[str, float]:
    """The server's metrics whose names start with ``prefix`` (labels kept in the name)."""
    port = int(srv.tail_log(100_000).split("metrics on 127.0.0.1:")[1].split()[0])
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(rf"^({prefix}\w*(?:\{{[^}}]*\}})?) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def test_replication_stats_exported(tmp_path):
    with ServerProc(tmp_path / "a", args=["--replication", "sync", "--replication-timeout-ms", "300", *METRICS]) as a:
        c = a.client(retries=0)
        with pytest.raises(errors.Unavailable):
            c.send("s", b"x", delay_ms=60_000)
        m = scrape(a)
        assert m["qdelay_replication_sync_timeouts_total"] == 1
        assert m["qdelay_replication_lag_ms"] == -1 and m["qdelay_replication_lag_bytes"] == -1
        assert m["qdelay_replication_slaves_attached"] == 0
        assert m['qdelay_replication_mode{mode="sync"}'] == 1
        with ServerProc(tmp_path / "b", args=["--role", "slave", "--master", a.address, *METRICS]) as b:
            wait_until(lambda: scrape(a).get("qdelay_replication_slaves_attached") == 1, 20, "the slave attached")
            # retried as a user would: 300 ms can be too short for the slave on a loaded box
            with a.client() as retrying:
                retrying.send("s", b"y", delay_ms=60_000)
            m = scrape(a)
            assert m["qdelay_replication_lag_ms"] >= 0 and m["qdelay_replication_lag_bytes"] >= 0
            s = scrape(b)
            assert s["qdelay_replication_connected"] == 1
            assert s["qdelay_replication_lag_ms"] >= 0 and "qdelay_replication_delay_p99_ms" in s
            assert m["qdelay_replication_slaves_held"] == 0  # attached: not counted there
            # caught up for sync_bound_ms: in sync (what an alert on "no in-sync slave" reads)
            wait_until(lambda: scrape(a).get("qdelay_replication_slaves_in_sync") == 1, 20, "the slave in sync")
            # the holds file was saved when the slave attached (a hold added): what it took
            assert m["qdelay_replication_holds_saves_total"] >= 1
            assert m["qdelay_replication_holds_save_seconds_total"] > 0
            assert m["qdelay_replication_holds_save_cpu_seconds_total"] > 0
        # stopped: held (slave_hold_ms), not expired
        m = wait_until(lambda: (m := scrape(a))["qdelay_replication_slaves_held"] == 1 and m, 20, "the slave held")
        assert m["qdelay_replication_slave_holds_expired_total"] == 0
        wait_until(lambda: scrape(a).get("qdelay_replication_slaves_in_sync") == 0, 20, "no slave in sync once it left")
        c.close()


def gauge(srv: ServerProc, name: str) -> float:
    """One unlabelled metric (-1 when the server does not export it)."""
    return scrape(srv, name).get(name, -1.0)


def test_a_slave_keeps_the_id_filter_ready_for_its_promotion(tmp_path):
    """The id filter is built when a server opens, whatever its role, and a slave adds every
    replicated id to it: a slave never looks ids up, so before, its filter was first built by
    the first write after its promotion, whose scan of every key held that write up
    (bench.admin: 28 ms at 100,000 ids, 31 ms at 1,000,000). Exported as qdelay_id_filter_keys."""
    with ServerProc(tmp_path / "a", args=METRICS) as a:
        with ServerProc(tmp_path / "b", args=["--role", "slave", "--master", a.address, *METRICS]) as b:
            with a.client() as c:
                c.send_many(c.message("s", b"x", delay_ms=3_600_000) for _ in range(300))
            wait_until(lambda: gauge(a, "qdelay_id_filter_keys") == 300, 20, "the master's filter holds every id")
            # no lookup was made on the slave: its filter was built at its start and grows by its puts
            wait_until(lambda: gauge(b, "qdelay_id_filter_keys") == 300, 20, "the slave's filter holds every id")
            # where the index's memory is, by the server's own figures (docs/benchmarks.md)
            assert gauge(a, "qdelay_id_filter_layers") == 1
            assert gauge(a, "qdelay_id_filter_bytes") >= 1 << 20  # 1 MiB at least
            assert gauge(a, "qdelay_id_index_memtable_bytes") > 0
            assert gauge(a, "qdelay_id_index_block_cache_bytes") >= 0
            assert gauge(a, "qdelay_id_index_table_readers_bytes") >= 0
            # idempotent send's recent ids: the server's own ids, forgotten once indexed
            assert gauge(a, "qdelay_dedupe_recent_ids") >= 0 and gauge(a, "qdelay_dedupe_recent_bytes") > 0
