"""Runs (scopes): a tree with deadlines whose end stops a whole subtree at once (SPEC §2).

A run's ``stored_state`` is its own (ACTIVE, CANCELLED, COMPLETED); it is *effectively*
INACTIVE when it or any ancestor is not ACTIVE or is past its deadline. Refusals are
computed from the tree at request time (:meth:`Runs.inactive_error`), so a deadline
refuses work at the instant it passes, before its activity fires.

A run's end is ONE record (``ScopeEnded``, ``ScopeDeadlinePassed``, or the
``GroupFinalized`` that cancels a gate run) whose apply, with no ``await`` in between:

1. records the run's new state;
2. walks the subtree, and for every run in it lets what the run owns react, newest
   first (join sets close, groups gated there finalize, barriers and timers are
   cancelled: :meth:`Kind.on_run_inactive`), then cancels its unfinished tasks;
3. cancels the run's nursery: the actor tasks of the run, of everything below it, and
   every waiter they hold end through Trio cancellation and answer from the state of
   step 2.

No request can see a half-ended subtree, and no waiter below an ended run is left.

The actor of a run lives in its parent run's nursery (a root run in the root nursery);
groups, barriers, timers and join sets live in their run's nursery. A task's own run
(``delivery.run()``, ``ScopeState.task_id``) is a child of the task's run, so it sits in
that run's nursery and in its subtree: whatever ends the task's run ends the task and,
in the same step, the task's own run. It ends only with its task (cancel/complete on it
directly is CONFLICT): see :mod:`rallypoint.actors.queue`.
"""

from __future__ import annotations

import sys

import msgspec

from ..clock import to_iso
from ..errors import (
    ConflictError,
    DeadlineExceededError,
    LimitError,
    RallypointError,
    ScopeCancelledError,
    ValidationError,
)
from ..protocol import (
    ScopeCancel, ScopeComplete, ScopeCreate, ScopeEnsureNamed, ScopeList, ScopeListView, ScopeStatus, ScopeView,
)
from ..events import emits, ev
from ..records import ScopeCreated, ScopeDeadlinePassed, ScopeEnded
from .queue_state import PRIORITY_MAX, PRIORITY_MIN
from .common import applies, check_label, check_range, clamp_wait, data, parse_instant
from .kind import Kind
from .opmark import ALWAYS, NEVER, R, SPACE, W, asked, by_run, fenced, in_slot, named, op, run_or_space
from .runtime import PRIO_RUN_DEADLINE, Park

__all__ = ["ScopeState", "Runs"]


class ScopeState(msgspec.Struct, gc=False, omit_defaults=True):
    """What a snapshot stores of a run. Instants are wall ms."""

    id: str
    space: str
    parent_id: str | None
    name: str | None
    deadline_ms: int | None
    child_limit: int
    created_at_ms: int
    state: str = "ACTIVE"  # ACTIVE | CANCELLED | COMPLETED
    ended_at_ms: int | None = None
    end_reason: str | None = None
    deadline_fired: bool = False
    children: int = 0
    group_id: str | None = None
    task_id: str | None = None  # a task's own run: it ends with that task
    #: a sharded cluster: set on a *remote run* of the home shard (the run lives on
    #: that shard; here only its id, space and state: no tree, no deadline of its own)
    remote_shard: int | None = None
    #: a sharded cluster: the home shards this run uses entities of (``RunLinked``);
    #: its end puts one outbox entry for each, then this is emptied (a tuple: an empty
    #: list per run would be one GC-tracked object per run for every GC pass to walk)
    links: tuple[int, ...] = ()
    #: issue 44: the default priority of tasks submitted under it and its descendants
    #: (None: its parent's; a task's own run: that task's priority)
    priority: int | None = None


_REASON_OF_STATE = {"CANCELLED": "cancelled", "COMPLETED": "completed"}
_intern = sys.intern


