"""The SDK: the same handles over TCP and embedded.

``rs`` (a :class:`Client`) is what :func:`rallypoint.connect` and
:func:`rallypoint.open_embedded` yield. Handles (:class:`Run`, :class:`Mailbox`,
:class:`Ticket`, :class:`Delivery`, :class:`Group`) are cheap objects holding an id;
every method is one request (or, for waits longer than the server's 60 s limit, a few).

Units: durations are seconds (float) named ``timeout``, ``wait``, ``lease_seconds``,
``delay``; instants are aware ``datetime`` (or ISO 8601 strings). Errors are the
:mod:`rallypoint.errors` classes, raised the same way in both modes.

Over TCP the client reconnects after a dropped connection (see
:mod:`rallypoint.client.reconnect`): a call in flight at the drop is sent again when that
cannot apply it twice (reads, waits, receive, a delivery's settle calls, idempotent
writes, submissions with a ``key``), and otherwise raises UnavailableError (UNAVAILABLE)
with ``details["maybe_applied"] = True``. The methods below say which they are.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any, Iterable

import anyio
import msgspec

from .. import protocol as p
from ..errors import (
    LeaseLostError,
    ScopeInactiveError,
    UnavailableError,
    ValidationError,
    WaitTimeout,
)
from . import types as t

__all__ = ["Client", "Run", "Mailbox", "Ticket", "Delivery", "Group", "Scopes", "Mailboxes", "Events", "EventStream"]

_MAX_WAIT_S = 60.0
_payload_encoder = msgspec.msgpack.Encoder(order="sorted")
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def encode_payload(value: Any, field: str = "input") -> msgspec.Raw:
    """Encode a payload (any msgpack-able value) for the wire. Dict keys are sorted so
    that equal inputs encode to equal bytes (idempotency keys compare bytes)."""
    try:
        return msgspec.Raw(_payload_encoder.encode(value))
    except (TypeError, msgspec.EncodeError, OverflowError) as e:
        raise ValidationError(f"{field} is not msgpack-able: {e}", details={"field": field}) from None


def _iso(value: datetime | str | None, field: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValidationError(f"{field} must be a timezone-aware datetime", details={"field": field})
        return value.isoformat()
    raise ValidationError(f"{field} must be a datetime or an ISO 8601 string", details={"field": field})


_MAX_SECONDS = 10 * 365 * 24 * 3600  # ten years: anything longer is a mistake


def _ms(seconds: float | None, field: str) -> int:
    """Seconds (the API's unit) -> integer milliseconds (the wire's), or
    VALIDATION_FAILED naming ``field`` for a negative, NaN, infinite or absurd value."""
    if seconds is None:
        return 0
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= _MAX_SECONDS:
        raise ValidationError(
            f"{field} must be a number of seconds between 0 and {_MAX_SECONDS} (got {seconds!r})",
            details={"field": field},
        )
    return int(round(seconds * 1000))


def _id_of(x: Any, kind: str = "scope") -> str:
    if isinstance(x, str):
        return x
    i = getattr(x, "id", None)
    if isinstance(i, str):
        return i
    raise ValidationError(f"{kind} must be an id or a handle (got {x!r})", details={"field": kind})


def _mailbox_name(x: Any) -> str:
    if isinstance(x, str):
        return x
    n = getattr(x, "name", None)
    if isinstance(n, str):
        return n
    raise ValidationError(f"mailbox must be a name or a Mailbox handle (got {x!r})", details={"field": "mailbox"})


class Client:
    """The ``rs`` object. ``transport`` has ``call(op) -> Raw`` and ``call_many``."""

    def __init__(self, transport) -> None:
        self._transport = transport
        self.scopes = Scopes(self)
        self.mailboxes = Mailboxes(self)
        self.events = Events(self)

    async def _call(self, op: msgspec.Struct, reply_type: type):
        raw = await self._transport.call(op)
        dec = _decoders.get(reply_type)
        if dec is None:
            dec = _decoders[reply_type] = msgspec.msgpack.Decoder(reply_type)
        return dec.decode(raw)

    async def _call_many(self, ops: list, reply_type: type) -> list:
        """One batch frame; returns replies or RallypointError instances, in order."""
        dec = _decoders.get(reply_type)
        if dec is None:
            dec = _decoders[reply_type] = msgspec.msgpack.Decoder(reply_type)
        out = []
        for r in await self._transport.call_many(ops):
            out.append(r if isinstance(r, Exception) else dec.decode(r))
        return out

    async def _wait(self, make_op, reply_type: type, done, timeout: float | None, still) -> Any:
        """A server-side wait of any length: re-issue ``make_op(wait_ms)`` in chunks of
        at most 60 s (the server's limit) until ``done(reply)``; WaitTimeout with
        ``still(reply)`` as its message once ``timeout`` seconds passed (None: forever).
        Every reply goes through ``done`` (callers may keep it as their last status)."""
        remaining = math.inf if timeout is None else timeout
        while True:
            chunk = min(remaining, _MAX_WAIT_S)
            reply = await self._call(make_op(_ms(chunk, "timeout")), reply_type)
            if done(reply):
                return reply
            remaining -= chunk
            if remaining <= 0:
                raise WaitTimeout(still(reply))

    async def results(self, tickets: "Iterable[Ticket | str]", timeout: float | None = None) -> list[t.TaskInfo]:
        """Wait until every task is terminal; their infos in the given order.

        One batch frame per round (a server-side wait per task, answered as each
        finishes), so waiting for N tasks costs one round trip, not N. WaitTimeout
        (changing nothing) if some are still unfinished after ``timeout`` seconds."""
        ids = [_id_of(x, "task") for x in tickets]
        out: list[t.TaskInfo | None] = [None] * len(ids)
        remaining = math.inf if timeout is None else timeout
        while True:
            todo = [i for i, info in enumerate(out) if info is None or not info.finished]
            if not todo:
                return out  # type: ignore[return-value]
            chunk = min(remaining, _MAX_WAIT_S)
            ms = _ms(chunk, "timeout")
            replies = await self._call_many([p.TaskResult(task_id=ids[i], wait_ms=ms) for i in todo], t.TaskInfo)
            for i, r in zip(todo, replies):
                if isinstance(r, Exception):
                    raise r
                out[i] = r
            remaining -= chunk
            if remaining <= 0 and any(not out[i].finished for i in todo):
                raise WaitTimeout(f"{sum(not out[i].finished for i in todo)} of {len(ids)} tasks unfinished after {timeout} s")

    def scope(self, scope_id: str) -> "Run":
        """Re-attach to a run by id (no request is made)."""
        return Run(self, _id_of(scope_id))

    def mailbox(self, name: str) -> "Mailbox":
        """A handle on a mailbox by name (no request is made)."""
        return Mailbox(self, _mailbox_name(name))

    def task(self, task_id: str) -> "Ticket":
        return Ticket(self, _id_of(task_id, "task"))

    def group(self, group_id: str) -> "Group":
        return Group(self, _id_of(group_id, "group"))

    async def status(self) -> t.ServerInfo:
        """Server version, uptime (s), connections, runs and tasks by state, LSNs."""
        return await self._call(p.ServerStatus(), t.ServerInfo)

    async def overview(self, limit: int = 20) -> t.Overview:
        """What ``rallypoint top`` shows: the newest ``limit`` active runs, the work
        queues (``done``: tasks finished since the server started), the newest open
        groups, parked waits per kind, event positions. Read-only, for humans."""
        return await self._call(p.OpsOverview(limit=limit), t.Overview)


def _types_arg(types) -> list[str] | None:
    if types is None:
        return None
    if isinstance(types, str):
        types = [x for x in types.split(",") if x]
    return list(types)


def _aggregate_arg(aggregate) -> str | None:
    if aggregate is None or isinstance(aggregate, str):
        return aggregate
    i = getattr(aggregate, "id", None)
    if isinstance(i, str):
        return i
    raise ValidationError(f"aggregate must be 'kind:id', an id or a handle (got {aggregate!r})",
                          details={"field": "aggregate"})


_event_decoder = msgspec.msgpack.Decoder(t.Event)


class Events:
    """``rs.events``: the space's event stream (docs/events.md).

    Every state change is an event with a space-wide, strictly increasing ``seq``; a
    *cursor* is the ``seq`` of the last event you processed. Events are kept for the
    server's ``--retain-events``; a cursor older than that is CURSOR_EXPIRED."""

    def __init__(self, rs: Client) -> None:
        self._rs = rs

    async def list(self, cursor: int | None = None, limit: int = 100, *, types=None, scope=None,
                   aggregate=None) -> t.EventPage:
        """One page of events after ``cursor`` (None: from the oldest kept), oldest
        first, at most ``limit`` (1-10000). Filters: ``types`` (names or ``"task.*"``,
        a list or a comma-separated string), ``scope`` (a run or its id: events of it
        and every run below it), ``aggregate`` (``"task:tsk_…"``, an id or a handle).
        Continue with ``cursor=page.next_cursor``. CURSOR_EXPIRED, VALIDATION_FAILED."""
        return await self._rs._call(
            p.EventsList(cursor=cursor, limit=limit, types=_types_arg(types),
                         scope_id=None if scope is None else _id_of(scope), aggregate=_aggregate_arg(aggregate)),
            t.EventPage,
        )

    def watch(self, cursor: int | None = None, types=None, scope=None, aggregate=None, *, start: str = "oldest",
              buffer: int = 10_000) -> "EventStream":
        """Events after ``cursor`` as they happen, pushed by the server: an async
        iterator (use ``async with rs.events.watch(...) as stream: async for ev in
        stream``; ``stream.cursor`` is the seq of the last event it returned).

        ``cursor=None`` starts at the oldest event kept (``start="oldest"``) or at the
        newest (``start="now"``: only what happens from now on). Filters as
        :meth:`list`. ``buffer``: events held for a slow reader before the
        subscription is ended and re-opened from the cursor.

        It resumes by itself from its cursor -- every event exactly once, in order --
        after the server cut it off for being slow (SLOW_CONSUMER), after its own buffer
        filled, and (over TCP, with reconnection) after a dropped connection or a daemon
        restart. It raises CURSOR_EXPIRED when its position is no longer kept, and
        UnavailableError once the client gave up reconnecting."""
        if start not in ("oldest", "now"):
            raise ValidationError("start must be 'oldest' or 'now'", details={"field": "start"})
        return EventStream(self._rs, cursor, _types_arg(types), None if scope is None else _id_of(scope),
                           _aggregate_arg(aggregate), start, buffer)


class EventStream:
    """An open watch (see :meth:`Events.watch`). ``cursor``: the seq of the last event
    returned (None before the first); ``resumed``: how many times it re-subscribed."""

    def __init__(self, rs: Client, cursor, types, scope_id, aggregate, start: str, buffer: int) -> None:
        self._rs = rs
        self.cursor: int | None = cursor
        self._types = types
        self._scope_id = scope_id
        self._aggregate = aggregate
        self._start = start
        self._buffer = buffer
        self._sub = None
        self._batch: list = []
        self._pos = 0
        self._closed = False
        self.resumed = 0

    def __repr__(self) -> str:
        return f"EventStream(cursor={self.cursor!r})"

    async def _open(self) -> None:
        op = p.EventsWatch(cursor=self.cursor, start=self._start, types=self._types, scope_id=self._scope_id,
                           aggregate=self._aggregate)
        transport = self._rs._transport
        sub = await transport.subscribe(op, self._buffer)
        if self.cursor is None:
            # an explicit position from here on: a re-subscription continues, never restarts
            self.cursor = msgspec.msgpack.decode(sub.start, type=t.WatchStart).cursor
        self._sub = sub

    def __aiter__(self) -> "EventStream":
        return self

    async def __anext__(self) -> t.Event:
        from ..errors import SlowConsumerError

        while True:
            if self._pos < len(self._batch):
                e = self._batch[self._pos]
                self._pos += 1
                self.cursor = e.seq
                return e
            if self._closed:
                raise StopAsyncIteration
            if self._sub is None:
                try:
                    await self._open()
                except UnavailableError:
                    if getattr(self._rs._transport, "closed", True):
                        raise
                    await anyio.sleep(0.1)  # the transport is reconnecting: try again
                    continue
            try:
                raws = await self._sub.next_batch()
            except SlowConsumerError:
                self._sub = None  # cut off (server) or our own buffer filled: go on from our cursor
                self.resumed += 1
                continue
            except UnavailableError:
                self._sub = None
                if self._closed or getattr(self._rs._transport, "closed", True):
                    raise
                self.resumed += 1
                continue
            dec = _event_decoder.decode
            batch = []
            cursor = self.cursor if self.cursor is not None else -1
            for raw in raws:
                e = dec(raw)
                if e.seq > cursor:  # (never otherwise; a guard against a duplicate on resume)
                    batch.append(e)
            self._batch, self._pos = batch, 0

    async def next(self, timeout: float | None = None) -> t.Event:
        """The next event; WaitTimeout (changing nothing) after ``timeout`` seconds."""
        if timeout is None:
            return await self.__anext__()
        with anyio.move_on_after(timeout):
            return await self.__anext__()
        raise WaitTimeout(f"no event within {timeout} s (cursor {self.cursor})")

    async def aclose(self) -> None:
        """End the subscription (events already received and not returned are dropped)."""
        self._closed = True
        self._batch, self._pos = [], 0
        sub, self._sub = self._sub, None
        if sub is not None:
            sub.close()

    async def __aenter__(self) -> "EventStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class Scopes:
    def __init__(self, rs: Client) -> None:
        self._rs = rs

    async def create(
        self, name: str | None = None, deadline: datetime | str | None = None, child_limit: int = 1000
    ) -> "Run":
        """Create a root run. ``deadline``: aware datetime or ISO 8601, must be in the
        future (VALIDATION_FAILED). ``child_limit`` caps direct children (LIMIT_EXCEEDED).
        Not re-sent after a dropped connection (two creates make two runs):
        UnavailableError with ``details["maybe_applied"]``."""
        st = await self._rs._call(
            p.ScopeCreate(name=name, deadline=_iso(deadline, "deadline"), child_limit=child_limit), t.RunStatus
        )
        return Run(self._rs, st.id, st)

    async def list(
        self, parent: "Run | str | None" = None, *, roots_only: bool = False, state: str | None = None, limit: int = 100
    ) -> list[t.RunStatus]:
        reply = await self._rs._call(
            p.ScopeList(
                parent_id=None if parent is None else _id_of(parent), roots_only=roots_only, state=state, limit=limit
            ),
            t._RunList,
        )
        return reply.scopes


class Run:
    """A handle on a run (scope). ``id`` is ``scp_…``."""

    def __init__(self, rs: Client, scope_id: str, status: t.RunStatus | None = None) -> None:
        self._rs = rs
        self.id = scope_id
        self.last_status = status
        self.groups = Groups(rs, self)
        self.join_sets = JoinSets(rs, self)
        self.barriers = Barriers(rs, self)
        self.timers = Timers(rs, self)

    def __repr__(self) -> str:
        return f"Run({self.id!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Run) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    async def child(
        self, name: str | None = None, deadline: datetime | str | None = None, child_limit: int = 1000
    ) -> "Run":
        """A child run. SCOPE_CANCELLED / DEADLINE_EXCEEDED if this run is inactive,
        LIMIT_EXCEEDED past ``child_limit``. Not re-sent after a dropped connection
        (UnavailableError, ``details["maybe_applied"]``)."""
        st = await self._rs._call(
            p.ScopeCreate(parent_id=self.id, name=name, deadline=_iso(deadline, "deadline"), child_limit=child_limit),
            t.RunStatus,
        )
        return Run(self._rs, st.id, st)

    async def status(self) -> t.RunStatus:
        self.last_status = await self._rs._call(p.ScopeStatus(scope_id=self.id), t.RunStatus)
        return self.last_status

    async def cancel(self, reason: str | None = None) -> t.RunStatus:
        """Cancel this run and its subtree, in one step. Idempotent on a cancelled run;
        CONFLICT on a completed one."""
        self.last_status = await self._rs._call(p.ScopeCancel(scope_id=self.id, reason=reason), t.RunStatus)
        return self.last_status

    async def complete(self, timeout: float | None = None) -> t.RunStatus:
        """Record that the run finished normally (final; CONFLICT if already finished;
        after a dropped connection, a re-sent complete that finds the run COMPLETED
        returns its status).

        Open join sets are closed first, newest first, and the run completes only after
        their last child finished; this waits for that (WaitTimeout after ``timeout``
        seconds, the sets then stay closing and a later ``complete()`` finishes)."""
        def done(st: t.RunStatus) -> bool:
            self.last_status = st
            return st.stored_state == "COMPLETED"

        return await self._rs._wait(
            lambda ms: p.ScopeComplete(scope_id=self.id, wait_ms=ms), t.RunStatus, done, timeout,
            lambda st: f"run {self.id} is still waiting for join-set children after {timeout} s",
        )

    async def children(self, limit: int = 1000) -> list[t.RunStatus]:
        return await self._rs.scopes.list(self, limit=limit)

    def task(self, task_id: str) -> "Ticket":
        """Re-attach to a task by id."""
        return Ticket(self._rs, _id_of(task_id, "task"))


