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
    "TaskOutcome",
    "DeliveryInfo",
    "GroupStatus",
    "GroupMember",
    "GroupDecision",
    "VerdictResult",
    "ServerInfo",
    "Event",
    "EventPage",
    "Overview",
    "MessageInfo",
    "QuotaInfo",
    "QuotaTakeInfo",
    "BudgetInfo",
    "ReservationInfo",
    "SettleResult",
    "ClaimInfo",
    "PoolInfo",
    "GrantInfo",
    "WorkLimitInfo",
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
    """A mailbox. ``requirements``: its default requirements by name, as given to
    ``mailboxes.ensure`` (``{"pools": {"gpu": 1}, "budgets": {"spend": 40}}``, empty
    kinds left out), None when it has none."""

    id: str
    name: str
    mode: str
    max_attempts: int
    backlog_limit: int | None
    created_at: datetime
    queued: int
    running: int
    requirements: dict[str, dict[str, int]] | None = None


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
        return self.state in ("SUCCEEDED", "ACKED", "FAILED", "CANCELLED", "EXPIRED")


class TaskOutcome(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """What ``rs.results(..., details=False)`` returns per task: its id, state, attempt,
    ``outcome`` (the completing worker's value; None unless SUCCEEDED), outcome reason
    and last retry/reject ``error`` -- without the input echoed back or the instants."""

    id: str
    state: str
    attempt: int
    outcome: Any
    outcome_reason: str | None
    error: Any

    @property
    def finished(self) -> bool:
        return self.state in ("SUCCEEDED", "ACKED", "FAILED", "CANCELLED", "EXPIRED")


class GrantInfo(_Info):
    """A pool grant: ``units`` of pool ``pool``, ACTIVE, RELEASED or EXPIRED.
    ``lease_expires_at`` is None for a grant held by a task's delivery (``task_id``);
    ``token`` is only in the replies that hand the grant out (else 0)."""

    id: str
    pool: str
    pool_id: str
    scope_id: str
    units: int
    state: str
    token: int
    lease_expires_at: datetime | None
    holder: str | None
    task_id: str | None
    created_at: datetime
    ended_at: datetime | None
    end_reason: str | None


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
    grants: list[GrantInfo] = msgspec.field(default_factory=list)
    reservations: list[str] = msgspec.field(default_factory=list)


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
    #: where the journal's fdatasync runs: "process <pid>" (the sync helper process),
    #: "thread", or "" (memory durability: no fsync)
    sync_helper: str = ""
    #: fdatasync calls of the journal since start, and their total duration (seconds)
    fsyncs: int = 0
    fsync_seconds: float = 0.0


class _RunList(msgspec.Struct):
    scopes: list[RunStatus]


class _MailboxList(msgspec.Struct):
    mailboxes: list[MailboxInfo]


class _ItemError(msgspec.Struct):
    code: str
    message: str
    retry_after: float | None = None
    details: dict | None = None


class _Settled(msgspec.Struct):
    task: "TaskInfo | None" = None
    error: _ItemError | None = None


class _SettledList(msgspec.Struct):
    items: list[_Settled]


class _TaskIds(msgspec.Struct):
    ids: list[str] = msgspec.field(default_factory=list)


class _TaskList(msgspec.Struct):
    tasks: list[TaskInfo] = msgspec.field(default_factory=list)


class _TaskOutcomes(msgspec.Struct):
    outcomes: list[TaskOutcome] = msgspec.field(default_factory=list)


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


class MessageInfo(_Info):
    """A message of an INBOX mailbox: ``state`` QUEUED, RUNNING (leased), ACKED
    (completed), FAILED, CANCELLED or EXPIRED; ``result`` is what its receiver completed
    it with."""

    id: str
    mailbox: str
    scope_id: str
    state: str
    attempt: int
    key: str | None
    payload: Any
    result: Any
    error: Any
    outcome_reason: str | None
    created_at: datetime
    finished_at: datetime | None
    deadline: datetime | None

    @property
    def finished(self) -> bool:
        return self.state in ("ACKED", "FAILED", "CANCELLED", "EXPIRED")


class QuotaTakeInfo(_Info):
    """A quota take: ``state`` GRANTED (``consumption_id``: the units are taken, once),
    WAITING (a durable waiter, ``waiter_id``), EXPIRED or CANCELLED (``end_reason``).
    ``remaining``: units left in the current window now; ``window_start`` /
    ``window_end``: the window the grant counted in."""

    quota_id: str
    quota: str
    scope_id: str
    state: str
    units: int
    consumption_id: str | None
    waiter_id: str | None
    window_start: datetime | None
    window_end: datetime | None
    remaining: int
    expires_at: datetime | None
    created_at: datetime
    ended_at: datetime | None
    end_reason: str | None
    holder: str | None

    @property
    def granted(self) -> bool:
        return self.state == "GRANTED"


class QuotaInfo(_Info):
    """A quota now: ``used`` / ``remaining`` of ``units_limit`` in the current window
    [``window_start``, ``window_end``), ``waiting`` waiters, a running cooldown."""

    id: str
    name: str
    units_limit: int
    window_ms: int
    window_start: datetime
    window_end: datetime
    used: int
    remaining: int
    waiting: int
    cooldown_until: datetime | None
    cooldown_reason: str | None
    consumed_total: int
    created_at: datetime
    waiters: list[QuotaTakeInfo] = msgspec.field(default_factory=list)

    @property
    def window_seconds(self) -> float:
        return self.window_ms / 1000


class _QuotaList(msgspec.Struct):
    quotas: list[QuotaInfo]


class ReservationInfo(_Info):
    """A budget reservation (amounts in integer minor units): ``state`` ACTIVE, STALE
    (past settle-by, still holding), SETTLED or VOIDED."""

    id: str
    budget_id: str
    budget: str
    scope_id: str
    state: str
    amount_minor: int
    remaining_minor: int
    settled_minor: int
    overrun_minor: int
    currency: str
    scale: int
    settle_by: datetime | None
    created_at: datetime
    closed_at: datetime | None
    close_reason: str | None
    holder: str | None
    key: str | None
    task_id: str | None


class BudgetInfo(_Info):
    """A budget (amounts in integer minor units at ``scale``):
    ``available_minor`` = ``limit_minor`` - ``settled_minor`` - ``reserved_minor``."""

    id: str
    name: str
    currency: str
    scale: int
    limit_minor: int
    settled_minor: int
    reserved_minor: int
    available_minor: int
    overrun_minor: int
    open_reservations: int
    created_at: datetime
    reservations: list[ReservationInfo] = msgspec.field(default_factory=list)


class _BudgetList(msgspec.Struct):
    budgets: list[BudgetInfo]


class SettleResult(_Info):
    """One settlement: ``charged_minor`` of ``requested_minor`` (capped at what was
    left), the budget's ``available_minor`` after it; ``replayed``: this usage key had
    been settled before and nothing changed."""

    reservation: ReservationInfo
    usage_key: str
    requested_minor: int
    charged_minor: int
    available_minor: int
    replayed: bool
class ClaimWaiterInfo(_Info):
    scope_id: str
    holder: str | None
    queued_at: datetime
    expires_at: datetime


class ClaimInfo(_Info):
    """A claim: HELD, FREE or COMPLETED. ``generation`` counts its leases (the fencing
    number); ``observation`` is what the last release left, ``result`` what complete
    recorded; ``waiters`` the FIFO queue (first 100)."""

    id: str
    key: str
    scope_id: str
    state: str
    generation: int
    holder: str | None
    lease_expires_at: datetime | None
    acquired_at: datetime | None
    observation: Any
    result: Any
    completed_at: datetime | None
    created_at: datetime
    waiters: list[ClaimWaiterInfo]


class _ClaimLeaseReply(msgspec.Struct):
    status: str
    claim: ClaimInfo
    token: int = 0
    request_id: str | None = None
    position: int = 0


class _ClaimList(msgspec.Struct):
    claims: list[ClaimInfo]


class PoolWaiterInfo(_Info):
    scope_id: str
    units: int
    holder: str | None
    queued_at: datetime
    expires_at: datetime


class PoolInfo(_Info):
    """A pool: ``units_used`` of ``units_total`` granted; ``waiters`` in FIFO order and
    active ``grants`` (first 100 of each)."""

    id: str
    name: str
    units_total: int
    units_used: int
    units_free: int
    created_at: datetime
    waiting: int
    active_grants: int
    waiters: list[PoolWaiterInfo]
    grants: list[GrantInfo]


class _PoolList(msgspec.Struct):
    pools: list[PoolInfo]


class _PoolAcquireReply(msgspec.Struct):
    status: str
    grant: GrantInfo | None = None
    request_id: str | None = None
    position: int = 0


class _CancelWaitReply(msgspec.Struct):
    outcome: str


class WorkLimitInfo(_Info):
    """A work limit: at most ``max_outstanding`` unfinished tasks name it;
    ``outstanding`` now."""

    id: str
    scope_id: str
    name: str
    max_outstanding: int
    outstanding: int
    created_at: datetime


class _WorkLimitList(msgspec.Struct):
    work_limits: list[WorkLimitInfo]
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
