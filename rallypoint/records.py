"""Journal records: the facts the coordinator writes to its write-ahead log.

A record says what happened (``TaskCompleted``), never what was asked. Every state
change goes through one: ``decide`` produces records, ``apply`` mutates state from them,
live and in replay, with no clock reads (every instant is in the record, in ms).
Instants named ``at_ms``, ``deadline_ms`` and ``fire_at_ms`` are wall-clock (UTC ms since
the epoch); lease expiries, retry availability and ``*_mono_ms`` fields are *server
time* (:meth:`rallypoint.clock.Clock.mono_ms`), which durations are measured on. A commit is a list of records journaled as ONE entry with ONE LSN, so a
decision that spans entities (a group finalizing, a run cancelled with its subtree) is
all-or-nothing on disk as well as in memory.

Records tag themselves with the field ``r``. :data:`Record` is the union, and
:data:`ALL_RECORD_TYPES` enumerates it (a test round-trips every member).
"""

from __future__ import annotations

from typing import Union

import msgspec

__all__ = ["Record", "ALL_RECORD_TYPES", "IMPLIED_FACTS", "encode_commit", "decode_commit"]


class _Rec(msgspec.Struct, tag_field="r", gc=False, omit_defaults=True):
    pass


# --- runs (scopes) -------------------------------------------------------------------


class ScopeCreated(_Rec, tag="scope_created"):
    id: str
    space: str
    parent_id: str | None
    name: str | None
    deadline_ms: int | None
    child_limit: int
    at_ms: int
    group_id: str | None = None
    priority: int | None = None  # the tasks' default priority under it (resolved: own or the parent's)


class ScopeEnded(_Rec, tag="scope_ended"):
    """The run's own state becomes CANCELLED or COMPLETED; its subtree goes inactive:
    unfinished tasks CANCELLED, open groups FAILURE, barriers and timers CANCELLED."""

    id: str
    state: str  # "CANCELLED" | "COMPLETED"
    at_ms: int
    reason: str | None = None


class ScopeDeadlinePassed(_Rec, tag="scope_deadline"):
    """The run's deadline passed: the same subtree effects as a cancel (reason deadline);
    ``stored_state`` stays as it was."""

    id: str
    at_ms: int


# --- mailboxes, tasks, deliveries ------------------------------------------------------


class RemoteRequirements(msgspec.Struct, gc=False, omit_defaults=True):
    """A sharded cluster: requirements of a task whose run is not on its space's home
    ``shard``, by *name* (the pools and budgets live there): a delivery of the task first
    holds a reservation made on that shard (``actors/admission_holds.py``)."""

    shard: int
    pools: dict[str, int] = {}
    budgets: dict[str, int] = {}


class TaskRequirements(msgspec.Struct, gc=False, omit_defaults=True):
    """What a task needs to be handed out (admission), resolved at submission: one field
    per requirement type (``actors/admission.py``, ``REQUIREMENT_KINDS``). ``pools``:
    pool id -> units, held as grants while a delivery of the task runs; ``budgets``:
    budget id -> minor units, reserved for each delivery. Also a WORK mailbox's default
    requirements (:class:`MailboxRequirementsSet`), in the same resolved form."""

    pools: dict[str, int] = {}
    budgets: dict[str, int] = {}
    #: a sharded cluster: what the task needs of its space's home shard (a reservation
    #: there, then the delivery here), instead of ``pools`` / ``budgets``
    remote: RemoteRequirements | None = None


class MailboxCreated(_Rec, tag="mailbox_created"):
    """``requirements``: the queue's default requirements (resolved: ids), given to each
    task submitted without its own; None: none (also in journals older than the field)."""

    id: str
    space: str
    name: str
    mode: str
    max_attempts: int
    backlog_limit: int | None
    at_ms: int
    requirements: TaskRequirements | None = None
    aging_ms: int | None = None  # None: no aging
    weights: dict[str, int] | None = None  # fairness key -> weight
    rate_limits: dict[str, int] | None = None  # fairness key ("*": any other) -> deliveries a second


class MailboxSchedulingSet(_Rec, tag="mailbox_scheduling_set"):
    """A ``mailbox.ensure`` changed the queue's aging (``aging_ms``, None: off), its
    fair-share weights (``weights``, None: none) and/or its rate limits per fairness key
    (``rate_limits``, None: none); all are the queue's settings after it."""

    id: str
    at_ms: int
    aging_ms: int | None = None
    weights: dict[str, int] | None = None
    rate_limits: dict[str, int] | None = None


class TaskPrioritySet(_Rec, tag="task_priority_set"):
    """``task.set_priority``: the QUEUED task's priority becomes ``priority``."""

    task_id: str
    priority: int
    at_ms: int


class MailboxRequirementsSet(_Rec, tag="mailbox_requirements_set"):
    """A ``mailbox.ensure`` that declared requirements replaced the queue's default
    requirements with ``requirements`` (resolved: pool / budget ids); None clears them.
    Tasks already submitted keep what their own ``TaskSubmitted`` carried."""

    id: str
    at_ms: int
    requirements: TaskRequirements | None = None


