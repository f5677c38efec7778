"""The HTTP API of a sharded cluster through any node: routing inside the node.

The runstate SDK knows nothing of shards: it sends every request to one base URL. A
node of a sharded cluster therefore routes each HTTP request's operations itself, by
the shard fact each op declares with its ``@op`` (:class:`rallypoint.actors.opmark.Shard`,
the same facts the native SDK's router :class:`rallypoint.client.router.ShardedTransport`
reads). :func:`decide` says where one op goes:

- ``LOCAL``: this shard owns it (every slot it names is owned here; a new root run this
  shard takes; a per-shard store, ``"here"``) -- run as on a single node;
- ``("shard", S)``: shard ``S`` owns it. When it is the request's *first* operation
  (nothing applied yet) the whole HTTP request -- method, path, body, bearer key,
  ``Idempotency-Key`` -- is forwarded to ``S``'s leader's HTTP address and its answer
  returned unchanged (:meth:`HttpRouter.forward`): the request then runs there as on a
  single node, its idempotency answer stored on the shard that applied it. A later
  operation of a request (a request that already ran something here) is sent over the
  native protocol instead (:meth:`HttpRouter.call`);
- ``FANOUT``: every shard answers its part (lists, server status, a work queue's view
  and definition, a list of ids over several shards): sent through a
  :class:`~rallypoint.client.router.ShardedTransport` that splits and merges, over
  native connections to every shard's leader.

A new root run goes to the shards in turn; with an ``Idempotency-Key`` to the shard the
key hashes to, so a retry of the request reaches the shard that stored its answer.

**Identity**: a native call made for a request is made *under the caller's own API
key* (one pooled connection per key and shard, :class:`_KeyPool`): the owning shard
authenticates the key and checks its permissions and revocation itself, exactly as for
a native client; the cluster's node secret (which only makes the calls between shards)
is never used on a caller's behalf. A forwarded HTTP request carries the caller's
``authorization`` header likewise, plus ``x-rallypoint-routed`` (a routed request is
never forwarded again: its operations go native, and a new root run stays where it was
sent).

**The routed mark is a node's signature**: ``x-rallypoint-routed`` holds a node token
(:func:`rallypoint.cluster.peerauth.make_token`, purpose ``"http"``) over the cluster,
the forwarding node, ``METHOD <raw path?query>`` as sent and the body, made with the
cluster's node secret. The receiving leader honours it only when its
:class:`~rallypoint.cluster.peerauth.TokenVerifier` (one per node, so a token is taken
once, within 60 s of its making) accepts it (:meth:`HttpRouter.routed_by_peer`); a
client's header -- forged, replayed, or signed for another request -- changes nothing
(the request is served as the client's, one rate-limited WARNING) and is never passed
on: a forwarder drops every ``x-rallypoint-*`` header it received
(:func:`rallypoint.cluster.forward.forward_headers`).
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from typing import Any
from zlib import crc32

import httpx
import msgspec
import trio

from .. import protocol as p
from ..errors import RallypointError, UnavailableError

log = logging.getLogger("rallypoint.cluster")

__all__ = ["decide", "LOCAL", "FANOUT", "HttpRouter", "Elsewhere", "ROUTED_HEADER"]

LOCAL = ("local",)
FANOUT = ("fanout",)
#: the header a forwarded HTTP request carries (never forwarded again)
ROUTED_HEADER = "x-rallypoint-routed"
#: API keys a node keeps native connections for (least recently used dropped first)
MAX_KEYS = 256

#: an answer's headers not passed back (the answer is rebuilt here: length, encoding)
_RESP_DROP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "trailer",
                        "date", "server", "content-length", "content-encoding"})


def _decl(op: Any):
    from ..actors.api import TABLE

    return TABLE.shards[type(op)]


def decide(op: Any, space: str, sharding: Any, *, key: str | None = None, turn: int = 0,
           routed: bool = False) -> tuple:
    """Where ``op`` (of a request of ``space``) runs on the node whose shard is
    ``sharding`` (a :class:`~rallypoint.actors.sharding.Sharding`): :data:`LOCAL`,
    ``("shard", S)`` or :data:`FANOUT` (see the module docstring). ``key``: the
    request's Idempotency-Key (a new root run then goes to the shard it hashes to);
    ``turn``: a counter spreading new root runs without a key over the shards;
    ``routed``: the request was forwarded here by another node (a new root run then
    stays here: that node chose this shard)."""
    from ..actors.sharding import EVERY, HERE, NEW_ROOT, item_slots, target

    owners = sharding.owners
    shards = sorted(set(owners))
    if len(shards) <= 1:
        return LOCAL
    decl = _decl(op)  # (an op every shard answers is FANOUT: its declared merge joins the parts)
    n = sharding.slots
    if decl.kind == "slots":
        slots = item_slots(decl, op, space, n)
        if all(sharding.owned[s] for s in slots):
            return LOCAL
        owning = {owners[s] for s in slots}
        return ("shard", owning.pop()) if len(owning) == 1 else FANOUT
    slot = target(decl, op, space, n)
    if slot == HERE:
        return LOCAL
    if slot == EVERY:
        return FANOUT
    if slot == NEW_ROOT:
        if routed and any(sharding.owned):
            return LOCAL
        pick = crc32(key.encode()) if key is not None else turn
        s = shards[pick % len(shards)]
        return LOCAL if s == sharding.shard and any(sharding.owned) else ("shard", s)
    if sharding.owned[slot]:
        return LOCAL
    return ("shard", owners[slot])


class Elsewhere(Exception):
    """Raised by a request's first operation that belongs to another shard: the HTTP
    layer forwards the whole request to ``shard``'s leader (not a RallypointError:
    nothing answers it but :meth:`HttpApi.handle`)."""

    def __init__(self, shard: int) -> None:
        super().__init__(shard)
        self.shard = shard


class _ShardLink:
    """One shard's leader under one API key (and space): ``call`` / ``subscribe`` over a native
    connection opened on first use and again when it closed or the leader moved. A
    connection lost mid-call answers UNAVAILABLE (the HTTP client retries; with an
    Idempotency-Key that is safe)."""

    def __init__(self, router: "HttpRouter", secret: str | None, shard: int, space: str) -> None:
        self.router = router
        self.secret = secret
        self.space = space
        self.shard = shard
        self.closed = False
        self._conn: Any = None
        self._address: str | None = None
        self._lock = trio.Lock()

    async def _connection(self):
        from ..transport.connection import Connection

        address = self.router.leader_client(self.shard)
        if address is None:
            raise UnavailableError(f"shard {self.shard} has no leader right now; retry shortly", retry_after=0.5,
                                   details={"shard": self.shard})
        async with self._lock:
            c = self._conn
            if c is not None and not c.closed and self._address == address:
                return c
            if c is not None:
                self._conn = None
                await c.aclose()
            # (open mode: the hello names the request's space; with keys the key's wins)
            conn = await Connection.open(f"tcp://{address}", api_key=self.secret, client_name="rallypoint-http-route",
                                         connect_timeout=2.0, space=self.space)
            ready = trio.Event()
            trio.lowlevel.spawn_system_task(_hold, conn, ready)
            await ready.wait()
            self._conn, self._address = conn, address
            self.router.connections += 1
            return conn

    async def call(self, op: Any):
        return await (await self._connection()).call(op)

    async def subscribe(self, op: Any, max_events: int = 10_000):
        return await (await self._connection()).subscribe(op, max_events)

    async def aclose(self) -> None:
        self.closed = True
        c, self._conn = self._conn, None
        if c is not None:
            await c.aclose()


async def _hold(conn, ready: trio.Event) -> None:
    """A system task owning one pooled connection (its reader and writer) until it
    closes."""
    try:
        async with conn:
            ready.set()
            await conn.wait_closed()
    except Exception:  # (a system task must not raise)
        log.debug("a routed connection ended", exc_info=True)
    finally:
        ready.set()


class _LocalMap:
    """The ``first`` transport of a :class:`ShardedTransport` made by a node: the slot
    map and the leaders as this node's etcd watch holds them (no round trip)."""

    def __init__(self, member) -> None:
        self.member = member
        self.closed = False

    async def call(self, op: Any):
        if type(op) is not p.ClusterMap:
            raise UnavailableError("only the slot map is read here")
        return p.encoder.encode(self.member.cluster_map_view())


