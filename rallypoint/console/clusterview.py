"""The console on a node of a cluster (``serve --cluster ... --console HOST:PORT``).

Any node serves it, whatever its role (a standby too): the pages are the single node's
(:mod:`rallypoint.console.pages`), over a :class:`ClusterConsoleService` instead of the
node's own service, plus the cluster's health page (``/cluster``).

- **Reads** go to the shards' leaders over the native protocol, through the cluster's
  router (:class:`rallypoint.client.router.ShardedTransport`, one per login's key and
  space, made by :class:`rallypoint.cluster.httproute.HttpRouter`): an op about an id to
  its shard, a list or a view of the space to every shard, merged -- the same routing and
  merges the SDK uses. Each call is made **under the login's own API key**: the owning
  shard authenticates it and checks its permission and revocation itself, exactly as for
  a native client (the node secret is never used for a login). The console still runs
  only reads (``ConsoleApp.call``).
- **Keys** (:class:`ClusterKeys`): the sign-in form's key is checked against the
  cluster's key records in etcd (:mod:`rallypoint.cluster.keystore`, watched: a revoke
  reaches the console within one watch round trip, ends the key's console sessions at
  their next request and its open streams at once), as a single node checks its own
  table. The secret typed at sign-in is kept in this process's memory only, by key id,
  to make the login's calls (as the HTTP router keeps the keys of its callers), and
  dropped when the key is revoked.
- **Live events** (:class:`MergedSink`): one subscription per shard merged by
  :class:`rallypoint.client.shardevents.MergedWatch` (a cursor per shard). Each
  ``events`` message carries the vector cursor (``"0:120,1:45,2:9"``), also as the SSE
  ``id``: a browser that reconnects sends it back (``Last-Event-ID``) and the stream
  goes on after it, per shard. When a shard's leader changes the shard's subscription
  is opened again at the new leader *from its position*, so nothing is missed or
  doubled; the stream says so (``cluster`` messages: the failover, then the resume).
- **Health** (:class:`ClusterState`): every shard's leader, epoch, members and in-sync
  set as etcd holds them (one watch of the cluster's ``shards/`` prefix, as the nodes'
  own), the failovers seen since the console started (a leader key gone or replaced),
  and, from each leader's ``server.status`` read under the login's key, its standby's
  state and lag and how long it has led -- shown when the key may see server-wide
  figures (open mode, an ``operator`` key), else said to need one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import msgspec
import trio

from .. import protocol as p
from ..actors.keys import hash_secret
from ..errors import RallypointError, UnauthenticatedError, UnavailableError, ValidationError

log = logging.getLogger("rallypoint.console")

__all__ = ["ClusterKeys", "ClusterState", "Failover", "ClusterConsoleService", "MergedSink", "cluster_page",
           "serve_cluster_console", "event_view", "merge_recent"]

#: events held per shard by a merged stream before that shard's subscription is re-opened
STREAM_BUFFER = 2000
#: failovers remembered for the health page
MAX_FAILOVERS = 100

_encode = msgspec.msgpack.Encoder().encode
_event_decode = msgspec.msgpack.Decoder(p.EventView).decode


def _iso(dt) -> str:
    """A datetime as the protocol's instant text (UTC, ms, ``Z``)."""
    from datetime import timezone

    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def event_view(e) -> p.EventView:
    """An SDK :class:`~rallypoint.client.types.Event` (what the merge returns) as the
    protocol's EventView the console's pages and stream show."""
    return p.EventView(seq=e.seq, type=e.type, kind=e.kind, id=e.id, at=_iso(e.at), run=e.run, data=e.data,
                       shard=e.shard)


# ============================================================================ keys
class _Key(msgspec.Struct, frozen=True):
    id: str
    space: str
    permissions: list[str]
    name: str | None = None


