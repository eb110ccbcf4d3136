"""Assembly of a server: engine + grpc.aio server + health + reflection + metrics.

Start-up prints exactly one line on stdout, ``qdelay listening on HOST:PORT`` (the real
port when the listen address asked for port 0), once calls are accepted.

SIGTERM (or SIGINT) drains gracefully within one deadline, ``grace_seconds`` from the
signal, that every step shares (``App.stop``; docs/internals.md "Stopping"): health goes
NOT_SERVING and new writes and subscriptions are refused (UNAVAILABLE); no new deliveries
are handed out and consumers get up to ``ACK_GRACE_SECONDS`` to acknowledge what they hold;
subscription streams end; writes under way finish; the replication hook ends its streams
(a slave's Pull stream once that slave confirmed everything); the remaining calls get what
is left of the deadline; the engine flushes and checkpoints (``engine.close()``), and the
process exits 0. Streams the server can end are ended by it, never waited out.

Extension point: a module ``qdelay.replication.hooks`` with ``install(server, engine, cfg)``
(returning an optional async ``stop(deadline)``, ``deadline`` a ``time.monotonic()`` instant)
adds its services to the same gRPC server; its optional ``before_open(cfg)`` runs before the
engine opens the data folder, and its optional ``abort_before_open()`` is called on a stop
signal that comes meanwhile (a resync under way is abandoned, not waited out).

Re-execution: the replication node may ask the App to stop and start again
(``App.restart_process``, a slave's automatic full resync): the same drain as SIGTERM, then
``serve`` executes the same command line again in this process (same pid, same listen
address), keeping the data folder's lock held across the exec (segments/folder_lock.py).
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import importlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from qdelay.addresses import parse_hostport
from qdelay.cancellation import cancel_and_wait
from qdelay.server import auth
from qdelay.server.config import ServerConfig
from qdelay.server.consumers import ConsumerRegistry
from qdelay.server.metrics import Metrics
from qdelay.server.service import DelayService
from qdelay.threads import name_os_threads
from qdelay.v1 import qdelay_pb2 as pb
from qdelay.v1 import qdelay_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from qdelay.server.engine import Engine

log = logging.getLogger("qdelay.server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DelayService"].full_name
ACK_GRACE_SECONDS = 2.0
# the engine's last iterate catch-up gets what is left of the deadline, and at least this
ENGINE_CLOSE_MIN_SECONDS = 1.0
# a stop still running this long after its deadline dumps every thread's stack to the log:
# a stop that hangs says where
STOP_OVERRUN_SECONDS = 10.0
# once the engine is closed (everything durable, checkpoint written), the process exits
# within this long or dumps its threads' stacks and exits 1 (faulthandler): a thread or
# task that outlives the stop cannot keep a stopped server's process alive
EXIT_SECONDS = 10.0
# the health name a load balancer routing producers checks: SERVING only where writes go
MASTER_HEALTH_NAME = "qdelay.master"
HEALTH_POLL_SECONDS = 0.5


def _hook(name: str) -> Callable | None:
    """The function ``name`` of the replication hook module (``qdelay.replication.hooks``;
    the extension point above), None where the module or the function is absent."""
    try:
        hooks = importlib.import_module("qdelay.replication.hooks")
    except ModuleNotFoundError as e:
        if e.name not in ("qdelay.replication.hooks",):
            raise
        return None
    return getattr(hooks, name, None)


def _serving(yes: bool) -> int:
    return health_pb2.HealthCheckResponse.SERVING if yes else health_pb2.HealthCheckResponse.NOT_SERVING


class JsonFormatter(logging.Formatter):
    _SKIP = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in self._SKIP and not key.startswith("_"):
                out[key] = value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


class TextFormatter(logging.Formatter):
    _SKIP = JsonFormatter._SKIP

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extra = [f"{k}={v}" for k, v in record.__dict__.items() if k not in self._SKIP and not k.startswith("_")]
        return text + (" " + " ".join(extra) if extra else "")


def setup_logging(cfg: ServerConfig) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if cfg.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, cfg.log_level.upper(), logging.INFO))


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# decoded by the native codec from wire bytes (validation.decode_batch, decode_cancel_batch)
RAW_REQUEST_METHODS = ("SendBatch", "SendStream", "CancelBatch", "CancelStream")
# answered with wire bytes: SubscribeResponse (consumers.response_bytes), SendBatchResponse
# (service._batch_response), both from the native wire codec, and CancelBatchResponse
# (wire.encode_cancel_batch_response)
RAW_RESPONSE_METHODS = ("Subscribe", "SendBatch", "SendStream", "CancelBatch", "CancelStream")


class _HandlerRecorder:
    """Stands in for a server to capture the generated code's method handlers."""

    def __init__(self) -> None:
        self.handlers: dict = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.handlers = dict(handlers)


