"""The queue kind's batches: many submissions in one all-or-nothing commit
(``task.submit_many``), many completes of one run in one commit
(``delivery.complete_many``)."""

from __future__ import annotations


from ..errors import LeaseLostError, RallypointError, ValidationError
from ..protocol import (DeliveryCompleteMany, ItemError, SettledListView, SettledView, TaskListView, TaskSubmitMany)
from ..records import TaskSubmitted
from .common import REPLY_BUDGET_BYTES, fit_count
from .opmark import W, by, by_run, fenced, in_slots, op, resend_if
from ..opdecl import every_item_keyed
from .queue_state import (
    MAX_BATCH, task_view_bytes, TaskState,
)

__all__ = ['Batches']


class Batches:
    """Batches: many submissions in one commit, many completes of one run in one
    commit (a part of :class:`~rallypoint.actors.queue.WorkQueues`: the
    attributes it uses are made there)."""

    @op(TaskSubmitMany, route=by_run(), permission=W,
        resend=resend_if(every_item_keyed, "every item has a key",
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
                requirements=item.requirements, work_limit=wl, now=now, priority=item.priority,
                fair_key=item.fair_key, fair_weight=item.fair_weight,
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