class TaskSubmitted(_Rec, tag="task_submitted"):
    id: str
    space: str
    mailbox_id: str
    scope_id: str
    input: bytes
    at_ms: int
    key: str | None = None
    deadline_ms: int | None = None
    group_id: str | None = None
    joinset_id: str | None = None
    cancellable: bool = True
    seq: int = 0  # FIFO position: submission order, whatever the wall clock says
    requirements: TaskRequirements | None = None
    work_limit_id: str | None = None
    priority: int = 3  # 1 (most urgent) .. 5 (queue_state.DEFAULT_PRIORITY; omitted when 3)
    fair_key: str | None = None
    fair_weight: int | None = None


class TaskDelivered(_Rec, tag="task_delivered"):
    """A lease on the task was granted: QUEUED -> RUNNING with a new fencing token.
    ``lease_expires_ms`` is server time. ``holder``: who received it -- the worker
    name the receive gave, else its connection's ``client@peer`` (``Session.holder``);
    None in journals older than the field (and for a session with no identity)."""

    task_id: str
    delivery_id: str
    token: int
    lease_expires_ms: int
    at_ms: int
    holder: str | None = None


class LeaseRenewed(_Rec, tag="lease_renewed"):
    task_id: str
    token: int
    lease_expires_ms: int


class TaskCompleted(_Rec, tag="task_completed"):
    task_id: str
    token: int
    outcome: bytes
    at_ms: int


class TaskRetried(_Rec, tag="task_retried"):
    """RUNNING -> QUEUED (attempt + 1, eligible at server time ``available_at_ms``), or
    FAILED with reason ``max_attempts`` when ``final``."""

    task_id: str
    token: int
    at_ms: int
    available_at_ms: int
    error: bytes | None = None
    final: bool = False


class TaskReleased(_Rec, tag="task_released"):
    """RUNNING -> QUEUED by its holder (``delivery.release``), the attempt NOT counted:
    ``attempt`` unchanged, eligible at once, at its FIFO place (its ``seq``)."""

    task_id: str
    token: int
    at_ms: int


class TaskRejected(_Rec, tag="task_rejected"):
    """RUNNING -> FAILED (reason ``rejected``), no retry."""

    task_id: str
    token: int
    at_ms: int
    error: bytes | None = None


class LeaseExpired(_Rec, tag="lease_expired"):
    """The holder of ``token`` did not renew: back to QUEUED (attempt + 1) for takeover,
    or FAILED (reason ``lease_expired``) when ``final``."""

    task_id: str
    token: int
    at_ms: int
    final: bool = False


class LeasesExtended(_Rec, tag="leases_extended"):
    """Time the server could not hear (it was down, or its event loop stalled) does not
    count against lease holders: every outstanding lease expires ``by_ms`` later.
    ``reason``: ``restart`` or ``stall``."""

    by_ms: int
    at_ms: int
    reason: str = "restart"


class TaskCancelled(_Rec, tag="task_cancelled"):
    task_id: str
    at_ms: int
    reason: str = "cancelled"


class TaskExpired(_Rec, tag="task_expired"):
    """The task's own deadline passed before it finished."""

    task_id: str
    at_ms: int


class TaskRunCreated(_Rec, tag="task_run_created"):
    """The task's own run ``run_id``, a child of the task's run (``delivery.run()``).
    Any end of the task but success cancels it in the apply of that end."""

    task_id: str
    run_id: str
    at_ms: int


class TaskCompleting(_Rec, tag="task_completing"):
    """The holder of ``token`` completed a task that owns a run: the outcome is held,
    the lease no longer counts, and the run's open join sets are closed (their
    JoinSetClosed records follow in the same commit). The task stays RUNNING until
    ``TaskRunCompleted``."""

    task_id: str
    token: int
    outcome: bytes
    at_ms: int


class TaskRunCompleted(_Rec, tag="task_run_completed"):
    """ONE step: the completing task's run has no open join set left: the run is
    COMPLETED (its subtree step cancels what else is left in it) and the task SUCCEEDED
    with its held outcome."""

    task_id: str
    at_ms: int


# --- task groups ------------------------------------------------------------------------


class GroupCreated(_Rec, tag="group_created"):
    """Creates the group and its gate run (a child of ``parent_scope_id``) in one step."""

    id: str
    space: str
    parent_scope_id: str
    gate_scope_id: str
    mailbox_id: str
    condition: str
    at_ms: int
    threshold: int | None = None
    expected_members: int | None = None
    deadline_ms: int | None = None


class GroupMemberJoined(_Rec, tag="group_member_joined"):
    """An existing task joins the group (``join_task``) or a submitted one (``submit``,
    which journals its TaskSubmitted in the same commit). ``seals`` when it is the
    ``expected_members``-th member."""

    group_id: str
    task_id: str
    at_ms: int
    seals: bool = False


class GroupSealed(_Rec, tag="group_sealed"):
    group_id: str
    at_ms: int


