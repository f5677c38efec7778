"""Read-only operator views (runstate's ``/ops``, the web console): who holds what in a
run, what waits, lists of what a run or space holds, a task's delivery, a join set's log.

No state of its own: it reads the other kinds (never a source of authority; a view may
be stale the instant after it is made). ``ops.run`` runs on the run's actor,
``ops.waits`` on the space's; ``ops.items`` on the run's (or the space's), ``ops.task`` on
the task's run's, ``ops.joinset`` on the join set's. Every lookup is by the session's
space (NOT_FOUND across spaces, as everywhere).
"""

from __future__ import annotations

import heapq

from ..clock import to_iso
from ..errors import ValidationError
from ..protocol import (
    OpsItems, OpsItemsView, OpsJoinRecordView, OpsJoinSet, OpsJoinSetView, OpsJoinStepView, OpsQueueView, OpsRun,
    OpsRunView, OpsTask, OpsTaskRow, OpsTaskView, OpsWaits, OpsWaitsView, OpsWaitView, OpsWorkerView, OpsGroupRow,
)
from .common import check_range
from .kind import Kind
from .opmark import ALL, ALWAYS, R, SPACE, by, by_run, in_slot, op, run_or_space

__all__ = ["Diagnostics"]

MAX_ROWS = 1000
#: the kinds ``ops.items`` lists
ITEM_KINDS = ("tasks", "groups", "joinsets", "barriers", "timers", "claims", "grants", "queues")
#: entities a space-wide list looks at, at most, per call (newest first)
MAX_SCAN = 200_000