class Mailboxes:
    def __init__(self, rs: Client) -> None:
        self._rs = rs

    async def ensure(
        self, name: str, mode: str = "WORK", max_attempts: int = 5, backlog_limit: int | None = None
    ) -> "Mailbox":
        """Create the mailbox, or check it exists with these settings (CONFLICT naming
        the differing setting)."""
        info = await self._rs._call(
            p.MailboxEnsure(name=name, mode=mode, max_attempts=max_attempts, backlog_limit=backlog_limit),
            t.MailboxInfo,
        )
        return Mailbox(self._rs, info.name, info)

    async def get(self, name: str) -> "Mailbox":
        info = await self._rs._call(p.MailboxGet(name=name), t.MailboxInfo)
        return Mailbox(self._rs, info.name, info)

    async def list(self) -> list[t.MailboxInfo]:
        return (await self._rs._call(p.MailboxList(), t._MailboxList)).mailboxes


class Mailbox:
    """A handle on a mailbox (a durable work queue), by name."""

    def __init__(self, rs: Client, name: str, info: t.MailboxInfo | None = None) -> None:
        self._rs = rs
        self.name = name
        self.info = info

    def __repr__(self) -> str:
        return f"Mailbox({self.name!r})"

    async def status(self) -> t.MailboxInfo:
        self.info = await self._rs._call(p.MailboxGet(name=self.name), t.MailboxInfo)
        return self.info

    async def submit(
        self,
        input: Any = None,
        key: str | None = None,
        *,
        scope: "Run | str",
        deadline: datetime | str | None = None,
    ) -> "Ticket":
        """Submit a task to this mailbox, bound to ``scope``. With ``key``, idempotent
        within the run and mailbox (same input: the existing task; other input:
        CONFLICT). Refused on an inactive run; LIMIT_EXCEEDED (with retry_after) when the
        backlog is full.

        After a dropped connection a submit **with** a ``key`` is sent again (it returns
        the task the first one made, if it was applied); one **without** a key is not
        (it may have been applied): UnavailableError with ``details["maybe_applied"]``."""
        info = await self._rs._call(
            p.TaskSubmit(
                mailbox=self.name,
                scope_id=_id_of(scope),
                input=encode_payload(input),
                key=key,
                deadline=_iso(deadline, "deadline"),
            ),
            t.TaskInfo,
        )
        return Ticket(self._rs, info.id, info)

    async def submit_many(
        self, inputs: Iterable[Any], *, scope: "Run | str", keys: Iterable[str | None] | None = None,
        deadline: datetime | str | None = None,
    ) -> list["Ticket"]:
        """Submit several tasks in one request and one commit: all or none. ``keys``:
        one idempotency key (or None) per input. Re-sent after a dropped connection
        only if every input has a key (else UnavailableError, ``maybe_applied``)."""
        inputs = list(inputs)
        keys = list(keys) if keys is not None else [None] * len(inputs)
        if len(keys) != len(inputs):
            raise ValidationError("keys must have one entry per input", details={"field": "keys"})
        dl = _iso(deadline, "deadline")
        items = [
            p.SubmitItem(input=encode_payload(x, f"inputs[{i}]"), key=k, deadline=dl)
            for i, (x, k) in enumerate(zip(inputs, keys))
        ]
        reply = await self._rs._call(
            p.TaskSubmitMany(mailbox=self.name, scope_id=_id_of(scope), items=items), t._TaskList
        )
        return [Ticket(self._rs, i.id, i) for i in reply.tasks]

    async def complete_many(self, items: "Iterable[tuple[Delivery, Any]]") -> list:
        """Complete ``[(delivery, outcome), ...]`` in one batch frame; a TaskInfo or
        the error for each, in order (see :func:`complete_many`)."""
        return await complete_many(self._rs, items)

    async def receive(
        self,
        scope: "Run | str",
        lease_seconds: float = 30,
        wait: float = 20,
        max_messages: int = 1,
    ) -> "Delivery | list[Delivery] | None":
        """Lease the oldest eligible task(s) of ``scope`` and its descendants.

        Waits on the server up to ``wait`` seconds for work (re-issuing past 60 s).
        Returns a :class:`Delivery` or None when ``max_messages`` is 1, else a list
        (possibly empty). ``lease_seconds`` 5-600. Refused (SCOPE_CANCELLED /
        DEADLINE_EXCEEDED) when the run is inactive; NOT_FOUND for an unknown mailbox or
        run. Re-sent after a dropped connection (if the lost reply carried a lease, that
        task is delivered again once the lease runs out)."""
        sid = _id_of(scope)
        lease_ms = _ms(lease_seconds, "lease_seconds")
        remaining = wait if wait is not None else math.inf
        while True:
            chunk = min(remaining, _MAX_WAIT_S)
            reply = await self._rs._call(
                p.Receive(
                    mailbox=self.name,
                    scope_id=sid,
                    lease_ms=lease_ms,
                    wait_ms=_ms(chunk, "wait"),
                    max_messages=max_messages,
                ),
                t._ReceiveReply,
            )
            remaining -= chunk
            if reply.deliveries or remaining <= 0:
                break
        ds = [Delivery(self._rs, d, lease_seconds) for d in reply.deliveries]
        if max_messages == 1:
            return ds[0] if ds else None
        return ds


