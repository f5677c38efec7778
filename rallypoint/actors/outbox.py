"""The outbox: what crosses the shards of a sharded cluster when a run uses its space's
home shard (design: ``../shared/SCALE-OUT.md`` §4.2; the decisions:
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

The kind is one :class:`Outbox` made of parts, one module per concept: remote runs
(:mod:`.remote_runs`), links (:mod:`.run_links`), the outbox and the receiver's
state (here) and admission holds (:mod:`.admission_holds`).

Inter-shard calls (``run.link``, ``outbox.deliver``, ``admission.reserve``) are accepted
only from a session authenticated with the cluster's node secret (``Session.node``); the
in-process steps (``run.adopt_remote``, ``outbox.ack``, ``admission.hold``) only from
the node itself (``Session.local``).
"""

from __future__ import annotations

import msgspec

from ..errors import ValidationError
from ..ids import is_id
from ..protocol import OutboxAck, OutboxDeliver, OutboxDeliverView, OutboxItem
from ..records import OutboxAcked, RemoteDeliveryNoted, RemoteRunEnded
from .admission_holds import AdmissionHolds, HoldState, ReservedState
from .common import applies, require_local, require_node, short
from .kind import Kind
from .opmark import ALWAYS, LOCAL, NODE, PEER, SPACE, op
from .remote_runs import REMOTE_RUN_OPS, Adoptions
from .run_links import RunLinks

__all__ = ["Outbox", "OutboxState", "InboxState", "REMOTE_RUN_OPS"]

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


class InboxState(msgspec.Struct, gc=False, omit_defaults=True):
    """What this shard holds of shard ``shard``'s outbox (entity ``obi:<shard>``):
    every entry up to ``received``."""

    id: str
    shard: int
    received: int = 0


class Outbox(Adoptions, RunLinks, AdmissionHolds, Kind):
    """Remote runs, links, the outbox and admission holds (see the module docstring).
    Four tables: outboxes (``obx:<shard>``), what this shard received of each other
    shard's outbox (``obi:<shard>``), holds (``adm:``) and reservations (``tsv:``);
    ``on_change`` (set by the leader's sender) is called when an outbox gets an entry."""

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
        require_local(session, "outbox.ack")
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
        require_node(session, "outbox.deliver")
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
