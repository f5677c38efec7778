"""A sharded cluster's slot map in etcd: how many slots, and which shard owns each.

Keys, under ``/rallypoint/<cluster>/``:

| key | value (JSON) |
|---|---|
| ``config`` | ``{"slots": N, "shards": K}``: the slot count, fixed when the cluster is created (``rallypoint cluster init``), and how many shards were made then |
| ``slotmap`` | ``{"owners": [shard of slot 0, ..., shard of slot N-1]}``; its mod revision is the map's **version** |
| ``node_secret`` | 43 URL-safe characters (256 random bits): what a node presents to another node's client port to make the calls between shards (``run.link``, ``outbox.deliver``); made with the cluster, or by the first leader of a cluster made before it (:func:`node_secret`) |

``cluster init --slots N --shards K`` deals the slots out round-robin (slot i to shard
i mod K). ``cluster add-shard`` gives a new shard slots that hold nothing yet: each
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
from .etcd import Compare, EtcdClient, EtcdCompactedError, Put, Range

log = logging.getLogger("rallypoint.cluster")

__all__ = ["ClusterConfig", "SlotMap", "init_cluster", "read_map", "watch_map", "set_owners", "node_secret",
           "DEFAULT_SLOTS"]

#: Slots of a new cluster (the most an id can name: 10 bits).
DEFAULT_SLOTS = MAX_SLOTS


class ClusterConfig(msgspec.Struct, frozen=True):
    """``slots``: the cluster's slot count (fixed); ``shards``: shards made at creation."""

    slots: int
    shards: int


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


async def init_cluster(client: EtcdClient, cluster: str, *, slots: int = DEFAULT_SLOTS, shards: int = 1) -> SlotMap:
    """Create the cluster's config and slot map (slot i to shard i mod ``shards``), in one
    transaction that fails if either exists. Raises VALIDATION_FAILED for a slot count
    outside 1..1024 or a shard count outside 1..slots, CONFLICT when the cluster exists."""
    if not 1 <= slots <= MAX_SLOTS:
        raise ValidationError(f"--slots must be 1 to {MAX_SLOTS} (an id names its slot in 10 bits), not {slots}")
    if not 1 <= shards <= slots:
        raise ValidationError(f"--shards must be 1 to the slot count ({slots}), not {shards}")
    ck, mk = _keys(cluster)
    owners = [i % shards for i in range(slots)]
    r = await client.txn(
        [Compare.create_revision(ck, "==", 0), Compare.create_revision(mk, "==", 0)],
        [Put(ck, msgspec.json.encode(ClusterConfig(slots=slots, shards=shards))),
         Put(mk, msgspec.json.encode(_MapValue(owners)))],
    )
    if r.succeeded:
        await node_secret(client, cluster)
    if not r.succeeded:
        raise ConflictError(f"cluster {cluster!r} already exists in this etcd (its slot count is fixed at creation)")
    log.info("cluster %r created: %d slots over %d shards", cluster, slots, shards)
    return SlotMap(owners=owners, version=r.revision)


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