async def complete_many(rs: "Client", items: "Iterable[tuple[Delivery, Any]]") -> list:
    """Complete several deliveries in ONE batch frame: ``[(delivery, outcome), ...]`` ->
    a TaskInfo or the RallypointError (e.g. LeaseLostError) for each, in order. Marks
    the deliveries whose lease was lost."""
    items = list(items)
    ops = [
        p.DeliveryComplete(task_id=d.task_id, token=d.token, outcome=encode_payload(o, "outcome"))
        for d, o in items
    ]
    replies = await rs._call_many(ops, t.TaskInfo)
    for (d, _), r in zip(items, replies):
        if isinstance(r, (LeaseLostError, ScopeInactiveError)):
            d.lost = True
    return replies


class Ticket:
    """A handle on a task (``tsk_…``)."""

    def __init__(self, rs: Client, task_id: str, info: t.TaskInfo | None = None) -> None:
        self._rs = rs
        self.id = task_id
        self.info = info

    def __repr__(self) -> str:
        return f"Ticket({self.id!r})"

    async def status(self) -> t.TaskInfo:
        """The task's state now (no wait)."""
        self.info = await self._rs._call(p.TaskStatus(task_id=self.id), t.TaskInfo)
        return self.info

    async def result(self, timeout: float | None = None) -> t.TaskInfo:
        """Wait on the server until the task is terminal and return its
        ``{state, outcome, outcome_reason, attempt, …}``. Raises WaitTimeout (changing
        nothing) when ``timeout`` seconds pass first; ``None`` waits forever."""
        def done(info: t.TaskInfo) -> bool:
            self.info = info
            return info.finished

        return await self._rs._wait(
            lambda ms: p.TaskResult(task_id=self.id, wait_ms=ms), t.TaskInfo, done, timeout,
            lambda info: f"task {self.id} is still {info.state} after {timeout} s",
        )

    async def cancel(self) -> t.TaskInfo:
        """Cancel the task (no-op on a finished one); its lease holder loses the lease."""
        self.info = await self._rs._call(p.TaskCancel(task_id=self.id), t.TaskInfo)
        return self.info


