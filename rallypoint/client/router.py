"""The SDK's router for a sharded cluster: each request to the shard that owns it.

A sharded cluster (``rallypoint cluster init --shards K``) spreads root runs over
shards; every id names its slot (:func:`rallypoint.ids.slot_of`) and the slot map says
which shard owns each slot. :class:`ShardedTransport` keeps that map and one connection
per shard (each a :class:`~rallypoint.client.reconnect.ReconnectingTransport` that
follows that shard's leader, :mod:`rallypoint.client.follow`), and sends each request
where its declaration says (``@op(..., shard=...)``, :class:`rallypoint.opdecl.Shard`, read from
:mod:`rallypoint.opfacts`):

- an op about an id (a run, a task, a group...) to the shard of the id's slot; one
  about a space-wide entity by name (a work queue, a pool, a quota...) to the space's
  home shard;
- a new root run to the shards in turn, from a random one per client (so a shard
  added later takes new runs, and clients that make one run each spread out); a
  named root run (``ensure_named``) to the slot its name hashes to;
- a list of ids (``task.results``, ``delivery.complete_many``) split by shard, the
  answers put back in order;
- an op every shard answers its part of (server status, root run lists, the
  operator's views, a queue's messages) to every shard, the answers merged;
- a work queue's definition (``mailbox.ensure``) to its home shard first, then, with the
  id the home shard gave it, to every other shard (each needs it to take tasks of its
  runs).

A node that does not own the request's slot answers WRONG_SHARD: the router reads the
map again and sends it there.

Events are numbered per shard: the SDK's ``rs.events.list`` / ``rs.events.watch`` ask
each shard (:meth:`ShardedTransport.event_shards`, :meth:`~ShardedTransport.call_shard`,
:meth:`~ShardedTransport.subscribe_shard`) and merge, with a cursor per shard
(:mod:`rallypoint.client.shardevents`); a bare ``events.list`` / ``events.watch`` over
a whole space sent through :meth:`~ShardedTransport.call` is refused.
"""

from __future__ import annotations

import itertools
import random
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
import msgspec

from .. import protocol as p
from ..errors import RallypointError, ValidationError, WrongShardError

__all__ = ["MERGES", "ShardedTransport", "open_transport"]

log = logging.getLogger("rallypoint.client")

_TRIES = 4


def _table():
    """The facts of every op (:mod:`rallypoint.opfacts`, generated from the ``@op`` marks:
    the client imports no server module)."""
    from ..opfacts import TABLE

    return TABLE


def _sum_queue(view: p.MailboxView, v: p.MailboxView) -> p.MailboxView:
    """A queue's view with another shard's counts added: queued, running and the ready
    backlog per priority and per key (issue 44)."""
    def add(a: dict, b: dict) -> dict:
        out = dict(a)
        for k, n in b.items():
            out[k] = out.get(k, 0) + n
        return out

    return msgspec.structs.replace(view, queued=view.queued + v.queued, running=view.running + v.running,
                                   ready_by_priority=add(view.ready_by_priority, v.ready_by_priority),
                                   ready_by_key=add(view.ready_by_key, v.ready_by_key))