class Diagnostics(Kind):
    prefix = ""
    name = "diagnostics"

    @op(OpsRun, route=by_run(), permission=R, resend=ALWAYS)
    def op_ops_run(self, actor, session, op: OpsRun) -> OpsRunView:
        """For run ``scope_id`` and its subtree: ``workers`` (per holder: the once and
        claim keys and the ids of the leased tasks it holds -- a delivery's holder, see
        ``TaskDelivered.holder`` -- and its earliest lease expiry) and ``waiting`` (pool waiters,
        then WAITING quota waiters), at most 1000 rows each; ``root_scope_id``: the top of
        its tree."""
        coord = self.coord
        runs = coord.runs
        run = runs.get(session.space, op.scope_id)
        root = run
        while root.parent_id is not None:
            root = runs.table[root.parent_id]
        subtree = set(runs.subtree(run.id))
        workers: dict[str, list] = {}

        def hold(holder, key, lease_mono, task=False):
            w = workers.setdefault(holder or "", [[], None, []])
            w[0].append(key)
            if task:
                w[2].append(key)
            exp = coord.clock.mono_to_wall(lease_mono)
            w[1] = exp if w[1] is None else min(w[1], exp)

        for o in coord.onces.held():
            if o.scope_id in subtree:
                hold(o.holder, o.key, o.lease_expires_ms)
        claims = coord.claims
        for cid in sorted(claims.held):
            c = claims.table[cid]
            if c.scope_id in subtree:
                hold(c.holder, c.key, c.lease_expires_ms)
        # Leased tasks: each run's leased set (as many as its leases, whatever waits)
        queues = coord.queues
        run_leased, tasks = queues.run_leased, queues.tasks
        for rid in subtree:
            for tid in run_leased.get(rid, ()):
                t = tasks[tid]
                hold(t.holder, t.id, t.lease_expires_ms, task=True)
        waiting = [v for v in self._pool_waiting(session.space) if v.scope_id in subtree]
        waiting += [v for v in self._quota_waiting(session.space) if v.scope_id in subtree]
        return OpsRunView(
            root_scope_id=root.id, scope_id=run.id, runs=len(subtree),
            workers=[OpsWorkerView(holder=h, keys=sorted(k), earliest_lease_expiry=to_iso(e), tasks=sorted(ts))
                     for h, (k, e, ts) in sorted(workers.items())][:MAX_ROWS],
            waiting=waiting[:MAX_ROWS],
        )

    def _pool_waiting(self, space: str) -> list[OpsWaitView]:
        return [OpsWaitView(kind="permit", name=pool.name, units=w.units, holder=w.holder, scope_id=w.scope_id)
                for pool in self.coord.pools.table.values() if pool.space == space for w in pool.waiters]

    def _quota_waiting(self, space: str) -> list[OpsWaitView]:
        quotas = self.coord.quotas
        out = []
        for w in quotas.waiters.values():
            if w.space == space and w.state == "WAITING":
                out.append(OpsWaitView(kind="quota", name=quotas.table[w.quota_id].name, units=w.units,
                                       holder=w.holder, scope_id=w.scope_id))
        return out

    @op(OpsWaits, route=SPACE, permission=R, resend=ALWAYS, shard=ALL, merge="ops.waits")
    def op_ops_waits(self, actor, session, op: OpsWaits) -> OpsWaitsView:
        """Parked server-side waits by actor kind (the whole server's runtime) and the
        space's durable waiters (quota waiters), at most 1000 rows."""
        parked = {kind: st.get("waiters", 0) for kind, st in self.coord.actor_statistics().items()}
        waiting = self._pool_waiting(session.space) + self._quota_waiting(session.space)
        return OpsWaitsView(parked=parked, waiting=waiting[:MAX_ROWS])

    # ================================================================ the console's lists
    @op(OpsItems, route=run_or_space("scope_id"), permission=R, resend=ALWAYS, shard=in_slot("scope_id", "all"),
        merge="ops.items")
    def op_ops_items(self, actor, session, op: OpsItems) -> OpsItemsView:
        """For each of ``op.kinds``, what run ``op.scope_id`` holds (None: the space),
        at most ``op.limit`` rows (see :class:`~rallypoint.protocol.OpsItems`).
        VALIDATION_FAILED for an unknown kind or a limit outside 1-1000; NOT_FOUND for
        a run or mailbox of no (or another) space. A space-wide list looks at the newest
        :data:`MAX_SCAN` entities of its kind at most."""
        check_range("limit", op.limit, 1, MAX_ROWS)
        bad = [k for k in op.kinds if k not in ITEM_KINDS]
        if bad or not op.kinds:
            raise ValidationError(f"kinds must be some of {', '.join(ITEM_KINDS)} (got {bad or 'none'})",
                                  details={"field": "kinds"})
        coord = self.coord
        space = session.space
        run = coord.runs.get(space, op.scope_id) if op.scope_id is not None else None
        out = OpsItemsView()
        n = op.limit
        for kind in dict.fromkeys(op.kinds):
            setattr(out, kind, getattr(self, "_items_" + kind)(space, run, op, n))
        return out

    def _items_tasks(self, space, run, op, n):
        queues = self.coord.queues
        qid = queues.get_queue(space, op.mailbox).id if op.mailbox is not None else None
        tasks = queues.tasks
        before, state = op.before, op.state

        def keep(t) -> bool:
            return ((qid is None or t.mailbox_id == qid) and (before is None or t.id < before)
                    and (state is None or t.state == state))

        if run is not None:
            ids = [i for i in queues.run_tasks.get(run.id, ()) if keep(tasks[i])]
            picked = [tasks[i] for i in heapq.nlargest(n, ids)]
        else:
            picked = []
            for scanned, t in enumerate(reversed(tasks.values())):
                if scanned >= MAX_SCAN or len(picked) >= n:
                    break
                if t.space == space and keep(t):
                    picked.append(t)
        names = {q.id: q.name for q in queues.table.values() if q.space == space}
        return [OpsTaskRow(id=t.id, mailbox=names.get(t.mailbox_id, t.mailbox_id), scope_id=t.scope_id, state=t.state,
                           attempt=t.attempt, key=t.key, created_at=to_iso(t.created_at_ms),
                           finished_at=to_iso(t.finished_at_ms), group_id=t.group_id, outcome_reason=t.outcome_reason,
                           completing=t.completing, holder=t.holder) for t in picked]

    def _items_groups(self, space, run, op, n):
        coord = self.coord
        groups = coord.groups.table
        if run is not None:
            runs = coord.runs.table
            ids = [runs[k].group_id for k in coord.runs.children.get(run.id, ()) if runs[k].group_id is not None]
            source = (groups[i] for i in reversed(ids) if i in groups)
        else:
            source = reversed(groups.values())
        out = []
        for scanned, g in enumerate(source):
            if scanned >= MAX_SCAN or len(out) >= n:
                break
            if g.space != space or (op.before is not None and g.id >= op.before):
                continue
            if op.state is not None and g.state != op.state:
                continue
            out.append(OpsGroupRow(id=g.id, scope_id=g.parent_scope_id, condition=g.condition, state=g.state,
                                   outcome=g.outcome, outcome_reason=g.outcome_reason, members=len(g.members),
                                   accepted=sum(1 for m in g.members if m.verdict == "ACCEPTED"),
                                   created_at=to_iso(g.created_at_ms), finalized_at=to_iso(g.finalized_at_ms)))
        return out

    def _owned(self, run, prefix: str):
        return [i for i in self.coord.runs.owned.get(run.id, ()) if i.startswith(prefix)] if run is not None else []

    def _items_joinsets(self, space, run, op, n):
        kind = self.coord.joinsets
        table = kind.table
        source = (table[i] for i in reversed(self._owned(run, "jst_")) if i in table) if run is not None \
            else reversed(table.values())
        out = []
        for scanned, js in enumerate(source):
            if scanned >= MAX_SCAN or len(out) >= n:
                break
            if js.space != space or (op.before is not None and js.id >= op.before):
                continue
            v = kind.view(js)
            v.children = []  # (a list is for finding the set; its page shows the children)
            out.append(v)
        return out

    def _items_barriers(self, space, run, op, n):
        kind = self.coord.barriers
        return [kind.view(kind.table[i]) for i in self._owned(run, "bar_") if i in kind.table][:n]

    def _items_timers(self, space, run, op, n):
        kind = self.coord.timers
        return [kind.view(kind.table[i]) for i in self._owned(run, "tmr_") if i in kind.table][:n]

    def _items_claims(self, space, run, op, n):
        claims = self.coord.claims
        out = []
        for cid in sorted(claims.held):
            c = claims.table[cid]
            if c.space == space and (run is None or c.scope_id == run.id):
                out.append(claims.view(c))
                if len(out) >= n:
                    break
        return out

    def _items_grants(self, space, run, op, n):
        pools = self.coord.pools
        grants = pools.grants
        if run is not None:
            ids = list(pools.links.by.get(run.id, ()))
            for tid in sorted(self.coord.queues.run_unfinished.get(run.id, ())):
                ids.extend(pools.by_task.get(tid, ()))
        else:
            ids = [g for active in pools.active.values() for g in active]
        out = []
        for gid in ids:
            g = grants.get(gid)
            if g is not None and g.space == space and g.state == "ACTIVE":
                out.append(pools.grant_view(g))
                if len(out) >= n:
                    break
        return out

    def _items_queues(self, space, run, op, n):
        queues = self.coord.queues
        out = []
        for q in queues.table.values():
            if q.space != space:
                continue
            queued, running = queues.queue_counts.get(q.id, (0, 0))
            oldest = queues.ready_index.oldest(q.id)
            out.append(OpsQueueView(
                id=q.id, name=q.name, mode=q.mode, queued=queued, running=running, done=queues.queue_done.get(q.id, 0),
                oldest_ready_at=to_iso(oldest.created_at_ms) if oldest is not None else None,
                backlog_limit=q.backlog_limit))
            if len(out) >= n:
                break
        return out

    # ================================================================ one task, one join set
    def route_task(self, session, task_id) -> str:
        """A task's run's actor (NOT_FOUND as ``task.status``)."""
        return self.coord.queues.route_task(session, task_id)

    def route_joinset(self, session, joinset_id) -> str:
        """A join set's own actor (NOT_FOUND as ``joinset.get``)."""
        return self.coord.joinsets.route(session, joinset_id)

    @op(OpsTask, route=by("task_id", "route_task"), permission=R, resend=ALWAYS)
    def op_ops_task(self, actor, session, op: OpsTask) -> OpsTaskView:
        """The task (or message) ``op.task_id`` with its queue's ``max_attempts`` and,
        while RUNNING with a live lease, its delivery (token, lease expiry, grants and
        reservations held) and the server time left on the lease (ms). NOT_FOUND."""
        queues = self.coord.queues
        t = queues.get_task(session.space, op.task_id)
        v = OpsTaskView(task=queues.task_view(t), max_attempts=queues.table[t.mailbox_id].max_attempts)
        if t.state == "RUNNING" and not t.completing:
            v.delivery = queues.delivery_view(t)
            v.lease_left_ms = max(0, t.lease_expires_ms - self.coord.mono_ms())
        return v

    @op(OpsJoinSet, route=by("joinset_id", "route_joinset"), permission=R, resend=ALWAYS)
    def op_ops_joinset(self, actor, session, op: OpsJoinSet) -> OpsJoinSetView:
        """Join set ``op.joinset_id`` with its completion records (completion order, the
        order replay reproduces) and its log of answers, run-length entries with the
        step each starts at. NOT_FOUND."""
        kind = self.coord.joinsets
        js = kind.get(session.space, op.joinset_id)
        closing_from = js.closing_from
        records = [OpsJoinRecordView(index=i, child_id=c.child_id, kind=c.kind, ok=c.ok, failure_kind=c.failure_kind,
                                     consumed=i < js.consumed,
                                     closing=closing_from is not None and i >= closing_from and i < js.consumed)
                   for i, c in enumerate(js.completions)]
        steps = []
        step = 0
        for e in js.steps:
            steps.append(OpsJoinStepView(step=step, op=e.op, outcome=e.outcome, index=e.index,
                                         mailbox=kind._mailbox_name(e.mailbox), n=e.n))
            step += e.n
        return OpsJoinSetView(joinset=kind.view(js), records=records, steps=steps, closed_at=to_iso(js.closed_at_ms))
