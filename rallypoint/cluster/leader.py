"""Leadership of one shard, decided by etcd: campaign, epoch, self-fence, fenced ISR.

Keys (``../shared/SCALE-OUT.md`` §4.4), under ``/rallypoint/<cluster>/shards/<shard>/``:

- ``replicas``: JSON :class:`Replicas` ``{"members": [...], "isr": [...],
  "replication_factor": N}`` (node names); only a node in ``isr`` (the in-sync set) may
  become leader. ``replication_factor`` is how many nodes the shard has (1 or 2; 2 by
  default): ``members`` fills first come, first served, as each node starts the first
  time (:meth:`ShardElection.join`, a compare-and-swap on the key's mod revision), and
  once it holds that many names it is fixed: a node not named there is refused at start
  (:class:`NotAMemberError`);
- ``leader``: JSON :class:`LeaderInfo` ``{"node", "client_address",
  "replication_address", "http_address"}``, bound to the leader's lease (TTL 2 s by
  default, renewed every TTL/4). **The epoch is the leader key's create revision**: etcd
  revisions only grow, so every new leader has a higher epoch than all before it,
  cluster-wide.

Campaign: read both keys at one revision; if there is no leader and this node is in the
ISR of ``replicas`` at mod revision V, grant a lease and run the transaction
``leader CREATE == 0 AND replicas MOD == V`` → put the leader key with the lease. Else
watch the shard's keys and try again on any change.

Fencing guarantees, in the layers SCALE-OUT §4.4 describes (this module gives the first
two ingredients; the replica fence of frames lives in the replication code):

1. *etcd decides, atomically.* At most one leader key exists per shard, so at most one
   node holds a given epoch, and epochs strictly increase. A write fenced by
   :meth:`ShardElection.update_replicas_fenced` (compare ``leader CREATE == epoch``)
   succeeds only while the leader key created at that epoch still exists: once its lease
   has expired or been revoked, no ISR change by the deposed leader can succeed, however
   late its request arrives. A node dropped from the ISR cannot win a campaign (the
   ``replicas MOD == V`` compare fails if the ISR changed after it read it).
2. *The holder fences itself, by its own clock.* :meth:`Leadership.is_leader_now` is
   false once ``last successful keepalive's send time + TTL - margin_s`` has passed
   (Trio's clock, which is monotonic). etcd restarts the TTL when it *receives* the
   keepalive, later than it was sent, and only ever extends leases (on an etcd leader
   change), so the holder steps down at least ``margin_s`` before etcd can expire the
   lease and let another node campaign -- provided both clocks run at about the same
   rate. A process paused (SIGSTOP, a VM stall) past the deadline finds it passed the
   moment it runs again, since the monotonic clock kept counting. Writes never depend on
   this layer (layer 1 and the replica fence do); it keeps a deposed leader from
   answering reads.
3. *Loss is signalled at once.* A keepalive refused (lease not found), the leader key
   deleted or replaced (seen by a watch), a refused fenced write, or the self-fence
   deadline passing each set :attr:`Leadership.lost` and, by default, cancel the body of
   ``async with election.campaign(...)``, which then raises
   :class:`LeadershipLostError`. Leaving the block revokes the lease (a clean hand-over:
   standbys see the DELETE at once instead of waiting out the TTL).
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator, Sequence

import msgspec
import trio

from ..backoff import Backoff

from rallypoint.cluster.etcd import (
    Compare,
    EtcdClient,
    EtcdCompactedError,
    EtcdError,
    EtcdLeaseNotFoundError,
    EtcdUnavailableError,
    KeyValue,
    Put,
    Range,
    Watch,
)
from rallypoint.errors import ConflictError, InternalError, LeaseLostError, NotFoundError, ValidationError

__all__ = [
    "DEFAULT_REPLICATION_FACTOR",
    "MAX_REPLICATION_FACTOR",
    "check_replication_factor",
    "NotAMemberError",
    "LeaderInfo",
    "Replicas",
    "LeaderRecord",
    "ReplicasRecord",
    "ShardState",
    "ShardElection",
    "Leadership",
    "LeadershipStatistics",
    "LeaderWatch",
    "LeadershipLostError",
]

log = logging.getLogger("rallypoint.cluster")


class LeaderInfo(msgspec.Struct, frozen=True):
    """What a leader advertises in its leader key: its ``node`` name and the addresses
    (``host:port``, as the node prints them) of its client listener, its replication
    listener and its HTTP listener (None without ``--http``)."""

    node: str
    client_address: str
    replication_address: str
    http_address: str | None = None


#: How many nodes a shard has unless told otherwise (``cluster init --replicas``, ``serve
#: --replicas`` on the node that creates the shard): a leader and one standby.
DEFAULT_REPLICATION_FACTOR = 2
#: The most a shard can have: the replication link serves one standby at a time.
MAX_REPLICATION_FACTOR = 2


def check_replication_factor(n: int, flag: str = "--replicas") -> int:
    """``n`` if it is a valid node count of a shard (1 to :data:`MAX_REPLICATION_FACTOR`);
    else ValidationError (VALIDATION_FAILED) naming ``flag``."""
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_REPLICATION_FACTOR:
        raise ValidationError(f"{flag} must be 1 or {MAX_REPLICATION_FACTOR} (a shard is a leader and at most one "
                              f"standby), not {n!r}")
    return n


class Replicas(msgspec.Struct, frozen=True):
    """The shard's ``replicas`` value: every ``members`` node, the in-sync set ``isr``
    (a subset of members; the leader is always in it), and ``replication_factor``: how
    many members the shard takes (the set is fixed once it holds that many; a key
    written before this field existed reads as 2 and keeps whatever members it names)."""

    members: list[str]
    isr: list[str]
    replication_factor: int = DEFAULT_REPLICATION_FACTOR


class NotAMemberError(ConflictError):
    """CONFLICT: ``node`` is not a member of the shard and the shard's replica set is
    full (``details``: ``shard``, ``node``, ``members``, ``replication_factor``). The node
    must not start: it would replace the real standby over and over. Start it under a
    member's name, or replace a dead member (``rallypoint cluster remove-node``)."""

    def __init__(self, cluster: str, shard: str, node: str, replicas: Replicas) -> None:
        members = ", ".join(replicas.members)
        super().__init__(
            f"node {node!r} is not a member of shard {shard} of cluster {cluster!r}: its {replicas.replication_factor} "
            f"node(s) are {members} (the set in etcd is full); start one of them, or remove a dead member with "
            f"`rallypoint cluster remove-node --shard {shard} NAME` first",
            details={"shard": shard, "node": node, "members": list(replicas.members),
                     "replication_factor": replicas.replication_factor},
        )


