"""Error codes and the exception hierarchy (SPEC §1).

Every error rallypoint raises, on the server or in the SDK, is a :class:`RallypointError`
with a ``code`` (a string from :data:`CODES`), a human ``message`` that says what to do,
an optional ``retry_after`` (seconds, float) and optional structured ``details``.

Errors cross the wire as ``(code, message, retry_after, details)`` and are re-raised on
the client as the same class by :func:`error_from_wire`, so ``except LeaseLostError``
works the same embedded and over TCP.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CODES",
    "TRANSIENT_REASONS",
    "is_transient_refusal",
    "shutting_down_error",
    "RallypointError",
    "ValidationError",
    "NotFoundError",
    "ConflictError",
    "IdempotencyConflictError",
    "ScopeInactiveError",
    "ScopeCancelledError",
    "DeadlineExceededError",
    "LeaseLostError",
    "BarrierError",
    "BarrierReleasedError",
    "BarrierCancelledError",
    "TimerCancelledError",
    "JoinSetExhaustedError",
    "ChildError",
    "NondeterminismError",
    "FunctionMismatchError",
    "ContentionError",
    "CapacityUnavailableError",
    "AllowanceExhaustedError",
    "AllowanceCooldownError",
    "InsufficientBudgetError",
    "ClaimHeldError",
    "LimitError",
    "WaitTimeout",
    "AuthError",
    "UnauthenticatedError",
    "ForbiddenError",
    "UnavailableError",
    "NotLeaderError",
    "WrongShardError",
    "CursorExpiredError",
    "SlowConsumerError",
    "InternalError",
    "error_from_wire",
]


class RallypointError(Exception):
    """Base of every rallypoint error.

    Attributes:
        code: the wire code (e.g. ``"NOT_FOUND"``).
        message: what went wrong and what to do about it.
        retry_after: seconds after which the same request may succeed, or None.
        details: optional structured data (e.g. ``{"field": "lease_ms"}``).
    """

    code: str = "INTERNAL"

    def __init__(
        self,
        message: str = "",
        *,
        retry_after: float | None = None,
        details: dict[str, Any] | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.retry_after = retry_after
        self.details = details

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r})"


class ValidationError(RallypointError):
    """VALIDATION_FAILED: a bad argument; the message names the field."""

    code = "VALIDATION_FAILED"


class NotFoundError(RallypointError):
    """NOT_FOUND: no such entity in this space."""

    code = "NOT_FOUND"


class ConflictError(RallypointError):
    """CONFLICT: the request contradicts the state (closed group, key reuse, ...)."""

    code = "CONFLICT"


class IdempotencyConflictError(ConflictError):
    """IDEMPOTENCY_CONFLICT: an HTTP ``Idempotency-Key`` already stored an answer for a
    different request (method, path or body); runstate's semantics, HTTP 409. Reached
    over TCP only through the ``idempotency.*`` ops the HTTP front end uses."""

    code = "IDEMPOTENCY_CONFLICT"


class ScopeInactiveError(RallypointError):
    """Base of the two ways a run refuses new work (SPEC §2)."""

    code = "SCOPE_CANCELLED"


class ScopeCancelledError(ScopeInactiveError):
    """SCOPE_CANCELLED: the run, or an ancestor, was cancelled or completed."""

    code = "SCOPE_CANCELLED"


class DeadlineExceededError(ScopeInactiveError):
    """DEADLINE_EXCEEDED: the run, or an ancestor, is past its deadline."""

    code = "DEADLINE_EXCEEDED"


class LeaseLostError(RallypointError):
    """STALE_CLAIM: the lease / fencing token is no longer the current one."""

    code = "STALE_CLAIM"


class BarrierError(RallypointError):
    """Base of barrier errors."""

    code = "BARRIER_RELEASED"


class BarrierReleasedError(BarrierError):
    """BARRIER_RELEASED: arrive after the barrier released in this epoch."""

    code = "BARRIER_RELEASED"


class BarrierCancelledError(BarrierError, ConflictError):
    """BARRIER_CANCELLED: waited on a barrier that was cancelled (its run was cancelled,
    completed or passed its deadline). Also a :class:`ConflictError` -- the seed: a
    barrier's ``wait()`` "throws ConflictError with BARRIER_CANCELLED" -- so ``except
    ConflictError`` catches it, and a :class:`BarrierError` (SPEC §1)."""

    code = "BARRIER_CANCELLED"


class TimerCancelledError(ConflictError):
    """TIMER_CANCELLED: waited on a timer that will never fire: it was cancelled by
    ``timer.cancel()``, or its run was cancelled, completed or passed its deadline
    (``details["reason"]``: ``cancelled``, ``run_cancelled``, ``run_completed``,
    ``deadline``). A :class:`ConflictError` (as a cancelled barrier's wait is), so
    ``except ConflictError`` catches it."""

    code = "TIMER_CANCELLED"


class JoinSetExhaustedError(RallypointError):
    """JOIN_SET_EXHAUSTED: awaited more results than were submitted."""

    code = "JOIN_SET_EXHAUSTED"


class ChildError(RallypointError):
    """CHILD_FAILED: an awaited join-set child failed.

    Attributes:
        value: the child's error payload (any msgpack-able value), or None.
        failure_kind: ``"failed"``, ``"timed_out"``, ``"cancelled"`` or ``"expired"``.
        child_id: the id of the child that failed.
    """

    code = "CHILD_FAILED"

    def __init__(self, message: str = "", **kw: Any) -> None:
        super().__init__(message, **kw)
        d = self.details or {}
        self.value = d.get("value")
        self.failure_kind = d.get("failure_kind")
        self.child_id = d.get("child_id")


class NondeterminismError(RallypointError):
    """NONDETERMINISM_DETECTED: a replaying client asked, at a step of a join set's log,
    for another operation than the one its first execution made there (a ``join_next``
    where a ``join_next_try`` was answered, another mailbox for a typed await...).

    ``details``: ``joinset_id``, ``step``, ``logged`` (the answer the journal holds:
    ``op``, ``outcome`` -- ``record``, ``pending``, ``exhausted`` --, ``index``, and
    ``mailbox`` for a typed await) and ``asked`` (the operation asked: ``op``,
    ``mailbox``, and ``now``: what it would be answered if it were not a replay).
    Nothing changed on the server."""

    code = "NONDETERMINISM_DETECTED"


class FunctionMismatchError(RallypointError):
    """FUNCTION_MISMATCH: a typed ``join_next(mailbox=...)`` took a record of another
    kind of child -- a task of another mailbox, or a delay. The record IS consumed (as
    in Obelisk's typed await-next); re-read it with ``join_next(index=...)``.

    ``details``: ``joinset_id``, ``index`` (the record), ``step``, ``child_id``,
    ``expected`` (the mailbox asked for), ``actual`` (the child's mailbox; None for a
    delay) and ``actual_kind`` (``task`` or ``delay``)."""

    code = "FUNCTION_MISMATCH"

    def __init__(self, message: str = "", **kw: Any) -> None:
        super().__init__(message, **kw)
        d = self.details or {}
        self.child_id = d.get("child_id")
        self.expected = d.get("expected")
        self.actual = d.get("actual")


class ContentionError(RallypointError):
    """Base of contention on pools, quotas, budgets and claims."""


class CapacityUnavailableError(ContentionError):
    """CAPACITY_UNAVAILABLE: a pool acquire without waiting found too few free units, or
    others queued first (``details``: ``pool``, ``units``, ``units_free``, ``waiters``)."""

    code = "CAPACITY_UNAVAILABLE"


class AllowanceExhaustedError(ContentionError):
    """ALLOWANCE_EXHAUSTED: a quota take that may not wait found too few units left in
    the current window (or waiters queued ahead of it: waiters are served first-come
    first-served). ``retry_after``: seconds until the window rolls; ``details``:
    ``quota``, ``units``, ``remaining``, ``waiting``, ``window_start``, ``window_end``."""

    code = "ALLOWANCE_EXHAUSTED"


class AllowanceCooldownError(AllowanceExhaustedError):
    """ALLOWANCE_COOLDOWN: the quota is cooling down (``quota.cooldown(seconds)``, a
    backoff the provider asked for); nothing is granted from it, to any run of the
    space, until it ends. ``retry_after``: seconds left; ``details``: ``quota``,
    ``cooldown_until``, ``reason``. A subclass of AllowanceExhaustedError, so one
    ``except`` handles both."""

    code = "ALLOWANCE_COOLDOWN"


class InsufficientBudgetError(ContentionError):
    """INSUFFICIENT_BUDGET: a reservation larger than what the budget has left (its
    limit minus what is settled and what open reservations hold). ``details``:
    ``budget``, ``requested_minor``, ``available_minor``, ``limit_minor``,
    ``settled_minor``, ``reserved_minor``, ``currency``, ``scale`` (amounts in integer
    minor units)."""

    code = "INSUFFICIENT_BUDGET"


class ClaimHeldError(ContentionError):
    """CLAIM_HELD: a claim acquire without waiting found another live lease
    (``retry_after``: seconds it has left; ``details``: ``key``, ``generation``,
    ``holder``, ``waiters``)."""

    code = "CLAIM_HELD"


class LimitError(RallypointError):
    """LIMIT_EXCEEDED: a structural limit (100 members, child limit, backlog)."""

    code = "LIMIT_EXCEEDED"


class WaitTimeout(RallypointError, TimeoutError):
    """TIMEOUT: a client-side wait ran out; nothing changed on the server."""

    code = "TIMEOUT"


class AuthError(RallypointError):
    """Base of UNAUTHENTICATED and FORBIDDEN."""

    code = "UNAUTHENTICATED"


class UnauthenticatedError(AuthError):
    code = "UNAUTHENTICATED"


class ForbiddenError(AuthError):
    code = "FORBIDDEN"


class UnavailableError(RallypointError):
    """UNAVAILABLE: the server cannot be reached, or is shutting down."""

    code = "UNAVAILABLE"


class NotLeaderError(UnavailableError):
    """NOT_LEADER: this node of a replicated shard does not lead it now (a standby, or a
    leader that was deposed or is handing over). ``details``: ``shard``, ``epoch`` (the
    newest epoch this node knows), ``leader`` (``{"node", "address", "http_address"}``
    of the current leader, or None while none is known: retry after ``retry_after``).
    The SDK reconnects to the leader by itself (``rallypoint.connect`` with several
    addresses, or a cluster URL)."""

    code = "NOT_LEADER"


class WrongShardError(RallypointError):
    """WRONG_SHARD: in a sharded cluster, the request's slot is owned by another shard.
    ``details``: ``slot``, ``shard`` (its owner in this node's slot map), ``map_version``.
    The SDK refreshes its slot map and sends the request there by itself."""

    code = "WRONG_SHARD"


def shutting_down_error(message: str = "the server is shutting down; retry on a new connection") -> UnavailableError:
    """The UNAVAILABLE a draining or stopping server answers: ``details["reason"]`` is
    ``"shutting_down"``, which tells a reconnecting client to move to a new connection
    (any other UNAVAILABLE -- disk full, say -- is the server's answer to that request)."""
    return UnavailableError(message, retry_after=1.0, details={"reason": "shutting_down"})


class CursorExpiredError(RallypointError):
    """CURSOR_EXPIRED: the events after this cursor are no longer kept (older than
    ``--retain-events``); ``details``: ``cursor``, ``oldest`` (the oldest kept seq),
    ``newest``. Start again from ``cursor=None`` (the oldest kept) or from now."""

    code = "CURSOR_EXPIRED"


class SlowConsumerError(RallypointError):
    """SLOW_CONSUMER: a watch that could not take events for too long was cut off (so
    it cannot hold up the server); ``details``: ``cursor`` (the last event sent),
    ``stalled_s``. Resume with ``watch(cursor=...)`` -- the SDK's watch does that
    itself."""

    code = "SLOW_CONSUMER"


class InternalError(RallypointError):
    """INTERNAL: a server bug. The message never carries internal exception text."""

    code = "INTERNAL"


_BY_CODE: dict[str, type[RallypointError]] = {
    "VALIDATION_FAILED": ValidationError,
    "NOT_FOUND": NotFoundError,
    "CONFLICT": ConflictError,
    "SCOPE_CANCELLED": ScopeCancelledError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
    "STALE_CLAIM": LeaseLostError,
    "BARRIER_RELEASED": BarrierReleasedError,
    "BARRIER_CANCELLED": BarrierCancelledError,
    "TIMER_CANCELLED": TimerCancelledError,
    "JOIN_SET_EXHAUSTED": JoinSetExhaustedError,
    "CHILD_FAILED": ChildError,
    "NONDETERMINISM_DETECTED": NondeterminismError,
    "FUNCTION_MISMATCH": FunctionMismatchError,
    "CAPACITY_UNAVAILABLE": CapacityUnavailableError,
    "ALLOWANCE_EXHAUSTED": AllowanceExhaustedError,
    "ALLOWANCE_COOLDOWN": AllowanceCooldownError,
    "INSUFFICIENT_BUDGET": InsufficientBudgetError,
    "CLAIM_HELD": ClaimHeldError,
    "LIMIT_EXCEEDED": LimitError,
    "TIMEOUT": WaitTimeout,
    "UNAUTHENTICATED": UnauthenticatedError,
    "FORBIDDEN": ForbiddenError,
    "UNAVAILABLE": UnavailableError,
    "CURSOR_EXPIRED": CursorExpiredError,
    "SLOW_CONSUMER": SlowConsumerError,
    "INTERNAL": InternalError,
    "IDEMPOTENCY_CONFLICT": IdempotencyConflictError,  # HTTP's (runstate), after SPEC §1's
    "NOT_LEADER": NotLeaderError,  # a replicated shard's standby (rallypoint.cluster)
    "WRONG_SHARD": WrongShardError,  # a sharded cluster's (rallypoint.actors.sharding)
}

#: Every wire code, in SPEC §1 order, then IDEMPOTENCY_CONFLICT (the HTTP front end's),
#: NOT_LEADER (a replicated shard's) and WRONG_SHARD (a sharded cluster's).
CODES: tuple[str, ...] = tuple(_BY_CODE)


#: ``details["reason"]`` of the UNAVAILABLE refusals that change nothing and pass by
#: themselves: a full disk (``low``: below the reserve, ``stalled``: a write waits for
#: space) and a shard under ``--min-insync 2`` without its standby
TRANSIENT_REASONS = frozenset({"low", "stalled", "min_insync"})


def is_transient_refusal(e: BaseException) -> bool:
    """Whether ``e`` is a server's refusal that applied nothing and that waiting (its
    ``retry_after``, seconds) can get past: UNAVAILABLE for a reason in
    :data:`TRANSIENT_REASONS`, NOT_LEADER (a failover under way), or LIMIT_EXCEEDED with
    a ``retry_after``. Not: a client that gave up reconnecting, a request that may have
    been applied (``details["maybe_applied"]``), or a server shutting down (its
    connection is closed and the client reconnects)."""
    if not isinstance(e, RallypointError) or e.retry_after is None:
        return False
    details = e.details or {}
    if details.get("maybe_applied"):
        return False
    if isinstance(e, (NotLeaderError, LimitError)):
        return True
    return isinstance(e, UnavailableError) and details.get("reason") in TRANSIENT_REASONS


def error_from_wire(
    code: str,
    message: str,
    retry_after: float | None = None,
    details: dict[str, Any] | None = None,
) -> RallypointError:
    """Rebuild the exception a server sent: the class for ``code`` (RallypointError
    with that code if the code is unknown to this client version)."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return RallypointError(message, retry_after=retry_after, details=details, code=code)
    return cls(message, retry_after=retry_after, details=details)