def add_delay_service(service: DelayService, server) -> None:
    """Register DelayService with the generated handlers, except that SendBatch,
    SendStream, CancelBatch and CancelStream get their requests as wire bytes and answer
    with wire bytes, and Subscribe yields its responses as wire bytes: the wire codec
    (qdelay/wire.py) decodes and encodes those in one pass (validation.decode_batch and
    decode_cancel_batch, service._batch_response, wire.encode_cancel_batch_response,
    consumers.response_bytes) instead of a protobuf object per message."""
    recorder = _HandlerRecorder()
    pb_grpc.add_DelayServiceServicer_to_server(service, recorder)
    handlers = recorder.handlers
    for name in RAW_REQUEST_METHODS:
        handlers[name] = handlers[name]._replace(request_deserializer=None)
    for name in RAW_RESPONSE_METHODS:
        handlers[name] = handlers[name]._replace(response_serializer=None)
    # The generic handler only, not also as registered methods (what the generated code
    # does): grpc.aio keeps one pending request per registered method and waits on all of
    # them for every call, besides the generic one. Without DelayService's, the generated
    # stub's SendBatch of 100 cost the server's event loop thread ~0.7 us a message less
    # (docs/benchmarks.md, 26 Nov); nothing else changes (the same handlers, looked up by name).
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


class StartAborted(Exception):
    """``App.start`` gave up before opening the data folder: a stop signal came first."""


