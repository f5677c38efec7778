"""Claims: exclusive, fenced leases on a key -- "do this once, across the swarm" (SPEC §8,
runstate kernel §9).

A claim is named by a ``key`` (1-256 characters), unique per space. States::

    FREE --acquire--> HELD --release / lease runs out--> FREE (or HELD by the next waiter)
                       |--complete(result)--> COMPLETED (final: later acquirers get the result)

- **Leases and fencing.** Every lease gets the next ``generation`` (1, 2, ...: the fencing
  number to hand to outside systems) and a random ``token`` (its secret). Renew,
  release and complete carry the token; one that is not the current lease's -- a lease
  taken over after it ran out, released, or never yours -- is STALE_CLAIM and changes
  nothing. Leases run on server time (5-600 s) and are judged at request time.
- **Owning run.** Each lease records the run that acquired it; the claim's ``scope_id``
  is the run of its current (or last) lease, and the claim's actor runs in that run's
  nursery (placed at activation). Renew and complete are refused (SCOPE_CANCELLED /
  DEADLINE_EXCEEDED) once the lease's run is inactive, so holders see their lease lost;
  release stays allowed, and what was recorded stays readable.
- **Release** may leave an ``observation`` (a payload), kept and shown to the next
  acquirer (``claim.observation``). **Complete** records ``result`` exactly once; every
  later acquire, and every waiter, gets ``status=COMPLETED`` with that result.
- **Waiters** (``wait_ms`` > 0) are durable and FIFO: a ``ClaimWaiterQueued`` record puts
  the request in the claim's line (a :class:`~rallypoint.actors.waitqueue.WaitQueue` over
  ``ClaimState.waiters``) until its time limit. When the lease ends (release,
  expiry), the first waiter still in time and in an active run gets the next lease in
  the step right after (``ClaimAcquired`` with its ``request_id``) -- no polling, no
  barging: while anyone waits the claim is never FREE. The queue survives restarts.
- **Where things run.** ``acquire`` runs on the *acquiring run's* actor and a waiting
  acquire is parked there (key: its ``request_id``), so the run's end answers it through
  the run's nursery; renew/release/complete/status/cancel_wait run on the claim's actor.
- **A run's end** (the ONE step of ``ScopeEnded``/``ScopeDeadlinePassed``): every waiter
  of the run or below leaves the queue (``on_run_inactive``; each waiting run registers
  the claim with ``Runs.own``), and the run's nursery cancellation answers its parked
  acquire with the run's code (the runtime's rule: no wake-up here). The lease
  the run holds stays until released or run out (holders are asked to stop, not
  killed).
- A re-sent acquire with the same ``request_id`` finds its lease or its waiter, so the
  SDK re-sends it after a dropped connection (a daemon restart) and keeps its place.

Time the server could not hear (a restart, a stall) is given back to leases and waiters
(``extend_leases``, from ``LeasesExtended``).
"""

from __future__ import annotations

import secrets
from itertools import islice

import msgspec
import trio

from ..clock import to_iso
from ..errors import (
    ClaimHeldError,
    ConflictError,
    LeaseLostError,
    NotFoundError,
    UnavailableError,
    ValidationError,
    WaitTimeout,
)
from ..protocol import (
    NIL,
    CancelWaitView,
    ClaimAcquire,
    ClaimCancelWait,
    ClaimComplete,
    ClaimLeaseView,
    ClaimList,
    ClaimListView,
    ClaimRelease,
    ClaimRenew,
    ClaimStatus,
    ClaimView,
    ClaimWaiterView,
)
from ..records import (
    ClaimAcquired,
    ClaimCompleted,
    ClaimLeaseExpired,
    ClaimReleased,
    ClaimRenewed,
    ClaimWaiterEnded,
    ClaimWaiterQueued,
)
from ..events import emits, ev
from .common import MAX_KEY_LEN, MAX_WAIT_MS, applies, check_holder, check_payload, check_range, data, short
from .kind import Kind
from .opmark import ALWAYS, HOME, R, SPACE, W, asked, by, by_run, keyed, op
from .queue import MAX_LEASE_MS, MIN_LEASE_MS
from .runtime import PRIO_WAIT_END, Park
from .waitqueue import WaitQueue

