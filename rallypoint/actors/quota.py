"""Quotas (runstate's *allowances*): at most ``units_limit`` units per fixed window, with
durable first-come-first-served waiters (SPEC §8; kernel reference §11, as the
published SDK observed it).

**Windows.** A window is ``window_ms`` of server time (1 s to 1 day), aligned to
multiples of its length: the window of server time ``t`` starts at
``t - t % window_ms``. (Server time equals wall time on a data dir's first start, so
windows are epoch-aligned: a 60 s window starts on the minute.) Units taken count in
the window they were taken in; a new window starts with nothing used. Not a token
bucket: ``units_limit`` units may all be taken at the start of a window.

**Takes.** ``take(units, scope)`` with no TTL succeeds at once or is refused:
ALLOWANCE_COOLDOWN during a cooldown, ALLOWANCE_EXHAUSTED when the window has fewer
than ``units`` left *or when any waiter is queued* (strict FIFO: a take never jumps
the line), with ``retry_after`` the seconds until the window rolls (or the cooldown
ends). ``units`` above ``units_limit`` is VALIDATION_FAILED (it could never be
granted). A take with a TTL is a **durable waiter**: GRANTED at once when it could
have been taken now, else WAITING in FIFO order until the quota's actor serves it, or
EXPIRED when its TTL passes first, or CANCELLED (``waiter.cancel()``, or its run's end).
A GRANTED waiter carries its ``consumption_id``: the units were taken for it, once; a
client that finds it GRANTED must not take again. A grant that races the client's own
timeout stands.

**Serving the queue** is an activity of the quota (one entry in the coordinator's heap,
never a task): armed at the next window boundary while waiters wait, at a cooldown's
end, and at once when a waiter ahead leaves (cancelled, expired, its run ended). It
grants waiters head first while their units fit in the window and stops at the first
that does not fit, so a large request is never starved by small ones behind it. Like
every activity it is judged at its due instant, before any later request
(``Coordinator.before_batch``).

**Cooldown** (``quota.cooldown(seconds)``): a backoff the provider asked for, for the
whole space -- it names no run: nothing is granted from the quota, to any run, until it
ends; waiters stay queued and are served when it ends. A new cooldown only ever
extends a running one.

**Runs.** A take or a waiter registration on an inactive run is refused
(SCOPE_CANCELLED / DEADLINE_EXCEEDED). A quota is space-level (its actor lives in the
root nursery, not under any run), so a run's end does not reach its waiters through
the nursery tree. The rule instead: every WAITING waiter is *owned* by its run
(``Runs.own``), and the run's one cancellation step (``ScopeEnded`` /
``ScopeDeadlinePassed`` / a gate's ``GroupFinalized``) calls
:meth:`Quotas.on_run_inactive` for each of them: CANCELLED (``end_reason``
run_cancelled, run_completed or deadline), the quota's actor notified so a request
waiting on the waiter is answered at once (with the run's SCOPE_CANCELLED /
DEADLINE_EXCEEDED), and the queue served again (the next waiter may fit now). A waiter
already GRANTED keeps its units.

**Time and recovery.** Windows, waiter TTLs and cooldowns are server time. After a
restart the window state, the used units and every waiter are recovered; each
WAITING waiter's expiry and its quota's serve are re-armed at their original due
instants, so what fell due while the daemon was down happens at start-up in due order.
"""

from __future__ import annotations

import msgspec

from ..clock import to_iso
from ..errors import (
    AllowanceCooldownError,
    AllowanceExhaustedError,
    ConflictError,
    NotFoundError,
    ScopeCancelledError,
    ValidationError,
)
from ..ids import is_id
from ..protocol import (
    QuotaCooldown,
    QuotaEnsure,
    QuotaGet,
    QuotaList,
    QuotaListView,
    QuotaTake,
    QuotaTakeView,
    QuotaView,
    QuotaWaiterCancel,
    QuotaWaiterWait,
)
from ..records import (
    QuotaConsumed,
    QuotaCooldownSet,
    QuotaCreated,
    QuotaGrant,
    QuotaWaiterAdded,
    QuotaWaiterEnded,
    QuotaWaitersGranted,
)
from ..events import emits, ev
from .common import applies, check_key, check_name, check_range, clamp_wait, data, did_you_mean, short
from .kind import Kind, Links
from .opmark import ALWAYS, C, R, SPACE, W, asked, by, keyed, op
from .runtime import PRIO_WAIT_END, Park
from .waitqueue import WaitQueue

__all__ = ["QuotaState", "QuotaWaiterState", "Quotas"]

