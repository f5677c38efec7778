"""The queue kind's deliveries and leases: making a task ready and waking receivers,
receive, the settle commands (renew, complete, retry, reject, release), the task's own
run, lease expiry and extension."""

from __future__ import annotations

import msgspec

from ..clock import to_iso
from ..errors import ConflictError, LeaseLostError, RallypointError, ValidationError
from ..protocol import (
    CompleteNextView, DeliveryComplete, DeliveryCompleteNext, DeliveryReject, DeliveryRelease, DeliveryRenew, DeliveryRetry, DeliveryRun, DeliveryView,
    LeaseView, Receive, ReceiveView, ScopeView, TaskView,
)
from ..records import (
    LeaseExpired, LeaseRenewed, LeasesExtended, TaskCompleted, TaskDelivered, TaskRejected, TaskReleased,
    TaskRetried, TaskRunCompleted, TaskRunCreated, TaskCompleting,
)
from .common import REPLY_BUDGET_BYTES, applies, check_holder, check_payload, check_range, clamp_wait
from .opmark import ALWAYS, W, asked, by, by_run, fenced, op
from .runtime import Park
from .queue_state import (
    _NIL_BYTES, delivery_bytes, DELIVERY_MOVES, task_view_bytes, delivery_state, DeliveryState, MailboxState, MAX_LEASE_MS, MIN_LEASE_MS, TaskState, TERMINAL,
    RATE_WINDOW_MS, count_rate, rate_room,
)

__all__ = ['Deliveries']

#: the settle halves of ``delivery.complete_next``
_SETTLES = ("complete", "retry", "reject")