class ShardedTransport:
    """``call`` / ``call_many`` / ``subscribe`` over one transport per shard (see the
    module docstring). ``open_shard(shard, leader_hint)`` opens a transport (already
    entered) that follows that shard's leader (``leader_hint()``: the address the
    latest map names); ``first`` is a transport to any node, used to read the map and
    kept for the shard it leads; ``space`` is the connection's space (its home slot)."""

    def __init__(self, urls: list[str], first: Any, open_shard: Callable[[int, Callable[[], str | None]], Awaitable[Any]],
                 space: str) -> None:
        self.urls = urls
        self._first = first
        self._open_shard = open_shard
        self.space = space
        self.map: p.ClusterMapView | None = None
        self.shards: dict[int, Any] = {}
        # new root runs go to the shards in turn, from a random one: programs that each
        # make one run spread over the shards instead of all landing on the first
        self._roots = itertools.count(random.randrange(1 << 30))
        self._lock = anyio.Lock()
        self.refreshes = 0
        self.server_info = getattr(first, "server_info", None)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        await self.refresh()

    @property
    def closed(self) -> bool:
        return all(getattr(t, "closed", False) for t in [self._first, *self.shards.values()])

    # ------------------------------------------------------------------ the map
    async def refresh(self) -> None:
        """Read the slot map and the shards' leaders again (any shard answers)."""
        async with self._lock:
            src = next(iter(self.shards.values()), self._first)
            raw = await src.call(p.ClusterMap())
            m = msgspec.msgpack.decode(raw, type=p.ClusterMapView)
            self.map = m
            self.refreshes += 1
            leaders = {s.shard: s for s in m.shards}
            # every shard gets a transport of its own that follows only that shard's
            # leader (the first one, opened to any node, only reads the map); a cluster of
            # one shard needs none (the first one is it: no second connection, no second
            # reconnection and its warnings, through a failover)
            for s in leaders if self.sharded else ():
                if s not in self.shards:
                    self.shards[s] = await self._open_shard(s, lambda s=s: self._leader_address(s))
            self.server_info = getattr(self._first, "server_info", self.server_info)

    def _leader_address(self, shard: int) -> str | None:
        """The shard's leader as the last map read named it (tried first on a reconnection)."""
        m = self.map
        if m is None:
            return None
        for v in m.shards:
            if v.shard == shard:
                return v.address
        return None

    @property
    def sharded(self) -> bool:
        return self.map is not None and len(self.map.owners) > 0 and len(set(self.map.owners)) > 1

    def _shard_of_slot(self, slot: int) -> int:
        return self.map.owners[slot]

    def _transport(self, shard: int) -> Any:
        t = self.shards.get(shard)
        if t is None:
            raise WrongShardError(f"no connection to shard {shard} yet", details={"shard": shard})
        return t

    # ------------------------------------------------------------------ calls
    async def call(self, op: Any) -> Any:
        """Send ``op`` where it belongs (see the module docstring); the reply body."""
        for attempt in range(_TRIES):
            try:
                return await self._route(op)
            except WrongShardError:
                if attempt == _TRIES - 1:
                    raise
                await self.refresh()
        raise AssertionError("unreachable")

    async def call_many(self, ops: list) -> list:
        """Each op routed on its own (a batch may span shards); replies in order."""
        out: list = [None] * len(ops)

        async def one(i: int, o: Any) -> None:
            try:
                out[i] = await self.call(o)
            except RallypointError as e:
                out[i] = e

        async with _one_error(), anyio.create_task_group() as tg:
            for i, o in enumerate(ops):
                tg.start_soon(one, i, o)
        return out

    async def subscribe(self, op: Any, max_events: int = 10_000) -> Any:
        """One shard's subscription: the run's shard for a watch of a run. A watch over a
        whole space is VALIDATION_FAILED here (each shard numbers its own events): the
        SDK's ``rs.events.watch`` subscribes to every shard and merges."""
        if not self.sharded:
            return await self._transport(self._any_shard()).subscribe(op, max_events)
        if getattr(op, "scope_id", None) is None:
            raise ValidationError("a watch over a whole space of a cluster of several shards is one subscription "
                                  "per shard (each numbers its own events): use rs.events.watch(), which merges them")
        (shard,) = self.event_shards(op)
        return await self._transport(shard).subscribe(op, max_events)

    def event_shards(self, op: Any) -> list[int]:
        """The shards whose events ``op`` (``events.list`` / ``events.watch``) reads: the
        shard of its run (``scope_id``), else every shard, in order."""
        from ..slots import EVERY, target

        if self.map is None:
            return [self._any_shard()]
        slot = target(_table().shards[type(op)], op, self.space, len(self.map.owners))
        if slot == EVERY:
            return sorted(set(self.map.owners))
        return [self._shard_of_slot(slot)]

    async def call_shard(self, shard: int, op: Any) -> bytes:
        """``op`` sent to ``shard``'s leader as it is (no routing): the reply body."""
        return await self._transport(shard).call(op)

    async def subscribe_shard(self, shard: int, op: Any, max_events: int = 10_000) -> Any:
        """A subscription (``events.watch``) on ``shard``'s leader: the subscription object
        of that shard's transport (``start``, ``next_batch()``, ``scanned``, ``close()``)."""
        return await self._transport(shard).subscribe(op, max_events)

    def shard_closed(self, shard: int) -> bool:
        """True once ``shard``'s transport gave up reconnecting (or was closed)."""
        t = self.shards.get(shard)
        return t is None or getattr(t, "closed", False)

    def _any_shard(self) -> int:
        return next(iter(self.shards)) if self.shards else 0

    async def _route(self, op: Any) -> Any:
        if not self.sharded:
            return await self._transport(self._any_shard()).call(op)
        from ..slots import EVERY, HERE, NEW_ROOT, item_slots, target

        decl = _table().shards[type(op)]
        slots = len(self.map.owners)
        merge = _table().merges[type(op)]
        if merge == "mailbox.ensure":
            return await self._mailbox_ensure(op)
        if merge == "mailbox.read":
            return await self._mailbox_read(op)
        if decl.kind == "slots":
            return await self._split(op, decl, item_slots(decl, op, self.space, slots))
        slot = target(decl, op, self.space, slots)
        if slot == NEW_ROOT:
            shards = sorted(set(self.map.owners))
            return await self._transport(shards[next(self._roots) % len(shards)]).call(op)
        if slot == EVERY:
            return await self._every(op)
        if slot == HERE:  # a store of whichever shard takes it (the HTTP layer's)
            return await self._transport(self._any_shard()).call(op)
        return await self._transport(self._shard_of_slot(slot)).call(op)

    async def _mailbox_ensure(self, op: p.MailboxEnsure) -> bytes:
        from ..slots import home_slot

        home = self._shard_of_slot(home_slot(self.space, len(self.map.owners)))
        raw = await self._transport(home).call(op)
        view = msgspec.msgpack.decode(raw, type=p.MailboxView)
        # the home shard's definition (an ensure may have left settings out: `checked`)
        adopt = msgspec.structs.replace(op, id=view.id, mode=view.mode, max_attempts=view.max_attempts,
                                        backlog_limit=view.backlog_limit, checked=None,
                                        # issue 44: the home shard's aging, weights and rate limits
                                        # on every shard (a rate limit counts per shard)
                                        aging_ms=view.aging_ms or 0, weights=dict(view.weights),
                                        rate_limits=dict(view.rate_limits))
        for s in sorted(self.shards):
            if s != home:
                await self._transport(s).call(adopt)
        return raw

    async def _mailbox_read(self, op: p.MailboxGet | p.MailboxList) -> bytes:
        """A work queue's view (or the space's list) over every shard: each shard counts
        only the tasks of its own runs, so ``queued`` and ``running`` are summed; the
        definition is the home shard's, whose NOT_FOUND is the answer (a shard that never
        adopted the queue -- one added later -- has none of its tasks)."""
        from ..slots import home_slot

        home = self._shard_of_slot(home_slot(self.space, len(self.map.owners)))
        parts: dict[int, bytes | None] = {}

        async def send(s: int) -> None:
            try:
                parts[s] = await self._transport(s).call(op)
            except RallypointError as e:
                if s == home or e.code != "NOT_FOUND":
                    raise
                parts[s] = None

        async with _one_error(), anyio.create_task_group() as tg:
            for s in sorted(self.shards):
                tg.start_soon(send, s)
        others = [parts[s] for s in sorted(parts) if s != home and parts[s] is not None]
        if type(op) is p.MailboxGet:
            view = msgspec.msgpack.decode(parts[home], type=p.MailboxView)
            for raw in others:
                v = msgspec.msgpack.decode(raw, type=p.MailboxView)
                view = _sum_queue(view, v)
            return p.encoder.encode(view)
        base = msgspec.msgpack.decode(parts[home], type=p.MailboxListView).mailboxes
        by_id = {q.id: q for q in base}
        for raw in others:
            for v in msgspec.msgpack.decode(raw, type=p.MailboxListView).mailboxes:
                q = by_id.get(v.id)
                if q is not None:
                    by_id[v.id] = _sum_queue(q, v)
        return p.encoder.encode(p.MailboxListView(mailboxes=[by_id[q.id] for q in base]))

    async def _split(self, op: Any, decl: Any, slots: list[int]) -> bytes:
        by_shard: dict[int, list[int]] = {}
        for i, slot in enumerate(slots):
            by_shard.setdefault(self._shard_of_slot(slot), []).append(i)
        field = decl.field
        items = getattr(op, field)
        if len(by_shard) == 1:
            (s,) = by_shard
            return await self._transport(s).call(op)
        parts: dict[int, Any] = {}

        async def send(s: int, idx: list[int]) -> None:
            sub = msgspec.structs.replace(op, **{field: [items[i] for i in idx]})
            parts[s] = await self._transport(s).call(sub)

        async with _one_error(), anyio.create_task_group() as tg:
            for s, idx in by_shard.items():
                tg.start_soon(send, s, idx)
        return _merge_split(op, by_shard, parts, len(items))

    async def _every(self, op: Any) -> bytes:
        parts: dict[int, bytes] = {}

        async def send(s: int) -> None:
            parts[s] = await self._transport(s).call(op)

        async with _one_error(), anyio.create_task_group() as tg:
            for s in sorted(self.shards):
                tg.start_soon(send, s)
        return _merge_every(op, [parts[s] for s in sorted(parts)])


