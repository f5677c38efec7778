"""The coordinator: one class made of the actor kinds.

Each kind (runs, work queues, task groups, ...) is a mixin with its state Structs, its
``op_*`` handlers (decide), its ``@applies`` functions and its activities; the base
(:mod:`.system`) owns the tables, the commit pipeline, the timer heap and recovery.
"""

from .barrier import BarrierKind
from .group import GroupKind
from .joinset import JoinSetKind
from .keys import KeyKind
from .mailbox import MailboxKind
from .scope import ScopeKind
from .system import CoordinatorBase, MemoryJournal
from .timer import TimerKind


class Coordinator(KeyKind, JoinSetKind, TimerKind, BarrierKind, GroupKind, MailboxKind, ScopeKind, CoordinatorBase):
    """The whole coordinator (see :class:`.system.CoordinatorBase` for arguments)."""


__all__ = ["Coordinator", "MemoryJournal"]


def _op_server_status(self, session, op):
    from ..protocol import ServerStatusView
    from ..wire import PROTOCOL_VERSION

    st = self.server_status()
    runs = {"ACTIVE": 0, "CANCELLED": 0, "COMPLETED": 0}
    runs.update(self.run_counts.get(session.space, {}))
    tasks = {k: v for k, v in self.space_task_counts.get(session.space, {}).items() if v}
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
    )


Coordinator.op_server_status = _op_server_status