class Delivery:
    """A leased delivery of a task. Every method carries the fencing ``token``; a stale
    one raises LeaseLostError (STALE_CLAIM). ``lost`` is set once the lease is known lost.

    ``renew``, ``complete``, ``retry`` and ``reject`` are re-sent after a dropped
    connection (the token makes a second one harmless); the lease survives a daemon
    restart shorter than it. A re-sent ``complete`` that finds its first one applied
    (the task SUCCEEDED with this outcome) returns the task, not STALE_CLAIM.
    """

    def __init__(self, rs: Client, info: t.DeliveryInfo, lease_seconds: float) -> None:
        self._rs = rs
        self.id = info.id
        self.task_id = info.task_id
        self.mailbox = info.mailbox
        self.scope_id = info.scope_id
        self.input = info.input
        self.attempt = info.attempt
        self.token = info.token
        self.lease_expires_at = info.lease_expires_at
        self.group_id = info.group_id
        #: the task's own run, if one was made (by an earlier attempt, or ``run()``)
        self.run_id = info.run_id
        self.lease_seconds = lease_seconds
        self.lost = False

    def __repr__(self) -> str:
        return f"Delivery(task_id={self.task_id!r}, token={self.token}, attempt={self.attempt})"

    async def _settle(self, op, reply_type):
        try:
            return await self._rs._call(op, reply_type)
        except (LeaseLostError, ScopeInactiveError):
            self.lost = True
            raise

    async def run(self) -> "Run":
        """The task's own run: a child of the task's run, made on first use and the
        same for every later call and attempt (``run_id``). Put the worker's own work in
        it -- join sets, tasks, timers, child runs -- and it ends with the task:

        - ``complete()`` closes its join sets (cancellable children cancelled in reverse
          submission order, non-cancellable ones awaited) and the task is SUCCEEDED only
          once they finished (meanwhile it is RUNNING with ``completing``), in one step
          with the run's completion (what else the run holds is cancelled then);
        - any other end of the task (reject, last retry, last lease expired, deadline,
          cancel, its run or group ending) cancels the run and everything in it in the
          same step.

        So whoever waits for the task never sees it finished while work it started is
        pending. The run cannot be cancelled or completed by itself (CONFLICT). Raises
        LeaseLostError (STALE_CLAIM) when this delivery's lease is not current,
        ScopeInactiveError when the task's run is inactive, LimitError when that run has
        ``child_limit`` children. Re-sent after a dropped connection (idempotent)."""
        st = await self._settle(p.DeliveryRun(task_id=self.task_id, token=self.token), t.RunStatus)
        self.run_id = st.id
        return Run(self._rs, st.id, st)

    async def renew(self, lease_seconds: float | None = None) -> datetime:
        """Extend the lease by ``lease_seconds`` (default: the receive's; 5-600) from now.
        Returns the new expiry (aware datetime). Raises LeaseLostError (STALE_CLAIM) when
        the lease is lost, ScopeInactiveError (SCOPE_CANCELLED / DEADLINE_EXCEEDED) when
        the run is inactive; both set ``lost``."""
        ls = self.lease_seconds if lease_seconds is None else lease_seconds
        r = await self._settle(
            p.DeliveryRenew(task_id=self.task_id, token=self.token, lease_ms=_ms(ls, "lease_seconds")), t._LeaseReply
        )
        self.lease_expires_at = r.lease_expires_at
        return r.lease_expires_at

    async def complete(self, outcome: Any = None) -> t.TaskInfo:
        """Record the outcome (any msgpack-able value, at most 64 KiB encoded) and return
        the task (SUCCEEDED; for a task with its own run that still has awaited
        children, RUNNING with ``completing`` -- see :meth:`run`: the outcome is recorded
        once they finished, with no further call). Exactly once: a later complete is LeaseLostError
        (STALE_CLAIM), as is one after the lease ran out; ScopeInactiveError
        (SCOPE_CANCELLED / DEADLINE_EXCEEDED) on an inactive run (both set ``lost``);
        ValidationError (VALIDATION_FAILED) for an outcome that cannot be encoded or is
        too large."""
        return await self._settle(
            p.DeliveryComplete(task_id=self.task_id, token=self.token, outcome=encode_payload(outcome, "outcome")),
            t.TaskInfo,
        )

    async def retry(self, error: Any = None, delay: float = 0) -> t.TaskInfo:
        """Give the task back for another attempt after ``delay`` seconds, with ``error``
        (a msgpack-able value) recorded; the task is QUEUED again, or FAILED after
        max_attempts. Returns the task. Answered even when the run is inactive or the
        task already finished (nothing changes then: the returned state says so).
        LeaseLostError (STALE_CLAIM) when the lease is lost."""
        return await self._settle(
            p.DeliveryRetry(
                task_id=self.task_id, token=self.token, error=encode_payload(error, "error"), delay_ms=_ms(delay, "delay")
            ),
            t.TaskInfo,
        )

    async def reject(self, error: Any = None) -> t.TaskInfo:
        """Fail the task for good (FAILED, reason ``rejected``)."""
        return await self._settle(
            p.DeliveryReject(task_id=self.task_id, token=self.token, error=encode_payload(error, "error")), t.TaskInfo
        )


