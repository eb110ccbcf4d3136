"""The servers the side-by-side benchmark drives, and one client for each.

- ``qdelay``: this project's server (``qdelay server``), flush policy ``sync`` (a Send is
  acknowledged after fdatasync); producer = the Python client's SendBatch; consumer = a
  Subscribe stream, one ack request per received batch.
- ``redis-always``: Redis as a delay queue, the common way: ``ZADD key due member`` from a
  redis-py pipeline (member = the 100-byte payload), a consumer that runs a Lua script every
  5 ms taking due members (ZRANGEBYSCORE + ZREM, atomically); AOF ``appendfsync always``.
- ``beanstalkd-f0``: delayed ``put`` (whole seconds: the client rounds up and reports the
  effective due time), ``reserve``/``delete`` consumer; binlog with ``-f 0`` (fsync every
  write).

Every server runs on 127.0.0.1 on a free port in a fresh folder of the same disk; the peers
are started from their Debian packages (``make bench-deps`` installs them). Clients are built
inside worker processes from a picklable (path, kwargs) spec.
"""

from __future__ import annotations

import abc
import atexit
import importlib
import math
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from itertools import chain, repeat
from typing import NamedTuple

import psutil

PAYLOAD_ID_DIGITS = 12
PIPELINE = 16  # qdelay's producer: batches sent ahead of their answers (SendStream)
_LIVE: set[int] = set()


@atexit.register
def _kill_live() -> None:
    for pid in list(_LIVE):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def make_payload(msg_id: int, size: int = 100) -> bytes:
    head = b"%012d" % msg_id
    return head + b"p" * (size - len(head))


def decode_id(payload: bytes) -> int:
    return int(payload[:PAYLOAD_ID_DIGITS])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Chunk(NamedTuple):
    """One batch of the producers' messages, as columns of the same length: ``ids`` (ints),
    ``dues`` (Unix epoch ms, ints), ``payloads`` (bytes). Each client builds its own request
    from them (qdelay: an ``Outgoing`` a message; Redis: a ZADD; beanstalkd: a put), as a
    user's producer builds them from its own data: no object a message that only the
    benchmark makes (a tuple a message, unpacked again by every client, cost qdelay's
    producer ~0.1 µs a message of its ~3.4, docs/benchmarks.md)."""

    ids: list[int]
    dues: list[int]
    payloads: list[bytes]


def make_client(spec: tuple[str, dict]):
    path, kwargs = spec
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)(**kwargs)


