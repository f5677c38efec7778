"""Admission holds: cross-shard admission of a task whose requirements are its space's
home shard's (a part of the :class:`~rallypoint.actors.outbox.Outbox` kind; the whole
design: its module docstring).

- **Home shard** (entity ``adm:<task id>``, :class:`HoldState`): ``admission.reserve``
  takes what one delivery of the task needs -- through the admission kind's requirement
  registry (``actors/admission.py``, ``REQUIREMENT_KINDS``: one admission decision, one
  set of limits for local and cross-shard) -- with ``AdmissionHeld``, in one commit,
  idempotent per (task, token), leased: a reservation never confirmed lapses
  (``AdmissionEnded``); an outbox entry ``delivered`` confirms it, ``delivery_ended``
  gives it back.
- **Run's shard** (entity ``tsv:<task id>``, :class:`ReservedState`): the requirement kind
  of ``TaskRequirements.remote``: a ready task is delivered only with a reservation of
  the home shard for that delivery; a receive that finds none lists the task in
  ``wanted`` (the leader's reserver asks the home shard, then ``admission.hold`` ->
  ``TaskReservationHeld``); the delivery's commit carries ``ReservationUsed``.
"""

from __future__ import annotations

import msgspec

from ..errors import LeaseLostError, NotFoundError, ValidationError
from ..protocol import AdmissionHold, AdmissionReserve, AdmissionReserveView, GrantView, OutboxItem
from ..records import (
    AdmissionEnded,
    AdmissionHeld,
    BudgetReserved,
    PoolGranted,
    RemoteDeliveryNoted,
    ReservationUsed,
    TaskCancelled,
    TaskReservationHeld,
)
from .admission import RemoteDelivery
from .common import applies, require_local, require_node, short
from .opmark import ALWAYS, LOCAL, NODE, PEER, by_op, by_run, op
from .runtime import PRIO_WAIT_END

__all__ = ["AdmissionHolds", "HoldState", "ReservedState"]


class HoldState(msgspec.Struct, gc=False, omit_defaults=True):
    """On the home shard (entity ``adm:<task id>``): the reservation for delivery
    ``token`` of a task of ``shard``. ``confirmed``: that delivery started (it no
    longer lapses); ``ended``: released, settled or lapsed."""

    id: str
    task_id: str
    token: int
    space: str
    scope_id: str
    shard: int
    grants: list[str]
    reservations: list[str]
    expires_mono_ms: int
    at_ms: int
    confirmed: bool = False
    ended: str | None = None


class ReservedState(msgspec.Struct, gc=False, omit_defaults=True):
    """On the run's shard (entity ``tsv:<task id>``): what the home ``shard`` reserved
    for delivery ``token`` of the task (``grants``: encoded GrantViews), usable until
    server time ``until_mono_ms``; ``used``: that delivery started."""

    id: str
    task_id: str
    token: int
    shard: int
    grants: bytes
    reservations: list[str]
    until_mono_ms: int
    used: bool = False


_grants_enc = msgspec.msgpack.Encoder()
_grants_dec = msgspec.msgpack.Decoder(list[GrantView])