class GroupVerdict(_Rec, tag="group_verdict"):
    group_id: str
    task_id: str
    verdict: str  # "ACCEPTED" | "REJECTED"
    at_ms: int
    late: bool = False


class GroupFinalized(_Rec, tag="group_finalized"):
    """ONE step: outcome recorded, gate run cancelled, unfinished members CANCELLED."""

    group_id: str
    outcome: str  # "SUCCESS" | "FAILURE"
    reason: str
    at_ms: int


# --- barriers ---------------------------------------------------------------------------


class BarrierCreated(_Rec, tag="barrier_created"):
    id: str
    space: str
    scope_id: str
    target: int
    at_ms: int
    name: str | None = None


class BarrierArrived(_Rec, tag="barrier_arrived"):
    """A distinct key arrived in ``epoch``; ``releases`` when it is the target-th."""

    id: str
    key: str
    epoch: int
    at_ms: int
    releases: bool = False


class BarrierNextEpoch(_Rec, tag="barrier_next_epoch"):
    id: str
    epoch: int
    at_ms: int


# --- timers -----------------------------------------------------------------------------


class TimerCreated(_Rec, tag="timer_created"):
    """``fire_at_ms`` is wall time; a timer made with ``after`` also has
    ``fire_mono_ms`` (server time), which is what it fires on."""

    id: str
    space: str
    scope_id: str
    fire_at_ms: int
    at_ms: int
    fire_mono_ms: int | None = None
    name: str | None = None


class TimerFired(_Rec, tag="timer_fired"):
    id: str
    at_ms: int


class TimerAcked(_Rec, tag="timer_acked"):
    id: str
    at_ms: int


class TimerCancelled(_Rec, tag="timer_cancelled"):
    id: str
    at_ms: int


# --- join sets ----------------------------------------------------------------------------


class JoinSetCreated(_Rec, tag="joinset_created"):
    id: str
    space: str
    scope_id: str
    at_ms: int
    name: str | None = None


class JoinSetDelaySubmitted(_Rec, tag="joinset_delay"):
    """A durable delay child; its completion record is written when it fires."""

    joinset_id: str
    child_id: str
    fire_at_ms: int
    at_ms: int
    fire_mono_ms: int | None = None  # a delay given in seconds fires on server time


class JoinSetDelayFired(_Rec, tag="joinset_delay_fired"):
    joinset_id: str
    child_id: str
    at_ms: int


class JoinSetConsumed(_Rec, tag="joinset_consumed"):
    """The ``index``-th consume of the set (positional matching: it took record
    ``index``), answered as step ``step`` of the set's log by ``op`` (``next``: an
    await, ``try``: a probe), typed for work queue ``mailbox`` (an id) or not."""

    joinset_id: str
    index: int
    at_ms: int
    step: int | None = None
    op: str = "next"
    mailbox: str | None = None


class JoinSetAnswered(_Rec, tag="joinset_answered"):
    """An answer that consumed nothing, journaled as step ``step`` of the set's log so a
    replay gets it again: ``outcome`` ``pending`` (a probe found no record), ``exhausted``
    (nothing left to consume), or ``record`` (record ``index``, already taken by a
    closing consume, handed to an await that was waiting for it)."""

    joinset_id: str
    step: int
    op: str
    outcome: str
    at_ms: int
    index: int = -1
    mailbox: str | None = None


class JoinSetClosed(_Rec, tag="joinset_closed"):
    """Close: no more submissions; unconsumed delays and cancellable task children are
    cancelled in reverse submission order; every unconsumed record is consumed as a
    closing consume as it arrives."""

    joinset_id: str
    at_ms: int


# --- quotas (allowances) ------------------------------------------------------------------
# Windows, waiter TTLs and cooldowns are server time (``*_mono_ms``); ``at_ms`` is wall.


class QuotaCreated(_Rec, tag="quota_created"):
    """A quota: at most ``units_limit`` units per fixed window of ``window_ms``, windows
    aligned to multiples of ``window_ms`` on server time."""

    id: str
    space: str
    name: str
    units_limit: int
    window_ms: int
    at_ms: int


class QuotaConsumed(_Rec, tag="quota_consumed"):
    """``units`` taken at once (no waiter) in the window starting at
    ``window_start_mono_ms``."""

    quota_id: str
    consumption_id: str
    scope_id: str
    units: int
    window_start_mono_ms: int
    at_ms: int
    holder: str | None = None


class QuotaWaiterAdded(_Rec, tag="quota_waiter_added"):
    """A durable waiter (FIFO position ``seq``, registered at server time
    ``at_mono_ms``) for ``units``, WAITING until ``expires_mono_ms`` -- or, when ``consumption_id`` is set, GRANTED at once in the
    window starting at ``window_start_mono_ms``."""

    id: str
    quota_id: str
    space: str
    scope_id: str
    units: int
    seq: int
    expires_mono_ms: int
    at_ms: int
    at_mono_ms: int = 0
    key: str | None = None
    holder: str | None = None
    consumption_id: str | None = None
    window_start_mono_ms: int = 0


