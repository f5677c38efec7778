"""The queue kind's state (:mod:`rallypoint.actors.queue`): what a snapshot stores of
a work queue (:class:`MailboxState`) and of a task (:class:`TaskState`), the typed
states of a task and of its delivery with the moves allowed between them
(:data:`TASK_MOVES`, :data:`DELIVERY_MOVES`: :class:`rallypoint.fsm.Transitions`; an
illegal move raises :class:`rallypoint.fsm.IllegalTransition`), the limits of a queue's
commands and the upper bounds of the encoded views (bytes)."""

from __future__ import annotations

import enum

import msgspec

from ..errors import ValidationError
from ..fsm import Transitions
from .common import check_range
from ..records import TaskRequirements

__all__ = [
    'PRIORITY_MIN', 'PRIORITY_MAX', 'DEFAULT_PRIORITY', 'MAX_WEIGHT', 'MAX_FAIR_KEY', 'MAX_QUEUE_WEIGHTS',
    'MIN_AGING_MS', 'MAX_AGING_MS', 'TERMINAL', 'MODES', 'MIN_LEASE_MS', 'MAX_LEASE_MS', 'MAX_BATCH', 'MAX_SKIPPED', 'delivery_bytes', 'task_view_bytes', 'outcome_view_bytes', 'MailboxState', 'TaskState', 'TaskPhase', 'TASK_MOVES', 'DeliveryState', 'DELIVERY_MOVES', 'delivery_state', 'check_task_move', 'check_fair_key', 'check_scheduling', 'check_weights', 'check_rate_limits', 'rate_room', 'count_rate', 'MAX_RATE', 'RATE_WINDOW_MS',
]

#: task priorities: 1 (most urgent) .. PRIORITY_MAX; a task without one (and whose run
#: carries none) gets DEFAULT_PRIORITY, the middle
PRIORITY_MIN, PRIORITY_MAX, DEFAULT_PRIORITY = 1, 5, 3
#: a fairness key's weight: 1 .. MAX_WEIGHT (a key without one weighs 1)
MAX_WEIGHT = 1000
#: the largest rate limit of a fairness key (deliveries a second) and its window (ms)
MAX_RATE = 100_000
RATE_WINDOW_MS = 1000
#: a fairness key: 1 .. MAX_FAIR_KEY characters
MAX_FAIR_KEY = 128
#: how many fairness keys a queue's weight table holds at most
MAX_QUEUE_WEIGHTS = 10_000
#: aging interval bounds (ms): a waiting task gains one level per interval
MIN_AGING_MS, MAX_AGING_MS = 1_000, 7 * 24 * 3600 * 1000
TERMINAL = frozenset({"SUCCEEDED", "ACKED", "FAILED", "CANCELLED", "EXPIRED"})
MODES = ("WORK", "INBOX")
#: The settings ``mailbox.ensure`` compares with an existing queue (those it was given).
_ENSURE_SETTINGS = ("mode", "max_attempts", "backlog_limit")
MIN_LEASE_MS = 5_000
MAX_LEASE_MS = 600_000
MAX_BATCH = 1000
#: A receive looks at most this many ready tasks whose requirements cannot be taken now
#: before it gives up for this request.
MAX_SKIPPED = 10_000
#: A receive for a run looks at the ready heaps of its subtree: by walking the subtree,
#: or by testing each run with ready work for ancestry, whichever touches fewer runs.
_NIL_BYTES = b"\xc0"
_RUN_REASON = {"cancelled": "scope_cancelled", "completed": "scope_completed", "deadline": "deadline"}

# Upper bounds of the encoded views, bytes, for sizing a reply before anything is
# committed (``common.REPLY_BUDGET_BYTES``): the fixed part (field names, ids of 30
# bytes, instants, ints, a mailbox name of at most 128 characters) plus each variable
# part (payloads as stored; a string at 4 bytes a character). tests/test_reply_size.py
# checks them against real encodings at their largest.
_DELIVERY_FIXED = 512
_GRANT_VIEW = 1024  # one pool grant of a delivery, its pool's name included
_RESERVATION_ID = 48
_TASK_VIEW_FIXED = 768
_OUTCOME_VIEW_FIXED = 128


