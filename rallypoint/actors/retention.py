"""Retention: finished runs and tasks are deleted ``--retain-finished`` after they end.

**What is purged, and when.** Every run that ends (cancelled, completed, or past its
deadline) and every *plain* task that becomes terminal (not a group member, not a join
set's child) is a candidate, due ``retain_ms`` after its end instant (wall clock). When
it is due, the retention tick (an activity of the coordinator's heap) checks it again
and commits ONE ``Purged`` record per space and tick naming what goes:

- a **run** with its whole subtree: every run below it, their tasks, the groups gated
  there (with all their members), barriers, timers and join sets (with their children),
  and the tasks' own runs. Everything in an ended run's subtree is finished (its end
  cancelled what was pending), so nothing there can still change. A task's own run is
  never purged by itself (it goes with its task), and a subtree holding a task that is
  a member of a group outside it waits for that group (a group's view reads its
  members; such a run is looked at again a retention window later);
- a **finished task of a live run** (a long-lived run that keeps receiving work, like
  ``rallypoint bench``'s), with its own run. Group members go with their group's gate
  run, join-set children with their set's run; both are read by what stays.

Mailboxes and API keys are never purged. Each kind says what a purge of a run removes of
it (:meth:`Kind.purge_run`); the apply of ``Purged`` walks the subtree children first and
calls every kind, so replay and snapshots agree (a purged entity is deleted from the
snapshot's LMDB store at the next snapshot). An id that was purged answers NOT_FOUND
with "purged" in the message (:meth:`Retention.not_found_hint`: ids are time-ordered,
so any id older than the retention window -- or than the newest purged one -- that is
not found gets the hint).

Budget: at most :data:`MAX_PER_RECORD` entities per record (a few ms of apply); while a
backlog remains the tick repeats every :data:`BUSY_TICK_S` seconds, else every
:data:`TICK_S`. An ended run with more than the budget of plain tasks is emptied over
several records first. The same tick drops events older than ``--retain-events`` (an
age).
"""

from __future__ import annotations

from collections import deque

import trio

from ..events import emits, ev
from ..ids import id_time_ms
from ..records import Purged
from .common import applies
from .kind import Kind
from .queue import TERMINAL

__all__ = ["Retention", "MAX_PER_RECORD", "TICK_S", "BUSY_TICK_S"]

#: Entities removed by one Purged record at most.
MAX_PER_RECORD = 2000
#: Seconds between retention ticks (with a backlog: BUSY_TICK_S).
TICK_S = 1.0
BUSY_TICK_S = 0.05