__all__ = ["ClaimState", "ClaimWaiter", "Claims", "MAX_QUEUE_WAIT_MS", "check_request_id", "check_holder", "new_token"]

#: Longest time a durable waiter (claim or pool) stays in line, ms (24 h).
MAX_QUEUE_WAIT_MS = 24 * 3600 * 1000
_NIL_BYTES = b"\xc0"


def new_token() -> int:
    """A lease's secret: 62 random bits, never 0 (chosen in decide, kept in the record)."""
    return secrets.randbits(62) + 1


def check_request_id(value) -> None:
    if value is not None and (not isinstance(value, str) or not 1 <= len(value) <= 64):
        raise ValidationError("request_id must be 1 to 64 characters", details={"field": "request_id"})


def check_claim_key(key) -> str:
    if not isinstance(key, str) or not 1 <= len(key) <= MAX_KEY_LEN:
        raise ValidationError(f"key must be 1 to {MAX_KEY_LEN} characters", details={"field": "key"})
    return key


class ClaimWaiter(msgspec.Struct, gc=False, omit_defaults=True):
    """A durable waiter in a claim's FIFO queue. ``expires_mono_ms`` is server time."""

    request_id: str
    scope_id: str
    lease_ms: int
    expires_mono_ms: int
    queued_at_ms: int
    holder: str | None = None


class ClaimState(msgspec.Struct, gc=False, omit_defaults=True):
    """What a snapshot stores of a claim. ``token``, ``request_id``, ``holder`` are the
    current (or last) lease's; ``lease_expires_ms`` is server time; ``end_reason`` says
    how the last lease ended (released, withdrawn, expired, completed)."""

    id: str
    space: str
    key: str
    scope_id: str
    created_at_ms: int
    state: str = "FREE"  # FREE | HELD | COMPLETED
    generation: int = 0
    token: int = 0
    request_id: str | None = None
    holder: str | None = None
    lease_expires_ms: int = 0
    acquired_at_ms: int | None = None
    ended_at_ms: int | None = None
    end_reason: str | None = None
    observation: bytes | None = None
    result: bytes | None = None
    completed_at_ms: int | None = None
    waiters: list[ClaimWaiter] = []