def _text(s: str | None) -> int:
    return 4 * len(s) if s else 0


def delivery_bytes(t: "TaskState", q: "MailboxState", holder: str | None = None) -> int:
    """An upper bound of the encoded :class:`DeliveryView` of a delivery of ``t`` to
    ``holder``."""
    n = _DELIVERY_FIXED + len(q.name) + len(t.input) + _text(t.key) + _text(holder)
    req = t.requirements
    if req is not None:
        n += _GRANT_VIEW * len(req.pools) + _RESERVATION_ID * len(req.budgets)
    return n


def task_view_bytes(t: "TaskState") -> int:
    """An upper bound of the encoded :class:`TaskView` of ``t``."""
    n = (_TASK_VIEW_FIXED + len(t.input) + len(t.outcome or b"") + len(t.error or b"") + _text(t.key)
         + _text(t.outcome_reason) + _text(t.holder))
    if t.subscribers:
        n += sum(_text(x) + 8 for x in t.subscribers)
    return n


def outcome_view_bytes(t: "TaskState") -> int:
    """An upper bound of the encoded :class:`TaskOutcomeView` of ``t``."""
    return _OUTCOME_VIEW_FIXED + len(t.outcome or b"") + len(t.error or b"") + _text(t.outcome_reason)


class MailboxState(msgspec.Struct, gc=False, omit_defaults=True):
    """A work queue's configuration (what a snapshot stores). ``requirements``: its
    default requirements, resolved (pool / budget ids), given to every task submitted
    without its own; None: none (also in snapshots older than the field)."""

    id: str
    space: str
    name: str
    mode: str
    max_attempts: int
    backlog_limit: int | None
    created_at_ms: int
    requirements: TaskRequirements | None = None
    #: aging: a waiting task gains one priority level per ``aging_ms`` (ms) waited; None: off
    aging_ms: int | None = None
    #: fairness key -> weight (1..MAX_WEIGHT) for the key's tasks (over a task's own weight)
    weights: dict[str, int] | None = None
    #: fairness key ("*": every key without its own) -> deliveries per second (1..MAX_RATE)
    rate_limits: dict[str, int] | None = None
    #: the 1-second window (``at_ms // 1000`` of server wall ms) of the last delivery of a
    #: rate-limited key, and fairness key -> its deliveries in that window: counted from
    #: the ``TaskDelivered`` records (so replay needs no clock); only the current window
    #: limits, so a delivery in a new window starts the counts again
    rate_window: int | None = None
    rate_used: dict[str, int] | None = None


class TaskState(msgspec.Struct, gc=False, omit_defaults=True):
    """What a snapshot stores of a task. ``token`` is the fencing token of the latest
    delivery (0: never delivered); ``attempt`` starts at 1 and grows on each retry or
    lease expiry. ``lease_expires_ms`` and ``available_at_ms`` are server time; the other
    instants are wall time. ``seq`` is its FIFO position."""

    id: str
    space: str
    mailbox_id: str
    scope_id: str
    input: bytes
    created_at_ms: int
    key: str | None = None
    deadline_ms: int | None = None
    state: str = "QUEUED"
    attempt: int = 1
    token: int = 0
    delivery_id: str | None = None
    lease_expires_ms: int = 0
    available_at_ms: int = 0
    outcome: bytes | None = None
    outcome_reason: str | None = None
    error: bytes | None = None
    finished_at_ms: int | None = None
    group_id: str | None = None
    joinset_id: str | None = None
    cancellable: bool = True
    seq: int = 0
    run_id: str | None = None  # the task's own run (``delivery.run``)
    completing: bool = False  # completed by its worker; its run's join sets are closing
    held_outcome: bytes | None = None  # the outcome, recorded once the run is done
    subscribers: list[str] | None = None  # task.subscribe (interest only; none cancels nothing)
    requirements: TaskRequirements | None = None
    work_limit_id: str | None = None
    holder: str | None = None  # who received the latest delivery (TaskDelivered.holder)
    priority: int = DEFAULT_PRIORITY  # 1 (most urgent) .. PRIORITY_MAX
    fair_key: str | None = None  # its fairness key (None: the queue's keyless share)
    fair_weight: int | None = None  # its key's weight as the task gave it (the queue's wins)


