"""Durable timers (SPEC §7): ARMED -> FIRED -> ACKED; ARMED -> CANCELLED.

A timer fires on the server whether or not anyone waits (a ``TimerFired`` record at its
due time) and survives restarts: one due while the server was down fires at start-up,
in due order with everything else that fell due (a run's deadline that came first
cancels it instead). A timer made with ``after`` is due after that much *server time*
(a wall clock set back does not delay it); one made with ``at`` is due at that wall
instant. Every timer is an entry of the coordinator's one activity heap (no task per
timer).

``wait`` waits for the fire and acknowledges it in the same call (a second ack is a
no-op); on a timer that will never fire -- cancelled by ``cancel()``, or with its run --
it raises TIMER_CANCELLED. The timer's actor lives in its run's nursery, so the run's end
answers its waiters through the nursery's cancellation.
"""

from __future__ import annotations

import msgspec

from ..clock import to_iso
from ..errors import ConflictError, LeaseLostError, TimerCancelledError, ValidationError
from ..protocol import TimerAck, TimerCancel, TimerCreate, TimerListView, TimerPoll, TimerStatus, TimerView, TimerWait
from ..events import emits, ev
from ..records import TimerAcked, TimerCancelled, TimerCreated, TimerFired
from .common import applies, check_label, check_range, clamp_wait, parse_instant
from .kind import Kind
from .opmark import ALWAYS, NEVER, R, W, asked, by, by_run, keyed, op
from .runtime import Park

__all__ = ["TimerState", "Timers"]

MAX_AFTER_MS = 10 * 365 * 24 * 3600 * 1000
_RUN_REASON = {"cancelled": "run_cancelled", "completed": "run_completed", "deadline": "deadline"}


class TimerState(msgspec.Struct, gc=False, omit_defaults=True):
    """``fire_at_ms`` is wall time; ``fire_mono_ms`` (server time) is set for a timer
    made with ``after`` and is what it fires on."""

    id: str
    space: str
    scope_id: str
    fire_at_ms: int
    created_at_ms: int
    state: str = "ARMED"  # ARMED | FIRED | ACKED | CANCELLED
    fired_at_ms: int | None = None
    acked_at_ms: int | None = None
    fire_mono_ms: int | None = None
    cancel_reason: str | None = None
    name: str | None = None  # a named timer: one per (run, name)


