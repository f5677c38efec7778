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

import heapq
from typing import Any

import msgspec

from ..clock import to_iso
from ..errors import ConflictError, LeaseLostError, LimitError, NotFoundError, RallypointError, ValidationError
from ..ids import is_id, slot_of
from ..protocol import (
    NIL,
    DeliveryComplete,
    DeliveryCompleteMany,
    ItemError,
    SettledListView,
    SettledView,
    DeliveryReject,
    DeliveryRelease,
    DeliveryRenew,
    DeliveryRetry,
    DeliveryRun,
    DeliveryView,
    LeaseView,
    MailboxEnsure,
    MailboxGet,
    MailboxList,
    MailboxListView,
    MailboxMessages,
    MailboxView,
    Receive,
    ReceiveView,
    ScopeView,
    TaskCancel,
    TaskListView,
    TaskResult,
    TaskDetach,
    TaskResults,
    TaskOutcomeView,
    TaskStatus,
    TaskSubmit,
    TaskSubscribe,
    TaskSubmitMany,
    TaskView,
)
from ..records import (
    TaskRequirements,
    LeaseExpired,
    LeaseRenewed,
    LeasesExtended,
    MailboxCreated,
    MailboxRequirementsSet,
    TaskCancelled,
    TaskCompleted,
    TaskDelivered,
    TaskExpired,
    TaskRejected,
    TaskReleased,
    TaskRetried,
    TaskRunCompleted,
    TaskRunCreated,
    TaskCompleting,
    TaskDetached,
    TaskSubmitted,
    TaskSubscribed,
)
from ..events import emits, ev
from .common import (
    MAX_PAYLOAD_BYTES, REPLY_BUDGET_BYTES, applies, check_holder, check_key, check_name, check_payload, check_range,
    clamp_wait, data, did_you_mean, fit_count, parse_instant, short,
)
from .kind import Kind
from .opmark import ALL, ALWAYS, C, R, SPACE, W, asked, by, by_run, fenced, in_slots, keyed, op, resend_if
from .runtime import Park

__all__ = ["MailboxState", "TaskState", "WorkQueues", "TERMINAL", "MIN_LEASE_MS", "MAX_LEASE_MS"]

TERMINAL = frozenset({"SUCCEEDED", "ACKED", "FAILED", "CANCELLED", "EXPIRED"})
MODES = ("WORK", "INBOX")
#: The settings ``mailbox.ensure`` compares with an existing queue (those it was given).
_ENSURE_SETTINGS = ("mode", "max_attempts", "backlog_limit")
MIN_LEASE_MS = 5_000
MAX_LEASE_MS = 600_000
MAX_BATCH = 1000
#: A receive looks at most this many ready tasks whose requirements cannot be taken now
#: before it gives up for this request.
MAX_SKIPPED = 10_000
#: A receive for a run looks at the ready heaps of its subtree: by walking the subtree,
#: or by testing each run with ready work for ancestry, whichever touches fewer runs.
_NIL_BYTES = b"\xc0"
_RUN_REASON = {"cancelled": "scope_cancelled", "completed": "scope_completed", "deadline": "deadline"}

# Upper bounds of the encoded views, bytes, for sizing a reply before anything is
# committed (``common.REPLY_BUDGET_BYTES``): the fixed part (field names, ids of 30
# bytes, instants, ints, a mailbox name of at most 128 characters) plus each variable
# part (payloads as stored; a string at 4 bytes a character). tests/test_reply_size.py
# checks them against real encodings at their largest.
_DELIVERY_FIXED = 512
_GRANT_VIEW = 1024  # one pool grant of a delivery, its pool's name included
_RESERVATION_ID = 48
_TASK_VIEW_FIXED = 768
_OUTCOME_VIEW_FIXED = 128


def _text(s: str | None) -> int:
    return 4 * len(s) if s else 0


def delivery_bytes(t: "TaskState", q: "MailboxState", holder: str | None = None) -> int:
    """An upper bound of the encoded :class:`DeliveryView` of a delivery of ``t`` to
    ``holder``."""
    n = _DELIVERY_FIXED + len(q.name) + len(t.input) + _text(t.key) + _text(holder)
    req = t.requirements
    if req is not None:
        n += _GRANT_VIEW * len(req.pools) + _RESERVATION_ID * len(req.budgets)
    return n


def task_view_bytes(t: "TaskState") -> int:
    """An upper bound of the encoded :class:`TaskView` of ``t``."""
    n = (_TASK_VIEW_FIXED + len(t.input) + len(t.outcome or b"") + len(t.error or b"") + _text(t.key)
         + _text(t.outcome_reason) + _text(t.holder))
    if t.subscribers:
        n += sum(_text(x) + 8 for x in t.subscribers)
    return n


def outcome_view_bytes(t: "TaskState") -> int:
    """An upper bound of the encoded :class:`TaskOutcomeView` of ``t``."""
    return _OUTCOME_VIEW_FIXED + len(t.outcome or b"") + len(t.error or b"") + _text(t.outcome_reason)


class MailboxState(msgspec.Struct, gc=False, omit_defaults=True):
    """A work queue's configuration (what a snapshot stores). ``requirements``: its
    default requirements, resolved (pool / budget ids), given to every task submitted
    without its own; None: none (also in snapshots older than the field)."""

    id: str
    space: str
    name: str
    mode: str
    max_attempts: int
    backlog_limit: int | None
    created_at_ms: int
    requirements: TaskRequirements | None = None


class TaskState(msgspec.Struct, gc=False, omit_defaults=True):
    """What a snapshot stores of a task. ``token`` is the fencing token of the latest
    delivery (0: never delivered); ``attempt`` starts at 1 and grows on each retry or
    lease expiry. ``lease_expires_ms`` and ``available_at_ms`` are server time; the other
    instants are wall time. ``seq`` is its FIFO position."""

    id: str
    space: str
    mailbox_id: str
    scope_id: str
    input: bytes
    created_at_ms: int
    key: str | None = None
    deadline_ms: int | None = None
    state: str = "QUEUED"
    attempt: int = 1
    token: int = 0
    delivery_id: str | None = None
    lease_expires_ms: int = 0
    available_at_ms: int = 0
    outcome: bytes | None = None
    outcome_reason: str | None = None
    error: bytes | None = None
    finished_at_ms: int | None = None
    group_id: str | None = None
    joinset_id: str | None = None
    cancellable: bool = True
    seq: int = 0
    run_id: str | None = None  # the task's own run (``delivery.run``)
    completing: bool = False  # completed by its worker; its run's join sets are closing
    held_outcome: bytes | None = None  # the outcome, recorded once the run is done
    subscribers: list[str] | None = None  # task.subscribe (interest only; none cancels nothing)
    requirements: TaskRequirements | None = None
    work_limit_id: str | None = None
    holder: str | None = None  # who received the latest delivery (TaskDelivered.holder)


# Payloads of the hot task events: Structs without GC tracking (a dict per event is a
# GC allocation, which made the collector run twice as often); they encode as the same
# maps a dict would.
class _Submitted(msgspec.Struct, gc=False, omit_defaults=True):
    mailbox: str
    key: str | None = None
    group: str | None = None
    joinset: str | None = None
    deadline: str | None = None


class _Attempt(msgspec.Struct, gc=False):
    attempt: int


class _Delivered(msgspec.Struct, gc=False, omit_defaults=True):
    attempt: int
    holder: str | None = None


