"""Authentication and TLS against real server processes."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from serverproc import ServerProc, make_tls_cert

from qdelay import errors
from qdelay.server.auth import check_metadata, token_matches

TOKEN = "s3cret-token-value-9f8e7d"


def test_check_metadata_unit():
    tokens = [b"one", b"two"]
    assert check_metadata([("authorization", "Bearer two")], tokens) is None
    assert check_metadata([("authorization", "bearer one")], tokens) is None
    assert "missing" in check_metadata([], tokens)
    assert "Bearer" in check_metadata([("authorization", "Basic b25l")], tokens)
    assert check_metadata([("authorization", "Bearer three")], tokens) == "invalid token"
    assert not token_matches(b"on", tokens) and token_matches(b"one", tokens)


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"# rotated tokens\n{TOKEN}\n\nother-token\n")
    return path


def test_token_required_on_every_rpc(tmp_path, token_file):
    with ServerProc(tmp_path / "data", args=["--auth-token-file", str(token_file)]) as srv:
        for kw in ({}, {"token": "wrong"}, {"token": TOKEN + "x"}):
            c = srv.client(retries=0, **kw)
            with pytest.raises(errors.Unauthenticated):
                c.send("a.b", b"x", delay_ms=0)
            with pytest.raises(errors.Unauthenticated):
                c.send_batch([c.message("a.b", b"x", delay_ms=0)])
            with pytest.raises(errors.Unauthenticated):
                c.stats()
            with pytest.raises(errors.Unauthenticated):
                c.cancel("some-id")  # a request on a CancelStream
            with pytest.raises(errors.Unauthenticated):
                c.health()
            with c.subscribe("a.b") as consumer:
                with pytest.raises(errors.Unauthenticated):
                    consumer.receive(1, timeout=5)
            c.close()
        for token in (TOKEN, "other-token"):
            c = srv.client(token=token)
            r = c.send("a.b", b"x", delay_ms=0)
            assert c.state_name(c.get(r)) in ("PENDING", "DELIVERED")
            assert c.cancel(c.send("a.c", b"x", delay_ms=3_600_000)) == "CANCELLED"
            assert c.health() == "SERVING"
            with c.subscribe("a.b") as consumer:
                got = consumer.receive(1, timeout=5)
                assert [d.message_id for d in got] == [r.message_id]
                consumer.ack(got)
            c.close()
    log = srv.log_path.read_text()
    assert "refused" in log and TOKEN not in log and "wrong" not in log


def test_auth_off_by_default(tmp_path):
    with ServerProc(tmp_path / "data") as srv:
        c = srv.client(token="anything")
        c.send("a.b", b"x", delay_ms=0)
        c.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_with_token(tmp_path, token_file):
    cert, key = make_tls_cert(tmp_path)
    args = ["--tls-cert", str(cert), "--tls-key", str(key), "--auth-token-file", str(token_file)]
    with ServerProc(tmp_path / "data", args=args) as srv:
        c = srv.client(token=TOKEN, tls_ca=str(cert))
        r = c.send("a.b", b"over tls", delay_ms=0)
        assert r.message_id
        c.close()
        plain = srv.client(connect=False, token=TOKEN, retries=0, timeout=3)
        with pytest.raises(errors.Unavailable):
            plain.send("a.b", b"x", delay_ms=0)
        plain.close()
        bad = srv.client(tls_ca=str(cert), retries=0)
        with pytest.raises(errors.Unauthenticated):
            bad.send("a.b", b"x", delay_ms=0)
        bad.close()
        # qdelay admin against it, as an operator first tries it: it said "unreachable" for a
        # refused token and gRPC's bare "Socket closed" for a plaintext call to the TLS port,
        # with no word of the flag that fixes either
        import sys

        def admin(*argv: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                [sys.executable, "-m", "qdelay.cli", "admin", *argv, "--timeout", "5"],
                capture_output=True,
                text=True,
                timeout=60,
            )

        cp = admin("status", "--servers", srv.address)
        assert cp.returncode == 1 and "Socket closed" in cp.stdout, cp.stdout + cp.stderr
        assert cp.stdout.rstrip().endswith("(if the server serves TLS, give its CA certificate with --tls-ca FILE)")
        cp = admin("status", "--servers", srv.address, "--tls-ca", str(cert))
        assert cp.returncode == 1 and f"{srv.address:<22} refused (UNAUTHENTICATED: " in cp.stdout, cp.stdout
        assert "(the server requires a token: give its token file with --token-file FILE)" in cp.stdout
        cp = admin("group", "list", "--server", srv.address, "--tls-ca", str(cert))
        assert cp.returncode == 1 and "give its token file with --token-file FILE" in cp.stderr, cp.stderr
        cp = admin("status", "--servers", srv.address, "--tls-ca", str(cert), "--token-file", str(token_file))
        assert cp.returncode == 0 and " master " in cp.stdout, cp.stdout + cp.stderr
        # examples/python/example.py in plaintext against it said "no qdelay server answers
        # at ...; start one with 'make run'" of a server that answers: it names --tls-ca
        import os

        path = os.path.join(
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "python", "example.py"
        )
        cp = subprocess.run(
            [sys.executable, path, srv.address, "--token", TOKEN], capture_output=True, text=True, timeout=60
        )
        lines = cp.stderr.splitlines()
        assert cp.returncode == 1 and len(lines) == 1 and "Traceback" not in cp.stderr, cp.stderr
        assert "make run" not in lines[0] and "--tls-ca FILE" in lines[0], lines[0]


def test_unreadable_token_file_refuses_to_start(tmp_path):
    with pytest.raises(RuntimeError, match="exited"):
        ServerProc(tmp_path / "data", args=["--auth-token-file", str(tmp_path / "missing")], start_timeout=30).start()


def test_python_example_without_the_token_says_how_to_pass_it(tmp_path, token_file):
    """examples/python/example.py against a server that requires a token: without one (or
    with a wrong one) it printed an Unauthenticated traceback; it says in one line that a
    token is needed and how to pass it, and exits non-zero. With ``--token`` it runs."""
    import os
    import sys

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "python", "example.py")
    with ServerProc(tmp_path / "data", args=["--auth-token-file", str(token_file)]) as srv:

        def example(*extra: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                [sys.executable, path, srv.address, *extra], capture_output=True, text=True, timeout=60
            )

        for extra in ((), ("--token", "wrong")):
            cp = example(*extra)
            assert cp.returncode == 1 and cp.stdout == "", (extra, cp.stdout, cp.stderr)
            lines = cp.stderr.splitlines()
            assert len(lines) == 1 and "Traceback" not in cp.stderr, cp.stderr
            assert "--token TOKEN" in lines[0] and srv.address in lines[0], lines[0]
            assert ("refused the token" if extra else "requires a token") in lines[0], lines[0]
        cp = example("--token", TOKEN)
        assert cp.returncode == 0, cp.stdout + cp.stderr
        assert "received 1001 messages; cancelled one delivered: False" in cp.stdout
