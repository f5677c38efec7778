"""Mailboxes, durable tasks and fenced, leased deliveries (SPEC §3).

A task is QUEUED -> RUNNING (a delivery holds a lease) -> SUCCEEDED | FAILED |
CANCELLED | EXPIRED. Every delivery increments the task's fencing ``token``; renew,
complete, retry and reject carry it, and a token that is not the current one is
STALE_CLAIM and changes nothing. A lease that runs out puts the task back in the queue
(takeover) with ``attempt + 1``; so does a retry; after ``max_attempts`` attempts the
task is FAILED. Delivery is at-least-once; the outcome is recorded exactly once (the
first valid complete).

Indexes (rebuilt after recovery, never snapshotted): a ready heap per (mailbox, run)
ordered by task id (ids are time-ordered, so this is FIFO by submission), the
idempotency-key index, unfinished tasks per run (for cancellation), and counts.
"""

from __future__ import annotations

import heapq

import msgspec
import trio

from ..clock import to_iso as _to_iso

_ISO_HEADS: dict[int, str] = {}


def to_iso(ms: int | None) -> str | None:
    """:func:`rallypoint.clock.to_iso`, memoizing the per-second head (views of tasks
    format three instants each; datetime.isoformat dominated the reply cost)."""
    if ms is None:
        return None
    sec, milli = divmod(ms, 1000)
    head = _ISO_HEADS.get(sec)
    if head is None:
        if len(_ISO_HEADS) >= 4096:
            _ISO_HEADS.clear()
        head = _ISO_HEADS[sec] = _to_iso(sec * 1000)[:-5]  # drop ".000Z"
    return f"{head}.{milli:03d}Z"

from ..errors import (
    ConflictError,
    LeaseLostError,
    LimitError,
    NotFoundError,
    ValidationError,
)
from ..ids import is_id
from ..protocol import (
    NIL,
    DeliveryComplete,
    DeliveryReject,
    DeliveryRenew,
    DeliveryRetry,
    DeliveryView,
    LeaseView,
    MailboxEnsure,
    MailboxGet,
    MailboxList,
    MailboxListView,
    MailboxView,
    Receive,
    ReceiveView,
    TaskCancel,
    TaskListView,
    TaskResult,
    TaskStatus,
    TaskSubmit,
    TaskSubmitMany,
    TaskView,
)
from ..records import (
    LeaseExpired,
    LeaseRenewed,
    MailboxCreated,
    TaskCancelled,
    TaskCompleted,
    TaskDelivered,
    TaskExpired,
    TaskRejected,
    TaskRetried,
    TaskSubmitted,
)
from .system import short, applies, check_name, check_payload, check_range, clamp_wait, parse_instant

__all__ = ["MailboxState", "TaskState", "MailboxKind", "TERMINAL", "MIN_LEASE_MS", "MAX_LEASE_MS"]

TERMINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED"})
MIN_LEASE_MS = 5_000
MAX_LEASE_MS = 600_000
MAX_KEY_LEN = 256
MAX_BATCH = 1000


class MailboxState(msgspec.Struct, gc=False, omit_defaults=True):
    id: str
    space: str
    name: str
    mode: str
    max_attempts: int
    backlog_limit: int | None
    created_at_ms: int


class TaskState(msgspec.Struct, gc=False, omit_defaults=True):
    """What a snapshot stores of a task. ``token`` is the fencing token of the latest
    delivery (0: never delivered); ``attempt`` starts at 1 and grows on each retry or
    lease expiry."""

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


_NIL_BYTES = b"\xc0"
_SCOPE_REASON = {"cancelled": "scope_cancelled", "completed": "scope_completed", "deadline": "deadline"}


