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


class MailboxCreated(_Rec, tag="mailbox_created"):
    id: str
    space: str
    name: str
    mode: str
    max_attempts: int
    backlog_limit: int | None
    at_ms: int


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


class TaskDelivered(_Rec, tag="task_delivered"):
    """A lease on the task was granted: QUEUED -> RUNNING with a new fencing token.
    ``lease_expires_ms`` is server time."""

    task_id: str
    delivery_id: str
    token: int
    lease_expires_ms: int
    at_ms: int


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


IMPLIED_FACTS: tuple[type, ...] = (BarrierCancelled, JoinSetChildDone, JoinSetClosing, JoinSetDone)


Record = Union[
    ScopeCreated,
    ScopeEnded,
    ScopeDeadlinePassed,
    MailboxCreated,
    TaskSubmitted,
    TaskDelivered,
    LeaseRenewed,
    TaskCompleted,
    TaskRetried,
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
    Purged,
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
