"""The wire contract: operation requests and their replies, as msgspec Structs.

A request body is one of the Structs of :data:`ALL_OPS`, tagged by its field ``op``;
the handler's ``@op`` mark names its reply Struct, and :mod:`rallypoint.actors.api`
collects the marks into the ``Op`` tagged union and ``REPLY_TYPES``. Decoding a body
against ``Op`` validates it: an unknown ``op``, a missing field or a wrong type becomes
VALIDATION_FAILED with msgspec's path to the field (``$.lease_ms``).

Units on the wire: durations are integer milliseconds (``*_ms``), instants are ISO 8601
UTC strings, payloads (task input, outcome, error) are inline msgpack values
(:class:`msgspec.Raw`), at most 64 KiB each. The frame envelope is in
:mod:`rallypoint.wire`.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from .wire import *  # noqa: F401,F403  (the envelope is part of the contract)
from .wire import MAX_PAYLOAD_BYTES, PROTOCOL_VERSION  # noqa: F401

NIL = msgspec.Raw(b"\xc0")


class _Op(msgspec.Struct, tag_field="op", forbid_unknown_fields=True, omit_defaults=True):
    pass


class _View(msgspec.Struct, omit_defaults=False):
    """A reply view: THE declaration of what an entity shows. The SDK's reply types
    (:mod:`rallypoint.client.types`) are generated from it and the HTTP JSON
    (:mod:`rallypoint.http.shapes`) is derived from it; ``tests/test_view_drift.py``
    fails when a field reaches one and not the other."""


class InstantMark:
    """The marker :data:`Instant` carries (see there)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "INSTANT"


#: A view field that is an instant: an ISO 8601 UTC string with milliseconds on the wire
#: (``2026-01-31T12:00:00.000Z``, the same bytes as a plain ``str``); the SDK's generated
#: types show it as an aware ``datetime``. Only reply views use it.
Instant = Annotated[str, InstantMark()]


# --- system -------------------------------------------------------------------------


class ServerStatus(_Op, tag="server.status"):
    pass


class StandbyView(_View):
    """The leader's view of its standby: ``state`` catching_up, joining, in_sync (in the
    in-sync set); ``acked_lsn`` made durable there; ``lag_records`` behind the leader's
    journal end; ``since_progress_s`` since its last acknowledgement advanced."""

    node: str
    state: str
    acked_lsn: int
    lag_records: int
    since_progress_s: float


class ClusterView(_View):
    """A node of a replicated shard (``serve --cluster``): ``role`` (leader), its
    ``epoch``, the shard's ``members`` and in-sync set ``isr`` (as etcd holds them),
    ``lease_time_left_s`` before this leader fences itself unless a keepalive is
    answered, ``min_insync``, and its ``standby`` (None: none connected)."""

    cluster: str
    shard: int
    node: str
    role: str
    epoch: int
    members: list[str]
    isr: list[str]
    lease_time_left_s: float
    min_insync: int = 1
    standby: StandbyView | None = None
    #: seconds this node has led the shard (since the shard's last failover); None: not leading
    leading_for_s: float | None = None


class ClusterMap(_Op, tag="cluster.map"):
    """A sharded cluster's slot map and the leaders of its shards (any leader node
    answers: it watches both in etcd). The SDK's router keeps it."""

    pass


class ShardView(_View):
    """One shard: its ``leader`` node, that node's client ``address`` (None while a
    failover leaves it without one), its ``epoch``."""

    shard: int
    leader: str | None = None
    address: str | None = None
    epoch: int = 0


class ClusterMapView(_View):
    """``version`` of the slot map (its etcd revision), ``owners[slot]`` = the shard that
    owns the slot, ``shards``: every shard's leader; ``cluster`` its name. Without a
    slot map (a single shard) ``owners`` is empty."""

    cluster: str
    version: int
    owners: list[int]
    shards: list[ShardView]


class ClusterReleaseSlots(_Op, tag="cluster.release_slots"):
    """``rallypoint cluster add-shard``: give up to ``count`` slots that hold nothing
    (no entity of any kind, not the open slot) so another shard can own them; from this
    step on this shard makes no entity in them. Answers every slot released so far."""

    count: int


class SlotsReleasedView(_View):
    shard: int
    released: list[int]


class RunLink(_Op, tag="run.link"):
    """Between the shards of a sharded cluster (a node's own call, authenticated by the
    cluster's node secret: FORBIDDEN to anyone else): the home ``shard`` of ``space``
    asks the run's shard to tell it when run ``scope_id`` ends, before the run uses the
    home shard's claims, pools, quotas or budgets. Answered once the run's shard has
    journaled the link (idempotent), or with the run's refusal (NOT_FOUND,
    SCOPE_CANCELLED, DEADLINE_EXCEEDED) when it takes no new work."""

    scope_id: str
    space: str
    shard: int


class RunLinkView(_View):
    """``scope_id`` is linked to home shard ``shard``: its end will be delivered there."""

    scope_id: str
    shard: int


class RemoteRunAdopt(_Op, tag="run.adopt_remote"):
    """A home shard's own step (in-process only): keep run ``scope_id`` of ``space``,
    which lives on ``shard`` and is linked (``run.link``), as a remote run here.
    Idempotent."""

    scope_id: str
    space: str
    shard: int


class OutboxItem(msgspec.Struct, array_like=True, frozen=True):
    """One outbox entry: run ``run_id`` of ``space`` ended at ``at_ms`` (``reason``:
    cancelled, completed, deadline); ``seq`` numbers the entries from one shard to
    another (1, 2, ...)."""

    seq: int
    run_id: str
    space: str
    reason: str
    at_ms: int
    #: an entry about a delivery (``reason`` ``delivered`` or ``delivery_ended``): the
    #: task, the delivery's token and (ended) the task's next state
    task_id: str | None = None
    token: int = 0
    outcome: str | None = None


class OutboxDeliver(_Op, tag="outbox.deliver"):
    """Between the shards of a sharded cluster (authenticated by the node secret:
    FORBIDDEN to anyone else): shard ``source`` delivers its outbox ``items`` (in
    ``seq`` order) to this shard; those already applied (``seq`` at or below what this
    shard holds of ``source``) are skipped. Answers the highest ``seq`` held."""

    source: int
    items: list[OutboxItem]


class OutboxDeliverView(_View):
    """This shard holds every outbox entry of ``source`` up to ``received``."""

    source: int
    received: int


class AdmissionReserve(_Op, tag="admission.reserve"):
    """Between the shards of a sharded cluster (the node secret; FORBIDDEN to anyone
    else): reserve on this home shard what delivery ``token`` of task ``task_id`` (a
    task of run ``scope_id`` of ``space``, on another shard) needs -- ``pools`` (name ->
    units) and ``budgets`` (name -> minor units), all or nothing -- for ``lease_ms``
    unless the delivery is confirmed. Idempotent per (task, token); an older token is
    refused (STALE_CLAIM). Answers GRANTED with what was taken, or WAITING when it does
    not fit now (nothing taken)."""

    space: str
    scope_id: str
    task_id: str
    token: int
    pools: dict[str, int] = {}
    budgets: dict[str, int] = {}
    lease_ms: int = 30_000


class AdmissionReserveView(_View):
    """``status`` GRANTED (``grants``, ``reservations`` held for the delivery;
    ``lease_left_ms``: how long the home shard keeps them unless the delivery is
    confirmed) or WAITING."""

    status: str
    task_id: str
    token: int
    grants: list[GrantView] = []
    reservations: list[str] = []
    lease_left_ms: int = 0


