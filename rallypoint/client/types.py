"""What the SDK returns: typed, read-only views decoded straight from reply frames.

They mirror the server's views in :mod:`rallypoint.protocol`, with instants as aware
``datetime`` (UTC) and payloads (input, outcome, error) as the Python values the sender
encoded. Each supports attribute access and ``info["field"]``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec

__all__ = [
    "RunStatus",
    "MailboxInfo",
    "TaskInfo",
    "DeliveryInfo",
    "GroupStatus",
    "GroupMember",
    "GroupDecision",
    "VerdictResult",
    "ServerInfo",
    "Event",
    "EventPage",
    "Overview",
]


class _Info(msgspec.Struct, frozen=True, kw_only=True):
    def __getitem__(self, name: str) -> Any:
        try:
            return getattr(self, name)
        except AttributeError:
            raise KeyError(name) from None

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


class RunStatus(_Info):
    """A run: ``stored_state`` (ACTIVE/CANCELLED/COMPLETED, its own) and ``effective``
    (ACTIVE/INACTIVE, including ancestors and deadlines)."""

    id: str
    name: str | None
    parent_id: str | None
    stored_state: str
    effective: str
    inactive_reason: str | None
    deadline: datetime | None
    created_at: datetime
    ended_at: datetime | None
    child_limit: int
    children: int
    tasks: dict[str, int]
    group_id: str | None = None
    #: a task's own run (``delivery.run()``): that task; the run ends with it
    task_id: str | None = None


class MailboxInfo(_Info):
    id: str
    name: str
    mode: str
    max_attempts: int
    backlog_limit: int | None
    created_at: datetime
    queued: int
    running: int


class TaskInfo(_Info):
    """A task's state; ``outcome`` is the completing worker's value, ``error`` the last
    retry/reject error payload."""

    id: str
    mailbox: str
    scope_id: str
    state: str
    attempt: int
    key: str | None
    input: Any
    outcome: Any
    outcome_reason: str | None
    error: Any
    created_at: datetime
    finished_at: datetime | None
    deadline: datetime | None
    group_id: str | None = None
    #: the task's own run (made by its worker with ``delivery.run()``), or None
    run_id: str | None = None
    #: its worker completed it and its run's join sets are closing: the task is
    #: SUCCEEDED (with that outcome) once the last awaited child finished
    completing: bool = False

    @property
    def finished(self) -> bool:
        return self.state in ("SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED")


class DeliveryInfo(_Info):
    id: str
    task_id: str
    mailbox: str
    scope_id: str
    input: Any
    attempt: int
    token: int
    lease_expires_at: datetime
    group_id: str | None = None
    run_id: str | None = None


class _ReceiveReply(msgspec.Struct):
    deliveries: list[DeliveryInfo]


class _LeaseReply(msgspec.Struct):
    task_id: str
    token: int
    lease_expires_at: datetime


class GroupMember(_Info):
    task_id: str
    task_state: str
    verdict: str | None
    late: bool
    key: str | None


class GroupStatus(_Info):
    """A task group: ``scope_id`` is its gate run (workers receive from it)."""

    id: str
    scope_id: str
    parent_scope_id: str
    mailbox: str
    condition: str
    threshold: int | None
    expected_members: int | None
    deadline: datetime | None
    state: str
    outcome: str | None
    outcome_reason: str | None
    created_at: datetime
    finalized_at: datetime | None
    counts: dict[str, int]
    members: list[GroupMember]


class GroupDecision(_Info):
    state: str
    outcome: str | None
    outcome_reason: str | None


class VerdictResult(_Info):
    task_id: str
    verdict: str
    late: bool
    group_state: str
    outcome: str | None
    outcome_reason: str | None


class _MemberAdded(msgspec.Struct):
    task: TaskInfo
    group_state: str


class ServerInfo(_Info):
    version: str
    protocol_version: int
    uptime_s: float
    connections: int
    durability: str
    runs: dict[str, int]
    tasks: dict[str, int]
    entities: int
    last_lsn: int
    durable_lsn: int
    #: per kind (runs, queues, groups, barriers, timers, joinsets, ...): actors ``active``
    #: (holding a task) and ``passive``, ``inbox`` depth and parked ``waiters``
    actors: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)
    #: depth of the nursery tree of active actors (0: none active)
    tree_depth: int = 0


class _RunList(msgspec.Struct):
    scopes: list[RunStatus]


class _MailboxList(msgspec.Struct):
    mailboxes: list[MailboxInfo]


class _TaskList(msgspec.Struct):
    tasks: list[TaskInfo]


class BarrierStatus(_Info):
    """A barrier: WAITING, RELEASED or CANCELLED; ``arrivals`` of ``target`` in ``epoch``."""

    id: str
    scope_id: str
    state: str
    target: int
    arrivals: int
    keys: list[str]
    epoch: int
    created_at: datetime
    released_at: datetime | None


class TimerStatus(_Info):
    """A timer: ARMED, FIRED, ACKED or CANCELLED."""

    id: str
    scope_id: str
    state: str
    fire_at: datetime
    fired_at: datetime | None
    acked_at: datetime | None
    created_at: datetime


class JoinSetChild(_Info):
    child_id: str
    kind: str
    cancellable: bool
    finished: bool


class JoinSetStatus(_Info):
    """A join set: OPEN, CLOSING or CLOSED; counts of children submitted, finished
    (completion records) and consumed."""

    id: str
    scope_id: str
    name: str | None
    state: str
    submitted: int
    finished: int
    consumed: int
    created_at: datetime
    children: list[JoinSetChild]
    steps: int = 0  # answers of join_next / join_next_try journaled so far


class _ChildAdded(msgspec.Struct):
    child_id: str
    kind: str
    fire_at: datetime | None = None


class _JoinNextReply(msgspec.Struct):
    status: str
    index: int
    child_id: str | None = None
    kind: str | None = None
    ok: bool = True
    value: Any = None
    failure_kind: str | None = None
    closing: bool = False
    step: int | None = None
    replayed: bool = False


class Event(_Info):
    """One event (see docs/events.md): ``seq`` is the space-wide sequence number -- the
    cursor to resume after it --, ``type`` e.g. ``task.completed``, ``kind``/``id`` the
    entity it is about (the *aggregate*), ``run`` the run it happened in, ``at`` the
    instant of the change, ``data`` a small payload."""

    seq: int
    type: str
    kind: str
    id: str
    at: datetime
    run: str | None = None
    data: dict[str, Any] | None = None

    @property
    def cursor(self) -> int:
        return self.seq

    @property
    def aggregate(self) -> str:
        return f"{self.kind}:{self.id}"


class EventPage(_Info):
    """A page of ``events.list``: ``next_cursor`` continues after every event examined;
    ``oldest``/``newest``: the seqs the server keeps."""

    events: list[Event]
    next_cursor: int
    oldest: int
    newest: int


class WatchStart(_Info):
    cursor: int
    oldest: int
    newest: int


class OverviewRun(_Info):
    id: str
    name: str | None
    parent_id: str | None
    created_at: datetime
    tasks: dict[str, int]
    children: int


class OverviewQueue(_Info):
    name: str
    queued: int
    running: int
    done: int


class OverviewGroup(_Info):
    id: str
    condition: str
    state: str
    members: int
    accepted: int
    created_at: datetime


class Overview(_Info):
    """``rs.overview()``: what ``rallypoint top`` shows (read-only, for humans)."""

    runs: list[OverviewRun]
    runs_active: int
    queues: list[OverviewQueue]
    groups: list[OverviewGroup]
    groups_open: int
    waits: dict[str, dict[str, int]]
    events: dict[str, int]
    entities: int
    tasks: dict[str, int]
    retention: dict[str, Any]