class Groups:
    """``run.groups``: create task groups (gate run under this run by default)."""

    def __init__(self, rs: Client, run: Run) -> None:
        self._rs = rs
        self._run = run

    async def create(
        self,
        mailbox: "Mailbox | str",
        condition: str,
        threshold: int | None = None,
        expected_members: int | None = None,
        deadline: datetime | str | None = None,
        parent_scope_id: "Run | str | None" = None,
    ) -> "Group":
        """Create a group whose gate run is a child of ``parent_scope_id`` (default:
        this run). NOT_FOUND for a missing mailbox; VALIDATION_FAILED for a bad
        condition/threshold/expected_members."""
        st = await self._rs._call(
            p.GroupCreate(
                scope_id=self._run.id,
                mailbox=_mailbox_name(mailbox),
                condition=condition,
                threshold=threshold,
                expected_members=expected_members,
                deadline=_iso(deadline, "deadline"),
                parent_scope_id=None if parent_scope_id is None else _id_of(parent_scope_id),
            ),
            t.GroupStatus,
        )
        return Group(self._rs, st.id, st)

    def by_id(self, group_id: str) -> "Group":
        """Re-attach to a group (e.g. after a restart)."""
        return Group(self._rs, _id_of(group_id, "group"))


class Group:
    """A handle on a task group (``grp_…``). ``scope_id`` is its gate run, once known."""

    def __init__(self, rs: Client, group_id: str, status: t.GroupStatus | None = None) -> None:
        self._rs = rs
        self.id = group_id
        self.last_status = status
        self.scope_id = status.scope_id if status else None

    def __repr__(self) -> str:
        return f"Group({self.id!r})"

    async def submit(self, input: Any = None, key: str | None = None, *, deadline: datetime | str | None = None) -> Ticket:
        """Add a member task (in the gate run). CONFLICT once the group is closed, unless
        it is a resubmission of a member (same key and input), which returns it. Re-sent
        after a dropped connection only with a ``key`` (else UnavailableError,
        ``details["maybe_applied"]``)."""
        r = await self._rs._call(
            p.GroupSubmit(group_id=self.id, input=encode_payload(input), key=key, deadline=_iso(deadline, "deadline")),
            t._MemberAdded,
        )
        return Ticket(self._rs, r.task.id, r.task)

    async def join_task(self, task: "Ticket | str") -> Ticket:
        """Add an existing task as a member while the group is open."""
        r = await self._rs._call(p.GroupJoinTask(group_id=self.id, task_id=_id_of(task, "task")), t._MemberAdded)
        return Ticket(self._rs, r.task.id, r.task)

    async def accept(self, task: "Ticket | str") -> t.VerdictResult:
        """Accept a SUCCEEDED member (idempotent; CONFLICT if it was rejected). After
        finalization the verdict is recorded ``late`` and changes nothing."""
        return await self._rs._call(
            p.GroupVerdictOp(group_id=self.id, task_id=_id_of(task, "task"), verdict="ACCEPTED"), t.VerdictResult
        )

    async def reject(self, task: "Ticket | str") -> t.VerdictResult:
        """Reject a finished member (idempotent; CONFLICT if it was accepted)."""
        return await self._rs._call(
            p.GroupVerdictOp(group_id=self.id, task_id=_id_of(task, "task"), verdict="REJECTED"), t.VerdictResult
        )

    async def close(self) -> t.GroupDecision:
        """Seal membership and evaluate at once: ``{state, outcome, outcome_reason}``."""
        return await self._rs._call(p.GroupClose(group_id=self.id), t.GroupDecision)

    async def status(self) -> t.GroupStatus:
        st = await self._rs._call(p.GroupStatus(group_id=self.id), t.GroupStatus)
        self.last_status, self.scope_id = st, st.scope_id
        return st

    async def wait(self, timeout: float | None = None) -> t.GroupStatus:
        """Wait on the server for FINALIZED; WaitTimeout after ``timeout`` seconds."""
        def done(st: t.GroupStatus) -> bool:
            self.last_status, self.scope_id = st, st.scope_id
            return st.state == "FINALIZED"

        return await self._rs._wait(
            lambda ms: p.GroupWait(group_id=self.id, wait_ms=ms), t.GroupStatus, done, timeout,
            lambda st: f"group {self.id} is still {st.state} after {timeout} s",
        )


