"""Reconnection: a client transport that survives a daemon restart.

:class:`ReconnectingTransport` has the transport interface the SDK uses (``call`` and
``call_many``) over a :class:`~rallypoint.transport.connection.Connection` that it
replaces when it drops, with bounded exponential backoff (:class:`Reconnect`).

What happens to a request when the connection drops:

- **Not sent yet** (the connection was already down when the call was made): it waits
  for the new connection and is sent there. Always safe.
- **In flight** (sent, no reply): the server may or may not have applied it. It is sent
  again on the new connection only if doing so cannot apply it twice
  (:func:`reissue_safe`, which reads the ``resend`` rule of the op's ``@op`` mark beside
  its handler: ``ALWAYS``, ``NEVER``, ``keyed(field)`` or a predicate). Today:

  * reads and server-side waits (status, result, group/barrier/timer waits, run
    completion, join-set close, ``join_next`` / ``join_next_try`` at an explicit
    index or step, event pages, the operator overview);
  * idempotent writes: ``mailboxes.ensure``, run and task cancel, group close,
    join_task and verdicts, timer cancel and acknowledgement;
  * a delivery's ``run()`` (made once, the same run after), ``renew``, ``complete``,
    ``retry`` and ``reject`` (the fencing token makes a second one a no-op or
    STALE_CLAIM; when the first one was applied, the
    STALE_CLAIM / CONFLICT the second gets is recognised and the first one's result
    returned instead);
  * ``receive`` (if the lost reply carried a lease, that task stays leased to nobody
    until its lease runs out, then it is delivered again; no work is duplicated);
  * a submission *with an idempotency* ``key`` (task, batch where every item has a
    key, group member, join-set child, message): the server returns the existing one;
    likewise a quota take or a budget reservation with a ``key`` (``quota.take`` with
    ``wait`` always sends one);
  * quota reads, waiter waits and cancels, cooldowns (a second one only extends the
    cooldown to now plus its length); budget reads, settlements (idempotent per usage
    key) and voids;
  * claim and pool acquires with a ``request_id`` (the SDK always sends one): the server
    returns the lease or grant the first one got, or re-parks its queued waiter (which
    keeps its place); the holder's renew/release/complete (fenced by the token; a
    second release or complete returns the first one's result) and withdrawals.

  Everything else raises :class:`~rallypoint.errors.UnavailableError` with
  ``details={"op": ..., "maybe_applied": True}``: a submission *without* a key, creating
  runs, groups, barriers, timers and join sets, barrier arrivals and ``next_epoch``,
  ``join_next`` / ``join_next_try`` without a known index or step, key administration,
  a quota take without a key (``take(wait=0)``), a budget reservation without a key.
  Check the state, then retry
  yourself; or give submissions a ``key``, which makes them safe.

- **Answered UNAVAILABLE by a draining server** (SIGTERM: long waits are ended after a
  grace): treated like "in flight".
- **Answered NOT_LEADER** (a node of a replicated shard whose leadership lapsed: its
  self-fence refuses every request before applying it, ``rallypoint.cluster.member``):
  not applied, so always sent again, on a new connection to the shard's leader (this
  one is closed; :mod:`rallypoint.client.follow` finds the leader).

**Bounded calls.** A call returns or raises within its own server-side wait
(``wait_ms``, if it has one) plus :data:`CALL_GRACE_S`: a link that died without a word
(a proxy or NAT that stops forwarding, a frozen node) is closed by the connection's
liveness check (:meth:`~rallypoint.transport.connection.Connection.watch_liveness`:
6 s, 2.5 s with several addresses) and re-dialled, and a call that has not been
answered by then -- waiting for the new connection included -- raises UnavailableError
(``maybe_applied`` unless it is safe to send again).

If no connection can be made within :attr:`Reconnect.timeout` seconds of the drop, the
client gives up: waiting and later calls raise UnavailableError (the client stays
unusable; open a new one). A refusal at the handshake (e.g. UNAUTHENTICATED: the key
was revoked meanwhile) ends the client at once with that error.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import anyio
import anyio.abc
import msgspec

from .. import protocol as p
from ..errors import (
    ConflictError,
    LeaseLostError,
    RallypointError,
    ScopeInactiveError,
    UnavailableError,
)

__all__ = ["Reconnect", "ReconnectingTransport", "reissue_safe"]

log = logging.getLogger("rallypoint.client")


@dataclass(frozen=True)
class Reconnect:
    """How a client reconnects after its connection to the daemon drops.

    Attributes:
        timeout: seconds to keep trying after a drop before giving up (calls then raise
            UnavailableError). Default 60.
        initial_delay: seconds before the second attempt (the first is immediate);
            doubled after every failed attempt. Default 0.1.
        max_delay: cap on the delay between attempts, seconds. Default 5.
        jitter: each delay is drawn from ``[delay * (1 - jitter), delay]``, so that
            many workers do not reconnect in lockstep. Default 0.5.
    """

    timeout: float = 60.0
    initial_delay: float = 0.1
    max_delay: float = 5.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        from ..errors import ValidationError

        for name in ("timeout", "initial_delay", "max_delay"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ValidationError(f"Reconnect.{name} must be a number of seconds >= 0 (got {v!r})",
                                      details={"field": name})
        if not 0 <= self.jitter <= 1:
            raise ValidationError(f"Reconnect.jitter must be between 0 and 1 (got {self.jitter!r})",
                                  details={"field": "jitter"})


# ---------------------------------------------------------------- what may be re-sent

_table: Any = None


def _op_table() -> Any:
    """The facts of every op (:mod:`rallypoint.opfacts`, generated from the ``@op``
    marks: the client imports no server module), imported at the first dropped
    connection."""
    global _table
    if _table is None:
        from ..opfacts import TABLE

        _table = TABLE
    return _table


#: How long past its own server-side wait a call may take before it raises
#: UnavailableError (the module docstring, "Bounded calls"), seconds.
CALL_GRACE_S = 15.0


def _call_bound(op: Any) -> float:
    """The longest ``op`` may take (seconds): its ``wait_ms`` (if any) + CALL_GRACE_S."""
    wait_ms = getattr(op, "wait_ms", None)
    return (wait_ms / 1000.0 if isinstance(wait_ms, (int, float)) and wait_ms > 0 else 0.0) + CALL_GRACE_S


def reissue_safe(op: Any) -> bool:
    """Whether ``op`` may be sent again after a connection dropped with it in flight
    (applying it twice has the effect of applying it once): the ``resend`` rule of the
    op's ``@op`` mark (:class:`rallypoint.opdecl.Resend`, read from :mod:`rallypoint.opfacts`). False for anything
    else (a pre-encoded body). See the module docstring."""
    return _op_table().resend_safe(op)


def _op_name(op: Any) -> str:
    cfg = getattr(type(op), "__struct_config__", None)
    tag = getattr(cfg, "tag", None)
    return tag if isinstance(tag, str) else type(op).__name__


_task_view = msgspec.msgpack.Decoder(p.TaskView)
_scope_view = msgspec.msgpack.Decoder(p.ScopeView)


def _refused(e: UnavailableError, conn: Any) -> bool:
    """True when ``e`` is the server's own answer to the request -- the connection is
    still open and the server is not shutting down (e.g. disk full): raise it as is
    rather than moving to a new connection."""
    return not conn.closed and (e.details or {}).get("reason") != "shutting_down"


def _fresh(e: RallypointError) -> RallypointError:
    """A new instance of ``e`` (one exception object must not be raised in many tasks)."""
    return type(e)(e.message, retry_after=e.retry_after, details=e.details, code=e.code)


class ReconnectingTransport:
    """``call`` / ``call_many`` over a connection that is re-opened when it drops.

    ``open_connection(timeout)`` opens (connects and handshakes) a new, not yet entered
    :class:`~rallypoint.transport.connection.Connection`, raising UnavailableError when
    the server cannot be reached. Use as ``async with transport:``; the first connection
    is passed in already open, so a server that is down at the start fails at once.
    """

    def __init__(self, url: str, first: Any, open_connection: Callable[[float], Awaitable[Any]],
                 policy: Reconnect, connect_timeout: float = 10.0) -> None:
        self.url = url
        self.policy = policy
        self.connect_timeout = connect_timeout
        self.reconnects = 0  # successful reconnections so far
        self._open = open_connection
        self._first = first
        self.server_info = first.server_info
        self._conn: Any = None
        self._changed = anyio.Event()
        self._error: RallypointError | None = None  # set once the client is unusable
        self._closing = False
        self._tg: anyio.abc.TaskGroup | None = None

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> "ReconnectingTransport":
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        tg.start_soon(self._supervise, self._first)
        self._first = None
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        self._closing = True
        self._fail(UnavailableError(f"{self.url}: the connection was closed by the client"))
        tg = self._tg
        assert tg is not None
        tg.cancel_scope.cancel()
        # The body's own exception propagates unchanged (never an ExceptionGroup): the
        # task group only has to reap the supervisor, which never raises.
        await tg.__aexit__(None, None, None)
        return False

    @property
    def closed(self) -> bool:
        return self._error is not None

    def _fail(self, error: RallypointError) -> None:
        if self._error is None:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        ev, self._changed = self._changed, anyio.Event()
        ev.set()

    async def _supervise(self, conn: Any) -> None:
        try:
            while True:
                async with conn:
                    self._conn = conn
                    self.server_info = conn.server_info
                    self._wake()
                    await conn.wait_closed()
                self._conn = None
                if self._closing:
                    return
                reason = conn.close_reason or "the connection was closed"
                log.warning("%s: connection lost (%s); reconnecting (giving up after %g s)",
                            self.url, reason, self.policy.timeout)
                conn = await self._reopen(reason)
                if conn is None:
                    return
        except Exception as e:  # never let the task group die with the caller's block
            log.exception("%s: the reconnect supervisor failed", self.url)
            self._fail(UnavailableError(f"{self.url}: the client failed ({type(e).__name__}: {e})"))
        finally:
            self._conn = None

    async def _reopen(self, reason: str) -> Any:
        """A new connection, trying with backoff for ``policy.timeout`` seconds; None
        (and the client failed) if none could be made or the server refused us."""
        pol = self.policy
        start = anyio.current_time()
        deadline = start + pol.timeout
        delay = pol.initial_delay
        attempts = 0
        last = reason
        while True:
            attempts += 1
            remaining = deadline - anyio.current_time()
            try:
                conn = await self._open(max(0.5, min(self.connect_timeout, remaining)))
            except UnavailableError as e:
                last = e.message
                log.info("%s: reconnect attempt %d failed: %s", self.url, attempts, e.message)
            except RallypointError as e:  # refused at the handshake: trying again cannot help
                log.error("%s: the server refused the reconnection: %s; giving up", self.url, e)
                self._fail(e)
                return None
            else:
                self.reconnects += 1
                log.warning("%s: reconnected after %.1f s (%d attempt%s)", self.url,
                            anyio.current_time() - start, attempts, "" if attempts == 1 else "s")
                return conn
            remaining = deadline - anyio.current_time()
            if remaining <= 0:
                break
            pause = delay * (1 - pol.jitter * random.random())
            await anyio.sleep(min(pause, remaining))
            delay = min(delay * 2, pol.max_delay)
        msg = (f"{self.url}: the connection was lost and could not be re-established within "
               f"{pol.timeout:g} s ({attempts} attempt{'' if attempts == 1 else 's'}; last: {last})")
        log.error("%s; giving up", msg)
        self._fail(UnavailableError(msg, retry_after=1.0))
        return None

    async def _connection(self) -> Any:
        """The current open connection, waiting (boundedly: see _reopen) for one."""
        while True:
            if self._error is not None:
                raise _fresh(self._error)
            conn = self._conn
            if conn is not None and not conn.closed:
                return conn
            await self._changed.wait()

    async def _drop(self, conn: Any) -> None:
        """After an UNAVAILABLE on ``conn``: return once it is closed. A draining server
        answers long waits UNAVAILABLE, then still sends the replies of the requests it
        is finishing, then closes: so wait for that (other calls' replies may be on the
        way), closing it ourselves only if the server has not within the reconnect
        timeout."""
        if conn.closed:
            return
        with anyio.move_on_after(self.policy.timeout):
            await conn.wait_closed()
        if not conn.closed:
            await conn.aclose()

    async def _leave(self, conn: Any) -> None:
        """``conn``'s node answered NOT_LEADER: close it, so that the next connection
        (made through the leader follower) goes to the shard's leader."""
        if not conn.closed:
            await conn.aclose()

    def _maybe_applied(self, op: Any, e: UnavailableError) -> UnavailableError:
        name = _op_name(op)
        advice = _op_table().resend_advice(op) or "check the state before retrying it"
        return UnavailableError(
            f"{self.url}: the connection was lost with `{name}` in flight ({e.message}); the server may or "
            f"may not have applied it, so it was not sent again; {advice}",
            retry_after=1.0, details={"op": name, "maybe_applied": True},
        )

    # ---------------------------------------------------------------------- calls
    # (see _refused: only a lost connection or a draining server moves to a new one)

    async def call(self, op: Any) -> Any:
        """Send ``op`` and return its reply body (see the module docstring for what a
        dropped connection does). Raises the server's error, UnavailableError when the
        client gave up reconnecting, ``op`` was in flight and cannot be re-sent, or no
        answer came within its wait plus :data:`CALL_GRACE_S` seconds."""
        bound = _call_bound(op)
        with anyio.move_on_after(bound):
            return await self._call(op)
        raise UnavailableError(
            f"{self.url}: no answer to `{_op_name(op)}` within {bound:g} s (its wait plus {CALL_GRACE_S:g} s): the "
            "server is stopped or the link to it is dead", retry_after=1.0,
            details={"op": _op_name(op), **({} if reissue_safe(op) else {"maybe_applied": True})})

    async def _call(self, op: Any) -> Any:
        reissued = False
        while True:
            conn = self._conn
            if conn is None or conn._closed is not None or self._error is not None:
                conn = await self._connection()
            try:
                raw = await conn.call(op)
            except UnavailableError as e:
                if self._closing:
                    raise
                if e.code == "NOT_LEADER":  # refused unapplied: to the leader
                    log.info("%s: `%s` refused NOT_LEADER; sending it to the leader", self.url, _op_name(op))
                    await self._leave(conn)
                    reissued = True
                    continue
                if _refused(e, conn):
                    raise
                await self._drop(conn)
                if not reissue_safe(op):
                    raise self._maybe_applied(op, e) from None
                log.info("%s: re-sending `%s` after the connection was lost", self.url, _op_name(op))
                reissued = True
                continue
            except RallypointError as e:
                if reissued:
                    fixed = await _reconcile(conn, op, e)
                    if fixed is not None:
                        return fixed
                raise
            if reissued:
                return await _reconcile_answer(conn, op, raw)
            return raw

    async def subscribe(self, op: Any, max_events: int = 10_000) -> Any:
        """Open a subscription (``events.watch``) on the current connection (waiting for
        one after a drop). It ends with UnavailableError when that connection drops;
        the SDK's watch opens a new one from its cursor (:attr:`closed` says whether
        reconnecting gave up)."""
        conn = await self._connection()
        return await conn.subscribe(op, max_events)

    async def call_many(self, ops: list) -> list:
        """Like :meth:`call` for a batch (one frame): a reply body or the error, per op.
        The batch is re-sent after a drop only if every op in it may be; bounded by its
        longest wait plus :data:`CALL_GRACE_S`."""
        bound = max((_call_bound(op) for op in ops), default=CALL_GRACE_S)
        with anyio.move_on_after(bound):
            return await self._call_many(ops)
        unsafe = [op for op in ops if not reissue_safe(op)]
        raise UnavailableError(
            f"{self.url}: no answer to a batch of {len(ops)} within {bound:g} s: the server is stopped or the link "
            "to it is dead", retry_after=1.0, details={"ops": len(ops), **({"maybe_applied": True} if unsafe else {})})

    async def _call_many(self, ops: list) -> list:
        out: list = [None] * len(ops)
        todo = list(range(len(ops)))
        reissued = False
        while todo:
            conn = await self._connection()
            batch = [ops[i] for i in todo]
            try:
                results = await conn.call_many(batch)
            except UnavailableError as e:
                if self._closing or _refused(e, conn):
                    raise
                await self._drop(conn)
                unsafe = [op for op in batch if not reissue_safe(op)]
                if unsafe:
                    raise self._maybe_applied(unsafe[0], e) from None
                reissued = True
                continue
            again = []
            leave = False
            for i, r in zip(todo, results):
                if isinstance(r, UnavailableError) and not self._closing and r.code == "NOT_LEADER":
                    again.append(i)  # refused unapplied: to the leader
                    leave = True
                    continue
                if (isinstance(r, UnavailableError) and not self._closing and not _refused(r, conn)
                        and reissue_safe(ops[i])):
                    again.append(i)  # ended by a draining server: send it again
                    continue
                if reissued and isinstance(r, RallypointError):
                    fixed = await _reconcile(conn, ops[i], r)
                    if fixed is not None:
                        r = fixed
                elif reissued and not isinstance(r, Exception):
                    r = await _reconcile_answer(conn, ops[i], r)
                out[i] = r
            if again:
                await (self._leave(conn) if leave else self._drop(conn))
                reissued = True
            todo = again
        return out