class AdmissionHold(_Op, tag="admission.hold"):
    """A run shard's own step (in-process only): the home ``shard`` reserved what
    delivery ``token`` of task ``task_id`` needs (``grants``, ``reservations``), usable
    for ``usable_ms``; or refused it for good (``refused``: the message), which cancels
    the task."""

    task_id: str
    token: int
    shard: int
    grants: list[GrantView] = []
    reservations: list[str] = []
    usable_ms: int = 15_000
    refused: str | None = None


class OutboxAck(_Op, tag="outbox.ack"):
    """A node's own step (in-process only): shard ``shard`` holds this shard's outbox
    entries up to ``seq``; they leave the outbox. Idempotent."""

    shard: int
    seq: int


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
    #: where the journal's fdatasync runs: "process <pid>" (the sync helper process),
    #: "thread", "inline" (on the event loop), or "" (memory durability: no fsync)
    sync_helper: str = ""
    #: fdatasync calls of the journal since start, and their total duration (seconds)
    fsyncs: int = 0
    fsync_seconds: float = 0.0
    #: a node of a replicated shard: its role, epoch, in-sync set, standby (None: a
    #: single node)
    cluster: ClusterView | None = None
    #: ``server``: the figures are the whole server's (open mode, an ``operator`` key);
    #: ``space``: a key's own space's -- ``connections`` and ``entities`` count that
    #: space only, and the server-wide ones (LSNs, fsyncs, actors, cluster) are left
    #: empty (``actors/space.py``)
    view: str = "server"
    #: the limits per space, name -> value (0: no limit; ``rallypoint/limits.py``)
    limits: dict[str, int] = msgspec.field(default_factory=dict)
    #: space -> limit name -> use: the key's own space (``view`` space), or every space
    #: with any use, the 100 nearest a limit first (``view`` server)
    space_use: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)


# --- runs (scopes) --------------------------------------------------------------------


class ScopeCreate(_Op, tag="scope.create"):
    """``priority``: the default priority (1 most urgent .. 5) of every task submitted
    under the run and its descendants without one of its own; None: the parent's (a root
    run's: the queue default, 3). VALIDATION_FAILED outside 1..5."""

    parent_id: str | None = None
    name: str | None = None
    deadline: str | None = None  # ISO 8601
    child_limit: int = 1000
    priority: int | None = None


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
    first; ``after``/``before`` (ids, exclusive) bound the page, with either order;
    ``name``: only runs whose name contains it (case-insensitive)."""

    parent_id: str | None = None
    roots_only: bool = False
    state: str | None = None
    limit: int = 100
    after: str | None = None
    before: str | None = None
    order: str = "asc"
    name: str | None = None


class ScopeEnsureNamed(_Op, tag="scope.ensure_named"):
    """Join the root run named ``name``: the newest root run with that name that is
    still effectively ACTIVE, or a new one when there is none (a run that ended or passed
    its deadline is never joined again). ``deadline`` (ISO 8601) applies only when the
    run is created. Reply: the run (ScopeView). Runs on the space's actor."""

    name: str
    deadline: str | None = None


class ScopeView(_View):
    id: str
    name: str | None
    parent_id: str | None
    stored_state: str
    effective: str
    inactive_reason: str | None
    deadline: Instant | None
    created_at: Instant
    ended_at: Instant | None
    child_limit: int
    children: int
    tasks: dict[str, int]
    group_id: str | None = None
    task_id: str | None = None  # a task's own run: that task (it ends with the task)
    #: the default priority of the tasks submitted under it (its own, else inherited)
    priority: int | None = None


class ScopeListView(_View):
    scopes: list[ScopeView]


# --- mailboxes ------------------------------------------------------------------------


class Requirements(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What a task needs before it is handed out (admission, all or nothing in one
    step). One field per requirement type: ``pools`` maps a pool *name* to the units
    held (as grants) while a delivery of the task runs (at most 4 pools); ``budgets``
    maps a budget *name* to the amount (minor units) reserved for the delivery, settled
    in full if the task succeeds and voided otherwise unless its worker settles it
    first (at most 2 budgets)."""

    pools: dict[str, int] = {}
    budgets: dict[str, int] = {}


class MailboxEnsure(_Op, tag="mailbox.ensure"):
    """Create the queue, or check that it exists with the settings ``checked`` names
    (CONFLICT naming the first of ``mode``, ``max_attempts``, ``backlog_limit`` that
    differs). ``checked``: the settings the caller gave (``[]``: none -- an existing
    queue is taken as it is, as a producer that only wants a handle asks); a setting not
    in it only applies when the queue is made here (its value, by default WORK, 5
    attempts, no backlog limit). None (clients from before the field): all three.

    ``mode``: WORK (tasks: ``task.submit``) or INBOX (plain messages:
    ``message.send``); both are received, renewed and settled the same way.

    ``requirements``: the queue's *default requirements* (a WORK queue only; same shape
    and limits as a task's: pool name -> units, budget name -> minor units), given to
    every task submitted to it without requirements of its own (single submits, batch
    items, group members, join-set children), resolved and stored on the task at
    submission. None (absent) leaves what the queue holds unchanged (a producer's ensure
    does not erase a worker's declaration); given, it REPLACES them (no CONFLICT: a
    worker re-declares its queue at every start); an empty ``Requirements()`` clears
    them. Journaled (``MailboxRequirementsSet``) only when they change.
    VALIDATION_FAILED as for a task's requirements (too many pools or budgets, units
    outside 1..units_total, an amount outside 1..limit; also for an INBOX queue),
    NOT_FOUND for a pool or budget that does not exist."""

    name: str
    mode: str = "WORK"
    max_attempts: int = 5
    backlog_limit: int | None = None
    requirements: Requirements | None = None
    #: a sharded cluster: the id the space's home shard gave the queue, which another
    #: shard adopts (the SDK's router sends it after the home shard's answer; the
    #: default requirements stay the home shard's)
    id: str | None = None
    checked: list[str] | None = None  # of mode, max_attempts, backlog_limit; None: all
    #: aging (issue 44): a waiting task gains one priority level per ``aging_ms`` (ms,
    #: 1,000 .. 604,800,000); 0 turns it off; None leaves the queue's setting as it is
    aging_ms: int | None = None
    #: fair-share weights: fairness key -> weight (1 .. 1000), over the tasks' own; None
    #: leaves them as they are, given REPLACES them ({}: none). At most 10,000 keys.
    weights: dict[str, int] | None = None
    #: rate limits per fairness key: key -> deliveries per second (1 .. 100,000) in fixed
    #: 1-second windows of server time; "*" limits every key without its own; None leaves
    #: them as they are, given REPLACES them ({}: none). At most 10,000 keys.
    rate_limits: dict[str, int] | None = None


class MailboxGet(_Op, tag="mailbox.get"):
    name: str


class MailboxList(_Op, tag="mailbox.list"):
    pass


class MailboxView(_View):
    """A work queue. ``requirements``: its default requirements by name (pool name ->
    units, budget name -> minor units), None when it has none."""

    id: str
    name: str
    mode: str
    max_attempts: int
    backlog_limit: int | None
    created_at: Instant
    queued: int
    running: int
    requirements: Requirements | None = None
    aging_ms: int | None = None  # None: no aging
    weights: dict[str, int] = msgspec.field(default_factory=dict)
    rate_limits: dict[str, int] = msgspec.field(default_factory=dict)  # key -> deliveries a second
    #: ready tasks per priority ("1".."5") and per fairness key ("" : no key; the 100
    #: largest backlogs)
    ready_by_priority: dict[str, int] = msgspec.field(default_factory=dict)
    ready_by_key: dict[str, int] = msgspec.field(default_factory=dict)


class MailboxListView(_View):
    mailboxes: list[MailboxView]


# --- tasks and deliveries -------------------------------------------------------------


class SubmitItem(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One submission of a batch; ``priority``, ``fair_key``, ``fair_weight`` as in
    :class:`TaskSubmit`."""

    input: msgspec.Raw = NIL
    key: str | None = None
    deadline: str | None = None
    requirements: Requirements | None = None
    priority: int | None = None
    fair_key: str | None = None
    fair_weight: int | None = None