@asynccontextmanager
async def _one_error() -> AsyncIterator[None]:
    """The first error of a fan-out (a shard that failed mid-call) leaves as itself,
    not wrapped in an ExceptionGroup: the caller gets the RallypointError it can act on
    (a WRONG_SHARD refreshes the map; UNAVAILABLE is retried by its shard's transport)."""
    try:
        yield
    except BaseExceptionGroup as eg:
        leaves: list[BaseException] = []
        stack = [eg]
        while stack:
            for e in stack.pop().exceptions:
                (stack.append(e) if isinstance(e, BaseExceptionGroup) else leaves.append(e))
        real = [e for e in leaves if not isinstance(e, anyio.get_cancelled_exc_class())]
        if real:
            raise real[0] from real[0].__cause__
        raise


# ---------------------------------------------------------------------------- merging

def _merge_split(op: Any, by_shard: dict[int, list[int]], parts: dict[int, bytes], n: int) -> bytes:
    """Put the answers of a split list back in the request's order."""
    if type(op) is p.TaskResults:
        out_tasks: list = [None] * n
        out_outcomes: list = [None] * n
        for s, idx in by_shard.items():
            v = msgspec.msgpack.decode(parts[s], type=p.TaskListView)
            for j, i in enumerate(idx):
                if v.tasks:
                    out_tasks[i] = v.tasks[j]
                if v.outcomes:
                    out_outcomes[i] = v.outcomes[j]
        return p.encoder.encode(p.TaskListView(tasks=[x for x in out_tasks if x is not None],
                                               outcomes=[x for x in out_outcomes if x is not None]))
    if type(op) is p.DeliveryCompleteMany:
        items: list = [None] * n
        for s, idx in by_shard.items():
            v = msgspec.msgpack.decode(parts[s], type=p.SettledListView)
            for j, i in enumerate(idx):
                items[i] = v.items[j]
        return p.encoder.encode(p.SettledListView(items=items))
    raise ValidationError(f"{op.__struct_config__.tag} cannot be split over shards")


