"""A sharded cluster's slot map in etcd: how many slots, and which shard owns each.

Keys, under ``/rallypoint/<cluster>/``:

| key | value (JSON) |
|---|---|
| ``config`` | ``{"slots": N, "shards": K, "replication_factor": R}``: the slot count, fixed when the cluster is created (``rallypoint cluster init``), how many shards were made then, and how many nodes each shard has (``--replicas``, 2 by default; recorded in each shard's ``replicas`` key by its first node) |
| ``reinit`` | ``{"at_ms": ..., "replaced": "..."}``, written by ``cluster init --force``: its mod revision R marks the re-creation; a node whose data dir holds an epoch below R holds the deleted cluster's data and is refused at start |
| ``slotmap`` | ``{"owners": [shard of slot 0, ..., shard of slot N-1]}``; its mod revision is the map's **version** |
| ``node_secret`` | 43 URL-safe characters (256 random bits): what a node presents to another node's client port to make the calls between shards (``run.link``, ``outbox.deliver``); made with the cluster, or by the first leader of a cluster made before it (:func:`node_secret`) |

``cluster init --slots N --shards K`` deals the slots out round-robin (slot i to shard
i mod K). It is refused on a name that already has a shard or a cluster in this etcd
(a ``config``, a ``slotmap`` or any key under ``shards/``; API keys and the node secret
alone do not count), with one line saying what is there (:func:`inventory`); with
``force=True`` a cluster whose every shard is stopped (no leader key, no node's presence
key) is deleted and made anew in one transaction, while a running one is refused even
then. ``cluster add-shard`` gives a new shard slots that hold nothing yet: each
existing shard's leader releases some empty slots (``cluster.release_slots``: it
refuses new entities in them from then on, in a journaled step) and the map is changed
by one transaction that compares its version; the new shard then takes new root runs
(the SDK spreads them over every shard). Moving a slot that holds data is not done.

Every node watches the map (:func:`watch_map`) and refuses requests for slots it does
not own (WRONG_SHARD); the SDK keeps the map and the leaders of every shard
(``cluster.map``), refreshing both when a node says WRONG_SHARD or NOT_LEADER.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator

import msgspec

from ..errors import ConflictError, NotFoundError, ValidationError
from ..ids import MAX_SLOTS
from .etcd import Compare, Delete, EtcdClient, EtcdCompactedError, Put, Range

log = logging.getLogger("rallypoint.cluster")

__all__ = ["ClusterConfig", "SlotMap", "ShardInventory", "ClusterInventory", "ClusterExistsError", "init_cluster",
           "create_cluster", "inventory", "read_config", "reinit_revision", "read_map", "watch_map", "set_owners",
           "node_secret", "DEFAULT_SLOTS"]

#: Slots of a new cluster (the most an id can name: 10 bits).
DEFAULT_SLOTS = MAX_SLOTS


class ClusterConfig(msgspec.Struct, frozen=True):
    """``slots``: the cluster's slot count (fixed); ``shards``: shards made at creation;
    ``replication_factor``: nodes per shard (1 or 2), which each shard's first node
    records in the shard's ``replicas`` key."""

    slots: int
    shards: int
    replication_factor: int = 2


class ShardInventory(msgspec.Struct, frozen=True):
    """One shard as its etcd keys show it: ``members``, ``isr`` and
    ``replication_factor`` from its ``replicas`` key (empty / None without one),
    ``leader`` and ``epoch`` from its leader key (None: no leader), ``running``: the
    nodes whose presence key is live, ``other_keys``: any other key under the shard."""

    shard: str
    members: list[str] = []
    isr: list[str] = []
    replication_factor: int | None = None
    leader: str | None = None
    epoch: int | None = None
    running: list[str] = []
    other_keys: int = 0

    @property
    def is_running(self) -> bool:
        """A leader's lease or a node's presence lease is live."""
        return self.leader is not None or bool(self.running)

    def describe(self) -> str:
        """``shard 0: members a, b (2 of 2), leader a at epoch 12, running a, b``."""
        parts = []
        if self.replication_factor is not None:
            parts.append(f"members {', '.join(self.members) or 'none'} ({len(self.members)} of "
                         f"{self.replication_factor}), in sync {', '.join(self.isr)}")
        else:
            parts.append("no replicas key")
        parts.append(f"leader {self.leader} at epoch {self.epoch}" if self.leader is not None else "no leader")
        parts.append(f"running {', '.join(self.running)}" if self.running
                     else "running (its leader's lease is live)" if self.leader is not None else "stopped")
        if self.other_keys:
            parts.append(f"{self.other_keys} other key(s)")
        return f"shard {self.shard}: " + ", ".join(parts)


