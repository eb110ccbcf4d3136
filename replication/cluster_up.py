"""``qdelay cluster up``: etcd plus shards x nodes on loopback, for trying cluster mode.

    qdelay cluster up [--data-dir ./data-cluster] [--shards 2] [--nodes 2] [--base-port 7601]

Starts one etcd (Debian's ``etcd-server``, data in DATA/etcd) and SHARDS x NODES servers
(``--etcd … --cluster local --shard sN``, data in DATA/sN-K, logs beside), prints the seed
address, and stops everything on Ctrl-C (SIGTERM to every server, then etcd).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

from qdelay.units import counted


def _whole(least: int, most: int = 65535):
    """An argparse type: a whole number in [least, most] (--shards 0 ended in an IndexError
    traceback after etcd had been started)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if not least <= value <= most:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from {least} to {most}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="cluster_command", required=True)
    p = sub.add_parser("up", help="etcd + shards x nodes on loopback until Ctrl-C")
    p.add_argument("--data-dir", default="./data-cluster", help="default ./data-cluster")
    p.add_argument("--shards", type=_whole(1, 1000), default=2, help="default 2")
    p.add_argument(
        "--nodes", type=_whole(1, 100), default=2, help="servers per shard (one master, the rest slaves; default 2)"
    )
    p.add_argument(
        "--base-port",
        type=_whole(1),
        default=7601,
        help="the servers listen on this port and the next ones (default 7601)",
    )
    p.add_argument(
        "--etcd-port",
        type=_whole(1, 65534),
        default=2379,
        help="etcd's client port, and this + 1 its peer port (default 2379)",
    )
    p.add_argument("--replication", choices=["sync", "async"], default="async", help="default async")


class _NotStarted(Exception):
    """A server of the cluster did not start (its log says why)."""