class QuotaGrant(msgspec.Struct, gc=False, array_like=True):
    """One waiter granted by :class:`QuotaWaitersGranted`, with its consumption id."""

    waiter_id: str
    consumption_id: str


class QuotaWaitersGranted(_Rec, tag="quota_waiters_granted"):
    """The quota's actor served its queue (the window rolled, a cooldown ended, a waiter
    ahead left): the waiters in ``grants``, in FIFO order, are GRANTED in the window
    starting at ``window_start_mono_ms``."""

    quota_id: str
    window_start_mono_ms: int
    grants: list[QuotaGrant]
    at_ms: int


class QuotaWaiterEnded(_Rec, tag="quota_waiter_ended"):
    """A WAITING waiter left without a grant: ``state`` EXPIRED (its TTL passed) or
    CANCELLED (``waiter.cancel()``). (A run's end cancels its waiters inside the run's
    own record.)"""

    waiter_id: str
    state: str
    at_ms: int


class QuotaCooldownSet(_Rec, tag="quota_cooldown"):
    """Nothing is granted from the quota until server time ``until_mono_ms``."""

    quota_id: str
    until_mono_ms: int
    at_ms: int
    reason: str | None = None


# --- budgets --------------------------------------------------------------------------------
# Amounts are integer minor units (at scale 2, 250 = 2.50); never floats.


class BudgetCreated(_Rec, tag="budget_created"):
    id: str
    space: str
    name: str
    currency: str
    scale: int
    limit_minor: int
    at_ms: int


class BudgetReserved(_Rec, tag="budget_reserved"):
    """``amount_minor`` held for ``scope_id`` (ACTIVE). ``settle_by_mono_ms``: marked
    STALE if still open then (never refunded by that). ``task_id``/``token``: held for
    that delivery of a task, closed when the delivery ends (admission, or
    ``budget.reserve(delivery=...)``)."""

    id: str
    budget_id: str
    space: str
    scope_id: str
    amount_minor: int
    at_ms: int
    settle_by_mono_ms: int | None = None
    key: str | None = None
    holder: str | None = None
    task_id: str | None = None
    token: int = 0


class BudgetSettled(_Rec, tag="budget_settled"):
    """A settlement under ``usage_key``: ``requested_minor`` asked, ``charged_minor``
    charged (capped at the reservation's remainder plus the budget's unreserved amount),
    ``from_reserved_minor`` of it out of the reservation; ``released_minor`` of the
    reservation's remainder released; ``closes``: the reservation is SETTLED."""

    reservation_id: str
    usage_key: str
    requested_minor: int
    charged_minor: int
    from_reserved_minor: int
    released_minor: int
    at_ms: int
    closes: bool = True


class BudgetVoided(_Rec, tag="budget_voided"):
    """The reservation is VOIDED: its remainder (``released_minor``) goes back to the
    budget; what was settled stays spent."""

    reservation_id: str
    released_minor: int
    at_ms: int


class ReservationStale(_Rec, tag="reservation_stale"):
    """The reservation passed its settle-by while still ACTIVE: it is STALE, and still
    holds its remainder until settled or voided."""

    reservation_id: str
    at_ms: int


# --- access --------------------------------------------------------------------------------


class KeyCreated(_Rec, tag="key_created"):
    """An API key: only the SHA-256 of its secret is kept."""

    id: str
    space: str
    permissions: list[str]
    secret_sha256: str
    at_ms: int
    name: str | None = None


class KeyRevoked(_Rec, tag="key_revoked"):
    id: str
    at_ms: int


# --- claims ----------------------------------------------------------------------------


class ClaimAcquired(_Rec, tag="claim_acquired"):
    """A lease on claim ``key`` (created by its first acquire): ``generation`` is the
    claim's fencing number (one more than the last lease's), ``token`` the lease's
    secret. ``lease_expires_ms`` is server time. Made for an acquire, or handed to the
    waiter ``request_id`` (which leaves the queue) when the previous lease ended."""

    claim_id: str
    space: str
    key: str
    scope_id: str
    generation: int
    token: int
    lease_expires_ms: int
    at_ms: int
    holder: str | None = None
    request_id: str | None = None


class ClaimWaiterQueued(_Rec, tag="claim_waiter_queued"):
    """A durable FIFO waiter joins the claim's queue until server time
    ``expires_mono_ms``; served with a ``lease_ms`` lease."""

    claim_id: str
    request_id: str
    scope_id: str
    lease_ms: int
    expires_mono_ms: int
    at_ms: int
    holder: str | None = None


class ClaimWaiterEnded(_Rec, tag="claim_waiter_ended"):
    """The waiter leaves the queue unserved: ``expired`` (its wait ran out),
    ``withdrawn`` (its client cancelled the wait) or ``cancelled`` (its run is inactive)."""

    claim_id: str
    request_id: str
    reason: str


class ClaimRenewed(_Rec, tag="claim_renewed"):
    claim_id: str
    token: int
    lease_expires_ms: int


