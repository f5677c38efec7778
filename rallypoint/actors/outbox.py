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

Inter-shard calls (``run.link``, ``outbox.deliver``) are accepted only from a session
authenticated with the cluster's node secret (``Session.node``); the in-process steps
(``run.adopt_remote``, ``outbox.ack``) only from the node itself (``Session.local``).
"""

from __future__ import annotations

import msgspec

from ..errors import ForbiddenError, NotFoundError, ValidationError
from ..ids import is_id, slot_of
from ..protocol import (
    BudgetReserve,
    ClaimAcquire,
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
from ..records import OutboxAcked, RemoteRunAdopted, RemoteRunEnded, RunLinked
from .common import applies, short
from .kind import Kind
from .opmark import ALL, ALWAYS, SPACE, by_op, in_slot, op

__all__ = ["Outbox", "OutboxState", "InboxState", "REMOTE_RUN_OPS", "NODE_OPS"]

#: The ops a run of another shard may send to its space's home shard (their
#: ``scope_id`` names the run): the home shard links the run first when it does not
#: know it (``Service.submit``).
REMOTE_RUN_OPS = (ClaimAcquire, PoolAcquire, QuotaTake, BudgetReserve)
#: The only ops a node session (the cluster's node secret) may make.
NODE_OPS = (RunLink, OutboxDeliver)



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
        self.on_change = None

    def entity_tables(self):
        return {"obx": (self.table, OutboxState), "obi": (self.inbox, InboxState)}

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

    def note_end(self, s, reason: str, at_ms: int) -> None:
        """Inside the apply that ends the linked run ``s`` (a ``ScopeState``): one entry
        for each home shard it is linked to."""
        for shard in s.links:
            oid = f"obx:{shard}"
            o = self.table.get(oid)
            if o is None:
                o = self.table[oid] = OutboxState(id=oid, shard=shard)
            o.items = [*o.items, OutboxItem(seq=o.next_seq, run_id=s.id, space=s.space, reason=reason, at_ms=at_ms)]
            o.next_seq += 1
            self.coord.touch(oid)
        if self.on_change is not None and not self.coord.replaying:
            self.on_change()

    @applies(OutboxAcked)
    def _apply_acked(self, r: OutboxAcked) -> None:
        o = self.table.get(f"obx:{r.shard}")
        if o is None or r.seq <= o.acked:
            return
        o.acked = r.seq
        o.items = [x for x in o.items if x.seq > r.seq]
        self.coord.touch(o.id)

    @op(OutboxAck, route=SPACE, permission="operator", resend=ALWAYS, shard=ALL,
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
    @op(OutboxDeliver, route=SPACE, permission="operator", resend=ALWAYS, shard=ALL)
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
            if not is_id(it.run_id, "scp") or it.reason not in ("cancelled", "completed", "deadline"):
                raise ValidationError(f"outbox entry {it.seq} of shard {op.source} is malformed "
                                      f"(run {short(it.run_id)}, reason {it.reason!r})")
            recs.append(RemoteRunEnded(run_id=it.run_id, space=it.space, shard=op.source, seq=it.seq,
                                       reason=it.reason, at_ms=it.at_ms))
            held = it.seq
        if recs:
            self.coord.commit(recs)
        return OutboxDeliverView(source=op.source, received=held)

    @applies(RemoteRunEnded)
    def _apply_remote_ended(self, r: RemoteRunEnded) -> None:
        iid = f"obi:{r.shard}"
        i = self.inbox.get(iid)
        if i is None:
            i = self.inbox[iid] = InboxState(id=iid, shard=r.shard)
        if r.seq > i.received:
            i.received = r.seq
            self.coord.touch(iid)
        self.coord.runs.end_remote(r.run_id, r.space, r.shard, r.reason, r.at_ms)

    # ------------------------------------------------------------------ links
    def route_link(self, session, op) -> str:
        """``run.link`` runs on the run's actor (NOT_FOUND: no such run of the space
        here)."""
        s = self.coord.runs.table.get(op.scope_id) if isinstance(op.scope_id, str) else None
        if s is None or s.space != op.space or s.remote_shard is not None:
            raise NotFoundError(f"no run {short(op.scope_id)} in this space", details={"scope_id": short(op.scope_id)})
        return s.id

    @op(RunLink, route=by_op("route_link"), permission="operator", resend=ALWAYS, shard=in_slot("scope_id"))
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
            s.links = [*s.links, r.shard]
            self.coord.touch(s.id)

    @op(RemoteRunAdopt, route=SPACE, permission="operator", resend=ALWAYS, shard=ALL,
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