class JoinSets:
    """``run.join_sets``: create and re-attach join sets of this run."""

    def __init__(self, rs: Client, run: Run) -> None:
        self._rs = rs
        self._run = run

    async def create(self, name: str | None = None) -> "JoinSet":
        """A generated (``name=None``) or named set. Names: letters, digits, ``-`` and
        ``/``; used once per run, even after close (CONFLICT)."""
        st = await self._rs._call(p.JoinSetCreate(scope_id=self._run.id, name=name), t.JoinSetStatus)
        return JoinSet(self._rs, st.id, st)

    async def by_name(self, name: str, *, replay: bool = False) -> "JoinSet":
        """Re-attach to the set named ``name`` (NOT_FOUND if this run has none).

        ``replay=True``: the handle replays the set's log from step 0 -- each
        ``join_next`` / ``join_next_try`` is sent with the next step and answered what
        the first execution was answered there (NONDETERMINISM_DETECTED if it is another
        operation), then, past the log, live. For a client (or a task's next attempt)
        re-running the code that made those calls."""
        st = await self._rs._call(p.JoinSetGet(scope_id=self._run.id, name=name), t.JoinSetStatus)
        return JoinSet(self._rs, st.id, st, replay=replay)

    def by_id(self, joinset_id: str, *, replay: bool = False) -> "JoinSet":
        """A handle by id (no request); ``replay`` as for :meth:`by_name`."""
        return JoinSet(self._rs, _id_of(joinset_id, "join set"), replay=replay)


