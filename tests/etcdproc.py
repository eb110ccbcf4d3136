"""A real etcd on loopback for cluster tests, and a TCP proxy a test can cut.

    with EtcdProc(tmp_path / "etcd") as etcd:     # free ports, waits until it answers
        etcd.endpoint                              # "127.0.0.1:PORT"
        etcd.restart()

    with TcpProxy(etcd.endpoint) as proxy:         # a server given proxy.endpoint is cut
        proxy.cut()                                # off from etcd (connections closed,
        proxy.heal()                               # new ones refused) until healed

etcd comes from the Debian package ``etcd-server`` that ``make setup`` installs; where it
is missing, :func:`require_etcd` skips the test saying so.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from ports import free_port


def etcd_binary() -> str | None:
    return shutil.which("etcd") or (os.path.exists("/usr/bin/etcd") and "/usr/bin/etcd") or None


def require_etcd() -> str:
    path = etcd_binary()
    if path is None:
        pytest.skip("etcd is not installed (make setup runs 'apt-get install etcd-server'; it could not here)")
    return path


class EtcdProc:
    def __init__(self, data_dir) -> None:
        self.binary = require_etcd()
        self.data_dir = Path(data_dir)
        self.port = free_port()
        self.peer_port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log_path = self.data_dir.with_name(self.data_dir.name + ".log")

    def start(self, timeout: float = 20.0) -> EtcdProc:
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            self.binary,
            "--name",
            "t",
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            f"http://{self.endpoint}",
            "--advertise-client-urls",
            f"http://{self.endpoint}",
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"t={peer}",
            # a one-member etcd on loopback: short raft timers, so that the shortest lease
            # etcd grants (1.5 election timeouts) is 1 s and tests fail over quickly
            "--heartbeat-interval",
            "50",
            "--election-timeout",
            "500",
        ]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        import grpc

        from qdelay.v1 import etcd_pb2, etcd_pb2_grpc

        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.endpoint) as ch:
            stub = etcd_pb2_grpc.KVStub(ch)
            while True:
                try:
                    stub.Range(etcd_pb2.RangeRequest(key=b"/"), timeout=1.0)
                    return
                except grpc.RpcError:
                    if time.monotonic() > deadline or self.proc.poll() is not None:
                        raise RuntimeError(f"etcd did not start; log: {self.log_path.read_text()[-2000:]}") from None
                    time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()
            self._log = None

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> EtcdProc:
        self.stop()
        return self.start()

    def __enter__(self) -> EtcdProc:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill9()
        self.stop()


class TcpProxy:
    """Forwards 127.0.0.1:<port> to ``target``; ``cut()`` closes every connection and
    refuses new ones (the far side sees a network partition), ``heal()`` lets them in again."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.open = True
        self.closed = False
        self.lock = threading.Lock()
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.open:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=2)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data or not self.open:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        self.open = False
        with self.lock:
            socks, self.socks = self.socks, []
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def heal(self) -> None:
        self.open = True

    def close(self) -> None:
        self.closed = True
        self.cut()
        self.listener.close()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