# ------------------------------------------------------------------ reconcile rules
# How a fenced op sent again is reconciled when its second sending was refused because
# the first was applied: one implementation per rule its @op mark names
# (rallypoint.actors.opmark.RECONCILE_RULES; ``resend=fenced(rule)``).


async def _task_settled(conn: Any, op: Any, e: RallypointError) -> Any:
    if isinstance(e, ScopeInactiveError) or (
            isinstance(e, LeaseLostError) and (e.details or {}).get("state") in ("SUCCEEDED", "ACKED")):
        raw = await conn.call(p.TaskStatus(task_id=op.task_id))
        v = _task_view.decode(raw)
        if v.state in ("SUCCEEDED", "ACKED") and bytes(v.outcome) == bytes(op.outcome):
            return raw
    return None


async def _task_requeued(conn: Any, op: Any, e: RallypointError) -> Any:
    if isinstance(e, LeaseLostError) and (e.details or {}).get("state") == "QUEUED":
        # Our token is still the task's, and it is queued again: our retry (or release)
        # was applied (or, indistinguishably, the lease ran out meanwhile).
        return await conn.call(p.TaskStatus(task_id=op.task_id))
    return None


async def _task_settled_next(conn: Any, op: Any, e: RallypointError) -> Any:
    """A re-sent ``delivery.complete_next`` refused because its first sending settled
    the task (the settle half judged as ``task_settled`` / ``task_requeued``): the
    receive half alone (``delivery.receive`` for the same run, queue, lease and wait),
    answered with the settled task as the first sending would have been. Deliveries
    the first sending's lost reply carried are not seen again: their leases end and
    the tasks are delivered again then (as for a re-sent receive)."""
    if op.settle == "complete":
        raw = await _task_settled(conn, op, e)
    elif op.settle == "retry":
        raw = await _task_requeued(conn, op, e)
    else:
        raw = None
    if raw is None:
        return None
    task = msgspec.msgpack.decode(raw, type=p.TaskView)
    try:
        got = await conn.call(p.Receive(mailbox=task.mailbox, scope_id=op.scope_id, lease_ms=op.lease_ms,
                                        wait_ms=op.wait_ms, max_messages=op.max_messages, holder=op.holder))
    except ScopeInactiveError as stop:
        return p.encoder.encode(p.CompleteNextView(task=None if op.brief else task, stopped=stop.code))
    deliveries = msgspec.msgpack.decode(got, type=p.ReceiveView).deliveries
    return p.encoder.encode(p.CompleteNextView(task=None if op.brief else task, deliveries=deliveries))


