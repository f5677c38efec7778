"""Events over the shards of a sharded cluster: a cursor per shard, merged pages and
streams (design: ``../shared/SCALE-OUT.md`` §4.2, row "events").

Each shard numbers its own events (``seq`` 1, 2, 3... per space, on every shard; the
servers are unchanged): there is no sequence of the whole cluster, since one would need
every commit of every shard to pass through one sequencer -- the single point sharding
removes. Over a :class:`~rallypoint.client.router.ShardedTransport` the SDK's
``rs.events.list`` and ``rs.events.watch`` therefore ask every shard (a filter by run
asks that run's shard only) and merge:

- **The cursor is a vector**, one position per shard (Kafka's offsets per partition),
  written as an opaque string ``"0:120,1:45,2:9"`` (``shard:seq``, by shard) and
  accepted back by ``watch(cursor=...)`` / ``list(cursor=...)``. Resume is exact per
  shard: each shard goes on after its own position. A shard the string does not name
  starts at its oldest kept event (a shard added since the cursor was made); a shard
  the cluster does not have, an integer (one shard's number) or a malformed string is
  VALIDATION_FAILED. A single-shard deployment keeps the integer cursor (the router is
  not used there).
- **Order**: per shard exact (its ``seq`` order). Across shards by the event's instant
  (``at``, each shard's clock), then shard, then seq. A page of ``list`` and a watch
  catching up on history merge exactly by that key: a shard that has more to give
  bounds what the others may give first (``list``: events after the last one of a shard
  whose page was full wait for the next page; ``watch``: until every shard has sent the
  backlog it had when the watch subscribed -- ``WatchView.newest`` --, an event is
  returned only when every shard still catching up has one pending to compare it
  with). Live events are returned as they arrive, those at hand together merged by the
  key: an idle shard sends nothing, so waiting for every shard to speak would hold every
  event for the quietest one. So across shards the order is by instant, not a total
  order a later event can never precede.
- **Errors name their shard**: CURSOR_EXPIRED on one shard says which
  (``details["shard"]``; the other shards' positions are still good: drop that shard's
  entry from the vector to restart only it from its oldest kept event).
- Each event carries ``shard`` (the node that numbered it sets it).
"""

from __future__ import annotations

import re
from collections import deque
from typing import Any

import anyio
import msgspec

from .. import protocol as p
from ..errors import (
    CursorExpiredError,
    RallypointError,
    SlowConsumerError,
    UnavailableError,
    ValidationError,
)
from . import types as t

__all__ = ["parse_cursor", "format_cursor", "list_events", "MergedWatch"]

_event_decoder = msgspec.msgpack.Decoder(t.Event)
_page_decoder = msgspec.msgpack.Decoder(t.EventPage)
_watch_decoder = msgspec.msgpack.Decoder(p.WatchView)
_VECTOR = re.compile(r"^\d{1,4}:\d{1,19}(,\d{1,4}:\d{1,19})*$")


def format_cursor(positions: dict[int, int]) -> str:
    """The string form of a vector cursor: ``"0:120,1:45,2:9"`` (by shard)."""
    return ",".join(f"{s}:{positions[s]}" for s in sorted(positions))


