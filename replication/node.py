"""One server's replication role: the Replication gRPC service, promotion and fencing.

Roles (persisted with the epoch in ``checkpoint/role.ckpt``):

- ``master``: accepts writes, dispatches, serves Pull streams;
- ``slave``: pulls from its master, refuses writes (FAILED_PRECONDITION), never dispatches;
- ``fenced``: a master that learned of a higher epoch: refuses writes, stops dispatching;
  it re-attaches as a slave when started with ``--role slave --master NEW``;
- ``joining``: a former master started with ``--role slave``: refuses writes until the
  configured master proved a higher epoch, then becomes a slave (truncating a divergent tail).

How a server learns of a higher epoch: a Fence call (``qdelay admin promote`` fences the
old master and tells the peers), a slave's hello carrying a higher epoch, and -- with
``peers`` configured -- a check of the peers at start-up (before it listens) and every second.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from qdelay.cancellation import cancel_and_wait
from qdelay.replication import common
from qdelay.replication.master import Hub, PullServer, _Refuse
from qdelay.v1 import replication_pb2 as rpb
from qdelay.v1 import replication_pb2_grpc as rpb_grpc

log = logging.getLogger("qdelay.replication")

PEER_CHECK_S = 1.0
# after a slave attaches, how long the servers a promotion did not make slaves are asked
# whether it was one of them (its hello can come before its own port listens)
REATTACH_CHECK_S = 5.0
# how often a master notes its committed offset for the in-sync set (Hub.sample): a slave is
# in sync if it has what the master had sync_bound_ms ago, this much more at most
IN_SYNC_SAMPLE_S = 0.25


class Node:
    def __init__(self, engine, cfg) -> None:
        self.engine = engine
        self.cfg = cfg
        self.hub = Hub(engine, cfg)
        self.puller = None
        self.peers = cfg.peer_list()
        self.token, self.ca, self.tls = common.slave_credentials(cfg)
        self._tasks: list[asyncio.Task] = []
        # a promotion's note: what it did, then what became of each server it told, by
        # address; a part is updated when that server re-attaches as a slave
        self.promoted_head = ""
        self.promoted_peers: dict[str, str] = {}
        self._not_slaves: set[str] = set()  # told servers not known to be slaves yet
        self._reattach_until = 0.0
        self._reattach_task: asyncio.Task | None = None
        self.fenced_master = ""  # the newer master named when this one was fenced ("" unknown)
        self.slaves_in_sync = 0  # len(hub.in_sync()) as of the last sample (event loop writes it)
        self.agent = None  # cluster mode (--etcd): replication/cluster.py
        # stop the server gracefully and execute it again (the App's; None: it cannot):
        # the puller's automatic full resync (replication/autoresync.py)
        self.restart_process: Callable[[str], None] | None = None
        if cfg.etcd:
            from qdelay.replication.cluster import ClusterAgent

            self.agent = ClusterAgent(self, cfg)

    # --- life cycle ----------------------------------------------------------------------------------
    def install(self) -> None:
        engine = self.engine
        engine.replication_floor = self.hub.floor
        engine.replication_stats = self.stats
        if self.cfg.replication == "sync":
            engine.replication_wait = self.hub.wait
        if engine.role == "master" and self.peers:
            self.check_peers_blocking()
        if self.cfg.role == "slave" and engine.role in ("slave", "joining"):
            from qdelay.replication.slave import Puller

            self.puller = Puller(self, self.cfg.master)
            self.puller.start()
        if self.peers:
            self._tasks.append(asyncio.ensure_future(self._watch_peers()))
        self._tasks.append(asyncio.ensure_future(self.hub.keep_saved()))
        self._tasks.append(asyncio.ensure_future(self._sample_in_sync()))

    def on_listening(self, address: str) -> None:
        """The server accepts calls at ``address``: join the cluster (cluster mode)."""
        if self.agent is not None:
            self.agent.start(address)

    async def stop(self, deadline: float | None = None) -> None:
        """The server is stopping (``App.stop``); every wait here ends by ``deadline`` (a
        ``time.monotonic()`` instant; None: ``cfg.grace_seconds`` from now): the cluster
        agent's hand-over, the puller's last write, and the slaves' streams, which end once
        their slaves confirmed everything (``Hub.end_streams``)."""
        if deadline is None:
            deadline = time.monotonic() + self.cfg.grace_seconds
        if self.agent is not None:
            await self.agent.stop(deadline)
        # the peer watch, the holds' saver (a save under way ends first: the final save
        # below must come after it) and a re-attach
        await cancel_and_wait([*self._tasks, self._reattach_task])
        if self.puller is not None:
            await self.puller.stop()
        # the slaves' streams end first: the holds saved next have the slaves as seen then
        await self.hub.end_streams(deadline)
        try:
            await self.hub.save_if_changed(final=True)  # the holds as they are at the stop
        except Exception:  # noqa: BLE001 - the file saved last stays; the stop goes on
            log.exception("saving the slave holds failed")

    async def _sample_in_sync(self) -> None:
        while True:
            await asyncio.sleep(IN_SYNC_SAMPLE_S)
            # in_sync() samples; its count is kept for the metrics scrape, which runs on
            # another thread and must not touch the hub's samples
            self.slaves_in_sync = len(self.hub.in_sync())

    # --- peers ------------------------------------------------------------------------------------------
    def _channel(self, target: str, aio: bool = True):
        return common.make_channel(
            target, tls=self.tls, ca=self.ca, server_name=self.cfg.replication_tls_server_name, aio=aio
        )

    def check_peers_blocking(self) -> None:
        """Start-up, before listening: a master that a peer outranks is fenced at once."""
        for peer in self.peers:
            ch = self._channel(peer, aio=False)
            try:
                st = rpb_grpc.ReplicationStub(ch).Status(
                    rpb.ReplicationStatusRequest(), timeout=1.0, metadata=common.metadata(self.token)
                )
            except grpc.RpcError:
                continue
            finally:
                ch.close()
            if st.epoch > self.engine.epoch and st.role in ("master", "slave", "fenced"):
                self._do_fence(
                    st.epoch, peer if st.role == "master" else "", f"peer {peer} is {st.role} at epoch {st.epoch}"
                )

    async def peer_status(self, peer: str, timeout: float = 1.0):
        ch = self._channel(peer)
        try:
            return await rpb_grpc.ReplicationStub(ch).Status(
                rpb.ReplicationStatusRequest(), timeout=timeout, metadata=common.metadata(self.token)
            )
        except grpc.aio.AioRpcError:
            return None
        finally:
            await ch.close()

    async def find_master(self, exclude_self: bool = True) -> tuple[str, int] | None:
        targets = list(self.peers)
        best = None
        for peer in targets:
            st = await self.peer_status(peer)
            if st is not None and st.role == "master" and (best is None or st.epoch > best[1]):
                best = (peer, st.epoch)
        return best

    async def _watch_peers(self) -> None:
        while True:
            await asyncio.sleep(PEER_CHECK_S)
            try:
                if self.engine.role != "master":
                    continue
                for peer in self.peers:
                    st = await self.peer_status(peer)
                    if st is not None and st.epoch > self.engine.epoch:
                        await self.fence(
                            st.epoch,
                            peer if st.role == "master" else "",
                            f"peer {peer} is {st.role} at epoch {st.epoch}",
                        )
                        break
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001
                log.exception("peer check failed")

    # --- fencing and promotion -----------------------------------------------------------------------
    def _do_fence(self, epoch: int, master: str, reason: str) -> None:
        engine = self.engine
        if epoch <= engine.epoch:
            return
        if master:
            self.fenced_master = master
        if engine.role == "master":
            log.error(
                "fenced: a newer master exists; refusing writes and stopping dispatch; %s",
                self.fenced_advice(),
                extra={"epoch": engine.epoch, "new_epoch": epoch, "reason": reason},
            )
            engine.set_role("fenced", epoch)
        elif engine.role == "slave":
            engine.set_role("slave", epoch)
        elif engine.role == "fenced":
            engine.set_role("fenced", epoch)

    def fenced_advice(self) -> str:
        """What the operator does with a fenced server (docs/operations.md §4.3): it stays
        fenced until restarted as a slave of the new master. In cluster mode etcd
        re-attaches it by itself."""
        if self.agent is not None:
            return "it follows the shard's master by itself (cluster mode)"
        master = self.fenced_master or "NEW_MASTER:PORT"
        return f"to re-attach it, restart it with --role slave --master {master} (docs/operations.md 4.3)"

    async def fence(self, epoch: int, master: str, reason: str) -> None:
        await asyncio.to_thread(self._do_fence, epoch, master, reason)
        if master and self.puller is not None:
            self.puller.follow(master)

    async def promote(self, req) -> rpb.PromoteResponse:
        engine = self.engine
        wal = engine.wal
        if self.agent is not None:  # cluster mode: through etcd's keys, not epoch + 1
            note = await self.agent.promote(req.force)
            self._set_promoted(note, {})
            return rpb.PromoteResponse(
                epoch=engine.epoch, end_offset=wal.committed_offset, last_sequence=wal.committed_sequence, note=note
            )
        if engine.role == "master":
            return rpb.PromoteResponse(
                epoch=engine.epoch,
                end_offset=wal.committed_offset,
                last_sequence=wal.committed_sequence,
                note="already master",
            )
        if engine.role != "slave":
            raise _Refuse(
                "FAILED_PRECONDITION",
                f"this server is {engine.role}: only a slave can be promoted "
                f"(a fenced server re-attaches as slave first)",
            )
        puller = self.puller
        old_master = puller.master if puller is not None else self.cfg.master
        if puller is not None and puller.connected and not req.force:
            raise _Refuse(
                "FAILED_PRECONDITION",
                f"the master {old_master} is still connected; stop it first, "
                f"or promote with --force (it will be fenced)",
            )
        known = max(engine.epoch, puller.master_epoch if puller is not None else 0, req.min_epoch)
        for peer in self.peers:
            st = await self.peer_status(peer)
            if st is not None:
                known = max(known, st.epoch)
        epoch = known + 1
        if puller is not None:
            await puller.stop()
            self.puller = None
        await asyncio.to_thread(engine.set_role, "master", epoch)
        head = (
            f"promoted to master at epoch {epoch} (message log ends at {wal.committed_offset}, "
            f"sequence {wal.committed_sequence})"
        )
        told: dict[str, str] = {}
        not_slaves = set()
        # tell the old master (fence) and the peers (fence or follow); best effort
        for target in dict.fromkeys([t for t in [old_master, *self.peers] if t and t != req.address]):
            ch = self._channel(target)
            try:
                r = await rpb_grpc.ReplicationStub(ch).Fence(
                    rpb.FenceRequest(epoch=epoch, master=req.address), timeout=2.0, metadata=common.metadata(self.token)
                )
                told[target] = f"{target}: now {r.role} at epoch {r.epoch}"
                if r.role != "slave":
                    not_slaves.add(target)
            except grpc.aio.AioRpcError as e:
                not_slaves.add(target)
                told[target] = (
                    f"{target}: not reached ({e.code().name}); it is fenced when it comes back "
                    f"(peers) or must be started with --role slave --master {req.address or 'NEW'}"
                )
            finally:
                await ch.close()
        note = self._set_promoted(head, told, not_slaves)
        log.warning(note)
        return rpb.PromoteResponse(
            epoch=epoch, end_offset=wal.committed_offset, last_sequence=wal.committed_sequence, note=note
        )

    def _set_promoted(self, head: str, told: dict[str, str], not_slaves: set[str] | None = None) -> str:
        self.promoted_head = head
        self.promoted_peers = told
        self._not_slaves = not_slaves or set()
        return self.promoted_note()

    def promoted_note(self) -> str:
        return "; ".join([self.promoted_head, *self.promoted_peers.values()]) if self.promoted_head else ""

    def slave_attached(self) -> None:
        """A slave attached (replication/master.py): it may be a server the promotion could
        not reach or found fenced, restarted as this master's slave. Its part of the note
        said "not reached ... must be started with --role slave" long after it was."""
        if not self._not_slaves:
            return
        self._reattach_until = time.monotonic() + REATTACH_CHECK_S
        if self._reattach_task is None or self._reattach_task.done():
            self._reattach_task = asyncio.ensure_future(self._check_reattached())

    async def _check_reattached(self) -> None:
        while self._not_slaves and self.engine.role == "master" and time.monotonic() < self._reattach_until:
            for target in sorted(self._not_slaves):
                st = await self.peer_status(target)
                # a slave at this master's epoch follows this master (one master per epoch)
                if st is not None and st.role == "slave" and st.epoch == self.engine.epoch:
                    self._not_slaves.discard(target)
                    self.promoted_peers[target] = f"{target}: re-attached as slave at epoch {st.epoch}"
                    log.info("%s re-attached as a slave", target, extra={"epoch": st.epoch})
            if self._not_slaves:
                await asyncio.sleep(0.5)

    # --- status -------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        engine = self.engine
        out = {"replication_mode": self.cfg.replication, "sync_timeouts": self.hub.sync_timeouts}
        if engine.role == "master":
            lag_bytes, lag_ms = self.hub.lag()
            out.update(replication_lag_bytes=lag_bytes, replication_lag_ms=lag_ms, slaves_attached=len(self.hub.live()))
            out.update(slaves_held=self.hub.held_detached(), slave_holds_expired=self.hub.holds_expired)
            out.update(slaves_in_sync=self.slaves_in_sync)
        elif self.puller is not None:
            lag_bytes, lag_ms = self.puller.lag()
            out.update(
                replication_lag_bytes=lag_bytes,
                replication_lag_ms=lag_ms,
                replication_connected=self.puller.connected,
                replication_error=self.puller.error,
                replication_delay_p99_ms=self.puller.delay_p99(),
                master=self.puller.master,
            )
        else:
            out.update(replication_lag_bytes=-1, replication_lag_ms=-1)
        holds = self.hub.holds  # any role: a slave promoted and back keeps its counts
        out.update(
            holds_saves=holds.saves,
            holds_save_seconds=holds.save_seconds,
            holds_save_cpu_seconds=holds.save_cpu_seconds,
        )
        if self.agent is not None:
            out.update(self.agent.stats())
        return out

    def status(self) -> rpb.ReplicationStatus:
        engine = self.engine
        wal = engine.wal
        s = self.stats()
        st = rpb.ReplicationStatus(
            role=engine.role,
            epoch=engine.epoch,
            first_offset=wal.first_offset,
            end_offset=wal.committed_offset,
            last_sequence=wal.committed_sequence,
            first_sequence=common.first_sequence(wal),
            lag_bytes=s.get("replication_lag_bytes", -1),
            lag_ms=s.get("replication_lag_ms", -1),
            replication=self.cfg.replication,
            sync_timeouts=self.hub.sync_timeouts,
            iterate_offset=engine.iterate.offset,
        )
        if self.puller is not None:
            p = self.puller
            st.master = p.master
            st.connected = p.connected
            st.error = p.error
            st.delay_p99_ms = p.delay_p99()
            st.note = p.note
        elif engine.role == "fenced" and self.agent is not None:
            # cluster mode: a lost lease fences too (replication/cluster.py _watchdog)
            st.note = (
                "fenced: it acknowledges no write and dispatches nothing until etcd confirms its "
                "leadership again or elects another master, which it then follows by itself (cluster mode)"
            )
        elif engine.role == "fenced":
            # the status said only "fenced": not why, nor what to do
            st.note = f"fenced: a newer master exists (epoch {engine.epoch}); {self.fenced_advice()}"
        elif self.promoted_head:
            st.note = self.promoted_note()
        if self.agent is not None and self.agent.error and not st.error:
            # cluster mode: an etcd outage (no renewal, no election) showed nowhere in status
            st.error = self.agent.error
        now = time.time()
        end = wal.committed_offset
        in_sync = {id(sess) for sess in self.hub.in_sync()}
        for sess in self.hub.listed():  # an expired hold is not listed (it was until a restart)
            st.slaves.add(
                name=sess.name,
                peer=sess.peer,
                connected=sess.connected,
                acked_offset=sess.acked,
                lag_bytes=max(0, end - sess.acked),
                lag_ms=max(0, int((now - sess.last_seen) * 1000)),
                in_sync=id(sess) in in_sync,
            )
        return st


class ReplicationService(rpb_grpc.ReplicationServicer):
    def __init__(self, node: Node) -> None:
        self.node = node

    async def _abort(self, context, err: _Refuse):
        await context.abort(getattr(grpc.StatusCode, err.code), err.message)

    async def Pull(self, request_iterator, context):
        try:
            await PullServer(self.node).serve(request_iterator, context)
        except _Refuse as err:
            await self._abort(context, err)
        except StopAsyncIteration:
            return

    async def Status(self, request, context):
        return self.node.status()

    async def Promote(self, request, context):
        try:
            return await self.node.promote(request)
        except _Refuse as err:
            await self._abort(context, err)

    async def Fence(self, request, context):
        await self.node.fence(request.epoch, request.master, f"Fence call from {context.peer()}")
        return rpb.FenceResponse(role=self.node.engine.role, epoch=self.node.engine.epoch)

    async def Frames(self, request, context):
        wal = self.node.engine.wal
        n = min(request.max_frames or 1000, 10_000)
        out = rpb.FramesResponse(first_offset=wal.first_offset, end_offset=wal.committed_offset)
        if wal.first_offset <= request.offset < wal.committed_offset:
            data = await asyncio.to_thread(wal.read_raw, request.offset, 2 * 1024 * 1024)
            for off, seq, checksum, size in common.frame_infos(data, request.offset)[:n]:
                out.frames.add(offset=off, sequence=seq, checksum=checksum, size=size)
        return out

    async def Snapshot(self, request, context):
        from qdelay.replication.snapshot import serve_snapshot

        try:
            async for chunk in serve_snapshot(self.node, request):
                yield chunk
        except _Refuse as err:
            await self._abort(context, err)


def install(server, engine, cfg):
    """qdelay.replication.hooks entry: add the service, wire the engine, start the puller."""
    node = Node(engine, cfg)
    rpb_grpc.add_ReplicationServicer_to_server(ReplicationService(node), server)
    node.install()
    name = rpb.DESCRIPTOR.services_by_name["Replication"].full_name
    return node.stop, [name], node