class JoinSet:
    """A handle on a join set (``jst_…``): children finish in any order; ``join_next``
    returns their results in completion order, positionally (the k-th consume is the
    k-th record, forever).

    Every answer of ``join_next`` / ``join_next_try`` -- a record, a probe's "nothing
    yet", JOIN_SET_EXHAUSTED, FUNCTION_MISMATCH -- is the next *step* of the set's
    journaled log; :attr:`next_step` is the step this handle's next answer will be
    (when known). A handle made with ``replay=True`` sends its calls at explicit steps
    from 0, so a re-run of the same code gets the same answers. A wait that times out
    (WaitTimeout) is not a step: code that must replay uses a delay child, not a
    ``timeout``, to race the clock."""

    def __init__(self, rs: Client, joinset_id: str, status: t.JoinSetStatus | None = None, *,
                 replay: bool = False) -> None:
        self._rs = rs
        self.id = joinset_id
        self.last_status = status
        self.last_id: str | None = None
        self._replay = replay
        # The index of the next record to consume and the step of the next answer, when
        # known (from a status or the last reply): lets a call cut off by a dropped
        # connection be re-sent at its position.
        self._next_index: int | None = status.consumed if status is not None and not replay else None
        self._next_step: int | None = 0 if replay else (status.steps if status is not None else None)

    def __repr__(self) -> str:
        return f"JoinSet({self.id!r})"

    @property
    def next_step(self) -> int | None:
        """The step of this handle's next answer, when known (None: call ``status()``)."""
        return self._next_step

    async def submit(
        self, mailbox: "Mailbox | str", input: Any = None, key: str | None = None, *, cancellable: bool = True,
        deadline: datetime | str | None = None,
    ) -> str:
        """Add a child task to ``mailbox`` in this set's run; returns its id (a task id).
        A refused submission (inactive run, bad input) adds nothing. Re-sent after a
        dropped connection only with a ``key`` (else UnavailableError,
        ``details["maybe_applied"]``)."""
        r = await self._rs._call(
            p.JoinSetSubmit(
                joinset_id=self.id, mailbox=_mailbox_name(mailbox), input=encode_payload(input), key=key,
                cancellable=cancellable, deadline=_iso(deadline, "deadline"),
            ),
            t._ChildAdded,
        )
        return r.child_id

    async def submit_delay(self, seconds: float | None = None, *, at: datetime | str | None = None) -> str:
        """Add a durable delay child (result ``None`` when it fires); returns its id."""
        r = await self._rs._call(
            p.JoinSetSubmitDelay(
                joinset_id=self.id,
                after_ms=None if seconds is None else _ms(seconds, "seconds"),
                at=_iso(at, "at"),
            ),
            t._ChildAdded,
        )
        return r.child_id

    def _track(self, step: int | None, index: int | None = None) -> None:
        if step is not None and (self._next_step is None or step + 1 > self._next_step):
            self._next_step = step + 1
        if index is not None and (self._next_index is None or index + 1 > self._next_index):
            self._next_index = index + 1

    def _result(self, r, type: Any = None) -> tuple[str, Any]:
        self.last_id = r.child_id
        self._track(r.step, r.index)
        if not r.ok:
            from ..errors import ChildError

            raise ChildError(
                f"child {r.child_id} of join set {self.id} ended {r.failure_kind}",
                details={"value": r.value, "failure_kind": r.failure_kind, "child_id": r.child_id, "index": r.index,
                         "closing": r.closing, "step": r.step},
            )
        value = r.value
        if type is not None:
            try:
                value = msgspec.convert(value, type)
            except msgspec.ValidationError as e:
                name = getattr(type, "__name__", repr(type))
                raise ValidationError(
                    f"record {r.index} of join set {self.id} (child {r.child_id}) does not decode as {name}: {e}; "
                    f"it was consumed: re-read it with join_next(index={r.index})",
                    details={"field": "type", "index": r.index, "child_id": r.child_id, "step": r.step},
                ) from None
        return r.child_id, value

    async def _ask(self, send, index: int | None, step: int | None):
        """``send(index, step)``; after a dropped connection, re-sent at the step (else
        the record index) this handle expected, when it knows it. Errors that are answers
        (JOIN_SET_EXHAUSTED, FUNCTION_MISMATCH) advance the handle's position too."""
        from ..errors import FunctionMismatchError, JoinSetExhaustedError

        if step is None and index is None and self._replay:
            step = self._next_step
        expected_step, expected_index = self._next_step, self._next_index
        try:
            try:
                return await send(index, step)
            except UnavailableError as e:
                if index is not None or step is not None or not (e.details or {}).get("maybe_applied"):
                    raise
                if expected_step is not None:
                    return await send(None, expected_step)
                if expected_index is not None:
                    return await send(expected_index, None)
                raise
        except (JoinSetExhaustedError, FunctionMismatchError) as e:
            d = e.details or {}
            self._track(d.get("step"), d.get("index") if isinstance(e, FunctionMismatchError) else None)
            raise

    async def join_next(
        self, timeout: float | None = None, *, index: int | None = None, step: int | None = None,
        mailbox: "Mailbox | str | None" = None, type: Any = None,
    ) -> tuple[str, Any]:
        """Consume the next completion record: returns ``(child_id, result)``; a delay's
        result is None. A failed child raises ChildError (``value``, ``failure_kind``) and
        still counts as consumed. JoinSetExhaustedError past the last child; WaitTimeout
        after ``timeout`` s (not a step: nothing changed).

        - ``index=k``: re-read record ``k`` (no step), or consume it if it is the next.
        - ``step=s``: replay: the answer the set's log holds at step ``s`` (the same
          call only: else NondeterminismError, NONDETERMINISM_DETECTED), or, at the end
          of the log, a live answer at that step. VALIDATION_FAILED past the end.
        - ``mailbox`` (typed await-next for a homogeneous set): the record must be a
          child task of that mailbox; a delay or another mailbox's task is consumed all
          the same and raises FunctionMismatchError (FUNCTION_MISMATCH, naming both).
          ``type``: decode the result into it (a msgspec type: Struct, dataclass, ...);
          a result that does not decode raises ValidationError (the record is consumed).

        Over a reconnecting client, a consume cut off by a dropped connection is sent
        again at the step (or record index) this handle expected, when it knows it (it
        was created, looked up by name, replays, or has answered or read its status
        before); else it raises UnavailableError (UNAVAILABLE,
        ``details["maybe_applied"]``): call ``status()`` and
        ``join_next(index=consumed - 1)`` to re-read what may have been consumed."""
        mbx = None if mailbox is None else _mailbox_name(mailbox)

        def send(idx, stp):
            return self._rs._wait(
                lambda ms: p.JoinNext(joinset_id=self.id, index=idx, step=stp, wait_ms=ms, mailbox=mbx),
                t._JoinNextReply, lambda r: r.status == "record", timeout,
                lambda r: f"join set {self.id}: no child finished within {timeout} s",
            )

        return self._result(await self._ask(send, index, step), type)

    async def join_next_try(
        self, *, step: int | None = None, mailbox: "Mailbox | str | None" = None, type: Any = None,
    ) -> tuple[str, Any] | None:
        """The next record at once, or None while children are pending. Every answer --
        None too -- is a journaled step (``step`` replays it, as for :meth:`join_next`);
        JoinSetExhaustedError when nothing is left; ``mailbox`` / ``type`` as for
        :meth:`join_next`. Re-sent after a dropped connection like :meth:`join_next`."""
        mbx = None if mailbox is None else _mailbox_name(mailbox)

        def send(idx, stp):
            return self._rs._call(
                p.JoinNext(joinset_id=self.id, index=idx, step=stp, try_only=True, mailbox=mbx), t._JoinNextReply
            )

        r = await self._ask(send, None, step)
        if r.status != "record":
            self._track(r.step)
            if self._next_index is None or r.index > self._next_index:
                self._next_index = r.index
            return None
        return self._result(r, type)

    async def close(self, timeout: float | None = None) -> t.JoinSetStatus:
        """Cancel unconsumed delays and cancellable children (reverse submission order),
        wait for the others, consume what is left. Never raises for a child's failure."""
        def done(st: t.JoinSetStatus) -> bool:
            self.last_status = st
            return st.state == "CLOSED"

        return await self._rs._wait(
            lambda ms: p.JoinSetClose(joinset_id=self.id, wait_ms=ms), t.JoinSetStatus, done, timeout,
            lambda st: f"join set {self.id} is still closing after {timeout} s",
        )

    async def status(self) -> t.JoinSetStatus:
        """The set: state, counts (submitted, finished, consumed, ``steps``), children.
        (A replaying handle keeps its own position.)"""
        self.last_status = await self._rs._call(p.JoinSetGet(joinset_id=self.id), t.JoinSetStatus)
        if not self._replay:
            self._next_index = self.last_status.consumed
            self._next_step = self.last_status.steps
        return self.last_status