class ClaimReleased(_Rec, tag="claim_released"):
    """The holder ended its lease; ``observation`` (a payload) is kept and shown to the
    next acquirer. ``reason``: ``released`` or ``withdrawn`` (an abandoned acquire)."""

    claim_id: str
    token: int
    at_ms: int
    observation: bytes | None = None
    reason: str = "released"


class ClaimLeaseExpired(_Rec, tag="claim_lease_expired"):
    claim_id: str
    token: int
    at_ms: int


class ClaimCompleted(_Rec, tag="claim_completed"):
    """Do-it-once: the holder recorded ``result``; the claim is COMPLETED for good and
    every later acquire (and every waiter) gets the result instead of a lease."""

    claim_id: str
    token: int
    result: bytes
    at_ms: int


# --- pools (permits) and grants -----------------------------------------------------------


class PoolCreated(_Rec, tag="pool_created"):
    id: str
    space: str
    name: str
    units_total: int
    at_ms: int


class PoolWaiterQueued(_Rec, tag="pool_waiter_queued"):
    """A durable FIFO waiter for ``units`` joins the pool's queue until server time
    ``expires_mono_ms``; its grant will have a ``lease_ms`` lease."""

    pool_id: str
    request_id: str
    scope_id: str
    units: int
    lease_ms: int
    expires_mono_ms: int
    at_ms: int
    holder: str | None = None


class PoolWaiterEnded(_Rec, tag="pool_waiter_ended"):
    """``expired``, ``withdrawn`` or ``cancelled`` (its run is inactive), unserved."""

    pool_id: str
    request_id: str
    reason: str


class PoolGranted(_Rec, tag="pool_granted"):
    """Grant ``id``: ``units`` of the pool, under a lease until server time
    ``lease_expires_ms`` -- or, with ``task_id``, held for as long as that task's
    delivery runs (admission; ``lease_expires_ms`` 0). A waiter ``request_id`` in the
    queue is served by it (and leaves the queue)."""

    id: str
    pool_id: str
    space: str
    scope_id: str
    units: int
    token: int
    at_ms: int
    lease_expires_ms: int = 0
    holder: str | None = None
    request_id: str | None = None
    task_id: str | None = None


class GrantRenewed(_Rec, tag="grant_renewed"):
    grant_id: str
    token: int
    lease_expires_ms: int


class GrantReleased(_Rec, tag="grant_released"):
    """The units go back to the pool; ``reason``: ``released`` or ``withdrawn``."""

    grant_id: str
    token: int
    at_ms: int
    observation: bytes | None = None
    reason: str = "released"


class GrantExpired(_Rec, tag="grant_expired"):
    grant_id: str
    token: int
    at_ms: int


# --- work limits ------------------------------------------------------------------------------


class WorkLimitCreated(_Rec, tag="work_limit_created"):
    """A cap of ``max_outstanding`` unfinished tasks naming the limit, in run
    ``scope_id`` and below."""

    id: str
    space: str
    scope_id: str
    name: str
    max_outstanding: int
    at_ms: int


# --- once ----------------------------------------------------------------------------------


class OnceAcquired(_Rec, tag="once_acquired"):
    """``holder`` took the once ``key`` of run ``scope_id`` (made here on first use) with
    fencing ``token``; its lease runs to ``lease_expires_ms`` (server time)."""

    id: str
    space: str
    scope_id: str
    key: str
    token: int
    lease_expires_ms: int
    at_ms: int
    holder: str | None = None
    holder_session: str | None = None


class OnceRenewed(_Rec, tag="once_renewed"):
    id: str
    token: int
    lease_expires_ms: int


class OnceCompleted(_Rec, tag="once_completed"):
    id: str
    token: int
    result: bytes
    at_ms: int


class OnceFailed(_Rec, tag="once_failed"):
    """An attempt failed; ``final``: FAILED for good, else OPEN again."""

    id: str
    token: int
    error: str
    final: bool
    at_ms: int


class OnceLeaseExpired(_Rec, tag="once_lease_expired"):
    """The holder's lease ran out: OPEN again (the attempt is not counted)."""

    id: str
    token: int
    at_ms: int


# --- task subscriptions ---------------------------------------------------------------------


class TaskSubscribed(_Rec, tag="task_subscribed"):
    task_id: str
    subscriber_id: str
    at_ms: int


class TaskDetached(_Rec, tag="task_detached"):
    task_id: str
    subscriber_id: str
    at_ms: int


# --- HTTP idempotency keys ---------------------------------------------------------------


class IdempotencyRecorded(_Rec, tag="idempotency_recorded"):
    """The answer to the HTTP request ``key`` of ``space`` (``status``, encoded ``body``);
    ``id`` is derived from (space, key). With ``step`` (``"<i>:<op tag>"``): the answer
    of one step of that request (``status`` 0, ``body`` the operation's encoded reply),
    journaled in the same entry as the step's effect (``actors/idempotency.py``)."""

    id: str
    space: str
    key: str
    fingerprint: str
    status: int
    body: bytes
    at_ms: int
    step: str | None = None