class LeaderRecord(msgspec.Struct, frozen=True):
    """The leader key as read: ``info``, ``epoch`` (its create revision), ``lease_id``,
    ``mod_revision``."""

    info: LeaderInfo
    epoch: int
    lease_id: int
    mod_revision: int


class ReplicasRecord(msgspec.Struct, frozen=True):
    """The replicas key as read or written, with its ``mod_revision`` (the version a
    campaign compares)."""

    replicas: Replicas
    mod_revision: int


class ShardState(msgspec.Struct, frozen=True):
    """Both keys read at one store ``revision``; None where a key does not exist."""

    revision: int
    leader: LeaderRecord | None
    replicas: ReplicasRecord | None


class LeadershipLostError(LeaseLostError):
    """STALE_CLAIM: this node is not (or no longer) the shard's leader at the epoch it
    held: its lease expired or was revoked, its leader key was deleted, etcd refused a
    fenced write, or its self-fence deadline passed. ``details``: ``shard``, ``epoch``,
    ``reason``. Stop serving; campaign again or rejoin as a standby."""

    def __init__(self, shard: str, epoch: int, reason: str) -> None:
        super().__init__(
            f"shard {shard}: leadership at epoch {epoch} is lost ({reason}); stop serving and rejoin as a standby",
            details={"shard": shard, "epoch": epoch, "reason": reason},
        )
        self.shard = shard
        self.epoch = epoch
        self.reason = reason


class LeadershipStatistics(msgspec.Struct, frozen=True):
    """``fence_time_left_s``: seconds until the self-fence deadline (0 once passed or
    lost); ``keepalives_ok`` / ``keepalive_failures`` since election;
    ``last_keepalive_rtt_s``; ``lost_reason`` (None while leader)."""

    epoch: int
    lease_id: int
    ttl_s: int
    fence_time_left_s: float
    keepalives_ok: int
    keepalive_failures: int
    last_keepalive_rtt_s: float | None
    lost_reason: str | None