class ClusterInventory(msgspec.Struct, frozen=True):
    """What etcd holds under ``/rallypoint/<cluster>/`` at one ``revision``: the cluster's
    ``config`` (None: never ``cluster init``), whether it has a slot map, its shards."""

    cluster: str
    revision: int
    config: ClusterConfig | None = None
    has_slotmap: bool = False
    shards: list[ShardInventory] = []

    @property
    def occupied(self) -> bool:
        """A cluster or a shard of this name exists (keys and the node secret alone: no)."""
        return self.config is not None or self.has_slotmap or bool(self.shards)

    @property
    def running(self) -> list[ShardInventory]:
        """The shards with a live leader or node."""
        return [s for s in self.shards if s.is_running]

    def describe(self) -> str:
        """One line: what there is, the cluster then each shard (``cluster 'c' (64
        slots over 2 shard(s) of 2 node(s)); shard 0: members a, b (2 of 2), ...``)."""
        if self.config is not None:
            head = (f"cluster {self.cluster!r} ({self.config.slots} slots over {self.config.shards} shard(s) of "
                    f"{self.config.replication_factor} node(s))")
        elif self.has_slotmap:
            head = f"cluster {self.cluster!r} (a slot map without its config)"
        else:
            head = f"a replicated shard named {self.cluster!r} (started without `cluster init`)"
        shards = "; ".join(s.describe() for s in self.shards) or "no shard has started yet"
        return f"{head}; {shards}"


class ClusterExistsError(ConflictError):
    """CONFLICT: ``cluster init`` on a name that already has a cluster or a shard in
    this etcd (the message says what is there: ``details["inventory"]``), or, with
    ``--force``, one that is still running."""

    def __init__(self, message: str, inv: ClusterInventory) -> None:
        super().__init__(message, details={"inventory": msgspec.to_builtins(inv)})
        self.inventory = inv


class SlotMap(msgspec.Struct, frozen=True):
    """``owners[slot]`` = the shard owning it; ``version``: the map's etcd mod revision."""

    owners: list[int]
    version: int = 0

    @property
    def shards(self) -> list[int]:
        """Every shard that owns at least one slot, in order."""
        return sorted(set(self.owners))


class _MapValue(msgspec.Struct):
    owners: list[int]


def _keys(cluster: str) -> tuple[str, str]:
    return f"/rallypoint/{cluster}/config", f"/rallypoint/{cluster}/slotmap"


def _reinit_key(cluster: str) -> str:
    return f"/rallypoint/{cluster}/reinit"


async def read_config(client: EtcdClient, cluster: str) -> ClusterConfig | None:
    """The cluster's config, or None (a single shard started without ``cluster init``)."""
    kv = await client.get(_keys(cluster)[0])
    return None if kv is None else msgspec.json.decode(kv.value, type=ClusterConfig)


async def reinit_revision(client: EtcdClient, cluster: str) -> int:
    """The etcd revision of the last ``cluster init --force`` of this name (0: never).
    Every epoch of the cluster made then is higher; a data dir whose newest epoch is
    lower (and not 0) holds the deleted cluster's data."""
    kv = await client.get(_reinit_key(cluster))
    return 0 if kv is None else kv.mod_revision


async def inventory(client: EtcdClient, cluster: str) -> ClusterInventory:
    """Every key of the cluster's prefix, read at one revision, as a
    :class:`ClusterInventory` (the config, the slot map, each shard's members, leader
    and live nodes)."""
    from .leader import Replicas, _leader_record

    root = f"/rallypoint/{cluster}/"
    r = await client.range(root, prefix=True)
    ck, mk = _keys(cluster)
    config = None
    has_map = False
    shards: dict[str, dict] = {}
    for kv in r.kvs:
        key = kv.key.decode(errors="replace")
        if key == ck:
            try:
                config = msgspec.json.decode(kv.value, type=ClusterConfig)
            except msgspec.DecodeError:
                config = ClusterConfig(slots=0, shards=0)
            continue
        if key == mk:
            has_map = True
            continue
        if not key.startswith(root + "shards/"):
            continue  # keys/, node_secret, reinit: not a shard's
        rest = key[len(root + "shards/"):].split("/")
        s = shards.setdefault(rest[0], {"shard": rest[0], "running": [], "other_keys": 0})
        if rest[1:] == ["replicas"]:
            try:
                rep = msgspec.json.decode(kv.value, type=Replicas)
                s.update(members=list(rep.members), isr=list(rep.isr), replication_factor=rep.replication_factor)
            except msgspec.DecodeError:
                s["other_keys"] += 1
        elif rest[1:] == ["leader"]:
            try:
                rec = _leader_record(rest[0], kv)
                s.update(leader=rec.info.node, epoch=rec.epoch)
            except Exception:  # a malformed leader key still holds a lease: count it as a leader
                s.update(leader="?", epoch=kv.create_revision)
        elif len(rest) == 3 and rest[1] == "nodes":
            s["running"].append(rest[2])
        else:
            s["other_keys"] += 1
    order = sorted(shards, key=lambda x: (not x.isdigit(), int(x) if x.isdigit() else 0, x))
    return ClusterInventory(cluster=cluster, revision=r.revision, config=config, has_slotmap=has_map,
                            shards=[ShardInventory(**shards[k]) for k in order])


