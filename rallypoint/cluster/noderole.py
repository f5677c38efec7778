"""The role of a node of a replicated shard, as a sans-I/O state machine (issue 43).

::

    STARTING ──▶ STANDBY ◀──────────────▶ LEADER ──▶ STOPPING ──▶ STOPPED
        │           │   campaign won /       │                       ▲
        │           │   deposed, rebuilt     │                       │
        └───────────┴────────────────────────┴───────────────────────┘
                         stopped (SIGTERM as a standby, a fatal error)

- **STARTING**: admitted to the shard's replica set, recovering its data dir.
- **STANDBY**: follows whoever leads (frames in, acknowledgements out); its client port
  answers NOT_LEADER naming the leader, its HTTP port forwards.
- **LEADER**: won the campaign, journaled its epoch, serves clients, ships frames.
- **STOPPING**: a leader's graceful stop: it drains, lets the in-sync standby hold every
  record, resigns (:class:`rallypoint.cluster.member.ShardMember`).
- **STOPPED**: the node's run ended (terminal).

A leader deposed (lease lost, fence refused) stands by again (LEADER -> STANDBY); a
standby rebuilt from the leader's data stays STANDBY. What a move does (listeners,
etcd) stays in :class:`~rallypoint.cluster.member.ShardMember`; this module only says
which moves exist, and :class:`RoleMachine` holds the current role with the instant
it began leading.
"""

from __future__ import annotations

import enum

from ..fsm import IllegalTransition, Transitions

__all__ = ["IllegalTransition", "NodeRole", "ROLE_MOVES", "RoleMachine"]


class NodeRole(enum.StrEnum):
    """A node's role in its shard (its value is what ``ROLE`` lines, logs, ``cluster
    status`` and ``server.status`` say)."""

    STARTING = "starting"
    STANDBY = "standby"
    LEADER = "leader"
    STOPPING = "stopping"
    STOPPED = "stopped"


R = NodeRole
ROLE_MOVES: Transitions[NodeRole] = Transitions("node role", NodeRole, {
    R.STARTING: {R.STANDBY, R.STOPPED},
    R.STANDBY: {R.LEADER, R.STOPPED},
    R.LEADER: {R.STANDBY, R.STOPPING, R.STOPPED},
    R.STOPPING: {R.STOPPED},
    R.STOPPED: set(),
})


class RoleMachine:
    """The current :class:`NodeRole` of one node, moved only along :data:`ROLE_MOVES`.

    ``move(role, now)`` returns True for a move, False for the same role again (no
    move), and raises :class:`~rallypoint.fsm.IllegalTransition` for a move the table
    does not list. ``now`` is the caller's clock, seconds (``trio.current_time()``):
    :attr:`led_since` is the instant the current leadership began (None unless
    LEADER). :attr:`changes` counts the moves."""

    __slots__ = ("role", "led_since", "changes")

    def __init__(self) -> None:
        self.role: NodeRole = NodeRole.STARTING
        self.led_since: float | None = None
        self.changes = 0

    def move(self, role: NodeRole | str, now: float) -> bool:
        role = NodeRole(role)
        if not ROLE_MOVES.check(self.role, role):
            return False
        self.role = role
        self.led_since = now if role is NodeRole.LEADER else None
        self.changes += 1
        return True

    def leading_for(self, now: float) -> float | None:
        """Seconds this node has led, or None when it is not the leader."""
        return None if self.led_since is None else now - self.led_since
