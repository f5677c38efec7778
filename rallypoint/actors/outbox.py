"""Remote runs and the outbox: what crosses the shards of a sharded cluster when a run
uses its space's home shard (design: ``../shared/SCALE-OUT.md`` §4.2; the decisions:
docs/architecture.md, "Many shards").

Claims, pools, quotas and budgets live on their space's *home shard*. A run of another
shard that uses one is known there as a **remote run**: a run-table entry with the
run's id, space and shard (``ScopeState.remote_shard``), no tree, no deadline of its
own. It owns its claims, grants, waiters and reservations there exactly as a local run
does, and its actor parks its waiting acquires, so everything the single node does at a
run's end works unchanged -- once the home shard learns of the end.

- **Link** (``run.link`` on the run's shard, asked by the home shard before the run's
  first request there: ``rallypoint.cluster.peers``): the run's shard checks the run
  takes work and journals ``RunLinked(run, home shard)``; then the home shard journals
  ``RemoteRunAdopted`` (``run.adopt_remote``) and runs the request. A link is made
  once per (run, home shard).
- **Outbox** (the run's shard): the apply of the record that ends a linked run -- its
  own ``ScopeEnded`` / ``ScopeDeadlinePassed`` or an ancestor's, over the subtree --
  appends one entry per linked home shard to that shard's outbox, numbered 1, 2, ...
  per destination. It is part of the journal entry that ends the run (made by its
  apply, so replay and the standby make the same entries), and of every snapshot.
- **Delivery**: the run shard's leader sends each destination its outbox from the
  oldest entry (``outbox.deliver``), at least once, again after any failure and after
  a failover of either side; the answer's ``received`` is journaled as
  ``OutboxAcked`` and those entries leave the outbox.
- **Receiver**: ``outbox.deliver`` applies each entry above the highest ``seq`` it holds
  of that source (``RemoteRunEnded``, journaled with that ``seq``), so an entry
  delivered twice ends nothing twice; the remote run ends in that one step (its
  waiters answered with the run's code, renewals refused), and an entry that comes
  before the run was adopted leaves it ended (a late request is refused).

- **Admission** of a task whose requirements are the home shard's (``TaskRequirements.
  remote``, by name): a receive that finds no reservation for the task's next delivery
  skips it and lists it in ``wanted``; the run shard's leader asks the home shard
  (``admission.reserve``: grants, budget reservations and ``AdmissionHeld`` in one
  commit there, idempotent per (task, token), leased) and journals the answer here
  (``admission.hold`` -> ``TaskReservationHeld``); the delivery's commit carries
  ``ReservationUsed`` (outbox entry ``delivered``: the home shard's hold stops
  lapsing), its end an outbox entry ``delivery_ended`` (units back, budget settled or
  voided there). A reservation never confirmed lapses on the home shard.

Inter-shard calls (``run.link``, ``outbox.deliver``, ``admission.reserve``) are accepted
only from a session authenticated with the cluster's node secret (``Session.node``); the
in-process steps (``run.adopt_remote``, ``outbox.ack``, ``admission.hold``) only from
the node itself (``Session.local``).
"""

from __future__ import annotations

import msgspec

from ..errors import ForbiddenError, LeaseLostError, NotFoundError, ValidationError
from ..ids import is_id, slot_of
from ..protocol import (
    AdmissionHold,
    AdmissionReserve,
    AdmissionReserveView,
    BudgetReserve,
    ClaimAcquire,
    GrantView,
    OutboxAck,
    OutboxDeliver,
    OutboxDeliverView,
    OutboxItem,
    PoolAcquire,
    QuotaTake,
    RemoteRunAdopt,
    RunLink,
    RunLinkView,
)
from ..records import (
    AdmissionEnded,
    AdmissionHeld,
    BudgetReserved,
    OutboxAcked,
    PoolGranted,
    RemoteDeliveryNoted,
    RemoteRunAdopted,
    RemoteRunEnded,
    ReservationUsed,
    RunLinked,
    TaskCancelled,
    TaskReservationHeld,
)
from .claim import new_token
from .common import applies, short
from .kind import Kind
from .opmark import ALWAYS, LOCAL, NODE, PEER, SPACE, by_op, by_run, in_slot, op
from .runtime import PRIO_WAIT_END

__all__ = ["Outbox", "OutboxState", "InboxState", "REMOTE_RUN_OPS"]

#: The ops a run of another shard may send to its space's home shard (their
#: ``scope_id`` names the run): the home shard links the run first when it does not
#: know it (``Service.submit``).
REMOTE_RUN_OPS = (ClaimAcquire, PoolAcquire, QuotaTake, BudgetReserve, AdmissionReserve)
#: Most pools and budgets a task's requirements name (as on one node).
_MAX_POOLS, _MAX_BUDGETS = 4, 2
_RUN_END_REASONS = ("cancelled", "completed", "deadline")



