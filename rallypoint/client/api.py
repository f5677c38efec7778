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
import secrets
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any, AsyncIterator, Iterable

import anyio
import msgspec

from .. import protocol as p
from ..errors import (
    error_from_wire,
    RallypointError,
    ClaimHeldError,
    CapacityUnavailableError,
    ConflictError,
    LeaseLostError,
    ScopeInactiveError,
    UnavailableError,
    ValidationError,
    WaitTimeout,
)
from . import types as t

__all__ = [
    "Client", "Run", "Mailbox", "Ticket", "Delivery", "NextDeliveries", "Group", "Scopes", "Mailboxes", "Message",
    "Quotas", "Quota", "QuotaWaiter", "Budgets", "Budget", "Reservation", "Claims", "ClaimLease",
    "SpaceClaims", "Pools", "Pool", "RunPools", "Grant", "WorkLimits", "Events", "EventStream",
]

_MAX_WAIT_S = 60.0
_payload_encoder = msgspec.msgpack.Encoder(order="sorted")
_item_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {}
#: What the items of one request (and of its reply) may take, bytes: a frame (1 MiB)
#: less room for the envelope and the op's other fields -- the server sizes its replies
#: by the same budget (``actors/common.REPLY_BUDGET_BYTES``).
_FRAME_BUDGET = p.MAX_FRAME_BYTES - 4096
#: An upper bound of a task's view (``TaskInfo`` on the wire) apart from its payloads
#: and strings (the server's own bound, ``actors/queue.py``).
_TASK_VIEW_FIXED = 768


def _parts(sizes: list[int], budget: int = _FRAME_BUDGET) -> list[range]:
    """Consecutive index ranges whose ``sizes`` (bytes) add up to at most ``budget``
    (at least one index each)."""
    out: list[range] = []
    start, total = 0, 0
    for i, n in enumerate(sizes):
        if i > start and total + n > budget:
            out.append(range(start, i))
            start, total = i, 0
        total += n
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def encode_payload(value: Any, field: str = "input") -> msgspec.Raw:
    """Encode a payload (any msgpack-able value) for the wire. Dict keys are sorted so
    that equal inputs encode to equal bytes (idempotency keys compare bytes).
    VALIDATION_FAILED when it cannot be encoded, or is nested too deeply (the server
    takes about 900 levels)."""
    try:
        return msgspec.Raw(_payload_encoder.encode(value))
    except (TypeError, msgspec.EncodeError, OverflowError) as e:
        raise ValidationError(f"{field} is not msgpack-able: {e}", details={"field": field}) from None
    except RecursionError:
        raise ValidationError(f"{field} is nested too deeply to encode", details={"field": field}) from None


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


def _name_of(x: Any, kind: str) -> str:
    if isinstance(x, str):
        return x
    n = getattr(x, "name", None)
    if isinstance(n, str):
        return n
    raise ValidationError(f"{kind} must be a name or a handle (got {x!r})", details={"field": kind})