async def create_cluster(client: EtcdClient, cluster: str, *, slots: int = DEFAULT_SLOTS, shards: int = 1,
                         replication_factor: int = 2, force: bool = False
                         ) -> tuple[SlotMap, ClusterInventory | None]:
    """Create the cluster's config and slot map (slot i to shard i mod ``shards``) and
    its node secret; returns the map and, with ``force``, what was deleted (None if
    nothing was there).

    Refused (ClusterExistsError, CONFLICT, its message one line saying what is there)
    when this etcd already holds a cluster or a shard of this name. With ``force``, a
    cluster whose shards are all stopped is replaced: one transaction, which holds only
    if nothing under ``shards/`` was written since it was read and the config and map are
    as read, deletes every key under ``shards/`` (members, in-sync sets, the last
    epochs), writes the new config and map, and the ``reinit`` key whose revision later
    refuses a node on the deleted cluster's data dir; API keys and the node secret are
    kept. A running shard (a live leader or node) is refused even with ``force``.
    Raises VALIDATION_FAILED for a slot count outside 1..1024, a shard count outside
    1..slots, a replication factor other than 1 or 2; CONFLICT (ConflictError) when the
    keys changed between the read and the transaction (a node started: run it again)."""
    import time

    from .leader import check_replication_factor

    if not 1 <= slots <= MAX_SLOTS:
        raise ValidationError(f"--slots must be 1 to {MAX_SLOTS} (an id names its slot in 10 bits), not {slots}")
    if not 1 <= shards <= slots:
        raise ValidationError(f"--shards must be 1 to the slot count ({slots}), not {shards}")
    check_replication_factor(replication_factor)
    ck, mk = _keys(cluster)
    owners = [i % shards for i in range(slots)]
    inv = await inventory(client, cluster)
    replaced = None
    if inv.occupied:
        if not force:
            raise ClusterExistsError(
                f"this etcd already holds {inv.describe()}. Refused: `cluster init` would lay a new slot map over "
                "it. Use another "
                "--cluster-name, or stop every node of it and add --force, which deletes its shards from etcd "
                "(members, in-sync sets, epochs; their nodes' data dirs then belong to no cluster)", inv)
        if inv.running:
            names = ", ".join(s.shard for s in inv.running)
            raise ClusterExistsError(
                f"this etcd already holds {inv.describe()}. Refused even with --force: shard(s) {names} are running "
                "(a live leader or node); stop their nodes (SIGTERM) first", inv)
        replaced = inv
    shards_prefix = f"/rallypoint/{cluster}/shards/"
    ops = [Delete(shards_prefix, prefix=True)] if replaced is not None else []
    ops += [Put(ck, msgspec.json.encode(ClusterConfig(slots=slots, shards=shards,
                                                      replication_factor=replication_factor))),
            Put(mk, msgspec.json.encode(_MapValue(owners)))]
    if replaced is not None:
        ops.append(Put(_reinit_key(cluster), msgspec.json.encode(
            {"at_ms": int(time.time() * 1000), "replaced": replaced.describe()})))
    # nothing of what was read changed since (a key written later has a higher mod revision)
    r = await client.txn(
        [Compare.mod_revision(shards_prefix, "<", inv.revision + 1, prefix=True),
         Compare.mod_revision(ck, "<", inv.revision + 1), Compare.mod_revision(mk, "<", inv.revision + 1)],
        ops,
    )
    if not r.succeeded:
        raise ConflictError(f"the keys of cluster {cluster!r} changed while `cluster init` read them (a node "
                            "started?); run it again")
    await node_secret(client, cluster)
    if replaced is not None:
        log.warning("cluster %r re-created with --force; deleted: %s", cluster, replaced.describe())
    log.info("cluster %r created: %d slots over %d shards of %d node(s)", cluster, slots, shards, replication_factor)
    return SlotMap(owners=owners, version=r.revision), replaced