class OutboxState(msgspec.Struct, gc=False, omit_defaults=True):
    """The outbox to home shard ``shard`` (entity ``obx:<shard>``): ``items`` not yet
    acknowledged (oldest first), ``next_seq`` the number of the next entry, ``acked``
    the highest acknowledged."""

    id: str
    shard: int
    next_seq: int = 1
    acked: int = 0
    items: list[OutboxItem] = []


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


class _Task:
    """What the requirement kinds' release needs of a task that lives on another shard."""

    __slots__ = ("id", "token")

    def __init__(self, task_id: str, token: int) -> None:
        self.id = task_id
        self.token = token


_grants_enc = msgspec.msgpack.Encoder()
_grants_dec = msgspec.msgpack.Decoder(list[GrantView])


class InboxState(msgspec.Struct, gc=False, omit_defaults=True):
    """What this shard holds of shard ``shard``'s outbox (entity ``obi:<shard>``):
    every entry up to ``received``."""

    id: str
    shard: int
    received: int = 0


def _require_node(session, tag: str) -> None:
    if not (getattr(session, "node", False) or getattr(session, "local", False)):
        raise ForbiddenError(f"{tag} is a call between the nodes of a sharded cluster, authenticated by the "
                             "cluster's node secret; clients do not make it")


def _require_local(session, tag: str) -> None:
    if not getattr(session, "local", False):
        raise ForbiddenError(f"{tag} is a node's own step (in-process); it is not taken over the wire")