class TaskSubmit(_Op, tag="task.submit"):
    """``work_limit``: the name of a work limit of the run or an ancestor (nearest
    first); the submission is LIMIT_EXCEEDED while the limit's unfinished tasks number
    ``max_outstanding``.

    Issue 44: ``priority`` 1 (most urgent) .. 5, None: the run's default (``ScopeCreate.priority``,
    inherited), else 3; ``fair_key`` (1-128 characters): the task's fairness key (a tenant,
    an agent...), within one priority level deliveries go to the keys in proportion to
    their weights; ``fair_weight`` (1 .. 1000): the key's weight when the queue sets none
    for it (default 1). VALIDATION_FAILED outside those ranges."""

    mailbox: str
    scope_id: str
    input: msgspec.Raw = NIL
    key: str | None = None
    deadline: str | None = None
    requirements: Requirements | None = None
    work_limit: str | None = None
    priority: int | None = None
    fair_key: str | None = None
    fair_weight: int | None = None


class TaskSubmitMany(_Op, tag="task.submit_many"):
    """All-or-nothing: every item is validated first; one commit for all. ``brief``: the
    reply carries only the task ids (``TaskListView.ids``), not each task's view."""

    mailbox: str
    scope_id: str
    items: list[SubmitItem]
    work_limit: str | None = None
    brief: bool = False


class TaskStatus(_Op, tag="task.status"):
    task_id: str


class TaskResult(_Op, tag="task.result"):
    """Waits on the server (at most 60 s per request) for a terminal state."""

    task_id: str
    wait_ms: int = 0


class TaskResults(_Op, tag="task.results"):
    """Waits on the server (at most 60 s per request) until EVERY task is terminal; the
    reply lists them in the given order (as they are when the wait ends). One request
    and one parked wait for many tasks (1 to 1000 ids). ``brief``: each task's outcome
    only (``TaskListView.outcomes``: id, state, attempt, outcome, outcome reason, error),
    not its whole view (no input echoed back, no instants formatted)."""

    task_ids: list[str]
    wait_ms: int = 0
    brief: bool = False


class TaskCancel(_Op, tag="task.cancel"):
    task_id: str


class TaskSetPriority(_Op, tag="task.set_priority"):
    """Change a QUEUED task's priority (1 .. 5): a ready task moves to its new level (at
    its FIFO place there, by submission order). CONFLICT when the task is not QUEUED
    (running or finished); VALIDATION_FAILED outside 1..5; the same priority: no change."""

    task_id: str
    priority: int


class TaskSubscribe(_Op, tag="task.subscribe"):
    """Subscribe ``subscriber_id`` (1-256 chars) to the task: idempotent. ``scope_id``: the
    subscriber's run, which must be active (SCOPE_CANCELLED / DEADLINE_EXCEEDED). A
    subscription is a record of interest only: a task with no subscribers is not
    cancelled."""

    task_id: str
    subscriber_id: str
    scope_id: str | None = None


class TaskDetach(_Op, tag="task.detach"):
    """Remove the subscription (idempotent); the task goes on."""

    task_id: str
    subscriber_id: str


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
    created_at: Instant
    finished_at: Instant | None
    deadline: Instant | None
    group_id: str | None = None
    run_id: str | None = None  # the task's own run (``delivery.run``), once made
    completing: bool = False  # its worker completed it; its run's join sets are closing
    subscribers: list[str] = msgspec.field(default_factory=list)
    holder: str | None = None  # who received its latest delivery (DeliveryView.holder); None: never delivered
    priority: int = 3  # 1 (most urgent) .. 5
    fair_key: str | None = None  # its fairness key


class TaskOutcomeView(_View, array_like=True, gc=False):
    """What a producer waits for: a task's id, state, attempt, outcome (the completing
    worker's value, nil until SUCCEEDED), outcome reason and last error."""

    id: str
    state: str
    attempt: int
    outcome: msgspec.Raw
    outcome_reason: str | None
    error: msgspec.Raw


class TaskListView(_View):
    """The tasks' views, or (a ``brief`` submit) only their ids, or (a ``brief``
    ``task.results``) only their outcomes."""

    tasks: list[TaskView] = msgspec.field(default_factory=list)
    ids: list[str] = msgspec.field(default_factory=list)
    outcomes: list[TaskOutcomeView] = msgspec.field(default_factory=list)


class Receive(_Op, tag="delivery.receive"):
    """Lease ready tasks of ``mailbox`` in run ``scope_id``'s subtree. ``holder``: the
    receiving worker's name (1-128 characters), recorded with each delivery; None: the
    connection's identity (``client@peer``, see ``Session.holder``)."""

    mailbox: str
    scope_id: str
    lease_ms: int = 30_000
    wait_ms: int = 0
    max_messages: int = 1
    holder: str | None = None


class GrantView(_View):
    """A grant of ``units`` of pool ``pool``: ACTIVE, RELEASED or EXPIRED. ``token`` is
    the holder's secret, only in the replies that hand the grant out (else 0).
    ``lease_expires_at`` is None for a grant held by a task's delivery (``task_id``)."""

    id: str
    pool: str
    pool_id: str
    scope_id: str
    units: int
    state: str
    token: int
    lease_expires_at: Instant | None
    holder: str | None
    task_id: str | None
    created_at: Instant
    ended_at: Instant | None
    end_reason: str | None


class DeliveryView(_View):
    id: str
    task_id: str
    mailbox: str
    scope_id: str
    input: msgspec.Raw
    attempt: int
    token: int
    lease_expires_at: Instant
    group_id: str | None = None
    run_id: str | None = None  # the task's own run, if an earlier attempt made it
    key: str | None = None  # the task's idempotency key, if it was submitted with one
    #: pool grants taken with this delivery (the task's requirements), held while it runs
    grants: list[GrantView] = []
    #: ids of the budget reservations made for this delivery (the task's requirements)
    reservations: list[str] = []
    #: who received it: the worker name the receive gave, else the connection's
    #: ``client@peer``; None when unknown (a delivery journaled before the field)
    holder: str | None = None
    priority: int = 3  # the task's priority (1 most urgent .. 5)
    fair_key: str | None = None  # the task's fairness key


class ReceiveView(_View):
    deliveries: list[DeliveryView]


class DeliveryRenew(_Op, tag="delivery.renew"):
    task_id: str
    token: int
    lease_ms: int = 30_000


class LeaseView(_View):
    task_id: str
    token: int
    lease_expires_at: Instant


class DeliveryComplete(_Op, tag="delivery.complete"):
    task_id: str
    token: int
    outcome: msgspec.Raw = NIL


