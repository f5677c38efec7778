"""Remote runs: a run of another shard known on its space's home shard (a part of the
:class:`~rallypoint.actors.outbox.Outbox` kind; the whole design: its module docstring).

Claims, pools, quotas and budgets live on their space's *home shard*. A run of another
shard that uses one is known there as a **remote run**: a run-table entry with the
run's id, space and shard (``ScopeState.remote_shard``), no tree, no deadline of its
own. It owns its claims, grants, waiters and reservations there exactly as a local run
does, and its actor parks its waiting acquires, so everything the single node does at a
run's end works unchanged -- once the home shard learns of the end (an outbox entry:
:mod:`rallypoint.actors.outbox`).

Here: :data:`REMOTE_RUN_OPS` (the ops that make the home shard link a run first) and
``run.adopt_remote`` (the home shard keeps the run, ``RemoteRunAdopted``), the node's
own step once the run's shard has linked it (:mod:`rallypoint.actors.run_links`).
"""

from __future__ import annotations

from ..errors import ValidationError
from ..ids import is_id, slot_of
from ..protocol import AdmissionReserve, BudgetReserve, ClaimAcquire, PoolAcquire, QuotaTake, RemoteRunAdopt, RunLinkView
from ..records import RemoteRunAdopted
from .common import applies, require_local, short
from .opmark import ALWAYS, LOCAL, PEER, SPACE, op

__all__ = ["Adoptions", "REMOTE_RUN_OPS"]

#: The ops a run of another shard may send to its space's home shard (their
#: ``scope_id`` names the run): the home shard links the run first when it does not
#: know it (``Service.submit``).
REMOTE_RUN_OPS = (ClaimAcquire, PoolAcquire, QuotaTake, BudgetReserve, AdmissionReserve)


class Adoptions:
    """The home shard's remote runs: ``run.adopt_remote`` and its record (a part of
    :class:`~rallypoint.actors.outbox.Outbox`; the run table is the runs kind's)."""

    @op(RemoteRunAdopt, route=SPACE, permission=LOCAL, resend=ALWAYS, shard=PEER,
        reply=RunLinkView)
    def op_run_adopt_remote(self, actor, session, op: RemoteRunAdopt):
        """Keep run ``op.scope_id`` (linked on its shard ``op.shard``) as a remote run
        here (``RemoteRunAdopted``), unless this shard has it already (or had its end
        delivered first). FORBIDDEN unless local; VALIDATION_FAILED for a run of a slot
        this shard owns."""
        require_local(session, "run.adopt_remote")
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