class HttpRouter:
    """The routing of one leader's HTTP API on a sharded cluster (see the module
    docstring). ``member``: the :class:`~rallypoint.cluster.member.ShardMember`;
    ``sharding``: the coordinator's :class:`~rallypoint.actors.sharding.Sharding`.
    Counters: ``forwarded`` (HTTP requests sent to another shard), ``native`` (ops sent
    over the native protocol), ``connections`` (native connections opened).
    ``verifiers``: a dict the node keeps its :class:`~rallypoint.cluster.peerauth.TokenVerifier`
    in, by cluster secret (None: this router's own)."""

    def __init__(self, member, sharding, *, verifiers: dict | None = None) -> None:
        self.member = member
        self.sharding = sharding
        #: the node's TokenVerifier by cluster secret (ClusterHttpApp keeps it across terms)
        self._verifiers = verifiers if verifiers is not None else {}
        self._turn = itertools.count()
        self._pools: OrderedDict[tuple[str | None, str], Any] = OrderedDict()
        self._locks: dict[tuple[str | None, str], trio.Lock] = {}
        self.forwarded = 0
        self.native = 0
        self.connections = 0
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(connect=2.0, read=120.0, write=10.0, pool=10.0),
                                       follow_redirects=False)

    @property
    def sharded(self) -> bool:
        return len(set(self.sharding.owners)) > 1

    def decide(self, op: Any, space: str, key: str | None = None, routed: bool = False) -> tuple:
        """:func:`decide` for this node (a new root run without a key takes the next turn)."""
        return decide(op, space, self.sharding, key=key, turn=next(self._turn), routed=routed)

    def leader_client(self, shard: int) -> str | None:
        rec = self.member.leaders.get(shard)
        return rec.info.client_address if rec is not None else None

    def leader_http(self, shard: int) -> str | None:
        rec = self.member.leaders.get(shard)
        return rec.info.http_address if rec is not None else None

    async def transport(self, secret: str | None, space: str):
        """The :class:`~rallypoint.client.router.ShardedTransport` of the API key
        ``secret`` (None in open mode) for ``space``: one pooled connection per shard,
        opened on first use; at most :data:`MAX_KEYS` keys are kept."""
        from ..client.router import ShardedTransport

        k = (secret, space)
        st = self._pools.get(k)
        if st is not None:
            self._pools.move_to_end(k)
            return st
        lock = self._locks.setdefault(k, trio.Lock())
        async with lock:
            st = self._pools.get(k)
            if st is None:
                async def open_shard(shard: int, _hint):
                    return _ShardLink(self, secret, shard, space)

                st = ShardedTransport([], _LocalMap(self.member), open_shard, space)
                await st.start()
                self._pools[k] = st
                while len(self._pools) > MAX_KEYS:
                    _k, old = self._pools.popitem(last=False)
                    self._locks.pop(_k, None)
                    for link in old.shards.values():
                        await link.aclose()
        return st

    async def call(self, secret: str | None, space: str, op: Any) -> bytes:
        """``op`` through the key's :class:`ShardedTransport` (routed, split, merged):
        the reply body, or the RallypointError a shard answered."""
        self.native += 1
        st = await self.transport(secret, space)
        return bytes(await st.call(op))

    def _secret(self) -> str | None:
        node = self.member.node
        service = getattr(node, "service", None)
        return getattr(service, "node_secret", None)

    def _verifier(self):
        """The node's TokenVerifier for the cluster's secret (None: not known yet)."""
        from .peerauth import TokenVerifier

        secret = self._secret()
        if secret is None:
            return None
        v = self._verifiers.get(secret)
        if v is None:
            v = self._verifiers[secret] = TokenVerifier(secret, self.member.config.cluster)
        return v

    def routed_token(self, method: str, target: bytes, body: bytes) -> str:
        """The ``x-rallypoint-routed`` value of a request this node forwards: a node
        token over ``METHOD target`` (``target``: raw path and query as sent) and
        ``body``. UNAVAILABLE while the node secret is not read yet."""
        from .peerauth import make_token

        secret = self._secret()
        if secret is None:
            raise UnavailableError("this node has not read the cluster's node secret yet; retry shortly",
                                   retry_after=0.5)
        c = self.member.config
        return make_token(secret, purpose="http", cluster=c.cluster, node=c.node,
                          target=f"{method} {target.decode('latin-1')}", body=body)

    def routed_by_peer(self, token: str, method: str, scope, body: bytes) -> bool:
        """Whether ``token`` (a request's ``x-rallypoint-routed`` value) is a node
        token of this cluster for this very request (``method``, the ASGI ``scope``'s raw
        path and query, ``body``), not seen before (:class:`TokenVerifier`)."""
        verifier = self._verifier()
        if verifier is None:
            return False
        raw = scope.get("raw_path") or scope["path"].encode("latin-1")
        qs = scope.get("query_string") or b""
        target = raw + (b"?" + qs if qs else b"")
        return verifier.verify(token, purpose="http", target=f"{method} {target.decode('latin-1')}",
                               body=body) is not None

    async def forward(self, request, body: bytes, shard: int) -> tuple[int, list[tuple[str, str]], bytes]:
        """The HTTP ``request`` (its ``body`` already read) sent to ``shard``'s leader's
        HTTP listener: its method, origin-form path and query, body and end-to-end
        headers (:func:`rallypoint.cluster.forward.forward_headers`), marked routed with
        this node's signature (:meth:`routed_token`); ``(status, headers, body)`` of its
        answer. UNAVAILABLE when no leader of that shard serves HTTP or it could not be
        reached (not sent), UNAVAILABLE with ``details.maybe_applied`` when it went away
        mid-request; VALIDATION_FAILED for a request-target that is not a path."""
        from ..errors import ValidationError
        from .forward import forward_headers, peer_url

        address = self.leader_http(shard)
        if address is None:
            raise UnavailableError(f"shard {shard} has no leader serving HTTP right now; retry shortly",
                                   retry_after=0.5, details={"shard": shard})
        scope = request.scope
        try:
            url = peer_url(address, scope)
        except ValueError as e:  # (the listener's guard refused such targets already)
            raise ValidationError(f"not forwarded: {e}") from None
        headers = forward_headers(scope["headers"])
        headers.append((ROUTED_HEADER.encode(), self.routed_token(request.method, url.raw_path, body).encode()))
        self.forwarded += 1
        try:
            resp = await self._http.request(request.method, url, headers=headers, content=body)
        except httpx.ConnectError as e:
            raise UnavailableError(f"shard {shard}'s leader at {address} could not be reached ({e}); retry shortly",
                                   retry_after=0.5, details={"shard": shard}) from None
        except (httpx.HTTPError, OSError) as e:
            raise UnavailableError(
                f"shard {shard}'s leader at {address} went away while handling this request ({type(e).__name__}); "
                "it may or may not have been applied: retry it (with an Idempotency-Key that is safe)",
                retry_after=0.5, details={"shard": shard, "maybe_applied": True}) from None
        from .forward import response_headers

        return resp.status_code, response_headers(resp.headers.multi_items(), _RESP_DROP), resp.content

    async def aclose(self) -> None:
        """Close every pooled connection and the HTTP client (the term ended)."""
        pools, self._pools = list(self._pools.values()), OrderedDict()
        for st in pools:
            for link in st.shards.values():
                await link.aclose()
        await self._http.aclose()