class Barriers:
    """``run.barriers``."""

    def __init__(self, rs: Client, run: Run) -> None:
        self._rs = rs
        self._run = run

    async def create(self, target: int) -> "Barrier":
        """A barrier that releases once ``target`` distinct keys arrived."""
        st = await self._rs._call(p.BarrierCreate(scope_id=self._run.id, target=target), t.BarrierStatus)
        return Barrier(self._rs, st.id, st)

    def get(self, barrier_id: str) -> "Barrier":
        """A handle by id (no request)."""
        return Barrier(self._rs, _id_of(barrier_id, "barrier"))


class Barrier:
    def __init__(self, rs: Client, barrier_id: str, status: t.BarrierStatus | None = None) -> None:
        self._rs = rs
        self.id = barrier_id
        self.last_status = status

    def __repr__(self) -> str:
        return f"Barrier({self.id!r})"

    async def arrive(self, key: str) -> t.BarrierStatus:
        """Arrive as ``key`` (idempotent per key within an epoch). BarrierReleasedError
        after the release; SCOPE_CANCELLED / DEADLINE_EXCEEDED once its run is inactive."""
        self.last_status = await self._rs._call(p.BarrierArrive(barrier_id=self.id, key=key), t.BarrierStatus)
        return self.last_status

    async def wait(self, timeout: float | None = 60) -> t.BarrierStatus:
        """Wait on the server for RELEASED (in the epoch current at the call, or a later
        one). BarrierCancelledError if cancelled; WaitTimeout after ``timeout`` s."""
        # Pin the epoch current at the call: a reply cannot tell it (the server returns
        # the status of the epoch it woke in, which is later if the barrier was reused).
        epoch = (await self.status()).epoch

        def done(st: t.BarrierStatus) -> bool:
            self.last_status = st
            return st.epoch > epoch or st.state == "RELEASED"

        return await self._rs._wait(
            lambda ms: p.BarrierWait(barrier_id=self.id, wait_ms=ms, epoch=epoch), t.BarrierStatus, done, timeout,
            lambda st: f"barrier {self.id} has {st.arrivals}/{st.target} arrivals after {timeout} s",
        )

    async def next_epoch(self) -> t.BarrierStatus:
        """Start a new epoch with no arrivals (the barrier must be RELEASED)."""
        self.last_status = await self._rs._call(p.BarrierNextEpochOp(barrier_id=self.id), t.BarrierStatus)
        return self.last_status

    async def status(self) -> t.BarrierStatus:
        self.last_status = await self._rs._call(p.BarrierStatus(barrier_id=self.id), t.BarrierStatus)
        return self.last_status


class Timers:
    """``run.timers``."""

    def __init__(self, rs: Client, run: Run) -> None:
        self._rs = rs
        self._run = run

    async def create(self, at: datetime | str | None = None, after_seconds: float | None = None) -> "Timer":
        """A durable timer firing at ``at`` or after ``after_seconds`` (exactly one)."""
        st = await self._rs._call(
            p.TimerCreate(
                scope_id=self._run.id, at=_iso(at, "at"),
                after_ms=None if after_seconds is None else _ms(after_seconds, "after_seconds"),
            ),
            t.TimerStatus,
        )
        return Timer(self._rs, st.id, st)

    def get(self, timer_id: str) -> "Timer":
        return Timer(self._rs, _id_of(timer_id, "timer"))


class Timer:
    def __init__(self, rs: Client, timer_id: str, status: t.TimerStatus | None = None) -> None:
        self._rs = rs
        self.id = timer_id
        self.last_status = status

    def __repr__(self) -> str:
        return f"Timer({self.id!r})"

    @property
    def fire_at(self) -> datetime | None:
        return self.last_status.fire_at if self.last_status else None

    async def wait(self, timeout: float | None = None) -> datetime:
        """Wait for the timer to fire and acknowledge it; returns ``fired_at``.
        ConflictError if it was cancelled; WaitTimeout after ``timeout`` s."""
        def done(st: t.TimerStatus) -> bool:
            self.last_status = st
            return st.fired_at is not None

        st = await self._rs._wait(
            lambda ms: p.TimerWait(timer_id=self.id, wait_ms=ms), t.TimerStatus, done, timeout,
            lambda st: f"timer {self.id} has not fired after {timeout} s",
        )
        return st.fired_at

    async def cancel(self) -> t.TimerStatus:
        """Disarm an armed timer (no-op if cancelled; CONFLICT if it already fired)."""
        self.last_status = await self._rs._call(p.TimerCancel(timer_id=self.id), t.TimerStatus)
        return self.last_status

    async def status(self) -> t.TimerStatus:
        self.last_status = await self._rs._call(p.TimerStatus(timer_id=self.id), t.TimerStatus)
        return self.last_status