class MailboxKind:
    """Work queues: op handlers, apply functions, indexes, lease/retry/deadline activities."""

    def _init_tables(self) -> None:
        super()._init_tables()
        self.mailboxes: dict[str, MailboxState] = {}
        self.tasks: dict[str, TaskState] = {}
        self._init_task_indexes()
        self.inactive_hooks.append(self._tasks_on_scope_inactive)

    def _init_task_indexes(self) -> None:
        self.mailbox_by_name: dict[tuple[str, str], str] = {}
        self.task_keys: dict[tuple[str, str, str], str] = {}
        self.ready: dict[str, dict[str, list[str]]] = {}
        self.ready_set: set[str] = set()
        self.mailbox_counts: dict[str, list[int]] = {}  # [queued, running]
        self.scope_task_counts: dict[str, dict[str, int]] = {}
        self.scope_unfinished: dict[str, set[str]] = {}
        self.space_task_counts: dict[str, dict[str, int]] = {}

    def entity_tables(self):
        t = super().entity_tables()
        t["mbx"] = (self.mailboxes, MailboxState)
        t["tsk"] = (self.tasks, TaskState)
        return t

    # ================================================================ mailboxes
    def op_mailbox_ensure(self, session, op: MailboxEnsure) -> MailboxView:
        check_name("name", op.name)
        if op.mode != "WORK":
            raise ValidationError(f"mode must be WORK (got {short(op.mode)})", details={"field": "mode"})
        check_range("max_attempts", op.max_attempts, 1, 1000)
        if op.backlog_limit is not None:
            check_range("backlog_limit", op.backlog_limit, 1, 100_000_000)
        mid = self.mailbox_by_name.get((session.space, op.name))
        if mid is not None:
            m = self.mailboxes[mid]
            for field in ("mode", "max_attempts", "backlog_limit"):
                have, want = getattr(m, field), getattr(op, field)
                if have != want:
                    raise ConflictError(
                        f"mailbox {short(op.name)} exists with {field}={have!r}, not {want!r}",
                        details={"field": field, "existing": have},
                    )
            return self.mailbox_view(m)
        rec = MailboxCreated(
            id=self.ids.new("mbx"),
            space=session.space,
            name=op.name,
            mode=op.mode,
            max_attempts=op.max_attempts,
            backlog_limit=op.backlog_limit,
            at_ms=self.now_ms(),
        )
        self.commit([rec])
        return self.mailbox_view(self.mailboxes[rec.id])

    def op_mailbox_get(self, session, op: MailboxGet) -> MailboxView:
        return self.mailbox_view(self.get_mailbox(session.space, op.name))

    def op_mailbox_list(self, session, op: MailboxList) -> MailboxListView:
        return MailboxListView(
            mailboxes=[self.mailbox_view(m) for m in self.mailboxes.values() if m.space == session.space]
        )

    def get_mailbox(self, space: str, name_or_id: str) -> MailboxState:
        if not isinstance(name_or_id, str):
            raise ValidationError("mailbox must be a name or an id", details={"field": "mailbox"})
        mid = name_or_id if is_id(name_or_id, "mbx") else self.mailbox_by_name.get((space, name_or_id))
        m = self.mailboxes.get(mid) if mid else None
        if m is None or m.space != space:
            raise NotFoundError(
                f"no mailbox {short(name_or_id)}; create it with mailboxes.ensure()",
                details={"mailbox": name_or_id},
            )
        return m

    def mailbox_view(self, m: MailboxState) -> MailboxView:
        q, r = self.mailbox_counts.get(m.id, (0, 0))
        return MailboxView(
            id=m.id,
            name=m.name,
            mode=m.mode,
            max_attempts=m.max_attempts,
            backlog_limit=m.backlog_limit,
            created_at=to_iso(m.created_at_ms),
            queued=q,
            running=r,
        )

    @applies(MailboxCreated)
    def _apply_mailbox_created(self, r: MailboxCreated) -> None:
        m = MailboxState(
            id=r.id,
            space=r.space,
            name=r.name,
            mode=r.mode,
            max_attempts=r.max_attempts,
            backlog_limit=r.backlog_limit,
            created_at_ms=r.at_ms,
        )
        self.mailboxes[m.id] = m
        self.mailbox_by_name[(m.space, m.name)] = m.id
        self.touch(m.id)

    # ================================================================ tasks: submit
    def get_task(self, space: str, task_id: str) -> TaskState:
        t = self.tasks.get(task_id) if isinstance(task_id, str) else None
        if t is None or t.space != space:
            raise NotFoundError(f"no task {short(task_id)} in this space", details={"task_id": task_id})
        return t

    def _check_key(self, key: str | None, field: str = "key") -> None:
        if key is not None and (not isinstance(key, str) or not 1 <= len(key) <= MAX_KEY_LEN):
            raise ValidationError(f"{field} must be 1 to {MAX_KEY_LEN} characters", details={"field": field})

    def prepare_submit(
        self,
        space: str,
        mbx: MailboxState,
        scope_id: str,
        input_raw,
        key: str | None,
        deadline: str | None,
        *,
        field_prefix: str = "",
        pending: dict | None = None,
        extra_backlog: int = 0,
        **extra,
    ) -> TaskSubmitted | TaskState:
        """Validate one submission. Returns the existing task for an idempotent
        resubmission (same key, same input), else the record to commit.

        Raises VALIDATION_FAILED (bad key, payload, deadline), CONFLICT (key reused with
        other input), SCOPE_CANCELLED / DEADLINE_EXCEEDED, LIMIT_EXCEEDED (backlog)."""
        self._check_key(key, field_prefix + "key")
        data = check_payload(field_prefix + "input", input_raw)
        if key is not None:
            k = (scope_id, mbx.id, key)
            existing = None
            if pending is not None and k in pending:
                existing = pending[k]
                same = existing.input == data
            else:
                tid = self.task_keys.get(k)
                if tid is not None:
                    existing = self.tasks[tid]
                    same = existing.input == data
            if existing is not None:
                if not same:
                    raise ConflictError(
                        f"{field_prefix}key {key!r} was already used in this run and mailbox with a different input",
                        details={"field": field_prefix + "key", "task_id": existing.id},
                    )
                return existing
        self.require_active(scope_id)
        now = self.now_ms()
        deadline_ms = parse_instant(field_prefix + "deadline", deadline)
        if deadline_ms is not None and deadline_ms <= now:
            raise ValidationError(
                f"{field_prefix}deadline {deadline} is in the past", details={"field": field_prefix + "deadline"}
            )
        if mbx.backlog_limit is not None:
            q, r = self.mailbox_counts.get(mbx.id, (0, 0))
            if q + r + extra_backlog >= mbx.backlog_limit:
                raise LimitError(
                    f"mailbox {mbx.name!r} is full ({q + r} unfinished tasks, backlog_limit {mbx.backlog_limit}); retry later",
                    retry_after=1.0,
                    details={"limit": mbx.backlog_limit},
                )
        return TaskSubmitted(
            id=self.ids.new("tsk"),
            space=space,
            mailbox_id=mbx.id,
            scope_id=scope_id,
            input=data,
            at_ms=now,
            key=key,
            deadline_ms=deadline_ms,
            **extra,
        )

    def op_task_submit(self, session, op: TaskSubmit) -> TaskView:
        mbx = self.get_mailbox(session.space, op.mailbox)
        scope = self.get_scope(session.space, op.scope_id)
        rec = self.prepare_submit(session.space, mbx, scope.id, op.input, op.key, op.deadline)
        if isinstance(rec, TaskState):
            return self.task_view(rec)
        self.commit([rec])
        return self.task_view(self.tasks[rec.id])

    def op_task_submit_many(self, session, op: TaskSubmitMany) -> TaskListView:
        mbx = self.get_mailbox(session.space, op.mailbox)
        scope = self.get_scope(session.space, op.scope_id)
        if not 1 <= len(op.items) <= MAX_BATCH:
            raise ValidationError(f"items must hold 1 to {MAX_BATCH} submissions", details={"field": "items"})
        recs: list = []
        ids: list[str] = []
        pending: dict = {}
        for i, item in enumerate(op.items):
            r = self.prepare_submit(
                session.space, mbx, scope.id, item.input, item.key, item.deadline,
                field_prefix=f"items[{i}].", pending=pending, extra_backlog=len(recs),
            )
            if isinstance(r, TaskSubmitted) and not (r.key is not None and pending.get((scope.id, mbx.id, r.key)) is r):
                recs.append(r)  # (a duplicate key within the batch returns the pending record: add it once)
                if r.key is not None:
                    pending[(scope.id, mbx.id, r.key)] = r
            ids.append(r.id)
        if recs:
            self.commit(recs)
        return TaskListView(tasks=[self.task_view(self.tasks[i]) for i in ids])

    @applies(TaskSubmitted)
    def _apply_task_submitted(self, r: TaskSubmitted) -> None:
        t = TaskState(
            id=r.id,
            space=r.space,
            mailbox_id=r.mailbox_id,
            scope_id=r.scope_id,
            input=r.input,
            created_at_ms=r.at_ms,
            key=r.key,
            deadline_ms=r.deadline_ms,
            group_id=r.group_id,
            joinset_id=r.joinset_id,
            cancellable=r.cancellable,
        )
        self.tasks[t.id] = t
        self._index_task(t)
        self.touch(t.id)
        self._on_task_created(t)
        self._make_ready(t)
        if t.deadline_ms is not None:
            self.arm(t.deadline_ms, "task_deadline", t.id, t.deadline_ms)

    def _index_task(self, t: TaskState) -> None:
        if t.key is not None:
            self.task_keys[(t.scope_id, t.mailbox_id, t.key)] = t.id
        counts = self.scope_task_counts.get(t.scope_id)
        if counts is None:
            counts = self.scope_task_counts[t.scope_id] = {}
        counts[t.state] = counts.get(t.state, 0) + 1
        sc = self.space_task_counts.get(t.space)
        if sc is None:
            sc = self.space_task_counts[t.space] = {}
        sc[t.state] = sc.get(t.state, 0) + 1
        if t.state not in TERMINAL:
            self.scope_unfinished.setdefault(t.scope_id, set()).add(t.id)
            mc = self.mailbox_counts.get(t.mailbox_id)
            if mc is None:
                mc = self.mailbox_counts[t.mailbox_id] = [0, 0]
            mc[0 if t.state == "QUEUED" else 1] += 1

    def _set_task_state(self, t: TaskState, new: str) -> None:
        old = t.state
        if old == new:
            return
        t.state = new
        counts = self.scope_task_counts[t.scope_id]
        counts[old] -= 1
        if not counts[old]:
            del counts[old]
        counts[new] = counts.get(new, 0) + 1
        sc = self.space_task_counts[t.space]
        sc[old] -= 1
        sc[new] = sc.get(new, 0) + 1
        mc = self.mailbox_counts[t.mailbox_id]
        if old not in TERMINAL:
            mc[0 if old == "QUEUED" else 1] -= 1
        if new in TERMINAL:
            s = self.scope_unfinished.get(t.scope_id)
            if s is not None:
                s.discard(t.id)
                if not s:
                    del self.scope_unfinished[t.scope_id]
            self.ready_set.discard(t.id)
            self.notifier.notify(t.id)
            self._on_task_terminal(t)
        else:
            mc[0 if new == "QUEUED" else 1] += 1
        if t.group_id is not None and not self._replaying:
            self._touched_groups.add(t.group_id)

    def _on_task_created(self, t: TaskState) -> None:
        """Hook for kinds that follow tasks (join sets). Runs in apply (also in replay)."""

    def _on_task_terminal(self, t: TaskState) -> None:
        """Hook for kinds that follow tasks (join sets). Runs in apply (also in replay)."""

    def _finish(self, t: TaskState, state: str, at_ms: int, reason: str | None) -> None:
        t.finished_at_ms = at_ms
        t.outcome_reason = reason
        self._set_task_state(t, state)
        self.touch(t.id)

    # ================================================================ ready queue
    def _make_ready(self, t: TaskState, *, due: bool = False) -> None:
        """Put a QUEUED task where receivers find it (or arm its retry delay)."""
        if self._replaying:
            return  # rearm_all rebuilds the ready heaps after recovery
        if not due and t.available_at_ms > self.now_ms():
            self.timers.arm(t.available_at_ms, "task_ready", t.id, t.available_at_ms)
            return
        if t.id in self.ready_set:
            return
        self.ready_set.add(t.id)
        per_scope = self.ready.get(t.mailbox_id)
        if per_scope is None:
            per_scope = self.ready[t.mailbox_id] = {}
        heap = per_scope.get(t.scope_id)
        if heap is None:
            per_scope[t.scope_id] = [t.id]
        else:
            heapq.heappush(heap, t.id)
        # wake receivers waiting on this run or an ancestor
        notifier = self.notifier
        s = self.scopes.get(t.scope_id)
        while s is not None:
            key = ("recv", s.id)
            if notifier.has_waiters(key):
                notifier.notify(key)
            s = self.scopes.get(s.parent_id) if s.parent_id else None

    def _on_task_ready(self, task_id: str, available_at: int, _due: int) -> None:
        t = self.tasks.get(task_id)
        if t is not None and t.state == "QUEUED" and t.available_at_ms == available_at:
            self._make_ready(t, due=True)

    def _candidate_heaps(self, mbx_id: str, scope_id: str) -> list[tuple[str, list[str]]]:
        """(run id, ready heap) of ``scope_id`` and its descendants in this mailbox."""
        per_scope = self.ready.get(mbx_id)
        if not per_scope:
            return []
        if not self.scope_children.get(scope_id):
            h = per_scope.get(scope_id)
            return [(scope_id, h)] if h is not None else []
        if len(per_scope) <= 64:
            return [(sid, h) for sid, h in per_scope.items() if self.is_descendant_or_self(sid, scope_id)]
        out, stack = [], [scope_id]
        while stack:
            sid = stack.pop()
            h = per_scope.get(sid)
            if h is not None:
                out.append((sid, h))
            stack.extend(self.scope_children.get(sid, ()))
        return out

    def _pop_ready(self, mbx_id: str, scope_id: str, n: int) -> list[TaskState]:
        """Pop up to ``n`` oldest ready tasks of the run and its descendants. Stale heap
        entries (tasks no longer ready) are dropped on the way; heaps left empty are
        removed so a mailbox's index only holds runs with ready work."""
        cands = self._candidate_heaps(mbx_id, scope_id)
        out: list[TaskState] = []
        tasks, ready_set = self.tasks, self.ready_set
        heappop = heapq.heappop
        while len(out) < n:
            best = None
            for _sid, h in cands:
                while h and (h[0] not in ready_set):
                    heappop(h)
                if h and (best is None or h[0] < best[0]):
                    best = h
            if best is None:
                break
            tid = heappop(best)
            ready_set.discard(tid)
            out.append(tasks[tid])
        per_scope = self.ready.get(mbx_id)
        if per_scope is not None:
            for sid, h in cands:
                if not h:
                    per_scope.pop(sid, None)
        return out

    # ================================================================ receive
    def op_receive(self, session, op: Receive):
        mbx = self.get_mailbox(session.space, op.mailbox)
        scope = self.get_scope(session.space, op.scope_id)
        check_range("lease_ms", op.lease_ms, MIN_LEASE_MS, MAX_LEASE_MS, " ms")
        check_range("max_messages", op.max_messages, 1, 100)
        wait_ms = clamp_wait(op.wait_ms)
        self.require_active(scope.id)
        got = self._deliver(mbx, scope.id, op.lease_ms, op.max_messages)
        if got or wait_ms == 0:
            return ReceiveView(deliveries=got)
        return self._receive_wait(mbx, scope.id, op.lease_ms, op.max_messages, wait_ms)

    async def _receive_wait(self, mbx, scope_id, lease_ms, max_messages, wait_ms) -> ReceiveView:
        deadline = trio.current_time() + wait_ms / 1000
        while True:
            # Check before parking: this coroutine may start after other requests of the
            # same frame were dispatched (a submit or cancel whose wake-up found no waiter).
            self.require_active(scope_id)
            got = self._deliver(mbx, scope_id, lease_ms, max_messages)
            if got or trio.current_time() >= deadline:
                return ReceiveView(deliveries=got)
            ev = self.notifier.event(("recv", scope_id))
            with trio.move_on_at(deadline):
                await ev.wait()

    def _deliver(self, mbx: MailboxState, scope_id: str, lease_ms: int, n: int) -> list[DeliveryView]:
        self.journal.check_writable()  # before the pop: a refused commit must not lose them
        picked = self._pop_ready(mbx.id, scope_id, n)
        if not picked:
            return []
        now = self.now_ms()
        recs = [
            TaskDelivered(
                task_id=t.id,
                delivery_id=self.ids.new("dlv"),
                token=t.token + 1,
                lease_expires_ms=now + lease_ms,
                at_ms=now,
            )
            for t in picked
        ]
        self.commit(recs)
        return [self.delivery_view(t, mbx) for t in picked]

    def delivery_view(self, t: TaskState, mbx: MailboxState | None = None) -> DeliveryView:
        mbx = mbx or self.mailboxes[t.mailbox_id]
        return DeliveryView(
            id=t.delivery_id or "",
            task_id=t.id,
            mailbox=mbx.name,
            scope_id=t.scope_id,
            input=msgspec.Raw(t.input),
            attempt=t.attempt,
            token=t.token,
            lease_expires_at=to_iso(t.lease_expires_ms),
            group_id=t.group_id,
        )

    @applies(TaskDelivered)
    def _apply_task_delivered(self, r: TaskDelivered) -> None:
        t = self.tasks[r.task_id]
        t.token = r.token
        t.delivery_id = r.delivery_id
        t.lease_expires_ms = r.lease_expires_ms
        t.available_at_ms = 0
        self.ready_set.discard(t.id)
        self._set_task_state(t, "RUNNING")
        self.touch(t.id)
        self.arm(r.lease_expires_ms, "lease", t.id, (r.token, r.lease_expires_ms))

    # ================================================================ settle
    def _holder_task(self, session, task_id: str, token: int) -> TaskState:
        t = self.get_task(session.space, task_id)
        if t.token != token or token <= 0:
            raise LeaseLostError(
                f"token {token} is not the current lease on task {t.id} (current {t.token}); "
                "another worker has taken it over, or it was never yours",
                details={"task_id": t.id, "token": t.token},
            )
        return t

    def _lease_live(self, t: TaskState) -> bool:
        return t.state == "RUNNING" and t.lease_expires_ms > self.now_ms()

    def _lost(self, t: TaskState) -> LeaseLostError:
        why = "its lease expired" if t.state in ("RUNNING", "QUEUED") else f"the task is {t.state}"
        return LeaseLostError(
            f"the lease on task {t.id} is lost: {why}", details={"task_id": t.id, "state": t.state}
        )

    def op_delivery_renew(self, session, op: DeliveryRenew) -> LeaseView:
        t = self._holder_task(session, op.task_id, op.token)
        check_range("lease_ms", op.lease_ms, MIN_LEASE_MS, MAX_LEASE_MS, " ms")
        self.require_active(t.scope_id)
        if not self._lease_live(t):
            raise self._lost(t)
        expires = self.now_ms() + op.lease_ms
        self.commit([LeaseRenewed(task_id=t.id, token=t.token, lease_expires_ms=expires)])
        return LeaseView(task_id=t.id, token=t.token, lease_expires_at=to_iso(expires))

    @applies(LeaseRenewed)
    def _apply_lease_renewed(self, r: LeaseRenewed) -> None:
        t = self.tasks[r.task_id]
        t.lease_expires_ms = r.lease_expires_ms
        self.touch(t.id)
        self.arm(r.lease_expires_ms, "lease", t.id, (r.token, r.lease_expires_ms))

    def op_delivery_complete(self, session, op: DeliveryComplete) -> TaskView:
        t = self._holder_task(session, op.task_id, op.token)
        outcome = check_payload("outcome", op.outcome)
        self.require_active(t.scope_id)
        if not self._lease_live(t):
            raise self._lost(t)
        self.commit([TaskCompleted(task_id=t.id, token=t.token, outcome=outcome, at_ms=self.now_ms())])
        return self.task_view(t)

    @applies(TaskCompleted)
    def _apply_task_completed(self, r: TaskCompleted) -> None:
        t = self.tasks[r.task_id]
        t.outcome = r.outcome
        self._finish(t, "SUCCEEDED", r.at_ms, "completed")

    def _settle_inactive(self, t: TaskState) -> bool:
        """Retry/reject on an inactive run are answered without a change (SPEC §2.4)."""
        return t.state in TERMINAL or self.scope_inactive_error(t.scope_id) is not None

    def op_delivery_retry(self, session, op: DeliveryRetry) -> TaskView:
        t = self._holder_task(session, op.task_id, op.token)
        error = check_payload("error", op.error)
        check_range("delay_ms", op.delay_ms, 0, 7 * 24 * 3600 * 1000, " ms")
        if self._settle_inactive(t):
            return self.task_view(t)
        if not self._lease_live(t):
            raise self._lost(t)
        now = self.now_ms()
        final = t.attempt >= self.mailboxes[t.mailbox_id].max_attempts
        self.commit([
            TaskRetried(
                task_id=t.id,
                token=t.token,
                at_ms=now,
                available_at_ms=now + op.delay_ms,
                error=None if error == _NIL_BYTES else error,
                final=final,
            )
        ])
        return self.task_view(t)

    @applies(TaskRetried)
    def _apply_task_retried(self, r: TaskRetried) -> None:
        t = self.tasks[r.task_id]
        t.error = r.error
        if r.final:
            self._finish(t, "FAILED", r.at_ms, "max_attempts")
            return
        t.attempt += 1
        t.available_at_ms = r.available_at_ms if r.available_at_ms > r.at_ms else 0
        self._set_task_state(t, "QUEUED")
        self.touch(t.id)
        self._make_ready(t)

    def op_delivery_reject(self, session, op: DeliveryReject) -> TaskView:
        t = self._holder_task(session, op.task_id, op.token)
        error = check_payload("error", op.error)
        if self._settle_inactive(t):
            return self.task_view(t)
        if not self._lease_live(t):
            raise self._lost(t)
        self.commit([
            TaskRejected(task_id=t.id, token=t.token, at_ms=self.now_ms(), error=None if error == _NIL_BYTES else error)
        ])
        return self.task_view(t)

    @applies(TaskRejected)
    def _apply_task_rejected(self, r: TaskRejected) -> None:
        t = self.tasks[r.task_id]
        t.error = r.error
        self._finish(t, "FAILED", r.at_ms, "rejected")

    # ================================================================ status, result, cancel
    def op_task_status(self, session, op: TaskStatus) -> TaskView:
        return self.task_view(self.get_task(session.space, op.task_id))

    def op_task_result(self, session, op: TaskResult):
        t = self.get_task(session.space, op.task_id)
        wait_ms = clamp_wait(op.wait_ms)
        if t.state in TERMINAL or wait_ms == 0:
            return self.task_view(t)
        return self._task_wait(t, wait_ms)

    async def _task_wait(self, t: TaskState, wait_ms: int) -> TaskView:
        with trio.move_on_after(wait_ms / 1000):
            while t.state not in TERMINAL:
                await self.notifier.event(t.id).wait()
        return self.task_view(t)

    def op_task_cancel(self, session, op: TaskCancel) -> TaskView:
        t = self.get_task(session.space, op.task_id)
        if t.state not in TERMINAL:
            self.commit([TaskCancelled(task_id=t.id, at_ms=self.now_ms())])
        return self.task_view(t)

    @applies(TaskCancelled)
    def _apply_task_cancelled(self, r: TaskCancelled) -> None:
        self._finish(self.tasks[r.task_id], "CANCELLED", r.at_ms, r.reason)

    @applies(TaskExpired)
    def _apply_task_expired(self, r: TaskExpired) -> None:
        self._finish(self.tasks[r.task_id], "EXPIRED", r.at_ms, "deadline")

    @applies(LeaseExpired)
    def _apply_lease_expired(self, r: LeaseExpired) -> None:
        t = self.tasks[r.task_id]
        if r.final:
            self._finish(t, "FAILED", r.at_ms, "lease_expired")
            return
        t.attempt += 1
        t.available_at_ms = 0
        self._set_task_state(t, "QUEUED")
        self.touch(t.id)
        self._make_ready(t)

    def task_view(self, t: TaskState) -> TaskView:
        return TaskView(
            id=t.id,
            mailbox=self.mailboxes[t.mailbox_id].name,
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
        )

    # ================================================================ activities
    def _on_lease(self, task_id: str, arg, _due: int) -> None:
        token, expires = arg
        t = self.tasks.get(task_id)
        if t is None or t.state != "RUNNING" or t.token != token or t.lease_expires_ms != expires:
            return
        final = t.attempt >= self.mailboxes[t.mailbox_id].max_attempts
        self.commit([LeaseExpired(task_id=task_id, token=token, at_ms=expires, final=final)])

    def _on_task_deadline(self, task_id: str, deadline_ms: int, _due: int) -> None:
        t = self.tasks.get(task_id)
        if t is None or t.state in TERMINAL or t.deadline_ms != deadline_ms:
            return
        self.commit([TaskExpired(task_id=task_id, at_ms=deadline_ms)])

    def _tasks_on_scope_inactive(self, scope_id: str, at_ms: int, reason: str) -> None:
        """Cascade: the run's unfinished tasks become CANCELLED; receivers wake."""
        ids = self.scope_unfinished.get(scope_id)
        if ids:
            r = _SCOPE_REASON.get(reason, reason)
            for tid in sorted(ids):
                self._finish(self.tasks[tid], "CANCELLED", at_ms, r)
        self.notifier.notify(("recv", scope_id))

    # ================================================================ recovery
    def rebuild_indexes(self) -> None:
        super().rebuild_indexes()
        self._init_task_indexes()
        for m in self.mailboxes.values():
            self.mailbox_by_name[(m.space, m.name)] = m.id
        for t in self.tasks.values():
            self._index_task(t)

    def rearm_all(self) -> None:
        super().rearm_all()
        now = self.now_ms()
        for t in self.tasks.values():
            if t.state in TERMINAL:
                continue
            if t.deadline_ms is not None:
                self.timers.arm(max(t.deadline_ms, now), "task_deadline", t.id, t.deadline_ms)
            if t.state == "RUNNING":
                self.timers.arm(max(t.lease_expires_ms, now), "lease", t.id, (t.token, t.lease_expires_ms))
            elif t.state == "QUEUED":
                self._make_ready(t)