# ---------------------------------------------------------------------------- events
def _cursor_gone(e: RallypointError) -> RallypointError:
    """A cursor the merge cannot read (not a vector of this cluster's shards): the HTTP
    API's CURSOR_EXPIRED, so the runstate SDK drops it and starts again."""
    from ..errors import CursorExpiredError

    if e.code == "VALIDATION_FAILED" and (e.details or {}).get("field") == "cursor":
        return CursorExpiredError(f"{e.message}; start again without a cursor", details=e.details)
    return e


async def events_page(router: HttpRouter, secret: str | None, space: str, op: p.EventsList, cursor: str | None):
    """``GET /events`` over every shard (a space-wide page): the merged
    :class:`~rallypoint.client.types.EventPage` (:func:`rallypoint.client.shardevents.list_events`),
    its cursors vector strings (``"0:120,1:45,2:9"``: opaque to the runstate SDK).
    CURSOR_EXPIRED for a cursor that is not one of this cluster's (or one shard's that
    expired, ``details.shard``)."""
    from ..client.shardevents import list_events

    st = await router.transport(secret, space)
    try:
        return await list_events(st, op, cursor)
    except RallypointError as e:
        raise _cursor_gone(e) from None


async def events_watch(router: HttpRouter, secret: str | None, space: str, op: p.EventsList, cursor: str | None,
                       hold_s: float):
    """``GET /watch`` over every shard: a merged page at once when it has events (or
    ``hold_s`` is 0), else the events of every shard as they happen, merged
    (:class:`rallypoint.client.shardevents.MergedWatch` from the page's vector cursor),
    up to ``op.limit``, waiting at most ``hold_s`` seconds for the first. Returns
    ``(events, next_cursor, oldest, newest)`` (events: SDK Event values; cursors
    vector strings)."""
    from ..client.shardevents import MergedWatch

    page = await events_page(router, secret, space, op, cursor)
    if page.events or hold_s <= 0 or page.next_cursor != page.newest:
        return page.events, page.next_cursor, page.oldest, page.newest
    st = await router.transport(secret, space)
    wop = p.EventsWatch(types=op.types, scope_id=op.scope_id, aggregate=op.aggregate)
    w = MergedWatch(st, wop, page.next_cursor, max(op.limit, 64))
    out: list = []
    try:
        with trio.move_on_after(hold_s):
            out.append(await w.next())
            while len(out) < op.limit:
                e = w.ready()
                if e is None:
                    break
                out.append(e)
    except RallypointError as e:
        raise _cursor_gone(e) from None
    finally:
        w.close()
    nxt = w.cursor or page.next_cursor
    return out, nxt, page.oldest, nxt if not out else page.newest