class CompleteItem(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    task_id: str
    token: int
    outcome: msgspec.Raw = NIL


class DeliveryCompleteMany(_Op, tag="delivery.complete_many"):
    """Complete several deliveries of ONE run in one request and one commit. Each item
    is judged on its own, like ``delivery.complete`` (a refused item changes nothing;
    the others are applied); 1 to 1000 items. ``brief``: an accepted item's answer
    carries no task view (only refusals are detailed)."""

    items: list[CompleteItem]
    brief: bool = False


class ItemError(_View):
    """A refused item of a batch operation: the error it would have raised."""

    code: str
    message: str
    retry_after: float | None = None
    details: dict | None = None


class SettledView(_View):
    """One item's answer: the task after it (``task``) or why it was refused (``error``)."""

    task: TaskView | None = None
    error: ItemError | None = None


class SettledListView(_View):
    items: list[SettledView]


class DeliveryCompleteNext(_Op, tag="delivery.complete_next"):
    """Settle ONE delivery and receive the next deliveries of the same queue in one
    request (issue 47): the settle half is ``delivery.complete`` (``settle``
    ``"complete"``, with ``outcome``), ``delivery.retry`` (``"retry"``, with ``error``
    and ``delay_ms``) or ``delivery.reject`` (``"reject"``, with ``error``), judged and
    journaled as that op is; the receive half is ``delivery.receive`` for run
    ``scope_id`` (the task's run or an ancestor of it) of the task's queue, with
    ``lease_ms``, ``wait_ms``, ``max_messages`` and ``holder`` as there. A refused
    settle (STALE_CLAIM, SCOPE_CANCELLED / DEADLINE_EXCEEDED) is the answer and
    receives nothing. ``brief``: the reply carries no task view. Reply:
    :class:`CompleteNextView`."""

    task_id: str
    token: int
    scope_id: str
    settle: str = "complete"
    outcome: msgspec.Raw = NIL
    error: msgspec.Raw = NIL
    delay_ms: int = 0
    lease_ms: int = 30_000
    wait_ms: int = 0
    max_messages: int = 1
    holder: str | None = None
    brief: bool = False


class CompleteNextView(_View):
    """The answer of ``delivery.complete_next``: the settled task (None when ``brief``),
    the next deliveries (possibly none, after the wait), and ``stopped``: the code
    (SCOPE_CANCELLED / DEADLINE_EXCEEDED) when the receive's run stopped while the
    receive half waited (the settle was applied; nothing more will be delivered)."""

    task: TaskView | None = None
    deliveries: list[DeliveryView] = msgspec.field(default_factory=list)
    stopped: str | None = None


class DeliveryRetry(_Op, tag="delivery.retry"):
    task_id: str
    token: int
    error: msgspec.Raw = NIL
    delay_ms: int = 0


class DeliveryReject(_Op, tag="delivery.reject"):
    task_id: str
    token: int
    error: msgspec.Raw = NIL


class DeliveryRelease(_Op, tag="delivery.release"):
    """Give the task back unfinished WITHOUT counting an attempt (a worker that stops:
    Ctrl-C, a rolling restart): QUEUED again at once, at its place in FIFO order, with
    the same ``attempt``. Reply: the task (TaskView)."""

    task_id: str
    token: int


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
    """A member task. ``requirements``: its own admission requirements (as
    ``task.submit``'s); without them it gets its mailbox's default requirements."""

    group_id: str
    input: msgspec.Raw = NIL
    key: str | None = None
    deadline: str | None = None
    requirements: Requirements | None = None


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
    deadline: Instant | None
    state: str
    outcome: str | None
    outcome_reason: str | None
    created_at: Instant
    finalized_at: Instant | None
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
    """``name``: one barrier per (run, name): a later create returns it (CONFLICT when
    ``target`` differs)."""

    scope_id: str
    target: int
    name: str | None = None


class BarrierArrive(_Op, tag="barrier.arrive"):
    """``epoch``: the epoch this arrival is for (None: the current one; the next one
    while the current is RELEASED: an early arrival, counted when it begins)."""

    barrier_id: str
    key: str
    epoch: int | None = None


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
    created_at: Instant
    released_at: Instant | None
    name: str | None = None
    #: early arrivals for the next epoch (held until next_epoch starts it)
    next_keys: list[str] = []


# --- timers ---------------------------------------------------------------------------


class TimerCreate(_Op, tag="timer.create"):
    """``name``: a durable timer per (run, name): the first create makes it, every later
    one returns it unchanged (its ``fire_at`` is never reset)."""

    scope_id: str
    at: str | None = None
    after_ms: int | None = None
    name: str | None = None


class TimerAck(_Op, tag="timer.ack"):
    """Acknowledge a FIRED timer. ``token`` (the view's ``token``, given once it fired):
    another is STALE_CLAIM. CONFLICT while ARMED or once ACKED; TIMER_CANCELLED."""

    timer_id: str
    token: str | None = None


class TimerPoll(_Op, tag="timer.poll"):
    """The run's FIRED timers not yet acknowledged (oldest fire first, at most 1000)."""

    scope_id: str


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
    fire_at: Instant
    fired_at: Instant | None
    acked_at: Instant | None
    created_at: Instant
    name: str | None = None
    #: the fencing token of the fire (set once FIRED): what ``timer.ack`` presents
    token: str | None = None
    #: the server's wall clock when the view was made (``fire_at - now`` is the time left)
    now: Instant | None = None


class TimerListView(_View):
    timers: list[TimerView]


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
    """A child task. ``requirements``: its own admission requirements (as
    ``task.submit``'s); without them it gets its mailbox's default requirements."""

    joinset_id: str
    mailbox: str
    input: msgspec.Raw = NIL
    key: str | None = None
    cancellable: bool = True
    deadline: str | None = None
    requirements: Requirements | None = None


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
    created_at: Instant
    children: list[JoinSetChildView]
    steps: int = 0  # answers journaled so far (the next live answer's step)


class JoinSetChildAdded(_View):
    child_id: str
    kind: str
    fire_at: Instant | None = None


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


# --- messages (INBOX mailboxes) ----------------------------------------------------------


class MessageSend(_Op, tag="message.send"):
    """A plain message into an INBOX-mode mailbox, bound to ``scope_id``; receive,
    renew, complete, retry and reject it like a task delivery. ``key``: idempotent per
    (run, mailbox, key)."""

    mailbox: str
    scope_id: str
    payload: msgspec.Raw = NIL
    key: str | None = None
    deadline: str | None = None


class MessageStatus(_Op, tag="message.status"):
    message_id: str


class MessageView(_View):
    """``state``: QUEUED, RUNNING (leased), ACKED (completed), FAILED, CANCELLED,
    EXPIRED; ``result`` is what the receiver completed it with."""

    id: str
    mailbox: str
    scope_id: str
    state: str
    attempt: int
    key: str | None
    payload: msgspec.Raw
    result: msgspec.Raw
    error: msgspec.Raw
    outcome_reason: str | None
    created_at: Instant
    finished_at: Instant | None
    deadline: Instant | None


# --- quotas (allowances) ------------------------------------------------------------------


class QuotaEnsure(_Op, tag="quota.ensure"):
    """Create the quota, or check it exists with these settings (CONFLICT otherwise).
    ``window_ms``: 1 s to 1 day."""

    name: str
    units_limit: int
    window_ms: int


class QuotaGet(_Op, tag="quota.get"):
    """By name or id; ``waiters``: also list the WAITING waiters (first 1000, FIFO)."""

    quota: str
    waiters: bool = False


class QuotaList(_Op, tag="quota.list"):
    pass


class QuotaTake(_Op, tag="quota.take"):
    """Take ``units`` for ``scope_id``. ``ttl_ms`` 0: now or ALLOWANCE_EXHAUSTED /
    ALLOWANCE_COOLDOWN. ``ttl_ms`` > 0: a durable FIFO waiter, GRANTED at once or
    WAITING until served or ``ttl_ms`` passes (EXPIRED); the request waits up to
    ``wait_ms`` for it. ``key``: idempotent per (quota, key) (the take is recorded as a
    waiter, even when granted at once)."""

    quota: str
    scope_id: str
    units: int = 1
    ttl_ms: int = 0
    wait_ms: int = 0
    key: str | None = None
    holder: str | None = None


class QuotaCooldown(_Op, tag="quota.cooldown"):
    """Grant nothing from the quota, to any run, for ``cooldown_ms`` from now (a running
    cooldown is only ever extended)."""

    quota: str
    cooldown_ms: int
    reason: str | None = None


class QuotaWaiterWait(_Op, tag="quota.waiter_wait"):
    """The waiter's state; with ``wait_ms``, waits until it is no longer WAITING."""

    waiter_id: str
    wait_ms: int = 0


class QuotaWaiterCancel(_Op, tag="quota.waiter_cancel"):
    """Cancel a WAITING waiter; a waiter already GRANTED (or ended) is returned as is."""

    waiter_id: str


class QuotaTakeView(_View):
    """A take: ``state`` GRANTED (``consumption_id`` set: the units are taken, once),
    WAITING, EXPIRED or CANCELLED (``end_reason``: cancelled, run_cancelled,
    run_completed, deadline). ``remaining``: units left in the current window now;
    ``window_start``/``window_end``: the window the grant was counted in."""

    quota_id: str
    quota: str
    scope_id: str
    state: str
    units: int
    consumption_id: str | None
    waiter_id: str | None
    window_start: Instant | None
    window_end: Instant | None
    remaining: int
    expires_at: Instant | None
    created_at: Instant
    ended_at: Instant | None
    end_reason: str | None
    holder: str | None


class QuotaView(_View):
    """A quota now: ``used``/``remaining`` in the current window
    [``window_start``, ``window_end``), ``waiting`` waiters, a running cooldown."""

    id: str
    name: str
    units_limit: int
    window_ms: int
    window_start: Instant
    window_end: Instant
    used: int
    remaining: int
    waiting: int
    cooldown_until: Instant | None
    cooldown_reason: str | None
    consumed_total: int
    created_at: Instant
    waiters: list[QuotaTakeView] = msgspec.field(default_factory=list)


class QuotaListView(_View):
    quotas: list[QuotaView]


# --- schedules (recurring actions) ---------------------------------------------------------


class ScheduleCreate(_Op, tag="schedule.create"):
    """A schedule named ``name`` (unique in the space; the same settings again return it,
    others are CONFLICT). The spec: ``cron`` expressions (5 fields, or 6 with seconds
    first) read in ``timezone`` (an IANA name), and/or every ``interval_ms`` shifted by
    ``offset_ms``; fired only within [``start``, ``end``]; each time delayed by a
    deterministic jitter in [0, ``jitter_ms``). The action: a root run named by the
    template ``run_name`` (``{schedule}``, ``{time}``: the scheduled time, ISO UTC,
    ``{local}``: in ``timezone``), with a deadline ``run_deadline_ms`` after the fire and
    ``metadata``; with ``mailbox``, a task of ``input`` submitted to it in that run.
    Policies: ``overlap`` skip | buffer_one | buffer_all | cancel_other | allow_all;
    ``catchup_window_ms`` (a time that fell due longer ago -- while the server was
    down -- is skipped); ``pause_on_failure``; ``remaining_actions`` (None: no limit)."""

    name: str
    cron: list[str] = []
    interval_ms: int | None = None
    offset_ms: int = 0
    timezone: str = "UTC"
    start: str | None = None
    end: str | None = None
    jitter_ms: int = 0
    run_name: str = "{schedule} {time}"
    run_deadline_ms: int | None = None
    metadata: dict[str, str] = {}
    mailbox: str | None = None
    input: msgspec.Raw = NIL
    overlap: str = "skip"
    catchup_window_ms: int = 60_000
    pause_on_failure: bool = False
    remaining_actions: int | None = None
    paused: bool = False
    note: str | None = None


class ScheduleUpdate(_Op, tag="schedule.update"):
    """Change the given settings (None keeps one; ``interval_ms`` 0 removes the interval,
    ``cron`` [] the cron expressions, ``end`` "" the end, ``mailbox`` "" the task).
    Times already past are never fired by the new spec."""

    schedule: str
    cron: list[str] | None = None
    interval_ms: int | None = None
    offset_ms: int | None = None
    timezone: str | None = None
    start: str | None = None
    end: str | None = None
    jitter_ms: int | None = None
    run_name: str | None = None
    run_deadline_ms: int | None = None
    metadata: dict[str, str] | None = None
    mailbox: str | None = None
    input: msgspec.Raw = NIL  # nil: unchanged
    overlap: str | None = None
    catchup_window_ms: int | None = None
    pause_on_failure: bool | None = None
    remaining_actions: int | None = None


class ScheduleGet(_Op, tag="schedule.describe"):
    """By name or id: the settings, the next ``next_n`` fire times (0 to 100) and the last
    ``recent`` actions (0 to 1000), newest first."""

    schedule: str
    next_n: int = 5
    recent: int = 10


class ScheduleList(_Op, tag="schedule.list"):
    pass


class SchedulePause(_Op, tag="schedule.pause"):
    """Pause (``paused``) or unpause, with a ``note`` (at most 1024 characters). Idempotent."""

    schedule: str
    paused: bool = True
    note: str | None = None


class ScheduleTrigger(_Op, tag="schedule.trigger"):
    """Fire the action now (scheduled time: now), under ``overlap`` (default: the
    schedule's). Counts against ``remaining_actions``."""

    schedule: str
    overlap: str | None = None


class ScheduleBackfill(_Op, tag="schedule.backfill"):
    """Take the action for every time of the spec in [``start``, ``end``] (cut at now; an
    end more than 5 minutes ahead is refused; at most 10,000 times) that has no action yet, under ``overlap`` (default: the
    schedule's). Each time is still fired at most once: safe to send again."""

    schedule: str
    start: str
    end: str
    overlap: str | None = None


class ScheduleDelete(_Op, tag="schedule.delete"):
    """Delete the schedule (its runs are left as they are); NOT_FOUND the second time (so
    it is not re-sent after a dropped connection)."""

    schedule: str


class ScheduleActionView(_View):
    """One action: the scheduled time (its key), when it fired, why (``origin``:
    scheduled, catchup, buffered, trigger, backfill), its run and task, ``state``
    RUNNING or ENDED, and ``outcome`` (succeeded, failed, cancelled, timed_out)."""

    id: str
    scheduled_at: Instant
    fired_at: Instant
    origin: str
    run_id: str
    task_id: str | None
    state: str
    outcome: str | None
    ended_at: Instant | None


class ScheduleView(_View):
    """A schedule: its settings (durations in ms), ``paused`` with its ``note``,
    ``next_fires`` (the next scheduled times, jitter added), ``buffered`` times waiting
    for the running action, ``recent`` actions (newest first), counts of actions taken
    and of times skipped."""

    id: str
    name: str
    paused: bool
    note: str | None
    cron: list[str]
    interval_ms: int | None
    offset_ms: int
    timezone: str
    start: Instant | None
    end: Instant | None
    jitter_ms: int
    run_name: str
    run_deadline_ms: int | None
    metadata: dict[str, str]
    mailbox: str | None
    overlap: str
    catchup_window_ms: int
    pause_on_failure: bool
    remaining_actions: int | None
    created_at: Instant
    actions: int
    skipped: int
    running: list[str]
    buffered: list[Instant]
    next_fires: list[Instant]
    recent: list[ScheduleActionView]


class ScheduleListView(_View):
    schedules: list[ScheduleView]


# --- budgets -------------------------------------------------------------------------------
# Amounts are integer minor units (``*_minor``): at ``scale`` 2, 250 means 2.50.


class BudgetEnsure(_Op, tag="budget.ensure"):
    """Create the budget, or check it exists with these settings (CONFLICT otherwise).
    ``currency``: 3 capital letters; ``scale``: 0-9 decimal places."""

    name: str
    limit_minor: int
    currency: str = "USD"
    scale: int = 2


class BudgetGet(_Op, tag="budget.get"):
    """By name or id; ``reservations``: also list the open (ACTIVE, STALE) ones (first
    1000)."""

    budget: str
    reservations: bool = False


class BudgetList(_Op, tag="budget.list"):
    pass


class BudgetReserve(_Op, tag="budget.reserve"):
    """Hold ``amount_minor`` for ``scope_id``. ``settle_by`` (instant) or
    ``settle_within_ms`` (server time): STALE if still open then. ``key``: idempotent
    per (budget, key). ``task_id``+``token``: held for that delivery (the current lease)
    and closed when it ends."""

    budget: str
    scope_id: str
    amount_minor: int
    settle_by: str | None = None
    settle_within_ms: int | None = None
    key: str | None = None
    holder: str | None = None
    task_id: str | None = None
    token: int = 0


class BudgetSettle(_Op, tag="budget.settle"):
    """Charge ``amount_minor`` (the actual cost) under ``usage_key`` (idempotent: the
    same key again changes nothing). Capped at the reservation's remainder plus what the
    budget has unreserved. ``final``: close the reservation, releasing the rest."""

    reservation_id: str
    amount_minor: int
    usage_key: str
    final: bool = True


class BudgetVoid(_Op, tag="budget.void"):
    """Close the reservation, releasing its remainder (idempotent)."""

    reservation_id: str


class ReservationGet(_Op, tag="budget.reservation"):
    reservation_id: str


class ReservationView(_View):
    """``state``: ACTIVE, STALE (past settle-by, still holding), SETTLED, VOIDED.
    ``remaining_minor``: still held; ``overrun_minor``: asked beyond what could be
    charged."""

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
    settle_by: Instant | None
    created_at: Instant
    closed_at: Instant | None
    close_reason: str | None
    holder: str | None
    key: str | None
    task_id: str | None


class BudgetView(_View):
    """``available_minor`` = ``limit_minor`` - ``settled_minor`` - ``reserved_minor``."""

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
    created_at: Instant
    reservations: list[ReservationView] = msgspec.field(default_factory=list)


class BudgetListView(_View):
    budgets: list[BudgetView]


class SettleView(_View):
    """One settlement: ``charged_minor`` of ``requested_minor`` (capped);
    ``available_minor``: what the budget has left now; ``replayed``: this usage key was
    settled before and nothing changed."""

    reservation: ReservationView
    usage_key: str
    requested_minor: int
    charged_minor: int
    available_minor: int
    replayed: bool


# --- access (admin) ---------------------------------------------------------------------


class KeyCreate(_Op, tag="key.create"):
    space: str
    permissions: list[str]
    name: str | None = None


class KeyList(_Op, tag="key.list"):
    space: str | None = None


class KeyRevoke(_Op, tag="key.revoke"):
    key_id: str


class KeyAdopt(_Op, tag="key.adopt"):
    """A key of the cluster's key store (etcd: ``rallypoint keys create --cluster``) that
    this shard takes as it is there: its id, space, permissions, name, the SHA-256 of
    its secret and its instants (ms since the epoch); ``revoked_at_ms`` revokes it here
    too. The node's own step (its watch of the key store), made in-process: FORBIDDEN
    over the wire. Idempotent: answers the key as this shard then holds it."""

    id: str
    space: str
    permissions: list[str]
    secret_sha256: str
    created_at_ms: int
    name: str | None = None
    revoked_at_ms: int | None = None


class KeyView(_View, omit_defaults=True):
    id: str
    space: str
    name: str | None
    permissions: list[str]
    created_at: Instant
    revoked_at: Instant | None
    secret: str | None = None  # only in the reply to key.create


class KeyListView(_View):
    keys: list[KeyView]


# --- events ---------------------------------------------------------------------------------


class EventView(_View, omit_defaults=True):
    """One event (see docs/events.md). ``seq`` is the space-wide sequence number (the
    cursor; in a sharded cluster, the sequence of the shard that numbered it),
    ``kind``/``id`` the aggregate, ``run`` the run it happened in, ``at`` the instant of
    the change (ISO 8601), ``data`` a small payload, ``shard`` the shard that numbered
    it (a node of a sharded cluster sets it; None, and not sent, on a single node)."""

    seq: int
    type: str
    kind: str
    id: str
    at: Instant
    run: str | None = None
    data: dict[str, Any] | None = None
    shard: int | None = None


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
    created_at: Instant
    tasks: dict[str, int]
    children: int


class OverviewQueue(_View):
    """A work queue in the overview. Issue 44: ``ready_by_priority`` (priority as a
    string -> ready tasks), ``ready_keys`` (fairness keys with ready tasks; summed over
    shards in a sharded cluster: an upper bound there) and ``ready_top_keys`` (the
    :data:`OVERVIEW_TOP_KEYS` largest keys' ready tasks; "" is no key)."""

    name: str
    queued: int
    running: int
    done: int  # tasks finished since the server started (a rate is its difference)
    ready_by_priority: dict[str, int] = msgspec.field(default_factory=dict)
    ready_keys: int = 0
    ready_top_keys: dict[str, int] = msgspec.field(default_factory=dict)


#: the largest fairness keys per queue the overview (``rallypoint top``) carries
OVERVIEW_TOP_KEYS = 3


class OverviewGroup(_View):
    id: str
    condition: str
    state: str
    members: int
    accepted: int
    created_at: Instant


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
# --- claims -----------------------------------------------------------------------------


class ClaimAcquire(_Op, tag="claim.acquire"):
    """An exclusive, fenced lease on ``key`` (unique per space) for run ``scope_id``.

    ``wait_ms``: 0 answers at once (CLAIM_HELD while another lease is live); more queues
    a durable FIFO waiter for that long (at most 24 h) and parks up to 60 s per
    request. ``request_id`` (client-chosen, <= 64 chars) makes the request re-sendable:
    the same id finds its lease or its waiter."""

    scope_id: str
    key: str
    lease_ms: int = 30_000
    wait_ms: int = 0
    holder: str | None = None
    request_id: str | None = None


class ClaimRenew(_Op, tag="claim.renew"):
    key: str
    token: int
    lease_ms: int = 30_000


class ClaimRelease(_Op, tag="claim.release"):
    key: str
    token: int
    observation: msgspec.Raw = NIL


class ClaimComplete(_Op, tag="claim.complete"):
    key: str
    token: int
    result: msgspec.Raw = NIL


class ClaimCancelWait(_Op, tag="claim.cancel_wait"):
    """Withdraw the acquire ``request_id``: its waiter leaves the queue, or the lease it
    was already given is released."""

    key: str
    request_id: str


class ClaimStatus(_Op, tag="claim.status"):
    key: str


class ClaimList(_Op, tag="claim.list"):
    """Claims of the space in key order; ``after`` (a key, exclusive) pages."""

    state: str | None = None
    limit: int = 100
    after: str | None = None


class ClaimWaiterView(_View):
    scope_id: str
    holder: str | None
    queued_at: Instant
    expires_at: Instant


class ClaimView(_View):
    """A claim: HELD (a live lease), FREE or COMPLETED. ``generation`` counts leases
    (the fencing number); ``observation`` is what the last release left for the next
    acquirer, ``result`` what ``complete`` recorded."""

    id: str
    key: str
    scope_id: str
    state: str
    generation: int
    holder: str | None
    lease_expires_at: Instant | None
    acquired_at: Instant | None
    observation: msgspec.Raw
    result: msgspec.Raw
    completed_at: Instant | None
    created_at: Instant
    waiters: list[ClaimWaiterView]


class ClaimLeaseView(_View):
    """The reply to acquire and renew. ``status``: ACQUIRED (``token`` is the lease's
    secret), COMPLETED (no lease: ``claim.result``), or WAITING (still in line at
    ``position``; re-send with the same ``request_id``)."""

    status: str
    claim: ClaimView
    token: int = 0
    request_id: str | None = None
    position: int = 0


class ClaimListView(_View):
    claims: list[ClaimView]


# --- pools (permits) ----------------------------------------------------------------------


class PoolEnsure(_Op, tag="pool.ensure"):
    name: str
    units_total: int


class PoolGet(_Op, tag="pool.get"):
    name: str


class PoolList(_Op, tag="pool.list"):
    pass


class PoolAcquire(_Op, tag="pool.acquire"):
    """``units`` of pool ``pool`` (a name) for run ``scope_id`` under a ``lease_ms``
    lease. ``wait_ms`` 0: CAPACITY_UNAVAILABLE unless the units are free and nobody
    waits; more: a durable FIFO waiter for that long (at most 24 h), parked up to 60 s
    per request. ``request_id`` as for claims."""

    pool: str
    scope_id: str
    units: int = 1
    lease_ms: int = 30_000
    wait_ms: int = 0
    holder: str | None = None
    request_id: str | None = None


class PoolCancelWait(_Op, tag="pool.cancel_wait"):
    pool: str
    request_id: str


class GrantRenew(_Op, tag="grant.renew"):
    grant_id: str
    token: int
    lease_ms: int = 30_000


class GrantRelease(_Op, tag="grant.release"):
    grant_id: str
    token: int
    observation: msgspec.Raw = NIL


class GrantStatus(_Op, tag="grant.status"):
    grant_id: str


class PoolWaiterView(_View):
    scope_id: str
    units: int
    holder: str | None
    queued_at: Instant
    expires_at: Instant


class PoolView(_View):
    """A pool: ``units_used`` of ``units_total`` are granted; ``waiters`` in FIFO order
    and the active ``grants`` (at most 100 of each are listed)."""

    id: str
    name: str
    units_total: int
    units_used: int
    units_free: int
    created_at: Instant
    waiting: int
    active_grants: int
    waiters: list[PoolWaiterView]
    grants: list[GrantView]


class PoolListView(_View):
    pools: list[PoolView]


class PoolAcquireView(_View):
    """``status``: ACQUIRED (``grant``, with its token) or WAITING (in line at
    ``position``; re-send with the same ``request_id``)."""

    status: str
    grant: GrantView | None = None
    request_id: str | None = None
    position: int = 0


class CancelWaitView(_View):
    """``outcome``: ``withdrawn`` (the waiter left the queue), ``released`` (the lease or
    grant it had already been given was released) or ``none`` (nothing was pending)."""

    outcome: str


# --- work limits ---------------------------------------------------------------------------


class WorkLimitEnsure(_Op, tag="work_limit.ensure"):
    scope_id: str
    name: str
    max_outstanding: int


class WorkLimitList(_Op, tag="work_limit.list"):
    """The limits of run ``scope_id`` (None: every limit of the space)."""

    scope_id: str | None = None


class WorkLimitView(_View):
    id: str
    scope_id: str
    name: str
    max_outstanding: int
    outstanding: int
    created_at: Instant


class WorkLimitListView(_View):
    work_limits: list[WorkLimitView]


# --- mailbox contents (HTTP: GET /mailboxes/{id}/messages) ----------------------------------


class MailboxMessages(_Op, tag="mailbox.messages"):
    """The tasks and messages of one work queue, newest first (at most ``limit``, 1-1000);
    ``before`` (an id, exclusive) pages. A diagnostic read: it scans the space's tasks."""

    name: str
    limit: int = 100
    before: str | None = None


# --- once (exactly one execution per run and key) -------------------------------------------


class OnceAcquire(_Op, tag="once.acquire"):
    """Take the work ``key`` of run ``scope_id`` under a ``lease_ms`` lease (5-600 s).

    Reply ``state``: ACQUIRED (``token``; ``attempts``: failures so far), HELD (another
    holder's lease is live -- the same holder and session too: not re-entrant), DONE
    (``result``) or FAILED (``last_error``, ``attempts``). SCOPE_CANCELLED /
    DEADLINE_EXCEEDED when the run refuses new work (DONE and FAILED are still answered)."""

    scope_id: str
    key: str
    lease_ms: int = 30_000
    holder: str | None = None
    holder_session: str | None = None


class OnceGet(_Op, tag="once.get"):
    """The once now (OPEN when nobody took it yet); with ``wait_ms``, waits on the server
    until it is no longer HELD (at most 60 s)."""

    scope_id: str
    key: str
    wait_ms: int = 0


class OnceRenew(_Op, tag="once.renew"):
    """Extend the holder's lease to now + ``lease_ms``. STALE_CLAIM for a token that is
    not the live lease's; the run's code when the run refuses new work."""

    scope_id: str
    key: str
    token: int
    lease_ms: int = 30_000


class OnceComplete(_Op, tag="once.complete"):
    """Record ``result`` (at most 64 KiB): DONE for good. STALE_CLAIM for a stale token;
    the same complete again (same token, same result) answers DONE."""

    scope_id: str
    key: str
    token: int
    result: msgspec.Raw = NIL


class OnceFail(_Op, tag="once.fail"):
    """The holder's attempt failed with ``error`` (at most 2000 chars): FAILED for good
    once the failures reach ``max_attempts`` (1-100), else OPEN for the next caller."""

    scope_id: str
    key: str
    token: int
    error: str = ""
    max_attempts: int = 3


class OnceView(_View):
    """``state``: OPEN, HELD, DONE, FAILED, or (only in an acquire's reply) ACQUIRED.
    ``attempts``: failed attempts so far. ``token`` only to the acquirer."""

    id: str
    scope_id: str
    key: str
    state: str
    attempts: int
    token: int = 0
    holder: str | None = None
    lease_expires_at: Instant | None = None
    result: msgspec.Raw = NIL
    last_error: str | None = None
    created_at: Instant | None = None
    finished_at: Instant | None = None


# --- HTTP idempotency keys -------------------------------------------------------------------


class IdempotencyLookup(_Op, tag="idempotency.lookup"):
    """The answer stored under ``key`` (an HTTP ``Idempotency-Key`` of the session's
    space), if any and not expired. ``fingerprint``: the request's (method, path, body)
    digest; a stored answer for another fingerprint is IDEMPOTENCY_CONFLICT."""

    key: str
    fingerprint: str


class IdempotencyRecord(_Op, tag="idempotency.record"):
    """Store the answer (``status``, encoded ``body``) of the request ``key`` names, kept
    for the server's idempotency TTL (default 24 h); the first record wins."""

    key: str
    fingerprint: str
    status: int
    body: bytes = b""


class IdempotencyView(_View):
    """``found``: an answer is stored (``status``, ``body``)."""

    found: bool
    status: int = 0
    body: bytes = b""


# --- operator actions (the web console's audit trail) ----------------------------------------


class OperatorActed(_Op, tag="console.acted"):
    """Record that an operator acted from the web console (node-local: only the console,
    in process, under ``Session.as_local`` of the acting login, which names its key):
    ``action`` (``cancel-run``, ``retry-task``, ``fail-task``, ``release-lease``,
    ``close-joinset``, ``pause-schedule``, ``unpause-schedule``), ``target`` (the id acted
    on), ``run`` (the run it belongs to, None for a schedule), ``note`` (at most 1024
    characters). Made once the action's own operation succeeded; the event
    ``console.action`` carries the session's key id. Reply: :class:`OperatorActedView`."""

    action: str
    target: str
    run: str | None = None
    note: str | None = None


class OperatorActedView(_View):
    """``at``: when the action was recorded."""

    at: Instant


# --- diagnostics (read-only, never a source of authority) ----------------------------------


class OpsRun(_Op, tag="ops.run"):
    """Who holds what in run ``scope_id``'s subtree: lease holders (once and claim keys,
    leased tasks by their delivery's holder) and waiters (pool and quota waiters)."""

    scope_id: str


class OpsWorkerView(_View):
    """A lease holder of a run's subtree: ``keys`` every once and claim key and leased
    task id it holds (runstate counts them as what it holds), ``tasks`` which of them are
    tasks (leased by deliveries to this holder)."""

    holder: str
    keys: list[str]
    earliest_lease_expiry: Instant | None
    tasks: list[str] = []


class OpsWaitView(_View):
    kind: str  # quota | permit
    name: str
    units: int
    holder: str | None
    scope_id: str


class OpsRunView(_View):
    root_scope_id: str
    scope_id: str
    runs: int
    workers: list[OpsWorkerView]
    waiting: list[OpsWaitView]


class OpsWaits(_Op, tag="ops.waits"):
    """Every parked server-side wait and durable waiter of the space, by kind."""

    pass


class OpsWaitsView(_View):
    parked: dict[str, int]
    waiting: list[OpsWaitView]


class OpsItems(_Op, tag="ops.items"):
    """Lists for operators (the web console), read-only: for each of ``kinds``, what run
    ``scope_id`` holds (None: the whole space), at most ``limit`` (1-1000) rows each.

    - ``tasks``: newest first (the run's own tasks; the space's with ``mailbox``),
      ``state`` filters, ``before`` (an id, exclusive) pages (OpsTaskRow);
    - ``groups``: newest first, the groups created from the run (the space's: all),
      ``state`` filters, ``before`` pages (OpsGroupRow);
    - ``joinsets``: newest first, without their children (JoinSetView); ``before`` pages;
    - ``barriers``, ``timers``: the run's (the space's: none), oldest first;
    - ``claims``: HELD by the run (the space's: every HELD claim);
    - ``grants``: ACTIVE grants of the run and of its tasks' deliveries (the space's: every
      ACTIVE grant);
    - ``queues``: the space's work queues with depth, in flight, done since start and the
      oldest ready task (OpsQueueView; ``scope_id`` is ignored).

    VALIDATION_FAILED for an unknown kind or a bad limit; NOT_FOUND for the run or the
    mailbox."""

    kinds: list[str]
    scope_id: str | None = None
    limit: int = 50
    before: str | None = None
    state: str | None = None
    mailbox: str | None = None


class OpsTaskRow(_View):
    """A task (or message) in a list: no payloads."""

    id: str
    mailbox: str
    scope_id: str
    state: str
    attempt: int
    key: str | None
    created_at: Instant
    finished_at: Instant | None
    group_id: str | None
    outcome_reason: str | None
    completing: bool
    holder: str | None = None  # who received its latest delivery (TaskView.holder)


class OpsGroupRow(_View):
    """A task group in a list: ``scope_id`` the run it was created from; ``outcome``
    SUCCESS / FAILURE once FINALIZED."""

    id: str
    scope_id: str
    condition: str
    state: str
    outcome: str | None
    outcome_reason: str | None
    members: int
    accepted: int
    created_at: Instant
    finalized_at: Instant | None


class OpsQueueView(_View):
    """A work queue for operators: ``queued`` (depth), ``running`` (in flight), ``done``
    (tasks finished since the server started: a rate is its difference between two
    reads), ``oldest_ready_at`` (the creation instant of the oldest task ready to be
    received; None: none ready)."""

    id: str
    name: str
    mode: str
    queued: int
    running: int
    done: int
    oldest_ready_at: Instant | None
    backlog_limit: int | None


class OpsItemsView(_View):
    tasks: list[OpsTaskRow] = msgspec.field(default_factory=list)
    groups: list[OpsGroupRow] = msgspec.field(default_factory=list)
    joinsets: list[JoinSetView] = msgspec.field(default_factory=list)
    barriers: list[BarrierView] = msgspec.field(default_factory=list)
    timers: list[TimerView] = msgspec.field(default_factory=list)
    claims: list[ClaimView] = msgspec.field(default_factory=list)
    grants: list[GrantView] = msgspec.field(default_factory=list)
    queues: list[OpsQueueView] = msgspec.field(default_factory=list)


class OpsTask(_Op, tag="ops.task"):
    """A task (or message) for operators: its view, its queue's ``max_attempts``, and
    while it is RUNNING its current delivery (delivery id, fencing token, lease expiry,
    the pool grants and budget reservations it holds) and the lease time left."""

    task_id: str


class OpsTaskView(_View):
    task: TaskView
    max_attempts: int
    delivery: DeliveryView | None = None
    lease_left_ms: int | None = None  # server time left on the current lease


class OpsJoinSet(_Op, tag="ops.joinset"):
    """A join set as its journal holds it: the children's completion records in
    completion order (consumed or not, closing consumes marked) and its log of answers
    (the steps a replaying client follows)."""

    joinset_id: str


class OpsJoinRecordView(_View):
    """The ``index``-th completion record: ``consumed`` once a consume took it,
    ``closing`` when that consume was a close's."""

    index: int
    child_id: str
    kind: str
    ok: bool
    failure_kind: str | None
    consumed: bool
    closing: bool


class OpsJoinStepView(_View):
    """An entry of the log: steps ``step`` .. ``step + n - 1`` (``n`` identical answers in
    a row), the operation (``next``: an await, ``try``: a probe) and its answer
    (``record`` ``index``, ``pending``, ``exhausted``); ``mailbox``: a typed op's queue."""

    step: int
    op: str
    outcome: str
    index: int
    mailbox: str | None
    n: int


class OpsJoinSetView(_View):
    joinset: JoinSetView
    records: list[OpsJoinRecordView]
    steps: list[OpsJoinStepView]
    closed_at: Instant | None


#: Every request Struct (every subclass of ``_Op`` above), in the order they are defined.
#: Which kind handles each, its reply Struct, and the ``Op`` union a request body is
#: decoded against are declared by the handlers' ``@op`` marks and collected in
#: :mod:`rallypoint.actors.api` (``REPLY_TYPES``, ``Op``, ``op_decoder``).
ALL_OPS: tuple[type, ...] = tuple(dict.fromkeys(
    v for v in list(globals().values()) if isinstance(v, type) and issubclass(v, _Op) and v is not _Op))

encoder = msgspec.msgpack.Encoder()
