"""Server configuration: defaults, a TOML file, and command-line flags (flags win).

File layout (every key optional; unknown keys are an error so that typos do not pass
silently)::

    listen = "127.0.0.1:7600"
    data_dir = "./data"
    role = "master"                 # or "slave"
    master = "10.0.0.1:7600"        # slave only: where to pull from
    replication = "async"           # or "sync"
    replication_timeout_ms = 5000   # sync: answer UNAVAILABLE if no slave confirmed by then
    peers = "10.0.0.2:7600,10.0.0.3:7600"  # other cluster members: fencing and failover
    slave_hold_ms = 3600000         # the master keeps its log this long for a slave away
    auto_resync = true              # slave: a full resync by itself when refused as behind
                                    # the master's retention (replication/autoresync.py)
    replication_tls_ca = "/etc/qdelay/ca.crt"  # slave/admin: CA to verify the master's TLS
    replication_token_file = "/etc/qdelay/tokens"  # slave/admin: token to present (default:
                                    # the first line of auth_token_file)
    auth_token_file = "/etc/qdelay/tokens"
    etcd = "10.0.0.9:2379,10.0.0.10:2379"  # cluster mode: membership, leadership, failover
    cluster = "orders"              # cluster mode: the cluster's name (its etcd prefix)
    shard = "s1"                    # cluster mode: this server's shard (master + slaves)
    advertise = "10.0.0.1:7600"     # cluster mode: the address others reach this server at
    lease_ttl_ms = 5000             # etcd lease TTL (whole seconds): failover starts after it
    lease_renew_ms = 1000           # how often the lease is renewed
    lease_deadline_ms = 3500        # a master stops acknowledging this long after its last
                                    # renewal was sent (< TTL: before another can be elected)
    sync_bound_ms = 2000            # a slave is in sync if it has what the master had then
                                    # (cluster mode: who may take over; any mode: Status)
    tls_cert = "/etc/qdelay/server.crt"
    tls_key = "/etc/qdelay/server.key"
    metrics_listen = "127.0.0.1:9600"
    min_free_bytes = 536870912      # refuse new messages below this much free disk
    min_free_bytes_hard = 16777216  # refuse cancels too below this
    ingest_queue_messages = 200000  # messages accepted but not yet durable, server-wide
    ingest_queue_bytes = 536870912
    grace_seconds = 10              # SIGTERM: the stop's one deadline, shared by every step
    log_level = "info"
    log_format = "text"             # or "json"

    [limits]
    max_payload_bytes = 4194304
    max_batch = 10000
    ...

    [engine]                        # mapped onto qdelay.server.engine.EngineConfig (ENGINE_KEYS)
    flush = "sync"
    ack_timeout_ms = 30000
    ...
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qdelay.addresses import parse_hostport
from qdelay.errors import InvalidArgument

if TYPE_CHECKING:
    from qdelay.server.engine import EngineConfig

DEFAULT_LISTEN = "127.0.0.1:7600"
LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_DATA_DIR = "./data"
YEAR_MS = 365 * 86400 * 1000


class ConfigError(InvalidArgument):
    """The configuration (file or flags) is invalid; the server refuses to start."""


@dataclass
class Limits:
    """Request limits of the API contract; validated on every request."""

    max_subject_len: int = 255
    max_payload_bytes: int = 4 * 1024 * 1024
    max_headers: int = 64
    max_header_key_bytes: int = 128
    max_headers_bytes: int = 16 * 1024
    max_message_id_bytes: int = 128
    max_batch: int = 10_000
    max_delay_ms: int = 2 * YEAR_MS
    # gRPC's receive cap: one request (a batch) may be at most this large
    max_request_bytes: int = 64 * 1024 * 1024

    def grpc_receive_limit(self) -> int:
        # a single message of the maximum payload, with room for its envelope, always fits
        return max(self.max_request_bytes, self.max_payload_bytes + 64 * 1024 + self.max_headers_bytes)


@dataclass
class ServerConfig:
    listen: str = DEFAULT_LISTEN
    data_dir: str = DEFAULT_DATA_DIR
    role: str = "master"
    master: str | None = None
    replication: str = "async"
    replication_timeout_ms: int = 5000
    peers: str | None = None
    replication_tls_ca: str | None = None
    replication_tls_server_name: str | None = None
    replication_token_file: str | None = None
    replication_batch_bytes: int = 1024 * 1024
    # how long the master keeps message-log segments for a slave that disconnected
    slave_hold_ms: int = 3_600_000
    # ... and at most this many bytes of it behind the log's end (0: no bound by size)
    slave_hold_bytes: int = 0
    # slave: refused as behind the master's retention (away longer than its hold), resync the
    # folder from the master's snapshot by itself (replication/autoresync.py)
    auto_resync: bool = True
    # cluster mode (replication/cluster.py): etcd endpoints, names, lease timing
    etcd: str | None = None
    cluster: str | None = None
    shard: str | None = None
    advertise: str | None = None
    lease_ttl_ms: int = 5000
    lease_renew_ms: int = 1000
    lease_deadline_ms: int = 3500
    sync_bound_ms: int = 2000
    auth_token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    metrics_listen: str | None = None
    min_free_bytes: int = 512 * 1024 * 1024
    min_free_bytes_hard: int = 16 * 1024 * 1024
    ingest_queue_messages: int = 200_000
    ingest_queue_bytes: int = 512 * 1024 * 1024
    # Subscribe: default credit, and the size of one SubscribeResponse
    default_max_in_flight: int = 1000
    max_deliveries_per_response: int = 1000
    max_response_bytes: int = 2 * 1024 * 1024
    max_concurrent_rpcs: int = 10_000
    # the shortest interval between a client's HTTP/2 keepalive pings that the server accepts
    # on a connection it sends nothing on (faster ones get GOAWAY "too_many_pings"; the
    # Python and Node clients ping every 30 s while a call is open)
    min_ping_interval_ms: int = 10_000
    grace_seconds: float = 10.0  # SIGTERM: one deadline for the whole stop (App.stop)
    log_level: str = "info"
    log_format: str = "text"
    limits: Limits = field(default_factory=Limits)
    # options for EngineConfig (data_dir, role and max_delay_ms are filled in from above)
    engine_options: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------------------------
    @property
    def engine(self) -> EngineConfig:
        """The :class:`qdelay.server.engine.EngineConfig` this server runs with."""
        return build_engine_config(self)

    def validate(self) -> ServerConfig:
        self._validate_types()
        parse_hostport(self.listen, "listen", ConfigError)
        if self.metrics_listen:
            parse_hostport(self.metrics_listen, "metrics_listen", ConfigError)
        if self.role not in ("master", "slave"):
            raise ConfigError(f"role must be 'master' or 'slave', not {self.role!r}")
        if self.replication not in ("sync", "async"):
            raise ConfigError(f"replication must be 'sync' or 'async', not {self.replication!r}")
        if self.role == "slave" and not self.master:
            raise ConfigError("role 'slave' needs --master HOST:PORT")
        if self.master:
            parse_hostport(self.master, "master", ConfigError)
        for peer in self.peer_list():
            parse_hostport(peer, "peers", ConfigError)
        if self.etcd:
            self._validate_cluster(self.etcd)
        elif self.cluster or self.shard:
            raise ConfigError("--cluster and --shard need --etcd HOST:PORT[,...]")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("TLS needs both --tls-cert and --tls-key")
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"log_format must be 'text' or 'json', not {self.log_format!r}")
        if not isinstance(self.log_level, str) or self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)}, not {self.log_level!r}")
        if os.path.exists(self.data_dir) and not os.path.isdir(self.data_dir):
            raise ConfigError(f"data_dir {self.data_dir} is not a folder")
        self._validate_files()
        for f in dataclasses.fields(Limits):
            value = getattr(self.limits, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"limits.{f.name} must be a positive integer, not {value!r}")
        if self.limits.max_subject_len > 65535 or self.limits.max_message_id_bytes > 65535:
            raise ConfigError("subject and message_id limits must fit the record format (65535 bytes)")
        if self.limits.max_payload_bytes >= 2**31:
            raise ConfigError("limits.max_payload_bytes must be below 2 GiB")
        check_engine_options(self)
        return self

    def _validate_types(self) -> None:
        """Each top-level key has its default's type (``wanted``; a key whose default is None
        a string or None): ``listen = 7600`` ended in an AttributeError traceback, and
        ``grace_seconds = "10"`` started the server and broke its SIGTERM drain (a TypeError
        before the engine closed)."""
        for f in dataclasses.fields(self):
            if f.name in ("limits", "engine_options"):
                continue
            value, default = getattr(self, f.name), f.default
            if default is None:
                if f.name == "peers" and isinstance(value, list) and all(isinstance(p, str) for p in value):
                    continue  # a list when built in code
                want = None if value is None else wanted(value, "")
            else:
                want = wanted(value, default)
            if want is not None:
                raise ConfigError(f"{f.name} must be {want}, not {value!r}")

    def _validate_files(self) -> None:
        """Every file the server reads at start-up is readable now: a missing TLS key or token
        file is a configuration error (exit 2, the key named) before the data folder is
        opened, not an ``[Errno 2]`` without the key once the engine has started."""
        for key in ("auth_token_file", "replication_token_file", "tls_cert", "tls_key", "replication_tls_ca"):
            path = getattr(self, key)
            if not path:
                continue
            try:
                with open(path, "rb") as f:
                    text = f.read()
            except OSError as e:
                raise ConfigError(f"{key} {path}: cannot read it: {e.strerror}") from None
            if key.endswith("token_file") and not any(
                line.strip() and not line.lstrip().startswith(b"#") for line in text.splitlines()
            ):
                raise ConfigError(f"{key} {path} holds no token (one per line; blank lines and # comments are skipped)")

    def _validate_cluster(self, etcd: str) -> None:
        for e in etcd.split(","):
            parse_hostport(e.strip().removeprefix("http://"), "etcd", ConfigError)
        name = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
        for what in ("cluster", "shard"):
            value = getattr(self, what)
            if not value or not name.match(value):
                raise ConfigError(f"cluster mode needs --{what} NAME ([A-Za-z0-9._-]{{1,64}}), not {value!r}")
        if self.advertise:
            parse_hostport(self.advertise, "advertise", ConfigError)
        if self.role != "master" or self.master or self.peers:
            raise ConfigError("cluster mode (--etcd) elects masters by itself: leave out --role, --master and --peers")
        ttl, renew, deadline = self.lease_ttl_ms, self.lease_renew_ms, self.lease_deadline_ms
        if ttl % 1000 or ttl < 1000:
            raise ConfigError(f"lease_ttl_ms must be a multiple of 1000 (etcd counts whole seconds), not {ttl}")
        if not 0 < renew < deadline < ttl:
            raise ConfigError(
                f"need 0 < lease_renew_ms ({renew}) < lease_deadline_ms ({deadline}) < lease_ttl_ms ({ttl}): "
                f"a master must stop acknowledging before its lease can expire"
            )

    def peer_list(self) -> list[str]:
        peers: str | list[str] = self.peers or []  # a list when built in code
        if isinstance(peers, str):
            peers = peers.split(",")
        return [p.strip() for p in peers if p and p.strip()]


_SCALARS = {f.name for f in dataclasses.fields(ServerConfig)} - {"limits", "engine_options"}


def from_mapping(data: dict[str, Any], base: ServerConfig | None = None, source: str = "config") -> ServerConfig:
    """Apply a parsed TOML document over ``base`` (defaults when None)."""
    cfg = base or ServerConfig()
    for key, value in data.items():
        if key == "limits":
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: [limits] must be a table")
            known = {f.name for f in dataclasses.fields(Limits)}
            for lk, lv in value.items():
                if lk not in known:
                    raise ConfigError(f"{source}: unknown key limits.{lk} (known: {', '.join(sorted(known))})")
                setattr(cfg.limits, lk, lv)
        elif key == "engine":
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: [engine] must be a table")
            cfg.engine_options.update(value)
        elif key in _SCALARS:
            setattr(cfg, key, value)
        else:
            raise ConfigError(f"{source}: unknown key {key!r}")
    return cfg


def load_file(path: str, base: ServerConfig | None = None) -> ServerConfig:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: {e}") from None
    return from_mapping(data, base, source=path)


# The ``[engine]`` keys (docs/operations.md), flat as users write them, and where each one
# lives inside EngineConfig: the engine's own field, or a field of the config of the piece
# that uses it (EngineConfig.scheduler, EngineConfig.cleaner). This table is the only place
# that maps one to the other.
ENGINE_KEYS: dict[str, tuple[str | None, str]] = {
    "data_dir": (None, "data_dir"),
    "role": (None, "role"),
    "max_delay_ms": (None, "max_delay_ms"),
    "segment_bytes": (None, "segment_bytes"),
    "flush": (None, "flush"),
    "dead_letter_prefix": (None, "dead_letter_prefix"),
    "corruption": (None, "corruption"),
    "open_files": (None, "open_files"),
    "checkpoint_interval_ms": (None, "checkpoint_interval_ms"),
    "iterate_gather_ms": (None, "iterate_gather_ms"),
    "iterate_gather_far_ms": (None, "iterate_gather_far_ms"),
    "id_index": (None, "id_index"),
    "dedupe_window_ms": (None, "dedupe_window_ms"),
    "scale_minutes": ("scheduler", "scale_minutes"),
    "load_ahead_ms": ("scheduler", "load_ahead_ms"),
    "tick_ms": ("scheduler", "tick_ms"),
    "dispatch_rate": ("scheduler", "dispatch_rate"),
    "ack_timeout_ms": ("scheduler", "ack_timeout_ms"),
    "max_attempts": ("scheduler", "max_attempts"),
    "retry_backoff_ms": ("scheduler", "retry_backoff_ms"),
    "max_loaded": ("scheduler", "max_loaded"),
    "group_max_ready": ("scheduler", "group_max_ready"),
    "group_max_ready_of": ("scheduler", "group_max_ready_of"),
    "implicit_group": ("scheduler", "implicit_group"),
    "cleaner_enabled": ("cleaner", "enabled"),
    "cleaner_interval_ms": ("cleaner", "interval_ms"),
    "message_retention_ms": ("cleaner", "message_retention_ms"),
    "schedule_keep_ms": ("cleaner", "schedule_keep_ms"),
}


# EngineConfig fields filled in from the server's top-level keys (build_engine_config), never
# [engine] options: the key a user sets instead.
DERIVED_ENGINE_KEYS = {
    "data_dir": "the top-level data_dir (--data-dir)",
    "role": "the top-level role (--role)",
    "max_delay_ms": "limits.max_delay_ms",
}


def engine_config(**options: Any) -> EngineConfig:
    """An EngineConfig from flat ``[engine]`` keys (``ack_timeout_ms=500``, ...): each goes
    to its place (ENGINE_KEYS); the rest keep their defaults. Unknown keys are an error."""
    from qdelay.server.engine import EngineConfig  # the engine is imported only when needed

    unknown = sorted(set(options) - set(ENGINE_KEYS))
    if unknown:
        known = sorted(set(ENGINE_KEYS) - set(DERIVED_ENGINE_KEYS))
        raise ConfigError(f"unknown [engine] option(s) {', '.join(unknown)} (known: {', '.join(known)})")
    ecfg = EngineConfig()
    for key, value in options.items():
        section, name = ENGINE_KEYS[key]
        if key == "group_max_ready_of":
            value = _group_bounds(value)
        setattr(ecfg if section is None else getattr(ecfg, section), name, value)
    return ecfg


_GROUP_KEY = re.compile(r"[A-Za-z0-9._-]+/[A-Za-z0-9._-]+")


def _group_bounds(value: Any) -> dict[str, int]:
    """``[engine.group_max_ready_of]``: "SUBJECT/GROUP" = entries, each a positive integer."""
    if not isinstance(value, dict):
        raise ConfigError(
            'engine.group_max_ready_of: a table of "SUBJECT/GROUP" = entries, '
            "e.g. --set 'engine.group_max_ready_of={\"orders.close/billing\" = 500000}'"
        )
    out: dict[str, int] = {}
    for key, bound in value.items():
        if not _GROUP_KEY.fullmatch(key):
            raise ConfigError(f'engine.group_max_ready_of: key {key!r} is not "SUBJECT/GROUP"')
        if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
            raise ConfigError(f"engine.group_max_ready_of.{key}: {bound!r} is not a positive number of entries")
        out[key] = bound
    return out


def wanted(value: Any, default: Any) -> str | None:
    """What a setting whose default is ``default`` must be, if ``value`` is not that (a bool
    for a bool, a non-negative int for an int, a non-negative number for a float, a string
    for a string); None if it is, or for a default of another type. The one type rule of
    the top-level keys and the ``[engine]`` ones."""
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "true or false"
    number = not isinstance(value, bool) and isinstance(value, int | float)
    if isinstance(default, int):
        return None if number and isinstance(value, int) and value >= 0 else "a non-negative integer"
    if isinstance(default, float):
        return None if number and value >= 0 else "a non-negative number"
    if isinstance(default, str):
        return None if isinstance(value, str) else "a string"
    return None


# [engine] keys where 0 is no setting at all: tick_ms = 0 ended in a ValueError traceback,
# cleaner_interval_ms = 0 spun the cleaner thread on a core, max_loaded = 0 (or
# group_max_ready = 0) loaded nothing, so nothing was ever delivered
POSITIVE_ENGINE_KEYS = frozenset({"tick_ms", "segment_bytes", "max_loaded", "group_max_ready", "cleaner_interval_ms"})


def check_engine_options(cfg: ServerConfig) -> None:
    """The ``[engine]`` options have the types and ranges the engine needs. Checked with the
    rest of the configuration, so that ``--set engine.ack_timeout_ms=abc`` (a bare word is a
    string) or ``--flush sometimes`` is a configuration error naming the key (exit 2), not a
    TypeError traceback once the data folder is open."""
    from qdelay.segments.wal import FlushPolicy
    from qdelay.server.engine import EngineConfig

    ecfg = build_engine_config(cfg)  # unknown and server-filled keys are refused here
    defaults = EngineConfig()
    for key, value in cfg.engine_options.items():
        section, name = ENGINE_KEYS[key]
        default = getattr(defaults if section is None else getattr(defaults, section), name)
        want = wanted(value, default)  # (group_max_ready_of, a dict: checked by _group_bounds)
        if want is None and key in POSITIVE_ENGINE_KEYS and value < 1:
            want = "a positive integer"
        if want is not None:
            raise ConfigError(f"engine.{key} must be {want}, not {value!r}")
    try:
        FlushPolicy.parse(ecfg.flush)
    except ValueError as e:
        raise ConfigError(f"engine.flush (--flush): {e}") from None
    try:
        ecfg.validate()
    except InvalidArgument as e:
        raise ConfigError(f"engine.{e}") from None


def build_engine_config(cfg: ServerConfig) -> EngineConfig:
    """EngineConfig from the server config: [engine] options plus data_dir, role, max delay."""
    options = dict(cfg.engine_options)
    # cluster mode: a server starts as a slave (no writes, no dispatch) until etcd makes it master
    role = "slave" if cfg.etcd else cfg.role
    derived = {"data_dir": cfg.data_dir, "role": role, "max_delay_ms": cfg.limits.max_delay_ms}
    # these come from the server's own keys only: an [engine] data_dir (or --set
    # engine.data_dir) used to win over --data-dir, putting the logs in another folder than
    # the rest, and an [engine] role = "master" started a cluster node as a master before etcd
    # elected it
    given = sorted(set(options) & set(DERIVED_ENGINE_KEYS))
    if given:
        raise ConfigError(
            f"[engine] {', '.join(given)}: not an [engine] option; set "
            + ", ".join(DERIVED_ENGINE_KEYS[k] for k in given)
            + " instead"
        )
    options.update(derived)
    return engine_config(**options)
