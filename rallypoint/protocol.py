"""The wire contract: operation requests and their replies, as msgspec Structs.

A request body is one Struct of the :data:`Op` tagged union (tag field ``op``); its
reply body is the Struct named in :data:`REPLY_TYPES`. Decoding a body against
:data:`Op` validates it: an unknown ``op``, a missing field or a wrong type becomes
VALIDATION_FAILED with msgspec's path to the field (``$.lease_ms``).

Units on the wire: durations are integer milliseconds (``*_ms``), instants are ISO 8601
UTC strings, payloads (task input, outcome, error) are inline msgpack values
(:class:`msgspec.Raw`), at most 64 KiB each. The frame envelope is in
:mod:`rallypoint.wire`.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from .wire import *  # noqa: F401,F403  (the envelope is part of the contract)
from .wire import MAX_PAYLOAD_BYTES, PROTOCOL_VERSION  # noqa: F401

NIL = msgspec.Raw(b"\xc0")


class _Op(msgspec.Struct, tag_field="op", forbid_unknown_fields=True, omit_defaults=True):
    pass


class _View(msgspec.Struct, omit_defaults=False):
    pass


# --- system -------------------------------------------------------------------------


class ServerStatus(_Op, tag="server.status"):
    pass


class ServerStatusView(_View):
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
    #: per kind: actors ``active`` (with a task) and ``passive``, ``inbox`` depth, parked ``waiters``
    actors: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)
    #: depth of the nursery tree (0: no actor active)
    tree_depth: int = 0


# --- runs (scopes) --------------------------------------------------------------------


class ScopeCreate(_Op, tag="scope.create"):
    parent_id: str | None = None
    name: str | None = None
    deadline: str | None = None  # ISO 8601
    child_limit: int = 1000


class ScopeStatus(_Op, tag="scope.status"):
    scope_id: str


class ScopeCancel(_Op, tag="scope.cancel"):
    scope_id: str
    reason: str | None = None


class ScopeComplete(_Op, tag="scope.complete"):
    """Closes the run's open join sets first; waits up to ``wait_ms`` for their children."""

    scope_id: str
    wait_ms: int = 0


class ScopeList(_Op, tag="scope.list"):
    """Runs in creation (id) order: ``order="asc"`` oldest first, ``"desc"`` newest
    first; ``after``/``before`` (ids, exclusive) bound the page, with either order."""

    parent_id: str | None = None
    roots_only: bool = False
    state: str | None = None
    limit: int = 100
    after: str | None = None
    before: str | None = None
    order: str = "asc"


class ScopeView(_View):
    id: str
    name: str | None
    parent_id: str | None
    stored_state: str
    effective: str
    inactive_reason: str | None
    deadline: str | None
    created_at: str
    ended_at: str | None
    child_limit: int
    children: int
    tasks: dict[str, int]
    group_id: str | None = None
    task_id: str | None = None  # a task's own run: that task (it ends with the task)


class ScopeListView(_View):
    scopes: list[ScopeView]


# --- mailboxes ------------------------------------------------------------------------


class MailboxEnsure(_Op, tag="mailbox.ensure"):
    name: str
    mode: str = "WORK"
    max_attempts: int = 5
    backlog_limit: int | None = None


class MailboxGet(_Op, tag="mailbox.get"):
    name: str


class MailboxList(_Op, tag="mailbox.list"):
    pass


class MailboxView(_View):
    id: str
    name: str
    mode: str
    max_attempts: int
    backlog_limit: int | None
    created_at: str
    queued: int
    running: int


class MailboxListView(_View):
    mailboxes: list[MailboxView]


# --- tasks and deliveries -------------------------------------------------------------