# Payloads of the hot task events: Structs without GC tracking (a dict per event is a
# GC allocation, which made the collector run twice as often); they encode as the same
# maps a dict would.
class _Submitted(msgspec.Struct, gc=False, omit_defaults=True):
    mailbox: str
    key: str | None = None
    group: str | None = None
    joinset: str | None = None
    deadline: str | None = None
    priority: int | None = None  # (always given: shown even at the default)
    fair_key: str | None = None


class _Attempt(msgspec.Struct, gc=False):
    attempt: int


class _Delivered(msgspec.Struct, gc=False, omit_defaults=True):
    attempt: int
    holder: str | None = None
    priority: int | None = None  # (always given: shown even at the default)
    fair_key: str | None = None


class TaskPhase(enum.StrEnum):
    """A task's state (``TaskState.state``; a ``str`` enum, so a snapshot and a view
    carry the same strings as before). QUEUED -> RUNNING (a delivery holds a lease) ->
    SUCCEEDED (ACKED for a message) | FAILED | CANCELLED | EXPIRED, or back to QUEUED
    (retry, release, lease expiry); a QUEUED task may be CANCELLED or EXPIRED."""

    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    ACKED = "ACKED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    EXPIRED = "EXPIRED"


_S = TaskPhase
TASK_MOVES = Transitions("task", TaskPhase, {
    _S.QUEUED: {_S.RUNNING, _S.CANCELLED, _S.EXPIRED},
    _S.RUNNING: {_S.QUEUED, _S.SUCCEEDED, _S.ACKED, _S.FAILED, _S.CANCELLED, _S.EXPIRED},
    _S.SUCCEEDED: (), _S.ACKED: (), _S.FAILED: (), _S.CANCELLED: (), _S.EXPIRED: (),
})
_STATUS = {s.value: s for s in TaskPhase}


def check_task_move(old: str, new: str) -> None:
    """Raise :class:`~rallypoint.fsm.IllegalTransition` unless ``old -> new`` is a move
    of :data:`TASK_MOVES` (a bug: every caller decided the move from the task's state).
    KeyError for a string that is no state."""
    TASK_MOVES.check(_STATUS[old], _STATUS[new])


class DeliveryState(enum.Enum):
    """The state of a task's latest delivery (derived from the task: :func:`delivery_state`).
    NONE: never delivered; LEASED: a worker holds the lease (the task is RUNNING);
    COMPLETING: its worker completed it and the task's own run's join sets are closing
    (no lease any more); ENDED: settled, expired, released or cancelled (the task is
    QUEUED again or terminal)."""

    NONE = "none"
    LEASED = "leased"
    COMPLETING = "completing"
    ENDED = "ended"


_D = DeliveryState
DELIVERY_MOVES = Transitions("delivery", DeliveryState, {
    _D.NONE: {_D.LEASED, _D.ENDED},  # ENDED: cancelled or expired before any delivery
    _D.LEASED: {_D.COMPLETING, _D.ENDED},
    _D.COMPLETING: {_D.ENDED},
    _D.ENDED: {_D.LEASED},  # the next delivery (after a retry, a release, a lease expiry)
})


def delivery_state(t: "TaskState") -> DeliveryState:
    """The state of ``t``'s latest delivery."""
    if t.state == "RUNNING":
        return _D.COMPLETING if t.completing else _D.LEASED
    return _D.NONE if t.token == 0 and t.state == "QUEUED" else _D.ENDED


