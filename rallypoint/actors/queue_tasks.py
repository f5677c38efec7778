"""The queue kind's tasks: lookups, submission (one task), the task's state and every
index and hook that follows it (:meth:`Tasks._set_state`, checked against
:data:`~rallypoint.actors.queue_state.TASK_MOVES` and
:data:`~rallypoint.actors.queue_state.DELIVERY_MOVES`), its end
(:meth:`Tasks.finish`), status, results, cancel and subscriptions, deadlines."""

from __future__ import annotations

import msgspec

from ..clock import to_iso
from ..errors import ConflictError, LimitError, NotFoundError, ValidationError
from ..protocol import (TaskSetPriority, 
    NIL, TaskCancel, TaskListView, TaskResult, TaskDetach, TaskResults, TaskOutcomeView, TaskStatus, TaskSubmit,
    TaskSubscribe, TaskView,
)
from ..records import TaskPrioritySet, TaskCancelled, TaskExpired, TaskDetached, TaskSubmitted, TaskSubscribed
from .common import (
    MAX_PAYLOAD_BYTES, applies, check_range, check_key, check_payload, clamp_wait, data, fit_count, parse_instant, short,
)
from .opmark import ALWAYS, R, W, asked, by, by_run, in_slots, keyed, op
from .runtime import Park
from .queue_state import (DEFAULT_PRIORITY, PRIORITY_MAX, PRIORITY_MIN, check_scheduling, 
    _RUN_REASON, check_task_move, DELIVERY_MOVES, delivery_state, DeliveryState, MailboxState, MAX_BATCH, outcome_view_bytes, task_view_bytes, TaskState, TERMINAL,
)

__all__ = ['Tasks']


class Tasks:
    """Tasks: lookups, one submission, the task's state and its indexes, its end,
    status, results, cancel, subscriptions, deadlines (a part of :class:`~rallypoint.actors.queue.WorkQueues`: the
    attributes it uses are made there)."""

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
        priority: int | None = None,
        fair_key: str | None = None,
        fair_weight: int | None = None,
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
        DEADLINE_EXCEEDED, LIMIT_EXCEEDED (backlog, work limit, the space's limits).

        Issue 44: ``priority`` (1 .. :data:`PRIORITY_MAX`; None: the run's default,
        :meth:`~rallypoint.actors.run.Runs.default_priority`, else
        :data:`DEFAULT_PRIORITY`), ``fair_key`` (1 .. :data:`MAX_FAIR_KEY` characters) and
        ``fair_weight`` (1 .. :data:`MAX_WEIGHT`): VALIDATION_FAILED outside them (a
        weight without a key too)."""
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
        priority = check_scheduling(field_prefix, priority, fair_key, fair_weight)
        if priority is None:
            priority = coord.runs.default_priority(run_id) or DEFAULT_PRIORITY
        seq = self.next_seq + extra_backlog
        return TaskSubmitted(
            id=coord.new_id("msg" if mode == "INBOX" else "tsk", under=run_id), space=space, mailbox_id=q.id, scope_id=run_id,
            input=data, at_ms=now, key=key, deadline_ms=deadline_ms, seq=seq, requirements=reqs,
            work_limit_id=work_limit.id if work_limit is not None else None, priority=priority,
            fair_key=fair_key, fair_weight=fair_weight, **extra,
        )

    @op(TaskSubmit, route=by_run(), permission=W,
        resend=keyed("key", "give the submission a `key` to make it safe to retry"))
    def op_task_submit(self, actor, session, op: TaskSubmit) -> TaskView:
        """One task; ``requirements`` and ``work_limit`` as in ``actors/admission.py``."""
        q = self.get_queue(session.space, op.mailbox)
        run = self.coord.runs.get(session.space, op.scope_id)
        wl = self.coord.admission.resolve_work_limit(run.id, op.work_limit) if op.work_limit is not None else None
        rec = self.prepare_submit(session.space, q, run.id, op.input, op.key, op.deadline,
                                  requirements=op.requirements, work_limit=wl, priority=op.priority,
                                  fair_key=op.fair_key, fair_weight=op.fair_weight)
        if isinstance(rec, TaskState):
            return self.task_view(rec)
        self.coord.commit([rec])
        return self.task_view(self.tasks[rec.id])

    @applies(TaskSubmitted)
    def _apply_submitted(self, r: TaskSubmitted) -> None:
        t = TaskState(
            id=r.id, space=r.space, mailbox_id=r.mailbox_id, scope_id=r.scope_id, input=r.input,
            created_at_ms=r.at_ms, key=r.key, deadline_ms=r.deadline_ms, group_id=r.group_id,
            joinset_id=r.joinset_id, cancellable=r.cancellable, seq=r.seq, requirements=r.requirements,
            work_limit_id=r.work_limit_id, priority=r.priority, fair_key=r.fair_key, fair_weight=r.fair_weight,
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

    def _set_state(self, t: TaskState, new: str, at_ms: int = 0) -> None:
        """Move ``t`` to ``new`` and keep every index and hook in step: counts, the
        leased set, result waiters, join sets and groups; a delivery that ends (leaving
        RUNNING) gives back what it took for the task's requirements (at ``at_ms``), and
        a task that finishes stops counting against its work limit."""
        old = t.state
        if old == new:
            return
        check_task_move(old, new)  # IllegalTransition: a bug of the caller
        if old == "RUNNING" or new == "RUNNING":
            before = delivery_state(t)
            after = DeliveryState.LEASED if new == "RUNNING" else DeliveryState.ENDED
            DELIVERY_MOVES.check(before, after)
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
            self.ready_index.discard(t.id)
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

    @op(TaskSetPriority, route=by("task_id", "route_task"), permission=W, resend=ALWAYS)
    def op_task_set_priority(self, actor, session, op: TaskSetPriority) -> TaskView:
        """Change a QUEUED task's priority (``TaskPrioritySet``); a ready one moves to its
        new level at once (its FIFO place there is its submission order). The same
        priority changes nothing (nothing journaled). VALIDATION_FAILED outside
        1..PRIORITY_MAX; CONFLICT when the task is not QUEUED (it is being worked on or
        finished: a priority only orders the waiting)."""
        t = self.get_task(session.space, op.task_id)
        check_range("priority", op.priority, PRIORITY_MIN, PRIORITY_MAX)
        if t.state != "QUEUED":
            raise ConflictError(f"task {t.id} is {t.state}: only a QUEUED task's priority can change",
                                details={"task_id": t.id, "state": t.state})
        if t.priority != op.priority:
            self.coord.commit([TaskPrioritySet(task_id=t.id, priority=op.priority, at_ms=self.coord.now_ms())])
        return self.task_view(t)

    @applies(TaskPrioritySet)
    def _apply_priority_set(self, r: TaskPrioritySet) -> None:
        t = self.tasks[r.task_id]
        t.priority = r.priority
        self.coord.touch(t.id)
        if t.id in self.ready_index:  # (a delayed retry takes its new level when due)
            self._make_ready(t)

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
            priority=t.priority,
            fair_key=t.fair_key,
        )

    def _deadline_stale(self, arg) -> bool:
        t = self.tasks.get(arg[0])
        return t is None or t.state in TERMINAL or t.deadline_ms != arg[1]

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
