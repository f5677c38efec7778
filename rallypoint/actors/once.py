"""Once: exactly one successful execution per (run, key) (runstate 0.3 ``@once``).

A once is OPEN (nobody holds it), HELD (a holder's fenced lease is live), DONE (a holder
recorded its ``result``: every later acquire gets the result) or FAILED (the failures
reached the caller's ``max_attempts``: final for that run and key).

- ``acquire`` on an OPEN once gives the caller a lease and a new fencing ``token``
  (``OnceAcquired``; the first acquire makes the entity). While a lease is live every
  other acquire -- the same holder and session included: a once is not re-entrant --
  answers HELD. DONE and FAILED are answered to anyone, also after the run ended.
- ``renew``, ``complete`` and ``fail`` present the token; another is STALE_CLAIM, as is a
  lease that ran out (server time). ``fail`` counts the attempt: FAILED once the failures
  reach ``max_attempts``, else OPEN for the next caller (the failing caller does not
  retry by itself).
- A lease that runs out without complete or fail (the holder died, or was interrupted)
  makes the once OPEN again (``OnceLeaseExpired``), without counting an attempt.
- ``get`` with ``wait_ms`` parks until the once is no longer HELD.

Where things run: a once belongs to its run; every command about it runs on the run's
actor and a ``get`` waits there, so the run's end answers the waits (with the state as
it is: HELD until the lease runs out; the next acquire is then SCOPE_CANCELLED).
Renewals on an inactive run are refused with the run's code, which tells a holder its
run stopped; complete and fail stay fenced by the token only.
"""

from __future__ import annotations

import msgspec

from ..clock import to_iso
from ..errors import LeaseLostError, NotFoundError, ValidationError
from ..protocol import NIL, OnceAcquire, OnceComplete, OnceFail, OnceGet, OnceRenew, OnceView
from ..records import OnceAcquired, OnceCompleted, OnceFailed, OnceLeaseExpired, OnceRenewed
from ..events import emits, ev
from .common import applies, check_label, check_payload, check_range, clamp_wait, data, short
from .kind import Kind, Links
from .opmark import ALWAYS, NEVER, R, W, asked, by_run, op
from .runtime import Park

__all__ = ["OnceState", "Onces"]

MIN_LEASE_MS = 5_000
MAX_LEASE_MS = 600_000
MAX_KEY = 512
MAX_ERROR = 2_000


class OnceState(msgspec.Struct, gc=False, omit_defaults=True):
    """What a snapshot stores of a once. ``lease_expires_ms`` is server time; the other
    instants wall time. ``attempts``: failed attempts so far."""

    id: str
    space: str
    scope_id: str
    key: str
    created_at_ms: int
    state: str = "OPEN"  # OPEN | HELD | DONE | FAILED
    token: int = 0
    holder: str | None = None
    holder_session: str | None = None
    lease_expires_ms: int = 0
    attempts: int = 0
    last_error: str | None = None
    result: bytes | None = None
    finished_at_ms: int | None = None