async def init_cluster(client: EtcdClient, cluster: str, *, slots: int = DEFAULT_SLOTS, shards: int = 1,
                       replication_factor: int = 2, force: bool = False) -> SlotMap:
    """:func:`create_cluster`, returning the new slot map only."""
    m, _replaced = await create_cluster(client, cluster, slots=slots, shards=shards,
                                        replication_factor=replication_factor, force=force)
    return m


def _secret_key(cluster: str) -> str:
    return f"/rallypoint/{cluster}/node_secret"


async def node_secret(client: EtcdClient, cluster: str) -> str:
    """The cluster's node secret (see the module docstring), made now if the cluster has
    none (one transaction that fails if another node made it first: then theirs)."""
    import secrets

    key = _secret_key(cluster)
    kv = await client.get(key)
    if kv is not None:
        return kv.value.decode()
    r = await client.txn([Compare.create_revision(key, "==", 0)], [Put(key, secrets.token_urlsafe(32).encode())],
                         [Range(key)])
    if r.succeeded:
        kv = await client.get(key)
        return kv.value.decode()
    return r.responses[0].kvs[0].value.decode()


async def read_map(client: EtcdClient, cluster: str) -> SlotMap | None:
    """The slot map, or None when the cluster was never initialised (a single shard)."""
    _ck, mk = _keys(cluster)
    kv = await client.get(mk)
    if kv is None:
        return None
    return SlotMap(owners=msgspec.json.decode(kv.value, type=_MapValue).owners, version=kv.mod_revision)


async def set_owners(client: EtcdClient, cluster: str, version: int, owners: list[int]) -> SlotMap:
    """Write a new map if the current one is still at ``version`` (CONFLICT otherwise:
    read it again). The slot count never changes (VALIDATION_FAILED)."""
    _ck, mk = _keys(cluster)
    current = await read_map(client, cluster)
    if current is None:
        raise NotFoundError(f"cluster {cluster!r} has no slot map: run `rallypoint cluster init` first")
    if len(owners) != len(current.owners):
        raise ValidationError(f"the slot count is fixed at {len(current.owners)}")
    r = await client.txn([Compare.mod_revision(mk, "==", version)], [Put(mk, msgspec.json.encode(_MapValue(owners)))],
                         [Range(mk)])
    if not r.succeeded:
        raise ConflictError(f"the slot map changed (it is past version {version}); read it again")
    return SlotMap(owners=list(owners), version=r.revision)


async def watch_map(client: EtcdClient, cluster: str) -> AsyncIterator[SlotMap | None]:
    """The slot map now, then each new version (None: no map). A compacted history is
    handled by reading it again."""
    _ck, mk = _keys(cluster)
    while True:
        r = await client.txn([], [Range(mk)])
        kvs = r.responses[0].kvs
        current = None if not kvs else SlotMap(owners=msgspec.json.decode(kvs[0].value, type=_MapValue).owners,
                                               version=kvs[0].mod_revision)
        yield current
        try:
            async with client.watch(mk, start_revision=r.revision + 1) as events:
                async for ev in events:
                    if ev.type == "DELETE":
                        yield None
                    else:
                        yield SlotMap(owners=msgspec.json.decode(ev.kv.value, type=_MapValue).owners,
                                      version=ev.kv.mod_revision)
        except EtcdCompactedError:
            continue


async def watch_leaders(client: EtcdClient, cluster: str) -> AsyncIterator[dict[int, "LeaderRecord"]]:
    """Every shard's leader (shard -> :class:`~rallypoint.cluster.leader.LeaderRecord`;
    a shard without one is absent) now, then after each change: one watch on the
    cluster's ``shards/`` prefix."""
    from .leader import _leader_record

    prefix = f"/rallypoint/{cluster}/shards/"

    def shard_of(key: bytes) -> int | None:
        parts = key.decode(errors="replace")[len(prefix):].split("/")
        if len(parts) == 2 and parts[1] == "leader" and parts[0].isdigit():
            return int(parts[0])
        return None

    while True:
        r = await client.range(prefix, prefix=True)
        leaders: dict[int, "LeaderRecord"] = {}
        for kv in r.kvs:
            s = shard_of(kv.key)
            if s is not None:
                leaders[s] = _leader_record(str(s), kv)
        yield dict(leaders)
        try:
            async with client.watch(prefix, prefix=True, start_revision=r.revision + 1) as events:
                async for ev in events:
                    s = shard_of(ev.kv.key)
                    if s is None:
                        continue
                    if ev.type == "DELETE":
                        leaders.pop(s, None)
                    else:
                        leaders[s] = _leader_record(str(s), ev.kv)
                    yield dict(leaders)
        except EtcdCompactedError:
            continue
