"""A cluster on etcd: membership, leadership, automatic failover, the topology.

Words: a *shard* is one master with its slaves (one replication set); a *cluster* is any
number of shards sharing one etcd prefix. Keys, under ``/qdelay/<cluster>/shards/<shard>/``:

- ``members/<address>`` -- under the node's lease: JSON {address, name, role, epoch,
  end_offset}. Gone when the node is (its lease expires) -- membership.
- ``leader`` -- under the master's lease, created only where absent (a transaction whose
  guard is "create revision == 0"). Its *create revision* is the master's fencing epoch:
  etcd revisions only grow, so every election yields a higher epoch, and that epoch is what
  replication already compares (a slave follows only a master whose epoch is not older).
- ``insync`` -- no lease (it must outlive a dead master): JSON {members: [...]}, written
  only by the current master (guarded by its leader key's create revision): itself and the
  slaves whose acknowledged offset reached what the master had committed ``sync_bound_ms``
  ago. Only a member of it may take the leader key; among those alive, the one whose log is
  longest (asked live over Replication.Status) goes first.

Fencing by time: every lease renewal records when it was *sent*; etcd keeps the lease at
least ``TTL`` from the moment it received it, so from the send. The master acknowledges a
write only while ``now < last send + lease_deadline_ms`` (< TTL): cut off from etcd, it
stops acknowledging (the write guard raises UNAVAILABLE) and stops dispatching (fenced)
``TTL - deadline`` before its lease can expire, hence before any slave can be elected.
If it reaches etcd again while its key still stands, it resumes at the same epoch; if
another master was elected, it re-attaches as that master's slave (a divergent tail, written
but never acknowledged, is cut and kept by the ordinary rejoin path, replication/slave.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field

from qdelay.cancellation import cancel_and_wait
from qdelay.errors import Fenced, LeaseLost
from qdelay.replication.etcd import Etcd, EtcdError, absent, created_at, delete, put, unchanged_since

log = logging.getLogger("qdelay.cluster")

MEMBER_PUBLISH_S = 1.0
HANDOVER_S = 3.0  # graceful stop: how long a master waits for a slave to have its whole log


@dataclass
class ShardView:
    name: str
    master: str = ""
    epoch: int = 0
    leader_lease: int = 0
    members: dict[str, dict] = field(default_factory=dict)  # address -> member JSON
    insync: list[str] | None = None  # None: never written (a new shard)
    insync_revision: int = 0  # the insync key's mod revision as read (0: absent)

    def slaves(self) -> list[str]:
        return sorted(a for a in self.members if a != self.master)


def parse_view(prefix: bytes, kvs) -> dict[str, ShardView]:
    """Shards from a Range over ``/qdelay/<cluster>/shards/``."""
    shards: dict[str, ShardView] = {}
    for kv in kvs:
        rest = kv.key[len(prefix) :].decode()
        name, _, tail = rest.partition("/")
        s = shards.setdefault(name, ShardView(name))
        try:
            value = json.loads(kv.value) if kv.value else {}
        except ValueError:
            continue
        if tail == "leader":
            s.master = value.get("address", "")
            s.epoch = kv.create_revision
            s.leader_lease = kv.lease
        elif tail == "insync":
            s.insync = list(value.get("members", []))
            s.insync_revision = kv.mod_revision
        elif tail.startswith("members/"):
            s.members[tail[len("members/") :]] = value
    return shards


def campaign_guards(leader_key: bytes, insync_key: bytes, seen: ShardView) -> list:
    """What a campaign's transaction compares: the leader key is absent, and the in-sync set
    is still the one the eligibility was judged on (``seen``, read at the start of the step;
    the step then asks each member's log end, up to 0.5 s each). Without the second, a
    server judged eligible on a set a forced promotion had since replaced (``admin promote
    --force`` leaves the promoted server alone in it between its two transactions) could
    take the key back: the fenced old master master again."""
    return [absent(leader_key), unchanged_since(insync_key, seen.insync_revision)]


class ClusterAgent:
    """One server's part in the cluster: lease, member key, leadership, following."""

    def __init__(self, node, cfg) -> None:
        self.node = node
        self.engine = node.engine
        self.cfg = cfg
        self.cluster = cfg.cluster
        self.shard = cfg.shard
        self.address = ""
        # how this server names itself to a master it pulls from (replication/slave.py)
        self.name = f"{os.uname().nodename}:{os.path.abspath(cfg.data_dir)}"
        self.root = f"/qdelay/{cfg.cluster}/shards/".encode()
        self.shard_prefix = self.root + f"{cfg.shard}/".encode()
        self.leader_key = self.shard_prefix + b"leader"
        self.insync_key = self.shard_prefix + b"insync"
        self.ttl_s = max(1, cfg.lease_ttl_ms // 1000)
        self.renew_s = cfg.lease_renew_ms / 1000
        self.deadline_s = cfg.lease_deadline_ms / 1000
        self.poll_s = min(self.renew_s, 0.5)
        # two connections: a slow KV call never delays a lease renewal
        self.kv = Etcd(cfg.etcd)
        self.leases = Etcd(cfg.etcd, timeout=self.renew_s)
        self.lease_id: int | None = None
        self.valid_until = 0.0  # monotonic: the last renewal's send time + deadline
        self.leading_lease: int | None = None  # the lease our leader key is under
        self.self_fenced = False  # fenced by the deadline watchdog (not by a newer master)
        self.view: dict[str, ShardView] = {}
        self.insync: list[str] = []
        self._published = (None, 0.0)
        self._tasks: list[asyncio.Task] = []  # the logic loop and the watchdog
        self._renewing: asyncio.Task | None = None  # the renew loop
        self.stopping = False
        self.error = ""
        self._step_error = ""  # the last etcd error the logic loop logged (once, not every poll)
        self.renewals = 0
        self.renew_failures = 0
        self.leader_changes = 0  # times this server became master
        self.self_fences = 0
        self.became_master_at = 0.0

    # --- life cycle ------------------------------------------------------------------------------------
    def start(self, address: str) -> None:
        self.address = self.cfg.advertise or address
        self.engine.write_guard = self.check_writable
        self._renewing = asyncio.ensure_future(self._renew_loop())
        self._tasks = [asyncio.ensure_future(fn()) for fn in (self._logic_loop, self._watchdog)]
        log.info(
            "joining cluster %s as %s in shard %s (etcd %s)", self.cluster, self.address, self.shard, self.cfg.etcd
        )

    async def stop(self, deadline: float | None = None) -> None:
        """Stop acknowledging, let an attached slave confirm everything (async mode too), then
        give the leadership up at once (revoke the lease: the leader and member keys go with
        it) so that the slave takes over without waiting for the TTL. The hand-over waits
        ``HANDOVER_S`` at most, and never past ``deadline`` (the server's shutdown deadline).

        The watchdog and the logic loop stop first: the watchdog, seeing the lease no longer
        valid, fenced the engine on a worker thread that went on while the server closed the
        engine. The renewals go on until the hand-over is over (the lease must not expire
        before the slave has the whole log)."""
        self.stopping = True  # acknowledges nothing more, whatever a renewal says
        await cancel_and_wait(self._tasks)
        self.valid_until = 0.0
        if self.engine.role == "master":
            end = self.engine.wal.committed_offset
            until = time.monotonic() + HANDOVER_S
            if deadline is not None:
                until = min(until, deadline)
            while time.monotonic() < until and self.node.hub.live():
                if max(s.acked for s in self.node.hub.live()) >= end:
                    break
                await asyncio.sleep(0.01)
        await cancel_and_wait([self._renewing])
        if self.lease_id is not None:
            try:
                await self.leases.revoke(self.lease_id)
            except EtcdError:
                pass  # it expires by itself
        await self.kv.close()
        await self.leases.close()

    # --- the write guard --------------------------------------------------------------------------------
    def lease_ok(self) -> bool:
        return (
            not self.stopping
            and self.leading_lease is not None
            and self.leading_lease == self.lease_id
            and time.monotonic() < self.valid_until
        )

    def check_writable(self) -> None:
        """Engine hook: called before a write and again right before it is acknowledged."""
        if self.engine.role != "master":  # fenced while the write waited (a manual promotion)
            raise Fenced(f"this server was fenced at epoch {self.engine.epoch}: a newer master exists")
        if not self.lease_ok():
            raise LeaseLost(
                f"this server cannot prove it still holds the leadership of shard {self.shard!r} "
                f"(no etcd lease renewal for {self.deadline_s:g}s); the write is not acknowledged: "
                f"retry with the same message_id on the shard's current master"
            )

    # --- loops --------------------------------------------------------------------------------------------
    async def _renew_loop(self) -> None:
        while True:
            try:
                if self.lease_id is None:
                    lease, sent = await self.leases.grant(self.ttl_s)
                    self.lease_id, self.valid_until = lease, sent + self.deadline_s
                    self._published = (None, 0.0)
                    log.info("etcd lease granted", extra={"lease": lease, "ttl_s": self.ttl_s})
                else:
                    ttl, sent = await self.leases.keepalive(self.lease_id, timeout=self.renew_s)
                    if ttl <= 0:
                        log.error("etcd lease expired", extra={"lease": self.lease_id})
                        self.lease_id, self.valid_until = None, 0.0
                        continue
                    self.valid_until = sent + self.deadline_s
                    self.renewals += 1
            except asyncio.CancelledError:
                raise
            except EtcdError as e:
                self.renew_failures += 1
                self.error = str(e)
            except Exception:  # noqa: BLE001 - the loop must go on
                log.exception("lease renewal failed")
            await asyncio.sleep(self.renew_s)

    async def _watchdog(self) -> None:
        """Stop dispatching (fence) as soon as the lease can no longer be proven."""
        while True:
            await asyncio.sleep(0.05)
            if self.engine.role == "master" and not self.lease_ok():
                self.self_fenced = True
                self.self_fences += 1
                log.error(
                    "lost the leadership lease: no longer acknowledging writes nor dispatching",
                    extra={"shard": self.shard, "epoch": self.engine.epoch},
                )
                await asyncio.to_thread(self.engine.set_role, "fenced", self.engine.epoch)

    async def _logic_loop(self) -> None:
        while True:
            try:
                await self.tick()
                self.error = ""
                if self._step_error:
                    log.info("etcd: reachable again")
                    self._step_error = ""
            except asyncio.CancelledError:
                raise
            except EtcdError as e:
                # compared with its own last line: the renew loop writes self.error too, with
                # another call's name, so the same outage was logged again at every poll
                if str(e) != self._step_error:
                    log.warning("etcd: %s (logged once until it changes or etcd answers again)", e)
                    self._step_error = str(e)
                self.error = str(e)
            except Exception:  # noqa: BLE001
                log.exception("cluster step failed")
            await asyncio.sleep(self.poll_s)

    # --- one step ------------------------------------------------------------------------------------------
    async def tick(self) -> None:
        r = await self.kv.range_prefix(self.root)
        self.view = parse_view(self.root, r.kvs)
        await self._publish_member()
        me = self.view.get(self.shard) or ShardView(self.shard)
        engine = self.engine
        if me.master == self.address and me.leader_lease and me.leader_lease == self.lease_id:
            self.leading_lease = self.lease_id
            if engine.role != "master" and self.self_fenced and engine.epoch == me.epoch and self.lease_ok():
                log.warning("leadership lease proven again: master again", extra={"epoch": me.epoch})
                self.self_fenced = False
                await asyncio.to_thread(engine.set_role, "master", me.epoch)
            if engine.role == "master":
                await self._maintain_insync(me)
        elif me.master == self.address:
            # the key of this server's previous life (a restart within the TTL): the old
            # process is gone (this one listens on its address), so free the shard now
            await self.kv.txn([created_at(self.leader_key, me.epoch)], [delete(self.leader_key)])
        elif me.master:
            self.leading_lease = None
            await self._follow(me.master, me.epoch)
        else:
            self.leading_lease = None
            if engine.role == "master":
                await asyncio.to_thread(engine.set_role, "fenced", engine.epoch)
            if self.lease_id is not None and await self._eligible(me):
                await self._campaign(me)

    async def _publish_member(self) -> None:
        if self.lease_id is None:
            return
        engine = self.engine
        value = {
            "address": self.address,
            "name": self.name,
            "role": engine.role,
            "epoch": engine.epoch,
            "end_offset": engine.wal.committed_offset,
        }
        text = json.dumps(value, sort_keys=True).encode()
        last, at = self._published
        now = time.monotonic()
        if last is not None:
            # the offset moves with every write: republish it at most once a second, a role at once
            if text == last or (now - at < MEMBER_PUBLISH_S and json.loads(last).get("role") == engine.role):
                return
        await self.kv.put(self.shard_prefix + f"members/{self.address}".encode(), text, lease=self.lease_id)
        self._published = (text, now)

    async def _follow(self, master: str, epoch: int) -> None:
        engine = self.engine
        node = self.node
        if engine.role == "master":
            log.error("another master holds shard %s (%s, epoch %d): fenced", self.shard, master, epoch)
            await asyncio.to_thread(engine.set_role, "fenced", engine.epoch)
        puller = node.puller
        if puller is not None and puller.master == master:
            return
        from qdelay.replication.slave import Puller

        if puller is not None:
            await puller.stop()
        # a change of master is worth a WARNING; a node's first master (every start of every
        # slave) is the normal state, and a WARNING there is noise an alert would page on
        log.log(
            logging.WARNING if puller is not None else logging.INFO,
            "following master %s of shard %s (epoch %d)",
            master,
            self.shard,
            epoch,
        )
        node.puller = Puller(node, master)
        node.puller.start()

    async def _eligible(self, me: ShardView) -> bool:
        """May this server take the shard's leader key now? Only an in-sync member (anyone
        while the shard has no in-sync set yet), and only if no other eligible live member
        holds a longer log (ties: the lowest address)."""
        if me.insync is not None and self.address not in me.insync:
            return False
        mine = (self.engine.wal.committed_offset, self.address)
        for addr, m in me.members.items():
            if addr == self.address or (me.insync is not None and addr not in me.insync):
                continue
            st = await self.node.peer_status(addr, timeout=0.5)
            offset = st.end_offset if st is not None else int(m.get("end_offset", 0))
            if offset > mine[0] or (offset == mine[0] and addr < mine[1]):
                return False
        return True

    async def _campaign(self, me: ShardView) -> None:
        lease = self.lease_id
        value = json.dumps({"address": self.address}).encode()
        r = await self.kv.txn(
            campaign_guards(self.leader_key, self.insync_key, me),
            [
                put(self.leader_key, value, lease=lease),
                put(self.insync_key, json.dumps({"members": [self.address]}).encode()),
            ],
        )
        if not r.succeeded:
            return
        await self._become_master(r.header.revision, lease)

    async def _become_master(self, epoch: int, lease: int) -> None:
        engine = self.engine
        if epoch <= engine.epoch:
            # etcd's revisions are behind this data folder (etcd was wiped): an epoch that does
            # not grow would not fence anything; give the key back and say so
            log.error(
                "etcd revision %d is not above this server's epoch %d: refusing the leadership "
                "(was etcd's data lost? restore it, or start the nodes on a new --cluster name)",
                epoch,
                engine.epoch,
            )
            await self.kv.txn([created_at(self.leader_key, epoch)], [delete(self.leader_key)])
            return
        if self.node.puller is not None:
            await self.node.puller.stop()
            self.node.puller = None
        self.leading_lease = lease
        self.self_fenced = False
        view = self.view.setdefault(self.shard, ShardView(self.shard))
        view.master, view.epoch, view.leader_lease, view.insync = self.address, epoch, lease, [self.address]
        self.insync = [self.address]
        await asyncio.to_thread(engine.set_role, "master", epoch)
        self.leader_changes += 1
        self.became_master_at = time.time()
        log.warning(
            "took the leadership of shard %s at epoch %d (message log ends at %d)",
            self.shard,
            epoch,
            engine.wal.committed_offset,
        )

    async def _maintain_insync(self, me: ShardView) -> None:
        # the hub keeps what was committed sync_bound ago (or at the takeover: its samples
        # start again at a new epoch); here its in-sync slaves are named by their addresses
        by_name = {m.get("name"): addr for addr, m in me.members.items() if m.get("name")}
        members = [self.address]
        for sess in self.node.hub.in_sync():
            addr = by_name.get(sess.name)
            if addr is not None:
                members.append(addr)
        members = [members[0], *sorted(set(members[1:]))]
        if members != me.insync:
            r = await self.kv.txn(
                [created_at(self.leader_key, me.epoch)],
                [put(self.insync_key, json.dumps({"members": members}).encode())],
            )
            if r.succeeded:
                log.info("in-sync set", extra={"shard": self.shard, "members": ",".join(members)})
        self.insync = members

    # --- manual override ----------------------------------------------------------------------------------
    async def promote(self, force: bool) -> str:
        """``qdelay admin promote`` in cluster mode, through the same keys: fence the current
        master (only with ``force`` while it still answers), catch up with its log, then
        replace its leader key in one transaction guarded by that key's revision."""
        from qdelay.replication.master import _Refuse

        engine = self.engine
        if engine.role == "master":
            return f"already master of shard {self.shard} at epoch {engine.epoch}"
        r = await self.kv.range_prefix(self.root)
        me = parse_view(self.root, r.kvs).get(self.shard) or ShardView(self.shard)
        notes = []
        if me.insync is not None and self.address not in me.insync:
            if not force or me.master:
                raise _Refuse(
                    "FAILED_PRECONDITION",
                    f"{self.address} is not in the in-sync set of shard {self.shard} ({', '.join(me.insync)}): "
                    f"promoting it could lose acknowledged writes (with no master and no in-sync member "
                    f"left, --force accepts that loss)",
                )
            notes.append(
                f"not in the in-sync set ({', '.join(me.insync)}): writes acknowledged after "
                f"offset {engine.wal.committed_offset} may be lost"
            )
        if self.lease_id is None:
            raise _Refuse("UNAVAILABLE", "this server holds no etcd lease yet")
        if me.master:
            st = await self.node.peer_status(me.master, timeout=2.0)
            if st is None:
                raise _Refuse(
                    "FAILED_PRECONDITION",
                    f"the master {me.master} does not answer but its lease still holds: it may still be "
                    f"acknowledging writes; it fails over by itself once its lease expires",
                )
            if st.role == "master" and not force:
                raise _Refuse(
                    "FAILED_PRECONDITION",
                    f"the master {me.master} is running; stop it, or promote with --force (it will be fenced)",
                )
            from qdelay.v1 import replication_pb2 as rpb
            from qdelay.v1 import replication_pb2_grpc as rpb_grpc

            # catch up first: a fenced master serves no Pull stream any more
            end = st.end_offset
            deadline = time.monotonic() + 10
            while engine.wal.committed_offset < end and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if engine.wal.committed_offset < end:
                notes.append(f"this server has its log up to {engine.wal.committed_offset} of {end}")
            ch = self.node._channel(me.master)
            try:
                f = await rpb_grpc.ReplicationStub(ch).Fence(
                    rpb.FenceRequest(epoch=me.epoch + 1, master=self.address),
                    timeout=2.0,
                    metadata=self.node_metadata(),
                )
            finally:
                await ch.close()
            notes.append(f"{me.master}: {f.role} at epoch {f.epoch}")
            # etcd refuses a transaction that deletes and puts one key, and a put keeps the
            # key's create revision (the epoch): so first remove the old key and leave this
            # server alone in the in-sync set (no other may win the gap), then campaign
            gone = await self.kv.txn(
                [created_at(self.leader_key, me.epoch)],
                [delete(self.leader_key), put(self.insync_key, json.dumps({"members": [self.address]}).encode())],
            )
            if not gone.succeeded:
                raise _Refuse("ABORTED", "the shard's leader key changed meanwhile (an election ran); look again")
        value = json.dumps({"address": self.address}).encode()
        txn = await self.kv.txn(
            [absent(self.leader_key)],
            [
                put(self.leader_key, value, lease=self.lease_id),
                put(self.insync_key, json.dumps({"members": [self.address]}).encode()),
            ],
        )
        if not txn.succeeded:
            if not await self._won_meanwhile():
                raise _Refuse("ABORTED", "another server took the shard's leader key meanwhile; look again")
            won = f"{self.address} is master of shard {self.shard} at epoch {engine.epoch} (its own election)"
            notes.insert(0, won)
            return "; ".join(notes)
        await self._become_master(txn.header.revision, self.lease_id)
        notes.insert(0, f"{self.address} is master of shard {self.shard} at epoch {engine.epoch} (manual)")
        return "; ".join(notes)

    async def _won_meanwhile(self) -> bool:
        """After a promotion's campaign lost: whether this server's own election (its logic
        loop, seeing the key free and itself alone in the in-sync set the promotion wrote)
        took the key in between -- then the promotion happened; wait for its role."""
        kv = await self.kv.get(self.leader_key)
        if kv is None or kv.lease != self.lease_id:
            return False
        try:
            if json.loads(kv.value).get("address") != self.address:
                return False
        except ValueError:
            return False
        until = time.monotonic() + 5.0
        while self.engine.role != "master" and time.monotonic() < until:
            await asyncio.sleep(0.02)
        return self.engine.role == "master"

    def node_metadata(self):
        from qdelay.replication import common

        return common.metadata(self.node.token)

    # --- what others ask -------------------------------------------------------------------------------
    def topology(self) -> tuple[str, list[ShardView]]:
        return self.cluster, [self.view[k] for k in sorted(self.view)]

    def stats(self) -> dict:
        return {
            "cluster_lease_renewals": self.renewals,
            "cluster_lease_renew_failures": self.renew_failures,
            "cluster_leader_changes": self.leader_changes,
            "cluster_self_fences": self.self_fences,
            "cluster_lease_ok": self.lease_ok(),
        }
