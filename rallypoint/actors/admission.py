"""Admission: what a task needs before it is handed out (its *requirements*), and work
limits (runstate kernel §7.1-7.4).

**Requirements.** ``submit(..., requirements={"pools": {"gpu": 2}})`` stores, on the task,
what a delivery of it must hold. A task with requirements is handed out (by ``receive``
or ``mailbox.admit``) only when *every* requirement can be taken in the same step as the
delivery: the ``TaskDelivered`` record and the records that take the requirements (pool
grants) are ONE commit -- all or nothing; never part of them, never over-granted. A
receive takes the oldest *eligible* ready task: older tasks whose requirements cannot be
taken now are skipped (and stay first in line for the next receive), so the order is
FIFO among the tasks that can run -- but a skipped task keeps its place for the units
it is short of: it joins the pool's *admission line* (by submission order), and no
younger task takes units of that pool while an older task of the line does not fit,
so units that come back go to the oldest task that needs them and a large request is
never starved by a stream of small ones (the promise plain ``acquire`` keeps). The line
is derived, in memory: a task leaves it when it is delivered or no longer ready, or
when no receive looked at it for 2 minutes (nobody asks for it any more); after a
restart the first receive that skips it puts it back. What a delivery took is given back in the apply of
the record that ends the delivery -- completed, retried, rejected, cancelled, expired,
its lease run out, its run ended -- so a task never holds a grant unless it is RUNNING.
When units come back, the receivers parked for ready tasks that need them are woken.

Requirement types are pluggable. :data:`REQUIREMENT_KINDS` maps each field of
:class:`rallypoint.protocol.Requirements` (the wire form, by *name*) and of
:class:`rallypoint.records.TaskRequirements` (the stored form, resolved at submission)
to the coordinator attribute of the kind implementing it, which provides::

    requirement_prepare(space, value) -> stored value     # at submit; VALIDATION_FAILED / NOT_FOUND
    requirement_fits(stored, pending: dict, task) -> bool # read-only: can it be taken now for task,
                                                          #   on top of what this step already took?
    requirement_skipped(task, stored, pending)            # optional: a receive could not take it
                                                          #   (pools: the task keeps its place)
    requirement_hold(stored, pending: dict) -> None       # count it in ``pending`` (same step)
    requirement_records(task, stored, at_ms) -> [Record]  # the take, committed with TaskDelivered
    requirement_release(task, stored, at_ms, new_state)   # apply: the delivery ended: give back /
                                                          #   settle what it still holds. new_state:
                                                          #   the task's next state; SUCCEEDED also
                                                          #   when its worker completed a task whose
                                                          #   own run's join sets are still closing
                                                          #   (it stays RUNNING, completing, and this
                                                          #   is called again when it leaves
                                                          #   RUNNING): must be idempotent
    requirement_track(task, stored) / requirement_untrack(task, stored)
                                                          # apply: the task is unfinished / finished
    requirement_views(task) -> dict                       # extra DeliveryView fields (e.g. grants)
    requirement_describe(stored) -> wire value            # stored (ids) back to names: a mailbox's
                                                          #   default requirements in its view
    requirement_max_names: int                            # most names one task's requirements give

Two kinds implement it: pools (``"pools"``: pool id -> units, held as grants) and
budgets (``"budgets"``: budget id -> minor units, a reservation per delivery, settled or
voided by ``new_state``; :mod:`rallypoint.actors.budget`). A new type needs (1) a field in
both Requirements Structs and in the two cross-shard ones (``records.RemoteRequirements``,
``protocol.AdmissionReserve``), (2) a line here, (3) those methods on its kind, and (4)
what its ``requirement_views`` returns as a field of ``DeliveryView`` (pools: ``grants``,
budgets: ``reservations``). The same registry admits across shards: a task whose run is
not on its space's home shard keeps its requirements by name (:meth:`Admission.named`,
each kind's ``requirement_max_names``), and the home shard's ``admission.reserve``
resolves and takes them through the same methods (:meth:`Admission.prepare_named`,
:meth:`Admission.take_now`, :meth:`Admission.release_remote`;
``tests/test_cluster_remote.py`` fails for a type left out).

**Mailbox defaults.** A WORK mailbox may hold default requirements
(``mailbox.ensure(..., requirements=)``, resolved by :meth:`Admission.prepare` like a
task's and stored on the queue: ``MailboxCreated`` / ``MailboxRequirementsSet``). A
submission without requirements of its own -- by any path: ``task.submit``, a
``task.submit_many`` item, ``group.submit``, ``joinset.submit`` -- gets them in
``WorkQueues.prepare_submit``, copied into its ``TaskSubmitted``: the task keeps what it
was submitted with whatever the queue declares later, and replay needs no lookup. A task
with requirements of its own keeps its own (they replace the defaults; no merge).

**Work limits.** ``run.work_limits.ensure(name, max_outstanding)`` caps the unfinished
tasks that name the limit (``submit(..., work_limit=name)``), in the run and below: the
name is looked up in the submitting run, then its ancestors, nearest first. A
submission that would make ``max_outstanding + 1`` unfinished tasks is LIMIT_EXCEEDED
(with ``retry_after``); an idempotent resubmission (same key, same input) is not
counted again. The count drops when a task finishes (any terminal state, including the
cancellations of a run's end).
"""