class SubmitItem(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    input: msgspec.Raw = NIL
    key: str | None = None
    deadline: str | None = None


class TaskSubmit(_Op, tag="task.submit"):
    mailbox: str
    scope_id: str
    input: msgspec.Raw = NIL
    key: str | None = None
    deadline: str | None = None


class TaskSubmitMany(_Op, tag="task.submit_many"):
    """All-or-nothing: every item is validated first; one commit for all."""

    mailbox: str
    scope_id: str
    items: list[SubmitItem]


class TaskStatus(_Op, tag="task.status"):
    task_id: str


class TaskResult(_Op, tag="task.result"):
    """Waits on the server (at most 60 s per request) for a terminal state."""

    task_id: str
    wait_ms: int = 0


class TaskCancel(_Op, tag="task.cancel"):
    task_id: str


class TaskView(_View):
    id: str
    mailbox: str
    scope_id: str
    state: str
    attempt: int
    key: str | None
    input: msgspec.Raw
    outcome: msgspec.Raw
    outcome_reason: str | None
    error: msgspec.Raw
    created_at: str
    finished_at: str | None
    deadline: str | None
    group_id: str | None = None
    run_id: str | None = None  # the task's own run (``delivery.run``), once made
    completing: bool = False  # its worker completed it; its run's join sets are closing


class TaskListView(_View):
    tasks: list[TaskView]


class Receive(_Op, tag="delivery.receive"):
    mailbox: str
    scope_id: str
    lease_ms: int = 30_000
    wait_ms: int = 0
    max_messages: int = 1


class DeliveryView(_View):
    id: str
    task_id: str
    mailbox: str
    scope_id: str
    input: msgspec.Raw
    attempt: int
    token: int
    lease_expires_at: str
    group_id: str | None = None
    run_id: str | None = None  # the task's own run, if an earlier attempt made it


class ReceiveView(_View):
    deliveries: list[DeliveryView]


class DeliveryRenew(_Op, tag="delivery.renew"):
    task_id: str
    token: int
    lease_ms: int = 30_000


class LeaseView(_View):
    task_id: str
    token: int
    lease_expires_at: str


class DeliveryComplete(_Op, tag="delivery.complete"):
    task_id: str
    token: int
    outcome: msgspec.Raw = NIL


class DeliveryRetry(_Op, tag="delivery.retry"):
    task_id: str
    token: int
    error: msgspec.Raw = NIL
    delay_ms: int = 0


class DeliveryReject(_Op, tag="delivery.reject"):
    task_id: str
    token: int
    error: msgspec.Raw = NIL


class DeliveryRun(_Op, tag="delivery.run"):
    """The task's own run (a child of the task's run), made on first use; the same run
    for every later call and attempt. Reply: the run (ScopeView)."""

    task_id: str
    token: int


# --- task groups ----------------------------------------------------------------------


class GroupCreate(_Op, tag="group.create"):
    scope_id: str  # the run it was created from
    mailbox: str
    condition: str
    threshold: int | None = None
    expected_members: int | None = None
    deadline: str | None = None
    parent_scope_id: str | None = None


class GroupSubmit(_Op, tag="group.submit"):
    group_id: str
    input: msgspec.Raw = NIL
    key: str | None = None
    deadline: str | None = None


class GroupJoinTask(_Op, tag="group.join_task"):
    group_id: str
    task_id: str


class GroupVerdictOp(_Op, tag="group.verdict"):
    group_id: str
    task_id: str
    verdict: str  # "ACCEPTED" | "REJECTED"


class GroupClose(_Op, tag="group.close"):
    group_id: str


class GroupStatus(_Op, tag="group.status"):
    group_id: str


class GroupWait(_Op, tag="group.wait"):
    group_id: str
    wait_ms: int = 0


class GroupMemberView(_View):
    task_id: str
    task_state: str
    verdict: str | None
    late: bool
    key: str | None


class GroupView(_View):
    id: str
    scope_id: str  # the gate run
    parent_scope_id: str
    mailbox: str
    condition: str
    threshold: int | None
    expected_members: int | None
    deadline: str | None
    state: str
    outcome: str | None
    outcome_reason: str | None
    created_at: str
    finalized_at: str | None
    counts: dict[str, int]
    members: list[GroupMemberView]


class GroupDecisionView(_View):
    state: str
    outcome: str | None
    outcome_reason: str | None


class VerdictView(_View):
    task_id: str
    verdict: str
    late: bool
    group_state: str
    outcome: str | None
    outcome_reason: str | None


class GroupMemberAddedView(_View):
    task: TaskView
    group_state: str


# --- barriers -------------------------------------------------------------------------


class BarrierCreate(_Op, tag="barrier.create"):
    scope_id: str
    target: int


class BarrierArrive(_Op, tag="barrier.arrive"):
    barrier_id: str
    key: str


class BarrierStatus(_Op, tag="barrier.status"):
    barrier_id: str


class BarrierWait(_Op, tag="barrier.wait"):
    """Waits for RELEASED in ``epoch`` (default: the current one) or a later epoch."""

    barrier_id: str
    wait_ms: int = 0
    epoch: int | None = None


class BarrierNextEpochOp(_Op, tag="barrier.next_epoch"):
    barrier_id: str


class BarrierView(_View):
    id: str
    scope_id: str
    state: str
    target: int
    arrivals: int
    keys: list[str]
    epoch: int
    created_at: str
    released_at: str | None


# --- timers ---------------------------------------------------------------------------


class TimerCreate(_Op, tag="timer.create"):
    scope_id: str
    at: str | None = None
    after_ms: int | None = None


class TimerStatus(_Op, tag="timer.status"):
    timer_id: str


class TimerWait(_Op, tag="timer.wait"):
    """Waits for the timer to fire and acknowledges it in the same call."""

    timer_id: str
    wait_ms: int = 0


class TimerCancel(_Op, tag="timer.cancel"):
    timer_id: str


class TimerView(_View):
    id: str
    scope_id: str
    state: str
    fire_at: str
    fired_at: str | None
    acked_at: str | None
    created_at: str


# --- join sets ------------------------------------------------------------------------


class JoinSetCreate(_Op, tag="joinset.create"):
    scope_id: str
    name: str | None = None


class JoinSetGet(_Op, tag="joinset.get"):
    """By id, or by (scope_id, name)."""

    joinset_id: str | None = None
    scope_id: str | None = None
    name: str | None = None


class JoinSetSubmit(_Op, tag="joinset.submit"):
    joinset_id: str
    mailbox: str
    input: msgspec.Raw = NIL
    key: str | None = None
    cancellable: bool = True
    deadline: str | None = None


class JoinSetSubmitDelay(_Op, tag="joinset.submit_delay"):
    joinset_id: str
    after_ms: int | None = None
    at: str | None = None


class JoinNext(_Op, tag="joinset.join_next"):
    """``join_next`` (an *await*: waits up to ``wait_ms`` for the next record) or, with
    ``try_only``, ``join_next_try`` (a *probe*: answers at once).

    Every answer given -- a record consumed, a probe's ``pending``, JOIN_SET_EXHAUSTED,
    FUNCTION_MISMATCH, a record a close handed to a waiting await -- is the next *step*
    of the set's journaled log (``JoinNextView.step``); a wait that runs out is no step.

    - ``step``: a replaying client's position: ``step < steps`` answers what the log holds
      at that step (the same operation, else NONDETERMINISM_DETECTED), ``step == steps``
      is a live answer that must land there, ``step > steps`` is VALIDATION_FAILED.
    - ``index``: a record by position: ``index < consumed`` re-reads record ``index``
      (no step), ``index == consumed`` consumes it, more is VALIDATION_FAILED.
      ``index`` and ``step`` exclude each other.
    - ``mailbox`` (a name or id): a typed await/probe for a homogeneous set; a record
      of another mailbox or a delay is still consumed and answered FUNCTION_MISMATCH.
    """

    joinset_id: str
    index: int | None = None
    wait_ms: int = 0
    try_only: bool = False
    step: int | None = None
    mailbox: str | None = None


class JoinSetClose(_Op, tag="joinset.close"):
    joinset_id: str
    wait_ms: int = 0


class JoinSetChildView(_View):
    child_id: str
    kind: str  # task | delay
    cancellable: bool
    finished: bool


class JoinSetView(_View):
    id: str
    scope_id: str
    name: str | None
    state: str  # OPEN | CLOSING | CLOSED
    submitted: int
    finished: int
    consumed: int
    created_at: str
    children: list[JoinSetChildView]
    steps: int = 0  # answers journaled so far (the next live answer's step)


class JoinSetChildAdded(_View):
    child_id: str
    kind: str
    fire_at: str | None = None


class JoinNextView(_View):
    status: str  # "record" | "pending"
    index: int  # the record; for "pending" the next unconsumed one
    child_id: str | None = None
    kind: str | None = None
    ok: bool = True
    value: msgspec.Raw = NIL
    failure_kind: str | None = None
    closing: bool = False
    step: int | None = None  # the step this answer is (None: a re-read, or a wait that ran out)
    replayed: bool = False  # answered from the log (a step below ``steps``)


# --- access (admin) ---------------------------------------------------------------------


class KeyCreate(_Op, tag="key.create"):
    space: str
    permissions: list[str]
    name: str | None = None


class KeyList(_Op, tag="key.list"):
    space: str | None = None


class KeyRevoke(_Op, tag="key.revoke"):
    key_id: str


class KeyView(_View, omit_defaults=True):
    id: str
    space: str
    name: str | None
    permissions: list[str]
    created_at: str
    revoked_at: str | None
    secret: str | None = None  # only in the reply to key.create


class KeyListView(_View):
    keys: list[KeyView]


# --- events ---------------------------------------------------------------------------------


class EventView(_View, omit_defaults=True):
    """One event (see docs/events.md). ``seq`` is the space-wide sequence number (the
    cursor), ``kind``/``id`` the aggregate, ``run`` the run it happened in, ``at`` the
    instant of the change (ISO 8601), ``data`` a small payload."""

    seq: int
    type: str
    kind: str
    id: str
    at: str
    run: str | None = None
    data: dict[str, Any] | None = None


class EventsList(_Op, tag="events.list"):
    """A page of events after ``cursor`` (None: from the oldest kept), oldest first.
    ``types`` (names, or ``prefix.*``), ``scope_id`` (the run and its subtree) and
    ``aggregate`` (``kind:id`` or an id) filter it."""

    cursor: int | None = None
    limit: int = 100
    types: list[str] | None = None
    scope_id: str | None = None
    aggregate: str | None = None


class EventPageView(_View):
    """``events`` (encoded EventViews), ``next_cursor`` (pass it back for the next
    page: past every event examined, matching or not), ``oldest``/``newest``: the seqs
    kept."""

    events: list[msgspec.Raw]
    next_cursor: int
    oldest: int
    newest: int


class EventsWatch(_Op, tag="events.watch"):
    """Subscribe: the Ok (a WatchView) is followed by ``Push`` frames of events after
    ``cursor`` -- or, when ``cursor`` is None, from the oldest kept (``start="oldest"``)
    or from now (``start="now"``) -- as they happen, until Cancel. Filters as
    EventsList."""

    cursor: int | None = None
    start: str = "oldest"
    types: list[str] | None = None
    scope_id: str | None = None
    aggregate: str | None = None


class WatchView(_View):
    """Where a subscription starts: events with ``seq > cursor`` follow."""

    cursor: int
    oldest: int
    newest: int


class OpsOverview(_Op, tag="ops.overview"):
    """A read-only view for operators (``rallypoint top``): the newest active runs,
    the work queues, the open groups, parked waits by kind. Never a source of
    authority."""

    limit: int = 20


class OverviewRun(_View):
    id: str
    name: str | None
    parent_id: str | None
    created_at: str
    tasks: dict[str, int]
    children: int


class OverviewQueue(_View):
    name: str
    queued: int
    running: int
    done: int  # tasks finished since the server started (a rate is its difference)


class OverviewGroup(_View):
    id: str
    condition: str
    state: str
    members: int
    accepted: int
    created_at: str


class OverviewView(_View):
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


Op = Union[
    ServerStatus,
    ScopeCreate,
    ScopeStatus,
    ScopeCancel,
    ScopeComplete,
    ScopeList,
    MailboxEnsure,
    MailboxGet,
    MailboxList,
    TaskSubmit,
    TaskSubmitMany,
    TaskStatus,
    TaskResult,
    TaskCancel,
    Receive,
    DeliveryRenew,
    DeliveryComplete,
    DeliveryRetry,
    DeliveryReject,
    DeliveryRun,
    GroupCreate,
    GroupSubmit,
    GroupJoinTask,
    GroupVerdictOp,
    GroupClose,
    GroupStatus,
    GroupWait,
    BarrierCreate,
    BarrierArrive,
    BarrierStatus,
    BarrierWait,
    BarrierNextEpochOp,
    TimerCreate,
    TimerStatus,
    TimerWait,
    TimerCancel,
    JoinSetCreate,
    JoinSetGet,
    JoinSetSubmit,
    JoinSetSubmitDelay,
    JoinNext,
    JoinSetClose,
    KeyCreate,
    KeyList,
    KeyRevoke,
    EventsList,
    EventsWatch,
    OpsOverview,
]

ALL_OPS: tuple[type, ...] = Op.__args__  # type: ignore[attr-defined]

#: reply Struct per op (None: the reply is nil)
REPLY_TYPES: dict[type, type] = {
    ServerStatus: ServerStatusView,
    ScopeCreate: ScopeView,
    ScopeStatus: ScopeView,
    ScopeCancel: ScopeView,
    ScopeComplete: ScopeView,
    ScopeList: ScopeListView,
    MailboxEnsure: MailboxView,
    MailboxGet: MailboxView,
    MailboxList: MailboxListView,
    TaskSubmit: TaskView,
    TaskSubmitMany: TaskListView,
    TaskStatus: TaskView,
    TaskResult: TaskView,
    TaskCancel: TaskView,
    Receive: ReceiveView,
    DeliveryRenew: LeaseView,
    DeliveryComplete: TaskView,
    DeliveryRetry: TaskView,
    DeliveryReject: TaskView,
    DeliveryRun: ScopeView,
    GroupCreate: GroupView,
    GroupSubmit: GroupMemberAddedView,
    GroupJoinTask: GroupMemberAddedView,
    GroupVerdictOp: VerdictView,
    GroupClose: GroupDecisionView,
    GroupStatus: GroupView,
    GroupWait: GroupView,
    BarrierCreate: BarrierView,
    BarrierArrive: BarrierView,
    BarrierStatus: BarrierView,
    BarrierWait: BarrierView,
    BarrierNextEpochOp: BarrierView,
    TimerCreate: TimerView,
    TimerStatus: TimerView,
    TimerWait: TimerView,
    TimerCancel: TimerView,
    JoinSetCreate: JoinSetView,
    JoinSetGet: JoinSetView,
    JoinSetSubmit: JoinSetChildAdded,
    JoinSetSubmitDelay: JoinSetChildAdded,
    JoinNext: JoinNextView,
    JoinSetClose: JoinSetView,
    KeyCreate: KeyView,
    KeyList: KeyListView,
    KeyRevoke: KeyView,
    EventsList: EventPageView,
    EventsWatch: WatchView,
    OpsOverview: OverviewView,
}

op_decoder = msgspec.msgpack.Decoder(Op)
encoder = msgspec.msgpack.Encoder()
