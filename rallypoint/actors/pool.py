"""Pools (runstate's permits): ``units_total`` units shared by a space, handed out as
leased grants, with durable FIFO waiters (SPEC §8, runstate kernel §10).

- A **grant** holds ``units`` of one pool for one run, under a lease on server time
  (5-600 s, renewable) with a random secret ``token``. Release returns the units at once
  (leaving an optional ``observation``); a lease that runs out returns them too (the
  grant is EXPIRED, its holder's renew/release get STALE_CLAIM). Grants taken by
  **admission** (a task's ``requirements``) have no lease of their own: they are held
  while the task's delivery runs and released in the step that ends it.
- **Acquire** with ``wait_ms`` 0 succeeds only if the units are free *and nobody is
  waiting*; otherwise CAPACITY_UNAVAILABLE. With ``wait_ms`` > 0 the request joins the
  pool's durable FIFO queue (``PoolWaiterQueued``) for that long.
- **No starvation (how):** the queue is strict FIFO with no barging. Freed units go to
  the waiters in arrival order, and the first waiter that does not fit stops the
  serving: nobody behind it, however small, is served before it, and while anyone waits
  new acquires queue behind (or get CAPACITY_UNAVAILABLE) and admission takes no units
  from the pool. So a request for 5 units behind a stream of 1-unit requests is served
  as soon as 5 units are free at once; the cost is that units may sit idle while the
  head waits for enough of them.
- ``units`` > ``units_total`` (or < 1) is VALIDATION_FAILED: such a request could never
  be served.
- **Where things run.** A pool is space-level: its actor is in the root nursery, and
  every pool and grant command (acquire, renew, release, status) runs there; a waiting
  acquire is parked there (key: its ``request_id``). Admission runs on the task's run's
  actor and reads the pool's state; its ``PoolGranted`` records change the pool.
- **A run's end.** Pool waiters do not live under their run, so the nursery
  cancellation cannot reach them: the run's ONE step answers them explicitly --
  ``on_run_inactive`` (each waiting run registers the pool with ``Runs.own``) removes
  every waiter of an inactive run from the queue and notifies the pool's actor, whose
  parked acquires then answer the run's code (SCOPE_CANCELLED / DEADLINE_EXCEEDED); the
  waiters behind are served right after (the queue's head may have changed). Grants of
  the run stay until released or run out: renewals are refused (the holder is asked to
  stop), release stays allowed.

Freed units are handed out by :meth:`Pools._serve`, a decide step (it commits the
grants) run after every release, expiry and withdrawal, and -- for changes made inside
another record's apply (a run's end, a task's delivery ending) -- as an activity due at
once. Recovery re-arms leases and waiter limits at their due times and serves every
pool with waiters.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import islice

import msgspec
import trio

from ..clock import to_iso
from ..errors import (
    CapacityUnavailableError,
    ConflictError,
    LeaseLostError,
    NotFoundError,
    UnavailableError,
    ValidationError,
    WaitTimeout,
)
from ..ids import is_id
from ..protocol import (
    CancelWaitView,
    GrantRelease,
    GrantRenew,
    GrantStatus,
    GrantView,
    PoolAcquire,
    PoolAcquireView,
    PoolCancelWait,
    PoolEnsure,
    PoolGet,
    PoolList,
    PoolListView,
    PoolView,
    PoolWaiterView,
)
from ..records import GrantExpired, GrantReleased, GrantRenewed, PoolCreated, PoolGranted, PoolWaiterEnded, PoolWaiterQueued
from .claim import MAX_QUEUE_WAIT_MS, check_holder, check_request_id, new_token
from ..events import emits, ev
from .common import MAX_WAIT_MS, applies, check_name, check_payload, check_range, data, did_you_mean, short
from .kind import Kind, Links
from .opmark import ALWAYS, C, R, SPACE, W, asked, by, keyed, op
from .queue import MAX_LEASE_MS, MIN_LEASE_MS
from .runtime import PRIO_WAIT_END, Park
from .waitqueue import WaitQueue

__all__ = ["PoolState", "PoolWaiter", "GrantState", "Pools", "MAX_UNITS", "MAX_POOLS_PER_TASK"]

MAX_UNITS = 1_000_000
#: How long a task a receive skipped for lack of units keeps its place in a pool's
#: admission line without a receive looking at it again, ms: a live worker's receive
#: looks again at least every 60 s (a parked receive ends, the SDK sends it again).
ADMISSION_HOLD_MS = 2 * MAX_WAIT_MS
#: At most this many pools in one task's requirements (runstate's limit).
MAX_POOLS_PER_TASK = 4
_NIL_BYTES = b"\xc0"


class PoolWaiter(msgspec.Struct, gc=False, omit_defaults=True):
    """A durable waiter in a pool's FIFO queue; ``expires_mono_ms`` is server time."""

    request_id: str
    scope_id: str
    units: int
    lease_ms: int
    expires_mono_ms: int
    queued_at_ms: int
    holder: str | None = None


class PoolState(msgspec.Struct, gc=False, omit_defaults=True):
    """What a snapshot stores of a pool: its size and its queue (FIFO)."""

    id: str
    space: str
    name: str
    units_total: int
    created_at_ms: int
    waiters: list[PoolWaiter] = []