def _leader_record(shard: str, kv: KeyValue) -> LeaderRecord:
    try:
        info = msgspec.json.decode(kv.value, type=LeaderInfo)
    except msgspec.DecodeError as e:
        raise InternalError(
            f"shard {shard}: the leader key {kv.key!r} does not hold a leader record ({e}); delete it"
        ) from None
    return LeaderRecord(info=info, epoch=kv.create_revision, lease_id=kv.lease, mod_revision=kv.mod_revision)


def _replicas_record(shard: str, kv: KeyValue) -> ReplicasRecord:
    try:
        replicas = msgspec.json.decode(kv.value, type=Replicas)
    except msgspec.DecodeError as e:
        raise InternalError(f"shard {shard}: the replicas key {kv.key!r} is malformed ({e}); write it again") from None
    return ReplicasRecord(replicas=replicas, mod_revision=kv.mod_revision)


class ShardElection:
    """The etcd keys of one shard and the operations on them.

    ``client``: an :class:`EtcdClient`; ``cluster``: the cluster's name; ``shard``: the
    shard's number or name. Every call may raise EtcdUnavailableError (UNAVAILABLE) when
    etcd does not answer within the client's ``timeout_s``.
    """

    def __init__(self, client: EtcdClient, cluster: str, shard: int | str) -> None:
        self.client = client
        self.cluster = cluster
        self.shard = str(shard)
        self.prefix = f"/rallypoint/{cluster}/shards/{shard}/"
        self.leader_key = self.prefix + "leader"
        self.replicas_key = self.prefix + "replicas"

    # -- reading -------------------------------------------------------------------

    async def read(self) -> ShardState:
        """The leader and replicas keys at one revision (one transaction)."""
        r = await self.client.txn([], [Range(self.leader_key), Range(self.replicas_key)])
        lkvs, rkvs = r.responses[0].kvs, r.responses[1].kvs
        return ShardState(
            revision=r.revision,
            leader=_leader_record(self.shard, lkvs[0]) if lkvs else None,
            replicas=_replicas_record(self.shard, rkvs[0]) if rkvs else None,
        )

    async def read_leader(self) -> LeaderRecord | None:
        """The current leader (its addresses for NOT_LEADER hints, its epoch), or None."""
        kv = await self.client.get(self.leader_key)
        return _leader_record(self.shard, kv) if kv else None

    async def read_replicas(self) -> ReplicasRecord | None:
        """The current members and in-sync set, or None before :meth:`bootstrap`."""
        kv = await self.client.get(self.replicas_key)
        return _replicas_record(self.shard, kv) if kv else None

    def watch_leader(self) -> "LeaderWatch":
        """A :class:`LeaderWatch`: the current leader, then every change
        (``async with election.watch_leader() as leaders: async for rec in leaders:``)."""
        return LeaderWatch(self)

    # -- writing -------------------------------------------------------------------

    async def bootstrap(self, members: Sequence[str], isr: Sequence[str] | None = None, *,
                        replication_factor: int = DEFAULT_REPLICATION_FACTOR) -> bool:
        """Create the replicas key if it does not exist (``isr`` defaults to every
        member: new, empty nodes are all in sync). True if this call created it, False if
        it existed (then nothing changed). Raises ValidationError (VALIDATION_FAILED) if
        ``isr`` is not a non-empty subset of ``members``, or there are more members than
        ``replication_factor`` (1 or 2)."""
        check_replication_factor(replication_factor, "replication_factor")
        if len(set(members)) > replication_factor:
            raise ValidationError(f"{len(set(members))} members for a replication factor of {replication_factor}")
        value = _replicas(members, members if isr is None else isr, replication_factor)
        r = await self.client.txn(
            [Compare.create_revision(self.replicas_key, "==", 0)],
            [Put(self.replicas_key, msgspec.json.encode(value))],
        )
        return r.succeeded

    async def join(self, node: str, *, replication_factor: int | None = None,
                   create_with: int = DEFAULT_REPLICATION_FACTOR) -> ReplicasRecord:
        """Make ``node`` a member of the shard's replica set, or find it one already.

        No replicas key yet: create it with ``node`` as its only member and in-sync
        replica, and a replication factor of ``replication_factor`` if given, else
        ``create_with`` (the cluster's, from ``cluster init``). A key that names
        ``node``: nothing to do. A key with room (fewer members than its replication
        factor): add ``node`` to ``members`` (not to the in-sync set: it joins that once
        it has caught up), in a transaction that compares the key's mod revision with
        the one read (a concurrent join or in-sync set update is read again: first come,
        first served). Returns the record as it stands.

        Raises NotAMemberError (CONFLICT) when the set is full without ``node``;
        ValidationError when ``replication_factor`` is given and differs from the one the
        shard records (it is fixed when the shard is created), or is not 1 or 2;
        ConflictError if the key kept changing under 8 tries."""
        if replication_factor is not None:
            check_replication_factor(replication_factor)
        check_replication_factor(create_with, "the cluster's replication factor")
        for _ in range(8):
            current = await self.read_replicas()
            if current is None:
                rf = replication_factor or create_with
                if await self.bootstrap([node], replication_factor=rf):
                    log.info("shard %s of cluster %r created with %s as its first member (%d node(s))",
                             self.shard, self.cluster, node, rf)
                continue  # read what is there now (ours, or a node that came first)
            rep = current.replicas
            if replication_factor is not None and replication_factor != rep.replication_factor:
                raise ValidationError(
                    f"--replicas {replication_factor}: shard {self.shard} of cluster {self.cluster!r} has "
                    f"{rep.replication_factor} node(s), fixed when it was created (etcd {self.replicas_key}); "
                    "leave --replicas out")
            if node in rep.members:
                return current
            if len(rep.members) >= rep.replication_factor:
                raise NotAMemberError(self.cluster, self.shard, node, rep)
            value = Replicas(members=sorted({*rep.members, node}), isr=list(rep.isr),
                             replication_factor=rep.replication_factor)
            r = await self.client.txn(
                [Compare.mod_revision(self.replicas_key, "==", current.mod_revision)],
                [Put(self.replicas_key, msgspec.json.encode(value))],
            )
            if r.succeeded:
                log.info("node %s joined shard %s of cluster %r (members now %s)", node, self.shard, self.cluster,
                         ", ".join(value.members))
                return ReplicasRecord(replicas=value, mod_revision=r.revision)
        raise ConflictError(f"shard {self.shard}: the replicas key kept changing during 8 tries; try again")

    async def remove_member(self, node: str) -> ReplicasRecord:
        """Take ``node`` out of the shard's members (a dead node, or one whose name was
        mistyped), so that the next new name to start joins in its place. One
        transaction that holds only if the replicas key, the leader key and the node's
        presence key are as read.

        Refused (ConflictError, CONFLICT) while the node runs (its presence key is
        live), while it leads, and while it is in the in-sync set with a live leader
        (the leader drops a stopped standby within its ``--isr-timeout``: try again
        then); without a leader, it leaves the in-sync set with it unless it is the only
        node there (the others may lack acknowledged writes: refused). NotFoundError
        (NOT_FOUND) if it is not a member or the shard does not exist."""
        from .presence import presence_key

        pkey = presence_key(self.cluster, self.shard, node)
        r = await self.client.txn([], [Range(self.leader_key), Range(self.replicas_key), Range(pkey)])
        lkvs, rkvs, pkvs = (x.kvs for x in r.responses)
        if not rkvs:
            raise NotFoundError(f"shard {self.shard} of cluster {self.cluster!r} does not exist (no node started it)")
        current = _replicas_record(self.shard, rkvs[0])
        rep = current.replicas
        if node not in rep.members:
            raise NotFoundError(f"{node!r} is not a member of shard {self.shard}: its members are "
                                f"{', '.join(rep.members)}")
        leader = _leader_record(self.shard, lkvs[0]) if lkvs else None
        if leader is not None and leader.info.node == node:
            raise ConflictError(f"node {node!r} leads shard {self.shard}; stop it (SIGTERM hands over) first")
        if pkvs:
            raise ConflictError(f"node {node!r} of shard {self.shard} is running (its presence key is live); stop it "
                                "first")
        isr = [n for n in rep.isr if n != node]
        if node in rep.isr:
            if leader is not None:
                raise ConflictError(f"node {node!r} is still in the in-sync set of shard {self.shard}; its leader "
                                    f"{leader.info.node} drops it within its --isr-timeout once it has stopped: try "
                                    "again then")
            if not isr:
                raise ConflictError(f"node {node!r} is the only in-sync node of shard {self.shard}: without it no "
                                    "node holds every acknowledged write, so none could lead; start it again instead")
        value = Replicas(members=[n for n in rep.members if n != node], isr=isr,
                         replication_factor=rep.replication_factor)
        leader_cmp = (Compare.create_revision(self.leader_key, "==", leader.epoch) if leader is not None
                      else Compare.create_revision(self.leader_key, "==", 0))
        t = await self.client.txn(
            [Compare.mod_revision(self.replicas_key, "==", current.mod_revision), leader_cmp,
             Compare.create_revision(pkey, "==", 0)],
            [Put(self.replicas_key, msgspec.json.encode(value))],
        )
        if not t.succeeded:
            raise ConflictError(f"shard {self.shard} changed while its members were read; run it again")
        log.warning("node %s removed from the members of shard %s of cluster %r (now %s)", node, self.shard,
                    self.cluster, ", ".join(value.members))
        return ReplicasRecord(replicas=value, mod_revision=t.revision)

    async def update_replicas_fenced(
        self,
        epoch: int,
        isr: Sequence[str],
        *,
        members: Sequence[str] | None = None,
        leader_node: str | None = None,
    ) -> ReplicasRecord:
        """Write the in-sync set (and, if given, the members) **only while the leader
        key created at ``epoch`` exists**: one transaction comparing the leader key's
        create revision with ``epoch`` and the replicas key's mod revision with the one
        just read (a concurrent change is read again and retried).

        Raises LeadershipLostError (STALE_CLAIM) if the leader key is gone or newer;
        ValidationError if ``isr`` is not a non-empty subset of the members or leaves out
        ``leader_node``; ConflictError (CONFLICT) if the replicas key kept changing under
        8 tries. Returns the record written."""
        if leader_node is not None and leader_node not in isr:
            raise ValidationError(f"the in-sync set {list(isr)} must include the leader {leader_node!r}")
        for _ in range(8):
            current = await self.read_replicas()
            keep = members if members is not None else (current.replicas.members if current else isr)
            rf = current.replicas.replication_factor if current else DEFAULT_REPLICATION_FACTOR
            value = _replicas(keep, isr, rf)
            r = await self.client.txn(
                [
                    Compare.create_revision(self.leader_key, "==", epoch),
                    Compare.mod_revision(self.replicas_key, "==", current.mod_revision if current else 0),
                ],
                [Put(self.replicas_key, msgspec.json.encode(value))],
                [Range(self.leader_key), Range(self.replicas_key)],
            )
            if r.succeeded:
                return ReplicasRecord(replicas=value, mod_revision=r.revision)
            kvs, now = r.responses[0].kvs, r.responses[1].kvs
            if not kvs or kvs[0].create_revision != epoch:
                holder = f"epoch {kvs[0].create_revision}" if kvs else "no leader"
                reason = f"etcd refused the in-sync set update: the leader key is at {holder}"
                raise LeadershipLostError(self.shard, epoch, reason)
            # still the leader at this revision; the value may already be the one asked
            # for (an earlier try of this call whose answer was lost wrote it)
            if now and _replicas_record(self.shard, now[0]).replicas == value:
                return ReplicasRecord(replicas=value, mod_revision=now[0].mod_revision)
        raise ConflictError(f"shard {self.shard}: the replicas key kept changing during 8 tries; try again")

    # -- campaigning ----------------------------------------------------------------

    @asynccontextmanager
    async def campaign(
        self,
        me: LeaderInfo,
        *,
        ttl_s: int = 2,
        margin_s: float = 0.25,
        keepalive_interval_s: float | None = None,
        cancel_on_loss: bool = True,
    ) -> AsyncIterator["Leadership"]:
        """``async with election.campaign(me) as leadership:`` -- wait until this node
        leads the shard, hold it while the block runs, step down when it ends.

        Entering waits (watching, not polling) until there is no leader and ``me.node``
        is in the ISR, then wins the campaign transaction; etcd outages are retried.
        Inside, a lease keepalive runs every ``keepalive_interval_s`` (default
        ``ttl_s / 4``), the self-fence deadline is ``send time + TTL - margin_s`` of the
        last answered keepalive, and a watch on the leader key notices its deletion.
        When leadership is lost, :attr:`Leadership.lost` is set and, with
        ``cancel_on_loss`` (the default), the block is cancelled and ends with
        :class:`LeadershipLostError`; without it, the block runs on and must check.
        Leaving the block (normally, by an error, or cancelled) revokes the lease
        (bounded by ``ttl_s``), so the key goes at once. Seconds throughout.

        Raises ValidationError if ``margin_s`` or the interval do not fit in ``ttl_s``."""
        interval = ttl_s / 4 if keepalive_interval_s is None else keepalive_interval_s
        if not 0 <= margin_s < ttl_s or not 0 < interval < ttl_s - margin_s:
            raise ValidationError(
                f"campaign timing: need 0 <= margin_s ({margin_s}) < ttl_s ({ttl_s}) and "
                f"0 < keepalive_interval_s ({interval}) < ttl_s - margin_s"
            )
        lead = await self._acquire(me, ttl_s, margin_s, interval)
        log.info(
            "shard %s: %s leads at epoch %d (lease %#x, TTL %d s)", self.shard, me.node, lead.epoch, lead.lease_id, lead.ttl_s
        )
        try:
            async with trio.open_nursery() as nursery:
                if cancel_on_loss:
                    lead._cancel_on_loss = nursery.cancel_scope
                nursery.start_soon(lead._keepalive_loop)
                nursery.start_soon(lead._fence_loop)
                nursery.start_soon(lead._watch_loop)
                try:
                    yield lead
                finally:
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:  # the background tasks never raise: the body's own error
            exc = group.exceptions[0] if len(group.exceptions) == 1 else group
            raise exc from exc.__cause__
        finally:
            with trio.CancelScope(shield=True):
                await lead._step_down()
        if cancel_on_loss and lead.lost_reason not in (None, "resigned"):
            raise LeadershipLostError(self.shard, lead.epoch, lead.lost_reason)

    async def _acquire(self, me: LeaderInfo, ttl_s: int, margin_s: float, interval_s: float) -> "Leadership":
        value = msgspec.json.encode(me)
        backoff = Backoff(0.05, 1.0)
        while True:
            try:
                state = await self.read()
                eligible = state.replicas is not None and me.node in state.replicas.replicas.isr
                if state.leader is None and eligible:
                    lead = await self._try_acquire(me, value, state, ttl_s, margin_s, interval_s)
                    if lead is not None:
                        return lead
                    continue
                await self._wait_for_change(state.revision)
                backoff.reset()
            except EtcdLeaseNotFoundError:
                continue  # the fresh lease expired before the transaction ran (a stall): again
            except EtcdUnavailableError as e:
                log.warning("shard %s: campaign of %s waits for etcd: %s", self.shard, me.node, e.message)
                await backoff.sleep()

    async def _try_acquire(
        self, me: LeaderInfo, value: bytes, state: ShardState, ttl_s: int, margin_s: float, interval_s: float
    ) -> "Leadership | None":
        assert state.replicas is not None
        sent = trio.current_time()
        grant = await self.client.lease_grant(ttl_s)
        try:
            r = await self.client.txn(
                [
                    Compare.create_revision(self.leader_key, "==", 0),
                    Compare.mod_revision(self.replicas_key, "==", state.replicas.mod_revision),
                ],
                [Put(self.leader_key, value, lease=grant.lease_id), Range(self.leader_key)],
                [Range(self.leader_key)],
            )
        except BaseException:
            with trio.CancelScope(shield=True):
                await _revoke_quietly(self.client, grant.lease_id, ttl_s)
            raise
        kvs = r.responses[-1].kvs
        # ours also when a re-sent transaction found the key its first try created
        if kvs and kvs[0].lease == grant.lease_id:
            return Leadership(self, me, kvs[0].create_revision, grant.lease_id, grant.ttl_s, sent, margin_s, interval_s)
        await _revoke_quietly(self.client, grant.lease_id, ttl_s)
        return None

    async def _wait_for_change(self, revision: int) -> None:
        """Return at the first change of the leader or replicas key after ``revision``."""
        try:
            async with self.client.watch(self.prefix, prefix=True, start_revision=revision + 1) as events:
                async for ev in events:
                    if ev.kv.key in (self.leader_key.encode(), self.replicas_key.encode()):
                        return
        except EtcdCompactedError:
            return