def _wait_listening(proc: subprocess.Popen, what: str, log_path: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            proc.wait()
            # the server's own last line says why (an address in use, a folder in use, ...)
            last = _last_line(log_path)
            raise _NotStarted(f"{what} exited with {proc.returncode} before listening: {last} (log: {log_path})")
        text = line.decode(errors="replace").strip()
        if text.startswith("qdelay listening on "):
            return text.rsplit(" ", 1)[1]
    raise _NotStarted(f"{what} did not start in {timeout}s (log: {log_path})")


def _in_use(port: int) -> bool:
    """Whether something listens on 127.0.0.1:``port`` (SO_REUSEADDR: a socket in TIME_WAIT
    does not count, as it does not stop etcd)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _last_line(path: str) -> str:
    with open(path, "rb") as f:
        return (f.read().decode(errors="replace").strip().splitlines() or [""])[-1]


def _ports_refused(args: argparse.Namespace) -> str:
    """Why the servers' ports (``--base-port`` and the next ones, one a server) cannot be
    used, or "": past 65535, or on etcd's client or peer port. Each flag's own range is
    argparse's; this is what they say together."""
    count = args.shards * args.nodes
    first, last = args.base_port, args.base_port + count - 1
    if last > 65535:
        return f"--base-port {first}: the {count} servers need ports {first} to {last}; the last is 65535"
    if first <= args.etcd_port + 1 and args.etcd_port <= last:
        return (
            f"--base-port {first}: the {count} servers' ports 127.0.0.1:{first}-{last} take etcd's "
            f"{args.etcd_port} or {args.etcd_port + 1} (--etcd-port): give ports apart"
        )
    return ""


def run(args: argparse.Namespace) -> int:
    refused = _ports_refused(args)
    if refused:  # a usage error, as a port out of range given alone: nothing started
        print(f"qdelay cluster up: {refused}", file=sys.stderr)
        return 2
    etcd_bin = shutil.which("etcd")
    if etcd_bin is None:
        print("qdelay cluster up: etcd is not installed (apt-get install etcd-server, or make setup)", file=sys.stderr)
        return 2
    # the servers start at the same moment as etcd: with its port taken (an etcd of the
    # user's own on 2379), etcd exited at once and the servers joined whatever answered there
    for p in (args.etcd_port, args.etcd_port + 1):
        if _in_use(p):
            print(
                f"qdelay cluster up: 127.0.0.1:{p} is in use (another etcd, or a cluster up already running): "
                f"give --etcd-port PORT with PORT and PORT+1 free (client and peer ports)",
                file=sys.stderr,
            )
            return 1
    root = os.path.abspath(args.data_dir)
    os.makedirs(root, exist_ok=True)
    procs: list[tuple[str, subprocess.Popen]] = []
    endpoint = f"127.0.0.1:{args.etcd_port}"
    peer = f"http://127.0.0.1:{args.etcd_port + 1}"
    stop = {"now": False}
    code = 0

    def on_signal(_sig, _frame) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        with open(os.path.join(root, "etcd.log"), "ab") as log:
            etcd = subprocess.Popen(
                [
                    etcd_bin,
                    "--name",
                    "local",
                    "--data-dir",
                    os.path.join(root, "etcd"),
                    "--listen-client-urls",
                    f"http://{endpoint}",
                    "--advertise-client-urls",
                    f"http://{endpoint}",
                    "--listen-peer-urls",
                    peer,
                    "--initial-advertise-peer-urls",
                    peer,
                    "--initial-cluster",
                    f"local={peer}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        procs.append(("etcd", etcd))
        port = args.base_port
        seeds = []
        commands: dict[str, list[str]] = {}
        for s in range(1, args.shards + 1):
            for k in range(1, args.nodes + 1):
                name = f"s{s}-{k}"
                commands[name] = [
                    "qdelay",
                    "server",
                    "--data-dir",
                    os.path.join(root, name),
                    "--listen",
                    f"127.0.0.1:{port}",
                    "--etcd",
                    endpoint,
                    "--cluster",
                    "local",
                    "--shard",
                    f"s{s}",
                    "--replication",
                    args.replication,
                ]
                with open(os.path.join(root, f"{name}.log"), "ab") as log:
                    p = subprocess.Popen(
                        [sys.executable, "-m", "qdelay.cli", *commands[name][1:]],
                        stdout=subprocess.PIPE,
                        stderr=log,
                    )
                procs.append((name, p))
                port += 1
        # every server starts at once and is waited for afterwards: one after another made the
        # start grow by a server's whole start-up (~0.85 s) per server (bench.cluster --only up)
        for name, p in procs[1:]:
            seeds.append(_wait_listening(p, name, os.path.join(root, f"{name}.log")))
        print(
            f"qdelay cluster 'local' ({counted(args.shards, 'shard')} x {counted(args.nodes, 'node')}, "
            f"etcd {endpoint}, data {root})"
        )
        print(f"seed address: {seeds[0]}   (any of {', '.join(seeds)})")
        print(f"status: qdelay admin status --servers {seeds[0]}    stop: Ctrl-C", flush=True)
        # a server that exits is reported once and the rest go on: killing a master to watch
        # its shard fail over is what this command is for (it used to stop everything);
        # without etcd, or with no server left, there is nothing to try
        gone: set[str] = set()
        while not stop["now"]:
            for name, p in procs:
                if name in gone or p.poll() is None:
                    continue
                gone.add(name)
                if name == "etcd":
                    last = _last_line(os.path.join(root, "etcd.log"))
                    print(f"etcd exited with {p.returncode}: {last} (log: {root}/etcd.log); stopping", file=sys.stderr)
                    stop["now"] = True
                    code = 1  # the cluster did not run until Ctrl-C: a script must not read success
                else:
                    print(
                        f"{name} exited with {p.returncode}; see {root}/{name}.log (its shard fails over by "
                        f"itself; to bring it back: {shlex.join(commands[name])})",
                        file=sys.stderr,
                        flush=True,
                    )
            if len(gone) == len(procs) - 1 and "etcd" not in gone:
                print("every server exited; stopping", file=sys.stderr)
                stop["now"] = True
            time.sleep(0.2)
    except _NotStarted as e:
        print(f"qdelay cluster up: {e}", file=sys.stderr)
        code = 1
    finally:
        for _name, p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        for _name, p in reversed(procs):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        print("stopped")
    return code