MIN_WINDOW_MS = 1_000
MAX_WINDOW_MS = 86_400_000
MAX_UNITS = 10**12
MIN_TTL_MS = 1_000
MAX_TTL_MS = 86_400_000
MAX_COOLDOWN_MS = 86_400_000
#: How many waiters ``quota.get(waiters=True)`` lists.
LIST_WAITERS = 1000
_RUN_REASON = {"cancelled": "run_cancelled", "completed": "run_completed", "deadline": "deadline"}


class QuotaState(msgspec.Struct, gc=False, omit_defaults=True):
    """A quota (what a snapshot stores). ``used`` counts in the window starting at
    ``window_start_mono_ms`` (server time); ``cooldown_until_mono_ms`` 0: none.
    ``next_seq``: the FIFO position of the next waiter."""

    id: str
    space: str
    name: str
    units_limit: int
    window_ms: int
    created_at_ms: int
    window_start_mono_ms: int = 0
    used: int = 0
    cooldown_until_mono_ms: int = 0
    cooldown_reason: str | None = None
    consumed_total: int = 0
    next_seq: int = 1


class QuotaWaiterState(msgspec.Struct, gc=False, omit_defaults=True):
    """A durable waiter: WAITING -> GRANTED | EXPIRED | CANCELLED. Server-time fields:
    ``at_mono_ms`` (registered), ``expires_mono_ms``, ``window_start_mono_ms`` (of the
    grant). ``end_reason``: ttl, cancelled, run_cancelled, run_completed, deadline."""

    id: str
    space: str
    quota_id: str
    scope_id: str
    units: int
    seq: int
    expires_mono_ms: int
    created_at_ms: int
    at_mono_ms: int = 0
    state: str = "WAITING"
    key: str | None = None
    holder: str | None = None
    consumption_id: str | None = None
    window_start_mono_ms: int = 0
    ended_at_ms: int | None = None
    end_reason: str | None = None