def _merge_server_status(op: p.ServerStatus, parts: list[bytes]) -> bytes:
    vs = [msgspec.msgpack.decode(b, type=p.ServerStatusView) for b in parts]
    first = vs[0]
    runs: dict[str, int] = {}
    tasks: dict[str, int] = {}
    actors: dict[str, dict[str, int]] = {}
    for v in vs:
        for k, x in v.runs.items():
            runs[k] = runs.get(k, 0) + x
        for k, x in v.tasks.items():
            tasks[k] = tasks.get(k, 0) + x
        for kind, a in v.actors.items():
            d = actors.setdefault(kind, {})
            for k, x in a.items():
                d[k] = d.get(k, 0) + x
    # limits are per shard per space: the use nearest its limit is the highest of any shard
    space_use: dict[str, dict[str, int]] = {}
    for v in vs:
        for sp, d in v.space_use.items():
            m = space_use.setdefault(sp, {})
            for k, x in d.items():
                m[k] = max(m.get(k, 0), x)
    merged = msgspec.structs.replace(
        first, runs=runs, tasks=tasks, actors=actors, entities=sum(v.entities for v in vs), space_use=space_use,
        connections=sum(v.connections for v in vs), fsyncs=sum(v.fsyncs for v in vs),
        fsync_seconds=sum(v.fsync_seconds for v in vs), tree_depth=max(v.tree_depth for v in vs))
    return p.encoder.encode(merged)