from __future__ import annotations

import msgspec

from ..clock import to_iso
from ..errors import ConflictError, LimitError, NotFoundError
from ..protocol import Requirements, WorkLimitEnsure, WorkLimitList, WorkLimitListView, WorkLimitView
from ..records import TaskRequirements, WorkLimitCreated
from ..events import emits, ev
from .common import applies, check_name, check_range, short
from .kind import Kind, Links
from .opmark import ALWAYS, C, R, by_run, op, run_or_space

__all__ = ["Admission", "RemoteDelivery", "WorkLimitState", "REQUIREMENT_KINDS"]

#: Requirement type (a field of Requirements / TaskRequirements) -> the Coordinator
#: attribute of the kind that implements it (see the module docstring).
REQUIREMENT_KINDS: dict[str, str] = {"pools": "pools", "budgets": "budgets"}

_TERMINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED"})


class RemoteDelivery:
    """A delivery of a task of another shard, as the requirement kinds see it on the
    space's home shard (the task itself is not there): ``id`` (the task's), ``space``,
    ``scope_id`` (its run: a remote run here), ``token`` as the task's own would be at
    that moment (the one before the delivery when it is taken, the delivery's when it
    is released) and ``grant_holder`` (what its pool grants show as their holder)."""

    __slots__ = ("id", "space", "scope_id", "token", "grant_holder")

    def __init__(self, task_id: str, token: int, space: str = "", scope_id: str = "",
                 grant_holder: str | None = None) -> None:
        self.id = task_id
        self.token = token
        self.space = space
        self.scope_id = scope_id
        self.grant_holder = grant_holder


class WorkLimitState(msgspec.Struct, gc=False, omit_defaults=True):
    id: str
    space: str
    scope_id: str
    name: str
    max_outstanding: int
    created_at_ms: int