class Onces(Kind):
    """Once keys of runs: acquire, get (wait), renew, complete, fail; lease expiry."""

    prefix = "onc"
    name = "onces"
    noun = "once"

    def __init__(self, coord) -> None:
        super().__init__(coord)
        self.table: dict[str, OnceState] = {}
        self.by_key: dict[tuple[str, str], str] = {}  # (run, key) -> once id
        self.held_ids: set[str] = set()  # HELD onces (a live lease)
        self.links = Links()  # retention: run -> its onces

    def entity_tables(self):
        return {"onc": (self.table, OnceState)}

    def parent_actor_id(self, once_id: str) -> str | None:
        return self.table[once_id].scope_id

    # ------------------------------------------------------------------ lookups
    def find(self, space: str, scope_id: str, key: str) -> OnceState | None:
        run = self.coord.runs.get(space, scope_id)
        oid = self.by_key.get((run.id, key))
        return self.table[oid] if oid is not None else None

    def view(self, o: OnceState, *, state: str | None = None, token: int = 0) -> OnceView:
        live = o.state == "HELD"
        return OnceView(
            id=o.id, scope_id=o.scope_id, key=o.key, state=state or o.state, attempts=o.attempts, token=token,
            holder=o.holder if live else None,
            lease_expires_at=to_iso(self.coord.clock.mono_to_wall(o.lease_expires_ms)) if live else None,
            result=msgspec.Raw(o.result) if o.result is not None else NIL,
            last_error=o.last_error, created_at=to_iso(o.created_at_ms), finished_at=to_iso(o.finished_at_ms),
        )

    def _open_view(self, scope_id: str, key: str) -> OnceView:
        return OnceView(id="", scope_id=scope_id, key=key, state="OPEN", attempts=0)

    def _held(self, space: str, op) -> OnceState:
        """The once ``op`` names, held under ``op.token`` with a live lease; STALE_CLAIM
        otherwise (NOT_FOUND for a key never acquired)."""
        o = self.find(space, op.scope_id, op.key)
        if o is None:
            raise NotFoundError(f"no once {short(op.key)} in run {op.scope_id}", details={"key": op.key})
        if o.state != "HELD" or o.token != op.token or o.lease_expires_ms <= self.coord.mono_ms():
            what = {"DONE": "it is done", "FAILED": "it failed for good"}.get(o.state, "the lease is no longer yours")
            raise LeaseLostError(f"token {op.token} does not hold once {short(op.key)}: {what}",
                                 details={"key": op.key, "state": o.state})
        return o

    # ------------------------------------------------------------------ ops
    @op(OnceAcquire, route=by_run(), permission=W, resend=NEVER)
    def op_once_acquire(self, actor, session, op: OnceAcquire) -> OnceView:
        """ACQUIRED (with ``token``), HELD, DONE or FAILED (see the module doc).
        VALIDATION_FAILED (key, lease), NOT_FOUND (run), SCOPE_CANCELLED /
        DEADLINE_EXCEEDED (the run refuses new work; DONE/FAILED are still answered)."""
        coord = self.coord
        check_label("key", op.key, MAX_KEY)
        check_range("lease_ms", op.lease_ms, MIN_LEASE_MS, MAX_LEASE_MS, " ms")
        o = self.find(session.space, op.scope_id, op.key)
        if o is not None and o.state in ("DONE", "FAILED"):
            return self.view(o)
        coord.runs.require_active(op.scope_id)
        now_mono = coord.mono_ms()
        if o is not None and o.state == "HELD":
            if o.lease_expires_ms > now_mono:
                return self.view(o)
        token = (o.token if o is not None else 0) + 1
        rec = OnceAcquired(
            id=o.id if o is not None else coord.new_id("onc", under=op.scope_id), space=session.space, scope_id=op.scope_id,
            key=op.key, token=token, lease_expires_ms=now_mono + op.lease_ms, at_ms=coord.now_ms(),
            holder=op.holder, holder_session=op.holder_session,
        )
        coord.commit([rec])
        return self.view(self.table[rec.id], state="ACQUIRED", token=token)

    @applies(OnceAcquired)
    def _apply_acquired(self, r: OnceAcquired) -> None:
        o = self.table.get(r.id)
        if o is None:
            o = OnceState(id=r.id, space=r.space, scope_id=r.scope_id, key=r.key, created_at_ms=r.at_ms)
            self.table[o.id] = o
            self.by_key[(o.scope_id, o.key)] = o.id
            self.links.add(o.scope_id, o.id)
        o.state = "HELD"
        self.held_ids.add(o.id)
        o.token = r.token
        o.holder = r.holder
        o.holder_session = r.holder_session
        o.lease_expires_ms = r.lease_expires_ms
        self.coord.touch(o.id)
        self.coord.arm_mono(r.lease_expires_ms, self._on_lease, (o.id, r.token, r.lease_expires_ms))

    @op(OnceGet, route=by_run(), permission=R, resend=ALWAYS, waits=asked("wait_ms"), reply=OnceView)
    def op_once_get(self, actor, session, op: OnceGet):
        """The once now (OPEN if never acquired); with ``wait_ms`` (at most 60 s) parks
        on the run's actor until it is no longer HELD."""
        o = self.find(session.space, op.scope_id, op.key)
        if o is None:
            return self._open_view(op.scope_id, op.key)
        wait_ms = clamp_wait(op.wait_ms)
        if o.state != "HELD" or wait_ms == 0:
            return self.view(o)
        view = self.view
        return Park(("once", o.id), lambda: None if o.state == "HELD" else view(o), wait_ms, lambda: view(o))

    @op(OnceRenew, route=by_run(), permission=W, resend=ALWAYS)
    def op_once_renew(self, actor, session, op: OnceRenew) -> OnceView:
        """Extend the lease to now + ``lease_ms``. STALE_CLAIM (token, lost lease);
        SCOPE_CANCELLED / DEADLINE_EXCEEDED when the run stopped (the holder must stop)."""
        check_range("lease_ms", op.lease_ms, MIN_LEASE_MS, MAX_LEASE_MS, " ms")
        o = self._held(session.space, op)
        self.coord.runs.require_active(o.scope_id)
        expires = self.coord.mono_ms() + op.lease_ms
        self.coord.commit([OnceRenewed(id=o.id, token=o.token, lease_expires_ms=expires)])
        return self.view(o)

    @applies(OnceRenewed)
    def _apply_renewed(self, r: OnceRenewed) -> None:
        o = self.table[r.id]
        o.lease_expires_ms = r.lease_expires_ms
        self.coord.touch(o.id)
        self.coord.arm_mono(r.lease_expires_ms, self._on_lease, (o.id, r.token, r.lease_expires_ms))

    @op(OnceComplete, route=by_run(), permission=W, resend=ALWAYS)
    def op_once_complete(self, actor, session, op: OnceComplete) -> OnceView:
        """DONE with ``result`` (at most 64 KiB encoded; VALIDATION_FAILED "result
        exceeds N bytes"). STALE_CLAIM for a stale token or a lost lease; the same
        token completing again with the same result answers DONE."""
        data = check_payload("result", op.result)
        o = self.find(session.space, op.scope_id, op.key)
        if o is not None and o.state == "DONE" and o.token == op.token and o.result == data:
            return self.view(o)
        o = self._held(session.space, op)
        self.coord.commit([OnceCompleted(id=o.id, token=o.token, result=data, at_ms=self.coord.now_ms())])
        return self.view(o)

    @applies(OnceCompleted)
    def _apply_completed(self, r: OnceCompleted) -> None:
        o = self.table[r.id]
        o.state = "DONE"
        self.held_ids.discard(o.id)
        o.result = r.result
        o.finished_at_ms = r.at_ms
        o.lease_expires_ms = 0
        self.coord.touch(o.id)
        self.coord.notify(o.scope_id, ("once", o.id))

    @op(OnceFail, route=by_run(), permission=W, resend=NEVER)
    def op_once_fail(self, actor, session, op: OnceFail) -> OnceView:
        """Count a failed attempt with ``error``: FAILED when the failures reach
        ``max_attempts`` (1-100), else OPEN. STALE_CLAIM for a stale token."""
        check_range("max_attempts", op.max_attempts, 1, 100)
        if not isinstance(op.error, str) or len(op.error) > MAX_ERROR:
            raise ValidationError(f"error must be a string of at most {MAX_ERROR} characters",
                                  details={"field": "error"})
        o = self._held(session.space, op)
        final = o.attempts + 1 >= op.max_attempts
        self.coord.commit([OnceFailed(id=o.id, token=o.token, error=op.error, final=final,
                                      at_ms=self.coord.now_ms())])
        return self.view(o)

    @applies(OnceFailed)
    def _apply_failed(self, r: OnceFailed) -> None:
        o = self.table[r.id]
        o.attempts += 1
        o.last_error = r.error
        o.lease_expires_ms = 0
        o.state = "FAILED" if r.final else "OPEN"
        self.held_ids.discard(o.id)
        if r.final:
            o.finished_at_ms = r.at_ms
        self.coord.touch(o.id)
        self.coord.notify(o.scope_id, ("once", o.id))

    # ------------------------------------------------------------------ lease expiry
    def _on_lease(self, arg) -> None:
        once_id, token, expires = arg
        o = self.table.get(once_id)
        if o is None or o.state != "HELD" or o.token != token or o.lease_expires_ms != expires:
            return
        self.coord.commit([OnceLeaseExpired(id=o.id, token=token, at_ms=self.coord.now_ms())])

    @applies(OnceLeaseExpired)
    def _apply_lease_expired(self, r: OnceLeaseExpired) -> None:
        o = self.table[r.id]
        o.state = "OPEN"
        o.lease_expires_ms = 0
        self.held_ids.discard(o.id)
        self.coord.touch(o.id)
        self.coord.notify(o.scope_id, ("once", o.id))

    def extend_leases(self, by_ms: int) -> None:
        """``LeasesExtended`` (a restart or a stall): the server could not hear the
        holders for ``by_ms``; give it back (in that record's apply)."""
        for oid in sorted(self.held_ids):
            o = self.table[oid]
            if o.state == "HELD":
                o.lease_expires_ms += by_ms
                self.coord.touch(o.id)
                self.coord.arm_mono(o.lease_expires_ms, self._on_lease, (o.id, o.token, o.lease_expires_ms))

    def held(self):
        """The HELD onces (for diagnostics)."""
        return [self.table[i] for i in sorted(self.held_ids)]

    def leases_outstanding(self) -> int:
        return len(self.held_ids)

    # ------------------------------------------------------------------ recovery
    def rebuild_indexes(self) -> None:
        self.by_key = {(o.scope_id, o.key): o.id for o in self.table.values()}
        self.held_ids = {o.id for o in self.table.values() if o.state == "HELD"}
        self.links = Links()
        for o in self.table.values():
            self.links.add(o.scope_id, o.id)

    # ================================================================ retention
    def _once_done(self, once_id: str) -> bool:
        o = self.table.get(once_id)
        return o is None or o.state != "HELD"

    def _drop(self, once_id: str) -> None:
        o = self.table.pop(once_id, None)
        if o is None:
            return
        if self.by_key.get((o.scope_id, o.key)) == once_id:
            del self.by_key[(o.scope_id, o.key)]
        self.coord.touch(once_id)

    def purge_run(self, run_id: str) -> int:
        """A once belongs to its run: purged with it (a HELD one -- a live lease in the
        ended run -- stays until its lease ends)."""
        return self.links.purge(run_id, self._once_done, self._drop)

    # ================================================================ events
    @emits(OnceAcquired)
    def _ev_acquired(self, r: OnceAcquired):
        return ev(r.space, "once.acquired", "once", r.id, r.scope_id, r.at_ms,
                  data(key=r.key, holder=r.holder, attempts=self.table[r.id].attempts))

    @emits(OnceCompleted)
    def _ev_completed(self, r: OnceCompleted):
        o = self.table[r.id]
        return ev(o.space, "once.completed", "once", o.id, o.scope_id, r.at_ms, {"key": o.key})

    @emits(OnceFailed)
    def _ev_failed(self, r: OnceFailed):
        o = self.table[r.id]
        return ev(o.space, "once.failed", "once", o.id, o.scope_id, r.at_ms,
                  {"key": o.key, "final": r.final, "attempts": o.attempts, "error": r.error[:200]})

    @emits(OnceLeaseExpired)
    def _ev_lease_expired(self, r: OnceLeaseExpired):
        o = self.table[r.id]
        return ev(o.space, "once.lease_expired", "once", o.id, o.scope_id, r.at_ms, {"key": o.key})

    def rearm(self) -> None:
        for o in self.table.values():
            if o.state == "HELD":
                self.coord.arm_mono(o.lease_expires_ms, self._on_lease, (o.id, o.token, o.lease_expires_ms))