# ------------------------------------------------------------------------------------- drivers
class Driver(abc.ABC):
    name = "base"
    delay_resolution_ms = 1

    def __init__(self) -> None:
        self.workdir: str | None = None
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.env: dict[str, str] | None = None  # the server's environment (None: this one's)

    @abc.abstractmethod
    def argv(self) -> list[str]:
        """Each driver or client defines this."""

    @abc.abstractmethod
    def ready(self) -> bool:
        """Each driver or client defines this."""

    @abc.abstractmethod
    def client_spec(self) -> tuple[str, dict]:
        """Each driver or client defines this."""

    def available(self) -> str | None:
        """None when this server can run here, else why not."""
        return None

    def start(self, workdir: str) -> float:
        self.workdir = workdir
        self.port = free_port()
        return self._spawn()

    def restart(self) -> float:
        return self._spawn()

    def _spawn(self) -> float:
        t0 = time.monotonic()
        self._log = open(os.path.join(self.workdir, f"{self.name}.log"), "ab")
        self.proc = subprocess.Popen(
            self.argv(),
            cwd=self.workdir,
            stdout=self._stdout(),
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=self.env,
        )
        _LIVE.add(self.proc.pid)
        deadline = t0 + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self._log.name}")
            try:
                if self.ready():
                    return time.monotonic() - t0
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(0.02)
        self.kill9()
        raise TimeoutError(f"{self.name} not ready after 120 s")

    def _stdout(self):
        return self._log

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_bytes(self) -> int:
        return psutil.Process(self.pid).memory_info().rss

    def cpu_seconds(self) -> float:
        t = psutil.Process(self.pid).cpu_times()
        return t.user + t.system

    def _reap(self, sig: int, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            os.kill(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait(10)
        _LIVE.discard(self.proc.pid)
        self.proc = None
        if self._log:
            self._log.close()
            self._log = None
        return code

    def stop(self) -> int | None:
        return self._reap(signal.SIGTERM, 60)

    def kill9(self) -> None:
        self._reap(signal.SIGKILL, 10)


class QdelayDriver(Driver):
    name = "qdelay"
    LINE = re.compile(rb"qdelay listening on (\S+):(\d+)")

    def __init__(self, flush: str = "sync", extra: list[str] | None = None) -> None:
        super().__init__()
        self.flush = flush
        self.extra = list(extra or [])
        self._metrics_port: int | None = None
        if flush != "sync":
            self.name = f"qdelay-{flush.replace(':', '')}"
        self._buf = b""

    def argv(self):
        return [
            sys.executable,
            "-m",
            "qdelay.cli",
            "server",
            "--data-dir",
            os.path.join(self.workdir, "data"),
            "--listen",
            f"127.0.0.1:{self.port}",
            "--flush",
            self.flush,
            "--log-level",
            "warning",
            # its gauges say where the memory is (bench.compare's memory scenario)
            "--metrics-listen",
            f"127.0.0.1:{self.metrics_port}",
            *self.extra,
        ]

    @property
    def metrics_port(self) -> int:
        if self._metrics_port is None:
            self._metrics_port = free_port()
        return self._metrics_port

    def gauges(self) -> dict[str, float]:
        """The server's unlabelled ``qdelay_*`` metrics, scraped now."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        return {m[1]: float(m[2]) for m in re.finditer(r"^(qdelay_\w+) (\S+)$", text, re.M)}

    def _stdout(self):
        return subprocess.PIPE

    def ready(self) -> bool:
        ready, _, _ = select.select([self.proc.stdout], [], [], 0.05)
        if ready:
            self._buf += os.read(self.proc.stdout.fileno(), 4096)
        if self.LINE.search(self._buf):
            self._buf = b""
            # keep draining stdout so the server never blocks on a full pipe
            threading.Thread(target=self.proc.stdout.read, daemon=True).start()
            return True
        return False

    def client_spec(self):
        return ("bench.peers:QdelayClient", {"address": f"127.0.0.1:{self.port}"})


class RedisDriver(Driver):
    name = "redis-always"

    def __init__(self, fsync: str = "always", poll_ms: float = 5.0) -> None:
        super().__init__()
        self.fsync = fsync
        self.poll_ms = poll_ms
        self.name = f"redis-{fsync}"

    def available(self):
        if shutil.which("redis-server") is None:
            return "redis-server not installed (make bench-deps)"
        try:
            import redis  # noqa: F401
        except ImportError:
            return "redis-py not installed (pip install -e '.[bench]')"
        return None

    def argv(self):
        return [
            "redis-server",
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            self.workdir,
            "--daemonize",
            "no",
            "--protected-mode",
            "no",
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            self.fsync,
            "--logfile",
            "redis-server.log",
        ]

    def ready(self):
        import redis

        r = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, socket_connect_timeout=1)
        try:
            return bool(r.ping())
        finally:
            r.close()

    def client_spec(self):
        return ("bench.peers:RedisClient", {"port": self.port, "poll_ms": self.poll_ms})


class BeanstalkdDriver(Driver):
    name = "beanstalkd-f0"
    delay_resolution_ms = 1000

    def available(self):
        return None if shutil.which("beanstalkd") else "beanstalkd not installed (make bench-deps)"

    def argv(self):
        binlog = os.path.join(self.workdir, "binlog")
        os.makedirs(binlog, exist_ok=True)
        return ["beanstalkd", "-l", "127.0.0.1", "-p", str(self.port), "-b", binlog, "-f", "0"]

    def ready(self):
        BeanstalkClient(self.port, timeout=5).close()
        return True

    def client_spec(self):
        return ("bench.peers:BeanstalkClient", {"port": self.port})


DRIVERS = {"qdelay": QdelayDriver, "redis-always": RedisDriver, "beanstalkd-f0": BeanstalkdDriver}


# ------------------------------------------------------------------------------------- clients
class BenchClient(abc.ABC):
    """send_batch(Chunk) -> effective dues or None, once durably acknowledged;
    consume(on_batch(ids, t), stop) takes due messages, hands them over and acknowledges them."""

    @abc.abstractmethod
    def send_batch(self, msgs):
        """Each driver or client defines this."""

    def send_batches(self, chunks, batch: int) -> list:
        """send_batch for each chunk (of ``batch`` messages) of an iterable, one batch in flight (how the peers'
        client libraries are driven); a client with a pipelined bulk API overrides it.
        Returns send_batch's result per chunk, in order."""
        return [self.send_batch(chunk) for chunk in chunks]

    @abc.abstractmethod
    def consume(self, on_batch, stop: threading.Event) -> None:
        """Each driver or client defines this."""

    def close(self) -> None:  # noqa: B027 - optional hook: most drivers hold nothing to close
        pass


class QdelayClient(BenchClient):
    def __init__(self, address: str, max_in_flight: int = 5000) -> None:
        from qdelay.client import Client

        self.address = address
        self.max_in_flight = max_in_flight
        self.client = Client(address, retries=0, timeout=60)
        from qdelay.v1 import qdelay_pb2

        self.pb = qdelay_pb2

    def send_batch(self, msgs: Chunk):
        M = self.pb.Message
        self.client.send_batch(
            [M(subject="bench", payload=p, message_id=str(i), deliver_at_ms=due) for i, due, p in zip(*msgs)]
        )
        return None

    def send_batches(self, chunks, batch: int) -> list:
        """The Python client's bulk API: ``send_many`` of ``Outgoing`` tuples pipelines batches
        over SendStream (PIPELINE batches unanswered); every message is durable when it returns.
        Each chunk's ``Outgoing`` are made by ``map`` over its columns (the message id as the
        id's ``str``), with no Python frame a message: the cheapest way a producer that holds
        its messages' fields can feed ``send_many``."""
        from qdelay.client import Outgoing

        sizes: list[int] = []

        def outgoing(chunk: Chunk):
            sizes.append(len(chunk.ids))
            return map(Outgoing, repeat("bench"), chunk.payloads, chunk.dues, repeat(None), map(str, chunk.ids))

        self.client.send_many(chain.from_iterable(map(outgoing, chunks)), batch_size=batch, max_in_flight=PIPELINE)
        return [None] * len(sizes)

    def consume(self, on_batch, stop):
        from qdelay import errors
        from qdelay.client import Client

        while not stop.is_set():
            client = Client(self.address, retries=0)
            consumer = client.subscribe("bench", max_in_flight=self.max_in_flight)
            watcher = threading.Thread(target=lambda c=consumer: (stop.wait(), c.close()), daemon=True)
            watcher.start()
            try:
                for batch in consumer.batches():
                    t = time.time()
                    on_batch([int(d.message_id) for d in batch], t)
                    consumer.ack(batch)
            except errors.QdelayError:
                time.sleep(0.05)  # server gone (crash scenario): subscribe again
            finally:
                consumer.close()
                client.close()

    def close(self):
        self.client.close()


LUA_POP = """
local items = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
if #items > 0 then redis.call('ZREM', KEYS[1], unpack(items)) end
return items
"""


class RedisClient(BenchClient):
    def __init__(self, port: int, poll_ms: float = 5.0, key: str = "dq") -> None:
        import redis

        self.redis_mod = redis
        self.port = port
        self.r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=60, socket_connect_timeout=3)
        self.poll_s = poll_ms / 1000.0
        self.key = key

    def send_batch(self, msgs: Chunk):
        p = self.r.pipeline(transaction=False)
        for due, payload in zip(msgs.dues, msgs.payloads):
            p.zadd(self.key, {payload: due})
        p.execute()
        return None

    def consume(self, on_batch, stop):
        r = None
        script = None
        while not stop.is_set():
            try:
                if r is None:
                    r = self.redis_mod.Redis(
                        host="127.0.0.1", port=self.port, socket_timeout=10, socket_connect_timeout=1
                    )
                    script = r.register_script(LUA_POP)
                items = script(keys=[self.key], args=[int(time.time() * 1000), 1000])
            except Exception:  # noqa: BLE001 - server gone: reconnect
                r = None
                time.sleep(0.05)
                continue
            if items:
                on_batch([decode_id(x) for x in items], time.time())
            else:
                time.sleep(self.poll_s)

    def close(self):
        self.r.close()


class BeanstalkClient(BenchClient):
    def __init__(self, port: int, tube: str = "dq", timeout: float = 60.0) -> None:
        self.port = port
        self.tube = tube
        self.timeout = timeout
        self._connect()

    def _connect(self) -> None:
        self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=3)
        self.sock.settimeout(self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()
        t = self.tube.encode()
        self.sock.sendall(b"use %s\r\nwatch %s\r\nignore default\r\n" % (t, t))
        for _ in range(3):
            self._line()

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("beanstalkd closed the connection")
        self.buf += chunk

    def _line(self) -> bytes:
        while True:
            i = self.buf.find(b"\r\n")
            if i >= 0:
                line = bytes(self.buf[:i])
                del self.buf[: i + 2]
                return line
            self._fill()

    def _exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    def send_batch(self, msgs: Chunk):
        now = time.time() * 1000.0
        out, eff = [], []
        for due, payload in zip(msgs.dues, msgs.payloads):
            d = max(0, math.ceil((due - now) / 1000.0))
            eff.append(now + d * 1000.0)
            out.append(b"put 0 %d 120 %d\r\n%s\r\n" % (d, len(payload), payload))
        self.sock.sendall(b"".join(out))
        for _ in msgs.ids:
            line = self._line()
            if not line.startswith(b"INSERTED"):
                raise RuntimeError(f"put failed: {line!r}")
        return eff

    def _reserve(self):
        line = self._line()
        if line.startswith(b"RESERVED"):
            _, jid, n = line.split()
            return int(jid), self._exact(int(n) + 2)[:-2]
        if line in (b"TIMED_OUT", b"DEADLINE_SOON"):
            return None
        raise RuntimeError(f"reserve failed: {line!r}")

    def consume(self, on_batch, stop):
        while not stop.is_set():
            try:
                self.sock.sendall(b"reserve-with-timeout 1\r\n")
                first = self._reserve()
                if first is None:
                    continue
                got = [first]
                self.sock.sendall(b"reserve-with-timeout 0\r\n" * 999)
                for _ in range(999):
                    r = self._reserve()
                    if r is not None:
                        got.append(r)
                on_batch([decode_id(body) for _, body in got], time.time())
                self.sock.sendall(b"".join(b"delete %d\r\n" % jid for jid, _ in got))
                for _ in got:
                    self._line()
            except (OSError, ConnectionError, RuntimeError):
                time.sleep(0.05)
                try:
                    self._connect()
                except OSError:
                    pass

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass
