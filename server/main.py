"""``qdelay server``: command line of the server (flags override the TOML config file)."""

from __future__ import annotations

import argparse
import logging
import sys
import tomllib

from qdelay.errors import QdelayError
from qdelay.server import config as config_mod
from qdelay.server.config import ConfigError, ServerConfig

# flag -> ServerConfig attribute; every flag defaults to None so that only given flags override
FLAGS = [
    ("--data-dir", "data_dir", "data folder (default ./data)"),
    ("--listen", "listen", "HOST:PORT to serve gRPC on (default 127.0.0.1:7600; port 0 picks a free one)"),
    ("--role", "role", "master (default) or slave"),
    ("--master", "master", "slave: the master's HOST:PORT"),
    ("--replication", "replication", "sync or async (default async)"),
    ("--peers", "peers", "comma-separated HOST:PORT of the other cluster members (fencing, failover)"),
    ("--replication-tls-ca", "replication_tls_ca", "slave: CA certificate to verify the master's TLS"),
    (
        "--replication-token-file",
        "replication_token_file",
        "slave: token file to present to the master (default: the first token of --auth-token-file)",
    ),
    ("--auth-token-file", "auth_token_file", "file with bearer token(s), one per line; enables authentication"),
    ("--tls-cert", "tls_cert", "PEM certificate chain; with --tls-key enables TLS"),
    ("--tls-key", "tls_key", "PEM private key"),
    ("--metrics-listen", "metrics_listen", "HOST:PORT for the Prometheus /metrics endpoint (off by default)"),
    ("--etcd", "etcd", "cluster mode: etcd endpoints HOST:PORT[,...] (membership, leadership, failover)"),
    ("--cluster", "cluster", "cluster mode: the cluster's name"),
    ("--shard", "shard", "cluster mode: this server's shard (one master and its slaves)"),
    ("--advertise", "advertise", "cluster mode: HOST:PORT others reach this server at (default: the listen address)"),
    ("--log-level", "log_level", "debug, info (default), warning, error"),
    ("--log-format", "log_format", "text (default) or json"),
]
INT_FLAGS = [
    (
        "--lease-ttl-ms",
        "lease_ttl_ms",
        "cluster mode: etcd lease TTL in ms, a multiple of 1000: etcd counts whole seconds (default 5000)",
    ),
    ("--lease-renew-ms", "lease_renew_ms", "cluster mode: lease renewal interval (default 1000)"),
    (
        "--lease-deadline-ms",
        "lease_deadline_ms",
        "cluster mode: a master stops acknowledging writes this long after its last lease renewal "
        "was sent (default 3500; must be below the TTL)",
    ),
    (
        "--sync-bound-ms",
        "sync_bound_ms",
        "how far behind a slave may be and stay in sync (cluster mode: the in-sync set; any mode: "
        "Status's in_sync; default 2000)",
    ),
    ("--min-free-bytes", "min_free_bytes", "refuse new messages when the data disk has less free space"),
    ("--ingest-queue-messages", "ingest_queue_messages", "messages accepted but not yet durable (bound)"),
    (
        "--replication-timeout-ms",
        "replication_timeout_ms",
        "sync replication: answer UNAVAILABLE when no slave confirmed a write within this time (default 5000)",
    ),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML config file (flags override it)")
    for flag, dest, text in FLAGS:
        parser.add_argument(
            flag,
            dest=dest,
            default=None,
            help=text,
            choices={"role": ["master", "slave"], "replication": ["sync", "async"], "log_format": ["text", "json"]}.get(
                dest
            ),
        )
    for flag, dest, text in INT_FLAGS:
        parser.add_argument(flag, dest=dest, type=int, default=None, help=text)
    parser.add_argument(
        "--flush",
        dest="flush",
        default=None,
        help="message-log flush policy: sync (default: ack after fdatasync) or interval:MS",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any config key, e.g. limits.max_batch=100 or engine.ack_timeout_ms=5000 "
        "(value in TOML syntax; bare words are strings); repeatable",
    )


def _parse_value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    cfg = config_mod.load_file(args.config) if getattr(args, "config", None) else ServerConfig()
    for _flag, dest, _text in FLAGS + INT_FLAGS:
        value = getattr(args, dest, None)
        if value is not None:
            setattr(cfg, dest, value)
    if getattr(args, "flush", None):
        cfg.engine_options["flush"] = args.flush
    for item in getattr(args, "overrides", None) or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        section, dot, name = key.strip().partition(".")
        data = {section: {name: _parse_value(value.strip())}} if dot else {section: _parse_value(value.strip())}
        config_mod.from_mapping(data, cfg, source=f"--set {key}")
    return cfg.validate()


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except QdelayError as e:
        print(f"qdelay server: {e}", file=sys.stderr)
        return 2
    from qdelay.server import app

    try:
        return app.serve(cfg)
    except (QdelayError, OSError) as e:
        logging.getLogger("qdelay.server").error("server stopped: %s", e)
        print(f"qdelay server: {e}", file=sys.stderr)
        return 1
