"""The Node module (examples/node/qdelay.js: grpc-js loading the .proto at run time) and its example
against a real server: batching send, a consumer across server restarts."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading

import pytest
from conftest import wait_until
from serverproc import ServerProc

NODE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "node")


@pytest.fixture(scope="module")
def node_modules():
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed")
    if not os.path.isdir(os.path.join(NODE_DIR, "node_modules", "@grpc", "grpc-js")):
        # `make test` runs npm ci first; this covers a bare `pytest`
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--silent"], cwd=NODE_DIR, check=True, timeout=300)


def run_example(address: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["node", "example.js", address],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, **env),
    )


def test_node_example_sends_receives_cancels(tmp_path, node_modules):
    with ServerProc(tmp_path / "data") as srv:
        result = run_example(srv.address)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cancelled" in result.stdout and "received" in result.stdout
    assert "node example: OK" in result.stdout


def test_node_example_with_token(tmp_path, node_modules):
    tokens = tmp_path / "tokens"
    tokens.write_text("node-token\n")
    with ServerProc(tmp_path / "data", args=["--auth-token-file", str(tokens)]) as srv:
        refused = run_example(srv.address)
        ok = run_example(srv.address, QDELAY_TOKEN="node-token")
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused.stdout + refused.stderr
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_node_module_batching_send_each_caller_its_receipt_invalid_fails_only_its_caller(tmp_path, node_modules):
    with ServerProc(tmp_path / "data") as srv:
        result = subprocess.run(
            ["node", "check_client.js", srv.address, "batching"],
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "batching: OK" in result.stdout


def test_node_module_receipt_text_reschedule_cancel_many(tmp_path, node_modules):
    """The Node module writes and reads the Python clients' receipt text (each side parses
    and acts on the other's), reschedules, and cancels many in the caller's order."""
    from qdelay.client import Receipt

    with ServerProc(tmp_path / "data") as srv, srv.client() as c:
        mine = c.send("node.receipts", b"py", delay_ms=3_600_000)
        result = subprocess.run(
            ["node", "check_client.js", srv.address, "receipts", "node.receipts", str(mine)],
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0 and "receipts: OK" in result.stdout, result.stdout + result.stderr
        lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
        theirs, moved = Receipt.parse(lines["text"]), Receipt.parse(lines["rescheduled"])
        assert str(theirs) == lines["text"] and str(moved) == lines["rescheduled"]
        assert c.get(mine).state == "CANCELLED"
        st = c.get(moved)
        assert st.state == "PENDING" and st.payload == b"kept" and st.deliver_at_ms == moved.deliver_at_ms
        assert moved.message_id == theirs.message_id and moved.deliver_at_ms > theirs.deliver_at_ms


class NodeConsumer:
    """check_client.js in consume mode: its stdout lines read as they come."""

    def __init__(self, address: str, subject: str) -> None:
        self.proc = subprocess.Popen(
            ["node", "check_client.js", address, "consume", subject],
            cwd=NODE_DIR,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def wait_for(self, line: str, timeout: float = 30.0) -> None:
        def printed() -> bool:
            assert self.proc.poll() is None, self.proc.stderr.read()
            return line in self.lines

        wait_until(printed, timeout, f"{line!r} in {self.lines}")

    def close(self) -> str:
        self.proc.stdin.close()
        self.proc.wait(30)
        self._reader.join(10)
        return "\n".join(self.lines)


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_node_consumer_keeps_receiving_across_a_restart(tmp_path, node_modules, how):
    subject = f"node.restart.{how}"
    srv = ServerProc(tmp_path / "data").start()
    try:
        consumer = NodeConsumer(srv.address, subject)
        consumer.wait_for("ready")
        with srv.client(batching=False) as c:
            before = c.send(subject, b"before")
            consumer.wait_for(f"got {before.message_id}")
            if how == "sigterm":
                assert srv.stop() == 0
            else:
                srv.kill9()
            srv.start()
            with srv.client(batching=False) as c:
                after = c.send(subject, b"after")
            consumer.wait_for(f"got {after.message_id}")
        out = consumer.close()
        assert consumer.proc.returncode == 0, out + consumer.proc.stderr.read()
        assert "reconnect 1" in out and "closed after" in out
    finally:
        srv.kill9()


def test_node_cancel_tried_again_after_an_unknown_outcome_answers_cancelled(tmp_path, node_modules):
    """The Node module's cancel() and cancelMany() are tried again after UNAVAILABLE (here
    sync replication unconfirmed: the tombstone is durable on the master); the retry found
    the message cancelled by its own first try and answered ALREADY_CANCELLED, where the
    Python clients answer CANCELLED (docs/api.md). A later first try still answers
    ALREADY_CANCELLED."""

    from test_client_parity import sync_master_and_slave, with_the_slave_stopped

    from qdelay.client import Client

    def node_cancel(text: str, *many: str) -> str:
        cp = subprocess.run(
            ["node", "check_client.js", a.address, "cancel", text, *many],
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cp.returncode == 0, cp.stderr
        return cp.stdout.split()[-1]

    with sync_master_and_slave(tmp_path) as (a, b):
        with Client(a.address) as c:
            targets = [str(c.send("node.retried", b"%d" % i, delay_ms=3_600_000)) for i in range(2)]
        assert with_the_slave_stopped(a, b, lambda: node_cancel(targets[0])) == "CANCELLED"
        assert node_cancel(targets[0]) == "ALREADY_CANCELLED"  # a first try: another's cancel
        assert with_the_slave_stopped(a, b, lambda: node_cancel(targets[1], "many")) == "CANCELLED"
        assert node_cancel(targets[1], "many") == "ALREADY_CANCELLED"


def test_node_module_refuses_a_url_or_an_address_without_its_port_when_made_as_the_python_clients(node_modules):
    """grpc-js took any address: ``new Client('http://host:7600')`` was made and failed only at
    its first call (UNAVAILABLE: the name could not be resolved), and ``'host'`` was tried on
    port 443. The Node module now refuses them when a client is made (no server, no call),
    with the Python clients' check and words (qdelay/addresses.py), naming the HOST:PORT to
    pass; gRPC's own target forms are still taken."""
    import json

    from qdelay import errors
    from qdelay.client import Client, ShardedClient

    bad = ["http://127.0.0.1:7600", "https://host:7600/", "grpc://host:7600", "HTTP://[::1]:7600", "xds:///host"]
    bad += ["", "host", "127.0.0.1", "127.0.0.1:", "127.0.0.1:abc", "host:0", "host:70000", "[::1]", "dns:///host"]
    bad += ["ipv4://127.0.0.1:7600", "ipv4:127.0.0.1:1,127.0.0.2", "a:1,b", "it's:x"]
    good = ["127.0.0.1:7600", "[::1]:1", "unix:/nonexistent/q.sock", "dns:///localhost:1"]
    good += ["ipv4:127.0.0.1:1,127.0.0.2:2"]
    result = subprocess.run(
        ["node", "check_targets.js", json.dumps(bad + good)], cwd=NODE_DIR, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    got = {row["target"]: row for row in map(json.loads, result.stdout.splitlines())}
    assert list(got) == bad + good

    def python(make, target):
        try:
            make(target).close()
        except errors.InvalidArgument as err:
            return str(err)
        except errors.QdelayError:
            pass  # taken: the sharded client's first Topology found no server there
        return None

    for target in bad + good:
        row = got[target]
        assert row["client"] == python(Client, target), target
        assert row["sharded"] == python(ShardedClient, target), target
    for target in good:
        assert got[target]["client"] is None and got[target]["sharded"] is None, target
    url = got["http://127.0.0.1:7600"]
    assert url["message"] == (
        "Client: INVALID_ARGUMENT: target must be HOST:PORT (or a gRPC target: unix:, dns:, ipv4:, ...), not "
        "'http://127.0.0.1:7600': gRPC takes no URL, drop the http://; pass '127.0.0.1:7600'"
    )