def parse_cursor(cursor: Any, shards: list[int], every: list[int] | None = None) -> dict[int, int | None]:
    """Each of ``shards``' position in ``cursor`` (None: from its oldest kept event).

    ``cursor``: None (every shard from its oldest kept event, or from now with
    ``start="now"``), a vector string (see the module docstring), or an integer when
    ``shards`` is one shard (a watch of one run). ``every``: the cluster's shards (a
    vector naming another is refused; default ``shards``). Raises VALIDATION_FAILED
    (``details.field`` ``cursor``)."""
    every = shards if every is None else every
    if cursor is None:
        return {s: None for s in shards}
    if isinstance(cursor, bool):
        raise ValidationError("cursor must be the stream's cursor string (e.g. '0:120,1:45'), not a bool",
                              details={"field": "cursor"})
    if isinstance(cursor, int):
        if len(shards) == 1:
            if cursor < 0:
                raise ValidationError(f"cursor must be >= 0 (got {cursor})", details={"field": "cursor"})
            return {shards[0]: cursor}
        raise ValidationError(
            f"cursor {cursor} is one shard's position, but this cluster has {len(every)} shards, each numbering "
            "its own events: pass the cursor string a stream or page gave (e.g. '0:120,1:45,2:9'), or None",
            details={"field": "cursor"})
    if not isinstance(cursor, str) or not _VECTOR.match(cursor.strip()):
        raise ValidationError(f"cursor must be 'SHARD:SEQ,...' as a stream or page gave it (got {cursor!r})",
                              details={"field": "cursor"})
    vec: dict[int, int] = {}
    for part in cursor.strip().split(","):
        s, _, seq = part.partition(":")
        shard = int(s)
        if shard in vec:
            raise ValidationError(f"cursor {cursor!r} names shard {shard} twice", details={"field": "cursor"})
        if shard not in every:
            raise ValidationError(f"cursor {cursor!r} names shard {shard}, which this cluster does not have "
                                  f"(its shards: {', '.join(map(str, every))}): a cursor of another cluster?",
                                  details={"field": "cursor", "shard": shard})
        vec[shard] = int(seq)
    return {s: vec.get(s) for s in shards}


def on_shard(shard: int, e: RallypointError) -> RallypointError:
    """``e`` (a shard's answer) saying which shard gave it (``details["shard"]``)."""
    if e.details and e.details.get("shard") == shard and e.message.startswith(f"shard {shard}:"):
        return e
    out = type(e)(f"shard {shard}: {e.message}", retry_after=e.retry_after,
                  details={**(e.details or {}), "shard": shard}, code=e.code)
    out.__cause__ = e
    return out


def _key(e: t.Event, shard: int) -> tuple:
    return (e.at, shard, e.seq)


async def list_events(transport: Any, op: p.EventsList, cursor: Any) -> t.EventPage:
    """``events.list`` over the shards ``transport.event_shards(op)`` (a
    :class:`~rallypoint.client.router.ShardedTransport`) after the vector ``cursor``:
    up to ``op.limit`` events merged by (instant, shard, seq), each shard's in its seq
    order (an instant earlier than its predecessor's counts as that one's) -- never past the last
    event of a shard whose page was full, so the next page starts no earlier --, and
    ``next_cursor`` (a vector: per shard, the last event taken or, when every event it
    sent was taken, the position it scanned to). ``oldest``/``newest``: vectors of what
    each shard keeps (``newest`` is a cursor for "from now"). Errors name their shard
    (CURSOR_EXPIRED, VALIDATION_FAILED)."""
    shards = transport.event_shards(op)
    every = sorted(set(transport.map.owners)) if transport.map is not None else shards
    vec = parse_cursor(cursor, shards, every)
    pages: dict[int, Any] = {}

    async def one(s: int) -> None:
        try:
            raw = await transport.call_shard(s, msgspec.structs.replace(op, cursor=vec[s]))
            pages[s] = _page_decoder.decode(raw)
        except RallypointError as e:
            pages[s] = on_shard(s, e)

    async with anyio.create_task_group() as tg:
        for s in shards:
            tg.start_soon(one, s)
    for s in shards:
        if isinstance(pages[s], RallypointError):
            raise pages[s]
    # Each shard's events keyed by the running maximum of their instants: a shard's
    # instants need not follow its seq (a lease expiry carries its deadline, earlier
    # than events numbered before it), and the merge must keep each shard's events in
    # seq order, so that what a page takes of a shard is a prefix and next_cursor
    # (which assumes one) skips and repeats nothing (seed 320 of the cluster simulator).
    keyed: dict[int, list[tuple]] = {}
    for s in shards:
        rows, top = [], None
        for e in pages[s].events:
            top = e.at if top is None or e.at > top else top
            rows.append(((top, s, e.seq), s, e))
        keyed[s] = rows
    cut = None
    for s in shards:
        pg = pages[s]
        if pg.events and (len(pg.events) >= op.limit or pg.next_cursor < pg.newest):
            k = keyed[s][-1][0]
            cut = k if cut is None or k < cut else cut
    merged = sorted((row for s in shards for row in keyed[s] if cut is None or row[0] <= cut),
                    key=lambda x: x[0])[: op.limit]
    taken: dict[int, int] = {}
    for _k, s, e in merged:
        taken[s] = taken.get(s, 0) + 1
    nxt: dict[int, int] = {}
    for s in shards:
        pg = pages[s]
        n = taken.get(s, 0)
        if n == len(pg.events):
            nxt[s] = pg.next_cursor  # every event it sent was taken: on from where it scanned
        elif n:
            nxt[s] = pg.events[n - 1].seq
        else:  # none taken: where it started (None pinned to before its oldest kept event)
            nxt[s] = vec[s] if vec[s] is not None else pg.oldest - 1
    return t.EventPage(events=[e for _k, _s, e in merged], next_cursor=format_cursor(nxt),
                       oldest=format_cursor({s: pages[s].oldest for s in shards}),
                       newest=format_cursor({s: pages[s].newest for s in shards}))