class App:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.engine: Engine | None = None
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.metrics = Metrics()
        self.port = 0
        self.metrics_port = 0
        self.stopping = asyncio.Event()
        self._hook_stops: list[Callable[[float], Awaitable[object]]] = []  # stop(deadline)
        self.node = None  # the replication node (qdelay.replication.node.Node), when installed
        # restart_process: why the server stops to execute itself again, and the value of
        # $QDELAY_FOLDER_LOCK that keeps the folder locked across the exec (set at the stop)
        self.reexec_reason: str | None = None
        self.reexec_wanted = asyncio.Event()
        self.kept_lock: str | None = None
        # whether a stop can be followed by the re-execution (``_main`` runs this App and
        # sets it; an App run some other way, as in tests, offers no restart_process)
        self.can_reexec = False
        self.start_aborted = False  # a stop signal during start (abort_start)

    async def start(self) -> str:
        from qdelay.server.engine import Engine

        cfg = self.cfg
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        engine_cfg = cfg.engine
        await asyncio.to_thread(self._before_open)
        if self.start_aborted:
            # a stop signal came meanwhile (a resync abandoned): stop before opening anything,
            # so that nothing (a puller refused again) asks for another resync on the way out
            raise StartAborted()
        self.engine = engine = await asyncio.to_thread(Engine, engine_cfg)  # opens and recovers the data folder
        self.consumers = consumers = ConsumerRegistry(
            loop, engine_cfg.scheduler.ack_timeout_ms, notify=engine.notify_credit, release=engine.post_release
        )
        engine.set_sink(consumers)
        service: DelayService  # made below, once the engine runs; read by the metrics at a scrape
        self.metrics.attach(
            engine,
            extra=lambda: {
                "qdelay_consumers": ("Subscribe streams connected", len(consumers.subscriptions())),
                "qdelay_ingest_queue_messages": ("Messages waiting to become durable", service.gate.messages),
                "qdelay_dedupe_recent_ids": (
                    "Ids idempotent send remembers that the id index may not hold yet",
                    len(service.dedupe.recent),
                ),
                "qdelay_dedupe_recent_bytes": (
                    "Bytes of those ids' table (server/recent_ids.py) and their batches' joined ids",
                    service.dedupe.recent.nbytes,
                ),
            },
            consumers=consumers,
        )
        engine.start(cleaner=False)  # started below, once the replication hook holds the slaves' log
        self.service = service = DelayService(engine, cfg, consumers, self.metrics)

        interceptors = []
        if cfg.auth_token_file:
            interceptors.append(auth.BearerTokenInterceptor(auth.load_tokens(cfg.auth_token_file)))
        limit = cfg.limits.grpc_receive_limit()
        options = [
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
            ("grpc.keepalive_permit_without_calls", 1),
            # the clients' keepalive pings: accepted every min_ping_interval_ms while the
            # server sends nothing (grpc's default is 5 minutes: a client pinging every 30 s
            # on an idle stream would be sent GOAWAY too_many_pings after three pings)
            ("grpc.http2.min_ping_interval_without_data_ms", cfg.min_ping_interval_ms),
        ]
        self.server = server = grpc.aio.server(
            interceptors=interceptors, options=options, maximum_concurrent_rpcs=cfg.max_concurrent_rpcs or None
        )
        add_delay_service(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
        names += self._install_hooks(server, engine)
        # the hook set engine.replication_floor (the holds restored from the file): a pass
        # before it saw no slave and could delete the segments a stopped slave needs
        engine.start_cleaner()
        reflection.enable_server_reflection(names, server)

        listen = cfg.listen
        again = os.environ.pop(REEXEC_LISTEN_ENV, "")
        if again and parse_hostport(listen, "listen")[1] == 0:
            listen = again  # re-executed (_reexec): the port it had
        host, want_port = parse_hostport(listen, "listen")
        try:
            if cfg.tls_cert and cfg.tls_key:  # the config has both or neither
                port = server.add_secure_port(listen, auth.server_credentials(cfg.tls_cert, cfg.tls_key))
            else:
                port = server.add_insecure_port(listen)
        except RuntimeError:  # grpcio >= 1.60 raises where older ones returned 0
            port = 0
        if not port:
            # said in words: grpcio's RuntimeError reached the user as a traceback
            raise OSError(f"cannot listen on {cfg.listen}: the address is in use (another server?) or not this host's")
        self.port = port
        await server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(MASTER_HEALTH_NAME, _serving(engine.takes_writes()))
        if cfg.metrics_listen:
            mhost, mport = parse_hostport(cfg.metrics_listen, "metrics_listen")
            try:
                self.metrics_port = self.metrics.serve(mhost, mport)
            except OSError as e:
                raise OSError(f"cannot serve metrics on {cfg.metrics_listen}: {e.strerror or e}") from None
            log.info("metrics on %s", format_address(mhost, self.metrics_port))
        self._watch = asyncio.ensure_future(self._watch_health(engine))
        address = format_address(host, port)
        self.service.address = address
        if self.node is not None:
            self.service.agent = self.node.agent
            self.node.on_listening(address)
        log.info(
            "started",
            extra={
                "listen": address,
                "data_dir": cfg.data_dir,
                "role": engine.role,
                "tls": bool(cfg.tls_cert),
                "auth": bool(cfg.auth_token_file),
                "startup_seconds": round(time.monotonic() - started, 3),
                # as grpc-core read it at load (qdelay/cli.py sets the server's default)
                "grpc_experiments": os.environ.get("GRPC_EXPERIMENTS", ""),
            },
        )
        return address

    async def _watch_health(self, engine: Engine) -> None:
        """Health follows the engine: NOT_SERVING while its WAL, iterate or scheduler failed;
        ``qdelay.master`` SERVING only while this server takes writes (not on a slave, a fenced
        master, or a cluster master that cannot prove its lease)."""
        serving = True
        writes = engine.takes_writes()
        while True:
            await asyncio.sleep(HEALTH_POLL_SECONDS)
            healthy = engine.healthy()
            now_writes = healthy and engine.takes_writes()
            if now_writes != writes:
                writes = now_writes
                await self.health.set(MASTER_HEALTH_NAME, _serving(writes))
                log.info("health: %s %s", MASTER_HEALTH_NAME, "serving" if writes else "not serving")
            if healthy != serving:
                serving = healthy
                status = _serving(healthy)
                for name in ("", SERVICE_NAME):
                    await self.health.set(name, status)
                log.log(
                    logging.INFO if healthy else logging.ERROR,
                    "health: %s",
                    "serving" if healthy else "not serving (engine failed; see the errors above)",
                )

    def _before_open(self) -> None:
        """The replication hook's ``before_open(cfg)`` (a requested automatic full resync)."""
        before_open = _hook("before_open")
        if before_open is not None:
            before_open(self.cfg)

    def abort_start(self) -> None:
        """A stop signal during ``start``, before the engine opens: the replication hook's
        ``abort_before_open()`` abandons a resync under way in ``before_open`` (a copy of up
        to an hour, which the signal otherwise waited out), and ``start`` raises
        ``StartAborted`` once ``before_open`` returns, the folder unopened."""
        self.start_aborted = True
        abort = _hook("abort_before_open")
        if abort is not None:
            abort()

    def restart_process(self, reason: str) -> None:
        """Stop gracefully, then execute this server again (``serve``); event loop only."""
        if self.reexec_reason is None:
            log.info("restarting this server: %s", reason)  # (the caller's WARNING says why)
            self.reexec_reason = reason
            self.reexec_wanted.set()

    def _install_hooks(self, server, engine) -> list[str]:
        install = _hook("install")
        if install is None:
            return []
        result = install(server, engine, self.cfg)
        names: list[str] = []
        if isinstance(result, tuple):
            stop, names, *rest = result
            self.node = rest[0] if rest else None
        else:
            stop = result
        if self.can_reexec and self.node is not None and hasattr(self.node, "restart_process"):
            self.node.restart_process = self.restart_process
        if stop is not None:
            self._hook_stops.append(stop)
        return list(names)

    async def stop(self) -> None:
        """The drain (see the module's docstring): every wait below ends by ``deadline``,
        ``grace_seconds`` from now; only the engine's close goes past it, by its bounded
        last work (iterate catch-up of at least ENGINE_CLOSE_MIN_SECONDS, the message log's
        final fsync, the checkpoint)."""
        cfg = self.cfg
        started = time.monotonic()
        deadline = started + cfg.grace_seconds
        log.info("shutting down", extra={"deadline_seconds": cfg.grace_seconds})
        self._watch.cancel()
        await self.health.enter_graceful_shutdown()
        self.service.begin_shutdown()
        # no new deliveries; give consumers a moment to ack what they hold
        self.consumers.pause()
        ack_by = min(deadline, started + ACK_GRACE_SECONDS)
        while self.consumers.outstanding() and time.monotonic() < ack_by:
            await asyncio.sleep(0.02)
        self.consumers.close_all()
        # writes under way finish before the replication streams end (sync mode: a write
        # waits for a slave's confirmation, which needs its stream)
        while self.service.active_writes and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for stop in self._hook_stops:
            # bounded here too, not only inside: a cluster server's stop once hung here past
            # 30 s (a lease-renewal loop that lost its cancellation in asyncio.wait_for:
            # qdelay/cancellation.py); the steps after it (gRPC's stop, the engine's close
            # and checkpoint) must run whatever a hook does
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic()) + 1.0):
                    await stop(deadline)
            except TimeoutError:
                log.error("the replication hook did not stop by the shutdown deadline; closing anyway")
            except Exception:  # noqa: BLE001
                log.exception("replication hook stop failed")
        if self.server is not None:
            await self._stop_server(deadline)
        if self.engine is not None:
            if self.reexec_reason is not None:
                # a duplicate of the lock's descriptor outlives the engine's close and the exec
                self.kept_lock = self.engine.folder_lock.keep_across_exec()
            left = max(ENGINE_CLOSE_MIN_SECONDS, deadline - time.monotonic())
            await asyncio.to_thread(self.engine.close, left)
        self.metrics.close()
        log.info("stopped", extra={"stop_seconds": round(time.monotonic() - started, 3)})

    async def _stop_server(self, deadline: float) -> None:
        """gRPC's stop: calls still open at ``deadline`` are cancelled. grpc.aio then waits
        for every handler to return, with no bound of its own: a handler that outlives its
        cancellation is reported and left behind (the engine refuses its writes once closed)."""
        assert self.server is not None
        stopping = asyncio.ensure_future(self.server.stop(max(0.0, deadline - time.monotonic())))
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic()) + 1.0):
                await asyncio.shield(stopping)
        except TimeoutError:
            log.error("gRPC calls still running after the shutdown deadline and their cancellation; closing anyway")