class Outbox(Kind):
    """Remote runs, links and the outbox (see the module docstring). Two tables:
    outboxes (``obx:<shard>``) and inboxes (``obi:<shard>``); ``on_change`` (set by
    the leader's sender) is called when an outbox gets an entry."""

    prefix = "obx"
    name = "outbox"
    noun = "outbox"

    def __init__(self, coord) -> None:
        super().__init__(coord)
        self.inbox: dict[str, InboxState] = {}
        self.holds: dict[str, HoldState] = {}  # home shard: reservations for other shards' deliveries
        self.holds_of: dict[str, list[str]] = {}  # home shard: remote run -> its holds (retention)
        self.reserved: dict[str, ReservedState] = {}  # run shard: reservations its tasks hold
        self.on_change = None
        #: run shard: ready tasks a receive could not deliver for want of a reservation,
        #: with the server time a receive last asked for each (the leader's reserver
        #: asks the home shard, and forgets a task no receive asked for lately), and its
        #: wake-up
        self.wanted: dict[str, int] = {}
        self.on_want = None

    def entity_tables(self):
        return {"obx": (self.table, OutboxState), "obi": (self.inbox, InboxState), "adm": (self.holds, HoldState),
                "tsv": (self.reserved, ReservedState)}

    def statistics(self) -> dict:
        return {"outbox_pending": sum(len(o.items) for o in self.table.values()),
                "inbox_sources": len(self.inbox)}

    # ------------------------------------------------------------------ outbox
    def pending(self) -> dict[int, list[OutboxItem]]:
        """Destination shard -> its entries not yet acknowledged (oldest first)."""
        return {o.shard: list(o.items) for o in self.table.values() if o.items}

    def acked(self, shard: int) -> int:
        o = self.table.get(f"obx:{shard}")
        return 0 if o is None else o.acked

    def received(self, shard: int) -> int:
        """The highest outbox entry of ``shard`` this shard holds."""
        i = self.inbox.get(f"obi:{shard}")
        return 0 if i is None else i.received

    def _append(self, shard: int, item_fn) -> None:
        oid = f"obx:{shard}"
        o = self.table.get(oid)
        if o is None:
            o = self.table[oid] = OutboxState(id=oid, shard=shard)
        o.items = [*o.items, item_fn(o.next_seq)]
        o.next_seq += 1
        self.coord.touch(oid)
        if self.on_change is not None and not self.coord.replaying:
            self.on_change()

    def note_end(self, s, reason: str, at_ms: int) -> None:
        """Inside the apply that ends the linked run ``s`` (a ``ScopeState``): one entry
        for each home shard it is linked to."""
        for shard in s.links:
            self._append(shard, lambda seq: OutboxItem(seq=seq, run_id=s.id, space=s.space, reason=reason,
                                                       at_ms=at_ms))

    @applies(OutboxAcked)
    def _apply_acked(self, r: OutboxAcked) -> None:
        o = self.table.get(f"obx:{r.shard}")
        if o is None or r.seq <= o.acked:
            return
        o.acked = r.seq
        o.items = [x for x in o.items if x.seq > r.seq]
        self.coord.touch(o.id)

    @op(OutboxAck, route=SPACE, permission=LOCAL, resend=ALWAYS, shard=PEER,
        reply=OutboxDeliverView)
    def op_outbox_ack(self, actor, session, op: OutboxAck):
        """Shard ``op.shard`` holds this shard's entries up to ``op.seq`` (the answer of
        a delivery): an ``OutboxAcked`` unless it changes nothing. FORBIDDEN unless
        local."""
        _require_local(session, "outbox.ack")
        o = self.table.get(f"obx:{op.shard}")
        if o is not None and o.acked < op.seq < o.next_seq:
            self.coord.commit([OutboxAcked(shard=op.shard, seq=op.seq)])
        return OutboxDeliverView(source=op.shard, received=self.acked(op.shard))

    # ------------------------------------------------------------------ inbox
    @op(OutboxDeliver, route=SPACE, permission=NODE, resend=ALWAYS, shard=PEER)
    def op_outbox_deliver(self, actor, session, op: OutboxDeliver) -> OutboxDeliverView:
        """Apply the entries of ``op.source``'s outbox this shard does not hold yet (one
        ``RemoteRunEnded`` each, in ``seq`` order) and answer the highest held.
        FORBIDDEN without the node secret; VALIDATION_FAILED for a malformed entry."""
        _require_node(session, "outbox.deliver")
        held = self.received(op.source)
        recs = []
        for it in op.items:
            if it.seq <= held:
                continue  # delivered before: applied once
            if it.reason in ("delivered", "delivery_ended") and isinstance(it.task_id, str):
                recs.append(RemoteDeliveryNoted(shard=op.source, seq=it.seq, task_id=it.task_id, token=it.token,
                                                what="delivered" if it.reason == "delivered" else "ended",
                                                at_ms=it.at_ms, outcome=it.outcome))
            elif is_id(it.run_id, "scp") and it.reason in _RUN_END_REASONS:
                recs.append(RemoteRunEnded(run_id=it.run_id, space=it.space, shard=op.source, seq=it.seq,
                                           reason=it.reason, at_ms=it.at_ms))
            else:
                raise ValidationError(f"outbox entry {it.seq} of shard {op.source} is malformed "
                                      f"(run {short(it.run_id)}, reason {it.reason!r})")
            held = it.seq
        if recs:
            self.coord.commit(recs)
        return OutboxDeliverView(source=op.source, received=held)

    def _received(self, shard: int, seq: int) -> None:
        iid = f"obi:{shard}"
        i = self.inbox.get(iid)
        if i is None:
            i = self.inbox[iid] = InboxState(id=iid, shard=shard)
        if seq > i.received:
            i.received = seq
            self.coord.touch(iid)

    @applies(RemoteRunEnded)
    def _apply_remote_ended(self, r: RemoteRunEnded) -> None:
        self._received(r.shard, r.seq)
        self.coord.runs.end_remote(r.run_id, r.space, r.shard, r.reason, r.at_ms)

    # ------------------------------------------------------------------ admission: the home shard
    @op(AdmissionReserve, route=by_run(), permission=NODE, resend=ALWAYS, shard=PEER,
        reply=AdmissionReserveView)
    def op_admission_reserve(self, actor, session, op: AdmissionReserve):
        """Reserve what delivery ``op.token`` of task ``op.task_id`` needs (see
        ``protocol.AdmissionReserve``), on the run's (remote) actor: one commit of the
        grants (``PoolGranted`` with the task's id), the budget reservations
        (``BudgetReserved`` with its id and token) and ``AdmissionHeld``; or WAITING.
        FORBIDDEN without the node secret; NOT_FOUND (pool, budget), VALIDATION_FAILED
        (units, amounts: as at a submission on one node), SCOPE_CANCELLED /
        DEADLINE_EXCEEDED (the run ended), STALE_CLAIM (a newer token holds)."""
        _require_node(session, "admission.reserve")
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
        if len(op.pools) > _MAX_POOLS or len(op.budgets) > _MAX_BUDGETS:
            raise ValidationError(f"requirements name at most {_MAX_POOLS} pools and {_MAX_BUDGETS} budgets")
        pools = coord.pools.requirement_prepare(space, op.pools) if op.pools else {}
        budgets = coord.budgets.requirement_prepare(space, op.budgets) if op.budgets else {}
        if not 100 <= op.lease_ms <= 600_000:
            raise ValidationError("lease_ms must be 100 to 600000", details={"field": "lease_ms"})
        pending: dict = {}
        fits = (not pools or coord.pools.requirement_fits(pools, pending, None)) and \
            (not budgets or coord.budgets.requirement_fits(budgets, pending, None))
        if not fits:
            return AdmissionReserveView(status="WAITING", task_id=op.task_id, token=op.token)
        now = coord.now_ms()
        recs: list = []
        if h is not None and h.ended is None:  # an older token's reservation, never delivered: it goes
            recs.append(AdmissionEnded(task_id=op.task_id, token=h.token, outcome="superseded", at_ms=now))
        new_id = coord.new_id
        grants = [PoolGranted(id=new_id("grt", space=space), pool_id=pid, space=space, scope_id=run.id, units=units,
                              token=new_token(), at_ms=now, holder=f"task {op.task_id}", task_id=op.task_id)
                  for pid, units in pools.items()]
        reservations = [BudgetReserved(id=new_id("rsv", space=space), budget_id=bid, space=space, scope_id=run.id,
                                       amount_minor=amount, at_ms=now, holder="admission", task_id=op.task_id,
                                       token=op.token)
                        for bid, amount in budgets.items()]
        recs += grants + reservations
        recs.append(AdmissionHeld(task_id=op.task_id, token=op.token, space=space, scope_id=run.id,
                                  shard=run.remote_shard if run.remote_shard is not None else -1,
                                  grants=[g.id for g in grants], reservations=[r.id for r in reservations],
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
        coord.pools.requirement_release(_Task(h.task_id, h.token), None, at_ms, new_state)
        coord.budgets.on_delivery_ended(h.task_id, h.token, new_state, at_ms)

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
        _require_local(session, "admission.hold")
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

    # ------------------------------------------------------------------ links
    def route_link(self, session, op) -> str:
        """``run.link`` runs on the run's actor (NOT_FOUND: no such run of the space
        here)."""
        s = self.coord.runs.table.get(op.scope_id) if isinstance(op.scope_id, str) else None
        if s is None or s.space != op.space or s.remote_shard is not None:
            raise NotFoundError(f"no run {short(op.scope_id)} in this space", details={"scope_id": short(op.scope_id)})
        return s.id

    @op(RunLink, route=by_op("route_link"), permission=NODE, resend=ALWAYS, shard=in_slot("scope_id"))
    def op_run_link(self, actor, session, op: RunLink) -> RunLinkView:
        """Link run ``op.scope_id`` to home shard ``op.shard`` (``RunLinked``, once).
        FORBIDDEN without the node secret; SCOPE_CANCELLED / DEADLINE_EXCEEDED when the
        run takes no new work (then nothing is linked)."""
        _require_node(session, "run.link")
        runs = self.coord.runs
        s = runs.table[op.scope_id]
        runs.require_active(s.id)
        if op.shard not in s.links:
            self.coord.commit([RunLinked(run_id=s.id, shard=op.shard, at_ms=self.coord.now_ms())])
        return RunLinkView(scope_id=s.id, shard=op.shard)

    @applies(RunLinked)
    def _apply_linked(self, r: RunLinked) -> None:
        s = self.coord.runs.table[r.run_id]
        if r.shard not in s.links:
            s.links = (*s.links, r.shard)
            self.coord.touch(s.id)

    @op(RemoteRunAdopt, route=SPACE, permission=LOCAL, resend=ALWAYS, shard=PEER,
        reply=RunLinkView)
    def op_run_adopt_remote(self, actor, session, op: RemoteRunAdopt):
        """Keep run ``op.scope_id`` (linked on its shard ``op.shard``) as a remote run
        here (``RemoteRunAdopted``), unless this shard has it already (or had its end
        delivered first). FORBIDDEN unless local; VALIDATION_FAILED for a run of a slot
        this shard owns."""
        _require_local(session, "run.adopt_remote")
        coord = self.coord
        sh = coord.sharding
        if not is_id(op.scope_id, "scp") or (sh is not None and sh.owned[slot_of(op.scope_id) % sh.slots]):
            raise ValidationError(f"run {short(op.scope_id)} is not a run of another shard")
        if op.scope_id not in coord.runs.table:
            coord.commit([RemoteRunAdopted(run_id=op.scope_id, space=op.space, shard=op.shard,
                                           at_ms=coord.now_ms())])
        return RunLinkView(scope_id=op.scope_id, shard=op.shard)

    @applies(RemoteRunAdopted)
    def _apply_adopted(self, r: RemoteRunAdopted) -> None:
        if r.run_id not in self.coord.runs.table:
            self.coord.runs.add_remote(r.run_id, r.space, r.shard, r.at_ms)