class IdempotencyExpired(_Rec, tag="idempotency_expired"):
    """Stored answers past the idempotency TTL, forgotten."""

    ids: list[str]


# --- retention ------------------------------------------------------------------------------


class Purged(_Rec, tag="purged"):
    """Finished entities deleted by retention (``--retain-finished``): every run in
    ``runs`` with its whole subtree (its tasks, groups gated there, barriers, timers,
    join sets, and the tasks' own runs), and each task in ``tasks`` (a finished task of a
    live run, with its own run). The decision only lists what nothing live can reach."""

    space: str
    runs: list[str]
    tasks: list[str]
    at_ms: int


# --- implied facts: never journaled --------------------------------------------------------
#
# A record whose apply changes other entities too (a run's end cancels its subtree) says
# so to the event table through *implied facts*: the record that would have described
# that change (TaskCancelled, ScopeEnded, GroupFinalized, TimerCancelled, JoinSetClosed),
# or, when no record type describes it, one of these. They are made by the apply of the
# record that implies them, in replay too, so they are never written.


class _Fact(msgspec.Struct, gc=False, omit_defaults=True):
    pass


class BarrierCancelled(_Fact):
    """The barrier's run ended before it released (``reason``: cancelled, completed,
    deadline)."""

    id: str
    at_ms: int
    reason: str


class JoinSetChildDone(_Fact):
    """A child of the set finished (a task terminal, a delay fired or cancelled): its
    completion record was appended."""

    joinset_id: str
    child_id: str
    child_kind: str  # task | delay
    ok: bool
    at_ms: int
    failure_kind: str | None = None


class JoinSetClosing(_Fact):
    """The set went OPEN -> CLOSING (``close()``, its run's ``complete()`` or end)."""

    joinset_id: str
    at_ms: int


class JoinSetDone(_Fact):
    """A closing set's last child finished: the set is CLOSED."""

    joinset_id: str
    at_ms: int


# --- operator actions (the console's audit trail) --------------------------------------


class OperatorActionRecorded(_Rec, tag="operator_acted"):
    """An operator acted from the web console: ``action`` on ``target`` (in ``run``), by
    the key ``key_id`` (None: open mode). Changes no state: the action's own records did;
    this one is its audit line (the event ``console.action``)."""

    space: str
    action: str
    target: str
    at_ms: int
    run: str | None = None
    key_id: str | None = None
    note: str | None = None


IMPLIED_FACTS: tuple[type, ...] = (BarrierCancelled, JoinSetChildDone, JoinSetClosing, JoinSetDone)


# --- replication: the shard's leader epochs ---------------------------------------------


class LeaderEpoch(_Rec, tag="leader_epoch"):
    """A node became the shard's leader: the first record of its ``epoch`` (the etcd
    leader key's create revision, strictly increasing), journaled at ``first_lsn``
    before it serves. Every replica keeps the history of these (``Epochs``): a deposed
    leader that rejoins truncates what it wrote past the end of its last epoch
    (Kafka's KIP-101: by epoch, never by time). ``mono_ms``: the new leader's server
    time when it took over."""

    epoch: int
    node: str
    first_lsn: int
    at_ms: int
    mono_ms: int


class SlotsReleased(_Rec, tag="slots_released"):
    """A sharded cluster's shard gives up ``slots`` (each held nothing): from this
    record on it makes no entity in them, so the slot map may give them to another
    shard (``rallypoint cluster add-shard``)."""

    slots: list[int]
    at_ms: int


# --- a sharded cluster: runs that use their space's home shard --------------------------


class RunLinked(_Rec, tag="run_linked"):
    """On the run's shard: run ``run_id`` uses entities of its space's home ``shard``
    (a claim, a pool, a quota, a budget) there, through a *remote run* of that shard.
    From this record on, the run's end (its own or an ancestor's: cancelled, completed,
    deadline) puts one outbox entry for ``shard`` in the same apply (``Outbox``)."""

    run_id: str
    shard: int
    at_ms: int


class RemoteRunAdopted(_Rec, tag="remote_run_adopted"):
    """On the home shard: the run ``run_id`` of ``space``, which lives on ``shard``, may
    use this shard's space-wide entities: a *remote run* (the run's id and shard, no
    tree) holds its claims, grants, waiters and reservations here. The run's shard
    journaled ``RunLinked`` first."""

    run_id: str
    space: str
    shard: int
    at_ms: int


class RemoteRunEnded(_Rec, tag="remote_run_ended"):
    """On the home shard: outbox entry ``seq`` of shard ``shard`` says run ``run_id``
    ended at ``at_ms`` (``reason``: cancelled, completed, deadline); the remote run ends
    here in this one step, as a run does (its waiters answered, renewals refused). The
    receiver keeps the highest ``seq`` applied per source shard: an entry delivered
    again is not applied again."""

    run_id: str
    space: str
    shard: int
    seq: int
    reason: str
    at_ms: int