class _ShardWatch:
    """One shard's part of a :class:`MergedWatch`: its subscription (None: to open),
    the events received and not yet returned, ``pos`` (the position returned: the seq
    of the last event of this shard returned, or later once every event received was
    returned and the shard said it scanned further), ``recv`` (the position received)
    and ``backlog`` (the newest seq the shard had when it subscribed: until ``recv``
    reaches it the shard is catching up)."""

    __slots__ = ("shard", "sub", "pending", "pos", "recv", "backlog")

    def __init__(self, shard: int, pos: int | None) -> None:
        self.shard = shard
        self.sub: Any = None
        self.pending: deque = deque()
        self.pos = pos
        self.recv = pos
        self.backlog = -1

    @property
    def behind(self) -> bool:
        """Catching up: it has not sent all it had when it (last) subscribed."""
        return self.recv is not None and self.recv < self.backlog


class MergedWatch:
    """``events.watch`` over several shards, merged (see the module docstring): the
    engine of :class:`rallypoint.client.api.EventStream` over a sharded cluster.

    ``transport``: a :class:`~rallypoint.client.router.ShardedTransport`; ``op``: the
    EventsWatch (its ``cursor`` is ignored: ``cursor`` gives each shard's); ``buffer``:
    events held per shard (a shard's subscription beyond it is re-opened from its
    position). :attr:`cursor` is the vector string (None before the subscription is made
    when none was given); :attr:`resumed` counts per-shard re-subscriptions."""

    def __init__(self, transport: Any, op: p.EventsWatch, cursor: Any, buffer: int) -> None:
        self._transport = transport
        self._op = op
        shards = transport.event_shards(op)
        every = sorted(set(transport.map.owners)) if transport.map is not None else shards
        vec = parse_cursor(cursor, shards, every)
        self._shards = [_ShardWatch(s, vec[s]) for s in shards]
        self._buffer = buffer
        self._start = op.start
        self._closed = False
        self.resumed = 0

    @property
    def cursor(self) -> str | None:
        known = {w.shard: w.pos for w in self._shards if w.pos is not None}
        return format_cursor(known) if known else None

    @property
    def shards(self) -> list[int]:
        return [w.shard for w in self._shards]

    # ------------------------------------------------------------------ subscribing
    async def _open_one(self, w: _ShardWatch) -> None:
        op = msgspec.structs.replace(self._op, cursor=w.recv, start=self._start)
        try:
            sub = await self._transport.subscribe_shard(w.shard, op, self._buffer)
        except RallypointError as e:
            raise on_shard(w.shard, e) from None
        start = _watch_decoder.decode(sub.start)
        if w.recv is None:  # an explicit position from here on: a re-subscription continues
            w.recv = start.cursor
            if w.pos is None:
                w.pos = start.cursor
        w.backlog = start.newest
        w.sub = sub

    async def open(self) -> None:
        """Subscribe to every shard not subscribed yet, at once (``start="now"`` is this
        moment on each). A shard whose leader is out of reach right now is left for
        :meth:`next`; CURSOR_EXPIRED and the like are raised naming the shard."""
        errors: list[RallypointError] = []

        async def one(w: _ShardWatch) -> None:
            try:
                await self._open_one(w)
            except UnavailableError as e:
                if self._transport.shard_closed(w.shard):
                    errors.append(e)
            except RallypointError as e:
                errors.append(e)

        async with anyio.create_task_group() as tg:
            for w in self._shards:
                if w.sub is None:
                    tg.start_soon(one, w)
        if errors:
            raise next((e for e in errors if not isinstance(e, UnavailableError)), errors[0])

    # ------------------------------------------------------------------ reading
    def _take(self) -> t.Event | None:
        """The next event in merge order, or None when one must wait: nothing pending,
        or a shard still catching up has nothing pending to compare with."""
        best = None
        for w in self._shards:
            if w.pending:
                k = _key(w.pending[0], w.shard)
                if best is None or k < best[0]:
                    best = (k, w)
            elif w.behind:
                return None  # its backlog may hold older events than any pending
        if best is None:
            return None
        w = best[1]
        e = w.pending.popleft()
        w.pos = e.seq
        if not w.pending and w.recv is not None and w.recv > e.seq:
            w.pos = w.recv  # the filter skipped what came after it
        return e

    def _received(self, w: _ShardWatch, raws: list, scanned: int | None) -> None:
        last = w.recv if w.recv is not None else -1
        dec = _event_decoder.decode
        for raw in raws:
            e = dec(raw)
            if e.seq > last:  # (never otherwise; a guard against a duplicate on resume)
                w.pending.append(e)
                last = e.seq
        if scanned is not None and scanned > last:
            last = scanned
        w.recv = last
        if not w.pending and w.pos is not None and last > w.pos:
            w.pos = last  # nothing new passed the filter up to there

    async def fill(self) -> None:
        """Wait until some shard has sent more (events, a scanned position, or its
        subscription ended and is to be re-opened), (re)opening the shards that need it
        first; a shard out of reach is tried again every 0.1 s meanwhile. Raises
        CURSOR_EXPIRED naming its shard, UnavailableError once a shard's transport gave
        up reconnecting.

        Cancel-safe: a shard's batch is taken into its ``pending`` in the same step as its
        ``next_batch`` returns it (no checkpoint between), so a caller cancelled while
        this waits -- a time-out, a ``move_on_after(0)`` to take what is buffered --
        loses nothing: the subscription will not send those events again. For a caller
        that takes events with :meth:`ready` itself (the console's stream)."""
        if any(w.sub is None for w in self._shards):
            await self.open()
        ready = [w for w in self._shards if w.sub is not None and len(w.pending) < self._buffer]
        retry = any(w.sub is None for w in self._shards)
        errors: list[RallypointError] = []

        async def one(w: _ShardWatch, scope) -> None:
            sub = w.sub
            try:
                raws = await sub.next_batch()
            except SlowConsumerError:
                w.sub = None  # cut off (server) or its buffer filled: on from what it received
                self.resumed += 1
            except UnavailableError as e:
                w.sub = None
                if self._closed or self._transport.shard_closed(w.shard):
                    errors.append(on_shard(w.shard, e))
                else:
                    self.resumed += 1
            except RallypointError as e:
                errors.append(on_shard(w.shard, e))
            else:
                self._received(w, raws, getattr(sub, "scanned", None))
            scope.cancel()  # (next_batch only waits before it takes anything: safe to cancel the others)

        async def later(scope) -> None:
            await anyio.sleep(0.1)
            scope.cancel()

        async with anyio.create_task_group() as tg:
            for w in ready:
                tg.start_soon(one, w, tg.cancel_scope)
            if retry or not ready:
                tg.start_soon(later, tg.cancel_scope)
        if errors:
            raise errors[0]

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def ready(self) -> t.Event | None:
        """The next event in merge order if one can be returned without waiting, else
        None (nothing received, or a shard still catching up has nothing to compare)."""
        return self._take()

    async def next(self) -> t.Event:
        """The next event in merge order (waiting for one). Raises StopAsyncIteration
        once closed, CURSOR_EXPIRED naming its shard, UnavailableError once a shard's
        transport gave up reconnecting."""
        while True:
            e = self._take()
            if e is not None:
                return e
            if self._closed:
                raise StopAsyncIteration
            await self.fill()

    def close(self) -> None:
        """End every shard's subscription (events received and not returned are dropped)."""
        self._closed = True
        for w in self._shards:
            w.pending.clear()
            sub, w.sub = w.sub, None
            if sub is not None:
                sub.close()