class ClusterKeys:
    """The cluster's API keys as etcd holds them, for the console's sign-in: the
    interface of the coordinator's key table the console uses (``open_mode``,
    ``authenticate``, ``is_revoked``). ``apply(records, deleted)`` takes what
    :func:`rallypoint.cluster.keystore.watch_keys` yields. A record deleted by hand
    revokes nothing, as on the shards."""

    def __init__(self) -> None:
        self.table: dict[str, Any] = {}  # key id -> KeyRecord
        self.by_hash: dict[str, str] = {}
        #: key id -> the secret typed at a sign-in (memory only; dropped on revocation)
        self.secrets: dict[str, str] = {}
        self._revoked: dict[str, trio.Event] = {}

    @property
    def open_mode(self) -> bool:
        """True only while the cluster has no key at all (as a shard: revoking every key
        does not reopen it)."""
        return not self.table

    def apply(self, records: list, deleted: list[str]) -> None:
        """Take key records (new, or revoked) from etcd. ``deleted`` is ignored: a record
        deleted by hand revokes nothing."""
        for rec in records:
            old = self.table.get(rec.id)
            if old is not None and old.revoked_at_ms is not None:
                continue  # (a revocation is never undone)
            self.table[rec.id] = rec
            self.by_hash[rec.secret_sha256] = rec.id
            if rec.revoked_at_ms is not None:
                self.secrets.pop(rec.id, None)
                ev = self._revoked.get(rec.id)
                if ev is not None:
                    ev.set()

    def is_revoked(self, key_id: str) -> bool:
        k = self.table.get(key_id)
        return k is None or k.revoked_at_ms is not None

    def authenticate(self, secret: str | None) -> _Key | None:
        """The live key for ``secret`` (None in open mode); it is remembered to make the
        login's calls. Raises UNAUTHENTICATED for a missing, unknown or revoked key."""
        if self.open_mode:
            return None
        if not secret:
            raise UnauthenticatedError("this cluster requires an API key")
        kid = self.by_hash.get(hash_secret(secret))
        rec = self.table.get(kid) if kid else None
        if rec is None or rec.revoked_at_ms is not None:
            raise UnauthenticatedError("unknown or revoked API key")
        self.secrets[rec.id] = secret
        return _Key(id=rec.id, space=rec.space, permissions=list(rec.permissions), name=rec.name)

    def revoked(self, key_id: str) -> trio.Event:
        """An event set when ``key_id`` is revoked (set already if it is)."""
        ev = self._revoked.get(key_id)
        if ev is None:
            ev = self._revoked[key_id] = trio.Event()
        if self.is_revoked(key_id):
            ev.set()
        return ev


class _Coordinator:
    """What the console asks of a coordinator: its keys."""

    def __init__(self, keys: ClusterKeys) -> None:
        self.keys = keys


# ============================================================================ health
@dataclass(frozen=True)
class Failover:
    """A change of a shard's leader seen by the console: ``at`` (seconds since the
    epoch), ``shard``, the leader before (``old``/``old_epoch``, None: none) and after
    (``new``/``new_epoch``, None: the leader key is gone and none took it yet)."""

    at: float
    shard: int
    old: str | None
    old_epoch: int | None
    new: str | None
    new_epoch: int | None

    def text(self) -> str:
        """One line for the page."""
        was = f"{self.old} (epoch {self.old_epoch})" if self.old else "no leader"
        if self.new is None:
            return f"shard {self.shard}: leader {was} is gone; waiting for a standby to take over"
        return f"shard {self.shard}: {was} → {self.new} (epoch {self.new_epoch})"


class ClusterState:
    """Every shard's leader and replica set as etcd holds them, kept by :meth:`apply`
    (a leader or replicas key put or deleted), and the failovers seen since start
    (``failovers``, newest last, at most :data:`MAX_FAILOVERS`). :meth:`wait_change`
    returns at the next change."""

    def __init__(self) -> None:
        self.leaders: dict[int, Any] = {}  # shard -> LeaderRecord
        self.replicas: dict[int, Any] = {}  # shard -> Replicas
        self.failovers: list[Failover] = []
        self.seen = False  # the first full read happened
        self._gone: dict[int, Any] = {}  # shard -> its leader record whose key went (until one takes over)
        self._changed = trio.Event()

    def apply(self, shard: int, what: str, record: Any, *, now: float | None = None) -> Failover | None:
        """A ``leader`` or ``replicas`` key of ``shard`` put (``record``) or deleted
        (None). A leader key gone or naming another node or epoch after the first read is
        a failover (returned and kept)."""
        out = None
        if what == "leader":
            old = self.leaders.get(shard)
            if record is None:
                self.leaders.pop(shard, None)
            else:
                self.leaders[shard] = record
            same = (old is None and record is None) or (old is not None and record is not None
                                                       and old.epoch == record.epoch)
            if record is None and old is not None:
                self._gone[shard] = old
            elif record is not None and old is None:
                old = self._gone.pop(shard, None)  # a takeover after the key went: from whom
            if self.seen and not same:
                out = Failover(at=time.time() if now is None else now, shard=shard,
                               old=old.info.node if old else None, old_epoch=old.epoch if old else None,
                               new=record.info.node if record else None, new_epoch=record.epoch if record else None)
                self.failovers.append(out)
                del self.failovers[:-MAX_FAILOVERS]
        elif what == "replicas":
            if record is None:
                self.replicas.pop(shard, None)
            else:
                self.replicas[shard] = record
        ev, self._changed = self._changed, trio.Event()
        ev.set()
        return out

    async def wait_change(self) -> None:
        await self._changed.wait()

    def last_failover(self, shard: int) -> Failover | None:
        for f in reversed(self.failovers):
            if f.shard == shard:
                return f
        return None


