"""Which slot an operation names, in a sharded cluster: the routing arithmetic both the
server (:mod:`rallypoint.actors.sharding`: the WRONG_SHARD check) and the client's router
(:mod:`rallypoint.client.router`) use, from an op's :class:`~rallypoint.opdecl.Shard`
declaration. Imports nothing of the server's.
"""

from __future__ import annotations

from zlib import crc32

from .ids import is_id, slot_of

__all__ = ["home_slot", "named_slot", "target", "item_slots", "NEW_ROOT", "EVERY", "HERE"]

#: :func:`target` of an op that any shard may take (a new root run) and of one every
#: shard answers its part of (lists, status, events).
NEW_ROOT = -1
EVERY = -2
#: :func:`target` of an op about a store every shard keeps of its own (``"here"``: the
#: HTTP idempotency answers): the shard the request reaches takes it.
HERE = -3


def home_slot(space: str, slots: int) -> int:
    """The home slot of ``space``: where its space-wide entities live."""
    return crc32(b"space\0" + space.encode()) % slots


def named_slot(space: str, name: str, slots: int) -> int:
    """The slot of the named root run ``name`` of ``space`` (``scope.ensure_named``)."""
    return crc32(b"root\0" + space.encode() + b"\0" + name.encode()) % slots


def _value_slot(v, space: str, slots: int) -> int:
    return slot_of(v) if is_id(v) else home_slot(space, slots)


def target(shard, op, space: str, slots: int) -> int:
    """The slot ``op`` belongs to under its declaration ``shard`` (an
    :class:`~rallypoint.opdecl.Shard`, not of kind ``slots``), or
    :data:`NEW_ROOT` / :data:`EVERY` / :data:`HERE`. An id names its slot; a name (a queue's, a
    pool's...) is its space's home slot."""
    kind = shard.kind
    if kind == "slot":
        v = getattr(op, shard.field)
        if v is None:
            alt = shard.if_none
            if alt == "home":
                return home_slot(space, slots)
            if alt == "all":
                return EVERY
            if alt == "new_root":
                return NEW_ROOT
            v = getattr(op, alt)  # another field names it
            if v is None:
                return home_slot(space, slots)
        return _value_slot(v, space, slots)
    if kind == "home":
        return home_slot(space, slots)
    if kind == "named":
        return named_slot(space, getattr(op, shard.field), slots)
    if kind == "new_root":
        return NEW_ROOT
    if kind == "all":
        return EVERY
    if kind in ("here", "peer"):  # (peer: the node that sent it chose this shard)
        return HERE
    raise ValueError(f"target() of a {kind!r} shard: use item_slots()")


def item_slots(shard, op, space: str, slots: int) -> list[int]:
    """The slot of each element of ``op.<field>`` (a ``slots`` declaration): ids, or
    items with a ``task_id``."""
    out = []
    for v in getattr(op, shard.field):
        if not isinstance(v, str):
            v = v.task_id
        out.append(_value_slot(v, space, slots))
    return out