class Client:
    """The ``rs`` object. ``transport`` has ``call(op) -> Raw`` and ``call_many``."""

    def __init__(self, transport) -> None:
        self._transport = transport
        self.scopes = Scopes(self)
        self.mailboxes = Mailboxes(self)
        self.events = Events(self)
        self.quotas = Quotas(self)
        self.schedules = Schedules(self)
        self.budgets = Budgets(self)
        self.claims = SpaceClaims(self)
        self.pools = Pools(self)

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

    async def results(self, tickets: "Iterable[Ticket | str]", timeout: float | None = None, *,
                      details: bool = True) -> "list[t.TaskInfo] | list[t.TaskOutcome]":
        """Wait until every task is terminal; their infos in the given order.

        ONE request per round (``task.results``: one wait on the server for all of
        them, at most 1000 per request; more are split), so waiting for N tasks costs
        one round trip, not N. A reply holds what fits in one frame (1 MiB): when the
        outcomes (or views) are large, the rest of the round is fetched in pages right
        after it. ``details=False``: a :class:`TaskOutcome` per task (id, state,
        attempt, outcome, outcome reason, error) instead of its whole TaskInfo -- no
        input echoed back, cheaper on both ends. WaitTimeout (changing nothing) if some
        are still unfinished after ``timeout`` seconds."""
        ids = [_id_of(x, "task") for x in tickets]
        out: list = [None] * len(ids)
        remaining = math.inf if timeout is None else timeout
        reply_type, field = (t._TaskList, "tasks") if details else (t._TaskOutcomes, "outcomes")
        while True:
            todo = [i for i, info in enumerate(out) if info is None or not info.finished]
            if not todo:
                return out
            chunk = min(remaining, _MAX_WAIT_S)
            ms = _ms(chunk, "timeout")
            parts = [todo[k:k + 1000] for k in range(0, len(todo), 1000)]
            ops = [p.TaskResults(task_ids=[ids[i] for i in part], wait_ms=ms, brief=not details) for part in parts]
            replies = await (self._call_many(ops, reply_type) if len(ops) > 1 else self._call_one(ops[0], reply_type))
            for part, r in zip(parts, replies):
                if isinstance(r, Exception):
                    raise r
                got = getattr(r, field)
                for i, info in zip(part, got):
                    out[i] = info
                rest = part[len(got):]
                while rest:  # a page: the rest did not fit in the reply; the wait is over
                    got = getattr(await self._call(p.TaskResults(task_ids=[ids[i] for i in rest], wait_ms=0,
                                                                 brief=not details), reply_type), field)
                    for i, info in zip(rest, got):
                        out[i] = info
                    rest = rest[len(got):]
            remaining -= chunk
            if remaining <= 0 and any(not out[i].finished for i in todo):
                raise WaitTimeout(f"{sum(not out[i].finished for i in todo)} of {len(ids)} tasks unfinished after {timeout} s")

    async def _call_one(self, op, reply_type) -> list:
        return [await self._call(op, reply_type)]

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

    def message(self, message_id: str) -> "Message":
        """Re-attach to a message (``msg_…``) by id (no request is made)."""
        return Message(self, _id_of(message_id, "message"))

    def quota(self, name: str) -> "Quota":
        """A handle on a quota by name or id (no request is made)."""
        return Quota(self, _name_of(name, "quota"))

    def budget(self, name: str) -> "Budget":
        """A handle on a budget by name or id (no request is made)."""
        return Budget(self, _name_of(name, "budget"))

    def pool(self, name: str) -> "Pool":
        """A handle on a pool by name (no request is made)."""
        return Pool(self, _pool_name(name))

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
    server's ``--retain-events``; a cursor older than that is CURSOR_EXPIRED.

    In a cluster of several shards each shard numbers its own events: the cursor is then
    a string naming a position per shard (``"0:120,1:45,2:9"``, opaque: pass back what a
    stream or page gave), every shard is read and the answers merged, and each event
    says its ``shard`` (:mod:`rallypoint.client.shardevents`)."""

    def __init__(self, rs: Client) -> None:
        self._rs = rs

    def _sharded(self):
        """The router when the client talks to a cluster of several shards, else None."""
        tr = self._rs._transport
        return tr if getattr(tr, "sharded", False) and hasattr(tr, "event_shards") else None

    async def list(self, cursor: int | str | None = None, limit: int = 100, *, types=None, scope=None,
                   aggregate=None) -> t.EventPage:
        """One page of events after ``cursor`` (None: from the oldest kept), oldest
        first, at most ``limit`` (1-10000). Filters: ``types`` (names or ``"task.*"``,
        a list or a comma-separated string), ``scope`` (a run or its id: events of it
        and every run below it), ``aggregate`` (``"task:tsk_…"``, an id or a handle).
        Continue with ``cursor=page.next_cursor``. CURSOR_EXPIRED, VALIDATION_FAILED.

        Over several shards: ``cursor`` and ``page.next_cursor`` are vector strings, the
        page merges every shard's (a run's shard only, with ``scope``) by the events'
        instant then shard, and an error names the shard that gave it
        (``details["shard"]``)."""
        op = p.EventsList(cursor=None, limit=limit, types=_types_arg(types),
                          scope_id=None if scope is None else _id_of(scope), aggregate=_aggregate_arg(aggregate))
        router = self._sharded()
        if router is not None:
            from .shardevents import list_events

            if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 10_000:
                raise ValidationError(f"limit must be 1 to 10000 (got {limit!r})", details={"field": "limit"})
            return await list_events(router, op, cursor)
        if isinstance(cursor, str):
            cursor = _single_cursor(cursor)
        return await self._rs._call(msgspec.structs.replace(op, cursor=cursor), t.EventPage)

    def watch(self, cursor: int | str | None = None, types=None, scope=None, aggregate=None, *,
              start: str = "oldest", buffer: int = 10_000) -> "EventStream":
        """Events after ``cursor`` as they happen, pushed by the server: an async
        iterator (use ``async with rs.events.watch(...) as stream: async for ev in
        stream``; ``stream.cursor`` is where it resumes from: the seq of the last event
        it returned, or later once the server told it how far it scanned past events
        the filters skip -- so a filtered watch resumes near the newest event, not from
        its last match, which retention may have dropped meanwhile).

        ``cursor=None`` starts at the oldest event kept (``start="oldest"``) or at the
        newest (``start="now"``: only what happens from the moment the ``async with``
        block is entered -- the subscription is made there -- or, iterated without
        one, from its first iteration). Filters as
        :meth:`list`. ``buffer``: events held for a slow reader before the
        subscription is ended and re-opened from the cursor.

        It resumes by itself from its cursor -- every event exactly once, in order --
        after the server cut it off for being slow (SLOW_CONSUMER), after its own buffer
        filled, and (over TCP, with reconnection) after a dropped connection or a daemon
        restart. It raises CURSOR_EXPIRED when its position is no longer kept, and
        UnavailableError once the client gave up reconnecting.

        Over several shards it subscribes to every shard (a run's shard only, with
        ``scope``) and merges: ``stream.cursor`` is a vector string (``"0:120,1:45"``)
        that ``watch(cursor=...)`` takes back, each shard resumes exactly from its own
        position, events of one shard come in their order and those of several by
        instant then shard (docs/events.md), and CURSOR_EXPIRED names its shard."""
        if start not in ("oldest", "now"):
            raise ValidationError("start must be 'oldest' or 'now'", details={"field": "start"})
        op = p.EventsWatch(start=start, types=_types_arg(types), scope_id=None if scope is None else _id_of(scope),
                           aggregate=_aggregate_arg(aggregate))
        router = self._sharded()
        if router is not None:
            from .shardevents import MergedWatch

            return EventStream(self._rs, None, op, buffer, merged=MergedWatch(router, op, cursor, buffer))
        if isinstance(cursor, str):
            cursor = _single_cursor(cursor)
        return EventStream(self._rs, cursor, op, buffer)


def _single_cursor(cursor: str) -> int:
    """A cursor string for a single shard: its digits (a vector string names shards,
    which only a cluster of several has: VALIDATION_FAILED)."""
    text = cursor.strip()
    if text.isdigit():
        return int(text)
    raise ValidationError(f"cursor {cursor!r}: this server numbers its events with one sequence; a cursor is an "
                          "event's seq (an integer)", details={"field": "cursor"})


class EventStream:
    """An open watch (see :meth:`Events.watch`). ``cursor``: the position it resumes
    from -- the seq of the last event returned or, once every event it received was
    returned, the newest position the server scanned for it (``wire.Push.cursor``:
    past events its filters skip); over several shards, a vector string of those
    positions per shard (:class:`~rallypoint.client.shardevents.MergedWatch`); None
    before the subscription is made; ``resumed``: how many times it re-subscribed."""

    def __init__(self, rs: Client, cursor, op: p.EventsWatch, buffer: int, *, merged=None) -> None:
        self._rs = rs
        self._cursor: int | None = cursor
        self._op = op
        self._buffer = buffer
        self._merged = merged
        self._sub = None
        self._batch: list = []
        self._pos = 0
        self._batch_end: int | None = None  # the position the server scanned up to past the batch
        self._closed = False
        self._resumed = 0

    def __repr__(self) -> str:
        return f"EventStream(cursor={self.cursor!r})"

    @property
    def cursor(self) -> int | str | None:
        return self._merged.cursor if self._merged is not None else self._cursor

    @property
    def resumed(self) -> int:
        return self._merged.resumed if self._merged is not None else self._resumed

    async def _open(self) -> None:
        if self._merged is not None:
            await self._merged.open()
            return
        op = msgspec.structs.replace(self._op, cursor=self._cursor)
        transport = self._rs._transport
        sub = await transport.subscribe(op, self._buffer)
        if self._cursor is None:
            # an explicit position from here on: a re-subscription continues, never restarts
            self._cursor = msgspec.msgpack.decode(sub.start, type=t.WatchStart).cursor
        self._sub = sub

    def __aiter__(self) -> "EventStream":
        return self

    async def __anext__(self) -> t.Event:
        from ..errors import SlowConsumerError

        if self._merged is not None:
            return await self._merged.next()
        while True:
            if self._pos < len(self._batch):
                e = self._batch[self._pos]
                self._pos += 1
                self._cursor = e.seq
                end = self._batch_end
                if self._pos == len(self._batch) and end is not None and end > e.seq:
                    self._cursor = end  # the filter skipped what came after it
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
                self._resumed += 1
                continue
            except UnavailableError:
                self._sub = None
                if self._closed or getattr(self._rs._transport, "closed", True):
                    raise
                self._resumed += 1
                continue
            dec = _event_decoder.decode
            batch = []
            cursor = self._cursor if self._cursor is not None else -1
            for raw in raws:
                e = dec(raw)
                if e.seq > cursor:  # (never otherwise; a guard against a duplicate on resume)
                    batch.append(e)
            scanned = getattr(self._sub, "scanned", None)
            if not batch:
                if scanned is not None and scanned > cursor:
                    self._cursor = scanned  # nothing new passed the filter up to there
                continue
            self._batch, self._pos, self._batch_end = batch, 0, scanned

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
        if self._merged is not None:
            self._merged.close()
        sub, self._sub = self._sub, None
        if sub is not None:
            sub.close()

    async def __aenter__(self) -> "EventStream":
        # subscribe here, not at the first iteration: ``start="now"`` is the moment the
        # block is entered, so what the caller does next is seen (a watch that is
        # iterated without ``async with`` subscribes at its first ``__anext__``)
        if self._merged is not None:
            if not self._closed:
                await self._merged.open()
        elif self._sub is None and not self._closed:
            await self._open()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class Scopes:
    def __init__(self, rs: Client) -> None:
        self._rs = rs

    async def create(
        self, name: str | None = None, deadline: datetime | str | None = None, child_limit: int = 1000,
        *, priority: int | None = None,
    ) -> "Run":
        """Create a root run. ``deadline``: aware datetime or ISO 8601, must be in the
        future (VALIDATION_FAILED). ``child_limit`` caps direct children (LIMIT_EXCEEDED).
        ``priority`` (1 most urgent .. 5): the default priority of every task submitted
        under the run and its descendants (a task's own ``priority`` overrides it; a
        child run's own replaces it for its subtree); None: 3.
        Not re-sent after a dropped connection (two creates make two runs):
        UnavailableError with ``details["maybe_applied"]``."""
        st = await self._rs._call(
            p.ScopeCreate(name=name, deadline=_iso(deadline, "deadline"), child_limit=child_limit,
                          priority=priority), t.RunStatus
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
        self.claims = Claims(rs, self)
        self.pools = RunPools(rs, self)
        self.work_limits = WorkLimits(rs, self)

    def __repr__(self) -> str:
        return f"Run({self.id!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Run) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    async def child(
        self, name: str | None = None, deadline: datetime | str | None = None, child_limit: int = 1000,
        *, priority: int | None = None,
    ) -> "Run":
        """A child run. SCOPE_CANCELLED / DEADLINE_EXCEEDED if this run is inactive,
        LIMIT_EXCEEDED past ``child_limit``. ``priority``: as for ``scopes.create``
        (None: this run's default is inherited). Not re-sent after a dropped connection
        (UnavailableError, ``details["maybe_applied"]``)."""
        st = await self._rs._call(
            p.ScopeCreate(parent_id=self.id, name=name, deadline=_iso(deadline, "deadline"), child_limit=child_limit,
                          priority=priority),
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
        self, name: str, mode: str | None = None, max_attempts: int | None = None, backlog_limit: int | None = None,
        *, requirements: dict | None = None, aging_seconds: float | None = None, weights: dict[str, int] | None = None,
        rate_limits: dict[str, int] | None = None,
    ) -> "Mailbox":
        """Create the mailbox, or check it exists with the settings given (CONFLICT
        naming the differing one of ``mode``, ``max_attempts``, ``backlog_limit``).

        A setting left out (None) is not checked: ``ensure(name)`` on an existing
        mailbox takes it as it is (a producer only wants a handle, whatever its worker
        declared); a mailbox made here gets the defaults: ``mode="WORK"``,
        ``max_attempts=5``, no backlog limit.

        ``requirements``: the mailbox's *default requirements* (a WORK mailbox only), in
        the form :meth:`Mailbox.submit` takes -- ``{"pools": {"gpu": 1}, "budgets":
        {"model-spend": 40}}``: pool name -> units (at most 4 pools, each
        1..units_total), budget name -> minor units (at most 2, each 1..limit). Every
        task later submitted to the mailbox without requirements of its own (submit,
        submit_many, group and join-set submits) gets them, stored on the task when it
        is submitted: a worker declares what its tasks need once, and producers that do
        not repeat it are held to it too. A task's own requirements replace them (no
        merge). ``None`` (the default) leaves what the mailbox holds unchanged; given,
        they REPLACE it (never CONFLICT: a worker re-declares at every start, and a
        change takes effect for tasks submitted from then on; tasks already queued keep
        theirs); ``{}`` clears them. ``info.requirements`` shows what is stored (by
        name; None when nothing). VALIDATION_FAILED for a bad shape, the limits above,
        quota requirements, or requirements on an INBOX mailbox; NOT_FOUND for a pool or
        budget that does not exist (create those first).

        ``aging_seconds`` (issue 44): a waiting task gains one priority level per this
        many seconds (1 .. 604,800; 0 turns aging off); ``weights``: fairness key ->
        weight (1 .. 1000) of the mailbox's fair shares (over the tasks' own
        ``fair_weight``); ``rate_limits``: fairness key -> deliveries per second (1 ..
        100,000; ``"*"``: every key without its own), counted in fixed 1-second windows
        of server time -- a key at its limit is passed over (its turn and its tasks'
        places kept) until its next window, and a waiting receive is woken then. None
        leaves each as the mailbox has it; given, it replaces it."""
        given = {"mode": mode, "max_attempts": max_attempts, "backlog_limit": backlog_limit}
        checked = [k for k, v in given.items() if v is not None]
        info = await self._rs._call(
            p.MailboxEnsure(name=name, mode="WORK" if mode is None else mode,
                            max_attempts=5 if max_attempts is None else max_attempts, backlog_limit=backlog_limit,
                            requirements=_requirements(requirements),
                            aging_ms=None if aging_seconds is None else round(aging_seconds * 1000), weights=weights,
                            rate_limits=rate_limits,
                            checked=None if len(checked) == 3 else checked),  # (None: all, as before the field)
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
        requirements: dict | None = None,
        work_limit: str | None = None,
        priority: int | None = None,
        fair_key: str | None = None,
        fair_weight: int | None = None,
    ) -> "Ticket":
        """Submit a task to this mailbox, bound to ``scope``. With ``key``, idempotent
        within the run and mailbox (same input: the existing task; other input:
        CONFLICT). Refused on an inactive run; LIMIT_EXCEEDED (with retry_after) when the
        backlog is full.

        ``requirements`` (admission): ``{"pools": {"gpu": 2, ...}, "budgets":
        {"model-spend": 40}}`` -- pool name -> units (at most 4 pools; each
        1..units_total) and budget name -> minor units (at most 2 budgets; each 1..limit);
        VALIDATION_FAILED otherwise, NOT_FOUND for a pool or budget that does not exist.
        The task is handed out only when all of them can be taken in the same step; its
        delivery holds them (``delivery.grants``, ``delivery.reservations``) and gives
        them back when it ends (a reservation is settled in full if the task succeeded,
        voided otherwise, unless settled before). Without ``requirements`` (None or
        ``{}``) the task gets the mailbox's default requirements, if it has any
        (``mailboxes.ensure(..., requirements=)``). ``work_limit``: the name
        of a work limit of the run or an ancestor (``run.work_limits.ensure``);
        LIMIT_EXCEEDED while it has ``max_outstanding`` unfinished tasks.

        ``priority`` (1 most urgent .. 5; None: the run's default, else 3): a receive
        always gets the most urgent ready task, first in, first out within a priority;
        ``fair_key`` (1-128 characters: a tenant, an agent...): within a priority,
        deliveries go to the keys with ready tasks in proportion to their weights
        (``fair_weight`` 1 .. 1000, default 1; a weight the mailbox sets for the key wins).
        VALIDATION_FAILED outside those ranges.

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
                requirements=_requirements(requirements),
                work_limit=work_limit,
                priority=priority,
                fair_key=fair_key,
                fair_weight=fair_weight,
            ),
            t.TaskInfo,
        )
        return Ticket(self._rs, info.id, info)

    async def submit_many(
        self, inputs: Iterable[Any], *, scope: "Run | str", keys: Iterable[str | None] | None = None,
        deadline: datetime | str | None = None, requirements: dict | None = None, work_limit: str | None = None,
        details: bool = True, priority: int | None = None, fair_key: str | None = None,
        fair_weight: int | None = None,
    ) -> list["Ticket"]:
        """Submit several tasks in one request and one commit: all or none. ``keys``:
        one idempotency key (or None) per input; ``requirements``, ``work_limit``,
        ``priority``, ``fair_key`` and ``fair_weight`` (as for :meth:`submit`) apply to
        every task. ``details=False`` asks only for the
        ids (the tickets' ``info`` is then None; cheaper for the server and the client).
        Re-sent after a dropped connection only if every input has a key (else
        UnavailableError, ``maybe_applied``). An empty ``inputs`` submits nothing and
        returns ``[]`` without a request (as :meth:`complete_many` and
        ``rs.results`` do); more than 1,000 is VALIDATION_FAILED (one commit holds at
        most 1,000: split the batch yourself, each part is then all or none).

        **Large inputs.** A batch whose items (or, with ``details``, their views, which
        echo each input) do not fit in one frame (1 MiB) is sent as consecutive parts,
        each one request and one commit, all or none, in order. If a part is refused,
        the parts before it stay submitted: the error raised carries
        ``details["submitted"]``, how many of the leading inputs were. Give every input
        a ``key`` and sending the whole batch again is safe: the submitted ones are
        found by their keys, not made twice."""
        inputs = list(inputs)
        keys = list(keys) if keys is not None else [None] * len(inputs)
        if len(keys) != len(inputs):
            raise ValidationError("keys must have one entry per input", details={"field": "keys"})
        if not inputs:
            return []
        if len(inputs) > 1000:
            raise ValidationError("submit_many takes 1 to 1000 inputs (one commit holds at most 1,000): split "
                                  "the batch", details={"field": "inputs"})
        dl = _iso(deadline, "deadline")
        req = _requirements(requirements)
        items = [
            p.SubmitItem(input=encode_payload(x, f"inputs[{i}]"), key=k, deadline=dl, requirements=req,
                         priority=priority, fair_key=fair_key, fair_weight=fair_weight)
            for i, (x, k) in enumerate(zip(inputs, keys))
        ]
        sizes = [len(_item_encoder.encode(it)) + 8 for it in items]
        if details:  # the reply's views echo each input
            sizes = [max(n, _TASK_VIEW_FIXED + len(it.input) + 4 * len(it.key or ""))
                     for n, it in zip(sizes, items)]
        scope_id = _id_of(scope)
        tickets: list[Ticket] = []
        for part in _parts(sizes):
            op = p.TaskSubmitMany(mailbox=self.name, scope_id=scope_id, items=items[part.start:part.stop],
                                  work_limit=work_limit, brief=not details)
            try:
                if not details:
                    tickets += [Ticket(self._rs, i) for i in (await self._rs._call(op, t._TaskIds)).ids]
                    continue
                reply = await self._rs._call(op, t._TaskList)
            except RallypointError as e:
                if tickets:  # the parts before this one were applied
                    e.details = {**(e.details or {}), "submitted": len(tickets)}
                raise
            if reply.ids:  # the views did not all fit in the reply: the leading ones did
                infos = list(reply.tasks) + await _task_infos(self._rs, reply.ids[len(reply.tasks):])
                tickets += [Ticket(self._rs, info.id, info) for info in infos]
            else:
                tickets += [Ticket(self._rs, i.id, i) for i in reply.tasks]
        return tickets

    async def send(
        self,
        payload: Any = None,
        *,
        scope: "Run | str",
        key: str | None = None,
        deadline: datetime | str | None = None,
    ) -> "Message":
        """Send a plain message into this INBOX mailbox (``ensure(name, mode="INBOX")``),
        bound to ``scope``. Receivers take it with :meth:`receive` (or ``consume``) and
        renew, complete (ACKED), retry or reject it like a task delivery, with the same
        fencing tokens and leases. ``payload``: any msgpack-able value, at most 64 KiB.

        With ``key``, idempotent within the run and mailbox (same payload: the existing
        message; another payload: CONFLICT); sent again after a dropped connection only
        with a ``key`` (else UnavailableError, ``details["maybe_applied"]``).
        Errors: CONFLICT (a WORK mailbox), SCOPE_CANCELLED / DEADLINE_EXCEEDED (the run
        is inactive), LIMIT_EXCEEDED (backlog full), NOT_FOUND, VALIDATION_FAILED."""
        info = await self._rs._call(
            p.MessageSend(mailbox=self.name, scope_id=_id_of(scope), payload=encode_payload(payload, "payload"),
                          key=key, deadline=_iso(deadline, "deadline")),
            t.MessageInfo,
        )
        return Message(self._rs, info.id, info)

    async def complete_many(self, items: "Iterable[tuple[Delivery, Any]]", *, details: bool = True) -> list:
        """Complete ``[(delivery, outcome), ...]``: one request per run; a TaskInfo (None
        with ``details=False``) or the error for each, in order (see :func:`complete_many`)."""
        return await complete_many(self._rs, items, details=details)

    async def complete_many_and_next(self, items: "Iterable[tuple[Delivery, Any]]", *,
                                     scope: "Run | str | None" = None, max_messages: int = 1,
                                     lease_seconds: float | None = None, wait: float = 0,
                                     holder: str | None = None) -> "tuple[list, NextDeliveries]":
        """Complete ``[(delivery, outcome), ...]`` and receive the next deliveries in one
        round trip (see :func:`complete_many_and_next`)."""
        return await complete_many_and_next(self._rs, items, scope=scope, max_messages=max_messages,
                                            lease_seconds=lease_seconds, wait=wait, holder=holder)

    async def receive(
        self,
        scope: "Run | str",
        lease_seconds: float = 30,
        wait: float = 20,
        max_messages: int = 1,
        *,
        holder: str | None = None,
    ) -> "Delivery | list[Delivery] | None":
        """Lease the oldest eligible task(s) of ``scope`` and its descendants.

        Waits on the server up to ``wait`` seconds for work (re-issuing past 60 s).
        Returns a :class:`Delivery` or None when ``max_messages`` is 1, else a list
        (possibly empty). ``lease_seconds`` 5-600. ``holder``: this worker's name
        (1-128 characters), recorded with each delivery (``delivery.holder``, the
        task's views, the ``task.delivered`` event); None: the server records the
        connection's ``client_name@host:port``. Refused (SCOPE_CANCELLED /
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
                    holder=holder,
                ),
                t._ReceiveReply,
            )
            remaining -= chunk
            if reply.deliveries or remaining <= 0:
                break
        ds = [Delivery(self._rs, d, lease_seconds, received_for=sid) for d in reply.deliveries]
        if max_messages == 1:
            return ds[0] if ds else None
        return ds

    async def admit(self, scope: "Run | str", lease_seconds: float = 30, wait: float = 0, *,
                    holder: str | None = None) -> "Delivery | None":
        """Admission (runstate's ``mailbox.admit``): lease the oldest *eligible* task of
        ``scope`` and its descendants -- one whose requirements can all be taken now --
        together with its requirements, in one step. Returns the :class:`Delivery`
        (``delivery.grants``: the pool grants it holds until it ends) or None when
        nothing could be admitted within ``wait`` seconds. A shortage of pool units is
        not an error: the task waits its turn. The lease is not renewed for you (call
        ``delivery.renew()``, or use :func:`rallypoint.consume`, which does). ``holder``
        and errors as :meth:`receive`."""
        return await self.receive(scope, lease_seconds=lease_seconds, wait=wait, max_messages=1, holder=holder)


async def complete_many(rs: "Client", items: "Iterable[tuple[Delivery, Any]]", *, details: bool = True) -> list:
    """Complete several deliveries at once: ``[(delivery, outcome), ...]`` -> a TaskInfo
    (None with ``details=False``: cheaper when only refusals matter) or the
    RallypointError (e.g. LeaseLostError) for each, in order. ONE request per run
    (``delivery.complete_many``: one commit on the server; the requests of several runs
    go in one batch frame) -- more when the outcomes do not fit in one frame (1 MiB):
    then one per frame's worth, in order, each its own batch. Marks the deliveries whose
    lease was lost. Outcomes that cannot be encoded raise VALIDATION_FAILED before
    anything is sent."""
    items = list(items)
    by_run: dict[str, list[int]] = {}
    encoded = [encode_payload(o, "outcome") for _, o in items]
    for i, (d, _) in enumerate(items):
        by_run.setdefault(d.scope_id, []).append(i)
    groups = [by_run[r] for r in by_run]
    ops = []
    for g in groups:
        for k in range(0, len(g), 1000):
            run_part = g[k:k + 1000]
            for r in _parts([len(encoded[i]) + 96 for i in run_part]):
                part = run_part[r.start:r.stop]
                ops.append((part, p.DeliveryCompleteMany(items=[
                    p.CompleteItem(task_id=items[i][0].task_id, token=items[i][0].token, outcome=encoded[i])
                    for i in part
                ], brief=not details)))
    # one batch frame per frame's worth of requests
    sizes = [sum(len(encoded[i]) + 96 for i in part) + 64 for part, _ in ops]
    replies: list = []
    for r in _parts(sizes):
        replies += await rs._call_many([op for _, op in ops[r.start:r.stop]], t._SettledList)
    out: list = [None] * len(items)
    unseen: list[int] = []  # accepted without a view: the reply had no room for it
    for (part, _), reply in zip(ops, replies):
        if isinstance(reply, Exception):
            for i in part:
                out[i] = reply
            continue
        for i, r in zip(part, reply.items):
            if r.error is None:
                out[i] = r.task
                if details and r.task is None:
                    unseen.append(i)
            else:
                out[i] = error_from_wire(r.error.code, r.error.message, r.error.retry_after, r.error.details)
    if unseen:
        for i, info in zip(unseen, await _task_infos(rs, [items[i][0].task_id for i in unseen])):
            out[i] = info
    for (d, _), r in zip(items, out):
        if isinstance(r, (LeaseLostError, ScopeInactiveError)):
            d.lost = True
    return out


_settled_list_decode = msgspec.msgpack.Decoder(t._SettledList).decode
_complete_next_decode = msgspec.msgpack.Decoder(t._CompleteNext).decode


async def complete_many_and_next(rs: "Client", items: "Iterable[tuple[Delivery, Any]]", *,
                                 scope: "Run | str | None" = None, max_messages: int = 1,
                                 lease_seconds: float | None = None, wait: float = 0,
                                 holder: str | None = None) -> "tuple[list, NextDeliveries]":
    """Complete a batch of deliveries and receive the next ones in ONE round trip:
    ``[(delivery, outcome), ...]`` -> ``(answers, next)``. ``answers``: per item,
    None (completed) or the RallypointError that refused it, in order; ``next``: a
    :class:`NextDeliveries` of up to ``max_messages`` (1-100) new deliveries of the
    last item's mailbox for ``scope`` (default: the run the last delivery was
    received for), waiting up to ``wait`` seconds on the server when none is ready.

    One batch frame: a ``delivery.complete_many`` of all items but the last
    (brief) and a ``delivery.complete_next`` of the last, on the same run's actor,
    in that order (one fsync round for both). When the last item's complete is
    refused (STALE_CLAIM, SCOPE_CANCELLED...), nothing is received (``next`` is
    empty). Items of several runs, or outcomes past one frame, go as
    :func:`complete_many` first and the last item alone with
    :meth:`Delivery.complete_and_next`. VALIDATION_FAILED for no items or an
    outcome that cannot be encoded (before anything is sent)."""
    items = list(items)
    if not items:
        raise ValidationError("complete_many_and_next takes 1 or more (delivery, outcome) items",
                              details={"field": "items"})
    encoded = [encode_payload(o, "outcome") for _, o in items]
    last, rest = items[-1][0], items[:-1]
    same_run = all(d.scope_id == last.scope_id for d, _ in rest)
    if not same_run or len(rest) > 1000 or sum(len(e) + 96 for e in encoded) + 512 > _FRAME_BUDGET:
        out = await complete_many(rs, [(d, e) for (d, _), e in zip(rest, encoded)], details=False) if rest else []
        out = [r if isinstance(r, Exception) else None for r in out]
        try:
            nxt = await last.complete_and_next(encoded[-1], scope=scope, max_messages=max_messages,
                                               lease_seconds=lease_seconds, wait=wait, holder=holder,
                                               details=False)
        except RallypointError as e:
            return out + [e], NextDeliveries([], None, None)
        return out + [None], nxt
    sid = _id_of(scope) if scope is not None else last.received_for
    ls = last.lease_seconds if lease_seconds is None else lease_seconds
    chunk = min(wait if wait is not None else math.inf, _MAX_WAIT_S)
    ops: list = []
    if rest:
        ops.append(p.DeliveryCompleteMany(items=[p.CompleteItem(task_id=d.task_id, token=d.token, outcome=e)
                                                 for (d, _), e in zip(rest, encoded)], brief=True))
    ops.append(p.DeliveryCompleteNext(task_id=last.task_id, token=last.token, scope_id=sid, outcome=encoded[-1],
                                      lease_ms=_ms(ls, "lease_seconds"), wait_ms=_ms(chunk, "wait"),
                                      max_messages=max_messages, holder=holder, brief=True))
    replies = await rs._transport.call_many(ops)
    out: list = []
    if rest:
        r = replies[0]
        if isinstance(r, Exception):
            out = [r] * len(rest)
        else:
            out = [None if x.error is None else
                   error_from_wire(x.error.code, x.error.message, x.error.retry_after, x.error.details)
                   for x in _settled_list_decode(r).items]
    r = replies[-1]
    if isinstance(r, Exception):
        out.append(r)
        nxt = NextDeliveries([], None, None)
    else:
        v = _complete_next_decode(r)
        out.append(None)
        nxt = NextDeliveries([Delivery(rs, d, ls, received_for=sid) for d in v.deliveries], None, v.stopped)
        if not nxt and v.stopped is None and wait is not None and wait > chunk:  # the rest of a long wait
            more = await Mailbox(rs, last.mailbox).receive(sid, lease_seconds=ls, wait=wait - chunk,
                                                           max_messages=max_messages, holder=holder)
            nxt = NextDeliveries(more if isinstance(more, list) else ([more] if more else []), None, None)
    for (d, _), r in zip(items, out):
        if isinstance(r, (LeaseLostError, ScopeInactiveError)):
            d.lost = True
    return out, nxt


async def _task_infos(rs: "Client", task_ids: list[str]) -> list:
    """The TaskInfo of each task now (no wait), in order: ``task.results`` pages of as
    many as fit in a frame."""
    out: list = []
    while len(out) < len(task_ids):
        rest = task_ids[len(out):len(out) + 1000]
        out += (await rs._call(p.TaskResults(task_ids=rest, wait_ms=0), t._TaskList)).tasks
    return out


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

    async def set_priority(self, priority: int) -> t.TaskInfo:
        """Change the QUEUED task's priority (1 most urgent .. 5): it moves to that level at
        once (in submission order there). CONFLICT once it is running or finished;
        VALIDATION_FAILED outside 1..5."""
        self.info = await self._rs._call(p.TaskSetPriority(task_id=self.id, priority=priority), t.TaskInfo)
        return self.info

    async def cancel(self) -> t.TaskInfo:
        """Cancel the task (no-op on a finished one); its lease holder loses the lease."""
        self.info = await self._rs._call(p.TaskCancel(task_id=self.id), t.TaskInfo)
        return self.info


class NextDeliveries(list):
    """What :meth:`Delivery.complete_and_next` (and ``retry_and_next``,
    ``reject_and_next``) return: the new :class:`Delivery` handles (a list, possibly
    empty), with ``task``: the settled task (TaskInfo; None when asked without
    details) and ``stopped``: None, or SCOPE_CANCELLED / DEADLINE_EXCEEDED when the run
    stopped while the receive half waited (the settle was recorded)."""

    def __init__(self, deliveries: "Iterable[Delivery]", task: "t.TaskInfo | None", stopped: str | None) -> None:
        super().__init__(deliveries)
        self.task = task
        self.stopped = stopped


class Delivery:
    """A leased delivery of a task. Every method carries the fencing ``token``; a stale
    one raises LeaseLostError (STALE_CLAIM). ``lost`` is set once the lease is known lost.

    ``renew``, ``complete``, ``retry`` and ``reject`` are re-sent after a dropped
    connection (the token makes a second one harmless); the lease survives a daemon
    restart shorter than it. A re-sent ``complete`` that finds its first one applied
    (the task SUCCEEDED with this outcome) returns the task, not STALE_CLAIM.

    Attributes: ``task_id``, ``input`` (``payload``), ``attempt``, ``token``,
    ``lease_expires_at`` (aware datetime; moved by ``renew``), ``key`` (the task's
    idempotency key, None without one), ``mailbox``, ``scope_id``, ``group_id``,
    ``run_id``, ``grants`` and ``reservations`` (handles), ``info`` (the whole
    :class:`~rallypoint.client.types.DeliveryInfo` as received: every field of the
    delivery's view), ``lost``.
    """

    def __init__(self, rs: Client, info: t.DeliveryInfo, lease_seconds: float, *,
                 received_for: str | None = None) -> None:
        self._rs = rs
        #: the run the receive that leased it was for (the task's run or an ancestor):
        #: where :meth:`complete_and_next` receives by default
        self.received_for = received_for or info.scope_id
        #: the delivery as received (every field of its view)
        self.info = info
        self.id = info.id
        self.task_id = info.task_id
        self.mailbox = info.mailbox
        self.scope_id = info.scope_id
        self.input = info.input
        self.attempt = info.attempt
        self.token = info.token
        self.lease_expires_at = info.lease_expires_at
        self.group_id = info.group_id
        #: the task's idempotency key (``submit(..., key=)``), None when it has none
        self.key = info.key
        #: the task's own run, if one was made (by an earlier attempt, or ``run()``)
        self.run_id = info.run_id
        #: who received it, as the server recorded it (the receive's ``holder``, else
        #: the connection's ``client_name@host:port``)
        self.holder = info.holder
        #: the task's priority (1 most urgent .. 5) and fairness key (None: none)
        self.priority = info.priority
        self.fair_key = info.fair_key
        self.lease_seconds = lease_seconds
        self.lost = False
        #: pool grants this delivery holds (its task's requirements), given back when it ends
        self.grants = [Grant(rs, g, lease_seconds) for g in info.grants]
        #: budget reservations made for this delivery (its task's requirements): settle the
        #: real cost on them; what is left is settled in full if the task succeeds, else voided
        self.reservations = [Reservation(rs, rid) for rid in info.reservations]

    def __repr__(self) -> str:
        return f"Delivery(task_id={self.task_id!r}, token={self.token}, attempt={self.attempt})"

    @property
    def payload(self) -> Any:
        """The message's payload (the same as ``input``; for INBOX mailboxes)."""
        return self.input

    @property
    def message_id(self) -> str | None:
        """The message id (``msg_…``) when this delivers a message, else None."""
        return self.task_id if self.task_id.startswith("msg_") else None

    async def nack(self, retry: bool = True, error: Any = None, delay: float = 0) -> t.TaskInfo:
        """Give it back: ``retry=True`` is :meth:`retry` (delivered again after
        ``delay`` s, attempt + 1), ``retry=False`` is :meth:`reject` (FAILED)."""
        if retry:
            return await self.retry(error, delay=delay)
        return await self.reject(error)

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

    async def complete_and_next(self, outcome: Any = None, *, scope: "Run | str | None" = None,
                                max_messages: int = 1, lease_seconds: float | None = None, wait: float = 0,
                                holder: str | None = None, details: bool = True) -> "NextDeliveries":
        """Complete this delivery and receive the next deliveries of the same mailbox in
        ONE request (``delivery.complete_next``): the complete is judged and journaled
        exactly as :meth:`complete` (durable before the answer), then up to
        ``max_messages`` (1-100) ready tasks of ``scope`` (default: the run the receive
        that leased this was for; the task's run or an ancestor of it) are leased for
        ``lease_seconds`` (default: this delivery's) as :meth:`Mailbox.receive` leases
        them, waiting on the server up to ``wait`` seconds when none is ready
        (re-issuing plain receives past 60 s). ``holder`` as for receive.

        Returns :class:`NextDeliveries`: a list of the new deliveries (possibly empty),
        with ``task`` (the completed task's TaskInfo; None with ``details=False``) and
        ``stopped`` (SCOPE_CANCELLED / DEADLINE_EXCEEDED when the run stopped while it
        waited: the complete was recorded, nothing more comes). Raises as
        :meth:`complete` (LeaseLostError STALE_CLAIM, ScopeInactiveError; both set
        ``lost``; nothing is received then). Re-sent after a dropped connection: if
        the first sending was applied, the answer is the task as completed and the
        deliveries of a fresh receive (those the lost reply carried come back once
        their leases end)."""
        return await self._and_next("complete", encode_payload(outcome, "outcome"), None, 0, scope, max_messages,
                                    lease_seconds, wait, holder, details)

    async def retry_and_next(self, error: Any = None, delay: float = 0, *, scope: "Run | str | None" = None,
                             max_messages: int = 1, lease_seconds: float | None = None, wait: float = 0,
                             holder: str | None = None, details: bool = True) -> "NextDeliveries":
        """:meth:`retry` (after ``delay`` seconds, ``error`` recorded; FAILED after
        max_attempts) and the next deliveries in one request, as
        :meth:`complete_and_next`. Unlike a plain retry, a stopped run refuses it
        (ScopeInactiveError: nothing to retry, nothing to receive)."""
        return await self._and_next("retry", None, encode_payload(error, "error"), _ms(delay, "delay"), scope,
                                    max_messages, lease_seconds, wait, holder, details)

    async def reject_and_next(self, error: Any = None, *, scope: "Run | str | None" = None, max_messages: int = 1,
                              lease_seconds: float | None = None, wait: float = 0, holder: str | None = None,
                              details: bool = True) -> "NextDeliveries":
        """:meth:`reject` (FAILED, reason ``rejected``) and the next deliveries in one
        request, as :meth:`retry_and_next`."""
        return await self._and_next("reject", None, encode_payload(error, "error"), 0, scope, max_messages,
                                    lease_seconds, wait, holder, details)

    async def _and_next(self, settle: str, outcome, error, delay_ms: int, scope, max_messages: int,
                        lease_seconds: float | None, wait: float, holder: str | None,
                        details: bool) -> "NextDeliveries":
        sid = _id_of(scope) if scope is not None else self.received_for
        ls = self.lease_seconds if lease_seconds is None else lease_seconds
        lease_ms = _ms(ls, "lease_seconds")
        remaining = wait if wait is not None else math.inf
        chunk = min(remaining, _MAX_WAIT_S)
        reply = await self._settle(p.DeliveryCompleteNext(
            task_id=self.task_id, token=self.token, scope_id=sid, settle=settle,
            **({"outcome": outcome} if outcome is not None else {}), **({"error": error} if error is not None else {}),
            delay_ms=delay_ms, lease_ms=lease_ms, wait_ms=_ms(chunk, "wait"), max_messages=max_messages,
            holder=holder, brief=not details), t._CompleteNext)
        remaining -= chunk
        raw_ds = list(reply.deliveries)
        stopped = reply.stopped
        if not raw_ds and stopped is None and remaining > 0:  # a wait past one request's: plain receives
            try:
                more = await Mailbox(self._rs, self.mailbox).receive(sid, lease_seconds=ls, wait=remaining,
                                                                     max_messages=max_messages, holder=holder)
            except ScopeInactiveError as e:
                stopped = e.code
            else:
                return NextDeliveries(more if isinstance(more, list) else ([more] if more else []), reply.task,
                                      stopped)
        return NextDeliveries([Delivery(self._rs, d, ls, received_for=sid) for d in raw_ds], reply.task, stopped)

    async def release(self) -> t.TaskInfo:
        """Give the task back unfinished **without counting an attempt**: QUEUED again
        at once, at its place in FIFO order, with the same ``attempt`` (a worker that is
        stopping -- ``consume()`` on Ctrl-C -- hands back what it could not finish).
        Returns the task. Answered (changing nothing) when the run is inactive or the
        task already finished, like :meth:`retry`; LeaseLostError (STALE_CLAIM) when the
        lease is lost. Re-sent after a dropped connection (fenced by the token)."""
        return await self._settle(p.DeliveryRelease(task_id=self.task_id, token=self.token), t.TaskInfo)


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

    async def submit(self, input: Any = None, key: str | None = None, *, deadline: datetime | str | None = None,
                     requirements: dict | None = None) -> Ticket:
        """Add a member task (in the gate run). CONFLICT once the group is closed, unless
        it is a resubmission of a member (same key and input), which returns it. Re-sent
        after a dropped connection only with a ``key`` (else UnavailableError,
        ``details["maybe_applied"]``). ``requirements``: the member's own admission
        requirements, as :meth:`Mailbox.submit` takes them (``{"pools": {name: units},
        "budgets": {name: minor units}}``; VALIDATION_FAILED / NOT_FOUND as there);
        without them it gets the mailbox's default requirements
        (``mailboxes.ensure(..., requirements=)``)."""
        r = await self._rs._call(
            p.GroupSubmit(group_id=self.id, input=encode_payload(input), key=key, deadline=_iso(deadline, "deadline"),
                          requirements=_requirements(requirements)),
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
        deadline: datetime | str | None = None, requirements: dict | None = None,
    ) -> str:
        """Add a child task to ``mailbox`` in this set's run; returns its id (a task id).
        A refused submission (inactive run, bad input) adds nothing. Re-sent after a
        dropped connection only with a ``key`` (else UnavailableError,
        ``details["maybe_applied"]``). ``requirements``: the child's own admission
        requirements, as :meth:`Mailbox.submit` takes them; without them it gets the
        mailbox's default requirements (``mailboxes.ensure(..., requirements=)``)."""
        r = await self._rs._call(
            p.JoinSetSubmit(
                joinset_id=self.id, mailbox=_mailbox_name(mailbox), input=encode_payload(input), key=key,
                cancellable=cancellable, deadline=_iso(deadline, "deadline"),
                requirements=_requirements(requirements),
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
        #: the epoch this handle's last arrival counted in (None: it has not arrived)
        self.arrived_epoch: int | None = None

    def __repr__(self) -> str:
        return f"Barrier({self.id!r})"

    async def arrive(self, key: str, *, epoch: int | None = None) -> t.BarrierStatus:
        """Arrive as ``key`` (idempotent per key within an epoch) in ``epoch`` (None:
        the current one). Naming the epoch makes a reused barrier's loop race-free: an
        arrival for the next epoch while the current one is RELEASED is an *early
        arrival*, held and counted the moment ``next_epoch()`` starts that epoch
        (``status.next_keys`` lists them). BarrierReleasedError (BARRIER_RELEASED) after
        the release, or for an epoch that is over; ConflictError (CONFLICT) for an epoch
        not yet next; SCOPE_CANCELLED / DEADLINE_EXCEEDED once its run is inactive.
        :meth:`wait` then waits for the epoch of this arrival."""
        self.last_status = await self._rs._call(p.BarrierArrive(barrier_id=self.id, key=key, epoch=epoch),
                                                t.BarrierStatus)
        self.arrived_epoch = epoch if epoch is not None else self.last_status.epoch
        return self.last_status

    async def wait(self, timeout: float | None = 60, *, epoch: int | None = None) -> t.BarrierStatus:
        """Wait on the server for RELEASED in ``epoch`` (or once a later epoch began):
        by default the epoch of this handle's last :meth:`arrive` -- so a wait that
        starts after the barrier was released and reused still returns for the caller's
        own round -- else the epoch current at the call. BarrierCancelledError
        (BARRIER_CANCELLED, a ConflictError) once the barrier is cancelled (its run
        cancelled, completed or past its deadline); WaitTimeout after ``timeout`` s."""
        # Pin the epoch: a reply cannot tell it (the server returns the status of the
        # epoch it woke in, which is later if the barrier was reused).
        if epoch is None:
            epoch = self.arrived_epoch
        if epoch is None:
            epoch = (await self.status()).epoch

        def done(st: t.BarrierStatus) -> bool:
            self.last_status = st
            return st.epoch > epoch or (st.epoch == epoch and st.state == "RELEASED")

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
        TimerCancelledError (TIMER_CANCELLED, a ConflictError) if it was cancelled, or
        its run was cancelled, completed or passed its deadline; WaitTimeout after
        ``timeout`` s."""
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


# ---------------------------------------------------------------------------- messages


class Message:
    """A handle on a message of an INBOX mailbox (``msg_…``)."""

    def __init__(self, rs: Client, message_id: str, info: t.MessageInfo | None = None) -> None:
        self._rs = rs
        self.id = message_id
        self.info = info

    def __repr__(self) -> str:
        return f"Message({self.id!r})"

    async def status(self) -> t.MessageInfo:
        """The message now (readable forever, whatever its run's state)."""
        self.info = await self._rs._call(p.MessageStatus(message_id=self.id), t.MessageInfo)
        return self.info


# ---------------------------------------------------------------------------- quotas

_MAX_TTL_S = 86_400.0


# ============================================================================ schedules


def _opt_ms(seconds: float | None, field: str) -> int | None:
    return None if seconds is None else _ms(seconds, field)


def _schedule_fields(cron, every, offset, timezone, start, end, jitter, run_name, run_deadline, metadata,
                     mailbox, input, overlap, catchup_window, pause_on_failure, remaining_actions) -> dict:
    """The wire fields of a schedule's settings from the SDK's arguments (seconds ->
    ms, datetimes -> ISO); None entries are left out (update: unchanged)."""
    out = {
        "cron": [cron] if isinstance(cron, str) else (list(cron) if cron is not None else None),
        "interval_ms": _opt_ms(every, "every"),
        "offset_ms": _opt_ms(offset, "offset"),
        "timezone": timezone,
        "start": _iso(start, "start"),
        "end": _iso(end, "end"),
        "jitter_ms": _opt_ms(jitter, "jitter"),
        "run_name": run_name,
        "run_deadline_ms": _opt_ms(run_deadline, "run_deadline"),
        "metadata": dict(metadata) if metadata is not None else None,
        "mailbox": _name_of(mailbox, "mailbox") if mailbox is not None else None,
        "input": encode_payload(input) if input is not _UNSET and input is not None else None,
        "overlap": overlap,
        "catchup_window_ms": _opt_ms(catchup_window, "catchup_window"),
        "pause_on_failure": pause_on_failure,
        "remaining_actions": remaining_actions,
    }
    return {k: v for k, v in out.items() if v is not None}


_UNSET: Any = object()


class Schedules:
    """``rs.schedules``: recurring actions the server takes itself, exactly once per
    scheduled time (see :mod:`rallypoint.actors.schedule`)."""

    def __init__(self, rs: Client) -> None:
        self._rs = rs

    async def create(
        self, name: str, *, cron: str | list[str] | None = None, every: float | None = None, offset: float = 0,
        timezone: str = "UTC", start: datetime | str | None = None, end: datetime | str | None = None,
        jitter: float = 0, run_name: str = "{schedule} {time}", run_deadline: float | None = None,
        metadata: dict[str, str] | None = None, mailbox: "Mailbox | str | None" = None, input: Any = _UNSET,
        overlap: str = "skip", catchup_window: float = 60.0, pause_on_failure: bool = False,
        remaining_actions: int | None = None, paused: bool = False, note: str | None = None,
    ) -> "Schedule":
        """Create the schedule ``name`` (the same settings again return it; others are
        CONFLICT). When: ``cron`` (one expression or a list, read in ``timezone``) and/or
        ``every`` seconds shifted by ``offset`` seconds, within [``start``, ``end``], each
        fire delayed by a deterministic jitter below ``jitter`` seconds. What: a root run
        named by ``run_name`` ({schedule}, {time}, {local}) with a deadline
        ``run_deadline`` seconds after the fire and ``metadata``; with ``mailbox``, a task
        of ``input`` in it. Policies: ``overlap`` (skip, buffer_one, buffer_all,
        cancel_other, allow_all), ``catchup_window`` seconds, ``pause_on_failure``,
        ``remaining_actions``. Needs ``resource_config``. Raises ValidationError (bad
        cron, unknown time zone, end before start...), NotFoundError (mailbox),
        LimitError (the space's ``schedules`` limit)."""
        fields = _schedule_fields(cron if cron is not None else [], every, offset, timezone, start, end, jitter,
                                  run_name, run_deadline, metadata, mailbox, input, overlap, catchup_window,
                                  pause_on_failure, remaining_actions)
        info = await self._rs._call(p.ScheduleCreate(name=name, paused=paused, note=note, **fields), t.ScheduleInfo)
        return Schedule(self._rs, info.name, info)

    async def get(self, name: str) -> "Schedule":
        """The schedule ``name`` (or id); NotFoundError if there is none."""
        info = await self._rs._call(p.ScheduleGet(schedule=_name_of(name, "schedule")), t.ScheduleInfo)
        return Schedule(self._rs, info.name, info)

    async def list(self) -> list[t.ScheduleInfo]:
        """The space's schedules by name (each with its next fire and last action)."""
        return (await self._rs._call(p.ScheduleList(), t._ScheduleList)).schedules


class Schedule:
    """A handle on a schedule (by name)."""

    def __init__(self, rs: Client, name: str, info: t.ScheduleInfo | None = None) -> None:
        self._rs = rs
        self.name = name
        self.info = info

    def __repr__(self) -> str:
        return f"Schedule({self.name!r})"

    async def describe(self, next_n: int = 5, recent: int = 10) -> t.ScheduleInfo:
        """The settings, the next ``next_n`` fire times and the last ``recent`` actions
        (with their runs and outcomes), newest first."""
        self.info = await self._rs._call(p.ScheduleGet(schedule=self.name, next_n=next_n, recent=recent),
                                         t.ScheduleInfo)
        return self.info

    async def update(
        self, *, cron: str | list[str] | None = None, every: float | None = None, offset: float | None = None,
        timezone: str | None = None, start: datetime | str | None = None, end: datetime | str | None = None,
        jitter: float | None = None, run_name: str | None = None, run_deadline: float | None = None,
        metadata: dict[str, str] | None = None, mailbox: "Mailbox | str | None" = None, input: Any = _UNSET,
        overlap: str | None = None, catchup_window: float | None = None, pause_on_failure: bool | None = None,
        remaining_actions: int | None = None,
    ) -> t.ScheduleInfo:
        """Change the given settings (None: unchanged; ``every=0`` removes the interval,
        ``cron=[]`` the cron expressions, ``end=""`` the end, ``mailbox=""`` the task).
        The new spec counts from now. Raises as :meth:`Schedules.create`."""
        fields = _schedule_fields(cron, every, offset, timezone, start, end, jitter, run_name, run_deadline,
                                  metadata, mailbox, input, overlap, catchup_window, pause_on_failure,
                                  remaining_actions)
        self.info = await self._rs._call(p.ScheduleUpdate(schedule=self.name, **fields), t.ScheduleInfo)
        return self.info

    async def pause(self, note: str | None = None) -> t.ScheduleInfo:
        """Pause (idempotent): nothing fires until :meth:`unpause`."""
        self.info = await self._rs._call(p.SchedulePause(schedule=self.name, paused=True, note=note), t.ScheduleInfo)
        return self.info

    async def unpause(self, note: str | None = None) -> t.ScheduleInfo:
        """Unpause: the times that fell due while paused are recorded skipped (reason
        ``paused``); the next time of the spec fires."""
        self.info = await self._rs._call(p.SchedulePause(schedule=self.name, paused=False, note=note),
                                         t.ScheduleInfo)
        return self.info

    async def trigger(self, overlap: str | None = None) -> t.ScheduleInfo:
        """Take the action now (under ``overlap``, default the schedule's). Not re-sent
        after a dropped connection (it would fire again). ConflictError when no actions
        remain."""
        self.info = await self._rs._call(p.ScheduleTrigger(schedule=self.name, overlap=overlap), t.ScheduleInfo)
        return self.info

    async def backfill(self, start: datetime | str, end: datetime | str, overlap: str | None = None) -> t.ScheduleInfo:
        """Take the action for every time of the spec in [``start``, ``end``] (past) that
        has none yet (at most 10,000 times; safe to send again)."""
        self.info = await self._rs._call(
            p.ScheduleBackfill(schedule=self.name, start=_iso(start, "start"), end=_iso(end, "end"), overlap=overlap),
            t.ScheduleInfo)
        return self.info

    async def delete(self) -> t.ScheduleInfo:
        """Delete the schedule (its runs stay); returns its last view."""
        return await self._rs._call(p.ScheduleDelete(schedule=self.name), t.ScheduleInfo)


class Quotas:
    """``rs.quotas``: create, look up and list quotas (rate limits)."""

    def __init__(self, rs: Client) -> None:
        self._rs = rs

    async def ensure(self, name: str, units_limit: int, window_seconds: float) -> "Quota":
        """Create the quota -- at most ``units_limit`` units per fixed window of
        ``window_seconds`` (1 s to 1 day), windows aligned to their length -- or check it
        exists with these settings (CONFLICT naming the one that differs). Needs the
        ``resource_config`` permission."""
        info = await self._rs._call(
            p.QuotaEnsure(name=name, units_limit=units_limit, window_ms=_ms(window_seconds, "window_seconds")),
            t.QuotaInfo,
        )
        return Quota(self._rs, info.name, info)

    async def get(self, name: str) -> "Quota":
        """The quota ``name`` (or id); NOT_FOUND if there is none."""
        info = await self._rs._call(p.QuotaGet(quota=_name_of(name, "quota")), t.QuotaInfo)
        return Quota(self._rs, info.name, info)

    async def list(self) -> list[t.QuotaInfo]:
        return (await self._rs._call(p.QuotaList(), t._QuotaList)).quotas


class Quota:
    """A handle on a quota: ``units_limit`` units per fixed window, durable FIFO
    waiters, cooldowns (see :mod:`rallypoint.actors.quota`)."""

    def __init__(self, rs: Client, name: str, info: t.QuotaInfo | None = None) -> None:
        self._rs = rs
        self.name = name
        self.info = info

    def __repr__(self) -> str:
        return f"Quota({self.name!r})"

    async def status(self, waiters: bool = False) -> t.QuotaInfo:
        """Used and remaining units in the current window, waiters, cooldown;
        ``waiters=True`` also lists the WAITING waiters in line order."""
        self.info = await self._rs._call(p.QuotaGet(quota=self.name, waiters=waiters), t.QuotaInfo)
        return self.info

    async def take(
        self, units: int = 1, *, scope: "Run | str", wait: float = 0, holder: str | None = None
    ) -> t.QuotaTakeInfo:
        """Take ``units`` (1 to ``units_limit``) for run ``scope``; returns the grant
        (``consumption_id``: the units are taken, once).

        ``wait=0``: now or never: AllowanceExhaustedError (ALLOWANCE_EXHAUSTED: too few
        units left in this window, or waiters queued ahead -- first come, first served)
        or AllowanceCooldownError (ALLOWANCE_COOLDOWN), each with ``retry_after``. Not
        sent again after a dropped connection (UnavailableError, ``maybe_applied``).

        ``wait`` > 0 seconds: queues a durable waiter on the server (TTL ``wait``) and
        waits for its grant, which the quota's actor gives in line order as windows
        roll; WaitTimeout after ``wait`` seconds (the waiter is cancelled; a grant that
        raced the timeout is returned, not lost). The request carries a key, so it is
        safe to send again after a dropped connection, and a waiter that the server
        already GRANTED is never taken twice.

        Errors: SCOPE_CANCELLED / DEADLINE_EXCEEDED (the run is inactive, or ended while
        this waited), VALIDATION_FAILED (units), NOT_FOUND."""
        sid = _id_of(scope)
        if wait is None or wait <= 0:
            return await self._rs._call(
                p.QuotaTake(quota=self.name, scope_id=sid, units=units, holder=holder), t.QuotaTakeInfo
            )
        deadline = anyio.current_time() + wait
        reply = await self._register(units, sid, wait, holder, wait)
        try:
            while True:
                if reply.state == "GRANTED":
                    return reply
                if reply.state == "CANCELLED":
                    raise ConflictError(
                        f"quota waiter {reply.waiter_id} was cancelled ({reply.end_reason}) while this take waited",
                        details={"waiter_id": reply.waiter_id, "reason": reply.end_reason},
                    )
                left = deadline - anyio.current_time()
                if reply.state == "EXPIRED":
                    if left < 0.001:
                        break
                    reply = await self._register(units, sid, left, holder, left)  # TTL shorter than the wait
                    continue
                wait_ms = _ms(min(left, _MAX_WAIT_S), "wait") if left > 0 else 0
                if wait_ms <= 0:
                    break
                reply = await self._rs._call(p.QuotaWaiterWait(waiter_id=reply.waiter_id, wait_ms=wait_ms),
                                             t.QuotaTakeInfo)
        except BaseException:
            if reply.state == "WAITING":
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    try:
                        await self._rs._call(p.QuotaWaiterCancel(waiter_id=reply.waiter_id), t.QuotaTakeInfo)
                    except Exception:
                        pass
            raise
        if reply.state == "WAITING":
            reply = await self._rs._call(p.QuotaWaiterCancel(waiter_id=reply.waiter_id), t.QuotaTakeInfo)
            if reply.state == "GRANTED":  # granted while the cancel was on its way: it stands
                return reply
        raise WaitTimeout(
            f"quota {self.name!r}: {units} unit(s) not granted within {wait} s (waiter {reply.waiter_id} "
            "cancelled); nothing was taken"
        )

    async def _register(self, units: int, sid: str, ttl: float, holder: str | None, wait: float) -> t.QuotaTakeInfo:
        ttl_ms = min(max(_ms(math.ceil(ttl), "wait"), 1000), int(_MAX_TTL_S * 1000))
        return await self._rs._call(
            p.QuotaTake(quota=self.name, scope_id=sid, units=units, ttl_ms=ttl_ms,
                        wait_ms=_ms(min(wait, _MAX_WAIT_S), "wait"), key=secrets.token_hex(12), holder=holder),
            t.QuotaTakeInfo,
        )

    async def enqueue(
        self, units: int = 1, *, scope: "Run | str", ttl: float, key: str | None = None, holder: str | None = None
    ) -> "QuotaWaiter":
        """Register a durable waiter for ``units`` with a TTL of ``ttl`` seconds (1 s to
        1 day) without waiting for it: GRANTED at once if the units could be taken now
        (and nobody waits ahead), else WAITING until the quota's actor grants it in line
        order, or EXPIRED. ``key`` makes it idempotent per (quota, key). Refused on an
        inactive run."""
        info = await self._rs._call(
            p.QuotaTake(quota=self.name, scope_id=_id_of(scope), units=units, ttl_ms=_ms(ttl, "ttl"), key=key,
                        holder=holder),
            t.QuotaTakeInfo,
        )
        return QuotaWaiter(self._rs, info.waiter_id, info)

    def waiter(self, waiter_id: str) -> "QuotaWaiter":
        """Re-attach to a waiter by id (no request)."""
        return QuotaWaiter(self._rs, _id_of(waiter_id, "waiter"))

    async def cooldown(self, seconds: float, reason: str | None = None) -> t.QuotaInfo:
        """Grant nothing from this quota, to any run of the space, for ``seconds`` (a
        backoff the provider asked for; at most one day). Only ever extends a running
        cooldown; waiters stay queued and are served when it ends. Takes meanwhile
        raise AllowanceCooldownError (ALLOWANCE_COOLDOWN)."""
        self.info = await self._rs._call(
            p.QuotaCooldown(quota=self.name, cooldown_ms=max(1, _ms(seconds, "seconds")), reason=reason), t.QuotaInfo
        )
        return self.info


class QuotaWaiter:
    """A durable quota waiter (``qwt_…``): WAITING -> GRANTED | EXPIRED | CANCELLED."""

    def __init__(self, rs: Client, waiter_id: str, info: t.QuotaTakeInfo | None = None) -> None:
        self._rs = rs
        self.id = waiter_id
        self.info = info

    def __repr__(self) -> str:
        return f"QuotaWaiter({self.id!r})"

    async def status(self) -> t.QuotaTakeInfo:
        self.info = await self._rs._call(p.QuotaWaiterWait(waiter_id=self.id), t.QuotaTakeInfo)
        return self.info

    async def wait(self, timeout: float | None = None) -> t.QuotaTakeInfo:
        """Wait on the server until it is no longer WAITING; WaitTimeout after
        ``timeout`` seconds (the waiter stays queued). SCOPE_CANCELLED /
        DEADLINE_EXCEEDED if its run's end cancelled it."""
        def done(info: t.QuotaTakeInfo) -> bool:
            self.info = info
            return info.state != "WAITING"

        return await self._rs._wait(
            lambda ms: p.QuotaWaiterWait(waiter_id=self.id, wait_ms=ms), t.QuotaTakeInfo, done, timeout,
            lambda info: f"quota waiter {self.id} is still WAITING after {timeout} s",
        )

    async def cancel(self) -> t.QuotaTakeInfo:
        """Leave the line (CANCELLED). A waiter already GRANTED is returned as it is:
        its units are taken."""
        self.info = await self._rs._call(p.QuotaWaiterCancel(waiter_id=self.id), t.QuotaTakeInfo)
        return self.info


# ---------------------------------------------------------------------------- budgets


def _minor(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(
            f"{field} must be an integer number of minor units (at scale 2, 250 = 2.50), never a float "
            f"(got {value!r}); convert a decimal string with rallypoint.minor_units('2.50', scale=2)",
            details={"field": field},
        )
    return value


class Budgets:
    """``rs.budgets``: create, look up and list budgets."""

    def __init__(self, rs: Client) -> None:
        self._rs = rs

    async def ensure(self, name: str, *, limit: int, currency: str = "USD", scale: int = 2) -> "Budget":
        """Create the budget -- ``limit`` integer minor units of ``currency`` (3 capital
        letters) at ``scale`` decimal places -- or check it exists with these settings
        (CONFLICT naming the one that differs). ``limit=500, scale=2`` is 5.00."""
        info = await self._rs._call(
            p.BudgetEnsure(name=name, limit_minor=_minor(limit, "limit"), currency=currency, scale=scale),
            t.BudgetInfo,
        )
        return Budget(self._rs, info.name, info)

    async def get(self, name: str) -> "Budget":
        info = await self._rs._call(p.BudgetGet(budget=_name_of(name, "budget")), t.BudgetInfo)
        return Budget(self._rs, info.name, info)

    async def list(self) -> list[t.BudgetInfo]:
        return (await self._rs._call(p.BudgetList(), t._BudgetList)).budgets


class Budget:
    """A handle on a budget (amounts in integer minor units; see
    :mod:`rallypoint.actors.budget`)."""

    def __init__(self, rs: Client, name: str, info: t.BudgetInfo | None = None) -> None:
        self._rs = rs
        self.name = name
        self.info = info

    def __repr__(self) -> str:
        return f"Budget({self.name!r})"

    async def status(self, reservations: bool = False) -> t.BudgetInfo:
        """Limit, settled, reserved and available (minor units); ``reservations=True``
        also lists the open reservations."""
        self.info = await self._rs._call(p.BudgetGet(budget=self.name, reservations=reservations), t.BudgetInfo)
        return self.info

    async def reserve(
        self,
        amount: int,
        *,
        scope: "Run | str",
        settle_by: datetime | str | None = None,
        settle_within_seconds: float | None = None,
        key: str | None = None,
        holder: str | None = None,
        delivery: "Delivery | None" = None,
    ) -> "Reservation":
        """Hold ``amount`` minor units for run ``scope`` until settled or voided.

        ``settle_by`` (instant) or ``settle_within_seconds``: if still open then, the
        reservation is marked STALE -- never refunded by that; it holds its amount until
        settled or voided. ``key``: idempotent per (budget, key), and then safe to send
        again after a dropped connection (without one: UnavailableError,
        ``maybe_applied``). ``delivery``: hold it for that delivery (its current lease):
        when the delivery ends, what is not settled is settled in full if the task
        succeeded, voided otherwise.

        Errors: InsufficientBudgetError (INSUFFICIENT_BUDGET: ``details
        ["available_minor"]`` says what is left), SCOPE_CANCELLED / DEADLINE_EXCEEDED
        (the run is inactive), LeaseLostError (``delivery`` no longer holds its lease),
        VALIDATION_FAILED, NOT_FOUND, CONFLICT (``key`` reused otherwise)."""
        info = await self._rs._call(
            p.BudgetReserve(
                budget=self.name, scope_id=_id_of(scope), amount_minor=_minor(amount, "amount"),
                settle_by=_iso(settle_by, "settle_by"),
                settle_within_ms=None if settle_within_seconds is None else _ms(settle_within_seconds,
                                                                                "settle_within_seconds"),
                key=key, holder=holder,
                task_id=delivery.task_id if delivery is not None else None,
                token=delivery.token if delivery is not None else 0,
            ),
            t.ReservationInfo,
        )
        return Reservation(self._rs, info.id, info)

    def reservation(self, reservation_id: str) -> "Reservation":
        """Re-attach to a reservation by id (no request)."""
        return Reservation(self._rs, _id_of(reservation_id, "reservation"))


class Reservation:
    """A budget reservation (``rsv_…``): ACTIVE (or STALE) until settled or voided."""

    def __init__(self, rs: Client, reservation_id: str, info: t.ReservationInfo | None = None) -> None:
        self._rs = rs
        self.id = reservation_id
        self.info = info

    def __repr__(self) -> str:
        return f"Reservation({self.id!r})"

    async def settle(self, amount: int, usage_key: str | None = None, *, final: bool = True) -> t.SettleResult:
        """Charge ``amount`` minor units (the actual cost) under ``usage_key`` (default
        ``settle:<reservation id>``): idempotent per usage key -- the same key again
        returns the first settlement (``replayed``), so it is safe to send again after
        a dropped connection. The charge is capped at what is left (the reservation's
        remainder plus what the budget has unreserved; the rest is ``overrun``).
        ``final`` (default) closes the reservation and releases the remainder;
        ``final=False`` keeps holding it (give each partial settlement its own key).
        Allowed whatever the run's state. CONFLICT: the usage key was used otherwise."""
        r = await self._rs._call(
            p.BudgetSettle(reservation_id=self.id, amount_minor=_minor(amount, "amount"),
                           usage_key=usage_key if usage_key is not None else f"settle:{self.id}", final=final),
            t.SettleResult,
        )
        self.info = r.reservation
        return r

    async def void(self) -> t.ReservationInfo:
        """Close the reservation and release its remainder (VOIDED; what was settled
        stays spent). Idempotent; allowed whatever the run's state."""
        self.info = await self._rs._call(p.BudgetVoid(reservation_id=self.id), t.ReservationInfo)
        return self.info

    async def status(self) -> t.ReservationInfo:
        self.info = await self._rs._call(p.ReservationGet(reservation_id=self.id), t.ReservationInfo)
        return self.info


# ================================================================ requirements helpers


def _requirements(value: Any) -> "p.Requirements | None":
    """``{"pools": {"gpu": 2}}`` -> the wire Requirements (VALIDATION_FAILED naming the
    field for anything else)."""
    if value is None:
        return None
    if isinstance(value, p.Requirements):
        return value
    try:
        return msgspec.convert(value, p.Requirements)
    except msgspec.ValidationError as e:
        raise ValidationError(f"requirements: {e}", details={"field": "requirements"}) from None


def _pool_name(x: Any) -> str:
    if isinstance(x, str):
        return x
    n = getattr(x, "name", None)
    if isinstance(n, str):
        return n
    raise ValidationError(f"pool must be a name or a Pool handle (got {x!r})", details={"field": "pool"})


async def _queued_acquire(rs: Client, make_op, reply_type, wait: float, withdraw_op, what: str):
    """An acquire that may wait in the server's durable FIFO queue.

    One request id for the whole call (the server finds its lease or its waiter by it,
    so a re-sent request -- after a dropped connection, or to wait past the server's
    60 s -- keeps its place). Returns the reply once it is not WAITING. When the wait
    runs out, or the caller is cancelled, or anything fails while a waiter may exist,
    the waiter is withdrawn (and a lease it was given meanwhile released), best effort,
    shielded, within 5 s."""
    wait_ms = _ms(wait, "wait")
    rid = secrets.token_hex(8)
    deadline = anyio.current_time() + wait
    try:
        ms = wait_ms
        while True:
            reply = await rs._call(make_op(rid, ms), reply_type)
            if reply.status != "WAITING":
                return reply
            left = deadline - anyio.current_time()
            if left <= 0:
                raise WaitTimeout(f"{what}: still waiting in line (position {reply.position}) after {wait} s")
            ms = max(1, _ms(left, "wait"))
    except BaseException:
        if wait_ms > 0:
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(5):
                    try:
                        await rs._call(withdraw_op(rid), t._CancelWaitReply)
                    except Exception:
                        pass
        raise


class _Lease:
    """What claim leases and pool grants share: the background renewal."""

    lease_seconds: float
    lost: bool

    async def renew(self, lease_seconds: float | None = None) -> datetime:  # pragma: no cover
        raise NotImplementedError

    def _lost_error(self, cause: BaseException) -> LeaseLostError:  # pragma: no cover
        raise NotImplementedError

    @asynccontextmanager
    async def keep_alive(self) -> AsyncIterator[Any]:
        """``async with lease.keep_alive():`` renews the lease every ``lease_seconds / 3``
        while the body runs. When a renewal is refused -- STALE_CLAIM (the lease was
        lost: taken over after it ran out, or released) or SCOPE_CANCELLED /
        DEADLINE_EXCEEDED (its run stopped: the holder must stop) -- the body is
        cancelled, ``lost`` is set, and LeaseLostError (STALE_CLAIM) is raised from the
        ``async with``. Renewals go on across a daemon restart on a reconnecting client."""
        refused: list[BaseException] = []
        async with anyio.create_task_group() as tg:
            async def renewer() -> None:
                while True:
                    await anyio.sleep(self.lease_seconds / 3)
                    try:
                        await self.renew()
                    except (LeaseLostError, ScopeInactiveError) as e:
                        self.lost = True
                        refused.append(e)
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(renewer)
            try:
                yield self
            finally:
                tg.cancel_scope.cancel()
        if refused:
            raise self._lost_error(refused[0]) from refused[0]


# ================================================================ claims


class SpaceClaims:
    """``rs.claims``: claims of the space (keys are unique per space)."""

    def __init__(self, rs: Client) -> None:
        self._rs = rs

    async def status(self, key: str) -> t.ClaimInfo:
        """The claim ``key`` (state, generation, holder, queue, observation, result);
        NOT_FOUND if it was never acquired. Never shows a token."""
        return await self._rs._call(p.ClaimStatus(key=key), t.ClaimInfo)

    async def list(self, state: str | None = None, limit: int = 100, after: str | None = None) -> list[t.ClaimInfo]:
        """Claims in key order (``state``: FREE, HELD or COMPLETED; ``after``: a key)."""
        return (await self._rs._call(p.ClaimList(state=state, limit=limit, after=after), t._ClaimList)).claims


class Claims:
    """``run.claims``: exclusive, fenced leases on keys, acquired for this run."""

    def __init__(self, rs: Client, run: "Run") -> None:
        self._rs = rs
        self._run = run

    async def acquire(
        self, key: str, lease_seconds: float = 30, wait: float = 0, *, holder: str | None = None
    ) -> "ClaimLease":
        """Acquire the lease on ``key`` (1-256 characters, unique per space) for this run.

        Returns a :class:`ClaimLease`: ``generation`` (the fencing number: one more than
        the previous lease's), ``token``, ``lease_expires_at``, ``observation`` (what the
        previous holder left at release). If the claim was already completed, no lease
        is taken: ``lease.completed`` is True and ``lease.result`` the recorded result.

        ``lease_seconds``: 5-600. ``wait``: 0 (default) raises ClaimHeldError
        (CLAIM_HELD, ``retry_after`` = seconds the current lease has left) when the claim
        is held; > 0 queues on the server, first come first served, for up to ``wait``
        seconds (at most 24 h) and raises WaitTimeout (TIMEOUT) if the lease did not come
        in time. The queued request survives a daemon restart (it is re-sent on the new
        connection with the same request id and keeps its place); if the call is
        cancelled the request is withdrawn. Raises ScopeCancelledError /
        DeadlineExceededError (SCOPE_CANCELLED / DEADLINE_EXCEEDED) when this run is
        inactive -- also to a waiting acquire, at once, when the run stops --,
        ValidationError (VALIDATION_FAILED) for a bad key, lease or wait."""
        run_id = self._run.id
        lease_ms = _ms(lease_seconds, "lease_seconds")
        reply = await _queued_acquire(
            self._rs,
            lambda rid, ms: p.ClaimAcquire(scope_id=run_id, key=key, lease_ms=lease_ms, wait_ms=ms, holder=holder,
                                           request_id=rid),
            t._ClaimLeaseReply, wait, lambda rid: p.ClaimCancelWait(key=key, request_id=rid), f"claim {key!r}",
        )
        return ClaimLease(self._rs, reply, lease_seconds)

    async def try_acquire(
        self, key: str, lease_seconds: float = 30, *, holder: str | None = None
    ) -> "ClaimLease | None":
        """Like :meth:`acquire` with ``wait=0``, but None instead of ClaimHeldError."""
        try:
            return await self.acquire(key, lease_seconds, 0, holder=holder)
        except ClaimHeldError:
            return None

    @asynccontextmanager
    async def hold(
        self, key: str, lease_seconds: float = 30, wait: float = 0, *, holder: str | None = None
    ) -> AsyncIterator["ClaimLease"]:
        """``async with run.claims.hold(key) as lease:`` acquire (as :meth:`acquire`), keep
        the lease renewed while the body runs (:meth:`ClaimLease.keep_alive`: a lost lease
        cancels the body and raises LeaseLostError), release it at the end unless the
        body completed it. A completed claim yields a lease with ``completed`` True (the
        body should use ``lease.result``)."""
        lease = await self.acquire(key, lease_seconds, wait, holder=holder)
        if lease.completed:
            yield lease
            return
        try:
            async with lease.keep_alive():
                yield lease
        finally:
            if not lease.lost and not lease.released and not lease.completed:
                with anyio.CancelScope(shield=True):
                    with anyio.move_on_after(5):
                        try:
                            await lease.release()
                        except Exception:
                            pass

    async def status(self, key: str) -> t.ClaimInfo:
        return await self._rs._call(p.ClaimStatus(key=key), t.ClaimInfo)


class ClaimLease(_Lease):
    """A lease on a claim (or, with ``completed`` True, the claim's recorded result).

    Attributes: ``key``, ``claim_id``, ``scope_id`` (the run it was acquired for),
    ``generation`` (fencing number), ``token`` (the lease's secret: renew, release and
    complete carry it), ``lease_expires_at`` (aware datetime), ``observation`` (left by
    the previous holder's release), ``completed`` / ``result``, ``info`` (the
    :class:`~rallypoint.client.types.ClaimInfo` last seen), ``lost`` (set once the lease
    is known lost), ``released``."""

    def __init__(self, rs: Client, reply, lease_seconds: float) -> None:
        self._rs = rs
        info = reply.claim
        self.info = info
        self.key = info.key
        self.claim_id = info.id
        self.scope_id = info.scope_id
        self.generation = info.generation
        self.token = reply.token
        self.lease_expires_at = info.lease_expires_at
        self.observation = info.observation
        self.completed = reply.status == "COMPLETED"
        self.result = info.result if self.completed else None
        self.lease_seconds = lease_seconds
        self.lost = False
        self.released = False

    def __repr__(self) -> str:
        return f"ClaimLease(key={self.key!r}, generation={self.generation}, completed={self.completed})"

    def _lost_error(self, cause: BaseException) -> LeaseLostError:
        return LeaseLostError(f"the lease on claim {self.key!r} was lost: {cause}",
                              details={"key": self.key, "generation": self.generation})

    async def _holder_call(self, op, reply_type):
        try:
            return await self._rs._call(op, reply_type)
        except (LeaseLostError, ScopeInactiveError):
            self.lost = True
            raise

    async def renew(self, lease_seconds: float | None = None) -> datetime:
        """Extend the lease by ``lease_seconds`` (default: the acquire's) from now; returns
        the new expiry. LeaseLostError (STALE_CLAIM) when the lease was lost (it ran out
        and was taken over, or was released); ScopeInactiveError (SCOPE_CANCELLED /
        DEADLINE_EXCEEDED) when its run stopped. Both set ``lost``."""
        ls = self.lease_seconds if lease_seconds is None else lease_seconds
        r = await self._holder_call(p.ClaimRenew(key=self.key, token=self.token, lease_ms=_ms(ls, "lease_seconds")),
                                    t._ClaimLeaseReply)
        self.info = r.claim
        self.lease_expires_at = r.claim.lease_expires_at
        return r.claim.lease_expires_at

    async def release(self, observation: Any = None) -> "t.ClaimInfo | None":
        """End the lease, leaving ``observation`` (any msgpack-able value) for the next
        acquirer; the first one queued gets the lease at once. Allowed when the run is
        inactive. Twice is harmless. Returns the claim, or None if the lease had already
        been lost (nothing to release)."""
        try:
            info = await self._holder_call(
                p.ClaimRelease(key=self.key, token=self.token, observation=encode_payload(observation, "observation")),
                t.ClaimInfo,
            )
        except LeaseLostError:
            return None
        self.released = True
        self.info = info
        return info

    async def complete(self, result: Any = None) -> t.ClaimInfo:
        """Record ``result`` once, for good: the claim is COMPLETED and every later
        acquirer (and everyone queued) gets the result instead of a lease. LeaseLostError
        (STALE_CLAIM) for a lost lease; ScopeInactiveError on an inactive run;
        ValidationError for a result over 64 KiB encoded."""
        info = await self._holder_call(
            p.ClaimComplete(key=self.key, token=self.token, result=encode_payload(result, "result")), t.ClaimInfo
        )
        self.completed = True
        self.result = result
        self.info = info
        return info

    async def status(self) -> t.ClaimInfo:
        self.info = await self._rs._call(p.ClaimStatus(key=self.key), t.ClaimInfo)
        return self.info


# ================================================================ pools


class Pools:
    """``rs.pools``: pools (runstate's permits) of the space."""

    def __init__(self, rs: Client) -> None:
        self._rs = rs

    async def ensure(self, name: str, units_total: int) -> "Pool":
        """Create the pool, or check it exists with this size (CONFLICT otherwise).
        ``units_total`` 1-1,000,000."""
        info = await self._rs._call(p.PoolEnsure(name=name, units_total=units_total), t.PoolInfo)
        return Pool(self._rs, info.name, info)

    async def get(self, name: str) -> "Pool":
        info = await self._rs._call(p.PoolGet(name=name), t.PoolInfo)
        return Pool(self._rs, info.name, info)

    async def list(self) -> list[t.PoolInfo]:
        return (await self._rs._call(p.PoolList(), t._PoolList)).pools


class Pool:
    """A handle on a pool, by name."""

    def __init__(self, rs: Client, name: str, info: t.PoolInfo | None = None) -> None:
        self._rs = rs
        self.name = name
        self.info = info

    def __repr__(self) -> str:
        return f"Pool({self.name!r})"

    async def status(self) -> t.PoolInfo:
        """Units used and free, the FIFO queue, active grants."""
        self.info = await self._rs._call(p.PoolGet(name=self.name), t.PoolInfo)
        return self.info

    async def acquire(
        self, units: int = 1, *, scope: "Run | str", lease_seconds: float = 30, wait: float = 0,
        holder: str | None = None,
    ) -> "Grant":
        """Take ``units`` of this pool for run ``scope`` under a lease (``lease_seconds``
        5-600; renew it, or use :meth:`Grant.keep_alive`).

        ``wait`` 0 (default): CapacityUnavailableError (CAPACITY_UNAVAILABLE) unless the
        units are free *and nobody is queued*. ``wait`` > 0: queue on the server, strictly
        first come first served (a large request is never overtaken by smaller ones), for
        up to ``wait`` seconds (24 h at most); WaitTimeout (TIMEOUT) if the units did not
        come in time. The queued request survives a daemon restart; a cancelled call
        withdraws it. ValidationError (VALIDATION_FAILED) when ``units`` is < 1 or more
        than the pool's ``units_total``; ScopeCancelledError / DeadlineExceededError when
        the run is inactive (also, at once, to a waiting acquire when the run stops)."""
        run_id = _id_of(scope)
        lease_ms = _ms(lease_seconds, "lease_seconds")
        name = self.name
        reply = await _queued_acquire(
            self._rs,
            lambda rid, ms: p.PoolAcquire(pool=name, scope_id=run_id, units=units, lease_ms=lease_ms, wait_ms=ms,
                                          holder=holder, request_id=rid),
            t._PoolAcquireReply, wait, lambda rid: p.PoolCancelWait(pool=name, request_id=rid),
            f"pool {name!r} ({units} unit(s))",
        )
        return Grant(self._rs, reply.grant, lease_seconds)

    async def try_acquire(
        self, units: int = 1, *, scope: "Run | str", lease_seconds: float = 30, holder: str | None = None
    ) -> "Grant | None":
        """Like :meth:`acquire` with ``wait=0``, but None instead of CAPACITY_UNAVAILABLE."""
        try:
            return await self.acquire(units, scope=scope, lease_seconds=lease_seconds, holder=holder)
        except CapacityUnavailableError:
            return None

    @asynccontextmanager
    async def hold(
        self, units: int = 1, *, scope: "Run | str", lease_seconds: float = 30, wait: float = 0,
        holder: str | None = None,
    ) -> AsyncIterator["Grant"]:
        """``async with pool.hold(2, scope=run, wait=60) as grant:`` acquire, keep the
        grant renewed while the body runs (a lost lease cancels the body and raises
        LeaseLostError), release it at the end."""
        grant = await self.acquire(units, scope=scope, lease_seconds=lease_seconds, wait=wait, holder=holder)
        try:
            async with grant.keep_alive():
                yield grant
        finally:
            if not grant.lost and not grant.released:
                with anyio.CancelScope(shield=True):
                    with anyio.move_on_after(5):
                        try:
                            await grant.release()
                        except Exception:
                            pass


class RunPools:
    """``run.pools``: acquire pool units for this run (``run.pools.acquire("gpu", 2)``)."""

    def __init__(self, rs: Client, run: "Run") -> None:
        self._rs = rs
        self._run = run

    async def acquire(self, pool: "Pool | str", units: int = 1, lease_seconds: float = 30, wait: float = 0,
                      *, holder: str | None = None) -> "Grant":
        """:meth:`Pool.acquire` for this run."""
        return await Pool(self._rs, _pool_name(pool)).acquire(units, scope=self._run, lease_seconds=lease_seconds,
                                                              wait=wait, holder=holder)

    async def try_acquire(self, pool: "Pool | str", units: int = 1, lease_seconds: float = 30,
                          *, holder: str | None = None) -> "Grant | None":
        return await Pool(self._rs, _pool_name(pool)).try_acquire(units, scope=self._run,
                                                                  lease_seconds=lease_seconds, holder=holder)

    def hold(self, pool: "Pool | str", units: int = 1, lease_seconds: float = 30, wait: float = 0,
             *, holder: str | None = None):
        """:meth:`Pool.hold` for this run (an async context manager)."""
        return Pool(self._rs, _pool_name(pool)).hold(units, scope=self._run, lease_seconds=lease_seconds,
                                                     wait=wait, holder=holder)


class Grant(_Lease):
    """A grant of ``units`` of pool ``pool``. Attributes: ``id``, ``pool``, ``units``,
    ``token`` (its secret), ``lease_expires_at`` (None for a task's grant, held while
    its delivery runs), ``task_id``, ``info``, ``lost``, ``released``."""

    def __init__(self, rs: Client, info: t.GrantInfo, lease_seconds: float) -> None:
        self._rs = rs
        self.info = info
        self.id = info.id
        self.pool = info.pool
        self.units = info.units
        self.token = info.token
        self.lease_expires_at = info.lease_expires_at
        self.task_id = info.task_id
        self.lease_seconds = lease_seconds
        self.lost = False
        self.released = False

    def __repr__(self) -> str:
        return f"Grant({self.id!r}, pool={self.pool!r}, units={self.units})"

    def _lost_error(self, cause: BaseException) -> LeaseLostError:
        return LeaseLostError(f"the lease on grant {self.id} of pool {self.pool!r} was lost: {cause}",
                              details={"grant_id": self.id})

    async def renew(self, lease_seconds: float | None = None) -> datetime:
        """Extend the lease by ``lease_seconds`` (default: the acquire's) from now.
        LeaseLostError (STALE_CLAIM) when it ran out or was released; ScopeInactiveError
        when its run stopped (both set ``lost``); ConflictError for a task's grant (renew
        the delivery)."""
        ls = self.lease_seconds if lease_seconds is None else lease_seconds
        try:
            info = await self._rs._call(
                p.GrantRenew(grant_id=self.id, token=self.token, lease_ms=_ms(ls, "lease_seconds")), t.GrantInfo
            )
        except (LeaseLostError, ScopeInactiveError):
            self.lost = True
            raise
        self.info = info
        self.lease_expires_at = info.lease_expires_at
        return info.lease_expires_at

    async def release(self, observation: Any = None) -> "t.GrantInfo | None":
        """Give the units back (to the first queued, at once). Allowed when the run is
        inactive, and for a task's grant (given back early). Twice is harmless. Returns
        the grant, or None if its lease had already been lost."""
        try:
            info = await self._rs._call(
                p.GrantRelease(grant_id=self.id, token=self.token,
                               observation=encode_payload(observation, "observation")),
                t.GrantInfo,
            )
        except LeaseLostError:
            self.lost = True
            return None
        self.released = True
        self.info = info
        return info

    async def status(self) -> t.GrantInfo:
        self.info = await self._rs._call(p.GrantStatus(grant_id=self.id), t.GrantInfo)
        return self.info


# ================================================================ work limits


class WorkLimits:
    """``run.work_limits``: caps on the unfinished tasks of this run (and below) that
    name a limit at submission."""

    def __init__(self, rs: Client, run: "Run") -> None:
        self._rs = rs
        self._run = run

    async def ensure(self, name: str, max_outstanding: int) -> t.WorkLimitInfo:
        """Create the limit ``name`` of this run, or check it exists with this
        ``max_outstanding`` (CONFLICT otherwise). A submit naming it
        (``work_limit=name``, from this run or below) is LIMIT_EXCEEDED while
        ``max_outstanding`` of its tasks are unfinished."""
        return await self._rs._call(
            p.WorkLimitEnsure(scope_id=self._run.id, name=name, max_outstanding=max_outstanding), t.WorkLimitInfo
        )

    async def list(self) -> list[t.WorkLimitInfo]:
        return (await self._rs._call(p.WorkLimitList(scope_id=self._run.id), t._WorkLimitList)).work_limits