class WorkQueues(Kind):
    """Work queues and their tasks: ops, apply functions, indexes, lease/retry/deadline
    activities."""

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
        self.ready: dict[str, dict[str, list[tuple[int, str]]]] = {}  # queue -> run -> heap of (seq, id)
        self.ready_set: set[str] = set()
        self.leased: set[str] = set()  # RUNNING tasks (a completing one is no longer leased)
        self.run_leased: dict[str, set[str]] = {}  # run -> its leased tasks (ops.run's holders)
        self.queue_counts: dict[str, list[int]] = {}  # queue -> [queued, running]
        self.run_counts: dict[str, dict[str, int]] = {}  # run -> state -> tasks
        self.run_unfinished: dict[str, set[str]] = {}
        self.run_tasks: dict[str, set[str]] = {}  # run -> every task of it (retention)
        self.space_counts: dict[str, dict[str, int]] = {}
        self.queue_done: dict[str, int] = {}  # queue -> tasks finished since start (rates in `top`)

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

    # ================================================================ queues
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
        requirements)."""
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
        if q is not None:
            if op.requirements is not None and reqs != q.requirements:
                coord.commit([MailboxRequirementsSet(id=q.id, at_ms=coord.now_ms(), requirements=reqs)])
            return self.queue_view(q)
        rec = MailboxCreated(
            id=op.id or coord.new_id("mbx", space=session.space), space=session.space, name=op.name, mode=mode,
            max_attempts=op.max_attempts, backlog_limit=op.backlog_limit, at_ms=coord.now_ms(), requirements=reqs,
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
        return MailboxView(
            id=q.id, name=q.name, mode=q.mode, max_attempts=q.max_attempts, backlog_limit=q.backlog_limit,
            created_at=to_iso(q.created_at_ms), queued=queued, running=running,
            requirements=self.coord.admission.describe(q.requirements),
        )

    @applies(MailboxCreated)
    def _apply_queue_created(self, r: MailboxCreated) -> None:
        q = MailboxState(id=r.id, space=r.space, name=r.name, mode=r.mode, max_attempts=r.max_attempts,
                         backlog_limit=r.backlog_limit, created_at_ms=r.at_ms, requirements=r.requirements)
        self.table[q.id] = q
        self.by_name[(q.space, q.name)] = q.id
        self.coord.touch(q.id)

    @applies(MailboxRequirementsSet)
    def _apply_requirements_set(self, r: MailboxRequirementsSet) -> None:
        q = self.table[r.id]
        q.requirements = r.requirements
        self.coord.touch(q.id)

    # ================================================================ tasks: lookups
    def get_task(self, space: str, task_id) -> TaskState:
        t = self.tasks.get(task_id) if isinstance(task_id, str) else None
        if t is None or t.space != space:
            hint = self.coord.retention.not_found_hint(task_id) if t is None else ""
            raise NotFoundError(f"no task {short(task_id)} in this space{hint}", details={"task_id": task_id})
        return t

    def route_task(self, session, task_id) -> str:
        """The actor of a command about a task: its run's."""
        return self.get_task(session.space, task_id).scope_id

    def task_by_key(self, run_id: str, queue_id: str, key: str) -> TaskState | None:
        tid = self.task_keys.get((run_id, queue_id, key))
        return self.tasks[tid] if tid is not None else None

    # ================================================================ submit
    def prepare_submit(
        self,
        space: str,
        q: MailboxState,
        run_id: str,
        input_raw,
        key: str | None,
        deadline: str | None,
        *,
        field_prefix: str = "",
        pending: dict | None = None,
        extra_backlog: int = 0,
        extra_bytes: int = 0,
        requirements=None,
        work_limit=None,
        mode: str = "WORK",
        now: int | None = None,
        **extra,
    ) -> TaskSubmitted | TaskState:
        """Validate one submission. Returns the existing task for an idempotent
        resubmission (same key, same input), else the record to commit. ``mode``:
        WORK for a task, INBOX for a message (``msg_`` id, its payload named
        ``payload``). ``requirements``: the wire :class:`~rallypoint.protocol.Requirements`
        (resolved here); ``work_limit``: a resolved work limit, checked for
        ``extra_backlog + 1`` more unfinished tasks -- and the space's ``tasks``,
        ``stored`` and ``payload_bytes`` limits for them with ``extra_bytes`` more input
        (``rallypoint/limits.py``). ``now``: the step's wall instant
        (ms), given by a batch whose caller already checked that the run is active.

        A submission without requirements of its own (None, or empty) gets the queue's
        default requirements (``q.requirements``, already resolved), copied into its
        record: every path that makes a task comes through here (submit, batch items,
        group members, join-set children), so the rule is the same for all.

        Raises VALIDATION_FAILED (bad key, payload, deadline, requirements), CONFLICT (key
        reused with other input; a task to an INBOX queue or a message to a WORK queue),
        NOT_FOUND (a pool or budget of the requirements), SCOPE_CANCELLED /
        DEADLINE_EXCEEDED, LIMIT_EXCEEDED (backlog, work limit, the space's limits)."""
        if q.mode != mode:
            how = "send messages with mailbox.send()" if q.mode == "INBOX" else "submit tasks with mailbox.submit()"
            raise ConflictError(f"mailbox {q.name!r} is a {q.mode} mailbox: {how}",
                                details={"field": "mailbox", "mode": q.mode})
        data = bytes(input_raw)
        if len(data) > MAX_PAYLOAD_BYTES:  # (the field's name is only made for the error)
            check_payload(field_prefix + ("payload" if mode == "INBOX" else "input"), data)
        if key is not None:
            check_key(field_prefix + "key", key)
            k = (run_id, q.id, key)
            existing = pending.get(k) if pending is not None else None
            if existing is None:
                tid = self.task_keys.get(k)
                existing = self.tasks[tid] if tid is not None else None
            if existing is not None:
                if existing.input != data:
                    raise ConflictError(
                        f"{field_prefix}key {key!r} was already used in this run and mailbox with a different input",
                        details={"field": field_prefix + "key", "task_id": existing.id},
                    )
                return existing
        coord = self.coord
        if now is None:
            coord.runs.require_active(run_id)
            now = coord.now_ms()
        deadline_ms = parse_instant(field_prefix + "deadline", deadline) if deadline is not None else None
        if deadline_ms is not None and deadline_ms <= now:
            raise ValidationError(
                f"{field_prefix}deadline {deadline} is in the past", details={"field": field_prefix + "deadline"}
            )
        if q.backlog_limit is not None:
            queued, running = self.queue_counts.get(q.id, (0, 0))
            if queued + running + extra_backlog >= q.backlog_limit:
                raise LimitError(
                    f"mailbox {q.name!r} is full ({queued + running} unfinished tasks, backlog_limit "
                    f"{q.backlog_limit}); retry later",
                    retry_after=1.0,
                    details={"limit": q.backlog_limit},
                )
        reqs = coord.admission.prepare(space, requirements) if requirements is not None else None
        if reqs is None:
            reqs = q.requirements  # the queue's defaults (resolved at ensure; pools and budgets are never purged)
        if work_limit is not None:
            coord.admission.check_work_limit(work_limit, extra_backlog + 1)
        coord.limits.check_tasks(space, extra_backlog + 1, extra_bytes + len(data))
        seq = self.next_seq + extra_backlog
        return TaskSubmitted(
            id=coord.new_id("msg" if mode == "INBOX" else "tsk", under=run_id), space=space, mailbox_id=q.id, scope_id=run_id,
            input=data, at_ms=now, key=key, deadline_ms=deadline_ms, seq=seq, requirements=reqs,
            work_limit_id=work_limit.id if work_limit is not None else None, **extra,
        )

    @op(TaskSubmit, route=by_run(), permission=W,
        resend=keyed("key", "give the submission a `key` to make it safe to retry"))
    def op_task_submit(self, actor, session, op: TaskSubmit) -> TaskView:
        """One task; ``requirements`` and ``work_limit`` as in ``actors/admission.py``."""
        q = self.get_queue(session.space, op.mailbox)
        run = self.coord.runs.get(session.space, op.scope_id)
        wl = self.coord.admission.resolve_work_limit(run.id, op.work_limit) if op.work_limit is not None else None
        rec = self.prepare_submit(session.space, q, run.id, op.input, op.key, op.deadline,
                                  requirements=op.requirements, work_limit=wl)
        if isinstance(rec, TaskState):
            return self.task_view(rec)
        self.coord.commit([rec])
        return self.task_view(self.tasks[rec.id])

    @op(TaskSubmitMany, route=by_run(), permission=W,
        resend=resend_if(lambda op: all(i.key is not None for i in op.items), "every item has a key",
                         "give every item a `key` to make the batch safe to retry", ("items",)))
    def op_task_submit_many(self, actor, session, op: TaskSubmitMany) -> TaskListView:
        """All or nothing: every item is validated first, then one commit for all. The
        reply carries every task's id (``ids``) when their views (which echo each input)
        would not fit in one frame, and then the views of the leading ones that do
        (``tasks``; read the rest with ``task.results``)."""
        q = self.get_queue(session.space, op.mailbox)
        run = self.coord.runs.get(session.space, op.scope_id)
        if not 1 <= len(op.items) <= MAX_BATCH:
            raise ValidationError(f"items must hold 1 to {MAX_BATCH} submissions", details={"field": "items"})
        wl = self.coord.admission.resolve_work_limit(run.id, op.work_limit) if op.work_limit is not None else None
        recs: list = []
        ids: list[str] = []
        pending: dict = {}
        nbytes = 0  # the inputs of ``recs`` (the space's payload_bytes limit)
        # one instant for the step; the run is checked once (nothing below changes it)
        self.coord.runs.require_active(run.id)
        now = self.coord.now_ms()
        for i, item in enumerate(op.items):
            r = self.prepare_submit(
                session.space, q, run.id, item.input, item.key, item.deadline,
                field_prefix=f"items[{i}].", pending=pending, extra_backlog=len(recs), extra_bytes=nbytes,
                requirements=item.requirements, work_limit=wl, now=now,
            )
            if isinstance(r, TaskSubmitted) and not (r.key is not None and pending.get((run.id, q.id, r.key)) is r):
                recs.append(r)  # (a key repeated within the batch returns the pending record: add it once)
                nbytes += len(r.input)
                if r.key is not None:
                    pending[(run.id, q.id, r.key)] = r
            ids.append(r.id)
        if recs:
            self.coord.commit(recs)
        if op.brief:
            return TaskListView(ids=ids)
        tasks = [self.tasks[i] for i in ids]
        n = fit_count(map(task_view_bytes, tasks), REPLY_BUDGET_BYTES - 40 * len(ids))
        if n == len(tasks):
            return TaskListView(tasks=[self.task_view(t) for t in tasks])
        return TaskListView(ids=ids, tasks=[self.task_view(t) for t in tasks[:n]])

    @applies(TaskSubmitted)
    def _apply_submitted(self, r: TaskSubmitted) -> None:
        t = TaskState(
            id=r.id, space=r.space, mailbox_id=r.mailbox_id, scope_id=r.scope_id, input=r.input,
            created_at_ms=r.at_ms, key=r.key, deadline_ms=r.deadline_ms, group_id=r.group_id,
            joinset_id=r.joinset_id, cancellable=r.cancellable, seq=r.seq, requirements=r.requirements,
            work_limit_id=r.work_limit_id,
        )
        if r.seq >= self.next_seq:
            self.next_seq = r.seq + 1
        self.tasks[t.id] = t
        self._index_task(t)
        self.coord.limits.task_added(t)
        if r.requirements is not None or r.work_limit_id is not None:
            self.coord.admission.on_task_submitted(t)
        self.coord.touch(t.id)
        if t.joinset_id is not None:
            self.coord.joinsets.on_task_created(t)
        self._make_ready(t)
        if t.deadline_ms is not None:
            self.coord.arm_wall(t.deadline_ms, self._on_deadline, (t.id, t.deadline_ms))

    def _index_task(self, t: TaskState) -> None:
        if t.key is not None:
            self.task_keys[(t.scope_id, t.mailbox_id, t.key)] = t.id
        rt = self.run_tasks.get(t.scope_id)
        if rt is None:
            self.run_tasks[t.scope_id] = {t.id}
        else:
            rt.add(t.id)
        counts = self.run_counts.get(t.scope_id)
        if counts is None:
            counts = self.run_counts[t.scope_id] = {}
        counts[t.state] = counts.get(t.state, 0) + 1
        sc = self.space_counts.get(t.space)
        if sc is None:
            sc = self.space_counts[t.space] = {}
        sc[t.state] = sc.get(t.state, 0) + 1
        if t.state not in TERMINAL:
            self.run_unfinished.setdefault(t.scope_id, set()).add(t.id)
            qc = self.queue_counts.get(t.mailbox_id)
            if qc is None:
                qc = self.queue_counts[t.mailbox_id] = [0, 0]
            qc[0 if t.state == "QUEUED" else 1] += 1
            if t.state == "RUNNING" and not t.completing:
                self._lease_add(t)

    def _lease_add(self, t: TaskState) -> None:
        self.leased.add(t.id)
        s = self.run_leased.get(t.scope_id)
        if s is None:
            self.run_leased[t.scope_id] = {t.id}
        else:
            s.add(t.id)

    def _lease_drop(self, t: TaskState) -> None:
        self.leased.discard(t.id)
        s = self.run_leased.get(t.scope_id)
        if s is not None:
            s.discard(t.id)
            if not s:
                del self.run_leased[t.scope_id]

    def _set_state(self, t: TaskState, new: str, at_ms: int = 0) -> None:
        """Move ``t`` to ``new`` and keep every index and hook in step: counts, the
        leased set, result waiters, join sets and groups; a delivery that ends (leaving
        RUNNING) gives back what it took for the task's requirements (at ``at_ms``), and
        a task that finishes stops counting against its work limit."""
        old = t.state
        if old == new:
            return
        t.state = new
        counts = self.run_counts[t.scope_id]
        counts[old] -= 1
        if not counts[old]:
            del counts[old]
        counts[new] = counts.get(new, 0) + 1
        sc = self.space_counts[t.space]
        sc[old] -= 1
        sc[new] = sc.get(new, 0) + 1
        qc = self.queue_counts[t.mailbox_id]
        if old not in TERMINAL:
            qc[0 if old == "QUEUED" else 1] -= 1
        coord = self.coord
        if old == "RUNNING":
            self._lease_drop(t)
            # the delivery ended: reservations held for it close (settled or voided)
            coord.budgets.on_delivery_ended(t.id, t.token, new, t.finished_at_ms if new in TERMINAL else None)
        elif new == "RUNNING":
            self._lease_add(t)
        if old == "RUNNING" and t.requirements is not None:
            coord.admission.on_delivery_ended(t, new, at_ms)
        if new in TERMINAL:
            if old not in TERMINAL:
                coord.limits.task_finished(t)
                if coord.schedules.by_run:  # a scheduled action's task: its outcome (actors/schedule.py)
                    coord.schedules.note_task_end(t)
            if t.requirements is not None or t.work_limit_id is not None:
                coord.admission.on_task_terminal(t)
            s = self.run_unfinished.get(t.scope_id)
            if s is not None:
                s.discard(t.id)
                if not s:
                    del self.run_unfinished[t.scope_id]
            self.ready_set.discard(t.id)
            self.queue_done[t.mailbox_id] = self.queue_done.get(t.mailbox_id, 0) + 1
            coord.notify(t.scope_id, t.id)  # result waiters (on the task's run)
            if self.result_watch:
                watchers = self.result_watch.pop(t.id, None)
                if watchers:
                    for actor_id, key in watchers:  # waits for many tasks, maybe on another run
                        coord.notify(actor_id, key)
            if t.joinset_id is not None:
                coord.joinsets.on_task_terminal(t)
        else:
            qc[0 if new == "QUEUED" else 1] += 1
        if t.group_id is not None:
            coord.groups.member_changed(t.group_id)

    def finish(self, t: TaskState, state: str, at_ms: int, reason: str | None) -> None:
        """Make ``t`` terminal (``state``) with ``reason``; used by every kind that ends
        tasks (run cancellation, group finalization, join-set close).

        A task that owns a run and ends any other way than SUCCEEDED (reject, last retry,
        last lease expired, deadline, cancel -- also while completing) cancels that run
        first, in this same apply: everything under it is cancelled before the task's end
        is visible to anyone (its join set's record, its group, a result wait)."""
        if t.run_id is not None and state != "SUCCEEDED":
            t.completing = False
            t.held_outcome = None
            run = self.coord.runs.table[t.run_id]
            if run.state == "ACTIVE":
                self.coord.runs.end(run, "CANCELLED", at_ms, f"task {t.id} {state}", implied=True)
        t.finished_at_ms = at_ms
        t.outcome_reason = reason
        self._set_state(t, state, at_ms)
        coord = self.coord
        coord.touch(t.id)
        retention = coord.retention
        if retention.retain_ms is not None and t.group_id is None and t.joinset_id is None:
            retention.candidates.append((at_ms, t.id))

    # ================================================================ the ready queue
    def _make_ready(self, t: TaskState, *, due: bool = False) -> None:
        """Put a QUEUED task where receivers find it (or arm its retry delay)."""
        coord = self.coord
        if coord.replaying:
            return  # rearm() rebuilds the ready heaps after recovery
        if not due and t.available_at_ms > coord.mono_ms():
            coord.arm_mono(t.available_at_ms, self._on_ready, (t.id, t.available_at_ms))
            return
        if t.id in self.ready_set:
            return
        self.ready_set.add(t.id)
        per_run = self.ready.get(t.mailbox_id)
        if per_run is None:
            per_run = self.ready[t.mailbox_id] = {}
        heap = per_run.get(t.scope_id)
        if heap is None:
            per_run[t.scope_id] = [(t.seq, t.id)]
        else:
            heapq.heappush(heap, (t.seq, t.id))
        self.wake_receivers(t)

    def wake_receivers(self, t: TaskState) -> None:
        """Re-check the receives parked for ``t``'s queue on its run and every ancestor
        (each on its run's actor): ``t`` is ready, or what it requires came free."""
        coord = self.coord
        key = ("recv", t.mailbox_id)
        table = coord.runs.table
        notify = coord.notify
        s = table.get(t.scope_id)
        while s is not None:
            notify(s.id, key)
            s = table.get(s.parent_id) if s.parent_id else None

    def _on_ready(self, arg) -> None:
        task_id, available_at = arg
        t = self.tasks.get(task_id)
        if t is not None and t.state == "QUEUED" and t.available_at_ms == available_at:
            self._make_ready(t, due=True)

    def _candidate_heaps(self, queue_id: str, run_id: str) -> list[tuple[str, list]]:
        """(run id, ready heap) of ``run_id`` and its descendants in this queue: found
        by testing each run with ready work for ancestry when there are few such runs,
        else by walking the subtree."""
        per_run = self.ready.get(queue_id)
        if not per_run:
            return []
        runs = self.coord.runs
        if not runs.children.get(run_id):
            h = per_run.get(run_id)
            return [(run_id, h)] if h is not None else []
        if len(per_run) <= 64:
            return [(rid, h) for rid, h in per_run.items() if runs.is_descendant_or_self(rid, run_id)]
        out = []
        for rid in runs.subtree(run_id):
            h = per_run.get(rid)
            if h is not None:
                out.append((rid, h))
        return out

    def _pop_ready(self, queue_id: str, run_id: str, n: int, room: int | None = None,
                   size=None) -> list[TaskState]:
        """Pop up to ``n`` oldest *eligible* ready tasks of the run and its descendants.
        A task with requirements is eligible only if all of them can be taken now,
        together with those of the tasks popped before it in this call (all or
        nothing, counted in one ``pending`` for the step); the others are skipped and put
        back, first in line for the next receive (at most :data:`MAX_SKIPPED` are looked
        at past). With ``room`` (bytes) and ``size(task)`` (an upper bound of what the
        task adds to the reply), popping stops before the first task that would not fit
        (it stays first in line; the first task is always taken). Stale heap entries
        (tasks no longer ready) are dropped on the way; heaps left empty are removed so
        a queue's index only holds runs with ready work."""
        cands = self._candidate_heaps(queue_id, run_id)
        out: list[TaskState] = []
        tasks, ready_set = self.tasks, self.ready_set
        heappop = heapq.heappop
        skipped: list = []
        pending: dict = {}
        admission = self.coord.admission
        while len(out) < n:
            best = None
            for _rid, h in cands:
                while h and (h[0][1] not in ready_set):
                    heappop(h)
                if h and (best is None or h[0] < best[0]):
                    best = h
            if best is None:
                break
            entry = heappop(best)
            t = tasks[entry[1]]
            if room is not None:
                need = size(t)
                if need > room and out:  # the reply is full: it stays first in line
                    heapq.heappush(best, entry)
                    break
            if t.requirements is not None and not admission.try_take(t, pending):
                admission.skipped(t, pending)  # it keeps its place for what it is short of
                skipped.append((entry, best))
                if len(skipped) >= MAX_SKIPPED:
                    break
                continue
            ready_set.discard(t.id)
            out.append(t)
            if room is not None:
                room -= need
        for entry, h in skipped:
            heapq.heappush(h, entry)
        per_run = self.ready.get(queue_id)
        if per_run is not None:
            for rid, h in cands:
                if not h:
                    per_run.pop(rid, None)
        return out

    # ================================================================ receive
    @op(Receive, route=by_run(), permission=W, resend=ALWAYS, waits=asked("wait_ms"), reply=ReceiveView)
    def op_receive(self, actor, session, op: Receive):
        """Lease up to ``max_messages`` of the oldest ready tasks of the run's subtree --
        as many as one reply carries (``REPLY_BUDGET_BYTES``: never more leased than can
        be sent; the rest stays first in line) --; parks on the run's actor for up to
        ``wait_ms`` when there are none. Each delivery records its holder: ``op.holder``,
        else the session's ``client@peer`` (VALIDATION_FAILED: a holder not 1-128
        characters)."""
        check_holder(op.holder)
        holder = op.holder or session.holder
        q = self.get_queue(session.space, op.mailbox)
        run = self.coord.runs.get(session.space, op.scope_id)
        check_range("lease_ms", op.lease_ms, MIN_LEASE_MS, MAX_LEASE_MS, " ms")
        check_range("max_messages", op.max_messages, 1, 100)
        wait_ms = clamp_wait(op.wait_ms)
        runs = self.coord.runs
        runs.require_active(run.id)
        got = self._deliver(q, run.id, op.lease_ms, op.max_messages, holder)
        if got or wait_ms == 0:
            return ReceiveView(deliveries=got)

        def check():
            runs.require_active(run.id)
            got = self._deliver(q, run.id, op.lease_ms, op.max_messages, holder)
            return ReceiveView(deliveries=got) if got else None

        return Park(("recv", q.id), check, wait_ms, lambda: ReceiveView(deliveries=[]))

    def _deliver(self, q: MailboxState, run_id: str, lease_ms: int, n: int,
                 holder: str | None = None) -> list[DeliveryView]:
        self.coord.journal.check_writable()  # before the pop: a refused commit must not drop tasks
        picked = self._pop_ready(q.id, run_id, n, REPLY_BUDGET_BYTES, lambda t: delivery_bytes(t, q, holder))
        if not picked:
            return []
        coord = self.coord
        now = coord.now_ms()
        expires = coord.mono_ms() + lease_ms
        new_id = coord.new_id
        recs = [
            TaskDelivered(task_id=t.id, delivery_id=new_id("dlv", under=t.id), token=t.token + 1, lease_expires_ms=expires,
                          at_ms=now, holder=holder)
            for t in picked
        ]
        for t in picked:
            if t.requirements is not None:  # the take, in the same commit as the delivery
                recs.extend(coord.admission.take_records(t, now))
        coord.commit(recs)
        expires_at = to_iso(coord.clock.mono_to_wall(expires))  # the same for the whole batch
        return [self.delivery_view(t, q, expires_at) for t in picked]

    def delivery_view(self, t: TaskState, q: MailboxState | None = None, expires_at: str | None = None) -> DeliveryView:
        q = q or self.table[t.mailbox_id]
        return DeliveryView(
            id=t.delivery_id or "",
            task_id=t.id,
            mailbox=q.name,
            scope_id=t.scope_id,
            input=msgspec.Raw(t.input),
            attempt=t.attempt,
            token=t.token,
            lease_expires_at=expires_at or to_iso(self.coord.clock.mono_to_wall(t.lease_expires_ms)),
            group_id=t.group_id,
            run_id=t.run_id,
            key=t.key,
            **(self.coord.admission.views(t) if t.requirements is not None else {}),
            holder=t.holder,
        )

    @applies(TaskDelivered)
    def _apply_delivered(self, r: TaskDelivered) -> None:
        t = self.tasks[r.task_id]
        t.token = r.token
        t.delivery_id = r.delivery_id
        t.holder = r.holder
        t.lease_expires_ms = r.lease_expires_ms
        t.available_at_ms = 0
        self.ready_set.discard(t.id)
        self._set_state(t, "RUNNING")
        coord = self.coord
        coord.touch(t.id)
        if coord.replaying:
            return  # rearm() arms the leases after recovery
        # The deliveries of one commit with the same expiry (a receive's batch) share ONE
        # activity entry: arming and compacting cost per receive, not per delivery.
        ob = self._lease_open
        if ob is not None and ob[0] == coord.commits and ob[1] == r.lease_expires_ms:
            ob[2].append(t.id)
            return
        ids = [t.id]
        self._lease_open = (coord.commits, r.lease_expires_ms, ids)
        coord.arm_mono(r.lease_expires_ms, self._on_leases, (r.lease_expires_ms, ids))

    # ================================================================ settle
    def _holder(self, session, task_id, token: int) -> TaskState:
        t = self.get_task(session.space, task_id)
        if t.token != token or token <= 0:
            raise LeaseLostError(
                f"token {token} is not the current lease on task {t.id} (current {t.token}); "
                "another worker has taken it over, or it was never yours",
                details={"task_id": t.id, "token": t.token},
            )
        return t

    def _lease_live(self, t: TaskState) -> bool:
        return t.state == "RUNNING" and not t.completing and t.lease_expires_ms > self.coord.mono_ms()

    def _lost(self, t: TaskState) -> LeaseLostError:
        if t.completing:
            why = "its worker completed it (the outcome is held until the task's run is done)"
        elif t.state in ("RUNNING", "QUEUED"):
            why = "its lease expired"
        else:
            why = f"the task is {t.state}"
        return LeaseLostError(f"the lease on task {t.id} is lost: {why}",
                              details={"task_id": t.id, "state": t.state, "completing": t.completing})

    @op(DeliveryRenew, route=by("task_id", "route_task"), permission=W, resend=ALWAYS)
    def op_delivery_renew(self, actor, session, op: DeliveryRenew) -> LeaseView:
        """Extend the lease by ``lease_ms`` from now. STALE_CLAIM when the token is not
        current or the lease ran out; SCOPE_CANCELLED / DEADLINE_EXCEEDED when the run
        stopped (the holder must stop)."""
        t = self._holder(session, op.task_id, op.token)
        check_range("lease_ms", op.lease_ms, MIN_LEASE_MS, MAX_LEASE_MS, " ms")
        self.coord.runs.require_active(t.scope_id)
        if not self._lease_live(t):
            raise self._lost(t)
        expires = self.coord.mono_ms() + op.lease_ms
        self.coord.commit([LeaseRenewed(task_id=t.id, token=t.token, lease_expires_ms=expires)])
        return LeaseView(task_id=t.id, token=t.token,
                         lease_expires_at=to_iso(self.coord.clock.mono_to_wall(expires)))

    @applies(LeaseRenewed)
    def _apply_renewed(self, r: LeaseRenewed) -> None:
        t = self.tasks[r.task_id]
        t.lease_expires_ms = r.lease_expires_ms
        self.coord.touch(t.id)
        self.coord.arm_mono(r.lease_expires_ms, self._on_lease, (t.id, r.token, r.lease_expires_ms))

    @applies(LeasesExtended)
    def _apply_leases_extended(self, r: LeasesExtended) -> None:
        """Every kind's outstanding leases (and durable waiters' time limits) end
        ``by_ms`` later: deliveries here, claims, pool grants... (``Kind.extend_leases``)."""
        for k in self.coord.kinds:
            k.extend_leases(r.by_ms)

    def extend_leases(self, by_ms: int) -> None:
        for tid in sorted(self.leased):
            t = self.tasks[tid]
            t.lease_expires_ms += by_ms
            self.coord.touch(t.id)
            self.coord.arm_mono(t.lease_expires_ms, self._on_lease, (t.id, t.token, t.lease_expires_ms))

    @op(DeliveryComplete, route=by("task_id", "route_task"), permission=W, resend=fenced("task_settled"))
    def op_delivery_complete(self, actor, session, op: DeliveryComplete) -> TaskView:
        """Record the outcome (exactly once). STALE_CLAIM for a stale token, a lost lease
        or a task past its deadline; SCOPE_CANCELLED / DEADLINE_EXCEEDED on a stopped run.

        A task that owns a run (``delivery.run``) is completed in two steps, like
        ``run.complete()``: ``TaskCompleting`` holds the outcome and closes the run's
        open join sets (newest first: cancellable children cancelled in reverse
        submission order, non-cancellable ones awaited); once none is open -- in this
        same commit or when the last awaited child finishes -- ``TaskRunCompleted``
        completes the run and records the outcome (SUCCEEDED). Until then the reply and
        the task say RUNNING with ``completing``; the same complete again is answered
        the same way (another outcome is STALE_CLAIM)."""
        t, recs = self._complete_records(session, op.task_id, op.token, op.outcome, self.coord.now_ms())
        if recs:
            self.coord.commit(recs)
        return self.task_view(t)

    def _complete_records(self, session, task_id, token: int, outcome_raw, now: int,
                          field: str = "outcome") -> tuple[TaskState, list]:
        """The records that complete ``task_id`` (none for a re-sent complete of a
        completing task). Raises as :meth:`op_delivery_complete` does."""
        t = self._holder(session, task_id, token)
        outcome = check_payload(field, outcome_raw)
        if t.completing and t.held_outcome == outcome:
            return t, []  # a re-sent complete
        coord = self.coord
        coord.runs.require_active(t.scope_id)
        if not self._lease_live(t):
            raise self._lost(t)
        if t.run_id is None:
            return t, [TaskCompleted(task_id=t.id, token=t.token, outcome=outcome, at_ms=now)]
        return t, [
            TaskCompleting(task_id=t.id, token=t.token, outcome=outcome, at_ms=now),
            *coord.joinsets.close_records_for_complete(t.run_id, now),
        ]

    def route_complete_many(self, session, items) -> str:
        """The actor of a batch of completes: the first task's run (every item must be
        a task of that run: its commands run on its run's actor). VALIDATION_FAILED for 0
        or more than 1000 items."""
        if not isinstance(items, list) or not 1 <= len(items) <= MAX_BATCH:
            raise ValidationError(f"items must hold 1 to {MAX_BATCH} completes", details={"field": "items"})
        return self.get_task(session.space, items[0].task_id).scope_id

    @op(DeliveryCompleteMany, route=by("items", "route_complete_many"), permission=W, resend=fenced("tasks_settled"),
        shard=in_slots("items"))
    def op_delivery_complete_many(self, actor, session, op: DeliveryCompleteMany) -> SettledListView:
        """Complete several deliveries of one run in ONE commit: each item is judged as
        ``delivery.complete`` judges it (its refusal is its answer, and changes nothing);
        the accepted ones are recorded together. An item naming a task of another run is
        VALIDATION_FAILED (send one batch per run); the same task twice in one batch: the
        second is STALE_CLAIM. Not ``brief``: an accepted item carries its task's view
        while they fit in one frame (``REPLY_BUDGET_BYTES``); the accepted items past that
        are answered as ``brief`` ones (no view, no error: read them with
        ``task.results``), so the reply never outgrows the frame that must carry it."""
        coord = self.coord
        run_id = self.get_task(session.space, op.items[0].task_id).scope_id
        now = coord.now_ms()
        recs: list = []
        answers: list = []
        seen: set[str] = set()
        for i, it in enumerate(op.items):
            try:
                t = self.get_task(session.space, it.task_id)
                if t.scope_id != run_id:
                    raise ValidationError(
                        f"items[{i}]: task {t.id} is in run {t.scope_id}, not {run_id}: send one batch per run",
                        details={"field": f"items[{i}].task_id"},
                    )
                if t.id in seen:
                    raise LeaseLostError(f"task {t.id} is completed earlier in this batch",
                                         details={"task_id": t.id, "state": t.state})
                t, more = self._complete_records(session, it.task_id, it.token, it.outcome, now,
                                                 f"items[{i}].outcome")
                seen.add(t.id)
                recs.extend(more)
                answers.append(t)
            except RallypointError as e:
                answers.append(e)
        if recs:
            coord.commit(recs)
        view = self.task_view
        ok = SettledView()
        if op.brief:
            return SettledListView(items=[ok if isinstance(a, TaskState) else SettledView(error=ItemError(
                code=a.code, message=a.message, retry_after=a.retry_after,
                details=a.details if isinstance(a.details, dict) or a.details is None else {"value": a.details}))
                for a in answers])
        # the views of the leading accepted items that fit next to every item's answer
        # (a refusal is a code, a line and small details: 512 bytes is generous)
        accepted = [a for a in answers if isinstance(a, TaskState)]
        room = REPLY_BUDGET_BYTES - 32 * len(answers) - 512 * (len(answers) - len(accepted))
        with_view = set(map(id, accepted[:fit_count(map(task_view_bytes, accepted), room)]))
        return SettledListView(items=[
            (SettledView(task=view(a)) if id(a) in with_view else ok) if isinstance(a, TaskState)
            else SettledView(error=ItemError(
                code=a.code, message=a.message, retry_after=a.retry_after,
                details=a.details if isinstance(a.details, dict) or a.details is None else {"value": a.details}))
            for a in answers
        ])

    @applies(TaskCompleting)
    def _apply_completing(self, r: TaskCompleting) -> None:
        t = self.tasks[r.task_id]
        t.completing = True
        t.held_outcome = r.outcome
        self._lease_drop(t)  # no lease counts any more: nothing to take over
        if t.requirements is not None:  # its worker is done: what its delivery took goes back now
            # (for its requirements it succeeded: pool units return, budget reservations settle)
            self.coord.admission.on_delivery_ended(t, "SUCCEEDED", r.at_ms)
        self.coord.touch(t.id)
        self.check_completion(t.id)

    def check_completion(self, task_id: str) -> None:
        """A completing task's run may have no open join set left: decide it as a
        reaction of the current commit (not in replay: the follow-up is journaled)."""
        if not self.coord.replaying:
            self.to_check.add(task_id)

    def react(self) -> list:
        """Follow-up records for the current commit: ``TaskRunCompleted`` for every
        completing task whose run has no open join set left."""
        if not self.to_check:
            return []
        todo, self.to_check = self.to_check, set()
        more = []
        joinsets = self.coord.joinsets
        for tid in sorted(todo):
            t = self.tasks[tid]
            if t.completing and t.state == "RUNNING" and joinsets.open_count(t.run_id) == 0:
                more.append(TaskRunCompleted(task_id=tid, at_ms=self.coord.now_ms()))
        return more

    @applies(TaskRunCompleted)
    def _apply_run_completed(self, r: TaskRunCompleted) -> None:
        t = self.tasks[r.task_id]
        run = self.coord.runs.table[t.run_id]
        if run.state == "ACTIVE":
            # whatever the run holds beyond its (closed) join sets is cancelled here
            self.coord.runs.end(run, "COMPLETED", r.at_ms, f"task {t.id} completed", implied=True)
        t.outcome, t.held_outcome, t.completing = t.held_outcome, None, False
        self.finish(t, "SUCCEEDED", r.at_ms, "completed")

    # ================================================================ the task's own run
    @op(DeliveryRun, route=by("task_id", "route_task"), permission=W, resend=ALWAYS, reply=ScopeView)
    def op_delivery_run(self, actor, session, op: DeliveryRun):
        """The task's own run, made on first use (a child of the task's run, named
        ``task:<id>``); the same run for every later call and attempt. The holder of the
        current lease only: STALE_CLAIM otherwise (or once completing); SCOPE_CANCELLED /
        DEADLINE_EXCEEDED when the task's run is inactive; LIMIT_EXCEEDED past its
        child_limit."""
        t = self._holder(session, op.task_id, op.token)
        if self.table[t.mailbox_id].mode == "INBOX":
            raise ConflictError(f"{t.id} is a message: only tasks have runs of their own",
                                details={"task_id": t.id})
        runs = self.coord.runs
        if t.run_id is not None and t.state == "RUNNING":
            return runs.view(runs.table[t.run_id])
        runs.require_active(t.scope_id)
        if not self._lease_live(t):
            raise self._lost(t)
        runs.check_child_limit(runs.table[t.scope_id], "; the task's own run would exceed it")
        self.coord.limits.check_runs(t.space)
        rec = TaskRunCreated(task_id=t.id, run_id=self.coord.new_id("scp", under=t.id), at_ms=self.coord.now_ms())
        self.coord.commit([rec])
        return runs.view(runs.table[rec.run_id])

    @applies(TaskRunCreated)
    def _apply_run_created(self, r: TaskRunCreated) -> None:
        from .run import ScopeState

        t = self.tasks[r.task_id]
        t.run_id = r.run_id
        self.coord.runs.add(ScopeState(
            id=r.run_id, space=t.space, parent_id=t.scope_id, name=f"task:{t.id}", deadline_ms=None,
            child_limit=1000, created_at_ms=r.at_ms, task_id=t.id,
        ))
        self.coord.touch(t.id)

    @applies(TaskCompleted)
    def _apply_completed(self, r: TaskCompleted) -> None:
        t = self.tasks[r.task_id]
        t.outcome = r.outcome
        self.finish(t, "ACKED" if self.table[t.mailbox_id].mode == "INBOX" else "SUCCEEDED", r.at_ms, "completed")

    def _settle_inactive(self, t: TaskState) -> bool:
        """Retry/reject on an inactive run are answered without a change (SPEC §2.4)."""
        return t.state in TERMINAL or self.coord.runs.inactive_error(t.scope_id) is not None

    @op(DeliveryRetry, route=by("task_id", "route_task"), permission=W, resend=fenced("task_requeued"))
    def op_delivery_retry(self, actor, session, op: DeliveryRetry) -> TaskView:
        """Back to the queue after ``delay_ms`` (server time), or FAILED once
        ``max_attempts`` attempts were made. Allowed (a no-op) on a stopped run."""
        t = self._holder(session, op.task_id, op.token)
        error = check_payload("error", op.error)
        check_range("delay_ms", op.delay_ms, 0, 7 * 24 * 3600 * 1000, " ms")
        if self._settle_inactive(t):
            return self.task_view(t)
        if not self._lease_live(t):
            raise self._lost(t)
        coord = self.coord
        final = t.attempt >= self.table[t.mailbox_id].max_attempts
        mono = coord.mono_ms()
        coord.commit([
            TaskRetried(
                task_id=t.id, token=t.token, at_ms=coord.now_ms(),
                available_at_ms=mono + op.delay_ms if op.delay_ms > 0 else 0,
                error=None if error == _NIL_BYTES else error, final=final,
            )
        ])
        return self.task_view(t)

    @applies(TaskRetried)
    def _apply_retried(self, r: TaskRetried) -> None:
        t = self.tasks[r.task_id]
        t.error = r.error
        if r.final:
            self.finish(t, "FAILED", r.at_ms, "max_attempts")
            return
        t.attempt += 1
        t.available_at_ms = r.available_at_ms
        self._set_state(t, "QUEUED", r.at_ms)
        self.coord.touch(t.id)
        self._make_ready(t)

    @op(DeliveryReject, route=by("task_id", "route_task"), permission=W, resend=ALWAYS)
    def op_delivery_reject(self, actor, session, op: DeliveryReject) -> TaskView:
        """FAILED, no retry. Allowed (a no-op) on a stopped run."""
        t = self._holder(session, op.task_id, op.token)
        error = check_payload("error", op.error)
        if self._settle_inactive(t):
            return self.task_view(t)
        if not self._lease_live(t):
            raise self._lost(t)
        self.coord.commit([
            TaskRejected(task_id=t.id, token=t.token, at_ms=self.coord.now_ms(),
                         error=None if error == _NIL_BYTES else error)
        ])
        return self.task_view(t)

    @applies(TaskRejected)
    def _apply_rejected(self, r: TaskRejected) -> None:
        t = self.tasks[r.task_id]
        t.error = r.error
        self.finish(t, "FAILED", r.at_ms, "rejected")

    @op(DeliveryRelease, route=by("task_id", "route_task"), permission=W, resend=fenced("task_requeued"))
    def op_delivery_release(self, actor, session, op: DeliveryRelease) -> TaskView:
        """Give the task back unfinished without counting an attempt (a worker that is
        stopping hands back what it holds): QUEUED at once, at its FIFO place, with the
        same ``attempt`` (``TaskReleased``). STALE_CLAIM for a stale token or a lost
        lease. Allowed (a no-op) on a stopped run, like retry and reject (SPEC §2.4)."""
        t = self._holder(session, op.task_id, op.token)
        if self._settle_inactive(t):
            return self.task_view(t)
        if not self._lease_live(t):
            raise self._lost(t)
        self.coord.commit([TaskReleased(task_id=t.id, token=t.token, at_ms=self.coord.now_ms())])
        return self.task_view(t)

    @applies(TaskReleased)
    def _apply_released(self, r: TaskReleased) -> None:
        t = self.tasks[r.task_id]
        t.available_at_ms = 0
        self._set_state(t, "QUEUED", r.at_ms)
        self.coord.touch(t.id)
        self._make_ready(t)

    # ================================================================ status, result, cancel
    @op(TaskStatus, route=by("task_id", "route_task"), permission=R, resend=ALWAYS)
    def op_task_status(self, actor, session, op: TaskStatus) -> TaskView:
        return self.task_view(self.get_task(session.space, op.task_id))

    @op(TaskResult, route=by("task_id", "route_task"), permission=R, resend=ALWAYS, waits=asked("wait_ms"),
        reply=TaskView)
    def op_task_result(self, actor, session, op: TaskResult):
        """The task, once terminal; parks on its run's actor up to ``wait_ms``."""
        t = self.get_task(session.space, op.task_id)
        wait_ms = clamp_wait(op.wait_ms)
        if t.state in TERMINAL or wait_ms == 0:
            return self.task_view(t)
        view = self.task_view
        return Park(t.id, lambda: view(t) if t.state in TERMINAL else None, wait_ms, lambda: view(t))

    def route_tasks(self, session, task_ids) -> str:
        """The actor of a wait for many tasks: the first task's run (the others'
        changes reach it through ``result_watch``). VALIDATION_FAILED for 0 or more than
        1000 ids; NOT_FOUND for an unknown one."""
        if not isinstance(task_ids, list) or not 1 <= len(task_ids) <= MAX_BATCH:
            raise ValidationError(f"task_ids must hold 1 to {MAX_BATCH} ids", details={"field": "task_ids"})
        first = None
        for tid in task_ids:
            t = self.get_task(session.space, tid)
            if first is None:
                first = t
        return first.scope_id

    @op(TaskResults, route=by("task_ids", "route_tasks"), permission=R, resend=ALWAYS, waits=asked("wait_ms"),
        shard=in_slots("task_ids"),
        reply=TaskListView)
    def op_task_results(self, actor, session, op: TaskResults):
        """Every task, once all are terminal (in the given order); ONE parked wait on the
        first task's run for up to ``wait_ms``, woken as each of them finishes (the
        tasks may be in several runs).

        A page: the reply lists the leading tasks that fit in one frame
        (``REPLY_BUDGET_BYTES``; at least one) -- all of them unless their outcomes (or
        views) are large; ask again for the rest (``wait_ms=0``: the wait is over)."""
        tasks = [self.get_task(session.space, tid) for tid in op.task_ids]
        wait_ms = clamp_wait(op.wait_ms)
        view = self.task_view
        if op.brief:
            def answer() -> TaskListView:
                page = tasks[:fit_count(map(outcome_view_bytes, tasks))]
                return TaskListView(outcomes=[
                    TaskOutcomeView(t.id, t.state, t.attempt, msgspec.Raw(t.outcome) if t.outcome is not None else NIL,
                                    t.outcome_reason, msgspec.Raw(t.error) if t.error is not None else NIL)
                    for t in page])
        else:
            def answer() -> TaskListView:
                return TaskListView(tasks=[view(t) for t in tasks[:fit_count(map(task_view_bytes, tasks))]])
        pending = [t for t in tasks if t.state not in TERMINAL]
        if not pending or wait_ms == 0:
            return answer()
        key = ("results", id(pending))
        watch = self.result_watch
        entry = (actor.id if actor is not None else tasks[0].scope_id, key)
        for t in pending:
            watch.setdefault(t.id, []).append(entry)

        def unwatch() -> None:
            for t in pending:
                lst = watch.get(t.id)
                if lst is not None:
                    try:
                        lst.remove(entry)
                    except ValueError:
                        pass
                    if not lst:
                        del watch[t.id]

        def check():
            while pending and pending[-1].state in TERMINAL:
                pending.pop()
            if any(t.state not in TERMINAL for t in pending):
                return None
            unwatch()
            return answer()

        def expire():
            unwatch()
            return answer()

        return Park(key, check, wait_ms, expire)

    @op(TaskCancel, route=by("task_id", "route_task"), permission=W, resend=ALWAYS)
    def op_task_cancel(self, actor, session, op: TaskCancel) -> TaskView:
        t = self.get_task(session.space, op.task_id)
        if t.state not in TERMINAL:
            self.coord.commit([TaskCancelled(task_id=t.id, at_ms=self.coord.now_ms())])
        return self.task_view(t)

    @op(TaskSubscribe, route=by("task_id", "route_task"), permission=W, resend=ALWAYS)
    def op_task_subscribe(self, actor, session, op: TaskSubscribe) -> TaskView:
        """Subscribe ``subscriber_id`` (idempotent); the subscriber's run ``scope_id``, when
        given, must be active. VALIDATION_FAILED (id), NOT_FOUND (task, run)."""
        t = self.get_task(session.space, op.task_id)
        check_key("subscriber_id", op.subscriber_id)
        if op.subscriber_id is None:
            raise ValidationError("subscriber_id is required", details={"field": "subscriber_id"})
        if op.scope_id is not None:
            self.coord.runs.require_active(self.coord.runs.get(session.space, op.scope_id).id)
        if op.subscriber_id not in (t.subscribers or ()):
            self.coord.commit([TaskSubscribed(task_id=t.id, subscriber_id=op.subscriber_id,
                                              at_ms=self.coord.now_ms())])
        return self.task_view(t)

    @applies(TaskSubscribed)
    def _apply_subscribed(self, r: TaskSubscribed) -> None:
        t = self.tasks[r.task_id]
        t.subscribers = [*(t.subscribers or ()), r.subscriber_id]
        self.coord.touch(t.id)

    @op(TaskDetach, route=by("task_id", "route_task"), permission=W, resend=ALWAYS)
    def op_task_detach(self, actor, session, op: TaskDetach) -> TaskView:
        """Unsubscribe (idempotent); the task goes on whoever is left."""
        t = self.get_task(session.space, op.task_id)
        if op.subscriber_id in (t.subscribers or ()):
            self.coord.commit([TaskDetached(task_id=t.id, subscriber_id=op.subscriber_id,
                                            at_ms=self.coord.now_ms())])
        return self.task_view(t)

    @applies(TaskDetached)
    def _apply_detached(self, r: TaskDetached) -> None:
        t = self.tasks[r.task_id]
        t.subscribers = [s for s in (t.subscribers or ()) if s != r.subscriber_id] or None
        self.coord.touch(t.id)

    @applies(TaskCancelled)
    def _apply_cancelled(self, r: TaskCancelled) -> None:
        self.finish(self.tasks[r.task_id], "CANCELLED", r.at_ms, r.reason)

    @applies(TaskExpired)
    def _apply_expired(self, r: TaskExpired) -> None:
        self.finish(self.tasks[r.task_id], "EXPIRED", r.at_ms, "deadline")

    @applies(LeaseExpired)
    def _apply_lease_expired(self, r: LeaseExpired) -> None:
        t = self.tasks[r.task_id]
        if r.final:
            self.finish(t, "FAILED", r.at_ms, "lease_expired")
            return
        t.attempt += 1
        t.available_at_ms = 0
        self._set_state(t, "QUEUED", r.at_ms)
        self.coord.touch(t.id)
        self._make_ready(t)

    def task_view(self, t: TaskState) -> TaskView:
        return TaskView(
            id=t.id,
            mailbox=self.table[t.mailbox_id].name,
            scope_id=t.scope_id,
            state=t.state,
            attempt=t.attempt,
            key=t.key,
            input=msgspec.Raw(t.input),
            outcome=msgspec.Raw(t.outcome) if t.outcome is not None else NIL,
            outcome_reason=t.outcome_reason,
            error=msgspec.Raw(t.error) if t.error is not None else NIL,
            created_at=to_iso(t.created_at_ms),
            finished_at=to_iso(t.finished_at_ms),
            deadline=to_iso(t.deadline_ms),
            group_id=t.group_id,
            run_id=t.run_id,
            completing=t.completing,
            subscribers=list(t.subscribers or ()),
            holder=t.holder,
        )

    # ================================================================ activities
    def _lease_stale(self, arg) -> bool:
        """The lease entry ``arg`` can never fire (its task is gone, finished or re-leased)."""
        t = self.tasks.get(arg[0])
        return t is None or t.state != "RUNNING" or t.token != arg[1] or t.lease_expires_ms != arg[2]

    def _leases_stale(self, arg) -> bool:
        """A batch lease entry ``(expires, [task ids])`` is stale when none of its tasks
        still holds a lease ending then (and it is not the batch still being filled)."""
        expires, ids = arg
        ob = self._lease_open
        if ob is not None and ob[2] is ids:
            return False
        tasks = self.tasks
        for tid in ids:
            t = tasks.get(tid)
            if t is not None and t.state == "RUNNING" and t.lease_expires_ms == expires:
                return False
        return True

    def _on_leases(self, arg) -> None:
        """The leases of a receive's batch that still end at ``expires`` have expired:
        one LeaseExpired commit per task, in delivery order. Idempotent (a retry after a
        refused commit skips the tasks already expired)."""
        expires, ids = arg
        ob = self._lease_open
        if ob is not None and ob[2] is ids:
            self._lease_open = None
        tasks = self.tasks
        coord = self.coord
        for tid in ids:
            t = tasks.get(tid)
            if t is None or t.state != "RUNNING" or t.lease_expires_ms != expires or t.completing:
                continue
            final = t.attempt >= self.table[t.mailbox_id].max_attempts
            coord.commit([LeaseExpired(task_id=tid, token=t.token, at_ms=coord.clock.mono_to_wall(expires),
                                       final=final)])

    def _deadline_stale(self, arg) -> bool:
        t = self.tasks.get(arg[0])
        return t is None or t.state in TERMINAL or t.deadline_ms != arg[1]

    def _on_lease(self, arg) -> None:
        task_id, token, expires = arg
        t = self.tasks.get(task_id)
        if t is None or t.state != "RUNNING" or t.token != token or t.lease_expires_ms != expires or t.completing:
            return
        coord = self.coord
        final = t.attempt >= self.table[t.mailbox_id].max_attempts
        coord.commit([LeaseExpired(task_id=task_id, token=token, at_ms=coord.clock.mono_to_wall(expires), final=final)])

    def _on_deadline(self, arg) -> None:
        task_id, deadline_ms = arg
        t = self.tasks.get(task_id)
        if t is None or t.state in TERMINAL or t.deadline_ms != deadline_ms:
            return
        self.coord.commit([TaskExpired(task_id=task_id, at_ms=deadline_ms)])

    def on_run_inactive(self, run_id: str, at_ms: int, reason: str) -> None:
        """The run's unfinished tasks become CANCELLED (in id order)."""
        ids = self.run_unfinished.get(run_id)
        if ids:
            r = _RUN_REASON.get(reason, reason)
            for tid in sorted(ids):
                t = self.tasks[tid]
                if t.state not in TERMINAL:
                    self.cancel_implied(t, at_ms, r)

    def cancel_implied(self, t: TaskState, at_ms: int, reason: str) -> None:
        """Another record's step cancels ``t`` (its run ended, its group finalized, its
        join set closed): the task's event, then the change."""
        self.coord.implied(TaskCancelled(task_id=t.id, at_ms=at_ms, reason=reason))
        self.finish(t, "CANCELLED", at_ms, reason)

    # ================================================================ retention
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
        for per_run in self.ready.values():
            per_run.pop(run_id, None)
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
            self.ready_set.discard(t.id)
            self._lease_drop(t)
        self.coord.touch(t.id)
        return n + 1

    # ================================================================ events
    @emits(MailboxCreated)
    def _ev_queue_created(self, r: MailboxCreated):
        return ev(r.space, "mailbox.created", "mailbox", r.id, None, r.at_ms,
                  data(name=r.name, max_attempts=r.max_attempts, backlog_limit=r.backlog_limit,
                       requirements=self._requirements_data(r.requirements)))

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
                       None if r.deadline_ms is None else to_iso(r.deadline_ms))
        return ev(r.space, "task.submitted", "task", r.id, r.scope_id, r.at_ms, d)

    @emits(TaskDelivered)
    def _ev_delivered(self, r: TaskDelivered):
        t = self.tasks[r.task_id]
        # (never the token: it is the lease's secret)
        return ev(t.space, "task.delivered", "task", t.id, t.scope_id, r.at_ms, _Delivered(t.attempt, r.holder))

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

    # ================================================================ recovery
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