def _merge_scope_list(op: p.ScopeList, parts: list[bytes]) -> bytes:
    vs = [msgspec.msgpack.decode(b, type=p.ScopeListView) for b in parts]
    scopes = [s for v in vs for s in v.scopes]
    scopes.sort(key=lambda s: s.id, reverse=op.order == "desc")
    return p.encoder.encode(p.ScopeListView(scopes=scopes[: op.limit]))


def _merge_messages(op: p.MailboxMessages, parts: list[bytes]) -> bytes:
    vs = [msgspec.msgpack.decode(b, type=p.TaskListView) for b in parts]
    tasks_ = sorted((x for v in vs for x in v.tasks), key=lambda x: x.id, reverse=True)
    return p.encoder.encode(p.TaskListView(tasks=tasks_[: op.limit]))


def _merge_overview(op: p.OpsOverview, parts: list[bytes]) -> bytes:
    vs = [msgspec.msgpack.decode(b, type=p.OverviewView) for b in parts]
    first = vs[0]
    waits: dict[str, dict[str, int]] = {}
    events: dict[str, int] = {}
    tasks_by_state: dict[str, int] = {}
    retention: dict[str, Any] = {}
    for v in vs:
        for kind, d in v.waits.items():
            w = waits.setdefault(kind, {})
            for k, x in d.items():
                w[k] = w.get(k, 0) + x
        # each shard numbers its own events: ``newest`` summed is how many the space
        # has (the shards' oldest kept have no sum; the merged view leaves it out)
        for k, x in v.events.items():
            if k != "oldest":
                events[k] = events.get(k, 0) + x
        for k, x in v.tasks.items():
            tasks_by_state[k] = tasks_by_state.get(k, 0) + x
        for k, x in v.retention.items():  # counts add up; the setting (retain_ms) is every shard's
            num = isinstance(x, (int, float)) and not isinstance(x, bool) and k != "retain_ms"
            retention[k] = retention.get(k, 0) + x if num else retention.get(k, x)
    runs_ = sorted((r for v in vs for r in v.runs), key=lambda r: r.id, reverse=True)[: op.limit]
    queues: dict[str, Any] = {}
    for v in vs:
        for q in v.queues:
            cur = queues.get(q.name)
            if cur is None:
                queues[q.name] = q
                continue
            # issue 44: the backlogs add up; the largest keys are re-cut from the shards'
            # (each shard's own largest: a key large only when summed may be missed)
            keys = _add_counts(cur.ready_top_keys, q.ready_top_keys)
            top = dict(sorted(keys.items(), key=lambda kc: (-kc[1], kc[0]))[:p.OVERVIEW_TOP_KEYS])
            queues[q.name] = msgspec.structs.replace(
                _sum_struct(cur, q), ready_by_priority=_add_counts(cur.ready_by_priority, q.ready_by_priority),
                ready_top_keys=top)
    return p.encoder.encode(msgspec.structs.replace(
        first, runs=runs_, runs_active=sum(v.runs_active for v in vs), queues=list(queues.values()),
        groups=[g for v in vs for g in v.groups], groups_open=sum(v.groups_open for v in vs), waits=waits,
        events=events, entities=sum(v.entities for v in vs), tasks=tasks_by_state, retention=retention))


def _merge_waits(op: p.OpsWaits, parts: list[bytes]) -> bytes:
    vs = [msgspec.msgpack.decode(b, type=p.OpsWaitsView) for b in parts]
    parked: dict[str, int] = {}
    for v in vs:
        for k, x in v.parked.items():
            parked[k] = parked.get(k, 0) + x
    return p.encoder.encode(p.OpsWaitsView(parked=parked, waiting=[w for v in vs for w in v.waiting]))