async def _run_completed(conn: Any, op: Any, e: RallypointError) -> Any:
    if isinstance(e, ConflictError):
        raw = await conn.call(p.ScopeStatus(scope_id=op.scope_id))
        if _scope_view.decode(raw).stored_state == "COMPLETED":
            return raw
    return None


async def _tasks_settled_answer(conn: Any, op: Any, raw: bytes) -> bytes:
    """A re-sent ``delivery.complete_many``: an item refused because the first sending
    already completed it (the task is SUCCEEDED with this item's outcome) is answered
    with the task, as the first sending would have been."""
    reply = msgspec.msgpack.decode(raw, type=p.SettledListView)
    changed = False
    for i, (item, res) in enumerate(zip(op.items, reply.items)):
        e = res.error
        if e is None or e.code not in ("STALE_CLAIM", "SCOPE_CANCELLED", "DEADLINE_EXCEEDED"):
            continue
        if e.code == "STALE_CLAIM" and (e.details or {}).get("state") not in ("SUCCEEDED", "ACKED"):
            continue
        try:
            st = await conn.call(p.TaskStatus(task_id=item.task_id))
        except RallypointError:
            continue
        v = _task_view.decode(st)
        if v.state in ("SUCCEEDED", "ACKED") and bytes(v.outcome) == bytes(item.outcome):
            reply.items[i] = p.SettledView(task=msgspec.msgpack.decode(st, type=p.TaskView))
            changed = True
    return p.encoder.encode(reply) if changed else raw


