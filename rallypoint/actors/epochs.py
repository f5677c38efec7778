"""Epochs: the history of a replicated shard's leaders (and the slots a sharded
cluster's shard gave up), as coordinator state.

Each time a node becomes the shard's leader it journals :class:`LeaderEpoch` as the
first record of its term (``rallypoint.cluster``). The history of these -- ``(epoch,
first LSN, node)`` in journal order -- is one entity (``epo:history``), so it is in
every snapshot and replayed from every journal like any other state, on the leader and
on the standby alike. It answers the question a rejoining replica asks (Kafka's
leader-epoch checkpoint, KIP-101): *where did epoch E end?* -- the LSN before the first
record of the next epoch, or nothing yet when E is the current one. A replica whose
journal goes past that end wrote records no one acknowledged and truncates them.
"""

from __future__ import annotations

import msgspec

from ..errors import ValidationError
from ..events import emits, ev
from ..ids import is_id, slot_of
from ..protocol import ClusterMap, ClusterMapView, ClusterReleaseSlots, SlotsReleasedView
from ..records import LeaderEpoch, SlotsReleased
from .common import applies, check_range
from .kind import Kind
from .runtime import AtOnce
from .opmark import ALL, ALWAYS, NEVER, R, SPACE, op

__all__ = ["Epochs", "EpochHistory", "EpochEntry", "ReleasedSlots", "HISTORY_ID", "RELEASED_ID"]

#: The kind's entities: the epoch history, and the slots this shard gave up.
HISTORY_ID = "epo:history"
RELEASED_ID = "rsl:released"


class EpochEntry(msgspec.Struct, gc=False, array_like=True, frozen=True):
    """One leader term: its epoch, the LSN of its first record, the node that led."""

    epoch: int
    first_lsn: int
    node: str


class EpochHistory(msgspec.Struct, gc=False):
    """``entries``: one per leader term, oldest first (epochs strictly increasing,
    first LSNs increasing)."""

    id: str
    entries: list[EpochEntry] = []


class ReleasedSlots(msgspec.Struct, gc=False):
    """The slots this shard gave up (``cluster add-shard``), in the order released."""

    id: str
    slots: list[int] = []


class Epochs(Kind):
    """The shard's leader epochs and released slots (two entities, no actor of their
    own), and the cluster ops a node answers itself: ``cluster.map`` and
    ``cluster.release_slots`` (on the space's actor)."""

    prefix = "epo"
    name = "epochs"
    noun = "epoch history"

    def __init__(self, coord) -> None:
        super().__init__(coord)
        self.released_table: dict[str, ReleasedSlots] = {}

    def entity_tables(self) -> dict[str, tuple[dict, type]]:
        return {"epo": (self.table, EpochHistory), "rsl": (self.released_table, ReleasedSlots)}

    @property
    def released(self) -> list[int]:
        """The slots this shard gave up."""
        r = self.released_table.get(RELEASED_ID)
        return [] if r is None else list(r.slots)

    @property
    def entries(self) -> list[EpochEntry]:
        h = self.table.get(HISTORY_ID)
        return [] if h is None else h.entries

    @property
    def current(self) -> int:
        """The newest epoch in the journal (0: none yet, a node that never led)."""
        e = self.entries
        return e[-1].epoch if e else 0

    def epoch_of(self, lsn: int) -> int:
        """The epoch record ``lsn`` was written in (0: before any epoch record)."""
        out = 0
        for e in self.entries:
            if e.first_lsn <= lsn:
                out = e.epoch
            else:
                break
        return out

    def end_of(self, epoch: int) -> int | None:
        """The last LSN of ``epoch``: the LSN before the first record of the oldest
        newer epoch; None when no newer epoch is known (``epoch`` is current or newer).
        An epoch never seen here ends where the next known one begins."""
        for e in self.entries:
            if e.epoch > epoch:
                return e.first_lsn - 1
        return None

    @applies(SlotsReleased)
    def _apply_slots_released(self, r: SlotsReleased) -> None:
        cur = self.released_table.get(RELEASED_ID)
        slots = [] if cur is None else list(cur.slots)
        slots += [x for x in r.slots if x not in slots]
        self.released_table[RELEASED_ID] = ReleasedSlots(id=RELEASED_ID, slots=slots)
        self.coord.touch(RELEASED_ID)
        sh = self.coord.sharding
        if sh is not None:
            sh.release(r.slots)

    @op(ClusterMap, route=SPACE, permission=R, resend=ALWAYS, shard=ALL, merge="any")
    def op_cluster_map(self, actor, session, op: ClusterMap) -> ClusterMapView:
        """The slot map and every shard's leader, as this node watches them in etcd (a
        single node: an empty map). Answered at once (etcd's, not the journal's: no wait
        for durability, so a client can route while a shard's writes wait)."""
        coord = self.coord
        if coord.cluster is None or coord.sharding is None:  # a single node, or a shard without a slot map
            return AtOnce(ClusterMapView(cluster="", version=0, owners=[], shards=[]))
        return AtOnce(coord.cluster.cluster_map_view())

    @op(ClusterReleaseSlots, route=SPACE, permission="operator", resend=NEVER, shard=ALL, merge="any")
    def op_cluster_release_slots(self, actor, session, op: ClusterReleaseSlots) -> SlotsReleasedView:
        """Give up to ``count`` empty slots (see ``protocol.ClusterReleaseSlots``): one
        scan of every entity id (O(entities), on the loop: an operator step), then one
        record. VALIDATION_FAILED on a node that is not part of a sharded cluster."""
        coord = self.coord
        sh = coord.sharding
        if sh is None:
            raise ValidationError("this node is not part of a sharded cluster (no slot map): nothing to release")
        check_range("count", op.count, 0, sh.slots)
        used: set[int] = set()
        for table, _typ in {id(t): (t, x) for t, x in coord.entity_tables().values()}.values():
            for eid in table:
                if is_id(eid):
                    used.add(slot_of(eid))
        keep = {sh.root_slot()}
        free = [x for x in range(sh.slots) if sh.owned[x] and x not in used and x not in keep]
        take = sorted(free, reverse=True)[: op.count]
        if take:
            coord.commit([SlotsReleased(slots=take, at_ms=coord.now_ms())])
        return SlotsReleasedView(shard=sh.shard, released=self.released)

    @applies(LeaderEpoch)
    def _apply_leader_epoch(self, r: LeaderEpoch) -> None:
        h = self.table.get(HISTORY_ID)
        if h is None:
            h = self.table[HISTORY_ID] = EpochHistory(id=HISTORY_ID, entries=[])
        if h.entries and h.entries[-1].epoch >= r.epoch:
            # a journal never holds an older epoch after a newer one: the leader fences
            # frames by epoch and a rejoining replica truncates first
            raise ValueError(f"epoch {r.epoch} after epoch {h.entries[-1].epoch} in the journal")
        h.entries = [*h.entries, EpochEntry(r.epoch, r.first_lsn, r.node)]
        self.coord.touch(HISTORY_ID)

    @emits(LeaderEpoch)
    def _ev_leader_epoch(self, r: LeaderEpoch):
        return [ev(sp, "cluster.leader_changed", "space", sp, None, r.at_ms,
                   {"epoch": r.epoch, "node": r.node, "lsn": r.first_lsn})
                for sp in sorted({"default", *self.coord.events.streams})]

    def statistics(self) -> dict:
        return {"epochs": len(self.entries), "current": self.current, "released_slots": len(self.released)}

