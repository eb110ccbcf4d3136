"""The server process's gRPC transport setting (qdelay/cli.py SERVER_GRPC_EXPERIMENTS): set
before gRPC loads, never over the operator's own GRPC_EXPERIMENTS, and in force in a real
server (its start line says what grpc-core read; it serves calls under it)."""

from __future__ import annotations

import re

import pytest
from serverproc import ServerProc

from qdelay.cli import SERVER_GRPC_EXPERIMENTS, set_server_grpc_experiments


def test_set_for_a_server_unless_the_operator_chose_or_grpc_is_loaded():
    env: dict[str, str] = {}
    assert set_server_grpc_experiments(env, grpc_loaded=False)
    assert env == {"GRPC_EXPERIMENTS": SERVER_GRPC_EXPERIMENTS}
    for chosen in ("", "event_engine_listener", "-event_engine_client"):
        env = {"GRPC_EXPERIMENTS": chosen}
        assert not set_server_grpc_experiments(env, grpc_loaded=False)
        assert env == {"GRPC_EXPERIMENTS": chosen}  # the operator's value, even empty
    env = {}
    assert not set_server_grpc_experiments(env, grpc_loaded=True)  # too late to matter: left alone
    assert env == {}


def _started_line(srv: ServerProc) -> str:
    lines = [line for line in srv.log_path.read_text().splitlines() if " started " in line]
    assert lines, "no start line in the server's log"
    return lines[-1]


@pytest.mark.parametrize("chosen", [None, ""])
def test_a_real_server_runs_with_the_setting_or_the_operators(tmp_path, monkeypatch, chosen):
    monkeypatch.delenv("GRPC_EXPERIMENTS", raising=False)  # (ServerProc passes this environment on)
    env = {} if chosen is None else {"GRPC_EXPERIMENTS": chosen}
    with ServerProc(tmp_path / "data", args=["--log-level", "info"], env=env) as srv:
        c = srv.client()
        receipts = c.send_batch([c.message("gx", b"p", delay_ms=0) for _ in range(20)])
        with c.subscribe("gx") as consumer:
            got = []
            while len(got) < 20:
                batch = consumer.receive(20, timeout=10)
                assert batch, "nothing delivered"
                consumer.ack(batch)
                got += batch
        assert sorted(d.message_id for d in got) == sorted(r.message_id for r in receipts)
        c.close()
        want = SERVER_GRPC_EXPERIMENTS if chosen is None else chosen
        assert re.search(rf"grpc_experiments={re.escape(want)}(\s|$)", _started_line(srv))