class GrantState(msgspec.Struct, gc=False, omit_defaults=True):
    """A grant: ACTIVE, RELEASED or EXPIRED. ``lease_expires_ms`` is server time (0 for a
    grant held by the delivery of task ``task_id``)."""

    id: str
    space: str
    pool_id: str
    scope_id: str
    units: int
    token: int
    created_at_ms: int
    state: str = "ACTIVE"
    lease_expires_ms: int = 0
    holder: str | None = None
    request_id: str | None = None
    task_id: str | None = None
    ended_at_ms: int | None = None
    end_reason: str | None = None
    observation: bytes | None = None


class Pools(Kind):
    """Pools and their grants: ensure, acquire (durable FIFO waiters), renew, release;
    lease and waiter expiry; serving the queue; the ``pools`` requirement of admission."""

    prefix = "pol"
    name = "pools"

    def __init__(self, coord) -> None:
        super().__init__(coord)
        self.table: dict[str, PoolState] = {}
        self.grants: dict[str, GrantState] = {}
        self._init_indexes()

    def _init_indexes(self) -> None:
        self.by_name: dict[tuple[str, str], str] = {}
        self.used: dict[str, int] = {}  # pool -> units of ACTIVE grants
        self.active: dict[str, set[str]] = {}  # pool -> ACTIVE grant ids
        self.by_request: dict[tuple[str, str], str] = {}  # (pool, request id) -> grant id
        self.by_task: dict[str, list[str]] = {}  # task -> ACTIVE grants its delivery holds
        self.leased: set[str] = set()  # ACTIVE grants with a lease of their own
        self.queued: set[str] = set()  # pools with waiters
        self.needs: dict[str, set[str]] = {}  # pool -> unfinished tasks that require it
        self._owned: set[tuple[str, str]] = set()
        self._kicked: set[str] = set()
        self.lines: dict[str, WaitQueue[PoolWaiter]] = {}  # pool -> its line (over PoolState.waiters)
        # pool -> its admission line: (seq, task id, units, held until, server ms) of the
        # ready tasks a receive could not serve, oldest first (derived, in memory only)
        self.admission_lines: dict[str, list[tuple[int, str, int, int]]] = {}
        self.links = Links()  # retention: run (or the task a delivery held it for) -> grant ids

    def entity_tables(self):
        return {"pol": (self.table, PoolState), "grt": (self.grants, GrantState)}

    def statistics(self) -> dict:
        return {"pools": len(self.table), "grants": len(self.grants), "leased": len(self.leased),
                "waiters": sum(len(self.line(self.table[p])) for p in self.queued),
                "admission_line": sum(len(line) for line in self.admission_lines.values())}

    def leases_outstanding(self) -> int:
        return len(self.leased) + len(self.queued)

    def line(self, pool: PoolState) -> WaitQueue[PoolWaiter]:
        """The pool's FIFO line of waiting acquires (:class:`WaitQueue`; its durable form
        is ``pool.waiters``, what snapshots store)."""
        q = self.lines.get(pool.id)
        if q is None:
            q = self.lines[pool.id] = WaitQueue(_request_id, pool.waiters)
        return q

    def free(self, pool: PoolState) -> int:
        """Units not granted now."""
        return pool.units_total - self.used.get(pool.id, 0)

    # ================================================================ lookups, views
    def get(self, space: str, name_or_id) -> PoolState:
        """A pool by name or id; NOT_FOUND (saying how to create it) otherwise."""
        if not isinstance(name_or_id, str):
            raise ValidationError("pool must be a name or an id", details={"field": "pool"})
        pid = name_or_id if is_id(name_or_id, "pol") else self.by_name.get((space, name_or_id))
        pool = self.table.get(pid) if pid else None
        if pool is None or pool.space != space:
            hint = did_you_mean(name_or_id, (n for (sp, n) in self.by_name if sp == space))
            raise NotFoundError(f"no pool {short(name_or_id)}{hint}; create it with pools.ensure()",
                                details={"pool": name_or_id})
        return pool

    def get_grant(self, space: str, grant_id) -> GrantState:
        g = self.grants.get(grant_id) if isinstance(grant_id, str) else None
        if g is None or g.space != space:
            raise NotFoundError(f"no grant {short(grant_id)} in this space", details={"grant_id": grant_id})
        return g

    def route(self, session, name_or_id) -> str:
        return self.get(session.space, name_or_id).id

    def route_grant(self, session, grant_id) -> str:
        return self.get_grant(session.space, grant_id).pool_id

    def grant_view(self, g: GrantState, with_token: bool = False) -> GrantView:
        return GrantView(
            id=g.id,
            pool=self.table[g.pool_id].name,
            pool_id=g.pool_id,
            scope_id=g.scope_id,
            units=g.units,
            state=g.state,
            token=g.token if with_token else 0,
            lease_expires_at=(to_iso(self.coord.clock.mono_to_wall(g.lease_expires_ms))
                              if g.lease_expires_ms and g.state == "ACTIVE" else None),
            holder=g.holder,
            task_id=g.task_id,
            created_at=to_iso(g.created_at_ms),
            ended_at=to_iso(g.ended_at_ms),
            end_reason=g.end_reason,
        )

    def view(self, pool: PoolState) -> PoolView:
        to_wall = self.coord.clock.mono_to_wall
        active = sorted(self.active.get(pool.id, ()))
        used = self.used.get(pool.id, 0)
        return PoolView(
            id=pool.id,
            name=pool.name,
            units_total=pool.units_total,
            units_used=used,
            units_free=pool.units_total - used,
            created_at=to_iso(pool.created_at_ms),
            waiting=len(self.line(pool)),
            active_grants=len(active),
            waiters=[
                PoolWaiterView(scope_id=w.scope_id, units=w.units, holder=w.holder, queued_at=to_iso(w.queued_at_ms),
                               expires_at=to_iso(to_wall(w.expires_mono_ms)))
                for w in islice(self.line(pool), 100)
            ],
            grants=[self.grant_view(self.grants[g]) for g in active[:100]],
        )

    # ================================================================ pools
    @op(PoolEnsure, route=SPACE, permission=C, resend=ALWAYS)
    def op_pool_ensure(self, actor, session, op: PoolEnsure) -> PoolView:
        """Create the pool, or check it exists with this ``units_total`` (CONFLICT
        otherwise). Runs on the space's actor (names are per space). VALIDATION_FAILED
        for a bad name or a size outside 1-1,000,000."""
        check_name("name", op.name)
        check_range("units_total", op.units_total, 1, MAX_UNITS)
        pid = self.by_name.get((session.space, op.name))
        if pid is not None:
            pool = self.table[pid]
            if pool.units_total != op.units_total:
                raise ConflictError(
                    f"pool {op.name!r} exists with units_total={pool.units_total}, not {op.units_total}",
                    details={"field": "units_total", "existing": pool.units_total},
                )
            return self.view(pool)
        rec = PoolCreated(id=self.coord.new_id("pol", space=session.space), space=session.space, name=op.name,
                          units_total=op.units_total, at_ms=self.coord.now_ms())
        self.coord.commit([rec])
        return self.view(self.table[rec.id])

    @applies(PoolCreated)
    def _apply_created(self, r: PoolCreated) -> None:
        pool = PoolState(id=r.id, space=r.space, name=r.name, units_total=r.units_total, created_at_ms=r.at_ms)
        self.table[pool.id] = pool
        self.by_name[(pool.space, pool.name)] = pool.id
        self.coord.touch(pool.id)

    @op(PoolGet, route=by("name"), permission=R, resend=ALWAYS)
    def op_pool_get(self, actor, session, op: PoolGet) -> PoolView:
        return self.view(self.get(session.space, op.name))

    @op(PoolList, route=SPACE, permission=R, resend=ALWAYS)
    def op_pool_list(self, actor, session, op: PoolList) -> PoolListView:
        return PoolListView(pools=[self.view(p) for p in self.table.values() if p.space == session.space])

    # ================================================================ acquire
    @op(PoolAcquire, route=by("pool"), permission=W, resend=keyed("request_id"), waits=asked("wait_ms"),
        reply=PoolAcquireView)
    def op_pool_acquire(self, actor, session, op: PoolAcquire):
        """``units`` of the pool for run ``scope_id`` under a ``lease_ms`` lease (runs on
        the pool's actor). Returns ACQUIRED with the grant (and its token) or, after
        waiting up to 60 s in line, WAITING (re-send with the same ``request_id``).
        Raises VALIDATION_FAILED (units < 1 or > units_total, lease 5-600 s, wait
        0-24 h, holder, request_id), NOT_FOUND (pool, run), SCOPE_CANCELLED /
        DEADLINE_EXCEEDED (inactive run), CAPACITY_UNAVAILABLE (``wait_ms`` 0 and the
        units are not free, or others wait first), TIMEOUT (the waiter's time limit ran
        out)."""
        coord = self.coord
        space = session.space
        pool = self.get(space, op.pool)
        run = coord.runs.get(space, op.scope_id)
        self._check_units("units", op.units, pool)
        check_range("lease_ms", op.lease_ms, MIN_LEASE_MS, MAX_LEASE_MS, " ms")
        check_range("wait_ms", op.wait_ms, 0, MAX_QUEUE_WAIT_MS, " ms")
        check_holder(op.holder)
        check_request_id(op.request_id)
        coord.runs.require_active(run.id)
        rid = op.request_id
        if rid is not None:
            gid = self.by_request.get((pool.id, rid))
            if gid is not None:  # a re-sent acquire that was applied
                return PoolAcquireView(status="ACQUIRED", grant=self.grant_view(self.grants[gid], True), request_id=rid)
            w = self.line(pool).get(rid)
            if w is not None:
                if w.scope_id != run.id or w.units != op.units:
                    raise ConflictError(f"request_id {rid!r} is already a waiter for {w.units} units of run "
                                        f"{w.scope_id}", details={"field": "request_id"})
                return self._park(pool, w)
        line = self.line(pool)
        if not line and self.free(pool) >= op.units:
            gid = coord.new_id("grt", space=pool.space)
            coord.commit([PoolGranted(
                id=gid, pool_id=pool.id, space=space, scope_id=run.id, units=op.units, token=new_token(),
                at_ms=coord.now_ms(), lease_expires_ms=coord.mono_ms() + op.lease_ms, holder=op.holder,
                request_id=rid,
            )])
            return PoolAcquireView(status="ACQUIRED", grant=self.grant_view(self.grants[gid], True), request_id=rid)
        if op.wait_ms == 0:
            free = self.free(pool)
            why = (f"{len(line)} waiter(s) are in line first" if line and free >= op.units
                   else f"{free} of {pool.units_total} units are free")
            raise CapacityUnavailableError(
                f"pool {pool.name!r} cannot grant {op.units} unit(s) now: {why}; acquire with wait to queue",
                retry_after=1.0,
                details={"pool": pool.name, "units": op.units, "units_free": free, "waiters": len(line)},
            )
        if rid is None:
            rid = "srv-" + coord.ids.new("req")[4:]
        coord.commit([PoolWaiterQueued(
            pool_id=pool.id, request_id=rid, scope_id=run.id, units=op.units, lease_ms=op.lease_ms,
            expires_mono_ms=coord.mono_ms() + op.wait_ms, at_ms=coord.now_ms(), holder=op.holder,
        )])
        return self._park(pool, line.get(rid))

    def _check_units(self, field: str, units, pool: PoolState) -> None:
        if isinstance(units, bool) or not isinstance(units, int) or units < 1:
            raise ValidationError(f"{field} must be an integer >= 1 (got {units!r})", details={"field": field})
        if units > pool.units_total:
            raise ValidationError(
                f"{field} {units} exceeds pool {pool.name!r}'s units_total {pool.units_total}: it could never be "
                "granted", details={"field": field, "units_total": pool.units_total},
            )

    def _park(self, pool: PoolState, w: PoolWaiter) -> Park:
        rid = w.request_id
        line = self.line(pool)
        park_ms = max(0, min(MAX_WAIT_MS, w.expires_mono_ms - self.coord.mono_ms()))

        def check():
            gid = self.by_request.get((pool.id, rid))
            if gid is not None:
                return PoolAcquireView(status="ACQUIRED", grant=self.grant_view(self.grants[gid], True), request_id=rid)
            if rid in line:
                return None
            err = self.coord.runs.inactive_error(w.scope_id)
            if err is not None:
                raise err
            raise WaitTimeout(
                f"pool {pool.name!r} could not grant {w.units} unit(s) in time; this acquire's wait ran out or "
                "was withdrawn", details={"pool": pool.name, "request_id": rid},
            )

        def expire():
            pos = line.position(rid)
            if pos == 0:
                return check()
            return PoolAcquireView(status="WAITING", request_id=rid, position=pos)

        return Park(rid, check, park_ms, expire)

    @applies(PoolWaiterQueued)
    def _apply_waiter_queued(self, r: PoolWaiterQueued) -> None:
        pool = self.table[r.pool_id]
        self.line(pool).add(PoolWaiter(request_id=r.request_id, scope_id=r.scope_id, units=r.units,
                                       lease_ms=r.lease_ms, expires_mono_ms=r.expires_mono_ms,
                                       queued_at_ms=r.at_ms, holder=r.holder))
        self.queued.add(pool.id)
        if (r.scope_id, pool.id) not in self._owned:
            self._owned.add((r.scope_id, pool.id))
            self.coord.runs.own(r.scope_id, pool.id)
        self.coord.touch(pool.id)
        self.coord.arm_mono(r.expires_mono_ms, self._on_waiter_ttl, (pool.id, r.request_id, r.expires_mono_ms),
                            PRIO_WAIT_END)

    @applies(PoolWaiterEnded)
    def _apply_waiter_ended(self, r: PoolWaiterEnded) -> None:
        pool = self.table[r.pool_id]
        if self.line(pool).remove(r.request_id) is not None:
            self._queue_changed(pool)
            self.coord.touch(pool.id)
            self.coord.notify(pool.id, r.request_id)

    def _queue_changed(self, pool: PoolState) -> None:
        if self.line(pool):
            self.queued.add(pool.id)
        else:
            self.queued.discard(pool.id)

    @applies(PoolGranted)
    def _apply_granted(self, r: PoolGranted) -> None:
        g = GrantState(id=r.id, space=r.space, pool_id=r.pool_id, scope_id=r.scope_id, units=r.units, token=r.token,
                       created_at_ms=r.at_ms, lease_expires_ms=r.lease_expires_ms, holder=r.holder,
                       request_id=r.request_id, task_id=r.task_id)
        self.grants[g.id] = g
        self._index_grant(g)
        pool = self.table[g.pool_id]
        if r.request_id is not None and self.line(pool).remove(r.request_id) is not None:
            self._queue_changed(pool)
            self.coord.touch(pool.id)
            self.coord.notify(pool.id, r.request_id)
        self.coord.touch(g.id)
        if g.task_id is None:
            self.coord.arm_mono(g.lease_expires_ms, self._on_lease, (g.id, g.token, g.lease_expires_ms))

    def _index_grant(self, g: GrantState) -> None:
        self.links.add(g.task_id or g.scope_id, g.id)
        if g.request_id is not None:
            self.by_request[(g.pool_id, g.request_id)] = g.id
        if g.state != "ACTIVE":
            return
        self.used[g.pool_id] = self.used.get(g.pool_id, 0) + g.units
        self.active.setdefault(g.pool_id, set()).add(g.id)
        if g.task_id is not None:
            self.by_task.setdefault(g.task_id, []).append(g.id)
        else:
            self.leased.add(g.id)

    def _end_grant(self, g: GrantState, state: str, at_ms: int, reason: str) -> None:
        """ACTIVE -> ``state``: the units go back to the pool (served soon)."""
        g.state = state
        g.ended_at_ms = at_ms
        g.end_reason = reason
        self.used[g.pool_id] -= g.units
        self.active[g.pool_id].discard(g.id)
        self.leased.discard(g.id)
        if g.task_id is not None:
            lst = self.by_task.get(g.task_id)
            if lst is not None and g.id in lst:
                lst.remove(g.id)
                if not lst:
                    del self.by_task[g.task_id]
        self.coord.touch(g.id)

    # ================================================================ the holder's calls
    def _holder(self, session, grant_id, token: int) -> GrantState:
        g = self.get_grant(session.space, grant_id)
        if g.token != token or token <= 0:
            raise LeaseLostError(
                f"token {token} is not the token of grant {g.id}; it was never yours",
                details={"grant_id": g.id, "state": g.state},
            )
        if g.state == "ACTIVE" and g.task_id is None and g.lease_expires_ms <= self.coord.mono_ms():
            self._on_lease((g.id, g.token, g.lease_expires_ms))  # judged at request time
        return g

    def _lost(self, g: GrantState) -> LeaseLostError:
        return LeaseLostError(
            f"grant {g.id} is {g.state} ({g.end_reason}); its units went back to the pool",
            details={"grant_id": g.id, "state": g.state},
        )

    @op(GrantRenew, route=by("grant_id", "route_grant"), permission=W, resend=ALWAYS)
    def op_grant_renew(self, actor, session, op: GrantRenew) -> GrantView:
        """Extend the grant's lease by ``lease_ms`` (5-600 s) from now. STALE_CLAIM when
        the token is wrong or the lease already ran out (or was released);
        SCOPE_CANCELLED / DEADLINE_EXCEEDED when the grant's run is inactive; CONFLICT for
        a grant held by a task's delivery (renew the delivery instead)."""
        g = self._holder(session, op.grant_id, op.token)
        check_range("lease_ms", op.lease_ms, MIN_LEASE_MS, MAX_LEASE_MS, " ms")
        if g.state != "ACTIVE":
            raise self._lost(g)
        if g.task_id is not None:
            raise ConflictError(f"grant {g.id} is held by the delivery of task {g.task_id}; renew the delivery",
                                details={"task_id": g.task_id})
        self.coord.runs.require_active(g.scope_id)
        expires = self.coord.mono_ms() + op.lease_ms
        self.coord.commit([GrantRenewed(grant_id=g.id, token=g.token, lease_expires_ms=expires)])
        return self.grant_view(g, True)

    @applies(GrantRenewed)
    def _apply_renewed(self, r: GrantRenewed) -> None:
        g = self.grants[r.grant_id]
        g.lease_expires_ms = r.lease_expires_ms
        self.coord.touch(g.id)
        self.coord.arm_mono(r.lease_expires_ms, self._on_lease, (g.id, r.token, r.lease_expires_ms))

    @op(GrantRelease, route=by("grant_id", "route_grant"), permission=W, resend=ALWAYS)
    def op_grant_release(self, actor, session, op: GrantRelease) -> GrantView:
        """Give the units back (to the first waiters in line, at once). Allowed on an
        inactive run and for a task's grant (returned early). Idempotent: a second
        release returns the RELEASED grant. STALE_CLAIM for a wrong token or a lease that
        ran out."""
        g = self._holder(session, op.grant_id, op.token)
        observation = check_payload("observation", op.observation)
        if g.state == "RELEASED":
            return self.grant_view(g)
        if g.state != "ACTIVE":
            raise self._lost(g)
        self._release(g, None if observation == _NIL_BYTES else observation, "released")
        return self.grant_view(g)

    def _release(self, g: GrantState, observation: bytes | None, reason: str) -> None:
        self.coord.commit([GrantReleased(grant_id=g.id, token=g.token, at_ms=self.coord.now_ms(),
                                         observation=observation, reason=reason)])
        self._serve_or_later(self.table[g.pool_id])

    @applies(GrantReleased)
    def _apply_released(self, r: GrantReleased) -> None:
        g = self.grants[r.grant_id]
        g.observation = r.observation
        self._end_grant(g, "RELEASED", r.at_ms, r.reason)

    @op(GrantStatus, route=by("grant_id", "route_grant"), permission=R, resend=ALWAYS)
    def op_grant_status(self, actor, session, op: GrantStatus) -> GrantView:
        """The grant (never its token)."""
        return self.grant_view(self.get_grant(session.space, op.grant_id))

    @op(PoolCancelWait, route=by("pool"), permission=W, resend=ALWAYS)
    def op_pool_cancel_wait(self, actor, session, op: PoolCancelWait) -> CancelWaitView:
        """Withdraw acquire ``request_id``: its waiter leaves the queue, or the grant it
        was already given is released. Idempotent."""
        pool = self.get(session.space, op.pool)
        check_request_id(op.request_id)
        if op.request_id in self.line(pool):
            self.coord.commit([PoolWaiterEnded(pool_id=pool.id, request_id=op.request_id, reason="withdrawn")])
            self._serve_or_later(pool)
            return CancelWaitView(outcome="withdrawn")
        gid = self.by_request.get((pool.id, op.request_id))
        if gid is not None and self.grants[gid].state == "ACTIVE":
            self._release(self.grants[gid], None, "withdrawn")
            return CancelWaitView(outcome="released")
        return CancelWaitView(outcome="none")

    # ================================================================ serving the queue
    def _serve(self, pool: PoolState) -> None:
        """Hand freed units to the waiters in FIFO order, in one commit: waiters out of
        time or in an inactive run leave the queue; the first that does not fit stops
        the serving (no barging). Then, with no one waiting, wake the receivers of ready
        tasks that require this pool (admission)."""
        coord = self.coord
        line = self.line(pool)
        if line:
            mono = coord.mono_ms()
            now = coord.now_ms()
            free = self.free(pool)
            inactive = coord.runs.inactive_error

            def fits(w: PoolWaiter) -> bool:
                nonlocal free
                if w.units > free:
                    return False
                free -= w.units
                return True

            # a waiter whose time limit is this very instant is still in time (a wait's
            # deadline sees what fell due at or before it)
            leaving, served = line.plan(lambda w: w.expires_mono_ms < mono or inactive(w.scope_id) is not None, fits)
            recs: list = [PoolWaiterEnded(pool_id=pool.id, request_id=w.request_id,
                                          reason="expired" if w.expires_mono_ms < mono else "cancelled")
                          for w in leaving]
            recs += [PoolGranted(
                id=coord.new_id("grt", space=pool.space), pool_id=pool.id, space=pool.space, scope_id=w.scope_id,
                units=w.units, token=new_token(), at_ms=now, lease_expires_ms=mono + w.lease_ms,
                holder=w.holder, request_id=w.request_id,
            ) for w in served]
            if recs:
                coord.commit(recs)
        if not line and self.free(pool) > 0 and self.needs.get(pool.id):
            self._wake_admission(pool.id)

    def _serve_or_later(self, pool: PoolState) -> None:
        """:meth:`_serve` right after the commit that freed units; if the journal
        refuses it (disk full: UNAVAILABLE before anything is applied), an activity due
        at once serves the pool, retried by the heap until the journal takes it."""
        try:
            self._serve(pool)
        except UnavailableError:
            self._kick(pool.id)

    def _wake_admission(self, pool_id: str) -> None:
        queues = self.coord.queues
        ready = queues.ready_set
        seen: set = set()
        for tid in self.needs.get(pool_id, ()):
            if tid in ready:
                t = queues.tasks[tid]
                k = (t.mailbox_id, t.scope_id)
                if k not in seen:
                    seen.add(k)
                    queues.wake_receivers(t)

    def _kick(self, pool_id: str) -> None:
        """From an apply (a run's end, a delivery ending): serve the pool as an activity
        due at once (a decide step may commit; an apply may not). Not in replay."""
        if self.coord.replaying or pool_id in self._kicked:
            return
        self._kicked.add(pool_id)
        self.coord.heap.arm(trio.current_time(), self._on_kick, pool_id)

    def _on_kick(self, pool_id: str) -> None:
        self._kicked.discard(pool_id)
        pool = self.table.get(pool_id)
        if pool is not None:
            self._serve(pool)

    # ================================================================ activities
    def _on_lease(self, arg) -> None:
        grant_id, token, expires = arg
        g = self.grants.get(grant_id)
        if g is None or g.state != "ACTIVE" or g.token != token or g.lease_expires_ms != expires:
            return
        coord = self.coord
        coord.commit([GrantExpired(grant_id=grant_id, token=token, at_ms=coord.clock.mono_to_wall(expires))])
        self._serve_or_later(self.table[g.pool_id])

    @applies(GrantExpired)
    def _apply_expired(self, r: GrantExpired) -> None:
        self._end_grant(self.grants[r.grant_id], "EXPIRED", r.at_ms, "expired")

    def _on_waiter_ttl(self, arg) -> None:
        pool_id, rid, expires = arg
        pool = self.table.get(pool_id)
        w = self.line(pool).get(rid) if pool is not None else None
        if w is None or w.expires_mono_ms != expires:
            return
        self.coord.commit([PoolWaiterEnded(pool_id=pool_id, request_id=rid, reason="expired")])
        self._serve_or_later(pool)

    # ================================================================ runs
    def on_run_inactive(self, pool_id: str, at_ms: int, reason: str) -> None:
        """The explicit answer (see the module docstring): waiters of runs inactive at
        ``at_ms`` leave the queue, the pool's actor re-checks their parked acquires
        (which answer the run's code), and the pool is served at once after this step."""
        pool = self.table[pool_id]
        line = self.line(pool)
        if not line:
            return
        inactive = self.coord.runs.inactive_error
        gone = line.remove_where(lambda w: inactive(w.scope_id, at_ms) is not None)
        if gone:
            self._queue_changed(pool)
            self.coord.touch(pool.id)
            for w in gone:
                self.coord.notify(pool.id, w.request_id)
                self.coord.implied(PoolWaiterEnded(pool_id=pool.id, request_id=w.request_id, reason="cancelled"))
            self._kick(pool.id)

    # ================================================================ admission ("pools" requirement)
    requirement_max_names = MAX_POOLS_PER_TASK

    def requirement_prepare(self, space: str, value: dict) -> dict[str, int]:
        """At submission: pool name -> units, to pool id -> units. VALIDATION_FAILED for
        more than 4 pools or units outside 1..units_total, NOT_FOUND for a pool."""
        if len(value) > MAX_POOLS_PER_TASK:
            raise ValidationError(f"requirements.pools names {len(value)} pools; at most {MAX_POOLS_PER_TASK}",
                                  details={"field": "requirements.pools"})
        out: dict[str, int] = {}
        for name, units in value.items():
            pool = self.get(space, name)
            self._check_units(f"requirements.pools[{name}]", units, pool)
            out[pool.id] = out.get(pool.id, 0) + units
        return out

    def requirement_fits(self, value: dict[str, int], pending: dict, task=None) -> bool:
        """Can these units be granted now to ``task``, on top of what this step already
        took (``pending``)? Not while anyone waits in the pool's acquire queue, and not
        units that an older task of the pool's admission line waits for (no barging:
        :meth:`_room`). ``task`` None: a request younger than every task in line."""
        for pid, units in value.items():
            pool = self.table[pid]
            if self.line(pool):
                return False
            room = self._room(pool, task, pending)
            if room is None or room < units:
                return False
        return True

    def requirement_skipped(self, task, value: dict[str, int], pending: dict) -> None:
        """A receive looked at ready ``task`` and could not take its requirements: in
        each pool that is short of what it needs (and where no older task of the line
        already stops the younger ones), it joins the pool's admission line, by its FIFO
        position (``seq``), for :data:`ADMISSION_HOLD_MS`; a task already in a line gets
        that time again (its worker is still asking)."""
        until = self.coord.mono_ms() + ADMISSION_HOLD_MS
        for pid, units in value.items():
            pool = self.table[pid]
            if self.line(pool):
                continue  # acquires wait first; admission takes nothing from the pool meanwhile
            line = self.admission_lines.get(pid)
            i = bisect_left(line, (task.seq, task.id)) if line else 0
            if line and i < len(line) and line[i][1] == task.id:
                line[i] = (task.seq, task.id, units, until)
                continue
            room = self._room(pool, task, pending)
            if room is not None and room < units:
                if line is None:
                    line = self.admission_lines[pid] = []
                    i = 0
                line.insert(i, (task.seq, task.id, units, until))

    def _room(self, pool: PoolState, task, pending: dict) -> int | None:
        """Units of ``pool`` that ``task`` may take now: the free units, less what this
        step took already (``pending``), less the units of every older task of the
        pool's admission line in turn; None when one of those does not fit (it is served
        first: nobody younger takes from the pool before it). Entries of tasks no longer
        ready (delivered, finished, waiting a retry delay) or not looked at for
        :data:`ADMISSION_HOLD_MS` (no worker asks for them any more) leave the line."""
        room = self.free(pool) - pending.get(pool.id, 0)
        line = self.admission_lines.get(pool.id)
        if not line:
            return room
        ready = self.coord.queues.ready_set
        mono = self.coord.mono_ms()
        if any(e[1] not in ready or e[3] < mono for e in line):
            line[:] = [e for e in line if e[1] in ready and e[3] >= mono]
            if not line:
                del self.admission_lines[pool.id]
                return room
        for seq, tid, units, _until in line:
            if task is not None and (seq, tid) >= (task.seq, task.id):
                break
            if units > room:
                return None
            room -= units
        return room

    def requirement_hold(self, value: dict[str, int], pending: dict) -> None:
        for pid, units in value.items():
            pending[pid] = pending.get(pid, 0) + units

    def requirement_records(self, task, value: dict[str, int], at_ms: int) -> list:
        """The grants, committed with the delivery (``TaskDelivered``; on a space's home
        shard, with ``AdmissionHeld``: ``task`` a ``RemoteDelivery``, whose
        ``grant_holder`` the grants show)."""
        new_id = self.coord.new_id
        holder = getattr(task, "grant_holder", None)
        return [
            PoolGranted(id=new_id("grt", space=task.space), pool_id=pid, space=task.space, scope_id=task.scope_id, units=units,
                        token=new_token(), at_ms=at_ms, holder=holder, task_id=task.id)
            for pid, units in value.items()
        ]

    def requirement_release(self, task, value: dict[str, int], at_ms: int, new_state: str) -> None:
        """Apply: the task's delivery ended (it left RUNNING for ``new_state``): its
        grants go back to their pools, which are served right after."""
        gids = self.by_task.get(task.id)
        if not gids:
            return
        for gid in list(gids):
            g = self.grants[gid]
            self._end_grant(g, "RELEASED", at_ms, "delivery_ended")
            self.coord.implied(GrantReleased(grant_id=gid, token=g.token, reason="delivery_ended",
                                             at_ms=at_ms or self.coord.events.instant(self.coord.now_ms())))
            self._kick(g.pool_id)

    def requirement_track(self, task, value: dict[str, int]) -> None:
        for pid in value:
            self.needs.setdefault(pid, set()).add(task.id)

    def requirement_untrack(self, task, value: dict[str, int]) -> None:
        for pid in value:
            s = self.needs.get(pid)
            if s is not None:
                s.discard(task.id)
                if not s:
                    del self.needs[pid]

    def requirement_views(self, task) -> dict:
        """What the delivery reply shows: ``grants`` (with their tokens)."""
        return {"grants": [self.grant_view(self.grants[g], True) for g in self.by_task.get(task.id, ())]}

    def requirement_describe(self, value: dict[str, int]) -> dict[str, int]:
        """Stored (pool id -> units) back to the wire form (pool name -> units): a
        mailbox's default requirements in its view. Pools are never purged."""
        table = self.table
        return {table[pid].name: units for pid, units in value.items()}

    # ================================================================ time, recovery
    def extend_leases(self, by_ms: int) -> None:
        coord = self.coord
        for gid in sorted(self.leased):
            g = self.grants[gid]
            g.lease_expires_ms += by_ms
            coord.touch(g.id)
            coord.arm_mono(g.lease_expires_ms, self._on_lease, (g.id, g.token, g.lease_expires_ms))
        for pid in sorted(self.queued):
            pool = self.table[pid]
            for w in self.line(pool):
                w.expires_mono_ms += by_ms
                coord.arm_mono(w.expires_mono_ms, self._on_waiter_ttl, (pid, w.request_id, w.expires_mono_ms),
                               PRIO_WAIT_END)
            coord.touch(pid)

    def rebuild_indexes(self) -> None:
        self._init_indexes()
        for pool in self.table.values():
            self.by_name[(pool.space, pool.name)] = pool.id
            self._queue_changed(pool)
            for w in self.line(pool):
                if (w.scope_id, pool.id) not in self._owned:
                    self._owned.add((w.scope_id, pool.id))
                    self.coord.runs.own(w.scope_id, pool.id)
        for g in self.grants.values():
            self._index_grant(g)

    def rearm(self) -> None:
        coord = self.coord
        for gid in self.leased:
            g = self.grants[gid]
            coord.arm_mono(g.lease_expires_ms, self._on_lease, (g.id, g.token, g.lease_expires_ms))
        for pid in self.queued:
            pool = self.table[pid]
            for w in self.line(pool):
                coord.arm_mono(w.expires_mono_ms, self._on_waiter_ttl, (pid, w.request_id, w.expires_mono_ms),
                               PRIO_WAIT_END)
            self._kick(pid)  # a crash between a release and its serving: serve now

    # ================================================================ retention
    def _grant_done(self, grant_id: str) -> bool:
        g = self.grants.get(grant_id)
        return g is None or g.state != "ACTIVE"

    def _drop_grant(self, grant_id: str) -> None:
        g = self.grants.pop(grant_id, None)
        if g is None:
            return
        if g.request_id is not None and self.by_request.get((g.pool_id, g.request_id)) == grant_id:
            del self.by_request[(g.pool_id, g.request_id)]
        self.coord.touch(grant_id)

    def purge_run(self, run_id: str) -> int:
        """The run's ended grants (RELEASED, EXPIRED). An ACTIVE grant -- a lease the
        ended run still holds -- stays until it ends. Pools themselves are named,
        space-wide entities: never purged."""
        return self.links.purge(run_id, self._grant_done, self._drop_grant)

    def purge_task_links(self, task_id: str) -> int:
        """The ended grants the task's deliveries held (admission)."""
        return self.links.purge(task_id, self._grant_done, self._drop_grant)

    # ================================================================ events
    @emits(PoolCreated)
    def _ev_created(self, r: PoolCreated):
        return ev(r.space, "pool.created", "pool", r.id, None, r.at_ms, {"name": r.name, "units_total": r.units_total})

    @emits(PoolWaiterQueued)
    def _ev_waiting(self, r: PoolWaiterQueued):
        pool = self.table[r.pool_id]
        return ev(pool.space, "pool.waiting", "pool", pool.id, r.scope_id, r.at_ms,
                  data(name=pool.name, request_id=r.request_id, units=r.units, holder=r.holder))

    @emits(PoolWaiterEnded)
    def _ev_wait_ended(self, r: PoolWaiterEnded):
        pool = self.table[r.pool_id]
        return ev(pool.space, "pool.wait_ended", "pool", pool.id, None, self.coord.events.instant(self.coord.now_ms()),
                  {"name": pool.name, "request_id": r.request_id, "reason": r.reason})

    @emits(PoolGranted)
    def _ev_granted(self, r: PoolGranted):
        return ev(r.space, "grant.acquired", "grant", r.id, r.scope_id, r.at_ms,
                  data(pool=self.table[r.pool_id].name, units=r.units, task=r.task_id, holder=r.holder,
                       request_id=r.request_id))

    @emits(GrantReleased)
    def _ev_released(self, r: GrantReleased):
        g = self.grants[r.grant_id]
        return ev(g.space, "grant.released", "grant", g.id, g.scope_id, r.at_ms,
                  {"pool": self.table[g.pool_id].name, "units": g.units, "reason": r.reason})

    @emits(GrantExpired)
    def _ev_expired(self, r: GrantExpired):
        g = self.grants[r.grant_id]
        return ev(g.space, "grant.expired", "grant", g.id, g.scope_id, r.at_ms,
                  {"pool": self.table[g.pool_id].name, "units": g.units})


def _request_id(w: PoolWaiter) -> str:
    return w.request_id
