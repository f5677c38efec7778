"""Read-only operator views (runstate's ``/ops``): who holds what in a run, what waits.

No state of its own: it reads the other kinds (never a source of authority; a view may
be stale the instant after it is made). ``ops.run`` runs on the run's actor,
``ops.waits`` on the space's.
"""

from __future__ import annotations

from ..clock import to_iso
from ..protocol import OpsRun, OpsRunView, OpsWaits, OpsWaitsView, OpsWaitView, OpsWorkerView
from .kind import Kind
from .opmark import ALL, ALWAYS, R, SPACE, by_run, op

__all__ = ["Diagnostics"]

MAX_ROWS = 1000


class Diagnostics(Kind):
    prefix = ""
    name = "diagnostics"

    @op(OpsRun, route=by_run(), permission=R, resend=ALWAYS)
    def op_ops_run(self, actor, session, op: OpsRun) -> OpsRunView:
        """For run ``scope_id`` and its subtree: ``workers`` (per holder: the once and
        claim keys it holds and its earliest lease expiry) and ``waiting`` (pool waiters,
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

        def hold(holder, key, lease_mono):
            w = workers.setdefault(holder or "", [[], None])
            w[0].append(key)
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
        waiting = [v for v in self._pool_waiting(session.space) if v.scope_id in subtree]
        waiting += [v for v in self._quota_waiting(session.space) if v.scope_id in subtree]
        return OpsRunView(
            root_scope_id=root.id, scope_id=run.id, runs=len(subtree),
            workers=[OpsWorkerView(holder=h, keys=sorted(k), earliest_lease_expiry=to_iso(e))
                     for h, (k, e) in sorted(workers.items())][:MAX_ROWS],
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

    @op(OpsWaits, route=SPACE, permission=R, resend=ALWAYS, shard=ALL)
    def op_ops_waits(self, actor, session, op: OpsWaits) -> OpsWaitsView:
        """Parked server-side waits by actor kind (the whole server's runtime) and the
        space's durable waiters (quota waiters), at most 1000 rows."""
        parked = {kind: st.get("waiters", 0) for kind, st in self.coord.actor_statistics().items()}
        waiting = self._pool_waiting(session.space) + self._quota_waiting(session.space)
        return OpsWaitsView(parked=parked, waiting=waiting[:MAX_ROWS])