class Timers(Kind):
    """Timers: create, wait (and ack), cancel; fired by the activity heap."""

    prefix = "tmr"
    name = "timers"
    noun = "timer"
    id_field = "timer_id"

    def __init__(self, coord) -> None:
        super().__init__(coord)
        self.table: dict[str, TimerState] = {}
        self.by_name: dict[tuple[str, str], str] = {}  # (run, name) -> timer id

    def entity_tables(self):
        return {"tmr": (self.table, TimerState)}

    def parent_actor_id(self, timer_id: str) -> str | None:
        return self.table[timer_id].scope_id


    def view(self, t: TimerState) -> TimerView:
        fire_at = t.fire_at_ms if t.fire_mono_ms is None else self.coord.clock.mono_to_wall(t.fire_mono_ms)
        return TimerView(
            id=t.id,
            scope_id=t.scope_id,
            state=t.state,
            fire_at=to_iso(fire_at),
            fired_at=to_iso(t.fired_at_ms),
            acked_at=to_iso(t.acked_at_ms),
            created_at=to_iso(t.created_at_ms),
            name=t.name,
            token=self._token(t),
            now=to_iso(self.coord.now_ms()),
        )

    @staticmethod
    def _token(t: TimerState) -> str | None:
        """The fire's fencing token: fixed by the one ``TimerFired`` record (a timer fires
        once), so every reader and replay agree on it."""
        return None if t.fired_at_ms is None or t.state == "CANCELLED" else f"f{t.fired_at_ms}"

    @op(TimerCreate, route=by_run(), permission=W, resend=keyed("name"))
    def op_timer_create(self, actor, session, op: TimerCreate) -> TimerView:
        """Exactly one of ``at`` (wall instant) or ``after_ms`` (server-time duration).
        SCOPE_CANCELLED / DEADLINE_EXCEEDED on an inactive run. With ``name``: the run's
        timer of that name, created by the first call and returned unchanged by every
        later one (whatever its state: ``fire_at`` is never reset). LIMIT_EXCEEDED at the
        space's ``timers`` or ``stored`` limit (``rallypoint/limits.py``)."""
        coord = self.coord
        run = coord.runs.get(session.space, op.scope_id)
        if op.name is not None:
            check_label("name", op.name)
            tid = self.by_name.get((run.id, op.name))
            if tid is not None:
                return self.view(self.table[tid])
        if (op.at is None) == (op.after_ms is None):
            raise ValidationError("give exactly one of at and after_seconds", details={"field": "at"})
        now = coord.now_ms()
        fire_mono = None
        if op.after_ms is not None:
            check_range("after_ms", op.after_ms, 0, MAX_AFTER_MS, " ms")
            fire_at = now + op.after_ms
            fire_mono = coord.mono_ms() + op.after_ms
        else:
            fire_at = parse_instant("at", op.at)
        coord.runs.require_active(run.id)
        coord.limits.check_timers(session.space)
        rec = TimerCreated(id=coord.new_id("tmr", under=run.id), space=session.space, scope_id=run.id, fire_at_ms=fire_at,
                           at_ms=now, fire_mono_ms=fire_mono, name=op.name)
        coord.commit([rec])
        return self.view(self.table[rec.id])

    @applies(TimerCreated)
    def _apply_created(self, r: TimerCreated) -> None:
        t = TimerState(id=r.id, space=r.space, scope_id=r.scope_id, fire_at_ms=r.fire_at_ms, created_at_ms=r.at_ms,
                       fire_mono_ms=r.fire_mono_ms, name=r.name)
        self.table[t.id] = t
        if t.name is not None:
            self.by_name[(t.scope_id, t.name)] = t.id
        self.coord.limits.timer_added(t.space)
        self.coord.runs.own(t.scope_id, t.id)
        self.coord.touch(t.id)
        self._arm(t)

    def _arm(self, t: TimerState) -> None:
        if t.fire_mono_ms is not None:
            self.coord.arm_mono(t.fire_mono_ms, self._on_fire, t.id)
        else:
            self.coord.arm_wall(t.fire_at_ms, self._on_fire, t.id)

    def _on_fire(self, timer_id: str) -> None:
        t = self.table.get(timer_id)
        if t is None or t.state != "ARMED":
            return
        coord = self.coord
        due = t.fire_at_ms if t.fire_mono_ms is None else coord.clock.mono_to_wall(t.fire_mono_ms)
        coord.commit([TimerFired(id=timer_id, at_ms=max(due, coord.now_ms()))])

    @applies(TimerFired)
    def _apply_fired(self, r: TimerFired) -> None:
        t = self.table[r.id]
        if t.state == "ARMED":
            self.coord.limits.timer_ended(t.space)
        t.state = "FIRED"
        t.fired_at_ms = r.at_ms
        self.coord.touch(t.id)
        self.coord.notify(t.id, "t")

    @op(TimerStatus, route=by("timer_id"), permission=R, resend=ALWAYS)
    def op_timer_status(self, actor, session, op: TimerStatus) -> TimerView:
        return self.view(self.get(session.space, op.timer_id))

    @op(TimerWait, route=by("timer_id"), permission=W, resend=ALWAYS, waits=asked("wait_ms"), reply=TimerView)
    def op_timer_wait(self, actor, session, op: TimerWait):
        """Wait for the fire and acknowledge it; parks on the timer's actor.
        TIMER_CANCELLED when the timer will never fire."""
        t = self.get(session.space, op.timer_id)
        wait_ms = clamp_wait(op.wait_ms)
        if t.state != "ARMED" or wait_ms == 0:
            return self._ack(t)
        ack = self._ack
        return Park("t", lambda: None if t.state == "ARMED" else ack(t), wait_ms, lambda: ack(t))

    def _ack(self, t: TimerState) -> TimerView:
        if t.state == "CANCELLED":
            reason = t.cancel_reason or "cancelled"
            why = "by timer.cancel()" if reason == "cancelled" else {
                "run_cancelled": "with its run", "run_completed": "when its run completed",
                "deadline": "when its run passed its deadline",
            }.get(reason, "")
            raise TimerCancelledError(
                f"timer {t.id} was cancelled {why}; it will never fire".replace("  ", " "),
                details={"timer_id": t.id, "scope_id": t.scope_id, "reason": reason},
            )
        if t.state == "FIRED":
            self.coord.commit([TimerAcked(id=t.id, at_ms=self.coord.now_ms())])
        return self.view(t)  # ACKED: a second ack is a no-op; ARMED: not yet

    @applies(TimerAcked)
    def _apply_acked(self, r: TimerAcked) -> None:
        t = self.table[r.id]
        t.state = "ACKED"
        t.acked_at_ms = r.at_ms
        self.coord.touch(t.id)

    @op(TimerAck, route=by("timer_id"), permission=W, resend=NEVER)
    def op_timer_ack(self, actor, session, op: TimerAck) -> TimerView:
        """Acknowledge the fire (the first ack wins). CONFLICT while still ARMED or once
        ACKED; STALE_CLAIM for a ``token`` that is not the fire's; TIMER_CANCELLED."""
        t = self.get(session.space, op.timer_id)
        if t.state == "ARMED":
            raise ConflictError(f"timer {t.id} has not fired yet (due {self.view(t).fire_at})",
                                details={"timer_id": t.id, "state": t.state})
        if op.token is not None and t.state != "CANCELLED" and op.token != self._token(t):
            raise LeaseLostError(f"token {op.token!r} is not timer {t.id}'s fire token",
                                 details={"timer_id": t.id})
        if t.state == "ACKED":
            raise ConflictError(f"timer {t.id} was already acknowledged at {to_iso(t.acked_at_ms)}",
                                details={"timer_id": t.id, "state": t.state})
        return self._ack(t)

    @op(TimerPoll, route=by_run(), permission=R, resend=ALWAYS)
    def op_timer_poll(self, actor, session, op: TimerPoll) -> TimerListView:
        """The run's fired, unacknowledged timers, oldest fire first (at most 1000)."""
        run = self.coord.runs.get(session.space, op.scope_id)
        table = self.table
        fired = [table[i] for i in self.coord.runs.owned.get(run.id, ()) if i in table and table[i].state == "FIRED"]
        fired.sort(key=lambda t: (t.fired_at_ms or 0, t.id))
        return TimerListView(timers=[self.view(t) for t in fired[:1000]])

    @op(TimerCancel, route=by("timer_id"), permission=W, resend=ALWAYS)
    def op_timer_cancel(self, actor, session, op: TimerCancel) -> TimerView:
        """Disarm an armed timer (idempotent); CONFLICT once it fired."""
        t = self.get(session.space, op.timer_id)
        if t.state in ("FIRED", "ACKED"):
            raise ConflictError(f"timer {t.id} already fired at {to_iso(t.fired_at_ms)}; it cannot be cancelled")
        if t.state == "ARMED":
            self.coord.commit([TimerCancelled(id=t.id, at_ms=self.coord.now_ms())])
        return self.view(t)

    @applies(TimerCancelled)
    def _apply_cancelled(self, r: TimerCancelled) -> None:
        t = self.table[r.id]
        self._cancel(t, "cancelled")
        self.coord.notify(t.id, "t")  # waits on a timer cancelled by timer.cancel()

    def _cancel(self, t: TimerState, reason: str) -> None:
        if t.state == "ARMED":
            self.coord.limits.timer_ended(t.space)
        t.state = "CANCELLED"
        t.cancel_reason = reason
        self.coord.touch(t.id)

    def on_run_inactive(self, timer_id: str, at_ms: int, reason: str) -> None:
        """Its run ended: CANCELLED. No wake-up: the timer's actor is in the ended run's
        subtree, and the nursery cancellation answers its waits (TIMER_CANCELLED)."""
        t = self.table[timer_id]
        if t.state == "ARMED":
            self._cancel(t, _RUN_REASON.get(reason, reason))
            self.coord.implied(TimerCancelled(id=t.id, at_ms=at_ms))

    # ================================================================ retention
    def purge_run(self, run_id: str) -> int:
        n = 0
        limits = self.coord.limits
        for tid in self.coord.runs.owned.get(run_id, ()):
            if tid.startswith("tmr"):
                t = self.table.pop(tid, None)
                if t is not None:
                    self.coord.touch(tid)
                    limits.timers_purged(t.space, 1)
                    if t.state == "ARMED":  # (never: its run ended, which cancelled it)
                        limits.timer_ended(t.space)
                    n += 1
        return n

    # ================================================================ events
    @emits(TimerCreated)
    def _ev_created(self, r: TimerCreated):
        return ev(r.space, "timer.created", "timer", r.id, r.scope_id, r.at_ms, {"fire_at": to_iso(r.fire_at_ms)})

    @emits(TimerFired)
    def _ev_fired(self, r: TimerFired):
        t = self.table[r.id]
        return ev(t.space, "timer.fired", "timer", t.id, t.scope_id, r.at_ms, None)

    @emits(TimerAcked)
    def _ev_acked(self, r: TimerAcked):
        t = self.table[r.id]
        return ev(t.space, "timer.acked", "timer", t.id, t.scope_id, r.at_ms, None)

    @emits(TimerCancelled)
    def _ev_cancelled(self, r: TimerCancelled):
        t = self.table[r.id]
        return ev(t.space, "timer.cancelled", "timer", t.id, t.scope_id, r.at_ms, {"reason": t.cancel_reason})

    def rebuild_indexes(self) -> None:
        runs = self.coord.runs
        self.by_name = {}
        for t in self.table.values():
            runs.own(t.scope_id, t.id)
            if t.name is not None:
                self.by_name[(t.scope_id, t.name)] = t.id

    def rearm(self) -> None:
        for t in self.table.values():
            if t.state == "ARMED":
                self._arm(t)
