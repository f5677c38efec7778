"""Which slots this coordinator owns, and which slot a new id names (a sharded cluster).

A cluster fixes its number of slots when it is created (``rallypoint cluster init
--slots N``); its slot map (in etcd, ``rallypoint.cluster.shardmap``) gives each slot to a
shard. Every id made under a root run names the root's slot, and a space-wide entity
(work queue, pool, quota, budget, claim, key) its space's *home slot*
(:meth:`Sharding.home_slot`), so any id routes to its shard with no lookup
(:func:`rallypoint.ids.slot_of`). A new root run takes this shard's *open slot*
(:attr:`Sharding.open_slot`), or, when it has a name, the slot the name hashes to
(its name index lives there).

A coordinator with no :class:`Sharding` (``coord.sharding is None``: a single node, or a
replicated shard without a slot map) makes ids as before.
"""

from __future__ import annotations

from ..errors import WrongShardError
from ..ids import MAX_SLOTS, is_id, slot_of
from ..slots import EVERY, HERE, NEW_ROOT, home_slot, item_slots, named_slot, target  # (shared with the client)

__all__ = ["Sharding", "WrongShardError", "home_slot", "named_slot", "target", "item_slots", "NEW_ROOT", "EVERY", "HERE"]

class Sharding:
    """This shard's place in the cluster's slot map.

    ``shard``: this shard's number; ``owners``: the map, one shard per slot (its
    length is the cluster's slot count); ``version``: the map's version (its etcd mod
    revision); ``open_slot``: the owned slot new unnamed root runs take (None: the
    first owned one)."""

    __slots__ = ("shard", "owners", "slots", "version", "owned", "open_slot", "released")

    def __init__(self, shard: int, owners: list[int], version: int = 0, open_slot: int | None = None,
                 released: list[int] = ()) -> None:
        if not 0 < len(owners) <= MAX_SLOTS:
            raise ValueError(f"a slot map has 1 to {MAX_SLOTS} slots, not {len(owners)}")
        self.shard = shard
        self.released: set[int] = set(released)
        self.update(owners, version)
        self.open_slot = open_slot

    def update(self, owners: list[int], version: int) -> None:
        """A new slot map (the etcd watch saw it change). A slot this shard released
        (``SlotsReleased``) is never its own again."""
        self.owners = list(owners)
        self.slots = len(owners)
        self.version = version
        rel = self.released
        self.owned = bytearray(1 if o == self.shard and i not in rel else 0 for i, o in enumerate(owners))

    def release(self, slots) -> None:
        """This shard gave up ``slots`` (the apply of ``SlotsReleased``)."""
        self.released.update(slots)
        for x in slots:
            if x < self.slots:
                self.owned[x] = 0

    def home_slot(self, space: str) -> int:
        return home_slot(space, self.slots)

    def named_slot(self, space: str, name: str) -> int:
        return named_slot(space, name, self.slots)

    def root_slot(self) -> int:
        """The slot a new unnamed root run of this shard takes."""
        s = self.open_slot
        if s is None or not self.owned[s]:
            s = self.open_slot = self.owned.index(1) if 1 in self.owned else None
        if s is None:
            raise WrongShardError(f"shard {self.shard} owns no slot in the slot map (version {self.version}): it "
                                  "takes no new runs", details={"shard": self.shard, "map_version": self.version})
        return s

    def check(self, slot: int, what: str) -> None:
        """Raise WRONG_SHARD unless this shard owns ``slot``."""
        if slot >= self.slots or not self.owned[slot]:
            owner = self.owners[slot] if slot < self.slots else None
            raise WrongShardError(
                f"{what} is in slot {slot}, owned by shard {owner}, not by shard {self.shard} (slot map version "
                f"{self.version}); the SDK refreshes its map and goes there",
                details={"slot": slot, "shard": owner, "map_version": self.version})

    def cross_shard(self, entity_id: object, noun: str) -> None:
        """Raise VALIDATION_FAILED (``details.cross_shard``) when ``entity_id`` is an id
        of a slot this shard does not own: a step that would span two shards, which
        a sharded cluster refuses (see docs/architecture.md, "Many shards")."""
        if not is_id(entity_id):
            return
        slot = slot_of(entity_id)  # type: ignore[arg-type]
        if slot < self.slots and self.owned[slot]:
            return
        from ..errors import ValidationError

        owner = self.owners[slot] if slot < self.slots else None
        raise ValidationError(
            f"{noun} {entity_id} lives on shard {owner}, not on shard {self.shard} where this step runs: a sharded "
            "cluster does not make one step of two shards (a group joins tasks of its own run tree; a budget "
            "reservation held for a delivery is made by admission there: give the task requirements)",
            details={"cross_shard": True, "id": entity_id, "shard": owner, "this_shard": self.shard})

    def check_id(self, entity_id: str, what: str = "it") -> None:
        self.check(slot_of(entity_id), what)

    def check_op(self, shard, op, space: str) -> None:
        """Raise WRONG_SHARD unless ``op`` (declared ``shard``) belongs to this shard:
        its slot, or every slot of its items, owned here; a new root run needs an owned
        slot; an op every shard answers its part of is always taken."""
        tag = op.__struct_config__.tag
        if shard.kind == "slots":
            for slot in item_slots(shard, op, space, self.slots):
                self.check(slot, f"an item of {tag}")
            return
        slot = target(shard, op, space, self.slots)
        if slot == NEW_ROOT:
            self.root_slot()
        elif slot not in (EVERY, HERE):
            self.check(slot, tag)
