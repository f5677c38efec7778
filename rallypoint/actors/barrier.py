"""Barriers: release everyone once ``target`` distinct keys have arrived (SPEC §6).

WAITING -> RELEASED (the target-th distinct key) -> (``next_epoch``) WAITING again with
no arrivals; WAITING -> CANCELLED when its run goes inactive. Arrivals are idempotent per
key within an epoch; arriving after the release is BARRIER_RELEASED. ``wait`` resolves
on RELEASED in the epoch it pinned, or when the epoch has moved past it (a waiter is not
fooled by reuse); on a cancelled barrier it raises BARRIER_CANCELLED.

**Reuse without races** (issue 42, item 3). An arrival may name its ``epoch``: the
current one counts as usual; the *next* one, while the current is RELEASED, is an
**early arrival** -- held (``next_keys``) and counted into the next epoch the moment
``next_epoch`` starts it (which releases at once if enough arrived early); an older
epoch is BARRIER_RELEASED, a later one or the next while the current still waits is
CONFLICT. Without ``epoch`` an arrival counts in the current epoch (a repeat of a key
that already arrived there, RELEASED or not, changes nothing). A waiter names the epoch
of its own arrival (the SDK's ``wait`` does that by itself after ``arrive``), so the
arrive-then-wait loop of a reused barrier cannot miss its own release however late it
waits.

The barrier's actor lives in its run's nursery; waits park there, so the run's end
answers them (BARRIER_CANCELLED) through the nursery's cancellation.
"""

from __future__ import annotations

import msgspec

from ..clock import to_iso
from ..errors import BarrierCancelledError, BarrierReleasedError, ConflictError
from ..protocol import BarrierArrive, BarrierCreate, BarrierNextEpochOp, BarrierStatus, BarrierView, BarrierWait
from ..events import emits, ev
from ..records import BarrierArrived, BarrierCancelled, BarrierCreated, BarrierNextEpoch
from .common import applies, check_key, check_label, check_range, clamp_wait
from .kind import Kind
from .opmark import ALWAYS, C, NEVER, R, W, asked, by, by_run, keyed, op
from .runtime import Park

__all__ = ["BarrierState", "Barriers"]


class BarrierState(msgspec.Struct, gc=False, omit_defaults=True):
    id: str
    space: str
    scope_id: str
    target: int
    created_at_ms: int
    state: str = "WAITING"  # WAITING | RELEASED | CANCELLED
    epoch: int = 1
    keys: list[str] = msgspec.field(default_factory=list)
    #: early arrivals: keys that arrived for ``epoch + 1`` while this epoch is RELEASED
    next_keys: list[str] = msgspec.field(default_factory=list)
    released_at_ms: int | None = None
    cancel_reason: str | None = None  # cancelled | completed | deadline
    name: str | None = None  # a named barrier: one per (run, name)