class AdmissionHeld(_Rec, tag="admission_held"):
    """On the home shard: the reservation for delivery ``token`` of task ``task_id`` (a
    task of ``shard``, in run ``scope_id``): ``grants`` and ``reservations`` were taken
    in this commit (``PoolGranted`` / ``BudgetReserved`` with the task's id), held for
    that delivery. Unless the delivery is confirmed (the run shard's outbox) before
    server time ``expires_mono_ms``, it lapses (``AdmissionEnded``)."""

    task_id: str
    token: int
    space: str
    scope_id: str
    shard: int
    grants: list[str]
    reservations: list[str]
    expires_mono_ms: int
    at_ms: int


class AdmissionEnded(_Rec, tag="admission_ended"):
    """On the home shard: the reservation of ``task_id``/``token`` ends unused
    (``outcome`` ``lapsed``: no delivery confirmed in time; ``superseded``: a newer
    token asked): its grants go back, its budget reservations are voided."""

    task_id: str
    token: int
    outcome: str
    at_ms: int


class RemoteDeliveryNoted(_Rec, tag="remote_delivery_noted"):
    """On the home shard: outbox entry ``seq`` of ``shard`` says delivery ``token`` of
    task ``task_id`` started (``what`` ``delivered``: its reservation no longer lapses)
    or ended (``ended``, the task's next state ``outcome``: grants back, budget
    reservations settled in full on SUCCEEDED, voided otherwise)."""

    shard: int
    seq: int
    task_id: str
    token: int
    what: str
    at_ms: int
    outcome: str | None = None


class TaskReservationHeld(_Rec, tag="task_reservation_held"):
    """On the run's shard: the home ``shard`` reserved what delivery ``token`` of task
    ``task_id`` needs (``grants``: the encoded grant views; ``reservations``: budget
    reservation ids); a receive may deliver it until server time ``until_mono_ms``."""

    task_id: str
    token: int
    shard: int
    grants: bytes
    reservations: list[str]
    until_mono_ms: int
    at_ms: int


class ReservationUsed(_Rec, tag="reservation_used"):
    """On the run's shard, in the commit of the ``TaskDelivered`` of ``token``: the
    delivery holds its reservation (an outbox entry tells the home shard)."""

    task_id: str
    token: int
    at_ms: int


class OutboxAcked(_Rec, tag="outbox_acked"):
    """On the run's shard: shard ``shard`` holds every outbox entry up to ``seq``
    (its answer to the delivery); they leave the outbox."""

    shard: int
    seq: int



# --- schedules (recurring actions) ----------------------------------------------------------


class ScheduleConfig(msgspec.Struct, gc=False, omit_defaults=True, forbid_unknown_fields=True):
    """A schedule's whole configuration, as stored and journaled (durations in ms,
    instants wall ms). The spec: the union of ``cron`` expressions in ``timezone`` and
    an ``interval_ms`` grid shifted by ``offset_ms`` (from the epoch), bounded by
    ``start_ms``/``end_ms``, each time delayed by a jitter in [0, ``jitter_ms``) that is a
    function of (schedule, time). The action: a root run named by ``run_name`` (a
    template), with ``run_deadline_ms`` after the fire and ``metadata``; and a task
    with ``input`` to ``mailbox`` in it when ``mailbox`` is set."""

    cron: list[str] = []
    interval_ms: int | None = None
    offset_ms: int = 0
    timezone: str = "UTC"
    start_ms: int | None = None
    end_ms: int | None = None
    jitter_ms: int = 0
    run_name: str = "{schedule} {time}"
    run_deadline_ms: int | None = None
    metadata: dict[str, str] = {}
    mailbox: str | None = None
    input: bytes | None = None
    overlap: str = "skip"
    catchup_window_ms: int = 60_000
    pause_on_failure: bool = False
    remaining_actions: int | None = None


class ScheduleCreated(_Rec, tag="schedule_created"):
    """A schedule named ``name`` exists; times at or before ``cursor_ms`` are never
    fired by the spec (the creation instant)."""

    id: str
    space: str
    name: str
    config: ScheduleConfig
    at_ms: int
    cursor_ms: int
    paused: bool = False
    note: str | None = None


class ScheduleUpdated(_Rec, tag="schedule_updated"):
    """The configuration is replaced; the spec's times are judged from ``cursor_ms`` on
    (the instant of the update: an updated spec never fires times already past)."""

    id: str
    config: ScheduleConfig
    at_ms: int
    cursor_ms: int
    reset_remaining: bool = False  # the remaining actions start again at config.remaining_actions


class SchedulePaused(_Rec, tag="schedule_paused"):
    """Paused (``paused``) or unpaused, with the operator's (or pause on failure's)
    ``note``. An unpause moves the cursor to ``cursor_ms``: the times that fell due while
    paused are recorded skipped (``ScheduleSkipped``, reason ``paused``) in the same commit."""

    id: str
    paused: bool
    at_ms: int
    note: str | None = None
    cursor_ms: int | None = None


class ScheduleDeleted(_Rec, tag="schedule_deleted"):
    id: str
    at_ms: int