def _purged_error(run_id: str, gone_id: str) -> ScopeCancelledError:
    """The refusal for a run (or an ancestor) that retention deleted: it ended."""
    who = f"run {run_id}" if gone_id == run_id else f"run {run_id}'s ancestor {gone_id}"
    return ScopeCancelledError(
        f"{who} ended and was purged by retention (--retain-finished); it accepts no new work (start a new run)",
        details={"scope_id": gone_id, "reason": "purged"},
    )


class Runs(Kind):
    """Runs: create, status, cancel, complete, list; deadlines; the subtree step."""

    prefix = "scp"
    name = "runs"
    noun = "run"
    id_field = "scope_id"

    def __init__(self, coord) -> None:
        super().__init__(coord)
        self.table: dict[str, ScopeState] = {}
        self._init_indexes()

    def _init_indexes(self) -> None:
        self.children: dict[str, dict[str, None]] = {}  # run id -> its child run ids (ordered)
        self.owned: dict[str, list[str]] = {}  # run id -> ids of the groups/barriers/timers/join sets it owns
        self.counts: dict[str, dict[str, int]] = {}  # space -> stored_state -> runs
        #: (space, name) -> the root runs of that name not yet ended, oldest first
        #: (``scope.ensure_named`` joins the newest effectively ACTIVE one)
        self.named_roots: dict[tuple[str, str], dict[str, None]] = {}
        self.roots: dict[str, dict[str, None]] = {}  # space -> its root runs (creation order)

    def entity_tables(self):
        return {"scp": (self.table, ScopeState)}

    def get(self, space: str, entity_id):
        """The run ``entity_id`` of ``space`` (NOT_FOUND otherwise); in a sharded cluster
        a run of another shard, named by a step on this one, is VALIDATION_FAILED
        saying so (``Sharding.cross_shard``), not NOT_FOUND."""
        sh = self.coord.sharding
        if sh is not None and entity_id not in self.table:
            sh.cross_shard(entity_id, "run")
        return super().get(space, entity_id)

    def root_of(self, run_id: str) -> str:
        """The root run of ``run_id``'s tree (``run_id`` must exist)."""
        table = self.table
        s = table[run_id]
        while s.parent_id is not None and s.parent_id in table:
            s = table[s.parent_id]
        return s.id

    def parent_actor_id(self, run_id: str) -> str | None:
        return self.table[run_id].parent_id

    # ================================================================ lookups
    def inactive_error(self, run_id: str, at_ms: int | None = None) -> RallypointError | None:
        """Why the run (or an ancestor) refuses new work at ``at_ms`` (default: now), or
        None when it is active. SCOPE_CANCELLED when it or an ancestor was cancelled or
        completed, DEADLINE_EXCEEDED when it or an ancestor is past its deadline (the
        first found walking up from the run).

        A run that is not in the table is ENDED, never active: retention purges only
        runs that ended (``details.reason`` purged), so a lease, grant or once its purged
        run still holds is refused renewal and completion exactly as while it was kept
        (issue 34 item 1). Callers that take a run id from a client look it up first
        (NOT_FOUND, with the "purged" hint)."""
        table = self.table
        s = table.get(run_id)
        if s is None:
            return _purged_error(run_id, run_id)
        now = at_ms
        while True:
            if s.state != "ACTIVE":
                what = "cancelled" if s.state == "CANCELLED" else "completed"
                if s.id == run_id:
                    msg = f"run {s.id} was {what}; it accepts no new work (start a new run)"
                else:
                    msg = f"run {run_id} is inactive: its ancestor {s.id} was {what}"
                return ScopeCancelledError(msg, details={"scope_id": s.id, "reason": what})
            if s.deadline_ms is not None:
                if now is None:
                    now = self.coord.now_ms()
                if s.deadline_fired or now >= s.deadline_ms:
                    who = "run " + s.id if s.id == run_id else f"run {run_id}'s ancestor {s.id}"
                    return DeadlineExceededError(
                        f"{who} passed its deadline {to_iso(s.deadline_ms)}; it accepts no new work",
                        details={"scope_id": s.id, "reason": "deadline"},
                    )
            if s.parent_id is None:
                return None
            parent = table.get(s.parent_id)
            if parent is None:  # (an ancestor is purged only with its subtree: cannot happen)
                return _purged_error(run_id, s.parent_id)
            s = parent

    def require_active(self, run_id: str) -> None:
        """Raise SCOPE_CANCELLED / DEADLINE_EXCEEDED when the run refuses new work."""
        err = self.inactive_error(run_id)
        if err is not None:
            raise err

    def deadline_passed(self, run_id: str, at_ms: int | None = None) -> bool:
        """The run or an ancestor is past its deadline at ``at_ms`` (default: now),
        whether or not the deadline's activity has fired. Deterministic given ``at_ms``."""
        if at_ms is None:
            at_ms = self.coord.now_ms()
        table = self.table
        s = table.get(run_id)
        while s is not None:
            if s.deadline_ms is not None and (s.deadline_fired or s.deadline_ms <= at_ms):
                return True
            s = table.get(s.parent_id) if s.parent_id else None
        return False

    def is_descendant_or_self(self, run_id: str, ancestor_id: str) -> bool:
        table = self.table
        s = table.get(run_id)
        while s is not None:
            if s.id == ancestor_id:
                return True
            s = table.get(s.parent_id) if s.parent_id else None
        return False

    def subtree(self, root_id: str):
        """Ids of the run and every run below it (parent before children)."""
        stack = [root_id]
        children = self.children
        while stack:
            rid = stack.pop()
            yield rid
            kids = children.get(rid)
            if kids:
                stack.extend(kids)

    def own(self, run_id: str, entity_id: str) -> None:
        """Register ``entity_id`` (a group gated here, a barrier, timer, join set) as owned
        by ``run_id``: it reacts (``on_run_inactive``) when the run ends."""
        self.owned.setdefault(run_id, []).append(entity_id)

    # ================================================================ decide (ops)
    @op(ScopeCreate, route=run_or_space("parent_id"), permission=W, resend=NEVER,
        shard=in_slot("parent_id", "new_root"))
    def op_scope_create(self, actor, session, op: ScopeCreate, named: bool = False) -> ScopeView:
        """A root run (on the space's actor) or a child run (on the parent's actor).
        ``named``: the root of ``scope.ensure_named`` (in a sharded cluster its id names
        the slot its name hashes to). VALIDATION_FAILED (name, deadline in the past,
        child_limit), NOT_FOUND (parent),
        SCOPE_CANCELLED / DEADLINE_EXCEEDED (parent inactive), LIMIT_EXCEEDED (child_limit; the
        space's ``runs`` or ``stored`` limit: ``rallypoint/limits.py``)."""
        space = session.space
        if op.parent_id is not None:
            parent = self.get(space, op.parent_id)
            self.require_active(parent.id)
            self.check_child_limit(parent)
        self.coord.limits.check_runs(space)
        if op.name is not None:
            check_label("name", op.name)
        check_range("child_limit", op.child_limit, 0, 1_000_000)
        if op.priority is not None:
            check_range("priority", op.priority, PRIORITY_MIN, PRIORITY_MAX)
        now = self.coord.now_ms()
        deadline_ms = parse_instant("deadline", op.deadline)
        if deadline_ms is not None and deadline_ms <= now:
            raise ValidationError(
                f"deadline {op.deadline} is in the past (now {to_iso(now)})", details={"field": "deadline"}
            )
        rec = ScopeCreated(
            id=self.coord.new_id("scp", under=op.parent_id, named=(space, op.name) if named else None),
            space=space,
            parent_id=op.parent_id,
            name=op.name,
            deadline_ms=deadline_ms,
            child_limit=op.child_limit,
            at_ms=now,
            priority=op.priority,
        )
        self.coord.commit([rec])
        return self.view(self.table[rec.id])

    @op(ScopeEnsureNamed, route=SPACE, permission=W, resend=ALWAYS, shard=named("name"))
    def op_scope_ensure_named(self, actor, session, op: ScopeEnsureNamed) -> ScopeView:
        """Join the named root run (the newest root run with ``name`` that is effectively
        ACTIVE) or create it; on the space's actor, so concurrent joins agree. A run that
        ended (cancelled, completed, past its deadline) is never joined again: the next
        join makes a new one. ``deadline`` applies only when creating.
        VALIDATION_FAILED (name, deadline)."""
        check_label("name", op.name)
        for rid in reversed(self.named_roots.get((session.space, op.name), ())):
            if self.inactive_error(rid) is None:  # (a newer one that ended does not hide it)
                return self.view(self.table[rid])
        return self.op_scope_create(actor, session, ScopeCreate(name=op.name, deadline=op.deadline), named=True)

    def check_child_limit(self, parent: ScopeState, what: str = "") -> None:
        if parent.children >= parent.child_limit:
            raise LimitError(
                f"run {parent.id} already has {parent.children} children, its child_limit{what}",
                details={"field": "child_limit", "limit": parent.child_limit},
            )

    @op(ScopeStatus, route=by_run(), permission=R, resend=ALWAYS)
    def op_scope_status(self, actor, session, op: ScopeStatus) -> ScopeView:
        return self.view(self.get(session.space, op.scope_id))

    @op(ScopeCancel, route=by_run(), permission=W, resend=ALWAYS)
    def op_scope_cancel(self, actor, session, op: ScopeCancel) -> ScopeView:
        """Cancel the run and its subtree (one record). Idempotent on a CANCELLED run;
        CONFLICT on a COMPLETED one."""
        s = self.get(session.space, op.scope_id)
        if s.state == "CANCELLED":
            return self.view(s)
        if s.state == "COMPLETED":
            raise ConflictError(f"run {s.id} is already COMPLETED; a finished run cannot be cancelled")
        self._refuse_task_run(s, "cancelled")
        if op.reason is not None and len(op.reason) > 1024:
            raise ValidationError("reason is longer than 1024 characters", details={"field": "reason"})
        self.coord.commit([ScopeEnded(id=s.id, state="CANCELLED", at_ms=self.coord.now_ms(), reason=op.reason)])
        return self.view(s)

    @op(ScopeComplete, route=by_run(), permission=W, resend=fenced("run_completed"), waits=asked("wait_ms"), reply=ScopeView)
    def op_scope_complete(self, actor, session, op: ScopeComplete):
        """Complete the run: first close its open join sets (newest first); the run is
        COMPLETED only once every child of those sets finished (SPEC §5 structured end).
        Until then the reply is the run still ACTIVE (the SDK re-issues the request); a
        join set created while this waits is closed too. CONFLICT on a finished run."""
        s = self.get(session.space, op.scope_id)
        if s.state != "ACTIVE":
            raise ConflictError(f"run {s.id} is already {s.state}; a finished run cannot be completed")
        self._refuse_task_run(s, "completed")
        wait_ms = clamp_wait(op.wait_ms)
        done = self._try_complete(s)
        if done is not None or wait_ms == 0:
            return self.view(s)

        def check():
            if s.state != "ACTIVE":
                return self.view(s)
            return self._try_complete(s)

        return Park("complete", check, wait_ms, lambda: self.view(s))

    def _refuse_task_run(self, s: ScopeState, what: str) -> None:
        """A task's own run ends with its task, never by itself (CONFLICT)."""
        if s.task_id is not None and s.state == "ACTIVE":
            raise ConflictError(
                f"run {s.id} belongs to task {s.task_id} and ends with it: it is completed when the task is "
                f"completed and cancelled by any other end of the task (reject it, or cancel the task); it "
                f"cannot be {what} by itself",
                details={"scope_id": s.id, "task_id": s.task_id},
            )

    def _try_complete(self, s: ScopeState) -> ScopeView | None:
        joinsets = self.coord.joinsets
        closes = joinsets.close_records_for_complete(s.id, self.coord.now_ms())
        if closes:
            self.coord.commit(closes)
        if joinsets.open_count(s.id) == 0 and s.state == "ACTIVE":
            self.coord.commit([ScopeEnded(id=s.id, state="COMPLETED", at_ms=self.coord.now_ms())])
            return self.view(s)
        return None

    @op(ScopeList, route=run_or_space("parent_id"), permission=R, resend=ALWAYS, shard=in_slot("parent_id", "all"),
        merge="scope.list")
    def op_scope_list(self, actor, session, op: ScopeList) -> ScopeListView:
        """Runs of the space (or the children of ``parent_id``) in creation order:
        ``order="asc"`` oldest first, ``"desc"`` newest first; ``after`` / ``before``
        (ids, exclusive) bound the page; filtered by ``state``, ``roots_only`` and
        ``name`` (a part of the name, case-insensitive; 1-256 characters).
        VALIDATION_FAILED for a bad ``limit`` (1-10000) or ``order``."""
        check_range("limit", op.limit, 1, 10_000)
        if op.order not in ("asc", "desc"):
            raise ValidationError("order must be 'asc' or 'desc'", details={"field": "order"})
        desc = op.order == "desc"
        if op.name is not None and not 1 <= len(op.name) <= 256:
            raise ValidationError("name (a part of the run names to match) must be 1-256 characters",
                                  details={"field": "name"})
        needle = op.name.casefold() if op.name is not None else None
        if op.parent_id is not None:
            parent = self.get(session.space, op.parent_id)
            ids = self.children.get(parent.id, {})
            source = (self.table[i] for i in (reversed(ids) if desc else ids))
        elif op.roots_only:  # the space's roots only: not a walk of every run
            ids = self.roots.get(session.space, {})
            source = (self.table[i] for i in (reversed(ids) if desc else ids))
        else:
            source = reversed(self.table.values()) if desc else iter(self.table.values())
        out = []
        for s in source:
            if s.space != session.space or s.remote_shard is not None:
                continue
            if op.roots_only and s.parent_id is not None:
                continue
            if op.after is not None and s.id <= op.after:
                continue
            if op.before is not None and s.id >= op.before:
                continue
            if op.state is not None and s.state != op.state:
                continue
            if needle is not None and (s.name is None or needle not in s.name.casefold()):
                continue
            out.append(self.view(s))
            if len(out) >= op.limit:
                break
        return ScopeListView(scopes=out)

    # ================================================================ views
    def view(self, s: ScopeState) -> ScopeView:
        err = self.inactive_error(s.id)
        reason = None
        if err is not None:
            owner = (err.details or {}).get("scope_id")
            reason = (err.details or {}).get("reason", "cancelled")
            if owner != s.id:
                reason = "ancestor_" + reason
        return ScopeView(
            id=s.id,
            name=s.name,
            parent_id=s.parent_id,
            stored_state=s.state,
            effective="ACTIVE" if err is None else "INACTIVE",
            inactive_reason=reason,
            deadline=to_iso(s.deadline_ms),
            created_at=to_iso(s.created_at_ms),
            ended_at=to_iso(s.ended_at_ms),
            child_limit=s.child_limit,
            children=s.children,
            tasks=self.coord.queues.run_task_counts(s.id),
            group_id=s.group_id,
            task_id=s.task_id,
            priority=self.default_priority(s.id),
        )

    # ================================================================ apply
    @applies(ScopeCreated)
    def _apply_created(self, r: ScopeCreated) -> None:
        """:meth:`add` of the record's run, written out (the most common record: a
        recovery replays it a million times; one frame instead of four, and a new run
        is never remote). Same effects in the same order as ``add``."""
        sid, parent_id, name = r.id, r.parent_id, r.name
        space = _intern(r.space)  # one str per space, not one per run (56 bytes a run)
        self.table[sid] = ScopeState(sid, space, parent_id, name, r.deadline_ms, r.child_limit, r.at_ms,
                                     group_id=r.group_id, priority=r.priority)
        c = self.counts.get(space)
        if c is None:
            c = self.counts[space] = {"ACTIVE": 0, "CANCELLED": 0, "COMPLETED": 0}
        c["ACTIVE"] = c.get("ACTIVE", 0) + 1
        coord = self.coord
        coord.limits.run_added(space)
        if parent_id is None:
            roots = self.roots.get(space)
            if roots is None:
                roots = self.roots[space] = {}
            roots[sid] = None
            if name is not None:
                self.named_roots.setdefault((space, name), {})[sid] = None
        else:
            kids = self.children.get(parent_id)
            if kids is None:
                kids = self.children[parent_id] = {}
            kids[sid] = None
            self.table[parent_id].children += 1
            coord.touch(parent_id)
        coord.touch(sid)
        if r.deadline_ms is not None:
            coord.arm_wall(r.deadline_ms, self._on_deadline, (sid, r.deadline_ms), PRIO_RUN_DEADLINE)

    def completing_task(self, run_id: str):
        """The task that owns ``run_id`` if its worker completed it and it waits for the
        run's join sets to close (``TaskState``), else None."""
        s = self.table.get(run_id)
        if s is None or s.task_id is None:
            return None
        t = self.coord.queues.tasks.get(s.task_id)
        return t if t is not None and t.completing else None

    def default_priority(self, run_id: str) -> int | None:
        """The priority tasks submitted under ``run_id`` get by default: the nearest
        priority set on the run or an ancestor; None when none is (issue 44)."""
        table = self.table
        s = table.get(run_id)
        while s is not None:
            if s.priority is not None:
                return s.priority
            s = table.get(s.parent_id) if s.parent_id else None
        return None

    def add(self, s: ScopeState) -> None:
        """Install a new run (its own record, or a group's gate run in GroupCreated)."""
        self._index(s)
        if s.remote_shard is None:
            self.coord.limits.run_added(s.space)
        if s.parent_id is not None:
            self.table[s.parent_id].children += 1
            self.coord.touch(s.parent_id)
        self.coord.touch(s.id)
        if s.deadline_ms is not None:
            self.coord.arm_wall(s.deadline_ms, self._on_deadline, (s.id, s.deadline_ms), PRIO_RUN_DEADLINE)

    def _count(self, space: str, old: str | None, new: str) -> None:
        c = self.counts.get(space)
        if c is None:
            c = self.counts[space] = {"ACTIVE": 0, "CANCELLED": 0, "COMPLETED": 0}
        if old is not None:
            c[old] -= 1
        c[new] = c.get(new, 0) + 1

    def _index(self, s: ScopeState) -> None:
        self.table[s.id] = s
        if s.remote_shard is not None:  # a remote run: no counts, lists or tree here
            return
        self._count(s.space, None, s.state)
        if s.parent_id is None:
            self.roots.setdefault(s.space, {})[s.id] = None
            if s.name is not None and s.state == "ACTIVE" and not s.deadline_fired:
                self.named_roots.setdefault((s.space, s.name), {})[s.id] = None
        if s.parent_id is not None:
            self.children.setdefault(s.parent_id, {})[s.id] = None

    @applies(ScopeEnded)
    def _apply_ended(self, r: ScopeEnded) -> None:
        self.end(self.table[r.id], r.state, r.at_ms, r.reason)

    def end(self, s: ScopeState, state: str, at_ms: int, reason: str | None, *, implied: bool = False) -> None:
        """The run's own state becomes ``state`` (CANCELLED or COMPLETED) and its subtree
        goes inactive, in this one synchronous step. ``implied``: another record's step
        ends it (a group's gate, a task's own run): its event is an implied fact."""
        was_live = self.live(s.id)
        self._count(s.space, s.state, state)
        s.state = state
        s.ended_at_ms = at_ms
        s.end_reason = reason
        self._unname(s)
        self.coord.touch(s.id)
        self.coord.retention.note(s.id, at_ms)
        if implied:
            self.coord.implied(ScopeEnded(id=s.id, state=state, at_ms=at_ms, reason=reason))
        if was_live:
            self._count_ended(s)
        self._inactivate_subtree(s.id, at_ms, _REASON_OF_STATE[state])

    @applies(ScopeDeadlinePassed)
    def _apply_deadline(self, r: ScopeDeadlinePassed) -> None:
        s = self.table[r.id]
        was_live = self.live(s.id)
        s.deadline_fired = True
        self._unname(s)
        if was_live:
            self._count_ended(s)
        self.coord.touch(s.id)
        if s.state == "ACTIVE":
            self.coord.retention.note(s.id, r.at_ms)
        self._inactivate_subtree(s.id, r.at_ms, "deadline")

    def live(self, run_id: str) -> bool:
        """The run has not ended by any record: it and every ancestor ACTIVE with no
        deadline fired (what the ``runs`` limit counts: ``rallypoint/limits.py``; a deadline
        that passed but has not fired yet still counts). A remote run is never live
        here (its own shard counts it)."""
        table = self.table
        s = table.get(run_id)
        while s is not None:
            if s.state != "ACTIVE" or s.deadline_fired or s.remote_shard is not None:
                return False
            if s.parent_id is None:
                return True
            s = table.get(s.parent_id)
        return False

    def _count_ended(self, s: ScopeState) -> None:
        """``s``, live until this step, ended: it and every run below it still live
        (ACTIVE, no deadline fired: a run that ended before took its subtree with it)
        leave the space's ``runs`` count. Apply only; O(the live part of the subtree)."""
        n = 1
        table, children = self.table, self.children
        stack = list(children.get(s.id, ()))
        while stack:
            c = table.get(stack.pop())
            if c is None or c.state != "ACTIVE" or c.deadline_fired:
                continue
            n += 1
            kids = children.get(c.id)
            if kids:
                stack.extend(kids)
        self.coord.limits.runs_ended(s.space, n)

    def _inactivate_subtree(self, root_id: str, at_ms: int, reason: str) -> None:
        coord = self.coord
        queues = coord.queues
        kind_of = coord._kind_by_prefix
        table = self.table
        for rid in self.subtree(root_id):
            s = table[rid]
            if s.links:  # home shards hold things of this run: tell them (the outbox)
                coord.outbox.note_end(s, reason, at_ms)
                s.links = ()
                coord.touch(rid)
            owned = self.owned.get(rid)
            if owned:
                for eid in reversed(owned):  # newest first: join sets close newest first
                    kind_of[eid[:3]].on_run_inactive(eid, at_ms, reason)
            queues.on_run_inactive(rid, at_ms, reason)
        coord.cancel_actor(root_id)

    # ================================================================ events
    @emits(ScopeCreated, pure=True)
    def _ev_created(self, r: ScopeCreated):
        return ev(r.space, "scope.created", "scope", r.id, r.id, r.at_ms,
                  data(parent=r.parent_id, name=r.name, deadline=to_iso(r.deadline_ms), group=r.group_id))

    @emits(ScopeEnded)
    def _ev_ended(self, r: ScopeEnded):
        s = self.table[r.id]
        kind = "scope.cancelled" if r.state == "CANCELLED" else "scope.completed"
        return ev(s.space, kind, "scope", s.id, s.id, r.at_ms, data(reason=r.reason))

    @emits(ScopeDeadlinePassed)
    def _ev_deadline(self, r: ScopeDeadlinePassed):
        s = self.table[r.id]
        return ev(s.space, "scope.deadline", "scope", s.id, s.id, r.at_ms, data(deadline=to_iso(s.deadline_ms)))

    # ================================================================ activities
    def _on_deadline(self, arg) -> None:
        run_id, deadline_ms = arg
        s = self.table.get(run_id)
        if s is None or s.deadline_fired or s.deadline_ms != deadline_ms:
            return
        self.coord.commit([ScopeDeadlinePassed(id=run_id, at_ms=deadline_ms)])

    def rearm(self) -> None:
        for s in self.table.values():
            if s.deadline_ms is not None and not s.deadline_fired:
                self.coord.arm_wall(s.deadline_ms, self._on_deadline, (s.id, s.deadline_ms), PRIO_RUN_DEADLINE)

    def rebuild_indexes(self) -> None:
        self._init_indexes()
        for s in self.table.values():
            if s.remote_shard is not None:
                continue
            self._count(s.space, None, s.state)
            if s.parent_id is not None:
                self.children.setdefault(s.parent_id, {})[s.id] = None
                continue
            self.roots.setdefault(s.space, {})[s.id] = None
            if s.name is not None and s.state == "ACTIVE" and not s.deadline_fired:
                self.named_roots.setdefault((s.space, s.name), {})[s.id] = None
        for k, ids in self.named_roots.items():  # oldest first (ids are time-ordered)
            self.named_roots[k] = dict.fromkeys(sorted(ids))

    # ================================================================ remote runs
    def add_remote(self, run_id: str, space: str, shard: int, at_ms: int) -> ScopeState:
        """Install the remote run ``run_id`` (it lives on ``shard``): the apply of
        ``RemoteRunAdopted``, and of a ``RemoteRunEnded`` that came first."""
        s = ScopeState(id=run_id, space=space, parent_id=None, name=None, deadline_ms=None, child_limit=0,
                       created_at_ms=at_ms, remote_shard=shard)
        self._index(s)
        self.coord.touch(run_id)
        return s

    def end_remote(self, run_id: str, space: str, shard: int, reason: str, at_ms: int) -> None:
        """The remote run ``run_id`` ended on its shard (``reason``: cancelled,
        completed, deadline): it ends here in this one step, as a run does -- what it
        owns reacts (waiters leave their lines), its actor's nursery is cancelled
        (its parked requests answer the run's code). Ending an ended one changes
        nothing. Retention purges an ended remote run, and what it owns here, as it
        does a run (a later request naming it is linked again, and refused by its
        shard: the run ended)."""
        s = self.table.get(run_id)
        if s is None:
            s = self.add_remote(run_id, space, shard, at_ms)
        elif s.remote_shard is None:
            return  # (a local run: never named by another shard's outbox)
        if self.inactive_error(run_id, at_ms) is not None:
            return
        if reason == "deadline":
            s.deadline_ms = at_ms
            s.deadline_fired = True
        else:
            s.state = "COMPLETED" if reason == "completed" else "CANCELLED"
            s.ended_at_ms = at_ms
            s.end_reason = "ended on shard %d (%s)" % (shard, reason)
        self.coord.touch(run_id)
        self.coord.retention.note(run_id, at_ms)
        self._inactivate_subtree(run_id, at_ms, reason if reason in ("deadline", "completed") else "cancelled")

    # ================================================================ retention
    def purge_run(self, run_id: str) -> int:
        """Remove the run itself (its subtree and what it owns are gone already). Its
        parent keeps its ``children`` count (the child_limit counts runs created)."""
        s = self.table.pop(run_id, None)
        if s is None:
            return 0
        c = self.counts.get(s.space) if s.remote_shard is None else None  # (remote runs are not counted)
        if c is not None:
            c[s.state] -= 1
        if s.remote_shard is None:
            self.coord.limits.run_purged(s.space)
        if s.parent_id is not None:
            kids = self.children.get(s.parent_id)
            if kids is not None:
                kids.pop(run_id, None)
                if not kids:
                    del self.children[s.parent_id]
        self.children.pop(run_id, None)
        self.owned.pop(run_id, None)
        if s.parent_id is None:
            roots = self.roots.get(s.space)
            if roots is not None:
                roots.pop(run_id, None)
                if not roots:
                    del self.roots[s.space]
        self._unname(s)
        self.coord.touch(run_id)
        return 1

    def _unname(self, s: ScopeState) -> None:
        """``s`` ended (or is gone): no join by name finds it again."""
        if s.parent_id is None and s.name is not None:
            k = (s.space, s.name)
            ids = self.named_roots.get(k)
            if ids is not None:
                ids.pop(s.id, None)
                if not ids:
                    del self.named_roots[k]

    def statistics(self) -> dict:
        return {"runs": len(self.table)}