def check_fair_key(field: str, key) -> str:
    """A fairness key: a string of 1 .. :data:`MAX_FAIR_KEY` characters
    (VALIDATION_FAILED otherwise)."""
    if not isinstance(key, str) or not 1 <= len(key) <= MAX_FAIR_KEY:
        raise ValidationError(f"{field} must be a string of 1 to {MAX_FAIR_KEY} characters (a tenant, an agent...)",
                              details={"field": field})
    return key


def check_scheduling(prefix: str, priority: int | None, fair_key: str | None, fair_weight: int | None) -> int | None:
    """Validate a submission's priority (1 .. :data:`PRIORITY_MAX`), fairness key and
    weight (1 .. :data:`MAX_WEIGHT`, only with a key); returns ``priority``.
    VALIDATION_FAILED naming the field (``prefix``: ``items[3].`` in a batch)."""
    if priority is not None:
        check_range(prefix + "priority", priority, PRIORITY_MIN, PRIORITY_MAX, " (1 is the most urgent)")
    if fair_key is not None:
        check_fair_key(prefix + "fair_key", fair_key)
    if fair_weight is not None:
        if fair_key is None:
            raise ValidationError(f"{prefix}fair_weight is the weight of a fairness key: give fair_key too",
                                  details={"field": prefix + "fair_weight"})
        check_range(prefix + "fair_weight", fair_weight, 1, MAX_WEIGHT)
    return priority


def check_rate_limits(limits: dict) -> dict[str, int]:
    """A queue's rate limits per fairness key: at most :data:`MAX_QUEUE_WEIGHTS` keys
    (``"*"``: every key without its own), each 1 .. :data:`MAX_RATE` deliveries per
    second (VALIDATION_FAILED naming the field)."""
    if len(limits) > MAX_QUEUE_WEIGHTS:
        raise ValidationError(f"rate_limits holds at most {MAX_QUEUE_WEIGHTS} keys (got {len(limits)})",
                              details={"field": "rate_limits"})
    for k, n in limits.items():
        check_fair_key("rate_limits", k)
        check_range(f"rate_limits[{k!r}]", n, 1, MAX_RATE, " deliveries a second")
    return dict(sorted(limits.items()))


def rate_room(q: MailboxState, key: str | None, now_ms: int) -> int | None:
    """How many more tasks of fairness key ``key`` the queue ``q`` may deliver in the
    1-second window of ``now_ms`` (server ms); None: no limit applies (no key, or no
    limit for it nor ``"*"``)."""
    limits = q.rate_limits
    if not limits or key is None:
        return None
    limit = limits.get(key, limits.get("*"))
    if limit is None:
        return None
    if q.rate_window != now_ms // RATE_WINDOW_MS or not q.rate_used:
        return limit
    return max(0, limit - q.rate_used.get(key, 0))


def count_rate(q: MailboxState, key: str, at_ms: int) -> None:
    """Count one delivery of fairness key ``key`` at ``at_ms`` (server ms, the
    ``TaskDelivered`` record's) in the queue's current rate window; the first delivery
    of a new window starts the counts again (O(1): only the current window limits)."""
    window = at_ms // RATE_WINDOW_MS
    used = q.rate_used
    if used is None or q.rate_window != window:
        q.rate_window = window
        used = q.rate_used = {}
    used[key] = used.get(key, 0) + 1


def check_weights(weights: dict) -> dict[str, int]:
    """A queue's fair-share weights: at most :data:`MAX_QUEUE_WEIGHTS` keys, each a
    fairness key with a weight of 1 .. :data:`MAX_WEIGHT` (VALIDATION_FAILED)."""
    if len(weights) > MAX_QUEUE_WEIGHTS:
        raise ValidationError(f"weights holds at most {MAX_QUEUE_WEIGHTS} keys (got {len(weights)})",
                              details={"field": "weights"})
    for k, w in weights.items():
        check_fair_key("weights", k)
        check_range(f"weights[{k!r}]", w, 1, MAX_WEIGHT)
    return dict(sorted(weights.items()))
