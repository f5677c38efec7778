"""Spaces: the actor of each space, for what has no run or entity to run on.

A space (a tenant, SPEC §1) has one actor, ``spc:<space>``, in the root nursery. It
runs the commands that create or list space-level things: root runs, work queues (names
are per space), API keys, and the server status. It owns no state of its own: what it
creates belongs to the runs, work-queue and keys kinds.
"""

from __future__ import annotations

from ..protocol import ServerStatus, ServerStatusView
from ..wire import PROTOCOL_VERSION
from .kind import Kind

__all__ = ["Spaces", "space_actor_id"]


def space_actor_id(space: str) -> str:
    """The actor id of a space."""
    return "spc:" + space


class Spaces(Kind):
    """The per-space actors (no entities; ``prefix`` is empty so they are not counted
    as an entity kind)."""

    prefix = ""
    name = "spaces"

    def route(self, session, _op=None) -> str:
        return "spc:" + session.space

    def op_server_status(self, actor, session, op: ServerStatus) -> ServerStatusView:
        """The server's version, uptime, connections, durability, counts of the session's
        space, journal LSNs, and the actor runtime (actors by kind, tree depth)."""
        coord = self.coord
        st = coord.server_status()
        runs = {"ACTIVE": 0, "CANCELLED": 0, "COMPLETED": 0}
        runs.update(coord.runs.counts.get(session.space, {}))
        tasks = {k: v for k, v in coord.queues.space_counts.get(session.space, {}).items() if v}
        return ServerStatusView(
            version=st["version"],
            protocol_version=PROTOCOL_VERSION,
            uptime_s=st["uptime_s"],
            connections=st["connections"],
            durability=st["durability"],
            runs=runs,
            tasks=tasks,
            entities=st["entities"],
            last_lsn=st["last_lsn"],
            durable_lsn=st["durable_lsn"],
            actors=st["actors"],
            tree_depth=st["tree_depth"],
        )
