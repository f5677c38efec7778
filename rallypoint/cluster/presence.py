"""One live process per node name: a node's presence key in etcd.

Key, under ``/rallypoint/<cluster>/shards/<shard>/``:

- ``nodes/<node>``: JSON :class:`NodeInstance` ``{"instance", "pid", "host",
  "started_at_ms", "ttl_s"}``, bound to a lease of the node's own (TTL ``ttl_s``, the
  node's ``--lease-ttl``, renewed every TTL/4), created by a transaction that fails if
  the key exists (``CREATE == 0``).

A node claims its key before it binds a listener or opens its data dir
(:meth:`NodePresence.claim`), holds it while it runs (:meth:`NodePresence.keep`) and
revokes the lease when it stops (:meth:`NodePresence.release`: the key goes at once).

Two processes started with the same ``--node`` would both follow the leader under one
name and replace each other's replication session over and over; the second one is
refused (:class:`DuplicateNodeError`). The key of a process that was killed (``kill -9``,
a crash) is not revoked: it lives until its lease lapses, at most its ``ttl_s`` after
the last renewal. So a claim that finds another instance's key waits, watching the key,
for ``ttl_s + margin_s`` seconds: a dead holder's key goes within that time and the
claim then succeeds (a restart right after ``kill -9`` starts, up to one TTL later); a
live holder keeps renewing, and the claim is refused when the wait is over. While etcd
cannot be reached the claim waits for it (and judges the holder afresh once it answers).

A running node whose lease lapsed (it was cut off from etcd for longer than the TTL)
claims its key again when etcd answers; if another instance took the name meanwhile,
:meth:`NodePresence.keep` raises DuplicateNodeError and this node must stop.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time

import msgspec
import trio

from ..backoff import Backoff
from ..errors import ConflictError
from .etcd import Compare, EtcdClient, EtcdError, EtcdLeaseNotFoundError, EtcdUnavailableError, Put, Range

__all__ = ["NodeInstance", "NodePresence", "DuplicateNodeError", "presence_key", "nodes_prefix"]

log = logging.getLogger("rallypoint.cluster")


def nodes_prefix(cluster: str, shard: int | str) -> str:
    """``/rallypoint/<cluster>/shards/<shard>/nodes/``: the presence keys of a shard."""
    return f"/rallypoint/{cluster}/shards/{shard}/nodes/"


def presence_key(cluster: str, shard: int | str, node: str) -> str:
    """The presence key of ``node`` in ``shard``."""
    return nodes_prefix(cluster, shard) + node


class NodeInstance(msgspec.Struct, frozen=True):
    """Who holds a presence key: ``instance`` (random, one per process start), ``pid``,
    ``host`` (its hostname), ``started_at_ms`` (Unix ms) and ``ttl_s`` (its lease's TTL,
    seconds: how long its key outlives a kill -9)."""

    instance: str
    pid: int = 0
    host: str = ""
    started_at_ms: int = 0
    ttl_s: int = 2

    def describe(self) -> str:
        """``pid 123 on host h, started 2026-01-02 03:04:05 UTC``."""
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started_at_ms / 1000))
        return f"pid {self.pid} on host {self.host or '?'}, started {when}"


class DuplicateNodeError(ConflictError):
    """CONFLICT: another live process holds this node's name in the shard
    (``details``: ``shard``, ``node``, ``holder``: its pid, host and start time). Each
    node of a shard needs its own ``--node`` name: stop the other process, or start this
    one under its own name."""

    def __init__(self, cluster: str, shard: str, node: str, holder: NodeInstance, *, waited_s: float | None) -> None:
        if waited_s is None:
            what = ("another process took this node's name while this one was cut off from etcd (its presence lease "
                    "lapsed); this one stops")
        else:
            what = (f"its presence key in etcd was renewed throughout {waited_s:g} s (a process that died would have "
                    "let it lapse); two processes may not share a --node name: stop the other one, or give this one "
                    "its own name")
        super().__init__(
            f"node {node!r} of shard {shard} of cluster {cluster!r} is already running ({holder.describe()}): {what}",
            details={"shard": shard, "node": node, "holder": msgspec.to_builtins(holder)},
        )


def _decode(value: bytes) -> NodeInstance:
    try:
        return msgspec.json.decode(value, type=NodeInstance)
    except msgspec.DecodeError:
        return NodeInstance(instance="?")  # not ours to judge: treated as another instance


class NodePresence:
    """This process's presence key for ``node`` in ``shard`` (see the module docstring).

    ``client``: an :class:`EtcdClient` (or the simulator's fake); ``ttl_s``: the lease's
    TTL (seconds, at least 2: etcd's minimum); ``margin_s``: how long past a holder's
    TTL a claim keeps waiting for its key to lapse (seconds). Attributes: ``key``,
    ``me`` (this process's :class:`NodeInstance`), ``lease_id`` (None until claimed),
    ``claims`` (successful claims: 1 + re-claims after a lapse)."""

    def __init__(self, client: EtcdClient, cluster: str, shard: int | str, node: str, *, ttl_s: int = 2,
                 margin_s: float = 1.0) -> None:
        self.client = client
        self.cluster = cluster
        self.shard = str(shard)
        self.node = node
        self.key = presence_key(cluster, shard, node)
        self.ttl_s = max(2, int(ttl_s))
        self.margin_s = margin_s
        self.me = NodeInstance(instance=secrets.token_hex(8), pid=os.getpid(), host=socket.gethostname(),
                               started_at_ms=int(time.time() * 1000), ttl_s=self.ttl_s)
        self._value = msgspec.json.encode(self.me)
        self.lease_id: int | None = None
        self.claims = 0

    async def claim(self) -> None:
        """Create the key under a new lease, waiting out a dead holder's lease (at most
        its ``ttl_s + margin_s`` seconds) and etcd outages (backing off up to 1 s).
        Raises DuplicateNodeError (CONFLICT) if another instance keeps the key alive."""
        await self._claim(wait=True)

    async def _claim(self, *, wait: bool) -> None:
        deadline: float | None = None
        started = trio.current_time()
        backoff = Backoff(0.05, 1.0)
        while True:
            try:
                if self.lease_id is None:
                    self.lease_id = (await self.client.lease_grant(self.ttl_s)).lease_id
                r = await self.client.txn(
                    [Compare.create_revision(self.key, "==", 0)],
                    [Put(self.key, self._value, lease=self.lease_id)],
                    [Range(self.key)],
                )
                if r.succeeded:
                    self.claims += 1
                    return
                kvs = r.responses[0].kvs
                if not kvs:
                    continue  # it went between the compare and now: again
                kv = kvs[0]
                holder = _decode(kv.value)
                if holder.instance == self.me.instance:
                    if kv.lease != self.lease_id:  # ours, under a lease of an earlier try: rebind it
                        await self.client.txn([Compare.mod_revision(self.key, "==", kv.mod_revision)],
                                              [Put(self.key, self._value, lease=self.lease_id)])
                        continue
                    self.claims += 1
                    return  # an earlier try of this transaction, applied (its answer lost)
                if not wait:
                    raise DuplicateNodeError(self.cluster, self.shard, self.node, holder, waited_s=None)
                now = trio.current_time()
                if deadline is None:
                    deadline = now + max(2, holder.ttl_s) + self.margin_s
                    log.info("node %s of shard %s: another instance holds its name (%s); waiting up to %g s for "
                             "its lease to lapse (a process killed a moment ago)", self.node, self.shard,
                             holder.describe(), deadline - now)
                if now >= deadline:
                    raise DuplicateNodeError(self.cluster, self.shard, self.node, holder,
                                             waited_s=round(now - started, 1))
                with trio.move_on_at(deadline):
                    await self._wait_for_change(kv.mod_revision)
                backoff.reset()
            except EtcdLeaseNotFoundError:
                self.lease_id = None  # our fresh lease lapsed before the put (a stall): a new one
            except EtcdUnavailableError as e:
                log.warning("node %s: waiting for etcd to register this node (%s)", self.node, e.message)
                deadline = None  # judged again once etcd answers: the holder's lease ran on meanwhile
                await backoff.sleep()

    async def _wait_for_change(self, mod_revision: int) -> None:
        async with self.client.watch(self.key, start_revision=mod_revision + 1) as events:
            async for _ev in events:
                return

    async def keep(self) -> None:
        """Renew the lease every ``ttl_s / 4`` seconds until cancelled. A lease that
        lapsed at etcd (this node was cut off for longer than the TTL) is claimed again
        without waiting; raises DuplicateNodeError if another instance holds the name
        by then. Etcd outages are logged and outlasted."""
        interval = self.ttl_s / 4
        while True:
            await trio.sleep(interval)
            try:
                if self.lease_id is None:
                    raise EtcdLeaseNotFoundError(0)
                with trio.move_on_after(interval):
                    await self.client.lease_keepalive(self.lease_id, timeout_s=interval)
            except EtcdLeaseNotFoundError:
                log.warning("node %s: its presence lease lapsed at etcd (cut off from etcd for longer than %d s); "
                            "registering it again", self.node, self.ttl_s)
                self.lease_id = None
                await self._claim(wait=False)
            except EtcdError as e:
                log.info("node %s: presence keepalive failed (%s)", self.node, e.message)

    async def release(self) -> None:
        """Revoke the lease (the key goes at once, so a restart need not wait); bounded
        by the client's timeout, failures ignored (the key then lapses by its TTL)."""
        lease, self.lease_id = self.lease_id, None
        if lease is None:
            return
        with trio.CancelScope(shield=True), trio.move_on_after(self.ttl_s):
            try:
                await self.client.lease_revoke(lease, timeout_s=min(self.client.timeout_s, self.ttl_s))
            except EtcdLeaseNotFoundError:
                pass  # lapsed already (a claim that waited, or etcd cut off): the key is gone with it
            except EtcdError as e:
                log.info("node %s: could not revoke its presence lease (%s); it lapses by its TTL", self.node,
                         e.message)
