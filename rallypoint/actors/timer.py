"""Durable timers (SPEC §7): ARMED -> FIRED -> ACKED; ARMED -> CANCELLED.

A timer fires on the server whether or not anyone waits (a ``TimerFired`` record at its
``fire_at``), and survives restarts: one due while the server was down fires at
start-up. Every timer of the process sits in the coordinator's one heap (no task per
timer). ``wait`` waits for the fire and acknowledges it in the same call; a second ack
is a no-op. Cancelling the run cancels its armed timers.
"""

from __future__ import annotations

import msgspec
import trio

from ..clock import to_iso
from ..errors import ConflictError, NotFoundError, ValidationError
from ..protocol import TimerCancel, TimerCreate, TimerStatus, TimerView, TimerWait
from ..records import TimerAcked, TimerCancelled, TimerCreated, TimerFired
from .system import short, applies, check_range, clamp_wait, parse_instant

__all__ = ["TimerState", "TimerKind"]

MAX_AFTER_MS = 10 * 365 * 24 * 3600 * 1000


class TimerState(msgspec.Struct, gc=False, omit_defaults=True):
    id: str
    space: str
    scope_id: str
    fire_at_ms: int
    created_at_ms: int
    state: str = "ARMED"  # ARMED | FIRED | ACKED | CANCELLED
    fired_at_ms: int | None = None
    acked_at_ms: int | None = None


class TimerKind:
    def _init_tables(self) -> None:
        super()._init_tables()
        self.timers_by_id: dict[str, TimerState] = {}
        self.scope_armed_timers: dict[str, set[str]] = {}
        self.inactive_hooks.append(self._timers_on_scope_inactive)

    def entity_tables(self):
        t = super().entity_tables()
        t["tmr"] = (self.timers_by_id, TimerState)
        return t

    def get_timer(self, space: str, timer_id: str) -> TimerState:
        t = self.timers_by_id.get(timer_id) if isinstance(timer_id, str) else None
        if t is None or t.space != space:
            raise NotFoundError(f"no timer {short(timer_id)} in this space", details={"timer_id": timer_id})
        return t

    def timer_view(self, t: TimerState) -> TimerView:
        return TimerView(
            id=t.id,
            scope_id=t.scope_id,
            state=t.state,
            fire_at=to_iso(t.fire_at_ms),
            fired_at=to_iso(t.fired_at_ms),
            acked_at=to_iso(t.acked_at_ms),
            created_at=to_iso(t.created_at_ms),
        )

    def op_timer_create(self, session, op: TimerCreate) -> TimerView:
        scope = self.get_scope(session.space, op.scope_id)
        if (op.at is None) == (op.after_ms is None):
            raise ValidationError("give exactly one of at and after_seconds", details={"field": "at"})
        now = self.now_ms()
        if op.after_ms is not None:
            check_range("after_ms", op.after_ms, 0, MAX_AFTER_MS, " ms")
            fire_at = now + op.after_ms
        else:
            fire_at = parse_instant("at", op.at)
        self.require_active(scope.id)
        rec = TimerCreated(id=self.ids.new("tmr"), space=session.space, scope_id=scope.id, fire_at_ms=fire_at, at_ms=now)
        self.commit([rec])
        return self.timer_view(self.timers_by_id[rec.id])

    @applies(TimerCreated)
    def _apply_timer_created(self, r: TimerCreated) -> None:
        t = TimerState(id=r.id, space=r.space, scope_id=r.scope_id, fire_at_ms=r.fire_at_ms, created_at_ms=r.at_ms)
        self.timers_by_id[t.id] = t
        self.scope_armed_timers.setdefault(t.scope_id, set()).add(t.id)
        self.touch(t.id)
        self.arm(t.fire_at_ms, "timer", t.id, t.fire_at_ms)

    def _on_timer(self, timer_id: str, fire_at: int, _due: int) -> None:
        t = self.timers_by_id.get(timer_id)
        if t is None or t.state != "ARMED" or t.fire_at_ms != fire_at:
            return
        self.commit([TimerFired(id=timer_id, at_ms=max(fire_at, self.now_ms()))])

    def _disarm(self, t: TimerState) -> None:
        s = self.scope_armed_timers.get(t.scope_id)
        if s is not None:
            s.discard(t.id)
            if not s:
                del self.scope_armed_timers[t.scope_id]

    @applies(TimerFired)
    def _apply_timer_fired(self, r: TimerFired) -> None:
        t = self.timers_by_id[r.id]
        t.state = "FIRED"
        t.fired_at_ms = r.at_ms
        self._disarm(t)
        self.touch(t.id)
        self.notifier.notify(t.id)

    def op_timer_status(self, session, op: TimerStatus) -> TimerView:
        return self.timer_view(self.get_timer(session.space, op.timer_id))

    def op_timer_wait(self, session, op: TimerWait):
        t = self.get_timer(session.space, op.timer_id)
        wait_ms = clamp_wait(op.wait_ms)
        if t.state != "ARMED" or wait_ms == 0:
            return self._ack(t)
        return self._timer_wait(t, wait_ms)

    def _ack(self, t: TimerState) -> TimerView:
        if t.state == "CANCELLED":
            raise ConflictError(f"timer {t.id} was cancelled; it will never fire")
        if t.state == "FIRED":
            self.commit([TimerAcked(id=t.id, at_ms=self.now_ms())])
        return self.timer_view(t)  # ACKED: a second ack is a no-op; ARMED: not yet

    async def _timer_wait(self, t: TimerState, wait_ms: int) -> TimerView:
        with trio.move_on_after(wait_ms / 1000):
            while t.state == "ARMED":
                await self.notifier.event(t.id).wait()
        return self._ack(t)

    @applies(TimerAcked)
    def _apply_timer_acked(self, r: TimerAcked) -> None:
        t = self.timers_by_id[r.id]
        t.state = "ACKED"
        t.acked_at_ms = r.at_ms
        self.touch(t.id)

    def op_timer_cancel(self, session, op: TimerCancel) -> TimerView:
        t = self.get_timer(session.space, op.timer_id)
        if t.state in ("FIRED", "ACKED"):
            raise ConflictError(f"timer {t.id} already fired at {to_iso(t.fired_at_ms)}; it cannot be cancelled")
        if t.state == "ARMED":
            self.commit([TimerCancelled(id=t.id, at_ms=self.now_ms())])
        return self.timer_view(t)

    @applies(TimerCancelled)
    def _apply_timer_cancelled(self, r: TimerCancelled) -> None:
        self._cancel_timer(self.timers_by_id[r.id])

    def _cancel_timer(self, t: TimerState) -> None:
        t.state = "CANCELLED"
        self._disarm(t)
        self.touch(t.id)
        self.notifier.notify(t.id)

    def _timers_on_scope_inactive(self, scope_id: str, at_ms: int, reason: str) -> None:
        ids = self.scope_armed_timers.get(scope_id)
        if ids:
            for tid in sorted(ids):
                self._cancel_timer(self.timers_by_id[tid])

    def rebuild_indexes(self) -> None:
        super().rebuild_indexes()
        self.scope_armed_timers = {}
        for t in self.timers_by_id.values():
            if t.state == "ARMED":
                self.scope_armed_timers.setdefault(t.scope_id, set()).add(t.id)

    def rearm_all(self) -> None:
        super().rearm_all()
        for t in self.timers_by_id.values():
            if t.state == "ARMED":
                self.timers.arm(t.fire_at_ms, "timer", t.id, t.fire_at_ms)