def _shard_key(prefix: str, key: bytes) -> tuple[int, str] | None:
    parts = key.decode(errors="replace")[len(prefix):].split("/")
    if len(parts) == 2 and parts[0].isdigit() and parts[1] in ("leader", "replicas"):
        return int(parts[0]), parts[1]
    return None


async def watch_shards(client, cluster: str, state: ClusterState, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Keep ``state`` as etcd's ``/rallypoint/<cluster>/shards/`` prefix says: one read,
    then one watch (read again after a compaction or a lost watch)."""
    from ..cluster.etcd import EtcdCompactedError, EtcdError
    from ..cluster.leader import _leader_record, _replicas_record

    prefix = f"/rallypoint/{cluster}/shards/"

    def record(shard: int, what: str, kv):
        return _leader_record(str(shard), kv) if what == "leader" else _replicas_record(str(shard), kv).replicas

    started = False
    while True:
        try:
            r = await client.range(prefix, prefix=True)
            got = {}
            for kv in r.kvs:
                sk = _shard_key(prefix, kv.key)
                if sk is not None:
                    got[sk] = record(*sk, kv)
            for sk in [(s, "leader") for s in list(state.leaders)] + [(s, "replicas") for s in list(state.replicas)]:
                if sk not in got:
                    state.apply(*sk, None)
            for sk, rec in sorted(got.items()):
                state.apply(*sk, rec)
            state.seen = True
            if not started:
                started = True
                task_status.started()
            async with client.watch(prefix, prefix=True, start_revision=r.revision + 1) as events:
                async for ev in events:
                    sk = _shard_key(prefix, ev.kv.key)
                    if sk is None:
                        continue
                    state.apply(*sk, None if ev.type == "DELETE" else record(*sk, ev.kv))
        except EtcdCompactedError:
            continue
        except EtcdError as e:
            log.warning("console: watching the cluster's shards in etcd failed (%s); again", e.message)
            await trio.sleep(0.5)


# ============================================================================ the service
class _OneShard:
    """A cluster of one shard (no slot map): the router's interface over that shard's
    leader alone."""

    def __init__(self, link, shard: int) -> None:
        self.link = link
        self.shard = shard
        self.map = None
        self.sharded = False

    async def call(self, op):
        return await self.link.call(op)

    def event_shards(self, op) -> list[int]:
        return [self.shard]

    async def call_shard(self, shard: int, op):
        return await self.link.call(op)

    async def subscribe_shard(self, shard: int, op, max_events: int = 10_000):
        return await self.link.subscribe(op, max_events)

    def shard_closed(self, shard: int) -> bool:
        return False


class ClusterConsoleService:
    """What :class:`~rallypoint.console.app.ConsoleApp` needs of a service, over the
    whole cluster (see the module docstring). ``member``: this node's
    :class:`~rallypoint.cluster.member.ShardMember` (its etcd access, its watch of the
    slot map and the leaders). Run :meth:`run` (in a nursery: ``await
    nursery.start(service.run)``) before serving: it reads the keys and the shards
    from etcd, then keeps them."""

    #: the console's stream takes ``resume`` (a vector cursor) and its sink says the cursor
    merged = True

    def __init__(self, member) -> None:
        from ..cluster.httproute import HttpRouter

        self.member = member
        self.keys = ClusterKeys()
        self.coordinator = _Coordinator(self.keys)
        self.state = ClusterState()
        self.router = HttpRouter(member, None)
        self._single: dict[tuple, _OneShard] = {}
        #: extra pages and nav entries of the console
        self.routes = [(("cluster",), cluster_page)]
        self.nav = (("cluster", "/cluster", "Cluster"),)

    # ------------------------------------------------------------------ lifecycle
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Read the keys and the shards from etcd, then watch both (until cancelled)."""
        from ..cluster.keystore import watch_keys

        cluster = self.member.config.cluster
        keys_read = trio.Event()

        async def keys_loop(etcd) -> None:
            from ..cluster.etcd import EtcdError

            while True:
                try:
                    async for recs, deleted in watch_keys(etcd, cluster):
                        self.keys.apply(recs, deleted)
                        keys_read.set()
                except EtcdError as e:
                    log.warning("console: watching the cluster's keys in etcd failed (%s); again", e.message)
                    await trio.sleep(0.5)

        try:
            async with self.member.make_etcd() as etcd, trio.open_nursery() as nursery:
                nursery.start_soon(keys_loop, etcd)
                await nursery.start(watch_shards, etcd, cluster, self.state)
                await keys_read.wait()
                task_status.started()
        finally:
            with trio.CancelScope(shield=True):
                for one in self._single.values():
                    await one.link.aclose()
                await self.router.aclose()

    # ------------------------------------------------------------------ routing
    def secret_of(self, session) -> str | None:
        """The API key secret a login's calls are made with (None in open mode).
        UNAUTHENTICATED when the key is revoked (or its secret was dropped)."""
        if session.key_id is None:
            if not self.keys.open_mode:
                raise UnauthenticatedError("open mode ended: sign in with an API key")
            return None
        secret = self.keys.secrets.get(session.key_id)
        if secret is None or self.keys.is_revoked(session.key_id):
            raise UnauthenticatedError("the key was revoked; sign in again")
        return secret

    async def transport(self, session):
        """The router for the login's key and space: a ShardedTransport over every
        shard (a sharded cluster), else the one shard's leader."""
        secret = self.secret_of(session)
        st = await self.router.transport(secret, session.space)
        if st.sharded:
            return st
        k = (secret, session.space)
        one = self._single.get(k)
        if one is None:
            from ..cluster.httproute import _ShardLink

            from ..cluster.httproute import MAX_KEYS

            shard = st.map.shards[0].shard if st.map is not None and st.map.shards else self.member.config.shard
            while len(self._single) >= MAX_KEYS:  # (as the router's pools: the oldest key's link goes)
                await self._single.pop(next(iter(self._single))).link.aclose()
            one = self._single[k] = _OneShard(_ShardLink(self.router, secret, shard, session.space), shard)
        return one

    async def call(self, session, op) -> bytes:
        """``op`` (a read) routed to the shard(s) that answer it, as the login's key:
        the reply body, or the RallypointError a shard answered."""
        t = await self.transport(session)
        try:
            if isinstance(op, p.EventsList) and len(t.event_shards(op)) > 1:
                # one entity's events (a page's history): its shard numbers them all
                got = self.where(op.aggregate.rsplit(":", 1)[-1]) if op.aggregate else None
                if got is None:
                    raise ValidationError("events over a whole space of several shards are read per shard "
                                          "(recent_events)")
                return bytes(await t.call_shard(got[0], op))
            return bytes(await t.call(op))
        except RallypointError as e:
            if e.code == "WRONG_SHARD":  # the map moved under us: the page reloads later
                raise UnavailableError(e.message, retry_after=0.5) from None
            raise

    async def subscribe(self, session, op: p.EventsWatch, *, max_bytes: int = 1 << 20,
                        resume: str | None = None) -> "MergedSink":
        """The login's live events over every shard (or the run's shard), merged;
        ``resume``: a vector cursor a stream gave (from after it, per shard; else from
        now). VALIDATION_FAILED for a cursor that is not this cluster's."""
        t = await self.transport(session)
        keys_revoked = self.keys.revoked(session.key_id) if session.key_id is not None else None
        w = _ReopenCounting(t, op, resume or None, STREAM_BUFFER)
        sink = MergedSink(w, self, keys_revoked)
        await w.open()
        return sink

    async def recent_events(self, session, flt: dict, n: int) -> list[p.EventView]:
        """The last ``n`` events of the space that match ``flt`` (EventsList filters),
        among the last 2,000 each shard keeps, merged by instant, oldest first."""
        t = await self.transport(session)
        op = p.EventsList(limit=2000, **flt)
        shards = t.event_shards(op)
        got: dict[int, list] = {}

        async def one(s: int) -> None:
            head = msgspec.msgpack.decode(await t.call_shard(s, p.EventsList(limit=1, cursor=None)),
                                          type=p.EventPageView)
            start = max(head.oldest - 1, head.newest - 2000, 0)
            page = msgspec.msgpack.decode(await t.call_shard(s, msgspec.structs.replace(op, cursor=start)),
                                          type=p.EventPageView)
            got[s] = [_event_decode(bytes(r)) for r in page.events]

        async with trio.open_nursery() as nursery:
            for s in shards:
                nursery.start_soon(one, s)
        return merge_recent(got, n)

    async def shard_status(self, session) -> dict[int, Any]:
        """Each shard's leader's ``server.status`` as the login's key sees it: shard ->
        ServerStatusView, or the RallypointError it answered."""
        t = await self.transport(session)
        m = getattr(t, "map", None)
        shards = sorted(set(m.owners)) if m is not None and m.owners else [getattr(t, "shard", 0)]
        out: dict[int, Any] = {}

        async def one(s: int) -> None:
            try:
                out[s] = msgspec.msgpack.decode(await t.call_shard(s, p.ServerStatus()), type=p.ServerStatusView)
            except RallypointError as e:
                out[s] = e

        async with trio.open_nursery() as nursery:
            for s in shards:
                nursery.start_soon(one, s)
        return out

    def where(self, entity_id: str) -> tuple[int, str | None] | None:
        """``(shard, leader node)`` serving an entity id (its slot's shard as the slot map
        says; the node as etcd says: None while it has no leader); None for a string
        that is not an id."""
        from ..ids import slot_of

        m = self.member.slotmap
        try:
            shard = m.owners[slot_of(entity_id)] if m is not None and m.owners else self.member.config.shard
        except (ValueError, IndexError, KeyError):
            return None
        rec = self.state.leaders.get(shard)
        return shard, rec.info.node if rec is not None else None


def merge_recent(by_shard: dict[int, list], n: int) -> list:
    """Events of several shards (each list oldest first) as one list ordered by
    (instant, shard, seq) -- the merge order of :mod:`rallypoint.client.shardevents` --,
    the last ``n``."""
    every = [(e.at, s, e.seq, e) for s, evs in by_shard.items() for e in evs]
    every.sort(key=lambda x: x[:3])
    return [x[3] for x in every[-n:]] if n > 0 else []


def _merged_watch():
    from ..client.shardevents import MergedWatch

    return MergedWatch


class _ReopenCounting(_merged_watch()):
    """A :class:`~rallypoint.client.shardevents.MergedWatch` that notes each shard
    subscribed *again* (after its subscription ended: a failover, a slow consumer) and
    the position it went on after (``reopened``: ``[(shard, seq)]``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reopened: list[tuple[int, int | None]] = []

    async def _open_one(self, w) -> None:
        again = w.backlog != -1  # subscribed before
        await super()._open_one(w)
        if again:
            self.reopened.append((w.shard, w.recv))


class MergedSink:
    """The console stream's subscription on a cluster: ``next_batch()`` -> the next
    events (encoded EventViews, merge order), ``cursor`` (the vector position after the
    last one returned), ``close()``; :meth:`watch_cluster` sends the stream's
    ``cluster`` messages. A revoked key ends it (UNAUTHENTICATED) at once."""

    MAX_BATCH = 500

    def __init__(self, watch, service: ClusterConsoleService, revoked: trio.Event | None) -> None:
        self.watch = watch
        self.service = service
        self.revoked = revoked

    @property
    def cursor(self) -> str | None:
        return self.watch.cursor

    async def next_batch(self) -> list[bytes]:
        """Wait for the next event(s); UNAUTHENTICATED once the key is revoked (even with
        events waiting), the merge's error (naming its shard) otherwise.

        Cancel-safe: only the wait is done in the nursery that also watches for the
        revocation; the events are taken after it, with no checkpoint between taking them
        and returning them, so a call cancelled (the stream's ``move_on_after(0)`` for
        what is buffered, a time-out) takes nothing."""
        while True:
            if self.revoked is not None and self.revoked.is_set():
                raise UnauthenticatedError("the key was revoked", details={"reason": "key_revoked"})
            first = self.watch.ready()
            if first is not None:
                break
            if self.watch.closed:
                raise UnavailableError("the stream was closed")
            err: list = []
            async with trio.open_nursery() as nursery:
                async def fill() -> None:
                    try:
                        await self.watch.fill()
                    except RallypointError as e:
                        err.append(e)
                    nursery.cancel_scope.cancel()

                async def revoked() -> None:
                    await self.revoked.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(fill)
                if self.revoked is not None:
                    nursery.start_soon(revoked)
            if err:
                raise err[0]
        got = [first]
        while len(got) < self.MAX_BATCH:
            e = self.watch.ready()
            if e is None:
                break
            got.append(e)
        return [_encode(event_view(e)) for e in got]

    def resumes(self) -> list[tuple[int, int | None]]:
        """Shards subscribed again (at their leader of now) since the last call, each
        with the position it went on after: ``[(shard, seq)]``."""
        out, self.watch.reopened = self.watch.reopened, []
        return out

    async def watch_cluster(self, emit) -> None:
        """Send a ``cluster`` message at each failover etcd shows, and one each time a
        shard's subscription was opened again (at its new leader, from its position):
        ``{"text", "shard", "leader", "epoch", "cursor", "resumed"}``."""
        state = self.service.state
        seen = len(state.failovers)
        while True:
            with trio.move_on_after(0.25):  # (a resume shows as a counter; checked 4 times a second)
                await state.wait_change()
            new = state.failovers[seen:]
            seen = len(state.failovers)
            for f in new:
                await emit("cluster", {"text": f.text(), "shard": f.shard, "leader": f.new, "epoch": f.new_epoch,
                                       "at": f.at, "cursor": self.cursor})
            for shard, pos in self.resumes():
                rec = state.leaders.get(shard)
                at = f"{rec.info.node} (epoch {rec.epoch})" if rec is not None else "its leader"
                await emit("cluster", {"text": f"shard {shard}: the live stream resumed at {at} after event "
                                               f"{shard}:{pos} (from its own position: nothing missed, nothing twice)",
                                       "resumed": shard, "cursor": self.cursor})

    def close(self) -> None:
        self.watch.close()


# ============================================================================ the health page
async def cluster_page(ctx):
    """``/cluster``: every shard's leader, epoch, members, in-sync set, standby lag and
    last failover, and the failovers seen (live)."""
    from . import pages
    from .pages import Page, Part, h, table, tr

    service = ctx.app.service
    if not isinstance(service, ClusterConsoleService):
        raise RallypointError("this console serves a single node, not a cluster", code="NOT_FOUND")
    state = service.state
    member = service.member

    async def shards() -> str:
        from ..actors.api import OPS

        if OPS[p.ServerStatus].permission != "coordination_read":  # (ConsoleApp.call's rule)
            raise RallypointError("server.status is not a read", code="INTERNAL")
        status = await service.shard_status(ctx.session)
        m = member.slotmap
        owned: dict[int, int] = {}
        for s in (m.owners if m is not None else []):
            owned[s] = owned.get(s, 0) + 1
        every = sorted(set(status) | set(state.leaders) | set(state.replicas))
        rows = []
        for s in every:
            rec = state.leaders.get(s)
            reps = state.replicas.get(s)
            st = status.get(s)
            cv = st.cluster if isinstance(st, p.ServerStatusView) else None
            if cv is not None and cv.standby is not None:
                sb = cv.standby
                standby = (f'{h(sb.node)} {pages.badge(sb.state.upper())} <span class="lag" data-lag="{sb.lag_records}">'
                           f'{h(sb.lag_records)} records behind</span>, last ack {h(round(sb.since_progress_s, 1))} s ago')
            elif cv is not None:
                standby = '<span class="muted">none connected</span>'
            elif isinstance(st, RallypointError):
                standby = f'<span class="error">{h(st.code)}: {h(st.message)}</span>'
            else:
                standby = '<span class="muted">— (server-wide figures need an operator key)</span>'
            last = state.last_failover(s)
            if last is not None:
                lf = f'{pages.when(_iso_at(last.at))} {h(last.text())}'
            elif cv is not None and cv.leading_for_s is not None:
                lf = f'none seen; {h(rec.info.node if rec else "?")} has led for {h(pages.duration(cv.leading_for_s))}'
            else:
                lf = '<span class="muted">none since this console started</span>'
            leader = (f'<b>{h(rec.info.node)}</b> <span class="muted">{h(rec.info.client_address)}</span>' if rec
                      else pages.badge("NO LEADER"))
            rows.append(tr(h(s), h(owned.get(s, "—")), leader, f'<span class="epoch">{h(rec.epoch if rec else "—")}'
                           '</span>', h(", ".join(reps.members)) if reps else "—",
                           h(", ".join(reps.isr)) if reps else "—", standby, lf,
                           attrs=f' data-shard="{s}" data-leader="{h(rec.info.node if rec else "")}" '
                                 f'data-epoch="{h(rec.epoch if rec else 0)}"'))
        me = member.config
        intro = (f'<p>Served by node <b>{h(me.node)}</b> of shard {h(me.shard)} ({h(member.role)}); cluster '
                 f'<b>{h(me.cluster)}</b>, slot map version {h(m.version if m else 0)}.</p>')
        return intro + table(["Shard", "Slots", "Leader", "Epoch", "Members", "In sync", "Standby (lag)",
                              "Last failover"], rows, "no shards", "shards")

    async def failovers() -> str:
        rows = [tr(pages.when(_iso_at(f.at)), h(f.shard), h(f.old or "—"), h(f.old_epoch or "—"), h(f.new or "—"),
                   h(f.new_epoch or "—"), attrs=f' data-shard="{f.shard}"')
                for f in reversed(state.failovers)]
        return "<h2>Failovers seen</h2>" + table(["At", "Shard", "Leader before", "Epoch", "Leader after", "Epoch"],
                                                  rows, "none since this console started", "failovers")

    return Page("Cluster", "cluster", [Part("shards", shards, "tick"), Part("failovers", failovers, "changed")],
                stream=urlencode({"types": "scope.created", "stats": "1"}))


def _iso_at(t: float) -> str:
    from datetime import datetime, timezone

    return _iso(datetime.fromtimestamp(t, timezone.utc))


def where_html(ctx, entity_id: str) -> str:
    """A small "shard S · node" label for an entity on a cluster's console ("" on a
    single node's)."""
    where = getattr(ctx.app.service, "where", None)
    if where is None:
        return ""
    got = where(entity_id)
    if got is None:
        return ""
    from .pages import h

    shard, node = got
    return (f' <span class="where" data-shard="{shard}" title="served by shard {shard}\'s leader">shard {shard} · '
            f'{h(node or "no leader")}</span>')


# ============================================================================ serving
async def serve_cluster_console(member, host: str, port: int, *, insecure: bool = False, loopback: bool = True,
                                task_status=trio.TASK_STATUS_IGNORED, **options) -> None:
    """``serve --cluster ... --console HOST:PORT``: a :class:`ClusterConsoleService`
    over ``member`` (run here), then :func:`rallypoint.console.serve_console` over it
    with ``options`` (TLS, limits, ``hosts`` for the Host check, ``shutdown``).
    ``task_status.started`` gets ``(app, urls)``. Raises VALIDATION_FAILED when the
    cluster has no API key, the address is not loopback (``loopback`` False) and
    ``insecure`` is not given -- as a single node refuses it."""
    from .app import serve_console

    service = ClusterConsoleService(member)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        if service.keys.open_mode and not loopback and not insecure:
            raise ValidationError(f"refusing to serve the console on {host} without API keys (the cluster has none "
                                  "in etcd); pass --insecure to serve this address without authentication")
        got = await nursery.start(lambda task_status: serve_console(service, host, port, task_status=task_status,
                                                                    **options))
        task_status.started(got)