# the address a re-executed server listens on when its --listen asked for port 0 (the port
# it had, not a new one: its slaves, clients and peers know it)
REEXEC_LISTEN_ENV = "QDELAY_REEXEC_LISTEN"


class Reexec:
    """``_main``'s answer when the server is to execute itself again (``App.restart_process``)."""

    def __init__(self, kept_lock: str | None, listen: str) -> None:
        self.kept_lock = kept_lock
        self.listen = listen


async def _main(cfg: ServerConfig) -> int | Reexec:
    app = App(cfg)
    app.can_reexec = True
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal() -> None:
        if not stop.is_set():
            stop.set()
            if app.engine is None:  # not open yet (a resync in before_open?): abandon it
                app.abort_start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        address = await app.start()
    except StartAborted:
        log.info("stopped before opening the data folder (a signal during start-up)")
        return 0
    except BaseException:
        if app.server is not None:
            await app.server.stop(None)
        if app.engine is not None:
            await asyncio.to_thread(app.engine.close)
        raise
    print(f"qdelay listening on {address}", flush=True)
    signalled = asyncio.ensure_future(stop.wait())
    restart = asyncio.ensure_future(app.reexec_wanted.wait())
    await asyncio.wait([signalled, restart], return_when=asyncio.FIRST_COMPLETED)
    await cancel_and_wait([signalled, restart])
    # process-wide watchdogs (faulthandler has one timer), so here and not in App.stop,
    # which tests also run in their own process
    faulthandler.dump_traceback_later(cfg.grace_seconds + STOP_OVERRUN_SECONDS, exit=False)
    # faulthandler shows threads only: a stop that hangs in an await (the event loop idle)
    # says where through the tasks' stacks
    overrun = loop.call_later(cfg.grace_seconds + STOP_OVERRUN_SECONDS, dump_tasks)
    await app.stop()
    overrun.cancel()
    if app.reexec_reason is not None:
        # from here to the exec a signal takes its default action (the process ends, the
        # folder's lock with it): set on ``stop`` after this check, nothing would read it,
        # and the server would start again instead of stopping
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if not stop.is_set():  # a signal meanwhile: just stop
            # the same exit watchdog as a stop's: asyncio.run's end waits for the worker
            # threads without a bound, and a stuck one must not keep a server that is
            # neither serving nor re-executed (the exec replaces the process, the timer too)
            faulthandler.dump_traceback_later(EXIT_SECONDS, exit=True)
            return Reexec(app.kept_lock, address)
    faulthandler.dump_traceback_later(EXIT_SECONDS, exit=True)
    return 0