class Barriers(Kind):
    """Barriers: create, arrive, wait, next epoch; cancelled with their run."""

    prefix = "bar"
    name = "barriers"
    noun = "barrier"
    id_field = "barrier_id"

    def __init__(self, coord) -> None:
        super().__init__(coord)
        self.table: dict[str, BarrierState] = {}
        self.by_name: dict[tuple[str, str], str] = {}  # (run, name) -> barrier id

    def entity_tables(self):
        return {"bar": (self.table, BarrierState)}

    def parent_actor_id(self, barrier_id: str) -> str | None:
        return self.table[barrier_id].scope_id


    def view(self, b: BarrierState) -> BarrierView:
        return BarrierView(
            id=b.id,
            scope_id=b.scope_id,
            state=b.state,
            target=b.target,
            arrivals=len(b.keys),
            keys=list(b.keys),
            epoch=b.epoch,
            created_at=to_iso(b.created_at_ms),
            released_at=to_iso(b.released_at_ms),
            name=b.name,
            next_keys=list(b.next_keys),
        )

    def _cancelled(self, b: BarrierState) -> BarrierCancelledError:
        why = {"deadline": "its run passed its deadline", "completed": "its run completed"}.get(
            b.cancel_reason or "", "its run was cancelled"
        )
        return BarrierCancelledError(
            f"barrier {b.id} was cancelled ({why})",
            details={"barrier_id": b.id, "scope_id": b.scope_id, "reason": b.cancel_reason or "cancelled"},
        )

    @op(BarrierCreate, route=by_run(), permission=C, resend=keyed("name"))
    def op_barrier_create(self, actor, session, op: BarrierCreate) -> BarrierView:
        """A barrier of run ``scope_id`` releasing at ``target`` distinct keys. With
        ``name``: the run's barrier of that name, made by the first call and returned by
        later ones (CONFLICT when their ``target`` differs). SCOPE_CANCELLED /
        DEADLINE_EXCEEDED on an inactive run (also for an existing named one)."""
        coord = self.coord
        run = coord.runs.get(session.space, op.scope_id)
        check_range("target", op.target, 1, 1_000_000)
        if op.name is not None:
            check_label("name", op.name)
            bid = self.by_name.get((run.id, op.name))
            if bid is not None:
                b = self.table[bid]
                if b.target != op.target:
                    raise ConflictError(f"barrier {op.name!r} of run {run.id} exists with target {b.target}, "
                                        f"not {op.target}", details={"field": "target", "existing": b.target})
                coord.runs.require_active(run.id)
                return self.view(b)
        coord.runs.require_active(run.id)
        rec = BarrierCreated(id=coord.new_id("bar", under=run.id), space=session.space, scope_id=run.id, target=op.target,
                             at_ms=coord.now_ms(), name=op.name)
        coord.commit([rec])
        return self.view(self.table[rec.id])

    @applies(BarrierCreated)
    def _apply_created(self, r: BarrierCreated) -> None:
        b = BarrierState(id=r.id, space=r.space, scope_id=r.scope_id, target=r.target, created_at_ms=r.at_ms,
                         name=r.name)
        self.table[b.id] = b
        if b.name is not None:
            self.by_name[(b.scope_id, b.name)] = b.id
        self.coord.runs.own(b.scope_id, b.id)
        self.coord.touch(b.id)

    @op(BarrierArrive, route=by("barrier_id"), permission=W, resend=NEVER)
    def op_barrier_arrive(self, actor, session, op: BarrierArrive) -> BarrierView:
        """Arrive with ``key`` (idempotent per key within the epoch) in ``op.epoch``
        (None: the current one; the next one while the current is RELEASED: an early
        arrival, see the module docstring). BARRIER_RELEASED after the release (or for
        an epoch that is over), CONFLICT for an epoch not next; SCOPE_CANCELLED /
        DEADLINE_EXCEEDED on an inactive run."""
        coord = self.coord
        b = self.get(session.space, op.barrier_id)
        check_key("key", op.key)
        if b.state == "CANCELLED":
            coord.runs.require_active(b.scope_id)  # SPEC §2: arrivals on an inactive run
            raise self._cancelled(b)
        if op.epoch is not None and op.epoch != b.epoch:
            return self._arrive_other_epoch(b, op)
        if op.key in b.keys:
            return self.view(b)
        if b.state == "RELEASED":
            raise BarrierReleasedError(
                f"barrier {b.id} already released in epoch {b.epoch}; call next_epoch() to reuse it",
                details={"epoch": b.epoch},
            )
        coord.runs.require_active(b.scope_id)
        releases = len(b.keys) + 1 >= b.target
        coord.commit([BarrierArrived(id=b.id, key=op.key, epoch=b.epoch, at_ms=coord.now_ms(), releases=releases)])
        return self.view(b)

    def _arrive_other_epoch(self, b: BarrierState, op: BarrierArrive) -> BarrierView:
        epoch = op.epoch
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 1:
            from ..errors import ValidationError

            raise ValidationError("epoch must be an integer >= 1", details={"field": "epoch"})
        if epoch < b.epoch:
            raise BarrierReleasedError(f"epoch {epoch} of barrier {b.id} is over (it is at epoch {b.epoch})",
                                       details={"epoch": b.epoch})
        if epoch > b.epoch + 1 or b.state != "RELEASED":
            raise ConflictError(
                f"barrier {b.id} is {b.state} in epoch {b.epoch}: an arrival may name its current epoch, or the "
                "next one once the current is released (an early arrival, counted when next_epoch starts it)",
                details={"epoch": b.epoch, "state": b.state})
        if op.key in b.next_keys:
            return self.view(b)
        self.coord.runs.require_active(b.scope_id)
        self.coord.commit([BarrierArrived(id=b.id, key=op.key, epoch=epoch, at_ms=self.coord.now_ms())])
        return self.view(b)

    @applies(BarrierArrived)
    def _apply_arrived(self, r: BarrierArrived) -> None:
        b = self.table[r.id]
        if r.epoch == b.epoch + 1:  # an early arrival: counted when next_epoch starts that epoch
            b.next_keys.append(r.key)
            self.coord.touch(b.id)
            return
        b.keys.append(r.key)
        if r.releases:
            b.state = "RELEASED"
            b.released_at_ms = r.at_ms
            self.coord.notify(b.id, "b")
        self.coord.touch(b.id)

    @op(BarrierStatus, route=by("barrier_id"), permission=R, resend=ALWAYS)
    def op_barrier_status(self, actor, session, op: BarrierStatus) -> BarrierView:
        return self.view(self.get(session.space, op.barrier_id))

    @op(BarrierWait, route=by("barrier_id"), permission=R, resend=ALWAYS, waits=asked("wait_ms"), reply=BarrierView)
    def op_barrier_wait(self, actor, session, op: BarrierWait):
        """The barrier once released in ``epoch`` (default: the current one) or a later
        epoch began; parks on the barrier's actor. BARRIER_CANCELLED once cancelled."""
        b = self.get(session.space, op.barrier_id)
        wait_ms = clamp_wait(op.wait_ms)
        epoch = b.epoch if op.epoch is None else op.epoch
        if self._done(b, epoch) or wait_ms == 0:
            return self.view(b)
        view = self.view
        return Park("b", lambda: view(b) if self._done(b, epoch) else None, wait_ms, lambda: view(b))

    def _done(self, b: BarrierState, epoch: int) -> bool:
        if b.state == "CANCELLED":
            raise self._cancelled(b)
        return b.epoch > epoch or (b.epoch == epoch and b.state == "RELEASED")

    @op(BarrierNextEpochOp, route=by("barrier_id"), permission=W, resend=NEVER)
    def op_barrier_next_epoch(self, actor, session, op: BarrierNextEpochOp) -> BarrierView:
        """Start a new epoch with the early arrivals as its first (releasing at once if
        they reach the target); only from RELEASED (CONFLICT otherwise)."""
        coord = self.coord
        b = self.get(session.space, op.barrier_id)
        if b.state == "CANCELLED":
            raise self._cancelled(b)
        if b.state != "RELEASED":
            raise ConflictError(
                f"barrier {b.id} is {b.state} in epoch {b.epoch}; only a released barrier starts a new epoch"
            )
        coord.runs.require_active(b.scope_id)
        coord.commit([BarrierNextEpoch(id=b.id, epoch=b.epoch + 1, at_ms=coord.now_ms())])
        return self.view(b)

    @applies(BarrierNextEpoch)
    def _apply_next_epoch(self, r: BarrierNextEpoch) -> None:
        b = self.table[r.id]
        b.epoch = r.epoch
        b.keys, b.next_keys = b.next_keys, []
        if len(b.keys) >= b.target:  # enough arrived early: released as it begins
            b.state = "RELEASED"
            b.released_at_ms = r.at_ms
        else:
            b.state = "WAITING"
            b.released_at_ms = None
        self.coord.touch(b.id)
        self.coord.notify(b.id, "b")

    def on_run_inactive(self, barrier_id: str, at_ms: int, reason: str) -> None:
        """Its run ended: CANCELLED. No wake-up: the barrier's actor is in the ended
        run's subtree, and the nursery cancellation answers its waits
        (BARRIER_CANCELLED)."""
        b = self.table[barrier_id]
        if b.state == "WAITING":
            b.state = "CANCELLED"
            b.cancel_reason = reason
            self.coord.touch(b.id)
            self.coord.implied(BarrierCancelled(id=b.id, at_ms=at_ms, reason=reason))

    # ================================================================ retention
    def purge_run(self, run_id: str) -> int:
        n = 0
        for bid in self.coord.runs.owned.get(run_id, ()):
            if bid.startswith("bar") and self.table.pop(bid, None) is not None:
                self.coord.touch(bid)
                n += 1
        return n

    # ================================================================ events
    @emits(BarrierCreated)
    def _ev_created(self, r: BarrierCreated):
        return ev(r.space, "barrier.created", "barrier", r.id, r.scope_id, r.at_ms, {"target": r.target})

    @emits(BarrierArrived)
    def _ev_arrived(self, r: BarrierArrived):
        b = self.table[r.id]
        early = r.epoch == b.epoch + 1
        data = {"key": r.key, "epoch": r.epoch, "arrived": len(b.next_keys if early else b.keys), "target": b.target}
        if early:
            data["early"] = True
        out = [ev(b.space, "barrier.arrived", "barrier", b.id, b.scope_id, r.at_ms, data)]
        if r.releases:
            out.append(ev(b.space, "barrier.released", "barrier", b.id, b.scope_id, r.at_ms, {"epoch": r.epoch}))
        return out

    @emits(BarrierNextEpoch)
    def _ev_next_epoch(self, r: BarrierNextEpoch):
        b = self.table[r.id]
        out = [ev(b.space, "barrier.next_epoch", "barrier", b.id, b.scope_id, r.at_ms,
                  {"epoch": r.epoch, "arrived": len(b.keys)})]
        if b.state == "RELEASED":
            out.append(ev(b.space, "barrier.released", "barrier", b.id, b.scope_id, r.at_ms, {"epoch": r.epoch}))
        return out

    @emits(BarrierCancelled)
    def _ev_cancelled(self, r: BarrierCancelled):
        b = self.table[r.id]
        return ev(b.space, "barrier.cancelled", "barrier", b.id, b.scope_id, r.at_ms, {"reason": r.reason})

    def rebuild_indexes(self) -> None:
        runs = self.coord.runs
        self.by_name = {}
        for b in self.table.values():
            runs.own(b.scope_id, b.id)
            if b.name is not None:
                self.by_name[(b.scope_id, b.name)] = b.id