class Claims(Kind):
    """Claims: acquire (with durable FIFO waiters), renew, release, complete, status,
    list; lease and waiter expiry; handoff to the next waiter."""

    prefix = "clm"
    name = "claims"

    def __init__(self, coord) -> None:
        super().__init__(coord)
        self.table: dict[str, ClaimState] = {}
        self._init_indexes()

    def _init_indexes(self) -> None:
        self.by_key: dict[tuple[str, str], str] = {}
        self.held: set[str] = set()  # claims with a lease (HELD)
        self.queued: set[str] = set()  # claims with waiters
        self._owned: set[tuple[str, str]] = set()  # (run, claim) registered with Runs.own
        self.lines: dict[str, WaitQueue[ClaimWaiter]] = {}  # claim -> its line (over ClaimState.waiters)

    def line(self, c: ClaimState) -> WaitQueue[ClaimWaiter]:
        """The claim's FIFO line of waiting acquires (:class:`WaitQueue`; its durable
        form is ``c.waiters``, what snapshots store)."""
        q = self.lines.get(c.id)
        if q is None:
            q = self.lines[c.id] = WaitQueue(_request_id, c.waiters)
        return q

    def entity_tables(self):
        return {"clm": (self.table, ClaimState)}

    def parent_actor_id(self, claim_id: str) -> str | None:
        run = self.table[claim_id].scope_id
        # the run of its last lease may have been purged by retention: then the root
        return run if run in self.coord.runs.table else None

    def statistics(self) -> dict:
        return {"claims": len(self.table), "held": len(self.held),
                "waiters": sum(len(self.line(self.table[c])) for c in self.queued)}

    def leases_outstanding(self) -> int:
        return len(self.held) + len(self.queued)

    # ================================================================ lookups
    def get(self, space: str, key) -> ClaimState:
        """The claim ``key`` of ``space``; NOT_FOUND (never acquired) otherwise."""
        cid = self.by_key.get((space, key)) if isinstance(key, str) else None
        if cid is None:
            raise NotFoundError(f"no claim {short(key)} in this space (acquire it first)", details={"key": key})
        return self.table[cid]

    def route(self, session, key) -> str:
        return self.get(session.space, key).id

    def view(self, c: ClaimState) -> ClaimView:
        to_wall = self.coord.clock.mono_to_wall
        return ClaimView(
            id=c.id,
            key=c.key,
            scope_id=c.scope_id,
            state=c.state,
            generation=c.generation,
            holder=c.holder,
            lease_expires_at=to_iso(to_wall(c.lease_expires_ms)) if c.state == "HELD" else None,
            acquired_at=to_iso(c.acquired_at_ms),
            observation=msgspec.Raw(c.observation) if c.observation is not None else NIL,
            result=msgspec.Raw(c.result) if c.result is not None else NIL,
            completed_at=to_iso(c.completed_at_ms),
            created_at=to_iso(c.created_at_ms),
            waiters=[
                ClaimWaiterView(scope_id=w.scope_id, holder=w.holder, queued_at=to_iso(w.queued_at_ms),
                                expires_at=to_iso(to_wall(w.expires_mono_ms)))
                for w in islice(self.line(c), 100)
            ],
        )

    def _lease_view(self, c: ClaimState, request_id: str | None = None) -> ClaimLeaseView:
        if c.state == "COMPLETED":
            return ClaimLeaseView(status="COMPLETED", claim=self.view(c), request_id=request_id)
        return ClaimLeaseView(status="ACQUIRED", claim=self.view(c), token=c.token, request_id=c.request_id)

    # ================================================================ acquire
    @op(ClaimAcquire, route=by_run(), permission=W, resend=keyed("request_id"), waits=asked("wait_ms"), shard=HOME,
        reply=ClaimLeaseView)
    def op_claim_acquire(self, actor, session, op: ClaimAcquire):
        """Acquire the lease on ``op.key`` for run ``op.scope_id`` (runs on that run's
        actor). Returns ACQUIRED (a new lease: generation + 1), COMPLETED (the recorded
        result) or, after waiting up to 60 s in line, WAITING (re-send with the same
        ``request_id``). Raises VALIDATION_FAILED (key, lease 5-600 s, wait 0-24 h,
        holder, request_id), NOT_FOUND (run), SCOPE_CANCELLED / DEADLINE_EXCEEDED (the
        run is inactive), CLAIM_HELD (held and ``wait_ms`` is 0, with ``retry_after``
        = the seconds the lease has left), TIMEOUT (a waiter whose time limit ran out)."""
        coord = self.coord
        space = session.space
        run = coord.runs.get(space, op.scope_id)
        check_claim_key(op.key)
        check_range("lease_ms", op.lease_ms, MIN_LEASE_MS, MAX_LEASE_MS, " ms")
        check_range("wait_ms", op.wait_ms, 0, MAX_QUEUE_WAIT_MS, " ms")
        check_holder(op.holder)
        check_request_id(op.request_id)
        coord.runs.require_active(run.id)
        rid = op.request_id
        cid = self.by_key.get((space, op.key))
        c = self.table[cid] if cid is not None else None
        if c is not None:
            self._settle_expiry(c)
            if c.state == "FREE" and self.line(c):
                self._handoff(c)  # (a crash between a release and its handoff) never barge
            if rid is not None:
                if c.request_id == rid and c.state == "HELD":
                    return self._lease_view(c)  # a re-sent acquire that was applied
                w = self.line(c).get(rid)
                if w is not None:
                    if w.scope_id != run.id:
                        raise ConflictError(f"request_id {rid!r} is a waiter of run {w.scope_id}, not {run.id}",
                                            details={"field": "request_id"})
                    return self._park(c, w)
            if c.state == "COMPLETED":
                return self._lease_view(c, rid)
        if c is None or c.state == "FREE":
            now = coord.now_ms()
            new_id = cid or coord.new_id("clm", space=session.space)
            coord.commit([ClaimAcquired(
                claim_id=new_id, space=space, key=op.key, scope_id=run.id,
                generation=(c.generation if c else 0) + 1, token=new_token(),
                lease_expires_ms=coord.mono_ms() + op.lease_ms, at_ms=now, holder=op.holder, request_id=rid,
            )])
            return self._lease_view(self.table[new_id])
        if op.wait_ms == 0:
            raise self._held(c)
        if rid is None:
            rid = "srv-" + coord.ids.new("req")[4:]
        mono = coord.mono_ms()
        coord.commit([ClaimWaiterQueued(
            claim_id=c.id, request_id=rid, scope_id=run.id, lease_ms=op.lease_ms,
            expires_mono_ms=mono + op.wait_ms, at_ms=coord.now_ms(), holder=op.holder,
        )])
        return self._park(c, self.line(c).get(rid))

    def _held(self, c: ClaimState) -> ClaimHeldError:
        left_ms = max(0, c.lease_expires_ms - self.coord.mono_ms())
        return ClaimHeldError(
            f"claim {c.key!r} is held (generation {c.generation}, holder {c.holder or 'unnamed'}) for "
            f"{left_ms / 1000:.1f} s more unless renewed; acquire with wait to queue for it",
            retry_after=max(0.1, left_ms / 1000),
            details={"key": c.key, "generation": c.generation, "holder": c.holder, "waiters": len(self.line(c))},
        )

    def _park(self, c: ClaimState, w: ClaimWaiter) -> Park:
        """Park the acquire of waiter ``w`` on the current actor (its run's): answered
        when the waiter gets the lease or the result, leaves the queue, or after up to
        60 s (WAITING: re-send)."""
        rid = w.request_id
        line = self.line(c)
        left = w.expires_mono_ms - self.coord.mono_ms()
        park_ms = max(0, min(MAX_WAIT_MS, left))

        def check():
            if c.request_id == rid and c.state == "HELD":
                return self._lease_view(c)
            if c.state == "COMPLETED":
                return self._lease_view(c, rid)
            if rid in line or self.coord.runs.inactive_error(w.scope_id) is not None:
                # still in line; or it left with its run's end, whose nursery cancellation
                # answers this acquire with the run's code (the runtime's one rule)
                return None
            raise WaitTimeout(
                f"claim {c.key!r} is still held; this acquire's wait ran out or was withdrawn",
                details={"key": c.key, "request_id": rid},
            )

        def expire():
            pos = line.position(rid)
            if pos == 0:
                return check()
            return ClaimLeaseView(status="WAITING", claim=self.view(c), request_id=rid, position=pos)

        return Park(rid, check, park_ms, expire)

    def _settle_expiry(self, c: ClaimState) -> None:
        """A lease past its time is expired before anything is decided about the claim
        (its activity normally did this already, before the batch)."""
        if c.state == "HELD" and c.lease_expires_ms <= self.coord.mono_ms():
            self._on_lease((c.id, c.token, c.lease_expires_ms))

    @applies(ClaimAcquired)
    def _apply_acquired(self, r: ClaimAcquired) -> None:
        c = self.table.get(r.claim_id)
        if c is None:
            c = ClaimState(id=r.claim_id, space=r.space, key=r.key, scope_id=r.scope_id, created_at_ms=r.at_ms)
            self.table[c.id] = c
            self.by_key[(c.space, c.key)] = c.id
        c.scope_id = r.scope_id
        c.state = "HELD"
        c.generation = r.generation
        c.token = r.token
        c.request_id = r.request_id
        c.holder = r.holder
        c.lease_expires_ms = r.lease_expires_ms
        c.acquired_at_ms = r.at_ms
        c.ended_at_ms = None
        c.end_reason = None
        self.held.add(c.id)
        if r.request_id is not None and self.line(c).remove(r.request_id) is not None:
            self._queue_changed(c)
            self.coord.notify(r.scope_id, r.request_id)  # the waiter's parked acquire
        self.coord.touch(c.id)
        self.coord.arm_mono(r.lease_expires_ms, self._on_lease, (c.id, r.token, r.lease_expires_ms))

    @applies(ClaimWaiterQueued)
    def _apply_waiter_queued(self, r: ClaimWaiterQueued) -> None:
        c = self.table[r.claim_id]
        self.line(c).add(ClaimWaiter(request_id=r.request_id, scope_id=r.scope_id, lease_ms=r.lease_ms,
                                     expires_mono_ms=r.expires_mono_ms, queued_at_ms=r.at_ms, holder=r.holder))
        self._queue_changed(c)
        self._own(r.scope_id, c.id)
        self.coord.touch(c.id)
        self.coord.arm_mono(r.expires_mono_ms, self._on_waiter_ttl, (c.id, r.request_id, r.expires_mono_ms),
                            PRIO_WAIT_END)

    @applies(ClaimWaiterEnded)
    def _apply_waiter_ended(self, r: ClaimWaiterEnded) -> None:
        c = self.table[r.claim_id]
        w = self.line(c).remove(r.request_id)
        if w is not None:
            self._queue_changed(c)
            self.coord.touch(c.id)
            self.coord.notify(w.scope_id, w.request_id)

    def _own(self, run_id: str, claim_id: str) -> None:
        if (run_id, claim_id) not in self._owned:
            self._owned.add((run_id, claim_id))
            self.coord.runs.own(run_id, claim_id)

    def _queue_changed(self, c: ClaimState) -> None:
        if self.line(c):
            self.queued.add(c.id)
        else:
            self.queued.discard(c.id)

    # ================================================================ the holder's calls
    def _holder(self, session, key, token: int) -> ClaimState:
        """The claim whose *current live* lease has ``token`` (at request time), else
        STALE_CLAIM saying why."""
        c = self.get(session.space, key)
        self._settle_expiry(c)
        if c.state != "HELD" or c.token != token or token <= 0:
            raise self._stale(c, token)
        return c

    def _stale(self, c: ClaimState, token: int) -> LeaseLostError:
        if c.state == "COMPLETED":
            why = "the claim was completed"
        elif c.token == token and token > 0:
            why = f"the lease was {c.end_reason or 'ended'}"
        else:
            why = f"it is not the current lease (generation {c.generation}); it was taken over, or never yours"
        return LeaseLostError(
            f"the lease on claim {c.key!r} is lost: {why}",
            details={"key": c.key, "generation": c.generation, "state": c.state},
        )

    @op(ClaimRenew, route=by("key"), permission=W, resend=ALWAYS)
    def op_claim_renew(self, actor, session, op: ClaimRenew) -> ClaimLeaseView:
        """Extend the live lease by ``lease_ms`` (5-600 s) from now. STALE_CLAIM when the
        token is not the current live lease's; SCOPE_CANCELLED / DEADLINE_EXCEEDED when
        the lease's run is inactive (the holder must stop)."""
        c = self._holder(session, op.key, op.token)
        check_range("lease_ms", op.lease_ms, MIN_LEASE_MS, MAX_LEASE_MS, " ms")
        self.coord.runs.require_active(c.scope_id)
        self.coord.commit([ClaimRenewed(claim_id=c.id, token=c.token, lease_expires_ms=self.coord.mono_ms() + op.lease_ms)])
        return self._lease_view(c)

    @applies(ClaimRenewed)
    def _apply_renewed(self, r: ClaimRenewed) -> None:
        c = self.table[r.claim_id]
        c.lease_expires_ms = r.lease_expires_ms
        self.coord.touch(c.id)
        self.coord.arm_mono(r.lease_expires_ms, self._on_lease, (c.id, r.token, r.lease_expires_ms))

    @op(ClaimRelease, route=by("key"), permission=W, resend=ALWAYS)
    def op_claim_release(self, actor, session, op: ClaimRelease) -> ClaimView:
        """End the lease, leaving ``observation`` for the next acquirer; the first waiter
        in line gets the next lease at once. Allowed on an inactive run. Idempotent for
        the lease's own token (a second release returns the claim); STALE_CLAIM for any
        other token or a lease that ran out."""
        c = self.get(session.space, op.key)
        self._settle_expiry(c)
        if c.token == op.token and op.token > 0 and c.state == "FREE" and c.end_reason in ("released", "withdrawn"):
            return self.view(c)  # released already (a re-sent release)
        c = self._holder(session, op.key, op.token)
        observation = check_payload("observation", op.observation)
        self._release(c, None if observation == _NIL_BYTES else observation, "released")
        return self.view(c)

    def _release(self, c: ClaimState, observation: bytes | None, reason: str) -> None:
        coord = self.coord
        coord.commit([ClaimReleased(claim_id=c.id, token=c.token, at_ms=coord.now_ms(), observation=observation,
                                    reason=reason)])
        self._handoff_or_later(c)

    @applies(ClaimReleased)
    def _apply_released(self, r: ClaimReleased) -> None:
        c = self.table[r.claim_id]
        if r.observation is not None or r.reason == "released":
            c.observation = r.observation
        self._end_lease(c, r.at_ms, r.reason)

    def _end_lease(self, c: ClaimState, at_ms: int, reason: str) -> None:
        c.state = "FREE"
        c.ended_at_ms = at_ms
        c.end_reason = reason
        self.held.discard(c.id)
        self.coord.touch(c.id)

    @op(ClaimComplete, route=by("key"), permission=W, resend=ALWAYS)
    def op_claim_complete(self, actor, session, op: ClaimComplete) -> ClaimView:
        """Record ``result`` (a payload) once, for good: the claim is COMPLETED, every
        waiter and every later acquire gets the result. STALE_CLAIM for a stale token or
        a lost lease; SCOPE_CANCELLED / DEADLINE_EXCEEDED on an inactive run. A re-sent
        complete of the same lease returns the claim."""
        c = self.get(session.space, op.key)
        if c.state == "COMPLETED" and c.token == op.token and op.token > 0:
            return self.view(c)
        c = self._holder(session, op.key, op.token)
        result = check_payload("result", op.result)
        self.coord.runs.require_active(c.scope_id)
        self.coord.commit([ClaimCompleted(claim_id=c.id, token=c.token, result=result, at_ms=self.coord.now_ms())])
        return self.view(c)

    @applies(ClaimCompleted)
    def _apply_completed(self, r: ClaimCompleted) -> None:
        c = self.table[r.claim_id]
        c.result = r.result
        c.completed_at_ms = r.at_ms
        self._end_lease(c, r.at_ms, "completed")
        c.state = "COMPLETED"
        waiters = self.line(c).clear()
        self._queue_changed(c)
        notify = self.coord.notify
        for w in waiters:  # every waiter gets the result
            notify(w.scope_id, w.request_id)

    @op(ClaimCancelWait, route=by("key"), permission=W, resend=ALWAYS)
    def op_claim_cancel_wait(self, actor, session, op: ClaimCancelWait) -> CancelWaitView:
        """Withdraw acquire ``request_id`` (its client gave up): its waiter leaves the
        queue, or, if it was already given the lease, the lease is released (and handed
        to the next waiter). Idempotent."""
        c = self.get(session.space, op.key)
        check_request_id(op.request_id)
        self._settle_expiry(c)
        if op.request_id in self.line(c):
            self.coord.commit([ClaimWaiterEnded(claim_id=c.id, request_id=op.request_id, reason="withdrawn")])
            return CancelWaitView(outcome="withdrawn")
        if c.state == "HELD" and c.request_id == op.request_id:
            self._release(c, None, "withdrawn")
            return CancelWaitView(outcome="released")
        return CancelWaitView(outcome="none")

    # ================================================================ reads
    @op(ClaimStatus, route=by("key"), permission=R, resend=ALWAYS)
    def op_claim_status(self, actor, session, op: ClaimStatus) -> ClaimView:
        """The claim (never its token); readable in any run state."""
        return self.view(self.get(session.space, op.key))

    @op(ClaimList, route=SPACE, permission=R, resend=ALWAYS)
    def op_claim_list(self, actor, session, op: ClaimList) -> ClaimListView:
        """Claims of the space in key order, filtered by ``state``; ``after`` a key."""
        check_range("limit", op.limit, 1, 10_000)
        if op.state is not None and op.state not in ("FREE", "HELD", "COMPLETED"):
            raise ValidationError("state must be FREE, HELD or COMPLETED", details={"field": "state"})
        keys = sorted(k for (sp, k) in self.by_key if sp == session.space and (op.after is None or k > op.after))
        out = []
        for k in keys:
            c = self.table[self.by_key[(session.space, k)]]
            if op.state is None or c.state == op.state:
                out.append(self.view(c))
                if len(out) >= op.limit:
                    break
        return ClaimListView(claims=out)

    # ================================================================ activities
    def _on_lease(self, arg) -> None:
        claim_id, token, expires = arg
        c = self.table.get(claim_id)
        if c is None or c.state != "HELD" or c.token != token or c.lease_expires_ms != expires:
            return
        coord = self.coord
        coord.commit([ClaimLeaseExpired(claim_id=claim_id, token=token, at_ms=coord.clock.mono_to_wall(expires))])
        self._handoff_or_later(c)

    @applies(ClaimLeaseExpired)
    def _apply_lease_expired(self, r: ClaimLeaseExpired) -> None:
        self._end_lease(self.table[r.claim_id], r.at_ms, "expired")

    def _on_waiter_ttl(self, arg) -> None:
        claim_id, rid, expires = arg
        c = self.table.get(claim_id)
        w = self.line(c).get(rid) if c is not None else None
        if w is None or w.expires_mono_ms != expires:
            return
        self.coord.commit([ClaimWaiterEnded(claim_id=claim_id, request_id=rid, reason="expired")])

    def _handoff_or_later(self, c: ClaimState) -> None:
        """The handoff right after the commit that freed the claim; if the journal
        refuses it (disk full: UNAVAILABLE before anything is applied), an activity due
        at once does it, retried by the heap until the journal takes it."""
        try:
            self._handoff(c)
        except UnavailableError:
            if not self.coord.replaying:
                self.coord.heap.arm(trio.current_time(), self._on_handoff, c.id)

    def _handoff(self, c: ClaimState) -> None:
        """A FREE claim with waiters: the first waiter still in time and in an active run
        gets the next lease (those out of time or run leave the queue), in one commit. A
        waiter whose time limit is this very instant is still in time (a wait's deadline
        sees what fell due at or before it)."""
        line = self.line(c)
        if c.state != "FREE" or not line:
            return
        coord = self.coord
        mono = coord.mono_ms()
        now = coord.now_ms()
        inactive = coord.runs.inactive_error
        leaving, served = line.plan(lambda w: w.expires_mono_ms < mono or inactive(w.scope_id) is not None,
                                    lambda w: True, limit=1)
        recs: list = [ClaimWaiterEnded(claim_id=c.id, request_id=w.request_id,
                                       reason="expired" if w.expires_mono_ms < mono else "cancelled")
                      for w in leaving]
        for w in served:
            recs.append(ClaimAcquired(
                claim_id=c.id, space=c.space, key=c.key, scope_id=w.scope_id, generation=c.generation + 1,
                token=new_token(), lease_expires_ms=mono + w.lease_ms, at_ms=now, holder=w.holder,
                request_id=w.request_id,
            ))
        if recs:
            coord.commit(recs)

    # ================================================================ runs, time, recovery
    def on_run_inactive(self, claim_id: str, at_ms: int, reason: str) -> None:
        """A run that queued on this claim went inactive: its waiters (and those of every
        other run now inactive) leave the line. Their parked acquires are in their runs'
        actors, inside the ended subtree: the nursery cancellation answers them with the
        run's code (no wake-up here). The claim stays HELD or FREE: a lease is never taken
        from its holder here, and a FREE claim has no waiters, so nobody is left to serve."""
        c = self.table[claim_id]
        line = self.line(c)
        if not line:
            return
        inactive = self.coord.runs.inactive_error
        gone = line.remove_where(lambda w: inactive(w.scope_id, at_ms) is not None)
        if gone:
            self._queue_changed(c)
            self.coord.touch(c.id)
            for w in gone:
                self.coord.implied(ClaimWaiterEnded(claim_id=c.id, request_id=w.request_id, reason="cancelled"))

    def extend_leases(self, by_ms: int) -> None:
        coord = self.coord
        for cid in sorted(self.held | self.queued):
            c = self.table[cid]
            if c.state == "HELD":
                c.lease_expires_ms += by_ms
                coord.arm_mono(c.lease_expires_ms, self._on_lease, (c.id, c.token, c.lease_expires_ms))
            for w in self.line(c):
                w.expires_mono_ms += by_ms
                coord.arm_mono(w.expires_mono_ms, self._on_waiter_ttl, (c.id, w.request_id, w.expires_mono_ms),
                               PRIO_WAIT_END)
            coord.touch(c.id)

    def rebuild_indexes(self) -> None:
        self._init_indexes()
        for c in self.table.values():
            self.by_key[(c.space, c.key)] = c.id
            if c.state == "HELD":
                self.held.add(c.id)
            self._queue_changed(c)
            for w in self.line(c):
                self._own(w.scope_id, c.id)

    def rearm(self) -> None:
        coord = self.coord
        for c in self.table.values():
            if c.state == "HELD":
                coord.arm_mono(c.lease_expires_ms, self._on_lease, (c.id, c.token, c.lease_expires_ms))
            for w in self.line(c):
                coord.arm_mono(w.expires_mono_ms, self._on_waiter_ttl, (c.id, w.request_id, w.expires_mono_ms),
                               PRIO_WAIT_END)
            if c.state == "FREE" and self.line(c):  # a crash between a release and its handoff
                coord.heap.arm(trio.current_time(), self._on_handoff, c.id)

    def _on_handoff(self, claim_id: str) -> None:
        self._handoff(self.table[claim_id])

    # ================================================================ events
    # Claims are named, space-wide entities (like pools and work queues): retention never
    # purges them -- a later acquire of the key must see its generation (the fencing
    # number) go on, and a COMPLETED claim's result is for every later acquirer.
    @emits(ClaimAcquired)
    def _ev_acquired(self, r: ClaimAcquired):
        return ev(r.space, "claim.acquired", "claim", r.claim_id, r.scope_id, r.at_ms,
                  data(key=r.key, generation=r.generation, holder=r.holder, request_id=r.request_id))

    @emits(ClaimWaiterQueued)
    def _ev_waiting(self, r: ClaimWaiterQueued):
        c = self.table[r.claim_id]
        return ev(c.space, "claim.waiting", "claim", c.id, r.scope_id, r.at_ms,
                  data(key=c.key, request_id=r.request_id, holder=r.holder))

    @emits(ClaimWaiterEnded)
    def _ev_wait_ended(self, r: ClaimWaiterEnded):
        c = self.table[r.claim_id]
        return ev(c.space, "claim.wait_ended", "claim", c.id, None, self.coord.events.instant(self.coord.now_ms()),
                  {"key": c.key, "request_id": r.request_id, "reason": r.reason})

    @emits(ClaimReleased)
    def _ev_released(self, r: ClaimReleased):
        c = self.table[r.claim_id]
        return ev(c.space, "claim.released", "claim", c.id, c.scope_id, r.at_ms,
                  {"key": c.key, "generation": c.generation, "reason": r.reason})

    @emits(ClaimLeaseExpired)
    def _ev_expired(self, r: ClaimLeaseExpired):
        c = self.table[r.claim_id]
        return ev(c.space, "claim.expired", "claim", c.id, c.scope_id, r.at_ms,
                  {"key": c.key, "generation": c.generation})

    @emits(ClaimCompleted)
    def _ev_completed(self, r: ClaimCompleted):
        c = self.table[r.claim_id]
        return ev(c.space, "claim.completed", "claim", c.id, c.scope_id, r.at_ms,
                  {"key": c.key, "generation": c.generation})




def _request_id(w: ClaimWaiter) -> str:
    return w.request_id