def _replicas(members: Sequence[str], isr: Sequence[str], replication_factor: int) -> Replicas:
    m, i = sorted(set(members)), sorted(set(isr))
    if not i or not set(i) <= set(m):
        raise ValidationError(f"the in-sync set {i} must be a non-empty subset of the members {m}")
    return Replicas(members=m, isr=i, replication_factor=replication_factor)


async def _revoke_quietly(client: EtcdClient, lease_id: int, timeout_s: float) -> bool:
    """Revoke, ignoring failure (the lease then expires by its TTL). True if revoked."""
    try:
        await client.lease_revoke(lease_id, timeout_s=min(client.timeout_s, timeout_s))
        return True
    except EtcdLeaseNotFoundError:
        return True
    except EtcdError as e:
        log.info("could not revoke lease %#x (%s); it expires by its TTL", lease_id, e.message)
        return False


class Leadership:
    """This node's leadership of one shard at one ``epoch``, as given by
    :meth:`ShardElection.campaign` (only valid inside its block).

    Attributes: ``epoch`` (the fencing token: the leader key's create revision),
    ``lease_id``, ``ttl_s`` (as etcd granted it), ``me`` (the advertised
    :class:`LeaderInfo`), ``lost`` (a ``trio.Event`` set when leadership is lost or
    resigned) and ``lost_reason`` (None while leader, ``"resigned"`` after
    :meth:`resign` or the block's end, else why it was lost).
    """

    def __init__(
        self,
        election: ShardElection,
        me: LeaderInfo,
        epoch: int,
        lease_id: int,
        ttl_s: int,
        granted_at: float,
        margin_s: float,
        keepalive_interval_s: float,
    ) -> None:
        self.election = election
        self.me = me
        self.epoch = epoch
        self.lease_id = lease_id
        self.ttl_s = ttl_s
        self.margin_s = margin_s
        self.keepalive_interval_s = keepalive_interval_s
        self.lost = trio.Event()
        self.lost_reason: str | None = None
        self._granted_at = granted_at
        self._fence_deadline = granted_at + ttl_s - margin_s
        self._cancel_on_loss: trio.CancelScope | None = None
        self._revoked = False
        self._keepalives_ok = 0
        self._keepalive_failures = 0
        self._last_rtt_s: float | None = None

    # -- for the holder --------------------------------------------------------------

    def is_leader_now(self) -> bool:
        """True while leadership is not lost and the self-fence deadline has not passed
        (checked against the Trio clock at each call: cheap, call it before every reply
        batch)."""
        return self.lost_reason is None and trio.current_time() < self._fence_deadline

    def check(self) -> None:
        """Raise LeadershipLostError (STALE_CLAIM) unless :meth:`is_leader_now`."""
        if not self.is_leader_now():
            reason = self.lost_reason or "the self-fence deadline passed"
            raise LeadershipLostError(self.election.shard, self.epoch, reason)

    @property
    def fence_deadline(self) -> float:
        """The self-fence deadline, in Trio clock seconds."""
        return self._fence_deadline

    async def update_isr(self, isr: Sequence[str], *, members: Sequence[str] | None = None) -> ReplicasRecord:
        """Change the in-sync set (and members), fenced by this epoch: refused locally
        once :meth:`is_leader_now` is false, and by etcd once the leader key of this
        epoch is gone (:meth:`ShardElection.update_replicas_fenced`). A refusal marks the
        leadership lost. Call it *before* acknowledging anything without a dropped
        standby. Raises LeadershipLostError, ValidationError (``isr`` must include this
        node), ConflictError, EtcdUnavailableError."""
        self.check()
        try:
            return await self.election.update_replicas_fenced(self.epoch, isr, members=members, leader_node=self.me.node)
        except LeadershipLostError as e:
            self._lose(e.reason)
            raise

    async def resign(self) -> None:
        """Step down now: stop counting as leader and revoke the lease, so the leader key
        goes and a standby may campaign at once (a SIGTERM hand-over). Idempotent; the
        block then ends without LeadershipLostError."""
        if self.lost_reason is None:
            self.lost_reason = "resigned"
            self.lost.set()
        await self._step_down()

    def statistics(self) -> LeadershipStatistics:
        left = max(0.0, self._fence_deadline - trio.current_time()) if self.lost_reason is None else 0.0
        return LeadershipStatistics(
            epoch=self.epoch,
            lease_id=self.lease_id,
            ttl_s=self.ttl_s,
            fence_time_left_s=left,
            keepalives_ok=self._keepalives_ok,
            keepalive_failures=self._keepalive_failures,
            last_keepalive_rtt_s=self._last_rtt_s,
            lost_reason=self.lost_reason,
        )

    # -- background tasks (they never raise; loss goes through _lose) ----------------

    def _lose(self, reason: str) -> None:
        if self.lost_reason is not None:
            return
        self.lost_reason = reason
        self.lost.set()
        log.warning("shard %s: %s lost leadership at epoch %d: %s", self.election.shard, self.me.node, self.epoch, reason)
        if self._cancel_on_loss is not None:
            self._cancel_on_loss.cancel()

    async def _step_down(self) -> None:
        if not self._revoked:
            self._revoked = await _revoke_quietly(self.election.client, self.lease_id, self.ttl_s)

    async def _keepalive_loop(self) -> None:
        client = self.election.client
        next_send = self._granted_at + self.keepalive_interval_s
        while self.lost_reason is None:
            await trio.sleep_until(next_send)
            sent = trio.current_time()
            next_send = sent + self.keepalive_interval_s
            ttl_s = None
            try:
                with trio.move_on_after(self.keepalive_interval_s):
                    ttl_s = await client.lease_keepalive(self.lease_id, timeout_s=self.keepalive_interval_s)
            except EtcdLeaseNotFoundError:
                self._lose("the lease expired at etcd (a keepalive found it gone)")
                return
            except EtcdError as e:
                log.info("shard %s: keepalive of lease %#x failed: %s", self.election.shard, self.lease_id, e.message)
            if ttl_s is None:
                self._keepalive_failures += 1
                continue
            self._keepalives_ok += 1
            self._last_rtt_s = trio.current_time() - sent
            self._fence_deadline = max(self._fence_deadline, sent + ttl_s - self.margin_s)

    async def _fence_loop(self) -> None:
        while self.lost_reason is None:
            await trio.sleep_until(self._fence_deadline)
            if trio.current_time() >= self._fence_deadline:
                self._lose(
                    f"self-fence: no keepalive answered for {self.ttl_s - self.margin_s:g} s, "
                    f"so the lease may expire at etcd within {self.margin_s:g} s"
                )

    async def _watch_loop(self) -> None:
        election = self.election
        start = self.epoch + 1
        while self.lost_reason is None:
            try:
                async with election.client.watch(election.leader_key, start_revision=start) as events:
                    async for ev in events:
                        if ev.type == "DELETE" or ev.kv.create_revision != self.epoch:
                            self._lose("the leader key was deleted (lease expired or revoked)")
                            return
                        start = ev.kv.mod_revision + 1
            except EtcdCompactedError:
                try:
                    state = await election.read()
                except EtcdError:
                    continue
                if state.leader is None or state.leader.epoch != self.epoch:
                    self._lose("the leader key was deleted (lease expired or revoked)")
                    return
                start = state.revision + 1
            except EtcdError as e:
                log.warning("shard %s: watch of the leader key failed (%s); watching again", election.shard, e.message)
                await trio.sleep(self.keepalive_interval_s)