def _merge_items(op: p.OpsItems, parts: list[bytes]) -> bytes:
    """The console's lists of a whole space over every shard: each list in the order
    one shard gives it (tasks, groups, join sets newest first; barriers and timers
    oldest first; ids sort by creation), at most ``op.limit`` rows; a work queue's
    counts summed over the shards, its oldest ready task the oldest of any."""
    vs = [msgspec.msgpack.decode(b, type=p.OpsItemsView) for b in parts]
    out: dict[str, list] = {}
    for f, newest_first in (("tasks", True), ("groups", True), ("joinsets", True), ("barriers", False),
                            ("timers", False), ("claims", False), ("grants", False)):
        rows = sorted((r for v in vs for r in getattr(v, f)), key=lambda r: r.id, reverse=newest_first)
        out[f] = rows[: op.limit]
    queues: dict[str, Any] = {}
    for v in vs:
        for q in v.queues:
            cur = queues.get(q.name)
            if cur is None:
                queues[q.name] = q
                continue
            ready = [x for x in (cur.oldest_ready_at, q.oldest_ready_at) if x is not None]
            queues[q.name] = msgspec.structs.replace(cur, queued=cur.queued + q.queued, running=cur.running + q.running,
                                                     done=cur.done + q.done,
                                                     oldest_ready_at=min(ready) if ready else None)
    return p.encoder.encode(p.OpsItemsView(**out, queues=sorted(queues.values(), key=lambda q: q.name)[: op.limit]))


def _merge_any(op: Any, parts: list[bytes]) -> bytes:
    """Every shard gives the same answer (the slot map; a release every shard applies)."""
    return parts[0]


def _merge_events(op: Any, parts: list[bytes]) -> bytes:
    raise ValidationError("the events of a whole space of a cluster of several shards are one list per shard "
                          "(each numbers its own events): use rs.events.list(), which merges them with a "
                          "cursor per shard")


def _merge_by_the_router(op: Any, parts: list[bytes]) -> bytes:
    # (the router sends these itself, before any fan-out: ShardedTransport._route)
    raise AssertionError(f"{op.__struct_config__.tag} is merged by ShardedTransport, not from parts")


#: How the parts of an op every shard answers merge into one answer, by the name its
#: ``@op(..., merge=NAME)`` declares (:mod:`rallypoint.actors.opmark`). An op cannot be
#: declared to fan out without a merge (``build_table`` refuses it), and
#: tests/test_op_facts.py checks that every declared name is here.
MERGES: dict[str, Callable[[Any, list[bytes]], bytes]] = {
    "server.status": _merge_server_status,
    "scope.list": _merge_scope_list,
    "mailbox.messages": _merge_messages,
    "ops.overview": _merge_overview,
    "ops.waits": _merge_waits,
    "ops.items": _merge_items,
    "any": _merge_any,
    "events": _merge_events,
    "mailbox.ensure": _merge_by_the_router,  # the home shard first, then adopted by the others
    "mailbox.read": _merge_by_the_router,  # the home shard's view, counts summed
}


def _merge_every(op: Any, parts: list[bytes]) -> bytes:
    """One answer from every shard's part, as the op's declared merge says."""
    name = _table().merges.get(type(op))
    merge = MERGES.get(name) if name is not None else None
    if merge is None:
        raise ValidationError(f"{op.__struct_config__.tag} cannot be merged over shards")
    return merge(op, parts)


def _add_counts(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    """Two ``name -> count`` maps summed key by key (a's order, then b's new keys)."""
    out = dict(a)
    for k, n in b.items():
        out[k] = out.get(k, 0) + n
    return out


def _sum_struct(a: Any, b: Any) -> Any:
    """Field-wise sum of two views of one queue (numbers add up; the rest is a's)."""
    out = {}
    for f in a.__struct_fields__:
        x, y = getattr(a, f), getattr(b, f)
        out[f] = x + y if isinstance(x, (int, float)) and not isinstance(x, bool) and isinstance(y, (int, float)) else x
    return msgspec.structs.replace(a, **out)


async def open_transport(first: Any, urls: list[str], open_shard, space: str) -> Any:
    """``first`` (a transport to any node) as it is when the cluster has one shard, or a
    :class:`ShardedTransport` over every shard when its slot map has several."""
    st = ShardedTransport(urls, first, open_shard, space)
    try:
        await st.start()
    except RallypointError as e:
        if e.code in ("NOT_FOUND", "VALIDATION_FAILED"):  # an older server: no cluster.map
            return first
        raise
    if not st.sharded:
        return first
    return st
