"""Work queues (runstate's "mailboxes"), durable tasks, fenced and leased deliveries (SPEC §3).

A task is QUEUED -> RUNNING (a delivery holds a lease) -> SUCCEEDED | FAILED |
CANCELLED | EXPIRED. Every delivery increments the task's fencing ``token``; renew,
complete, retry and reject carry it, and a token that is not the current one is
STALE_CLAIM and changes nothing. A lease that runs out puts the task back in the queue
(takeover) with ``attempt + 1``; so does a retry; after ``max_attempts`` attempts the
task is FAILED. A holder that stops may *release* it instead (``delivery.release``):
back in the queue with the same ``attempt``, not counted. Delivery is at-least-once; the outcome is recorded exactly once (the
first valid complete).

A task's own run (``delivery.run``, ``TaskRunCreated``): a child run of the task's run,
made on first use by the lease holder and kept across attempts. The task's end and the
run's end are one structure: a completed task is ``completing`` (outcome held, still
RUNNING, no lease) while its run's join sets close, and ``TaskRunCompleted`` -- a
reaction in the commit where the last set closes -- completes the run and records the
outcome in one apply; any other end of the task cancels its run in the apply of that
end (:meth:`WorkQueues.finish`), before the task's terminal state is visible.

Where things run: a work queue's actor (space level, in the root nursery) answers for
the queue itself; a **task belongs to its run**: every command about a task -- submit,
receive for a run, renew/complete/retry/reject, result, cancel -- is handled here but
runs on the task's run's actor, and a wait for a task (its result, a receive) is parked
there, so the run's end answers it.

Time: a task's deadline is a wall instant (judged before every command batch, so a
complete that arrives after it is refused even if its activity has not fired yet);
leases and retry delays are server time (:meth:`rallypoint.clock.Clock.mono_ms`), so a
wall clock set back does not stretch them, and time the server could not hear (down,
stalled) is given back to lease holders (``LeasesExtended``). FIFO order is a sequence
number given at submission, never the wall clock.

**Messages.** A queue is WORK (tasks, ``task.submit``) or INBOX (plain messages,
``message.send``: :mod:`rallypoint.actors.inbox`). A message is stored and handled
exactly like a task -- the same state, ready heaps, receive, fencing tokens, leases,
retries, deadlines, lease extensions and run cancellation -- with an ``msg_`` id and
ACKED instead of SUCCEEDED once completed. Submitting to an INBOX or sending to a WORK
queue is CONFLICT.

**Reservations held for a delivery.** When a delivery ends (its task leaves RUNNING:
completed, retried, rejected, lease expired, cancelled, expired) the budget
reservations held for it close in the same apply
(:meth:`rallypoint.actors.budget.Budgets.on_delivery_ended`).

Indexes (rebuilt after recovery, never snapshotted): a ready heap per (queue, run) of
``(seq, task id)``, the idempotency-key index, unfinished tasks per run, leased tasks
(node-wide and per run: ``ops.run`` lists a subtree's by their delivery's holder), and
counts.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..clock import to_iso
from ..errors import ConflictError, NotFoundError, ValidationError
from ..ids import is_id, slot_of
from ..protocol import (
    MailboxEnsure, MailboxGet, MailboxList, MailboxListView, MailboxMessages, MailboxView, TaskListView,
)
from ..records import (
    MailboxSchedulingSet, TaskPrioritySet,
    TaskRequirements, LeaseExpired, LeasesExtended, MailboxCreated, MailboxRequirementsSet, TaskCancelled,
    TaskCompleted, TaskDelivered, TaskExpired, TaskRejected, TaskReleased, TaskRetried, TaskRunCompleted,
    TaskRunCreated, TaskCompleting, TaskDetached, TaskSubmitted, TaskSubscribed,
)
from ..events import emits, ev
from .common import applies, check_name, check_range, data, did_you_mean, short
from .kind import Kind
from .opmark import ALL, ALWAYS, C, R, SPACE, by, op
from .queue_state import (
    MIN_AGING_MS, MAX_AGING_MS, check_weights, check_rate_limits,
    TERMINAL, MODES, _ENSURE_SETTINGS, MIN_LEASE_MS, MAX_LEASE_MS, MAX_BATCH, MailboxState, TaskState,
    _Submitted, _Attempt, _Delivered, TaskPhase, DeliveryState,
)
# (re-exported: other kinds and tests import them from here)
from .queue_state import delivery_bytes, outcome_view_bytes, task_view_bytes  # noqa: F401
from .queue_batches import Batches
from .queue_ready import ReadyIndex
from .queue_deliveries import Deliveries
from .queue_tasks import Tasks

__all__ = ["MailboxState", "TaskState", "TaskPhase", "DeliveryState", "WorkQueues", "TERMINAL", "MIN_LEASE_MS", "MAX_LEASE_MS"]


class WorkQueues(Tasks, Deliveries, Batches, Kind):
    """Work queues and their tasks: the kind. The queues themselves (ensure, get, list),
    indexes, retention, events and recovery are here; tasks in :class:`~.queue_tasks.Tasks`,
    deliveries and leases in :class:`~.queue_deliveries.Deliveries`, batches in
    :class:`~.queue_batches.Batches`, the ready index (where a receive finds what
    to deliver) in :class:`~.queue_ready.ReadyIndex`."""

    prefix = "mbx"
    name = "queues"

    def __init__(self, coord) -> None:
        super().__init__(coord)
        self.table: dict[str, MailboxState] = {}
        self.tasks: dict[str, TaskState] = {}
        self.next_seq = 1
        # task id -> [(actor id, key)] of waits for many tasks (task.results) to wake
        self.result_watch: dict[str, list[tuple[str, Any]]] = {}
        self.to_check: set[str] = set()  # completing tasks whose run may be done: see react()
        # (commits serial, expires ms, [task ids]): the lease batch the current commit fills
        self._lease_open: tuple[int, int, list[str]] | None = None
        self._init_indexes()
        coord.heap.stale_when(self._on_lease, self._lease_stale)
        coord.heap.stale_when(self._on_leases, self._leases_stale)
        coord.heap.stale_when(self._on_deadline, self._deadline_stale)

    def _init_indexes(self) -> None:
        self.by_name: dict[tuple[str, str], str] = {}
        self.task_keys: dict[tuple[str, str, str], str] = {}
        self.ready_index = ReadyIndex(self.tasks, self._weight_of, self._aging_of)
        self.ready_set = self.ready_index  # (``in``: is a task ready; read by pools and the simulator)
        self.leased: set[str] = set()  # RUNNING tasks (a completing one is no longer leased)
        self.run_leased: dict[str, set[str]] = {}  # run -> its leased tasks (ops.run's holders)
        self.queue_counts: dict[str, list[int]] = {}  # queue -> [queued, running]
        self.run_counts: dict[str, dict[str, int]] = {}  # run -> state -> tasks
        self.run_unfinished: dict[str, set[str]] = {}
        self.run_tasks: dict[str, set[str]] = {}  # run -> every task of it (retention)
        self.space_counts: dict[str, dict[str, int]] = {}
        self.queue_done: dict[str, int] = {}  # queue -> tasks finished since start (rates in `top`)
        self.rate_wakes: dict[str, int] = {}  # queue -> the rate window a wake-up is armed for

    def _weight_of(self, t: TaskState) -> int:
        """The weight of ``t``'s fairness key: the queue's for the key, else the task's
        own, else 1."""
        w = self.table[t.mailbox_id].weights
        if w and t.fair_key in w:
            return w[t.fair_key]
        return t.fair_weight or 1

    def _aging_of(self, queue_id: str) -> int | None:
        """The queue's aging interval (ms), None when off."""
        q = self.table.get(queue_id)
        return q.aging_ms if q is not None else None

    def entity_tables(self):
        # messages (``msg_`` ids) live in the task table: they are tasks of INBOX queues
        return {"mbx": (self.table, MailboxState), "tsk": (self.tasks, TaskState), "msg": (self.tasks, TaskState)}

    def statistics(self) -> dict:
        return {"queues": len(self.table), "tasks": len(self.tasks), "leased": len(self.leased),
                "ready": len(self.ready_set)}

    def leases_outstanding(self) -> int:
        """How many tasks are RUNNING (hold a lease)."""
        return len(self.leased)

    def run_task_counts(self, run_id: str) -> dict[str, int]:
        return dict(self.run_counts.get(run_id, {}))

    def get_queue(self, space: str, name_or_id) -> MailboxState:
        """A queue by name or id; NOT_FOUND (saying how to create it) otherwise."""
        if not isinstance(name_or_id, str):
            raise ValidationError("mailbox must be a name or an id", details={"field": "mailbox"})
        qid = name_or_id if is_id(name_or_id, "mbx") else self.by_name.get((space, name_or_id))
        q = self.table.get(qid) if qid else None
        if q is None or q.space != space:
            hint = did_you_mean(name_or_id, (n for (sp, n) in self.by_name if sp == space))
            raise NotFoundError(
                f"no mailbox {short(name_or_id)}{hint}; create it with mailboxes.ensure()",
                details={"mailbox": name_or_id},
            )
        return q

    def route_queue(self, session, name_or_id) -> str:
        return self.get_queue(session.space, name_or_id).id

    @op(MailboxEnsure, route=SPACE, permission=C, resend=ALWAYS, shard=ALL, merge="mailbox.ensure")
    def op_mailbox_ensure(self, actor, session, op: MailboxEnsure) -> MailboxView:
        """Create the queue, or check it exists with the settings ``op.checked`` names
        (the ones the caller gave; None: all three), CONFLICT naming the first of mode,
        max_attempts, backlog_limit that differs; an existing queue is otherwise taken as
        it is (``checked=[]``: a producer's handle). Runs on the space's actor (names are
        per space).

        ``requirements`` (see :class:`~rallypoint.protocol.MailboxEnsure`): None leaves
        the queue's default requirements as they are; given, they are resolved like a
        task's (VALIDATION_FAILED, NOT_FOUND: ``Admission.prepare``) and replace the
        stored ones -- in the ``MailboxCreated`` of a new queue, else by a
        ``MailboxRequirementsSet`` when they differ (nothing is journaled when they do
        not); empty clears them. VALIDATION_FAILED on an INBOX queue (messages carry no
        requirements).

        ``aging_ms`` (0: off) and ``weights`` (issue 44): None leaves them as they are;
        given, they replace the queue's (in ``MailboxCreated``, else one
        ``MailboxSchedulingSet`` when either differs). VALIDATION_FAILED: ``aging_ms``
        outside 1,000 .. 604,800,000 (and not 0); weights as :func:`check_weights`.
        ``rate_limits`` (deliveries a second per fairness key) the same way
        (:func:`check_rate_limits`); a change keeps the deliveries counted in the window."""
        check_name("name", op.name)
        if op.mode not in MODES:
            raise ValidationError(f"mode must be WORK (tasks) or INBOX (messages) (got {short(op.mode)})",
                                  details={"field": "mode"})
        check_range("max_attempts", op.max_attempts, 1, 1000)
        if op.backlog_limit is not None:
            check_range("backlog_limit", op.backlog_limit, 1, 100_000_000)
        checked = _ENSURE_SETTINGS if op.checked is None else op.checked
        for field in checked:
            if field not in _ENSURE_SETTINGS:
                raise ValidationError(f"checked names {', '.join(_ENSURE_SETTINGS)} (got {short(field)})",
                                      details={"field": "checked"})
        if op.aging_ms is not None and op.aging_ms != 0:
            check_range("aging_ms", op.aging_ms, MIN_AGING_MS, MAX_AGING_MS, " ms (0: no aging)")
        weights = check_weights(op.weights) if op.weights is not None else None
        rates = check_rate_limits(op.rate_limits) if op.rate_limits is not None else None
        coord = self.coord
        self._check_adopt(session.space, op)
        qid = self.by_name.get((session.space, op.name))
        q = self.table[qid] if qid is not None else None
        if q is not None:
            for field in _ENSURE_SETTINGS:
                have, want = getattr(q, field), getattr(op, field)
                if field in checked and have != want:
                    raise ConflictError(
                        f"mailbox {short(op.name)} exists with {field}={have!r}, not {want!r}; leave {field} out "
                        "to take the mailbox as it is",
                        details={"field": field, "existing": have},
                    )
        mode = q.mode if q is not None else op.mode
        reqs = None
        # (on the home shard, or a shard adopting the home shard's queue: there its
        # defaults are kept by name, reserved on the home shard: ``Admission.prepare``)
        if op.requirements is not None and (op.id is None or coord.sharding is not None):
            if mode != "WORK" and (op.requirements.pools or op.requirements.budgets):
                raise ValidationError("requirements apply to the tasks of a WORK mailbox; an INBOX mailbox's "
                                      "messages carry none", details={"field": "requirements"})
            reqs = coord.admission.prepare(session.space, op.requirements)  # None when empty: clears
        aging = (op.aging_ms or None) if op.aging_ms is not None else (q.aging_ms if q is not None else None)
        if weights is None:
            weights = q.weights if q is not None else None
        weights = weights or None
        if rates is None:
            rates = q.rate_limits if q is not None else None
        rates = rates or None
        if q is not None:
            recs: list = []
            if op.requirements is not None and reqs != q.requirements:
                recs.append(MailboxRequirementsSet(id=q.id, at_ms=coord.now_ms(), requirements=reqs))
            if aging != q.aging_ms or weights != q.weights or rates != q.rate_limits:
                recs.append(MailboxSchedulingSet(id=q.id, at_ms=coord.now_ms(), aging_ms=aging, weights=weights,
                                                 rate_limits=rates))
            if recs:
                coord.commit(recs)
            return self.queue_view(q)
        rec = MailboxCreated(
            id=op.id or coord.new_id("mbx", space=session.space), space=session.space, name=op.name, mode=mode,
            max_attempts=op.max_attempts, backlog_limit=op.backlog_limit, at_ms=coord.now_ms(), requirements=reqs,
            aging_ms=aging, weights=weights, rate_limits=rates,
        )
        coord.commit([rec])
        return self.queue_view(self.table[rec.id])

    def _check_adopt(self, space: str, op: MailboxEnsure) -> None:
        """A sharded cluster keeps one definition of a work queue on every shard, under
        the id its space's home shard gave it: an ensure without ``id`` belongs to the
        home shard (WRONG_SHARD elsewhere); with one (the router adopting it), it must
        be a queue id of the space's home slot. On a single node ``id`` is refused."""
        sh = self.coord.sharding
        if op.id is None:
            if sh is not None:
                sh.check(sh.home_slot(space), "a work queue's first ensure (its space's home slot)")
            return
        if sh is None:
            raise ValidationError("id is given only by a sharded cluster's router (adopting a queue); omit it",
                                  details={"field": "id"})
        if not is_id(op.id, "mbx") or slot_of(op.id) != sh.home_slot(space):
            raise ValidationError(f"id {short(op.id)} is not a work queue id of this space's home slot",
                                  details={"field": "id"})
        qid = self.by_name.get((space, op.name))
        if qid is not None and qid != op.id:
            raise ConflictError(f"mailbox {short(op.name)} exists here with another id ({qid}); it was made "
                                "without its home shard", details={"field": "id", "existing": qid})

    @op(MailboxGet, route=by("name", "route_queue"), permission=R, resend=ALWAYS, shard=ALL,
        merge="mailbox.read")
    def op_mailbox_get(self, actor, session, op: MailboxGet) -> MailboxView:
        return self.queue_view(self.get_queue(session.space, op.name))

    @op(MailboxList, route=SPACE, permission=R, resend=ALWAYS, shard=ALL, merge="mailbox.read")
    def op_mailbox_list(self, actor, session, op: MailboxList) -> MailboxListView:
        return MailboxListView(mailboxes=[self.queue_view(q) for q in self.table.values() if q.space == session.space])

    @op(MailboxMessages, route=by("name", "route_queue"), permission=R, resend=ALWAYS, shard=ALL,
        merge="mailbox.messages")
    def op_mailbox_messages(self, actor, session, op: MailboxMessages) -> TaskListView:
        """The queue's tasks (or messages), newest first: at most ``limit`` (1-1000),
        older than ``before`` (an id) when given. A diagnostic read: it walks the
        space's tasks from the newest (ids sort by creation)."""
        q = self.get_queue(session.space, op.name)
        check_range("limit", op.limit, 1, MAX_BATCH)
        out = []
        for t in reversed(self.tasks.values()):
            if t.mailbox_id != q.id or (op.before is not None and t.id >= op.before):
                continue
            out.append(self.task_view(t))
            if len(out) >= op.limit:
                break
        return TaskListView(tasks=out)

    def queue_view(self, q: MailboxState) -> MailboxView:
        queued, running = self.queue_counts.get(q.id, (0, 0))
        by_prio, by_key = self.ready_index.backlog(q.id)
        keys = sorted(by_key.items(), key=lambda kv: (-kv[1], kv[0] or ""))[:100]
        return MailboxView(
            id=q.id, name=q.name, mode=q.mode, max_attempts=q.max_attempts, backlog_limit=q.backlog_limit,
            created_at=to_iso(q.created_at_ms), queued=queued, running=running,
            requirements=self.coord.admission.describe(q.requirements),
            aging_ms=q.aging_ms, weights=dict(q.weights or {}), rate_limits=dict(q.rate_limits or {}),
            ready_by_priority={str(p): n for p, n in sorted(by_prio.items())},
            ready_by_key={(k or ""): n for k, n in keys},
        )

    @applies(MailboxCreated)
    def _apply_queue_created(self, r: MailboxCreated) -> None:
        q = MailboxState(id=r.id, space=r.space, name=r.name, mode=r.mode, max_attempts=r.max_attempts,
                         backlog_limit=r.backlog_limit, created_at_ms=r.at_ms, requirements=r.requirements,
                         aging_ms=r.aging_ms, weights=r.weights, rate_limits=r.rate_limits)
        self.table[q.id] = q
        self.by_name[(q.space, q.name)] = q.id
        self.coord.touch(q.id)

    @applies(MailboxSchedulingSet)
    def _apply_scheduling_set(self, r: MailboxSchedulingSet) -> None:
        """The queue's aging and weights change: its ready tasks are indexed again (the
        aging heaps, the keys' weights) -- not in replay (recovery rebuilds the index)."""
        q = self.table[r.id]
        q.aging_ms, q.weights, q.rate_limits = r.aging_ms, r.weights, r.rate_limits
        if q.rate_used and not q.rate_limits:
            q.rate_window = q.rate_used = None
        self.coord.touch(q.id)
        if not self.coord.replaying:
            self.ready_index.reindex_queue(q.id)

    @applies(MailboxRequirementsSet)
    def _apply_requirements_set(self, r: MailboxRequirementsSet) -> None:
        q = self.table[r.id]
        q.requirements = r.requirements
        self.coord.touch(q.id)

    def purge_run(self, run_id: str) -> int:
        """The run's tasks (all finished) and its index entries."""
        n = 0
        ids = self.run_tasks.get(run_id)
        if ids:
            tasks = self.tasks
            for tid in list(ids):
                t = tasks.get(tid)
                if t is not None:
                    n += self.purge_task(t)
        self.run_tasks.pop(run_id, None)
        self.run_counts.pop(run_id, None)
        self.run_unfinished.pop(run_id, None)
        self.ready_index.drop_run(run_id)
        return n

    def purge_task(self, t: TaskState) -> int:
        """Remove one finished task (and its own run's subtree, which ended with it).
        Returns the entities removed."""
        n = 0
        coord = self.coord
        if t.run_id is not None and t.run_id in coord.runs.table:
            n += coord.retention.purge_subtree(t.run_id)
        for k in coord.task_linked_kinds:  # what its deliveries held (grants, reservations)
            n += k.purge_task_links(t.id)
        del self.tasks[t.id]
        coord.limits.task_purged(t)
        if t.key is not None and self.task_keys.get((t.scope_id, t.mailbox_id, t.key)) == t.id:
            del self.task_keys[(t.scope_id, t.mailbox_id, t.key)]
        rt = self.run_tasks.get(t.scope_id)
        if rt is not None:
            rt.discard(t.id)
            if not rt:
                del self.run_tasks[t.scope_id]
        counts = self.run_counts.get(t.scope_id)
        if counts is not None:
            counts[t.state] -= 1
            if not counts[t.state]:
                del counts[t.state]
            if not counts:
                del self.run_counts[t.scope_id]
        sc = self.space_counts.get(t.space)
        if sc is not None:
            sc[t.state] -= 1
        if t.state not in TERMINAL:  # (never: only finished tasks are purged)
            self.ready_index.discard(t.id)
            self._lease_drop(t)
        self.coord.touch(t.id)
        return n + 1

    @emits(MailboxCreated)
    def _ev_queue_created(self, r: MailboxCreated):
        return ev(r.space, "mailbox.created", "mailbox", r.id, None, r.at_ms,
                  data(name=r.name, max_attempts=r.max_attempts, backlog_limit=r.backlog_limit,
                       requirements=self._requirements_data(r.requirements), aging_ms=r.aging_ms,
                       weights=r.weights, rate_limits=r.rate_limits))

    @emits(MailboxSchedulingSet)
    def _ev_scheduling_set(self, r: MailboxSchedulingSet):
        q = self.table[r.id]
        return ev(q.space, "mailbox.scheduling_set", "mailbox", q.id, None, r.at_ms,
                  {"name": q.name, "aging_ms": r.aging_ms, "weights": r.weights or {},
                   "rate_limits": r.rate_limits or {}})

    @emits(TaskPrioritySet)
    def _ev_priority_set(self, r: TaskPrioritySet):
        t = self.tasks[r.task_id]
        return ev(t.space, "task.priority_set", "task", t.id, t.scope_id, r.at_ms,
                  {"priority": r.priority, "fair_key": t.fair_key})

    @emits(MailboxRequirementsSet)
    def _ev_requirements_set(self, r: MailboxRequirementsSet):
        q = self.table[r.id]
        return ev(q.space, "mailbox.requirements_set", "mailbox", q.id, None, r.at_ms,
                  {"name": q.name, "requirements": self._requirements_data(r.requirements) or {}})

    def _requirements_data(self, stored: TaskRequirements | None) -> dict | None:
        """A mailbox's default requirements in an event: ``{pools: {name: units},
        budgets: {name: minor units}}`` (the empty fields left out), None when none."""
        view = self.coord.admission.describe(stored)
        if view is None:
            return None
        return {field: value for field, value in msgspec.structs.asdict(view).items() if value}

    @emits(TaskSubscribed, TaskDetached)
    def _ev_subscription(self, r):
        t = self.tasks[r.task_id]
        kind = "task.subscribed" if type(r) is TaskSubscribed else "task.detached"
        return ev(t.space, kind, "task", t.id, t.scope_id, r.at_ms, {"subscriber": r.subscriber_id})

    @emits(TaskSubmitted)
    def _ev_submitted(self, r: TaskSubmitted):
        d = _Submitted(self.table[r.mailbox_id].name, r.key, r.group_id, r.joinset_id,
                       None if r.deadline_ms is None else to_iso(r.deadline_ms), r.priority, r.fair_key)
        return ev(r.space, "task.submitted", "task", r.id, r.scope_id, r.at_ms, d)

    @emits(TaskDelivered)
    def _ev_delivered(self, r: TaskDelivered):
        t = self.tasks[r.task_id]
        # (never the token: it is the lease's secret)
        return ev(t.space, "task.delivered", "task", t.id, t.scope_id, r.at_ms, _Delivered(t.attempt, r.holder, t.priority, t.fair_key))

    @emits(TaskCompleted, TaskRunCompleted)
    def _ev_completed(self, r):
        t = self.tasks[r.task_id]
        return ev(t.space, "task.completed", "task", t.id, t.scope_id, r.at_ms, _Attempt(t.attempt))

    @emits(TaskCompleting)
    def _ev_completing(self, r: TaskCompleting):
        t = self.tasks[r.task_id]
        return ev(t.space, "task.completing", "task", t.id, t.scope_id, r.at_ms,
                  {"attempt": t.attempt, "run": t.run_id})

    @emits(TaskRetried)
    def _ev_retried(self, r: TaskRetried):
        t = self.tasks[r.task_id]
        if r.final:
            return ev(t.space, "task.failed", "task", t.id, t.scope_id, r.at_ms,
                      {"reason": "max_attempts", "attempt": t.attempt})
        return ev(t.space, "task.retried", "task", t.id, t.scope_id, r.at_ms, {"attempt": t.attempt})

    @emits(TaskReleased)
    def _ev_released(self, r: TaskReleased):
        t = self.tasks[r.task_id]
        return ev(t.space, "task.released", "task", t.id, t.scope_id, r.at_ms, {"attempt": t.attempt})

    @emits(TaskRejected)
    def _ev_rejected(self, r: TaskRejected):
        t = self.tasks[r.task_id]
        return ev(t.space, "task.failed", "task", t.id, t.scope_id, r.at_ms, {"reason": "rejected", "attempt": t.attempt})

    @emits(LeaseExpired)
    def _ev_lease_expired(self, r: LeaseExpired):
        t = self.tasks[r.task_id]
        if r.final:
            return ev(t.space, "task.failed", "task", t.id, t.scope_id, r.at_ms,
                      {"reason": "lease_expired", "attempt": t.attempt})
        return ev(t.space, "task.lease_expired", "task", t.id, t.scope_id, r.at_ms, {"attempt": t.attempt})

    @emits(TaskCancelled)
    def _ev_cancelled(self, r: TaskCancelled):
        t = self.tasks[r.task_id]  # (implied: called before the change; reads identity only)
        return ev(t.space, "task.cancelled", "task", t.id, t.scope_id, r.at_ms, {"reason": r.reason})

    @emits(TaskExpired)
    def _ev_expired(self, r: TaskExpired):
        t = self.tasks[r.task_id]
        return ev(t.space, "task.expired", "task", t.id, t.scope_id, r.at_ms, None)

    @emits(TaskRunCreated)
    def _ev_run_created(self, r: TaskRunCreated):
        t = self.tasks[r.task_id]
        return ev(t.space, "scope.created", "scope", r.run_id, r.run_id, r.at_ms,
                  {"parent": t.scope_id, "name": f"task:{t.id}", "task": t.id})

    @emits(LeasesExtended)
    def _ev_leases_extended(self, r: LeasesExtended):
        per_space: dict[str, int] = {}
        tasks = self.tasks
        for tid in self.leased:
            sp = tasks[tid].space
            per_space[sp] = per_space.get(sp, 0) + 1
        return [ev(sp, "leases.extended", "space", sp, None, r.at_ms, {"by_ms": r.by_ms, "reason": r.reason, "leases": n})
                for sp, n in sorted(per_space.items())]

    def rebuild_indexes(self) -> None:
        self._init_indexes()
        for q in self.table.values():
            self.by_name[(q.space, q.name)] = q.id
        for t in self.tasks.values():
            self._index_task(t)
            if t.seq >= self.next_seq:
                self.next_seq = t.seq + 1

    def rearm(self) -> None:
        coord = self.coord
        for t in self.tasks.values():
            if t.state in TERMINAL:
                continue
            if t.deadline_ms is not None:
                coord.arm_wall(t.deadline_ms, self._on_deadline, (t.id, t.deadline_ms))
            if t.state == "RUNNING" and not t.completing:
                coord.arm_mono(t.lease_expires_ms, self._on_lease, (t.id, t.token, t.lease_expires_ms))
            elif t.state == "QUEUED":
                self._make_ready(t)