class LeaderWatch:
    """The shard's leader as it changes, for standbys and for NOT_LEADER hints: an async
    iterator of ``LeaderRecord | None`` (None = no leader: the key was deleted). The
    first value is the current state; then one value per change (a new leader, a
    deletion, new addresses). A compacted history is handled by reading the key again.
    Use ``async with election.watch_leader() as leaders: async for rec in leaders:``.
    Reconnects as :class:`~rallypoint.cluster.etcd.Watch` does."""

    def __init__(self, election: ShardElection) -> None:
        self._election = election
        self._watch: Watch | None = None
        self._last: LeaderRecord | None = None
        self._started = False

    async def __aenter__(self) -> "LeaderWatch":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._watch is not None:
            await self._watch.aclose()

    def __aiter__(self) -> "LeaderWatch":
        return self

    async def _restart(self) -> LeaderRecord | None:
        election = self._election
        state = await election.read()
        if self._watch is not None:
            await self._watch.aclose()
        self._watch = election.client.watch(election.leader_key, start_revision=state.revision + 1)
        return state.leader

    async def __anext__(self) -> LeaderRecord | None:
        if not self._started:
            self._last = await self._restart()
            self._started = True
            return self._last
        assert self._watch is not None
        while True:
            try:
                ev = await self._watch.__anext__()
                new = None if ev.type == "DELETE" else _leader_record(self._election.shard, ev.kv)
            except EtcdCompactedError:
                new = await self._restart()
            if new != self._last:
                self._last = new
                return new
