"""Epochs: the history of a replicated shard's leaders, as coordinator state.

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

from ..events import emits, ev
from ..records import LeaderEpoch
from .common import applies
from .kind import Kind

__all__ = ["Epochs", "EpochHistory", "EpochEntry", "HISTORY_ID"]

#: The one entity of the kind.
HISTORY_ID = "epo:history"


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


class Epochs(Kind):
    """The shard's leader epochs (one entity, no actor, no operations)."""

    prefix = "epo"
    name = "epochs"
    noun = "epoch history"

    def __init__(self, coord) -> None:
        super().__init__(coord)

    def entity_tables(self) -> dict[str, tuple[dict, type]]:
        return {"epo": (self.table, EpochHistory)}

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
        return {"epochs": len(self.entries), "current": self.current}