def dump_tasks() -> None:
    """Every asyncio task's stack to stderr (where faulthandler writes the threads')."""
    tasks = asyncio.all_tasks()
    print(f"--- stop overran its deadline: {len(tasks)} asyncio tasks ---", file=sys.stderr, flush=True)
    for task in tasks:
        task.print_stack(file=sys.stderr)
    sys.stderr.flush()


def tune_runtime() -> None:
    """Keep the start-up objects (modules, protobuf descriptors) out of every later full
    garbage collection: shorter pauses on the delivery path."""
    gc.collect()
    gc.freeze()


def warn_stale_build() -> None:
    """One WARNING when this server runs a C extension built before its source last changed
    (a source tree whose ``make setup`` failed or was not run again): the old build's
    functions are not this code's (a stale codec made the WAL writer fail). Nothing in an
    installed package, where no source is beside the build (``extensions.stale_builds``,
    the check ``bench.require_built`` and ``make setup`` make too)."""
    from qdelay.extensions import stale_builds

    found = stale_builds()
    if found:
        log.warning(
            "a C extension is older than its source: run `make setup` to build it again",
            extra={"stale": "; ".join(f"{name}: {why}" for name, why in found.items())},
        )


def serve(cfg: ServerConfig) -> int:
    setup_logging(cfg)
    warn_stale_build()
    tune_runtime()
    # before any thread starts: each carries its name in top -H, py-spy and /proc (the
    # event loop is the thread whose id is the pid)
    name_os_threads()
    result = asyncio.run(_main(cfg))
    if isinstance(result, Reexec):
        return _reexec(result)
    return result


def _reexec(result: Reexec) -> int:
    """Execute this server's command line again in this process (same pid: a supervisor
    sees no exit; same listen address), the folder's lock kept held across the exec."""
    from qdelay.segments.folder_lock import INHERIT_ENV

    if result.kept_lock:
        os.environ[INHERIT_ENV] = result.kept_lock
    os.environ[REEXEC_LISTEN_ENV] = result.listen
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    log.info("executing again: %s", " ".join(argv))
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(sys.executable, argv)
    except OSError as e:
        log.error("cannot execute the server again (%s): start it again by hand", e)
    return 1
