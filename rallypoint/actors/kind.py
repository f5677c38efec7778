"""The base of every kind: a table of state Structs and the logic that changes it.

A *kind* (runs, work queues, task groups, barriers, timers, join sets, keys) is one
class. It owns:

- its **table(s)**: entity id -> state Struct (what snapshots store), plus derived
  indexes that :meth:`rebuild_indexes` recomputes after a snapshot is loaded;
- its **decide handlers** ``op_*(actor, session, op)``: validate against state (reading
  other kinds' state through their public methods is allowed), build journal records,
  ``coord.commit`` them, and return a reply Struct, raise a RallypointError, or return a
  :class:`~rallypoint.actors.runtime.Park` to wait on the server. They run on the task
  of the actor the op table (``api.py``) routes the op to, one command at a time;
- its **apply functions** (``@applies(Record)``): pure, synchronous, no clock reads,
  the same live and in replay; they may change the state of the entities their record
  names, and ``coord.notify`` the actors whose waiters may now be answered;
- its **activities** (deadlines, leases, timers): entries of the coordinator's activity
  heap, armed by apply (never in replay) and by :meth:`rearm` after recovery; firing
  one is a decide like any other (it re-checks, then commits).

``parent_actor_id`` places an entity's actor in the nursery tree, and
``on_run_inactive`` is what an entity owned by a run does, inside the run's ONE
cancellation step, when that run (or an ancestor) is cancelled, completed or passes
its deadline.
"""

from __future__ import annotations

from typing import Any, Callable

from ..errors import NotFoundError
from .common import short

__all__ = ["Kind"]


class Kind:
    """Base class of a kind. ``prefix`` is the id prefix of its (main) entities, kept in
    ``self.table``; ``noun`` and ``id_field`` name them in NOT_FOUND errors."""

    prefix: str = ""
    name: str = ""
    noun: str = "entity"
    id_field: str = "id"

    def __init__(self, coord) -> None:
        self.coord = coord
        self.table: dict[str, Any] = {}

    def get(self, space: str, entity_id: Any):
        """The entity ``entity_id`` of ``space``. NOT_FOUND when there is none -- and for
        another space's, which a key must not be able to tell apart."""
        ent = self.table.get(entity_id) if isinstance(entity_id, str) else None
        if ent is None or ent.space != space:
            hint = self.coord.retention.not_found_hint(entity_id) if ent is None else ""
            raise NotFoundError(f"no {self.noun} {short(entity_id)} in this space{hint}",
                                details={self.id_field: short(entity_id)})
        return ent

    def route(self, session, entity_id: Any) -> str:
        """The actor id for a command about ``entity_id`` (its own; NOT_FOUND as
        :meth:`get`)."""
        return self.get(session.space, entity_id).id

    def entity_tables(self) -> dict[str, tuple[dict, type]]:
        """id prefix -> (table, state Struct type): what snapshots store."""
        return {}

    def parent_actor_id(self, entity_id: str) -> str | None:
        """The actor in whose nursery this entity's actor runs (None: the root)."""
        return None

    def rebuild_indexes(self) -> None:
        """After a snapshot was loaded: recompute derived indexes from state."""

    def rearm(self) -> None:
        """After recovery: arm this kind's activities at their original due times."""

    def on_run_inactive(self, entity_id: str, at_ms: int, reason: str) -> None:
        """The run that owns ``entity_id`` went inactive (``reason``: cancelled,
        completed, deadline) in the apply of one record. Synchronous."""

    def purge_run(self, run_id: str) -> int:
        """Retention purges ``run_id`` (finished, with everything below it; called in the
        apply of ``Purged``, children before parents): remove this kind's entities that
        the run owns, and their index entries, and ``coord.touch`` each (the next
        snapshot deletes it). Returns how many entities were removed. Synchronous."""
        return 0

    def purge_task_links(self, task_id: str) -> int:
        """Retention purges the finished task ``task_id`` (alone, or with its run): remove
        what this kind keeps only for it (the pool grants and budget reservations its
        deliveries held), ``coord.touch`` each. Returns how many entities were removed.
        Synchronous."""
        return 0

    def leases_outstanding(self) -> int:
        """How many leases (and durable waiters with a time limit) of this kind run on
        server time now: a stall or a restart is given back to them (``LeasesExtended``)
        only when some kind has one."""
        return 0

    def extend_leases(self, by_ms: int) -> None:
        """Apply of ``LeasesExtended``: every outstanding lease of this kind (and every
        durable waiter's time limit) ends ``by_ms`` later; re-arm their activities."""

    def appliers(self) -> dict[type, Callable[[Any], None]]:
        """Record type -> bound apply function, from the ``@applies`` marks."""
        out: dict[type, Callable[[Any], None]] = {}
        for name in dir(type(self)):
            fn = getattr(type(self), name, None)
            rec_type = getattr(fn, "_applies", None)
            if rec_type is not None:
                out[rec_type] = getattr(self, name)
        return out

    def emitters(self) -> dict[type, Callable[[Any], Any]]:
        """Record (or implied fact) type -> bound event source, from the ``@emits`` marks
        (:mod:`rallypoint.events`): ``fn(record) -> Entry | list[Entry] | None``, called
        after the record was applied."""
        out: dict[type, Callable[[Any], Any]] = {}
        for name in dir(type(self)):
            fn = getattr(type(self), name, None)
            for rec_type in getattr(fn, "_emits", ()):
                if rec_type in out:
                    raise RuntimeError(f"{type(self).__name__} has two event sources for {rec_type.__name__}")
                out[rec_type] = getattr(self, name)
        return out

    def pure_emitters(self) -> set[type]:
        """The record types whose event source is marked ``@emits(..., pure=True)`` (a
        function of the record alone: one event, in its space)."""
        out: set[type] = set()
        for name in dir(type(self)):
            fn = getattr(type(self), name, None)
            if getattr(fn, "_emits_pure", False):
                out.update(fn._emits)
        return out

    def statistics(self) -> dict:
        """Entity counts (Trio-style introspection); kinds add their own figures."""
        return {name: len(table) for name, (table, _) in self.entity_tables().items()}


class Links:
    """Retention's index for one kind: owner id (a run, or the task whose delivery held
    it) -> the ids of the kind's entities it owns, in creation order. ``purge(owner,
    finished, remove)`` removes those ``finished(id)`` says are done (``remove(id)``)
    and keeps the rest listed (a live lease of an ended run stays until it ends)."""

    __slots__ = ("by",)

    def __init__(self) -> None:
        self.by: dict[str, list[str]] = {}

    def add(self, owner: str, entity_id: str) -> None:
        lst = self.by.get(owner)
        if lst is None:
            self.by[owner] = [entity_id]
        else:
            lst.append(entity_id)

    def purge(self, owner: str, finished: Callable[[str], bool], remove: Callable[[str], None]) -> int:
        """Remove the finished entities of ``owner``; returns how many."""
        ids = self.by.pop(owner, None)
        if not ids:
            return 0
        keep = []
        n = 0
        for eid in ids:
            if finished(eid):
                remove(eid)
                n += 1
            else:
                keep.append(eid)
        if keep:
            self.by[owner] = keep
        return n

    def __len__(self) -> int:
        return len(self.by)
