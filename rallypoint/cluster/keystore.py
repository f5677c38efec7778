"""A cluster's API keys in etcd: the one place they are made and revoked, watched by
every shard's leader (design: ``../shared/SCALE-OUT.md`` §4.2, row "API keys,
revocation").

Keys, under ``/rallypoint/<cluster>/keys/``:

| key | value (JSON, :class:`KeyRecord`) |
|---|---|
| ``keys/<key id>`` | ``{id, space, permissions, secret_sha256, created_at_ms, name, revoked_at_ms}`` |

The record is the key's source of truth: ``rallypoint keys create|list|revoke --cluster
etcd://...`` read and write etcd directly (the secret is printed once; only its SHA-256
is stored). A record is written once by a create (a transaction that fails if the id
exists) and once more by a revoke (``revoked_at_ms``, compared on its mod revision);
nothing deletes it.

Each shard's leader (:meth:`rallypoint.cluster.member.ShardMember`) reads every record
before it serves a client, then watches the prefix, and journals what its coordinator
lacks as ``KeyCreated`` / ``KeyRevoked`` with the record's id and hash (``key.adopt``):
authentication stays a local lookup, the standby holds the keys through the journal,
and a revocation reaches every shard within one watch round trip. A shard's open mode
(no key at all) ends as soon as it has taken the cluster's first key. A record deleted
by hand revokes nothing (the shards keep the key as they have it): revoke with
``keys revoke``.

A key's id names its space's home slot (like a key made by a shard): the slot count
comes from the cluster's config (``cluster init``); a cluster without one (a single
replicated shard) gets ids with random slot bits.
"""

from __future__ import annotations

import logging
import time
from typing import AsyncIterator

import msgspec

from ..errors import ConflictError, NotFoundError, ValidationError
from ..ids import IdGenerator, is_id
from .etcd import Compare, EtcdClient, EtcdCompactedError, Put

log = logging.getLogger("rallypoint.cluster")

__all__ = ["KeyRecord", "create_key", "list_keys", "revoke_key", "read_keys", "watch_keys", "keys_prefix"]

_ids = IdGenerator()


class KeyRecord(msgspec.Struct, omit_defaults=True):
    """A key as etcd holds it: ``id`` (``key_...``), ``space``, ``permissions``, the hex
    SHA-256 of its secret, ``created_at_ms`` / ``revoked_at_ms`` (ms since the epoch;
    None: live), ``name``."""

    id: str
    space: str
    permissions: list[str]
    secret_sha256: str
    created_at_ms: int
    name: str | None = None
    revoked_at_ms: int | None = None


def keys_prefix(cluster: str) -> str:
    """The etcd prefix of a cluster's key records."""
    return f"/rallypoint/{cluster}/keys/"


def _decode(value: bytes) -> KeyRecord | None:
    try:
        return msgspec.json.decode(value, type=KeyRecord)
    except msgspec.DecodeError as e:
        log.warning("an unreadable key record in etcd was skipped (%s)", e)
        return None


def _now_ms() -> int:
    return int(time.time() * 1000)


async def _slots(client: EtcdClient, cluster: str) -> int | None:
    from .shardmap import ClusterConfig

    kv = await client.get(f"/rallypoint/{cluster}/config")
    return None if kv is None else msgspec.json.decode(kv.value, type=ClusterConfig).slots


async def create_key(client: EtcdClient, cluster: str, space: str, permissions: list[str],
                     name: str | None = None) -> tuple[KeyRecord, str]:
    """Make a key in etcd; returns ``(record, secret)`` (the secret is not stored).
    Every permission may be given, ``operator`` too (writing etcd is the cluster's
    operator's). Raises VALIDATION_FAILED for a bad space, name or permission;
    EtcdError when etcd cannot be reached."""
    from ..actors.keys import check_key, hash_secret, new_secret
    from ..actors.sharding import home_slot

    perms = check_key(space, permissions, name)
    slots = await _slots(client, cluster)
    secret = new_secret()
    while True:
        kid = _ids.new("key", home_slot(space, slots) if slots else None)
        rec = KeyRecord(id=kid, space=space, permissions=perms, secret_sha256=hash_secret(secret),
                        created_at_ms=_now_ms(), name=name)
        key = keys_prefix(cluster) + kid
        r = await client.txn([Compare.create_revision(key, "==", 0)], [Put(key, msgspec.json.encode(rec))])
        if r.succeeded:
            log.info("API key %s created in etcd for space %s (cluster %s)", kid, space, cluster)
            return rec, secret


async def read_keys(client: EtcdClient, cluster: str) -> tuple[list[KeyRecord], int]:
    """Every key record, in id order, and the etcd revision read at."""
    r = await client.range(keys_prefix(cluster), prefix=True)
    out = [rec for kv in r.kvs if (rec := _decode(kv.value)) is not None]
    return out, r.revision


async def list_keys(client: EtcdClient, cluster: str, space: str | None = None) -> list[KeyRecord]:
    """The key records (of ``space`` only, when given), in id order."""
    recs, _rev = await read_keys(client, cluster)
    return [k for k in recs if space in (None, k.space)]


async def revoke_key(client: EtcdClient, cluster: str, key_id: str) -> KeyRecord:
    """Mark a key revoked in etcd (every shard's leader then revokes it); revoking a
    revoked key changes nothing. Raises NOT_FOUND for an unknown id."""
    if not is_id(key_id, "key"):
        raise ValidationError(f"not a key id (key_...): {key_id!r}", details={"field": "id"})
    key = keys_prefix(cluster) + key_id
    for _ in range(10):
        kv = await client.get(key)
        rec = None if kv is None else _decode(kv.value)
        if rec is None:
            raise NotFoundError(f"no API key {key_id} in cluster {cluster!r}", details={"key_id": key_id})
        if rec.revoked_at_ms is not None:
            return rec
        rec = msgspec.structs.replace(rec, revoked_at_ms=_now_ms())
        r = await client.txn([Compare.mod_revision(key, "==", kv.mod_revision)], [Put(key, msgspec.json.encode(rec))])
        if r.succeeded:
            log.info("API key %s revoked in etcd (cluster %s)", key_id, cluster)
            return rec
    raise ConflictError(f"key {key_id} kept changing in etcd while it was being revoked; run the command again")


async def watch_keys(client: EtcdClient, cluster: str) -> AsyncIterator[tuple[list[KeyRecord], list[str]]]:
    """Every key record now, then each change as it happens: ``(records, deleted ids)``
    -- first every record (and no deletion), then one record put or one id deleted at a
    time. A compacted history is handled by reading every record again."""
    prefix = keys_prefix(cluster)
    while True:
        recs, rev = await read_keys(client, cluster)
        yield recs, []
        try:
            async with client.watch(prefix, prefix=True, start_revision=rev + 1) as events:
                async for ev in events:
                    if ev.type == "DELETE":
                        yield [], [ev.kv.key.decode(errors="replace")[len(prefix):]]
                        continue
                    rec = _decode(ev.kv.value)
                    if rec is not None:
                        yield [rec], []
        except EtcdCompactedError:
            continue
