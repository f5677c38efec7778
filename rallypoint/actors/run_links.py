"""Links: a run's own shard records which home shards know it (a part of the
:class:`~rallypoint.actors.outbox.Outbox` kind; the whole design: its module docstring).

``run.link`` is asked by the home shard before the run's first request there
(``rallypoint.cluster.peers``): the run's shard checks the run takes work and journals
``RunLinked(run, home shard)`` once per (run, home shard). The run's ``links`` are what
its end tells: one outbox entry per linked shard (:meth:`Outbox.note_end`).
"""

from __future__ import annotations

from ..errors import NotFoundError
from ..protocol import RunLink, RunLinkView
from ..records import RunLinked
from .common import applies, require_node, short
from .opmark import ALWAYS, NODE, by_op, in_slot, op

__all__ = ["RunLinks"]


class RunLinks:
    """``run.link`` and ``RunLinked`` on the run's shard (a part of
    :class:`~rallypoint.actors.outbox.Outbox`; the links live on the run's ``ScopeState``)."""

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
        require_node(session, "run.link")
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