#: rule name -> (reconcile a refusal of the second sending, reconcile its answer): each
#: returns the first sending's answer, or None / the answer unchanged
RECONCILERS: dict[str, tuple[Callable | None, Callable | None]] = {
    "task_settled": (_task_settled, None),
    "tasks_settled": (None, _tasks_settled_answer),
    "task_requeued": (_task_requeued, None),
    "task_settled_next": (_task_settled_next, None),
    "run_completed": (_run_completed, None),
}


async def _reconcile(conn: Any, op: Any, e: RallypointError) -> Any:
    """``op`` was re-sent and refused: if the refusal shows that the first sending was
    applied, the reply it would have had (by the op's declared rule); else None (the
    refusal stands)."""
    fn = RECONCILERS.get(_op_table().reconcile_rule(op) or "", (None, None))[0]
    if fn is None:
        return None
    try:
        return await fn(conn, op, e)
    except RallypointError:
        return None


async def _reconcile_answer(conn: Any, op: Any, raw: bytes) -> bytes:
    """``op`` was re-sent and answered: the answer, with any part of it refused because
    the first sending applied it reconciled (by the op's declared rule)."""
    fn = RECONCILERS.get(_op_table().reconcile_rule(op) or "", (None, None))[1]
    return raw if fn is None else await fn(conn, op, raw)
