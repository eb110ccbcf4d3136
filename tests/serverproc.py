"""Start a real ``qdelay server`` process for tests (reusable by any test module).

    with ServerProc(tmp_path / "data") as srv:          # free 127.0.0.1 port, waits for the line
        client = srv.client()
        ...
    srv.stop() -> exit code (SIGTERM);  srv.kill9();  srv.restart()

Extra flags go in ``args`` (e.g. ``["--set", "engine.ack_timeout_ms=500"]``); ``command``
runs a wrapper of ``qdelay.cli`` instead (a server with a test's hook). The server's
stderr goes to ``<data>.log`` next to the data folder, for post-mortems.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from ports import free_port

LINE = re.compile(rb"^qdelay listening on (\S+):(\d+)\s*$")


class ServerProc:
    def __init__(
        self,
        data_dir,
        args: list[str] | None = None,
        listen: str = "127.0.0.1:0",
        start_timeout: float = 60.0,
        env: dict | None = None,
        command: list[str] | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        # what runs ``server ...``: qdelay's own command, or a test's wrapper of it (a server
        # with a hook, e.g. tests/gated_server.py)
        self.command = list(command or [sys.executable, "-m", "qdelay.cli"])
        self.args = list(args or [])
        self.listen = listen
        self.start_timeout = start_timeout
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None
        self.port: int | None = None
        self.log_path = self.data_dir.with_name(self.data_dir.name + ".log")

    # --- life cycle --------------------------------------------------------------------------------
    def start(self) -> ServerProc:
        if self.port is None and self.listen == "127.0.0.1:0":
            # a port no outgoing connection can take between a stop and a restart (ports.py);
            # another worker may take it before the server binds it: another one then
            for _ in range(4):
                try:
                    return self._start(f"127.0.0.1:{free_port()}")
                except RuntimeError as err:
                    if "address is in use" not in str(err):
                        raise
                    self.port = None
        listen = self.listen
        if self.port is not None and listen.endswith(":0"):
            listen = f"127.0.0.1:{self.port}"  # a restart keeps its address
        return self._start(listen)

    def _start(self, listen: str) -> ServerProc:
        cmd = [
            *self.command,
            "server",
            "--data-dir",
            str(self.data_dir),
            "--listen",
            listen,
            *self.args,
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(self.env or {}))
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, env=env)
        deadline = time.monotonic() + self.start_timeout
        buf = b""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill9()
                raise TimeoutError(
                    f"server did not print its listening line in {self.start_timeout}s; log: {self.tail_log()}"
                )
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk:
                    code = self.proc.wait()
                    raise RuntimeError(f"server exited with {code} before listening; log: {self.tail_log()}")
                buf += chunk
                for line in buf.splitlines():
                    m = LINE.match(line)
                    if m:
                        self.host = m.group(1).decode()
                        self.port = int(m.group(2))
                        self.address = f"{self.host}:{self.port}"
                        return self
            elif self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log: {self.tail_log()}")

    def tail_log(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self._reap()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        return self._reap()

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self._reap()

    def _reap(self) -> int:
        code = self.proc.returncode if self.proc is not None else 0
        if self.proc is not None and self.proc.stdout:
            self.proc.stdout.close()
        if getattr(self, "_log", None):
            self._log.close()
            self._log = None
        return code

    def restart(self) -> ServerProc:
        self.stop()
        return self.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # --- helpers -------------------------------------------------------------------------------------
    def client(self, connect: bool = True, **kw):
        """A blocking client, its channel connected first while the server runs: a test's
        first call (often with ``retries=0``, to see an error as it comes) must not meet
        a connection still being made on a loaded machine (UNAVAILABLE, "tcp handshaker
        shutdown", seen with two test workers on two busy cores). ``connect=False`` for a
        client that is meant not to connect (plaintext against TLS)."""
        from qdelay.client import Client

        c = Client(self.address, **kw)
        if connect and self.alive():
            c.wait_ready(30)
        return c

    def __enter__(self) -> ServerProc:
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.alive():
            try:
                self.stop(timeout=15)
            except subprocess.TimeoutExpired:
                pass


def make_tls_cert(folder) -> tuple[Path, Path]:
    """A self-signed certificate for localhost / 127.0.0.1 and its key, made by the openssl
    command in ``folder`` (a test using it skips where openssl is missing): the server takes
    them as ``--tls-cert`` / ``--tls-key``, clients and tools the certificate as their CA."""
    cert, key = Path(folder) / "server.crt", Path(folder) / "server.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return cert, key