class Quotas(Kind):
    """Quotas and their durable waiters: ensure, take, cooldown, waiter wait/cancel;
    the serve and TTL activities; cancelled with their run."""

    prefix = "quo"
    name = "quotas"

    def __init__(self, coord) -> None:
        super().__init__(coord)
        self.table: dict[str, QuotaState] = {}
        self.waiters: dict[str, QuotaWaiterState] = {}
        self._tick_due: dict[str, int] = {}  # quota id -> server time of the earliest armed serve
        self._init_indexes()

    def _init_indexes(self) -> None:
        self.by_name: dict[tuple[str, str], str] = {}
        self.lines: dict[str, WaitQueue[QuotaWaiterState]] = {}  # quota id -> its WAITING waiters, FIFO
        self.keys: dict[tuple[str, str], str] = {}  # (quota id, key) -> waiter id
        self.links = Links()  # retention: run -> its waiters

    def entity_tables(self):
        return {"quo": (self.table, QuotaState), "qwt": (self.waiters, QuotaWaiterState)}

    def statistics(self) -> dict:
        return {"quotas": len(self.table), "waiters": len(self.waiters),
                "waiting": sum(len(line) for line in self.lines.values())}

    def waiting(self, quota_id: str) -> int:
        """How many waiters of the quota are WAITING (in its line)."""
        line = self.lines.get(quota_id)
        return len(line) if line is not None else 0

    # ================================================================ lookups
    def get(self, space: str, name_or_id) -> QuotaState:
        """A quota by name or id; NOT_FOUND (saying how to create it) otherwise."""
        if not isinstance(name_or_id, str):
            raise ValidationError("quota must be a name or an id", details={"field": "quota"})
        qid = name_or_id if is_id(name_or_id, "quo") else self.by_name.get((space, name_or_id))
        q = self.table.get(qid) if qid else None
        if q is None or q.space != space:
            hint = did_you_mean(name_or_id, (n for (sp, n) in self.by_name if sp == space))
            raise NotFoundError(f"no quota {short(name_or_id)}{hint}; create it with quotas.ensure()",
                                details={"quota": name_or_id})
        return q

    def route(self, session, name_or_id) -> str:
        return self.get(session.space, name_or_id).id

    def get_waiter(self, space: str, waiter_id) -> QuotaWaiterState:
        w = self.waiters.get(waiter_id) if isinstance(waiter_id, str) else None
        if w is None or w.space != space:
            raise NotFoundError(f"no quota waiter {short(waiter_id)} in this space", details={"waiter_id": waiter_id})
        return w

    def route_waiter(self, session, waiter_id) -> str:
        """The actor of a command about a waiter: its quota's."""
        return self.get_waiter(session.space, waiter_id).quota_id

    # ================================================================ windows
    @staticmethod
    def window_of(q: QuotaState, mono_ms: int) -> int:
        """Start (server time) of the window holding ``mono_ms``."""
        return mono_ms - mono_ms % q.window_ms

    def used_in(self, q: QuotaState, window: int) -> int:
        return q.used if q.window_start_mono_ms == window else 0

    def remaining(self, q: QuotaState, mono_ms: int | None = None) -> int:
        """Units left in the window of ``mono_ms`` (default: now)."""
        if mono_ms is None:
            mono_ms = self.coord.mono_ms()
        return q.units_limit - self.used_in(q, self.window_of(q, mono_ms))

    def _wall(self, mono_ms: int) -> str | None:
        return to_iso(self.coord.clock.mono_to_wall(mono_ms))

    # ================================================================ ensure, list, get
    @op(QuotaEnsure, route=SPACE, permission=C, resend=ALWAYS)
    def op_quota_ensure(self, actor, session, op: QuotaEnsure) -> QuotaView:
        """Create the quota, or check it exists with these settings (CONFLICT naming the
        first that differs). VALIDATION_FAILED: name, ``units_limit`` (1 to 10^12),
        ``window_ms`` (1 s to 1 day). Runs on the space's actor (names are per space)."""
        check_name("name", op.name)
        check_range("units_limit", op.units_limit, 1, MAX_UNITS)
        check_range("window_ms", op.window_ms, MIN_WINDOW_MS, MAX_WINDOW_MS, " ms")
        qid = self.by_name.get((session.space, op.name))
        if qid is not None:
            q = self.table[qid]
            for field in ("units_limit", "window_ms"):
                have, want = getattr(q, field), getattr(op, field)
                if have != want:
                    raise ConflictError(
                        f"quota {short(op.name)} exists with {field}={have!r}, not {want!r}",
                        details={"field": field, "existing": have},
                    )
            return self.view(q)
        rec = QuotaCreated(id=self.coord.new_id("quo", space=session.space), space=session.space, name=op.name,
                           units_limit=op.units_limit, window_ms=op.window_ms, at_ms=self.coord.now_ms())
        self.coord.commit([rec])
        return self.view(self.table[rec.id])

    @op(QuotaGet, route=by("quota"), permission=R, resend=ALWAYS)
    def op_quota_get(self, actor, session, op: QuotaGet) -> QuotaView:
        return self.view(self.get(session.space, op.quota), waiters=op.waiters)

    @op(QuotaList, route=SPACE, permission=R, resend=ALWAYS)
    def op_quota_list(self, actor, session, op: QuotaList) -> QuotaListView:
        return QuotaListView(quotas=[self.view(q) for q in self.table.values() if q.space == session.space])

    # ================================================================ take
    @op(QuotaTake, route=by("quota"), permission=W, waits=asked("wait_ms"), reply=QuotaTakeView,
        resend=keyed("key", "check the quota's status before taking again (a take with wait carries a key and is "
                            "re-sent)"))
    def op_quota_take(self, actor, session, op: QuotaTake):
        """Take ``units`` for run ``scope_id`` (see the module docstring). Returns a
        QuotaTakeView (GRANTED with a ``consumption_id``, or the waiter's state); parks
        on the quota's actor up to ``wait_ms`` while the waiter is WAITING.

        Errors: VALIDATION_FAILED (units not in 1..units_limit, ttl_ms, key, holder),
        NOT_FOUND (quota, run), SCOPE_CANCELLED / DEADLINE_EXCEEDED (the run is
        inactive; also when a waiter this request waits on is cancelled by its run's
        end), ALLOWANCE_EXHAUSTED / ALLOWANCE_COOLDOWN (no TTL and nothing to take now),
        CONFLICT (a ``key`` reused with other units or another run)."""
        coord = self.coord
        q = self.get(session.space, op.quota)
        run = coord.runs.get(session.space, op.scope_id)
        if not 1 <= op.units <= q.units_limit:
            raise ValidationError(
                f"units must be between 1 and the quota's units_limit {q.units_limit} (got {op.units}); "
                "more could never be granted",
                details={"field": "units", "units_limit": q.units_limit},
            )
        if op.ttl_ms:
            check_range("ttl_ms", op.ttl_ms, MIN_TTL_MS, MAX_TTL_MS, " ms")
        wait_ms = clamp_wait(op.wait_ms)
        check_key("key", op.key)
        check_key("holder", op.holder)
        if op.key is not None:
            wid = self.keys.get((q.id, op.key))
            if wid is not None:
                w = self.waiters[wid]
                if w.units != op.units or w.scope_id != run.id:
                    raise ConflictError(
                        f"key {op.key!r} was already used on quota {q.name!r} for {w.units} unit(s) in run "
                        f"{w.scope_id}", details={"field": "key", "waiter_id": w.id},
                    )
                return self._wait_for(w, wait_ms)
        coord.runs.require_active(run.id)
        mono = coord.mono_ms()
        window = self.window_of(q, mono)
        fits = (
            q.cooldown_until_mono_ms <= mono
            and not self.waiting(q.id)
            and self.used_in(q, window) + op.units <= q.units_limit
        )
        if op.ttl_ms == 0:
            if not fits:
                raise self.refusal(q, op.units, mono)
            if op.key is None:
                rec = QuotaConsumed(quota_id=q.id, consumption_id=coord.new_id("qcn", space=q.space), scope_id=run.id,
                                    units=op.units, window_start_mono_ms=window, at_ms=coord.now_ms(),
                                    holder=op.holder)
                coord.commit([rec])
                return self._consumed_view(q, rec)
        added = QuotaWaiterAdded(
            id=coord.new_id("qwt", space=q.space), quota_id=q.id, space=session.space, scope_id=run.id, units=op.units,
            seq=q.next_seq, expires_mono_ms=mono + op.ttl_ms, at_ms=coord.now_ms(), at_mono_ms=mono,
            key=op.key, holder=op.holder,
            consumption_id=coord.new_id("qcn", space=q.space) if fits else None, window_start_mono_ms=window if fits else 0,
        )
        coord.commit([added])
        return self._wait_for(self.waiters[added.id], wait_ms)

    def refusal(self, q: QuotaState, units: int, mono: int) -> AllowanceExhaustedError:
        """The error of a take that may not wait: ALLOWANCE_COOLDOWN or
        ALLOWANCE_EXHAUSTED, with ``retry_after`` and the quota's figures."""
        if q.cooldown_until_mono_ms > mono:
            left_s = (q.cooldown_until_mono_ms - mono) / 1000
            why = f" ({q.cooldown_reason})" if q.cooldown_reason else ""
            return AllowanceCooldownError(
                f"quota {q.name!r} is cooling down{why} for another {left_s:.1f} s; nothing is granted from it "
                "until then (take with wait to queue for it)",
                retry_after=left_s,
                details={"quota": q.name, "cooldown_until": self._wall(q.cooldown_until_mono_ms),
                         "reason": q.cooldown_reason},
            )
        window = self.window_of(q, mono)
        remaining = q.units_limit - self.used_in(q, window)
        waiting = self.waiting(q.id)
        roll_s = (window + q.window_ms - mono) / 1000
        if waiting:
            msg = (f"quota {q.name!r}: {waiting} waiter(s) are queued ahead of this take (first come, first "
                   f"served); take with wait to queue, or retry after the window rolls in {roll_s:.1f} s")
        else:
            msg = (f"quota {q.name!r} has {remaining} of {q.units_limit} units left in this window, {units} "
                   f"asked; the window rolls in {roll_s:.1f} s (or take with wait)")
        return AllowanceExhaustedError(
            msg, retry_after=roll_s,
            details={"quota": q.name, "units": units, "remaining": remaining, "waiting": waiting,
                     "window_start": self._wall(window), "window_end": self._wall(window + q.window_ms)},
        )

    def _wait_for(self, w: QuotaWaiterState, wait_ms: int):
        if w.state != "WAITING" or wait_ms == 0:
            return self._answer(w, wait_ms > 0)
        return Park(w.id, lambda: None if w.state == "WAITING" else self._answer(w, True), wait_ms,
                    lambda: self.take_view(w))

    def _answer(self, w: QuotaWaiterState, waited: bool) -> QuotaTakeView:
        """The waiter's view; a request that waited for a grant on a waiter its run's
        end cancelled raises the run's code instead (an event that can no longer
        happen)."""
        if waited and w.state == "CANCELLED" and w.end_reason in _RUN_REASON.values():
            err = self.coord.runs.inactive_error(w.scope_id)
            if err is None:  # cannot happen: a run's end is final
                err = ScopeCancelledError(f"run {w.scope_id} ended", details={"scope_id": w.scope_id})
            err.message = f"{err.message}; quota waiter {w.id} was cancelled with it"
            err.details = {**(err.details or {}), "waiter_id": w.id}
            raise err
        return self.take_view(w)

    # ================================================================ waiters
    @op(QuotaWaiterWait, route=by("waiter_id", "route_waiter"), permission=R, resend=ALWAYS, waits=asked("wait_ms"),
        reply=QuotaTakeView)
    def op_quota_waiter_wait(self, actor, session, op: QuotaWaiterWait):
        """The waiter now; with ``wait_ms``, once it is no longer WAITING (parked on
        the quota's actor). SCOPE_CANCELLED / DEADLINE_EXCEEDED when it was waited for
        and its run's end cancelled it."""
        w = self.get_waiter(session.space, op.waiter_id)
        return self._wait_for(w, clamp_wait(op.wait_ms))

    @op(QuotaWaiterCancel, route=by("waiter_id", "route_waiter"), permission=W, resend=ALWAYS)
    def op_quota_waiter_cancel(self, actor, session, op: QuotaWaiterCancel) -> QuotaTakeView:
        """Cancel a WAITING waiter (and serve the queue behind it in the same commit).
        A waiter already GRANTED, EXPIRED or CANCELLED is returned as it is: a grant
        that raced the cancel stands (its units are taken)."""
        coord = self.coord
        w = self.get_waiter(session.space, op.waiter_id)
        if w.state == "WAITING":
            q = self.table[w.quota_id]
            recs: list = [QuotaWaiterEnded(waiter_id=w.id, state="CANCELLED", at_ms=coord.now_ms())]
            recs += self._grant_records(q, coord.mono_ms(), skip=w.id)
            coord.commit(recs)
        return self.take_view(w)

    @op(QuotaCooldown, route=by("quota"), permission=W, resend=ALWAYS)
    def op_quota_cooldown(self, actor, session, op: QuotaCooldown) -> QuotaView:
        """Grant nothing from the quota for ``cooldown_ms`` from now (1 ms to 1 day), to
        any run of the space; a running cooldown is only extended. Waiters stay queued
        and are served when it ends."""
        coord = self.coord
        q = self.get(session.space, op.quota)
        check_range("cooldown_ms", op.cooldown_ms, 1, MAX_COOLDOWN_MS, " ms")
        if op.reason is not None and len(op.reason) > 1024:
            raise ValidationError("reason is longer than 1024 characters", details={"field": "reason"})
        until = coord.mono_ms() + op.cooldown_ms
        if until > q.cooldown_until_mono_ms:  # a shorter one changes nothing (reason included)
            coord.commit([QuotaCooldownSet(quota_id=q.id, until_mono_ms=until, at_ms=coord.now_ms(),
                                           reason=op.reason)])
        return self.view(q)

    # ================================================================ serving the queue
    def _plan(self, q: QuotaState, mono: int, skip: str | None = None) -> list[QuotaWaiterState]:
        """The WAITING waiters to grant at server time ``mono``, head first, while their
        units fit in that window (none during a cooldown). Waiters already past their
        TTL, of an inactive run, or ``skip`` are passed over (they are leaving). A waiter
        whose TTL ends at ``mono`` itself is still in time: a wait's deadline sees what
        fell due at or before it (a window that rolls at that instant grants it)."""
        line = self.lines.get(q.id)
        if q.cooldown_until_mono_ms > mono or not line:
            return []
        window = self.window_of(q, mono)
        used = self.used_in(q, window)
        inactive = self.coord.runs.inactive_error
        wall = self.coord.clock.mono_to_wall(mono)

        def fits(w: QuotaWaiterState) -> bool:
            nonlocal used
            if used + w.units > q.units_limit:
                return False  # strict FIFO: nobody behind it goes first
            used += w.units
            return True

        return line.plan(lambda w: w.id == skip or w.expires_mono_ms < mono or inactive(w.scope_id, wall) is not None,
                         fits)[1]

    def _grant_records(self, q: QuotaState, mono: int, skip: str | None = None) -> list:
        ws = self._plan(q, mono, skip)
        if not ws:
            return []
        new = self.coord.ids.new
        return [QuotaWaitersGranted(
            quota_id=q.id, window_start_mono_ms=self.window_of(q, mono),
            grants=[QuotaGrant(waiter_id=w.id, consumption_id=new("qcn")) for w in ws],
            at_ms=self.coord.clock.mono_to_wall(mono),
        )]

    def _arm_serve(self, quota_id: str, due_mono: int) -> None:
        """Arm the quota's serve at server time ``due_mono`` unless one is armed at or
        before it (that one re-arms as needed). Not in replay."""
        if self.coord.replaying:
            return
        cur = self._tick_due.get(quota_id)
        if cur is not None and cur <= due_mono:
            return
        self._tick_due[quota_id] = due_mono
        self.coord.arm_mono(due_mono, self._on_serve, (quota_id, due_mono))

    def _schedule(self, q: QuotaState, mono: int) -> None:
        """While waiters wait: serve next at the cooldown's end or the next window."""
        if not self.waiting(q.id):
            return
        if q.cooldown_until_mono_ms > mono:
            self._arm_serve(q.id, q.cooldown_until_mono_ms)
        else:
            self._arm_serve(q.id, self.window_of(q, mono) + q.window_ms)

    def _serve_soon(self, quota_id: str) -> None:
        if not self.coord.replaying:
            self._arm_serve(quota_id, self.coord.mono_ms())

    def _on_serve(self, arg) -> None:
        """The serve activity, judged at its due instant: grant what fits, re-arm."""
        quota_id, due = arg
        if self._tick_due.get(quota_id) == due:
            del self._tick_due[quota_id]
        q = self.table.get(quota_id)
        if q is None or not self.waiting(quota_id):
            return
        recs = self._grant_records(q, due)
        if recs:
            self.coord.commit(recs)
        self._schedule(q, due)

    def _on_expiry(self, arg) -> None:
        """A waiter's TTL passed while it was WAITING: EXPIRED, and the queue behind it
        served, in one commit, judged at the expiry instant."""
        waiter_id, expires = arg
        w = self.waiters.get(waiter_id)
        if w is None or w.state != "WAITING" or w.expires_mono_ms != expires:
            return
        q = self.table[w.quota_id]
        recs: list = [QuotaWaiterEnded(waiter_id=w.id, state="EXPIRED", at_ms=self.coord.clock.mono_to_wall(expires))]
        recs += self._grant_records(q, expires, skip=w.id)
        self.coord.commit(recs)

    # ================================================================ apply
    @applies(QuotaCreated)
    def _apply_created(self, r: QuotaCreated) -> None:
        q = QuotaState(id=r.id, space=r.space, name=r.name, units_limit=r.units_limit, window_ms=r.window_ms,
                       created_at_ms=r.at_ms)
        self.table[q.id] = q
        self.by_name[(q.space, q.name)] = q.id
        self.coord.touch(q.id)

    def _count(self, q: QuotaState, window: int, units: int) -> None:
        if window > q.window_start_mono_ms:
            q.window_start_mono_ms = window
            q.used = 0
        if window == q.window_start_mono_ms:
            q.used += units
        q.consumed_total += units
        self.coord.touch(q.id)

    @applies(QuotaConsumed)
    def _apply_consumed(self, r: QuotaConsumed) -> None:
        self._count(self.table[r.quota_id], r.window_start_mono_ms, r.units)

    @applies(QuotaWaiterAdded)
    def _apply_waiter_added(self, r: QuotaWaiterAdded) -> None:
        q = self.table[r.quota_id]
        w = QuotaWaiterState(
            id=r.id, space=r.space, quota_id=q.id, scope_id=r.scope_id, units=r.units, seq=r.seq,
            expires_mono_ms=r.expires_mono_ms, created_at_ms=r.at_ms, at_mono_ms=r.at_mono_ms, key=r.key,
            holder=r.holder,
        )
        if r.seq >= q.next_seq:
            q.next_seq = r.seq + 1
        self.waiters[w.id] = w
        self.links.add(w.scope_id, w.id)
        if w.key is not None:
            self.keys[(q.id, w.key)] = w.id
        self.coord.touch(w.id)
        if r.consumption_id is not None:  # granted at once
            w.state = "GRANTED"
            w.consumption_id = r.consumption_id
            w.window_start_mono_ms = r.window_start_mono_ms
            w.ended_at_ms = r.at_ms
            self._count(q, r.window_start_mono_ms, w.units)
            return
        self._enqueue(q, w)
        self.coord.touch(q.id)
        self.coord.arm_mono(w.expires_mono_ms, self._on_expiry, (w.id, w.expires_mono_ms), PRIO_WAIT_END)
        self._schedule(q, r.at_mono_ms)

    def _enqueue(self, q: QuotaState, w: QuotaWaiterState) -> None:
        line = self.lines.get(q.id)
        if line is None:
            line = self.lines[q.id] = WaitQueue(_waiter_id)
        line.add(w)
        self.coord.runs.own(w.scope_id, w.id)

    def _left(self, w: QuotaWaiterState, state: str, at_ms: int, reason: str | None) -> None:
        """WAITING -> ``state``: counts, snapshot mark, the requests waiting on it."""
        w.state = state
        w.ended_at_ms = at_ms
        w.end_reason = reason
        line = self.lines.get(w.quota_id)
        if line is not None:
            line.remove(w.id)
            if not line:
                del self.lines[w.quota_id]
        self.coord.touch(w.id)
        self.coord.notify(w.quota_id, w.id)

    @applies(QuotaWaitersGranted)
    def _apply_granted(self, r: QuotaWaitersGranted) -> None:
        q = self.table[r.quota_id]
        for g in r.grants:
            w = self.waiters[g.waiter_id]
            w.consumption_id = g.consumption_id
            w.window_start_mono_ms = r.window_start_mono_ms
            self._left(w, "GRANTED", r.at_ms, None)
            self._count(q, r.window_start_mono_ms, w.units)

    @applies(QuotaWaiterEnded)
    def _apply_waiter_ended(self, r: QuotaWaiterEnded) -> None:
        w = self.waiters[r.waiter_id]
        self._left(w, r.state, r.at_ms, "ttl" if r.state == "EXPIRED" else "cancelled")

    @applies(QuotaCooldownSet)
    def _apply_cooldown(self, r: QuotaCooldownSet) -> None:
        q = self.table[r.quota_id]
        if r.until_mono_ms > q.cooldown_until_mono_ms:  # only ever extended
            q.cooldown_until_mono_ms = r.until_mono_ms
            q.cooldown_reason = r.reason
        self.coord.touch(q.id)
        if self.waiting(q.id):
            self._arm_serve(q.id, q.cooldown_until_mono_ms)

    def on_run_inactive(self, waiter_id: str, at_ms: int, reason: str) -> None:
        """Inside the run's cancellation step: its WAITING waiter is CANCELLED, a
        request waiting on it is answered, and the queue behind it is served soon (an
        activity due now: it runs before any later request)."""
        w = self.waiters[waiter_id]
        if w.state != "WAITING":
            return
        self._left(w, "CANCELLED", at_ms, _RUN_REASON.get(reason, reason))
        self.coord.implied(QuotaWaiterEnded(waiter_id=w.id, state="CANCELLED", at_ms=at_ms))
        self._serve_soon(w.quota_id)

    # ================================================================ views
    def _consumed_view(self, q: QuotaState, r: QuotaConsumed) -> QuotaTakeView:
        return QuotaTakeView(
            quota_id=q.id, quota=q.name, scope_id=r.scope_id, state="GRANTED", units=r.units,
            consumption_id=r.consumption_id, waiter_id=None, window_start=self._wall(r.window_start_mono_ms),
            window_end=self._wall(r.window_start_mono_ms + q.window_ms), remaining=self.remaining(q),
            expires_at=None, created_at=to_iso(r.at_ms), ended_at=to_iso(r.at_ms), end_reason=None, holder=r.holder,
        )

    def take_view(self, w: QuotaWaiterState) -> QuotaTakeView:
        q = self.table[w.quota_id]
        granted = w.state == "GRANTED"
        return QuotaTakeView(
            quota_id=q.id, quota=q.name, scope_id=w.scope_id, state=w.state, units=w.units,
            consumption_id=w.consumption_id, waiter_id=w.id,
            window_start=self._wall(w.window_start_mono_ms) if granted else None,
            window_end=self._wall(w.window_start_mono_ms + q.window_ms) if granted else None,
            remaining=self.remaining(q),
            expires_at=self._wall(w.expires_mono_ms) if w.state in ("WAITING", "EXPIRED") else None,
            created_at=to_iso(w.created_at_ms), ended_at=to_iso(w.ended_at_ms), end_reason=w.end_reason,
            holder=w.holder,
        )

    def view(self, q: QuotaState, waiters: bool = False) -> QuotaView:
        mono = self.coord.mono_ms()
        window = self.window_of(q, mono)
        used = self.used_in(q, window)
        cooling = q.cooldown_until_mono_ms > mono
        listed = []
        if waiters:
            for w in self.lines.get(q.id, ()):
                listed.append(self.take_view(w))
                if len(listed) >= LIST_WAITERS:
                    break
        return QuotaView(
            id=q.id, name=q.name, units_limit=q.units_limit, window_ms=q.window_ms,
            window_start=self._wall(window), window_end=self._wall(window + q.window_ms), used=used,
            remaining=q.units_limit - used, waiting=self.waiting(q.id),
            cooldown_until=self._wall(q.cooldown_until_mono_ms) if cooling else None,
            cooldown_reason=q.cooldown_reason if cooling else None, consumed_total=q.consumed_total,
            created_at=to_iso(q.created_at_ms), waiters=listed,
        )

    # ================================================================ recovery
    def rebuild_indexes(self) -> None:
        self._init_indexes()
        for q in self.table.values():
            self.by_name[(q.space, q.name)] = q.id
        waiting = []
        for w in self.waiters.values():
            self.links.add(w.scope_id, w.id)
            if w.key is not None:
                self.keys[(w.quota_id, w.key)] = w.id
            if w.state == "WAITING":
                waiting.append(w)
        for w in sorted(waiting, key=lambda w: (w.quota_id, w.seq)):
            self._enqueue(self.table[w.quota_id], w)

    def rearm(self) -> None:
        """Each WAITING waiter's expiry at its instant; each quota with waiters served at
        the boundary after its last registration or consume, at its cooldown's end,
        and now (a serve a crash cut short) -- each judged at its own due instant."""
        now = self.coord.mono_ms()
        latest: dict[str, int] = {}
        for w in self.waiters.values():
            if w.state == "WAITING":
                self.coord.arm_mono(w.expires_mono_ms, self._on_expiry, (w.id, w.expires_mono_ms), PRIO_WAIT_END)
                latest[w.quota_id] = max(latest.get(w.quota_id, 0), w.at_mono_ms)
        for qid, at in latest.items():
            q = self.table[qid]
            last = max(at, q.window_start_mono_ms)
            due = [self.window_of(q, last) + q.window_ms, now]
            if q.cooldown_until_mono_ms > last:
                due.append(q.cooldown_until_mono_ms)
            for d in sorted(set(due)):
                self.coord.arm_mono(d, self._on_serve, (qid, d))
            self._tick_due[qid] = min(due)

    # ================================================================ retention
    def _waiter_done(self, waiter_id: str) -> bool:
        w = self.waiters.get(waiter_id)
        return w is None or w.state != "WAITING"

    def _drop(self, waiter_id: str) -> None:
        w = self.waiters.pop(waiter_id, None)
        if w is None:
            return
        if w.key is not None and self.keys.get((w.quota_id, w.key)) == waiter_id:
            del self.keys[(w.quota_id, w.key)]
        self.coord.touch(waiter_id)

    def purge_run(self, run_id: str) -> int:
        """The run's finished takes (waiters GRANTED, EXPIRED, CANCELLED; what they took
        stays counted in the quota). Quotas themselves are named, space-wide entities:
        never purged."""
        return self.links.purge(run_id, self._waiter_done, self._drop)

    # ================================================================ events
    @emits(QuotaCreated)
    def _ev_created(self, r: QuotaCreated):
        return ev(r.space, "quota.created", "quota", r.id, None, r.at_ms,
                  {"name": r.name, "units_limit": r.units_limit, "window_ms": r.window_ms})

    @emits(QuotaConsumed)
    def _ev_consumed(self, r: QuotaConsumed):
        q = self.table[r.quota_id]
        return ev(q.space, "quota.consumed", "quota", q.id, r.scope_id, r.at_ms,
                  data(name=q.name, units=r.units, consumption_id=r.consumption_id, holder=r.holder))

    @emits(QuotaWaiterAdded)
    def _ev_waiter_added(self, r: QuotaWaiterAdded):
        q = self.table[r.quota_id]
        if r.consumption_id is not None:  # granted at once
            return ev(r.space, "quota.consumed", "quota", q.id, r.scope_id, r.at_ms,
                      data(name=q.name, units=r.units, consumption_id=r.consumption_id, waiter=r.id, holder=r.holder))
        return ev(r.space, "quota.waiting", "quota", q.id, r.scope_id, r.at_ms,
                  data(name=q.name, units=r.units, waiter=r.id, holder=r.holder))

    @emits(QuotaWaitersGranted)
    def _ev_granted(self, r: QuotaWaitersGranted):
        q = self.table[r.quota_id]
        out = []
        for g in r.grants:
            w = self.waiters[g.waiter_id]
            out.append(ev(q.space, "quota.granted", "quota", q.id, w.scope_id, r.at_ms,
                          {"name": q.name, "units": w.units, "consumption_id": g.consumption_id, "waiter": w.id}))
        return out

    @emits(QuotaWaiterEnded)
    def _ev_waiter_ended(self, r: QuotaWaiterEnded):
        w = self.waiters[r.waiter_id]
        q = self.table[w.quota_id]
        return ev(q.space, "quota.wait_ended", "quota", q.id, w.scope_id, r.at_ms,
                  {"name": q.name, "waiter": w.id, "state": r.state, "units": w.units})

    @emits(QuotaCooldownSet)
    def _ev_cooldown(self, r: QuotaCooldownSet):
        q = self.table[r.quota_id]
        return ev(q.space, "quota.cooldown", "quota", q.id, None, r.at_ms,
                  data(name=q.name, until=to_iso(self.coord.clock.mono_to_wall(r.until_mono_ms)), reason=r.reason))


def _waiter_id(w: QuotaWaiterState) -> str:
    return w.id
