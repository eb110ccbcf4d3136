"""``qdelay admin``: cluster administration.

    qdelay admin status  --servers A,B,C            role, epoch, offsets, lag of each server, and
                                                    which slaves of a master are in sync
                                                    (cluster mode: every shard, its in-sync set, and
                                                    every server, from any one)
    qdelay admin promote --target B [--force]       make slave B the master (epoch + 1)
    qdelay admin fence   --target A --epoch N       tell A a master with epoch N exists
    qdelay admin resync  --data-dir DIR --master M  rebuild a slave's data folder from M
    qdelay admin group {create,delete} --server M --subject S --group G
    qdelay admin group list --server M [--subject S] [--group G]
                                                    consumer groups, backlog, in flight
                                                    (none: "no groups ...", exit 0)

Every command takes ``--token-file`` / ``--tls-ca`` / ``--tls-server-name`` like a client.
Every address (A, B, M above) is HOST:PORT; one without its port is a usage error (exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys

import grpc
from google.protobuf.descriptor import FieldDescriptor

from qdelay.addresses import check_target
from qdelay.errors import InvalidArgument, QdelayError
from qdelay.replication import common
from qdelay.units import counted
from qdelay.v1 import replication_pb2 as rpb
from qdelay.v1 import replication_pb2_grpc as rpb_grpc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="admin_command", required=True)

    def common_args(p):
        p.add_argument("--token-file", help="file whose first line is the bearer token")
        p.add_argument("--tls-ca", help="CA certificate (PEM) to verify the servers; enables TLS")
        p.add_argument("--tls-server-name", help="expected TLS server name (override)")
        p.add_argument("--timeout", type=float, default=10.0, help="seconds per call (default 10)")
        p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("status", help="role, epoch, offsets and lag of servers")
    p.add_argument("--servers", required=True, help="comma-separated HOST:PORT list")
    common_args(p)
    p = sub.add_parser("promote", help="make a slave the master with epoch + 1")
    p.add_argument("--target", required=True, help="HOST:PORT of the slave to promote")
    p.add_argument("--force", action="store_true", help="even if its master still answers (it gets fenced)")
    p.add_argument("--min-epoch", type=int, default=0)
    common_args(p)
    p = sub.add_parser("fence", help="tell a server that a master with a higher epoch exists")
    p.add_argument("--target", required=True)
    p.add_argument("--epoch", type=int, required=True)
    p.add_argument("--master", default="", help="HOST:PORT of the current master (slaves follow it)")
    common_args(p)
    p = sub.add_parser("group", help="create, delete or list consumer groups")
    p.add_argument("group_command", choices=["create", "delete", "list"])
    p.add_argument("--server", required=True, help="HOST:PORT of the master")
    p.add_argument("--subject", help="the subject (create, delete; list: only its groups)")
    p.add_argument("--group", help="the group's name (create, delete; list: only groups of this name)")
    common_args(p)
    p = sub.add_parser("resync", help="rebuild a (stopped) slave's data folder from the master (full resync)")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--master", required=True)
    common_args(p)


def _channel(target: str, args):
    ca = None
    if args.tls_ca:
        with open(args.tls_ca, "rb") as f:
            ca = f.read()
    return common.make_channel(target, tls=bool(ca), ca=ca, server_name=args.tls_server_name, aio=False)


def _md(args):
    return common.metadata(common.read_token(args.token_file))


def _fmt_status(target: str, st) -> str:
    line = (
        f"{target:<22} {st.role:<8} epoch={st.epoch:<3} offsets={st.first_offset}..{st.end_offset} "
        f"seq={st.last_sequence} lag_bytes={st.lag_bytes} lag_ms={st.lag_ms}"
    )
    if st.role in ("slave", "joining"):
        line += f" master={st.master} connected={st.connected}"
        if st.delay_p99_ms >= 0:
            line += f" delay_p99_ms={st.delay_p99_ms}"
    if st.role == "master":
        line += f" mode={st.replication} sync_timeouts={st.sync_timeouts}"
        for s in st.slaves:
            line += (
                f"\n    slave {s.name} connected={s.connected} in_sync={s.in_sync} acked={s.acked_offset} "
                f"lag_bytes={s.lag_bytes}"
            )
    if st.error:
        line += f"\n    error: {st.error}"
    if st.note:
        line += f"\n    note: {st.note}"
    return line


def _cluster_shards(targets: list[str], args) -> list:
    """The shards of the cluster the first answering server belongs to ([] standalone)."""
    from qdelay.v1 import qdelay_pb2 as pb
    from qdelay.v1 import qdelay_pb2_grpc as pb_grpc

    for target in targets:
        ch = _channel(target, args)
        try:
            t = pb_grpc.DelayServiceStub(ch).Topology(pb.TopologyRequest(), timeout=args.timeout, metadata=_md(args))
        except grpc.RpcError:
            continue
        finally:
            ch.close()
        return list(t.shards) if t.cluster else []
    return []


def _to_dict(msg) -> dict:
    """The message as JSON-ready dict with the proto's field names, every field present, and
    64-bit integers as numbers: protobuf's JSON mapping writes them as strings ("epoch": "3"),
    which a script comparing offsets or lag then compares as text."""
    from google.protobuf.json_format import MessageToDict

    d = MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return _numbers(msg, d)


_INT64 = (FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64)


def _numbers(msg, d: dict) -> dict:
    """``d`` (MessageToDict of ``msg``) with its 64-bit integer fields as ints, nested too."""
    for f in msg.DESCRIPTOR.fields:
        if f.name not in d:
            continue
        value, repeated = getattr(msg, f.name), f.is_repeated
        if f.message_type is not None and not f.message_type.GetOptions().map_entry:
            if repeated:
                d[f.name] = [_numbers(m, x) for m, x in zip(value, d[f.name])]
            else:
                _numbers(value, d[f.name])
        elif f.cpp_type in _INT64:
            d[f.name] = list(value) if repeated else value
    return d


def _no_groups(subject: str | None, group: str | None) -> str:
    """What ``group list`` prints when no group matched its narrowing."""
    if subject and group:
        return f"no group {group} of subject {subject}"
    if subject:
        return f"no groups of subject {subject}"
    if group:
        return f"no groups named {group}"
    return "no groups"


def _group(args: argparse.Namespace) -> int:
    from qdelay import errors
    from qdelay.client import Client

    token = common.read_token(args.token_file) if args.token_file else None
    with Client(
        args.server, token=token, tls_ca=args.tls_ca, tls_server_name=args.tls_server_name, timeout=args.timeout
    ) as c:
        try:
            if args.group_command == "list":
                groups = c.groups(subject=args.subject or "", group=args.group or "")
                if args.json:
                    print(json.dumps(groups, indent=1))
                    return 0
                for g in groups:
                    more = f" ({g['backlog_on_disk_count']} of it on disk)" if g["backlog_on_disk"] else ""
                    if g.get("backlog_retrying"):  # (a server before this field sends none)
                        more += f" ({g['backlog_retrying']} of it waiting to be retried)"
                    print(
                        f"{g['subject']:<24} {g['group']:<16} consumers={g['consumers']} "
                        f"backlog={g['backlog']}{more} in_flight={g['in_flight']}"
                    )
                if not groups:  # a line rather than nothing, which reads as a hang or a failure
                    print(_no_groups(args.subject, args.group))
                return 0
            if not args.subject or not args.group:
                print(f"qdelay admin group {args.group_command}: --subject and --group are required", file=sys.stderr)
                return 2
            if args.group_command == "create":
                changed = c.create_group(args.subject, args.group)
                print(f"group {args.group} of {args.subject}: {'created' if changed else 'exists already'}")
            else:
                changed = c.delete_group(args.subject, args.group)
                print(f"group {args.group} of {args.subject}: {'deleted' if changed else 'did not exist'}")
            return 0
        except errors.QdelayError as e:
            code = getattr(e, "code", None)
            more = _advice(code.name, e.details, args) if code is not None else ""
            print(f"qdelay admin group {args.group_command}: {e}{more}", file=sys.stderr)
            return 1


def _advice(code: str, details: str, args: argparse.Namespace) -> str:
    """What to try, for the refusals an operator meets first: a token missing or wrong, and
    a plaintext call to a TLS port (gRPC says only "Socket closed"). "" for the rest."""
    if code == "UNAUTHENTICATED":
        if args.token_file:
            return f" (the token in {args.token_file} is not one the server accepts)"
        return " (the server requires a token: give its token file with --token-file FILE)"
    if code == "UNAVAILABLE" and not args.tls_ca and "Socket closed" in details:
        return " (if the server serves TLS, give its CA certificate with --tls-ca FILE)"
    return ""


def _unreadable(args: argparse.Namespace) -> str | None:
    """Why a file named on the command line cannot be used (None when all can): checked
    before any call, so a wrong path is a usage error naming the flag, not a
    FileNotFoundError traceback (nor, for a token file with no token, a call sent without
    one and refused UNAUTHENTICATED)."""
    for flag, path in (("--token-file", args.token_file), ("--tls-ca", args.tls_ca)):
        problem = common.file_problem(path, token=flag == "--token-file") if path else None
        if problem:
            return f"{flag} {problem}"
    return None


def _bad_address(args: argparse.Namespace) -> str | None:
    """Why an address flag is not HOST:PORT (None when all are), before any call: without
    its port gRPC tried 443, its default, and the server was reported unreachable there."""
    for flag in ("--servers", "--server", "--target", "--master"):
        value = getattr(args, flag[2:], None) or ""
        for address in value.split(",") if flag == "--servers" else [value]:
            if address.strip():
                try:
                    check_target(address.strip(), flag)
                except InvalidArgument as e:
                    return str(e)
    return None


def run(args: argparse.Namespace) -> int:
    cmd = args.admin_command
    problem = _unreadable(args) or _bad_address(args)
    if problem:
        print(f"qdelay admin {cmd}: {problem}", file=sys.stderr)
        return 2
    try:
        if cmd == "status":
            code = 0
            out = {}
            targets = [s.strip() for s in args.servers.split(",") if s.strip()]
            if not targets:  # printed nothing and exited 0: read as "all fine"
                print(f"qdelay admin status: --servers {args.servers!r} names no HOST:PORT", file=sys.stderr)
                return 2
            shards = _cluster_shards(targets, args)
            if shards:
                # cluster mode: every server of every shard, as the cluster's Topology names them
                targets = list(
                    dict.fromkeys(a for s in shards for a in ([s.master] if s.master else []) + list(s.slaves))
                )
                out["shards"] = {
                    s.name: {"master": s.master, "slaves": list(s.slaves), "epoch": s.epoch, "in_sync": list(s.in_sync)}
                    for s in shards
                }
                if not args.json:
                    for s in shards:
                        # in_sync: who may take over (etcd's set, its writer first); check it
                        # before stopping a master ('-': none written yet, a new shard)
                        print(
                            f"shard {s.name}: master={s.master or '(electing)'} epoch={s.epoch} "
                            f"slaves={','.join(s.slaves) or '-'} in_sync={','.join(s.in_sync) or '-'}"
                        )
            for target in targets:
                ch = _channel(target, args)
                try:
                    st = rpb_grpc.ReplicationStub(ch).Status(
                        rpb.ReplicationStatusRequest(), timeout=args.timeout, metadata=_md(args)
                    )
                    out[target] = _to_dict(st)
                    if not args.json:
                        print(_fmt_status(target, st))
                except grpc.RpcError as e:
                    code = 1
                    out[target] = {"error": f"{e.code().name}: {e.details()}"}
                    if not args.json:
                        # "unreachable" only when it is: a refused token was reported so too
                        no_answer = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                        what = "unreachable" if e.code() in no_answer else "refused"
                        more = _advice(e.code().name, e.details() or "", args)
                        print(f"{target:<22} {what} ({e.code().name}: {e.details()}){more}")
                finally:
                    ch.close()
            if args.json:
                print(json.dumps(out, indent=1))
            return code
        if cmd == "promote":
            ch = _channel(args.target, args)
            try:
                r = rpb_grpc.ReplicationStub(ch).Promote(
                    rpb.PromoteRequest(min_epoch=args.min_epoch, force=args.force, address=args.target),
                    timeout=args.timeout,
                    metadata=_md(args),
                )
            finally:
                ch.close()
            print(
                json.dumps(_to_dict(r))
                if args.json
                else f"{args.target} is master at epoch {r.epoch} (log ends at {r.end_offset}, "
                f"sequence {r.last_sequence})\n{r.note}"
            )
            return 0
        if cmd == "fence":
            ch = _channel(args.target, args)
            try:
                r = rpb_grpc.ReplicationStub(ch).Fence(
                    rpb.FenceRequest(epoch=args.epoch, master=args.master), timeout=args.timeout, metadata=_md(args)
                )
            finally:
                ch.close()
            print(f"{args.target}: {r.role} at epoch {r.epoch}")
            return 0
        if cmd == "group":
            return _group(args)
        if cmd == "resync":
            from qdelay.replication.snapshot import write_snapshot

            ch = _channel(args.master, args)
            try:
                stream = rpb_grpc.ReplicationStub(ch).Snapshot(
                    rpb.SnapshotRequest(slave_name=common.slave_name(args.data_dir)), timeout=3600, metadata=_md(args)
                )
                info = write_snapshot(args.data_dir, stream)
            finally:
                ch.close()
            print(
                json.dumps(info)
                if args.json
                else f"resynced {args.data_dir} from {args.master}: {counted(info['files'], 'segment file')}, "
                f"{counted(info['bytes'], 'byte')}; its message log starts at offset {info['offset']} "
                f"(after sequence {info['sequence']})"
                + (f"; the old folder was moved to {info['moved_old_to']}" if info["moved_old_to"] else "")
                # the slave's own flags are not known here: a bare command started it on the default
                # listen address with no token (the master refused it), or out of its cluster
                + f"\nnow start it within slave_hold_ms (the master holds its log for it that long) with its usual "
                f"flags (--listen, --peers, --auth-token-file, TLS): qdelay server --data-dir {args.data_dir} "
                f"--role slave --master {args.master} --listen HOST:PORT ...; in cluster mode its --etcd, --cluster "
                f"and --shard instead of --role and --master (docs/operations.md 4.4)"
            )
            return 0
    except grpc.RpcError as e:
        more = _advice(e.code().name, e.details() or "", args)
        print(f"qdelay admin {cmd}: {e.code().name}: {e.details()}{more}", file=sys.stderr)
        return 1
    except QdelayError as e:  # resync: the folder is in use
        print(f"qdelay admin {cmd}: {e}", file=sys.stderr)
        return 1
    return 2