class ScheduleFired(_Rec, tag="schedule_fired"):
    """The action for (``schedule_id``, ``scheduled_ms``), keyed by that pair: its run
    ``run_id`` (created by the ``ScopeCreated`` of this same commit) and task
    ``task_id`` (its ``TaskSubmitted``, same commit). ``origin``: scheduled, catchup,
    buffered, trigger or backfill. ``cancel_run``: the previous action's run this fire
    cancels (overlap ``cancel_other``; its ``ScopeEnded`` is in the same commit).
    ``advance``: the fire moves the schedule's cursor to ``scheduled_ms``."""

    id: str
    schedule_id: str
    scheduled_ms: int
    at_ms: int
    run_id: str
    origin: str
    advance: bool
    task_id: str | None = None
    buffered: bool = False  # taken from the buffer (remove its head)


class ScheduleSkipped(_Rec, tag="schedule_skipped"):
    """``count`` scheduled times from ``scheduled_ms`` to ``last_ms`` (inclusive) were not
    fired, for ``reason``: overlap (a previous action still running), catchup_window
    (fell due longer ago than the catch-up window: downtime), paused, or
    buffer_full. ``advance``: the cursor moves to ``last_ms``."""

    schedule_id: str
    scheduled_ms: int
    last_ms: int
    count: int
    reason: str
    at_ms: int
    advance: bool = True


class ScheduleBuffered(_Rec, tag="schedule_buffered"):
    """The time ``scheduled_ms`` waits in the buffer (overlap buffer_one / buffer_all)
    until the running action ends; ``advance`` as in ``ScheduleFired``."""

    schedule_id: str
    scheduled_ms: int
    at_ms: int
    origin: str = "scheduled"
    advance: bool = True


class ScheduleActionEnded(_Rec, tag="schedule_action_ended"):
    """The action ``id`` ended with ``outcome`` (succeeded, failed, cancelled,
    timed_out); ``pause``: it pauses the schedule (pause on failure)."""

    id: str
    outcome: str
    at_ms: int
    pause: bool = False


Record = Union[
    ScopeCreated,
    ScopeEnded,
    ScopeDeadlinePassed,
    MailboxCreated,
    MailboxRequirementsSet,
    MailboxSchedulingSet,
    TaskPrioritySet,
    TaskSubmitted,
    TaskDelivered,
    LeaseRenewed,
    TaskCompleted,
    TaskRetried,
    TaskReleased,
    TaskRejected,
    LeaseExpired,
    TaskCancelled,
    TaskExpired,
    TaskRunCreated,
    TaskCompleting,
    TaskRunCompleted,
    LeasesExtended,
    GroupCreated,
    GroupMemberJoined,
    GroupSealed,
    GroupVerdict,
    GroupFinalized,
    BarrierCreated,
    BarrierArrived,
    BarrierNextEpoch,
    TimerCreated,
    TimerFired,
    TimerAcked,
    TimerCancelled,
    JoinSetCreated,
    JoinSetDelaySubmitted,
    JoinSetDelayFired,
    JoinSetConsumed,
    JoinSetAnswered,
    JoinSetClosed,
    KeyCreated,
    KeyRevoked,
    QuotaCreated,
    QuotaConsumed,
    QuotaWaiterAdded,
    QuotaWaitersGranted,
    QuotaWaiterEnded,
    QuotaCooldownSet,
    BudgetCreated,
    BudgetReserved,
    BudgetSettled,
    BudgetVoided,
    ReservationStale,
    ClaimAcquired,
    ClaimWaiterQueued,
    ClaimWaiterEnded,
    ClaimRenewed,
    ClaimReleased,
    ClaimLeaseExpired,
    ClaimCompleted,
    PoolCreated,
    PoolWaiterQueued,
    PoolWaiterEnded,
    PoolGranted,
    GrantRenewed,
    GrantReleased,
    GrantExpired,
    WorkLimitCreated,
    OnceAcquired,
    OnceRenewed,
    OnceCompleted,
    OnceFailed,
    OnceLeaseExpired,
    IdempotencyRecorded,
    IdempotencyExpired,
    TaskSubscribed,
    TaskDetached,
    Purged,
    LeaderEpoch,
    SlotsReleased,
    RunLinked,
    RemoteRunAdopted,
    RemoteRunEnded,
    OutboxAcked,
    AdmissionHeld,
    AdmissionEnded,
    RemoteDeliveryNoted,
    TaskReservationHeld,
    ReservationUsed,
    ScheduleCreated,
    ScheduleUpdated,
    SchedulePaused,
    ScheduleDeleted,
    ScheduleFired,
    ScheduleSkipped,
    ScheduleBuffered,
    ScheduleActionEnded,
    OperatorActionRecorded,
]

ALL_RECORD_TYPES: tuple[type, ...] = Record.__args__  # type: ignore[attr-defined]

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(list[Record])


def encode_commit(records: list) -> bytes:
    """One journal entry: the records of one commit, in order."""
    return _enc.encode(records)


def decode_commit(payload: bytes) -> list:
    """Inverse of :func:`encode_commit`. Raises msgspec.DecodeError on bad bytes."""
    return _dec.decode(payload)