class Deliveries:
    """Deliveries and leases: making a task ready and waking receivers, receive, settling,
    the task's own run, lease expiry and extension (a part of :class:`~rallypoint.actors.queue.WorkQueues`: the
    attributes it uses are made there)."""

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

    def _make_ready(self, t: TaskState, *, due: bool = False) -> None:
        """Put a QUEUED task where receivers find it, at its priority and fairness key
        (:class:`~rallypoint.actors.queue_ready.ReadyIndex`), or arm its retry delay; a
        ready task whose priority changed moves to its new level."""
        coord = self.coord
        if coord.replaying:
            return  # rearm() rebuilds the ready heaps after recovery
        if not due and t.available_at_ms > coord.mono_ms():
            coord.arm_mono(t.available_at_ms, self._on_ready, (t.id, t.available_at_ms))
            return
        if self.ready_index.add(t):
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

    def _candidates(self, queue_id: str, run_id: str) -> list:
        """(run id, its ready index) of ``run_id`` and its descendants in this queue: found
        by testing each run with ready work for ancestry when there are few such runs,
        else by walking the subtree."""
        per_run = self.ready_index.runs(queue_id)
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
        """Take up to ``n`` *eligible* ready tasks of the run and its descendants, most
        urgent first (priority, then the fair-share turn of its key, then FIFO:
        :meth:`~rallypoint.actors.queue_ready.ReadyIndex.pop`). A task with requirements
        is eligible only if all of them can be taken now, together with those of the
        tasks taken before it in this call (all or nothing, counted in one ``pending``
        for the step); the others are set aside and put back, first in line for the
        next receive (at most :data:`MAX_SKIPPED` are looked at past). With ``room``
        (bytes) and ``size(task)`` (an upper bound of what the task adds to the reply),
        taking stops before the first task that would not fit (it stays first in line;
        the first task is always taken)."""
        cands = self._candidates(queue_id, run_id)
        if not cands:
            return []
        pending: dict = {}
        admission = self.coord.admission

        def eligible(t: TaskState) -> bool:
            if t.requirements is not None and not admission.try_take(t, pending):
                admission.skipped(t, pending)  # it keeps its place for what it is short of
                return False
            return True

        q = self.table[queue_id]
        now = self.coord.now_ms()
        key_room = None
        if q.rate_limits:
            def key_room(key):
                return rate_room(q, key, now)
        idx = self.ready_index
        got = idx.pop(queue_id, cands, n, now, eligible, room, size, key_room)
        if idx.rate_blocked:
            self._arm_rate_window(q, now)
        return got

    def _arm_rate_window(self, q: MailboxState, now_ms: int) -> None:
        """A receive passed over a rate-limited key: at the start of the next 1-second
        window re-check the receives parked on the queue (once per queue and window)."""
        window = now_ms // RATE_WINDOW_MS + 1
        if self.rate_wakes.get(q.id) == window:
            return
        self.rate_wakes[q.id] = window
        coord = self.coord
        coord.arm_mono(coord.mono_ms() + window * RATE_WINDOW_MS - now_ms, self._on_rate_window, (q.id, window))

    def _on_rate_window(self, arg) -> None:
        """A rate window turned: wake the receives parked on the queue's runs with ready
        tasks (and their ancestors)."""
        queue_id, window = arg
        if self.rate_wakes.get(queue_id) == window:
            del self.rate_wakes[queue_id]
        coord = self.coord
        table = coord.runs.table
        key = ("recv", queue_id)
        seen: set = set()
        for rid in list(self.ready_index.runs(queue_id)):
            s = table.get(rid)
            while s is not None and s.id not in seen:
                seen.add(s.id)
                coord.notify(s.id, key)
                s = table.get(s.parent_id) if s.parent_id else None

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

    @op(DeliveryCompleteNext, route=by_run(), permission=W, resend=fenced("task_settled_next"),
        waits=asked("wait_ms"), reply=CompleteNextView)
    def op_delivery_complete_next(self, actor, session, op: DeliveryCompleteNext):
        """Settle one delivery and receive the next ones of its queue, in one request
        (issue 47). Everything is judged before anything changes: VALIDATION_FAILED for
        a bad ``settle``, range or holder, or a task outside run ``scope_id``'s subtree;
        SCOPE_CANCELLED / DEADLINE_EXCEEDED when the receive's run (or the task's) is
        stopped; then the settle half is judged exactly as ``delivery.complete`` /
        ``retry`` / ``reject`` judge it (STALE_CLAIM for a stale token or a lost lease)
        and a refusal is the answer: nothing is received. An accepted settle is
        committed first (its records, then the deliveries, each its own commit: the
        reply leaves once both are durable), then up to ``max_messages`` ready tasks of
        the task's queue in ``scope_id``'s subtree are leased as ``delivery.receive``
        leases them; with none ready the request parks on the run's actor for up to
        ``wait_ms`` (the answer then has no deliveries). If the run stops while it waits,
        the answer is the settled task with ``stopped`` set to the run's code."""
        check_holder(op.holder)
        holder = op.holder or session.holder
        runs = self.coord.runs
        run = runs.get(session.space, op.scope_id)
        check_range("lease_ms", op.lease_ms, MIN_LEASE_MS, MAX_LEASE_MS, " ms")
        check_range("max_messages", op.max_messages, 1, 100)
        if op.settle not in _SETTLES:
            raise ValidationError(f"settle must be one of {', '.join(_SETTLES)} (got {op.settle!r})",
                                  details={"field": "settle"})
        wait_ms = clamp_wait(op.wait_ms)
        t = self.get_task(session.space, op.task_id)
        if not runs.is_descendant_or_self(t.scope_id, run.id):
            raise ValidationError(f"task {t.id} is in run {t.scope_id}, not in run {run.id}'s subtree: receive for "
                                  "the task's run or an ancestor of it", details={"field": "scope_id"})
        q = self.table[t.mailbox_id]
        # a stopped run refuses the whole request, as delivery.complete refuses on it
        runs.require_active(run.id)
        runs.require_active(t.scope_id)
        coord = self.coord
        if op.settle == "complete":
            t, recs = self._complete_records(session, op.task_id, op.token, op.outcome, coord.now_ms())
        elif op.settle == "retry":
            t, recs = self._retry_records(session, op.task_id, op.token, op.error, op.delay_ms)
        else:
            t, recs = self._reject_records(session, op.task_id, op.token, op.error)
        if recs:
            coord.commit(recs)
        view = None if op.brief else self.task_view(t)
        # the deliveries share the reply's frame with the settled task's view
        room = REPLY_BUDGET_BYTES - (0 if view is None else task_view_bytes(t)) - 64

        def deliver() -> list:
            try:
                return self._deliver(q, run.id, op.lease_ms, op.max_messages, holder, room)
            except RallypointError:
                # the settle is applied: a refused receive (a full disk...) answers it
                # with no deliveries rather than hiding it behind an error
                return []

        got = deliver()
        if got or wait_ms == 0:
            return CompleteNextView(task=view, deliveries=got)

        def check():
            err = runs.inactive_error(run.id)
            if err is not None:
                return CompleteNextView(task=view, stopped=err.code)
            got = deliver()
            return CompleteNextView(task=view, deliveries=got) if got else None

        return Park(("recv", q.id), check, wait_ms, lambda: CompleteNextView(task=view))

    def _deliver(self, q: MailboxState, run_id: str, lease_ms: int, n: int,
                 holder: str | None = None, room: int = REPLY_BUDGET_BYTES) -> list[DeliveryView]:
        """Lease up to ``n`` ready tasks of ``q`` in ``run_id``'s subtree, as many as
        ``room`` bytes of reply carry (one commit); their views."""
        self.coord.journal.check_writable()  # before the pop: a refused commit must not drop tasks
        picked = self._pop_ready(q.id, run_id, n, room, lambda t: delivery_bytes(t, q, holder))
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
            priority=t.priority,
            fair_key=t.fair_key,
        )

    @applies(TaskDelivered)
    def _apply_delivered(self, r: TaskDelivered) -> None:
        t = self.tasks[r.task_id]
        t.token = r.token
        t.delivery_id = r.delivery_id
        t.holder = r.holder
        t.lease_expires_ms = r.lease_expires_ms
        t.available_at_ms = 0
        self.ready_index.discard(t.id)
        self._set_state(t, "RUNNING")
        coord = self.coord
        coord.touch(t.id)
        q = self.table[t.mailbox_id]
        if q.rate_limits and t.fair_key is not None and (t.fair_key in q.rate_limits or "*" in q.rate_limits):
            count_rate(q, t.fair_key, r.at_ms)  # (from the record's instant: replay needs no clock)
            coord.touch(q.id)
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

    @applies(TaskCompleting)
    def _apply_completing(self, r: TaskCompleting) -> None:
        t = self.tasks[r.task_id]
        DELIVERY_MOVES.check(delivery_state(t), DeliveryState.COMPLETING)  # IllegalTransition: a bug
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
            priority=t.priority,  # what it submits inherits the task's priority (issue 44)
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
        t, recs = self._retry_records(session, op.task_id, op.token, op.error, op.delay_ms)
        if recs:
            self.coord.commit(recs)
        return self.task_view(t)

    def _retry_records(self, session, task_id: str, token: int, error_raw, delay_ms: int) -> tuple[TaskState, list]:
        """The records of a retry of ``task_id`` (none on a stopped run or a finished
        task: a no-op). Raises as :meth:`op_delivery_retry` does."""
        t = self._holder(session, task_id, token)
        error = check_payload("error", error_raw)
        check_range("delay_ms", delay_ms, 0, 7 * 24 * 3600 * 1000, " ms")
        if self._settle_inactive(t):
            return t, []
        if not self._lease_live(t):
            raise self._lost(t)
        coord = self.coord
        final = t.attempt >= self.table[t.mailbox_id].max_attempts
        mono = coord.mono_ms()
        return t, [
            TaskRetried(
                task_id=t.id, token=t.token, at_ms=coord.now_ms(),
                available_at_ms=mono + delay_ms if delay_ms > 0 else 0,
                error=None if error == _NIL_BYTES else error, final=final,
            )
        ]

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
        t, recs = self._reject_records(session, op.task_id, op.token, op.error)
        if recs:
            self.coord.commit(recs)
        return self.task_view(t)

    def _reject_records(self, session, task_id: str, token: int, error_raw) -> tuple[TaskState, list]:
        """The records of a reject of ``task_id`` (none on a stopped run or a finished
        task: a no-op). Raises as :meth:`op_delivery_reject` does."""
        t = self._holder(session, task_id, token)
        error = check_payload("error", error_raw)
        if self._settle_inactive(t):
            return t, []
        if not self._lease_live(t):
            raise self._lost(t)
        return t, [TaskRejected(task_id=t.id, token=t.token, at_ms=self.coord.now_ms(),
                                error=None if error == _NIL_BYTES else error)]

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

    def _on_lease(self, arg) -> None:
        task_id, token, expires = arg
        t = self.tasks.get(task_id)
        if t is None or t.state != "RUNNING" or t.token != token or t.lease_expires_ms != expires or t.completing:
            return
        coord = self.coord
        final = t.attempt >= self.table[t.mailbox_id].max_attempts
        coord.commit([LeaseExpired(task_id=task_id, token=token, at_ms=coord.clock.mono_to_wall(expires), final=final)])
