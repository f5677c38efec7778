"""Barriers: release everyone once ``target`` distinct keys have arrived (SPEC §6).

WAITING -> RELEASED (the target-th distinct key) -> (``next_epoch``) WAITING again with
no arrivals; WAITING -> CANCELLED when its run goes inactive (waiters wake at once with
BARRIER_CANCELLED). Arrivals are idempotent per key within an epoch; arriving after the
release is BARRIER_RELEASED. ``wait`` resolves on RELEASED in the epoch it pinned, or
when the epoch has moved past it (a waiter is not fooled by reuse).
"""

from __future__ import annotations

import msgspec
import trio

from ..clock import to_iso
from ..errors import BarrierCancelledError, BarrierReleasedError, ConflictError, NotFoundError, ValidationError
from ..protocol import BarrierArrive, BarrierCreate, BarrierNextEpochOp, BarrierStatus, BarrierView, BarrierWait
from ..records import BarrierArrived, BarrierCreated, BarrierNextEpoch
from .system import short, applies, check_range, clamp_wait

__all__ = ["BarrierState", "BarrierKind"]

MAX_KEY_LEN = 256


class BarrierState(msgspec.Struct, gc=False, omit_defaults=True):
    id: str
    space: str
    scope_id: str
    target: int
    created_at_ms: int
    state: str = "WAITING"  # WAITING | RELEASED | CANCELLED
    epoch: int = 1
    keys: list[str] = msgspec.field(default_factory=list)
    released_at_ms: int | None = None


class BarrierKind:
    def _init_tables(self) -> None:
        super()._init_tables()
        self.barriers: dict[str, BarrierState] = {}
        self.scope_barriers: dict[str, list[str]] = {}
        self.inactive_hooks.append(self._barriers_on_scope_inactive)

    def entity_tables(self):
        t = super().entity_tables()
        t["bar"] = (self.barriers, BarrierState)
        return t

    def get_barrier(self, space: str, barrier_id: str) -> BarrierState:
        b = self.barriers.get(barrier_id) if isinstance(barrier_id, str) else None
        if b is None or b.space != space:
            raise NotFoundError(f"no barrier {short(barrier_id)} in this space", details={"barrier_id": barrier_id})
        return b

    def barrier_view(self, b: BarrierState) -> BarrierView:
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
        )

    def op_barrier_create(self, session, op: BarrierCreate) -> BarrierView:
        scope = self.get_scope(session.space, op.scope_id)
        check_range("target", op.target, 1, 1_000_000)
        self.require_active(scope.id)
        rec = BarrierCreated(id=self.ids.new("bar"), space=session.space, scope_id=scope.id, target=op.target,
                             at_ms=self.now_ms())
        self.commit([rec])
        return self.barrier_view(self.barriers[rec.id])

    @applies(BarrierCreated)
    def _apply_barrier_created(self, r: BarrierCreated) -> None:
        b = BarrierState(id=r.id, space=r.space, scope_id=r.scope_id, target=r.target, created_at_ms=r.at_ms)
        self.barriers[b.id] = b
        self.scope_barriers.setdefault(b.scope_id, []).append(b.id)
        self.touch(b.id)

    def op_barrier_arrive(self, session, op: BarrierArrive) -> BarrierView:
        b = self.get_barrier(session.space, op.barrier_id)
        if not isinstance(op.key, str) or not 1 <= len(op.key) <= MAX_KEY_LEN:
            raise ValidationError(f"key must be 1 to {MAX_KEY_LEN} characters", details={"field": "key"})
        if b.state == "CANCELLED":
            self.require_active(b.scope_id)  # SPEC §2: arrivals on an inactive run are SCOPE_CANCELLED/DEADLINE_EXCEEDED
            raise BarrierCancelledError(f"barrier {b.id} was cancelled (its run was cancelled)")
        if op.key in b.keys:
            return self.barrier_view(b)  # idempotent per key within the epoch
        if b.state == "RELEASED":
            raise BarrierReleasedError(
                f"barrier {b.id} already released in epoch {b.epoch}; call next_epoch() to reuse it",
                details={"epoch": b.epoch},
            )
        self.require_active(b.scope_id)
        releases = len(b.keys) + 1 >= b.target
        self.commit([BarrierArrived(id=b.id, key=op.key, epoch=b.epoch, at_ms=self.now_ms(), releases=releases)])
        return self.barrier_view(b)

    @applies(BarrierArrived)
    def _apply_barrier_arrived(self, r: BarrierArrived) -> None:
        b = self.barriers[r.id]
        b.keys.append(r.key)
        if r.releases:
            b.state = "RELEASED"
            b.released_at_ms = r.at_ms
            self.notifier.notify(b.id)
        self.touch(b.id)

    def op_barrier_status(self, session, op: BarrierStatus) -> BarrierView:
        return self.barrier_view(self.get_barrier(session.space, op.barrier_id))

    def op_barrier_wait(self, session, op: BarrierWait):
        b = self.get_barrier(session.space, op.barrier_id)
        wait_ms = clamp_wait(op.wait_ms)
        epoch = b.epoch if op.epoch is None else op.epoch
        done = self._barrier_done(b, epoch)
        if done or wait_ms == 0:
            return self.barrier_view(b)
        return self._barrier_wait(b, epoch, wait_ms)

    def _barrier_done(self, b: BarrierState, epoch: int) -> bool:
        if b.state == "CANCELLED":
            raise BarrierCancelledError(f"barrier {b.id} was cancelled (its run was cancelled)")
        return b.epoch > epoch or (b.epoch == epoch and b.state == "RELEASED")

    async def _barrier_wait(self, b: BarrierState, epoch: int, wait_ms: int) -> BarrierView:
        with trio.move_on_after(wait_ms / 1000):
            while not self._barrier_done(b, epoch):
                await self.notifier.event(b.id).wait()
        return self.barrier_view(b)

    def op_barrier_next_epoch(self, session, op: BarrierNextEpochOp) -> BarrierView:
        b = self.get_barrier(session.space, op.barrier_id)
        if b.state == "CANCELLED":
            raise BarrierCancelledError(f"barrier {b.id} was cancelled (its run was cancelled)")
        if b.state != "RELEASED":
            raise ConflictError(
                f"barrier {b.id} is {b.state} in epoch {b.epoch}; only a released barrier starts a new epoch"
            )
        self.require_active(b.scope_id)
        self.commit([BarrierNextEpoch(id=b.id, epoch=b.epoch + 1, at_ms=self.now_ms())])
        return self.barrier_view(b)

    @applies(BarrierNextEpoch)
    def _apply_barrier_next_epoch(self, r: BarrierNextEpoch) -> None:
        b = self.barriers[r.id]
        b.epoch = r.epoch
        b.state = "WAITING"
        b.keys = []
        b.released_at_ms = None
        self.touch(b.id)
        self.notifier.notify(b.id)

    def _barriers_on_scope_inactive(self, scope_id: str, at_ms: int, reason: str) -> None:
        for bid in self.scope_barriers.get(scope_id, ()):
            b = self.barriers[bid]
            if b.state == "WAITING":
                b.state = "CANCELLED"
                self.touch(b.id)
                self.notifier.notify(b.id)

    def rebuild_indexes(self) -> None:
        super().rebuild_indexes()
        self.scope_barriers = {}
        for b in self.barriers.values():
            self.scope_barriers.setdefault(b.scope_id, []).append(b.id)