class Admission(Kind):
    """Work limits (the entities) and the requirements of tasks (the orchestration of
    the requirement kinds, called by the work-queue kind)."""

    prefix = "wlm"
    name = "admission"

    def __init__(self, coord) -> None:
        super().__init__(coord)
        self.table: dict[str, WorkLimitState] = {}
        self._init_indexes()

    def _init_indexes(self) -> None:
        self.by_name: dict[tuple[str, str], str] = {}  # (run, name) -> work limit id
        self.outstanding: dict[str, int] = {}  # work limit -> unfinished tasks naming it
        self.links = Links()  # retention: run -> its work limits

    def entity_tables(self):
        return {"wlm": (self.table, WorkLimitState)}

    def parent_actor_id(self, wl_id: str) -> str | None:
        return self.table[wl_id].scope_id

    def statistics(self) -> dict:
        return {"work_limits": len(self.table)}

    def _kinds(self):
        coord = self.coord
        return [(field, getattr(coord, attr)) for field, attr in REQUIREMENT_KINDS.items()]

    # ================================================================ work limits
    def view(self, wl: WorkLimitState) -> WorkLimitView:
        return WorkLimitView(id=wl.id, scope_id=wl.scope_id, name=wl.name, max_outstanding=wl.max_outstanding,
                             outstanding=self.outstanding.get(wl.id, 0), created_at=to_iso(wl.created_at_ms))

    @op(WorkLimitEnsure, route=by_run(), permission=C, resend=ALWAYS)
    def op_work_limit_ensure(self, actor, session, op: WorkLimitEnsure) -> WorkLimitView:
        """Create the limit ``name`` of run ``scope_id`` (runs on the run's actor), or
        check it exists with this ``max_outstanding`` (CONFLICT otherwise).
        VALIDATION_FAILED (name, max_outstanding 1-10,000,000), NOT_FOUND (run),
        SCOPE_CANCELLED / DEADLINE_EXCEEDED (inactive run)."""
        coord = self.coord
        run = coord.runs.get(session.space, op.scope_id)
        check_name("name", op.name)
        check_range("max_outstanding", op.max_outstanding, 1, 10_000_000)
        wid = self.by_name.get((run.id, op.name))
        if wid is not None:
            wl = self.table[wid]
            if wl.max_outstanding != op.max_outstanding:
                raise ConflictError(
                    f"work limit {op.name!r} of run {run.id} exists with max_outstanding={wl.max_outstanding}, "
                    f"not {op.max_outstanding}", details={"field": "max_outstanding", "existing": wl.max_outstanding},
                )
            return self.view(wl)
        coord.runs.require_active(run.id)
        rec = WorkLimitCreated(id=coord.new_id("wlm", under=run.id), space=session.space, scope_id=run.id, name=op.name,
                               max_outstanding=op.max_outstanding, at_ms=coord.now_ms())
        coord.commit([rec])
        return self.view(self.table[rec.id])

    @applies(WorkLimitCreated)
    def _apply_created(self, r: WorkLimitCreated) -> None:
        wl = WorkLimitState(id=r.id, space=r.space, scope_id=r.scope_id, name=r.name,
                            max_outstanding=r.max_outstanding, created_at_ms=r.at_ms)
        self.table[wl.id] = wl
        self.by_name[(wl.scope_id, wl.name)] = wl.id
        self.links.add(wl.scope_id, wl.id)
        self.coord.touch(wl.id)

    @emits(WorkLimitCreated)
    def _ev_created(self, r: WorkLimitCreated):
        return ev(r.space, "work_limit.created", "work_limit", r.id, r.scope_id, r.at_ms,
                  {"name": r.name, "max_outstanding": r.max_outstanding})

    def _limit_done(self, wl_id: str) -> bool:
        return not self.outstanding.get(wl_id)

    def _drop(self, wl_id: str) -> None:
        wl = self.table.pop(wl_id, None)
        if wl is None:
            return
        if self.by_name.get((wl.scope_id, wl.name)) == wl_id:
            del self.by_name[(wl.scope_id, wl.name)]
        self.outstanding.pop(wl_id, None)
        self.coord.touch(wl_id)

    def purge_run(self, run_id: str) -> int:
        """A work limit belongs to its run: purged with it (its tasks, all finished, are
        gone already: children first)."""
        return self.links.purge(run_id, self._limit_done, self._drop)

    @op(WorkLimitList, route=run_or_space("scope_id"), permission=R, resend=ALWAYS)
    def op_work_limit_list(self, actor, session, op: WorkLimitList) -> WorkLimitListView:
        if op.scope_id is not None:
            run = self.coord.runs.get(session.space, op.scope_id)
            out = [self.view(w) for w in self.table.values() if w.scope_id == run.id]
        else:
            out = [self.view(w) for w in self.table.values() if w.space == session.space]
        return WorkLimitListView(work_limits=out)

    def resolve_work_limit(self, run_id: str, name) -> WorkLimitState:
        """The limit ``name`` of the run or its nearest ancestor that has one; NOT_FOUND."""
        check_name("work_limit", name)
        table = self.coord.runs.table
        s = table.get(run_id)
        while s is not None:
            wid = self.by_name.get((s.id, name))
            if wid is not None:
                return self.table[wid]
            s = table.get(s.parent_id) if s.parent_id else None
        raise NotFoundError(
            f"no work limit {short(name)} in run {run_id} or its ancestors; create it with "
            "run.work_limits.ensure()", details={"work_limit": name},
        )

    def check_work_limit(self, wl: WorkLimitState, adding: int) -> None:
        """LIMIT_EXCEEDED unless ``adding`` more unfinished tasks fit under ``wl``."""
        n = self.outstanding.get(wl.id, 0)
        if n + adding > wl.max_outstanding:
            raise LimitError(
                f"work limit {wl.name!r} has {n} unfinished tasks of {wl.max_outstanding} (max_outstanding); "
                "retry once some finish",
                retry_after=1.0,
                details={"work_limit": wl.name, "max_outstanding": wl.max_outstanding, "outstanding": n},
            )

    # ================================================================ requirements
    def prepare(self, space: str, req: Requirements | None) -> TaskRequirements | None:
        """Wire requirements (by name) -> stored ones (by id), or None when empty.
        Raises what each requirement kind raises (VALIDATION_FAILED, NOT_FOUND)."""
        if req is None:
            return None
        sh = self.coord.sharding
        if sh is not None and not sh.owned[sh.home_slot(space)]:
            return self._prepare_remote(sh.owners[sh.home_slot(space)], req)
        out = {}
        for field, kind in self._kinds():
            value = getattr(req, field)
            if value:
                out[field] = kind.requirement_prepare(space, value)
        return TaskRequirements(**out) if out else None

    def _prepare_remote(self, home: int, req: Requirements) -> TaskRequirements | None:
        """A sharded cluster, a run of another shard than the space's home: the
        requirements are kept by name (the pools and budgets live on the home shard,
        which resolves and checks them when a delivery reserves them; one it can never
        grant cancels the task, reason ``requirements_refused``). Here only their shape
        is checked (:meth:`named`), by the same limits as on the home shard."""
        from ..records import RemoteRequirements

        named = self.named(req)
        if not any(named.values()):
            return None
        return TaskRequirements(remote=RemoteRequirements(shard=home, **named))

    def named(self, req) -> dict[str, dict[str, int]]:
        """Requirements by name -- ``req``: any Struct with one field per requirement
        type (``Requirements``, ``RemoteRequirements``, ``AdmissionReserve``) -- as
        ``{type: {name: amount}}``, one entry per :data:`REQUIREMENT_KINDS` type, their
        shape checked without looking anything up: VALIDATION_FAILED for more names
        than the type's kind allows (``requirement_max_names``), a bad name, or an
        amount that is not a positive integer."""
        from ..errors import ValidationError

        out: dict[str, dict[str, int]] = {}
        for field, kind in self._kinds():
            d = dict(getattr(req, field) or {})
            most = kind.requirement_max_names
            if len(d) > most:
                raise ValidationError(f"requirements.{field} names {len(d)}; at most {most}",
                                      details={"field": f"requirements.{field}"})
            for name, v in d.items():
                check_name(f"requirements.{field}", name)
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValidationError(f"requirements.{field}[{name}] must be a positive integer",
                                          details={"field": f"requirements.{field}[{name}]"})
            out[field] = d
        return out

    def prepare_named(self, space: str, req) -> dict:
        """The home shard of a sharded cluster: the requirements by name of ``req`` (any
        Struct with one field per requirement type: ``AdmissionReserve``) to their stored
        form, each by its kind's ``requirement_prepare`` -- the checks and limits of a
        submission on one node (VALIDATION_FAILED, NOT_FOUND); empty types left out."""
        return {field: kind.requirement_prepare(space, getattr(req, field)) for field, kind in self._kinds()
                if getattr(req, field)}

    def take_now(self, delivery, stored: dict, at_ms: int) -> list | None:
        """The home shard of a sharded cluster: the records that take every stored
        requirement (:meth:`prepare_named`) for ``delivery`` (a :class:`RemoteDelivery`)
        now, all or nothing, as :meth:`try_take` does for a local task (the same
        ``requirement_fits`` / ``requirement_hold`` / ``requirement_records``); None when
        one does not fit now (nothing taken). ``requirement_fits`` is asked with no task:
        a request younger than every task in a pool's admission line."""
        parts = [(kind, stored[field]) for field, kind in self._kinds() if stored.get(field)]
        pending: dict = {}
        if not all(kind.requirement_fits(value, pending, None) for kind, value in parts):
            return None
        out: list = []
        for kind, value in parts:
            kind.requirement_hold(value, pending)
            out.extend(kind.requirement_records(delivery, value, at_ms))
        return out

    def release_remote(self, delivery, at_ms: int, new_state: str) -> None:
        """Apply, on the home shard: what was taken for ``delivery`` (a
        :class:`RemoteDelivery` whose ``token`` is the delivery's) goes back or settles,
        by each kind's ``requirement_release`` (stored value None: all it holds for it)."""
        for _field, kind in self._kinds():
            kind.requirement_release(delivery, None, at_ms, new_state)

    def describe(self, stored: TaskRequirements | None) -> Requirements | None:
        """Stored requirements (by id) -> the wire form (by name), or None when there are
        none: how a mailbox's default requirements are shown."""
        if stored is None:
            return None
        out = {}
        for field, kind in self._kinds():
            value = getattr(stored, field)
            if value:
                out[field] = kind.requirement_describe(value)
        return Requirements(**out) if out else None

    def _each(self, t):
        req = t.requirements
        if req is None:
            return
        for field, kind in self._kinds():
            value = getattr(req, field)
            if value:
                yield kind, value
        if req.remote is not None:  # a sharded cluster: a reservation of the home shard
            yield self.coord.outbox, req.remote

    def try_take(self, t, pending: dict) -> bool:
        """All or nothing: True (and counted in ``pending``) when every requirement of
        ``t`` can be taken now together with what this step took already. Read-only
        otherwise (the simulator asks it too)."""
        parts = list(self._each(t))
        if not all(kind.requirement_fits(value, pending, t) for kind, value in parts):
            return False
        for kind, value in parts:
            kind.requirement_hold(value, pending)
        return True

    def skipped(self, t, pending: dict) -> None:
        """A receive looked at ready task ``t`` and :meth:`try_take` said no: each
        requirement kind may keep ``t``'s place for what it is short of (pools: the
        pool's admission line, so the units that come back go to the oldest task that
        needs them)."""
        for kind, value in self._each(t):
            fn = getattr(kind, "requirement_skipped", None)
            if fn is not None:
                fn(t, value, pending)

    def take_records(self, t, at_ms: int) -> list:
        out: list = []
        for kind, value in self._each(t):
            out.extend(kind.requirement_records(t, value, at_ms))
        return out

    def views(self, t) -> dict:
        out: dict = {}
        for kind, _value in self._each(t):
            out.update(kind.requirement_views(t))
        return out

    # ---------------------------------------------------------------- task lifecycle (apply)
    def on_task_submitted(self, t) -> None:
        if t.work_limit_id is not None:
            self.outstanding[t.work_limit_id] = self.outstanding.get(t.work_limit_id, 0) + 1
        for kind, value in self._each(t):
            kind.requirement_track(t, value)

    def on_delivery_ended(self, t, new_state: str, at_ms: int) -> None:
        for kind, value in self._each(t):
            kind.requirement_release(t, value, at_ms, new_state)

    def on_task_terminal(self, t) -> None:
        if t.work_limit_id is not None:
            self.outstanding[t.work_limit_id] -= 1
        for kind, value in self._each(t):
            kind.requirement_untrack(t, value)

    def rebuild_indexes(self) -> None:
        self._init_indexes()
        for wl in self.table.values():
            self.by_name[(wl.scope_id, wl.name)] = wl.id
            self.links.add(wl.scope_id, wl.id)
        for t in self.coord.queues.tasks.values():
            if t.state not in _TERMINAL:
                self.on_task_submitted(t)