class AdmissionHolds:
    """Cross-shard admission (see the module docstring): on the home shard the holds
    (``holds``, ``holds_of``), on the run's shard the reservations its tasks hold
    (``reserved``) and the tasks waiting for one (``wanted``). A part of
    :class:`~rallypoint.actors.outbox.Outbox`: its tables are made there."""

    # ------------------------------------------------------------------ admission: the home shard
    @op(AdmissionReserve, route=by_run(), permission=NODE, resend=ALWAYS, shard=PEER,
        reply=AdmissionReserveView)
    def op_admission_reserve(self, actor, session, op: AdmissionReserve):
        """Reserve what delivery ``op.token`` of task ``op.task_id`` needs (see
        ``protocol.AdmissionReserve``), on the run's (remote) actor: one commit of the
        grants (``PoolGranted`` with the task's id), the budget reservations
        (``BudgetReserved`` with its id and token) and ``AdmissionHeld``; or WAITING.
        Every requirement type goes through the admission kind's registry
        (:meth:`Admission.prepare_named`, :meth:`Admission.take_now`): the checks,
        limits and all-or-nothing take of a local delivery.
        FORBIDDEN without the node secret; NOT_FOUND (pool, budget), VALIDATION_FAILED
        (units, amounts: as at a submission on one node), SCOPE_CANCELLED /
        DEADLINE_EXCEEDED (the run ended), STALE_CLAIM (a newer token holds)."""
        require_node(session, "admission.reserve")
        coord = self.coord
        space = session.space
        run = coord.runs.get(space, op.scope_id)
        hid = f"adm:{op.task_id}"
        h = self.holds.get(hid)
        if h is not None and h.token > op.token:
            raise LeaseLostError(f"delivery {op.token} of task {op.task_id} is stale: token {h.token} holds a "
                                 "reservation", details={"task_id": op.task_id, "token": h.token})
        if h is not None and h.token == op.token and h.ended is None:
            return self._reserve_view(h)  # a re-sent reserve: what it got
        coord.runs.require_active(run.id)
        admission = coord.admission
        stored = admission.prepare_named(space, op)  # one set of limits: each requirement kind's
        if not 100 <= op.lease_ms <= 600_000:
            raise ValidationError("lease_ms must be 100 to 600000", details={"field": "lease_ms"})
        now = coord.now_ms()
        taken = admission.take_now(RemoteDelivery(op.task_id, op.token - 1, space, run.id,
                                                  grant_holder=f"task {op.task_id}"), stored, now)
        if taken is None:
            return AdmissionReserveView(status="WAITING", task_id=op.task_id, token=op.token)
        recs: list = []
        if h is not None and h.ended is None:  # an older token's reservation, never delivered: it goes
            recs.append(AdmissionEnded(task_id=op.task_id, token=h.token, outcome="superseded", at_ms=now))
        recs += taken
        recs.append(AdmissionHeld(task_id=op.task_id, token=op.token, space=space, scope_id=run.id,
                                  shard=run.remote_shard if run.remote_shard is not None else -1,
                                  grants=[r.id for r in taken if isinstance(r, PoolGranted)],
                                  reservations=[r.id for r in taken if isinstance(r, BudgetReserved)],
                                  expires_mono_ms=coord.mono_ms() + op.lease_ms, at_ms=now))
        coord.commit(recs)
        return self._reserve_view(self.holds[hid])

    def _reserve_view(self, h: HoldState) -> AdmissionReserveView:
        pools = self.coord.pools
        return AdmissionReserveView(status="GRANTED", task_id=h.task_id, token=h.token,
                                    grants=[pools.grant_view(pools.grants[g], True) for g in h.grants
                                            if g in pools.grants],
                                    reservations=list(h.reservations),
                                    lease_left_ms=max(0, h.expires_mono_ms - self.coord.mono_ms()))

    @applies(AdmissionHeld)
    def _apply_held(self, r: AdmissionHeld) -> None:
        hid = f"adm:{r.task_id}"
        if hid not in self.holds:
            self.holds_of.setdefault(r.scope_id, []).append(hid)
        self.holds[hid] = HoldState(id=hid, task_id=r.task_id, token=r.token, space=r.space, scope_id=r.scope_id,
                                    shard=r.shard, grants=list(r.grants), reservations=list(r.reservations),
                                    expires_mono_ms=r.expires_mono_ms, at_ms=r.at_ms)
        self.coord.touch(hid)
        self.coord.arm_mono(r.expires_mono_ms, self._on_lapse, (r.task_id, r.token, r.expires_mono_ms),
                            PRIO_WAIT_END)

    def _on_lapse(self, arg) -> None:
        task_id, token, expires = arg
        h = self.holds.get(f"adm:{task_id}")
        if h is None or h.token != token or h.confirmed or h.ended is not None or h.expires_mono_ms != expires:
            return
        self.coord.commit([AdmissionEnded(task_id=task_id, token=token, outcome="lapsed",
                                          at_ms=self.coord.now_ms())])

    def _end_hold(self, h: HoldState, outcome: str, new_state: str, at_ms: int) -> None:
        """Apply: the reservation ends -- its grants back to their pools, its budget
        reservations settled in full (``new_state`` SUCCEEDED) or voided."""
        coord = self.coord
        h.ended = outcome
        coord.touch(h.id)
        coord.admission.release_remote(RemoteDelivery(h.task_id, h.token), at_ms, new_state)

    @applies(AdmissionEnded)
    def _apply_admission_ended(self, r: AdmissionEnded) -> None:
        h = self.holds.get(f"adm:{r.task_id}")
        if h is not None and h.token == r.token and h.ended is None:
            self._end_hold(h, r.outcome, "CANCELLED", r.at_ms)

    @applies(RemoteDeliveryNoted)
    def _apply_delivery_noted(self, r: RemoteDeliveryNoted) -> None:
        self._received(r.shard, r.seq)
        h = self.holds.get(f"adm:{r.task_id}")
        if h is None or h.token != r.token or h.ended is not None:
            return  # (lapsed before the delivery was told: see docs/architecture.md)
        if r.what == "delivered":
            h.confirmed = True
            self.coord.touch(h.id)
        else:
            self._end_hold(h, "delivery_ended", r.outcome or "CANCELLED", r.at_ms)

    def rebuild_indexes(self) -> None:
        self.holds_of = {}
        for h in self.holds.values():
            self.holds_of.setdefault(h.scope_id, []).append(h.id)

    def purge_run(self, run_id: str) -> int:
        """Retention purges the (remote) run ``run_id``: the ended reservations its
        tasks' deliveries held here go, with their grants and budget reservations (on
        its own shard those go with each task; here with the run)."""
        hids = self.holds_of.pop(run_id, None)
        if not hids:
            return 0
        coord = self.coord
        n = 0
        keep = []
        for hid in hids:
            h = self.holds.get(hid)
            if h is None:
                continue
            if h.ended is None:
                keep.append(hid)  # (still held: cannot be, the run ended)
                continue
            for k in coord.task_linked_kinds:
                n += k.purge_task_links(h.task_id)
            del self.holds[hid]
            coord.touch(hid)
            n += 1
        if keep:
            self.holds_of[run_id] = keep
        return n

    def rearm(self) -> None:
        for h in self.holds.values():
            if h.ended is None and not h.confirmed:
                self.coord.arm_mono(h.expires_mono_ms, self._on_lapse, (h.task_id, h.token, h.expires_mono_ms),
                                    PRIO_WAIT_END)

    def leases_outstanding(self) -> int:
        return sum(1 for h in self.holds.values() if h.ended is None and not h.confirmed)

    def extend_leases(self, by_ms: int) -> None:
        for h in self.holds.values():
            if h.ended is None and not h.confirmed:
                h.expires_mono_ms += by_ms
                self.coord.touch(h.id)
                self.coord.arm_mono(h.expires_mono_ms, self._on_lapse, (h.task_id, h.token, h.expires_mono_ms),
                                    PRIO_WAIT_END)

    # ------------------------------------------------------------------ admission: the run's shard
    # The requirement kind of ``TaskRequirements.remote`` (actors/admission.py): a ready
    # task is delivered only with a reservation of the home shard for that delivery.
    def requirement_fits(self, value, pending: dict, task=None) -> bool:
        if task is None:
            return False
        r = self.reserved.get("tsv:" + task.id)
        return (r is not None and not r.used and r.token == task.token + 1
                and r.until_mono_ms > self.coord.mono_ms())

    def requirement_skipped(self, task, value, pending: dict) -> None:
        if self.coord.replaying:
            return
        new = task.id not in self.wanted
        self.wanted[task.id] = self.coord.mono_ms()
        if new and self.on_want is not None:
            self.on_want()

    def requirement_hold(self, value, pending: dict) -> None:
        pass

    def requirement_records(self, task, value, at_ms: int) -> list:
        return [ReservationUsed(task_id=task.id, token=task.token + 1, at_ms=at_ms)]

    def requirement_release(self, task, value, at_ms, new_state: str) -> None:
        """Apply: the delivery ended: the home shard is told (its grants back, its budget
        reservations settled or voided there). Idempotent."""
        rid = "tsv:" + task.id
        r = self.reserved.get(rid)
        if r is None or not r.used or r.token != task.token:
            return
        del self.reserved[rid]
        self.coord.touch(rid)
        t = self.coord.queues.tasks.get(task.id)
        space = t.space if t is not None else ""
        run_id = t.scope_id if t is not None else ""
        self._append(r.shard, lambda seq: OutboxItem(
            seq=seq, run_id=run_id, space=space, reason="delivery_ended", at_ms=at_ms or self.coord.now_ms(),
            task_id=task.id, token=r.token, outcome=new_state))

    def requirement_track(self, task, value) -> None:
        pass

    def requirement_untrack(self, task, value) -> None:
        """The task finished: a reservation it never used is forgotten here (the home
        shard lets it lapse)."""
        self.wanted.pop(task.id, None)
        rid = "tsv:" + task.id
        r = self.reserved.get(rid)
        if r is not None and not r.used:
            del self.reserved[rid]
            self.coord.touch(rid)

    def requirement_views(self, task) -> dict:
        r = self.reserved.get("tsv:" + task.id)
        if r is None or r.token != task.token:
            return {}
        return {"grants": _grants_dec.decode(r.grants), "reservations": list(r.reservations)}

    @applies(ReservationUsed)
    def _apply_used(self, r: ReservationUsed) -> None:
        rid = "tsv:" + r.task_id
        st = self.reserved.get(rid)
        if st is None or st.token != r.token:
            return
        st.used = True
        self.coord.touch(rid)
        self.wanted.pop(r.task_id, None)
        t = self.coord.queues.tasks.get(r.task_id)
        self._append(st.shard, lambda seq: OutboxItem(
            seq=seq, run_id=t.scope_id if t is not None else "", space=t.space if t is not None else "",
            reason="delivered", at_ms=r.at_ms, task_id=r.task_id, token=r.token))

    @op(AdmissionHold, route=by_op("route_hold"), permission=LOCAL, resend=ALWAYS, shard=PEER,
        reply=AdmissionReserveView)
    def op_admission_hold(self, actor, session, op: AdmissionHold):
        """Keep the home shard's reservation for delivery ``op.token`` of a QUEUED task
        (``TaskReservationHeld``) and wake the receives parked for it; or, ``refused``,
        cancel the task (its requirements can never be met). A task no longer QUEUED, or
        past that token, changes nothing. FORBIDDEN unless local."""
        require_local(session, "admission.hold")
        coord = self.coord
        t = coord.queues.tasks.get(op.task_id)
        if t is None or t.state != "QUEUED" or t.token + 1 != op.token:
            return AdmissionReserveView(status="STALE", task_id=op.task_id, token=op.token)
        now = coord.now_ms()
        if op.refused is not None:
            coord.commit([TaskCancelled(task_id=t.id, at_ms=now, reason="requirements_refused")])
            return AdmissionReserveView(status="REFUSED", task_id=op.task_id, token=op.token)
        coord.commit([TaskReservationHeld(task_id=t.id, token=op.token, shard=op.shard,
                                          grants=_grants_enc.encode(op.grants), reservations=list(op.reservations),
                                          until_mono_ms=coord.mono_ms() + op.usable_ms, at_ms=now)])
        return AdmissionReserveView(status="GRANTED", task_id=op.task_id, token=op.token, grants=op.grants,
                                    reservations=op.reservations)

    def route_hold(self, session, op) -> str:
        """``admission.hold`` runs on the task's run's actor."""
        t = self.coord.queues.tasks.get(op.task_id) if isinstance(op.task_id, str) else None
        if t is None:
            raise NotFoundError(f"no task {short(op.task_id)} here", details={"task_id": short(op.task_id)})
        return t.scope_id

    @applies(TaskReservationHeld)
    def _apply_reservation_held(self, r: TaskReservationHeld) -> None:
        rid = "tsv:" + r.task_id
        self.reserved[rid] = ReservedState(id=rid, task_id=r.task_id, token=r.token, shard=r.shard, grants=r.grants,
                                           reservations=list(r.reservations), until_mono_ms=r.until_mono_ms)
        self.coord.touch(rid)
        self.wanted.pop(r.task_id, None)
        coord = self.coord
        if coord.replaying:
            return
        t = coord.queues.tasks.get(r.task_id)
        if t is None:
            return
        key = ("recv", t.mailbox_id)  # the receives parked on the task's run and its ancestors
        runs = coord.runs.table
        s = runs.get(t.scope_id)
        while s is not None:
            coord.notify(s.id, key)
            s = runs.get(s.parent_id) if s.parent_id else None