class Retention(Kind):
    """The retention policy and the ``Purged`` record. No entities of its own.

    Args:
        retain_ms: how long a finished run or task is kept after it ended, ms (None or
            0: forever).
    """

    prefix = ""
    name = "retention"

    def __init__(self, coord, retain_ms: int | None = None) -> None:
        super().__init__(coord)
        self.retain_ms = retain_ms or None
        self.candidates: deque[tuple[int, str]] = deque()  # (end instant ms, id), about in time order
        self.horizon_id_ms = 0  # the newest id-time of anything purged (for NOT_FOUND hints)
        self.purged = {"runs": 0, "tasks": 0, "entities": 0, "records": 0}
        self._last_removed = 0
        self._armed = False

    # ------------------------------------------------------------------ candidates
    def note(self, entity_id: str, ended_ms: int) -> None:
        """A run ended or a plain task finished at ``ended_ms`` (called by apply)."""
        if self.retain_ms is not None:
            self.candidates.append((ended_ms, entity_id))

    def rebuild_indexes(self) -> None:
        """After a snapshot was loaded: every finished run and plain task, by end time."""
        self.candidates.clear()
        if self.retain_ms is None:
            return
        out: list[tuple[int, str]] = []
        for s in self.coord.runs.table.values():
            end = _run_end(s)
            if end is not None:
                out.append((end, s.id))
        for t in self.coord.queues.tasks.values():
            if t.state in TERMINAL and t.group_id is None and t.joinset_id is None:
                out.append((t.finished_at_ms or 0, t.id))
        out.sort()
        self.candidates.extend(out)

    # ------------------------------------------------------------------ decide
    def rearm(self) -> None:
        """Arm the tick (once) when there is anything for it to do: finished runs to
        purge, events to drop by age, stored HTTP answers to forget."""
        coord = self.coord
        if self._armed or coord.replaying:
            return
        if self.retain_ms is not None or coord.events.retain_ms is not None or coord.idempotency.table:
            self._armed = True
            self.coord.heap.arm(trio.current_time() + TICK_S, self._tick)

    def _tick(self, _arg=None) -> None:
        coord = self.coord
        busy = False
        try:
            if coord.failed is None and not coord.runtime.stopping:
                coord.events.trim_age(coord.now_ms())
                if getattr(coord.journal, "writable", True):  # (a full disk: nothing is purged)
                    if self.retain_ms is not None:
                        busy = self.purge_due(coord.now_ms())
                    if coord.idempotency.table:
                        busy = coord.idempotency.expire_due(coord.now_ms()) or busy
        finally:
            coord.heap.arm(trio.current_time() + (BUSY_TICK_S if busy else TICK_S), self._tick)

    def purge_due(self, now_ms: int, budget: int | None = None) -> bool:
        """Commit one Purged record per space for what is due at ``now_ms`` (at most
        ``budget`` entities in all). Returns True when more is due (a backlog)."""
        horizon = now_ms - self.retain_ms
        if budget is None:
            budget = MAX_PER_RECORD
        cands = self.candidates
        coord = self.coord
        runs, queues = coord.runs, coord.queues
        per_space: dict[str, tuple[list[str], list[str]]] = {}
        taken: set[str] = set()
        left = budget
        put_back: list[tuple[int, str]] = []
        while cands and cands[0][0] <= horizon and left > 0:
            end, eid = cands.popleft()
            if eid in taken:
                continue
            if eid.startswith("scp"):
                s = runs.table.get(eid)
                if s is None or s.task_id is not None or _run_end(s) is None:
                    continue
                size, blocked, plain = self._subtree_cost(eid)
                if blocked:
                    put_back.append((now_ms, eid))  # a group outside still reads a member: later
                    continue
                if size > left and plain:
                    # empty it over several records: its plain tasks first
                    chunk = plain[:left]
                    per_space.setdefault(s.space, ([], []))[1].extend(chunk)
                    taken.update(chunk)
                    left -= len(chunk)
                    cands.appendleft((end, eid))
                    break
                per_space.setdefault(s.space, ([], []))[0].append(eid)
                taken.add(eid)
                left -= size
            else:
                t = queues.tasks.get(eid)
                if t is None or t.state not in TERMINAL or t.group_id is not None or t.joinset_id is not None:
                    continue
                if runs.inactive_error(t.scope_id, now_ms) is not None:
                    continue  # its run ended: the run's purge takes it
                per_space.setdefault(t.space, ([], []))[1].append(eid)
                taken.add(eid)
                left -= 1 + (self._subtree_cost(t.run_id)[0] if t.run_id is not None else 0)
        for item in put_back:
            cands.append(item)
        for space in sorted(per_space):
            rids, tids = per_space[space]
            coord.commit([Purged(space=space, runs=rids, tasks=tids, at_ms=now_ms)])
        return bool(cands) and cands[0][0] <= horizon

    def _subtree_cost(self, root: str) -> tuple[int, bool, list[str]]:
        """(entities a purge of ``root``'s subtree removes, whether it must wait for a
        group outside it, the plain tasks in it)."""
        coord = self.coord
        runs, queues, groups = coord.runs, coord.queues, coord.groups
        ids = list(runs.subtree(root))
        inside = set(ids)
        size = 0
        blocked = False
        plain: list[str] = []
        tasks = queues.tasks
        for rid in ids:
            size += 1 + len(runs.owned.get(rid, ()))
            for tid in queues.run_tasks.get(rid, ()):
                size += 1
                t = tasks[tid]
                if t.group_id is not None:
                    g = groups.table.get(t.group_id)
                    if g is not None and g.gate_scope_id not in inside:
                        blocked = True
                elif t.joinset_id is None:
                    plain.append(tid)
        return size, blocked, plain

    # ------------------------------------------------------------------ apply
    @applies(Purged)
    def _apply_purged(self, r: Purged) -> None:
        coord = self.coord
        n = 0
        for rid in r.runs:
            if rid in coord.runs.table:
                n += self.purge_subtree(rid)
        for tid in r.tasks:
            t = coord.queues.tasks.get(tid)
            if t is not None:
                n += coord.queues.purge_task(t)
        self._last_removed = n
        self.purged["runs"] += len(r.runs)
        self.purged["tasks"] += len(r.tasks)
        self.purged["entities"] += n
        self.purged["records"] += 1
        for eid in (*r.runs, *r.tasks):
            ms = id_time_ms(eid)
            if ms is not None and ms > self.horizon_id_ms:
                self.horizon_id_ms = ms

    def purge_subtree(self, root: str) -> int:
        """Remove ``root``, every run below it and everything they own (children first:
        each kind's :meth:`Kind.purge_run`, the runs kind last). Returns how many
        entities were removed."""
        coord = self.coord
        ids = list(coord.runs.subtree(root))
        n = 0
        others = [k for k in coord.kinds if k is not coord.runs]
        for rid in reversed(ids):
            for k in others:
                n += k.purge_run(rid)
            n += coord.runs.purge_run(rid)
        return n

    @emits(Purged)
    def _ev_purged(self, r: Purged):
        return ev(r.space, "retention.purged", "space", r.space, None, r.at_ms,
                  {"runs": len(r.runs), "tasks": len(r.tasks), "entities": self._last_removed})

    # ------------------------------------------------------------------ lookups
    def not_found_hint(self, entity_id) -> str:
        """'' or a sentence saying the id may have been purged: it is older than the
        retention window (or than the newest purged id)."""
        if not isinstance(entity_id, str):
            return ""
        ms = id_time_ms(entity_id)
        if ms is None:
            return ""
        old = ms <= self.horizon_id_ms
        if not old and self.retain_ms is not None:
            old = ms <= self.coord.mono_ms() - self.retain_ms
        if not old:
            return ""
        return (" (it may have finished and been purged: finished runs and tasks are deleted once the "
                "retention time has passed after they ended: `rallypoint serve --retain-finished`, "
                "open_embedded's retain_finished)")

    def statistics(self) -> dict:
        return {"retain_ms": self.retain_ms, "candidates": len(self.candidates), **self.purged}


def _run_end(s) -> int | None:
    """When the run ended (its own end, or its deadline), or None while it is live."""
    if s.state != "ACTIVE":
        return s.ended_at_ms or s.created_at_ms
    if s.deadline_fired:
        return s.deadline_ms
    return None
