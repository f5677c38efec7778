"""The coordinator behind a connection: decode, authorize, route to an actor's inbox.

Used by the TCP server and by the embedded client alike, so both see exactly the same
validation, errors and durability rules:

1. :meth:`Service.submit` decodes the request body against the ``Op`` union (a bad
   op, field or type is VALIDATION_FAILED with msgspec's path), checks the session's
   permission and key, routes the op to the actor it runs on (NOT_FOUND for an unknown
   id or another space's), and appends the command to that actor's inbox -- all from
   the coordinator's op table, which it built from the handlers' ``@op`` marks
   (``Coordinator.ops``; :mod:`rallypoint.actors.opmark`). It never waits.
2. The actor handles it on its own task and answers through the
   :class:`~rallypoint.actors.runtime.ReplySink` (a connection, or an embedded call)
   with the LSN the answer depends on; the sink holds the answer -- success or error --
   until the journal is durable past that LSN.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import trio

from ._version import __version__
from .actors.opmark import ANY_KEY, LOCAL, NODE
from .actors.remote_runs import REMOTE_RUN_OPS as _REMOTE_RUN_OPS
from .ids import is_id, slot_of
from .actors.runtime import ReplySink
from .cluster.peerauth import is_token as is_node_token
from .errors import ForbiddenError, RallypointError, UnauthenticatedError, UnavailableError, ValidationError
from .protocol import encoder
from .wire import NESTING_MESSAGE
from .wire import PROTOCOL_VERSION, Hello, HelloOk

log = logging.getLogger("rallypoint.service")

__all__ = ["Session", "Service", "CallSink", "StreamSink"]


class Session:
    """Who is on the other end: the space it sees and the permissions it holds.

    ``permissions`` None means every permission (open mode, or a local session);
    ``local`` marks an offline session on the data dir (``rallypoint keys --data-dir``),
    the only one that may grant the ``operator`` permission. ``idempotency``: set on the
    session of one step of an HTTP request with an ``Idempotency-Key`` -- ``(key,
    fingerprint, step)`` -- (:meth:`for_step`; the coordinator stores that step's answer in
    the commit of its effect: ``actors/idempotency.py``); None otherwise. ``peer``: the
    other end's ``host:port`` (``"embedded"`` in process); ``client``: the client name
    its handshake gave (``rallypoint.connect(client_name=)``), else "". ``node``: another
    node of the sharded cluster, authenticated by the cluster's node secret (the only
    session that may make the calls between shards: ``run.link``, ``outbox.deliver``,
    ``admission.reserve``). ``open``: admitted by open mode (no key existed): every
    permission until the first key is created, then refused (UNAUTHENTICATED) -- its
    grant ends (``actors/keys.py``); a session with ``permissions`` None and ``open``
    False is a trusted in-process one (the embedded client, the local operator, a node)."""

    __slots__ = ("space", "permissions", "peer", "key_id", "local", "idempotency", "client", "node", "open")

    def __init__(self, space: str = "default", permissions: frozenset[str] | None = None, peer: str = "",
                 key_id=None, local: bool = False, client: str = "", node: bool = False, open: bool = False):
        self.space = space
        self.permissions = permissions
        self.peer = peer
        self.key_id = key_id
        self.local = local
        self.client = client
        self.node = node
        self.open = open
        self.idempotency: tuple[str, str, int] | None = None

    @property
    def holder(self) -> str | None:
        """Who this session is, as a delivery's holder when the receive names no worker:
        ``client@peer`` (the handshake's client name and the connection's address), the
        peer alone without a client name, None with neither (a local session). At most
        128 characters (a longer client name is cut, the peer kept)."""
        peer, client = self.peer, self.client
        if not client:
            return peer[:128] or None
        if not peer:
            return client[:128]
        return client[:max(1, 127 - len(peer))] + "@" + peer[-126:]

    def for_step(self, key: str, fingerprint: str, step: int) -> "Session":
        """A copy of this session for step ``step`` (0, 1, ...: the request's operations
        in order) of the HTTP request with Idempotency-Key ``key`` and ``fingerprint``
        (method, path, body)."""
        s = Session(self.space, self.permissions, self.peer, self.key_id, self.local, self.client, open=self.open)
        s.idempotency = (key, fingerprint, step)
        return s

    def as_local(self) -> "Session":
        """The node's own session for a step it takes for this one (the HTTP layer's
        ``idempotency.*`` bookkeeping, ops marked ``LOCAL``): local, in this space, and
        still refused once this session's grant ends (its key id is kept)."""
        return Session(self.space, None, self.peer, self.key_id, True, self.client, open=self.open)


class CallSink(ReplySink):
    """A one-shot sink for an in-process call: :meth:`wait` returns the encoded reply
    once it is durable, or raises the error."""

    __slots__ = ("_event", "reply", "lsn", "waiter", "closed", "n", "replies")

    def __init__(self, n: int = 1) -> None:
        self._event = trio.Event()
        self.reply: Any = None
        self.lsn = 0
        self.waiter = None
        self.closed = False
        self.n = n
        self.replies: dict[int, Any] = {}

    def deliver(self, rid: int, reply, lsn: int) -> None:
        if lsn > self.lsn:
            self.lsn = lsn
        self.replies[rid] = reply
        self.waiter = None
        if len(self.replies) >= self.n:
            self._event.set()

    def track(self, rid: int, waiter) -> None:
        self.waiter = waiter

    def untrack(self, rid: int) -> None:
        self.waiter = None

    def flush(self) -> None:
        return None

    def abandon(self) -> None:
        """The caller went away: end a parked wait, drop whatever comes later."""
        self.closed = True
        w, self.waiter = self.waiter, None
        if w is not None:
            w.cancel()


class StreamSink(ReplySink):
    """An embedded subscription (``events.watch``): the server side pushes into a buffer
    of at most ``max_bytes``; the client side reads it with :meth:`next_batch`. Its
    ``start`` is the encoded WatchView (or the error that refused the watch);
    ``scanned``: the newest cursor pushed (``wire.Push.cursor``), None before the first."""

    def __init__(self, watchers, max_bytes: int) -> None:
        from collections import deque

        self._watchers = watchers
        self.max_bytes = max_bytes
        self._buf: deque = deque()
        self._bytes = 0
        self._event = trio.Event()
        self.error: Exception | None = None
        self.start: Any = None
        self.closed = False
        self.watcher = None
        self.scanned: int | None = None
        self._returned: int | None = None  # ``scanned`` when next_batch last returned

    # server side (ReplySink)
    def deliver(self, rid: int, reply, lsn: int) -> None:
        if self.start is None:
            self.start = reply
            if isinstance(reply, BaseException):
                self.error = reply
        self._event.set()

    def add_stream(self, rid: int, watcher) -> bool:
        self.watcher = watcher
        return not self.closed

    def push_room(self, rid: int) -> int:
        return self.max_bytes - self._bytes

    def push(self, rid: int, events: list, cursor: int) -> None:
        self._buf.extend(events)
        self._bytes += sum(len(e) for e in events)
        self.scanned = cursor
        self._event.set()

    def end_stream(self, rid: int, error) -> None:
        if self.error is None:
            self.error = error
        self._event.set()

    # client side
    async def wait_started(self) -> bytes:
        while self.start is None:
            await self._event.wait()
            self._event = trio.Event()
        if isinstance(self.start, BaseException):
            raise self.start
        return self.start

    async def next_batch(self) -> list:
        """Every event buffered (encoded) -- none when only ``scanned`` moved --, waiting
        for either; raises the error that ended the subscription once the buffer is
        empty."""
        while not self._buf and self.error is None and self.scanned == self._returned:
            await self._event.wait()
            self._event = trio.Event()
        self._returned = self.scanned
        if self._buf or self.error is None:
            out = list(self._buf)
            self._buf.clear()
            full = self._bytes >= self.max_bytes
            self._bytes = 0
            if full:
                self._watchers.wake()
            return out
        raise self.error

    def close(self) -> None:
        self.closed = True
        if self.watcher is not None:
            self.watcher.cancel()
            self._watchers.wake()


class Service:
    """The dispatcher of :class:`rallypoint.transport.server.Server` and the embedded
    client's backend."""

    def __init__(self, coordinator) -> None:
        self.coordinator = coordinator
        #: on a replicated shard's leader: its shard and epoch, given in every HelloOk
        self.shard: int | None = None
        self.epoch: int | None = None
        #: a sharded cluster's node secret (etcd): what this node signs its calls to
        #: other nodes with (it is never accepted as a key itself)
        self.node_secret: str | None = None
        #: a sharded cluster's leader: checks the node tokens other nodes' handshakes
        #: carry (:class:`rallypoint.cluster.peerauth.TokenVerifier`; None: no node
        #: session is accepted)
        self.node_tokens: Any = None
        #: a sharded cluster's leader: ``link(session, body, sink, rid, run_id)`` links a
        #: run of another shard, then submits the request again
        #: (:class:`rallypoint.cluster.peers.RemoteRuns`)
        self.remote_runs: Any = None
        # request Struct -> (handler, route, permission, tag): one dict lookup per request
        self._ops: dict[type, tuple[Any, Any, str, str]] = {
            t: (b.handler, b.route, b.permission, b.tag) for t, b in coordinator.ops.items()
        }
        self._shards = coordinator.op_table.shards
        self._decoder = coordinator.op_table.decoder
        #: the sessions of open connections counted against their space's connections
        #: limit (:meth:`hello`, :meth:`goodbye`)
        self._counted: dict[Session, None] = {}

    # -------------------------------------------------------------- handshake
    def hello(self, hello: Hello, peer: str = "") -> tuple[Session, HelloOk]:
        """Authenticate a connection: ``(session, HelloOk)``. VALIDATION_FAILED for another
        protocol version, UNAUTHENTICATED for a missing, unknown or revoked key,
        LIMIT_EXCEEDED when its space has its ``connections`` limit open already
        (``rallypoint/limits.py``; the connection counts until :meth:`goodbye`)."""
        if hello.version != PROTOCOL_VERSION:
            raise ValidationError(
                f"protocol version mismatch: the client speaks version {hello.version}, "
                f"this server (rallypoint {__version__}) speaks version {PROTOCOL_VERSION}; "
                "upgrade the older side",
                details={"field": "version", "client": hello.version, "server": PROTOCOL_VERSION},
            )
        if is_node_token(hello.api_key):
            # another node of the sharded cluster: a one-use token of the node secret,
            # made for this shard (rallypoint.cluster.peerauth)
            tokens = self.node_tokens
            node = None if tokens is None else tokens.verify(hello.api_key, purpose="session", target=str(self.shard))
            if node is None:
                raise UnauthenticatedError("a node token that does not check (another cluster's, expired, replayed, "
                                           "or this node takes no calls between shards)")
            session = Session(peer=peer, client=hello.client, node=True)
            return session, HelloOk(version=PROTOCOL_VERSION, server_version=__version__, space=session.space,
                                    shard=self.shard, epoch=self.epoch)
        key = self.coordinator.keys.authenticate(hello.api_key)
        if key is None:  # open mode: the space the hello names (else "default"), every permission
            space = hello.space if isinstance(hello.space, str) and hello.space else "default"
            session = Session(space=space, peer=peer, client=hello.client, open=True)
        else:
            session = Session(space=key.space, permissions=frozenset(key.permissions), peer=peer, key_id=key.id,
                              client=hello.client)
        self.coordinator.limits.connection_opened(session.space)
        self._counted[session] = None
        return session, HelloOk(version=PROTOCOL_VERSION, server_version=__version__, space=session.space,
                                shard=self.shard, epoch=self.epoch)

    def goodbye(self, session: Session) -> None:
        """The connection :meth:`hello` authenticated as ``session`` closed: it stops
        counting against its space's connections limit (a session not counted: no-op)."""
        if session in self._counted:
            del self._counted[session]
            self.coordinator.limits.connection_closed(session.space)

    # -------------------------------------------------------------- requests
    def decode(self, body: msgspec.Raw | bytes):
        try:
            return self._decoder.decode(body)
        except msgspec.ValidationError as e:
            raise ValidationError(f"invalid request: {e}", details={"path": _path_of(str(e))}) from None
        except msgspec.DecodeError as e:
            raise ValidationError(f"undecodable request body: {e}") from None
        except RecursionError:  # msgspec recurses; the envelope decoded a few frames up the stack
            raise ValidationError(f"invalid request: {NESTING_MESSAGE}") from None

    def submit(self, session: Session, body: msgspec.Raw | bytes, sink: ReplySink, rid: int) -> None:
        """Queue one request for its actor; the answer reaches ``sink.deliver(rid, ...)``."""
        coord = self.coordinator
        try:
            op = self.decode(body)
        except ValidationError as exc:
            sink.deliver(rid, exc, 0)
            return
        handler, route, permission, tag = self._ops[type(op)]
        sink.note_op(rid, tag, op)
        try:
            if coord.failed is not None:
                raise UnavailableError("the server stopped after an internal failure; retry once it restarted",
                                       retry_after=1.0)
            if session.node:
                if permission != NODE:
                    raise ForbiddenError(f"a node session (the cluster's node secret) makes only the calls between "
                                         f"shards, not {tag}")
                space = getattr(op, "space", None)
                if isinstance(space, str) and space != session.space:  # a call about a run of that space
                    session = Session(space=space, peer=session.peer, client=session.client, node=True)
            elif permission == NODE:
                raise ForbiddenError(f"{tag} is a call between the shards of a cluster, made only by its nodes (the "
                                     "cluster's node secret): no client's key may make it", details={"op": tag})
            if permission == LOCAL and not session.local:
                hint = (": send the request over HTTP with an Idempotency-Key header" if tag.startswith("idempotency.")
                        else "")
                raise ForbiddenError(f"{tag} is a step the node takes itself, not a client's{hint}", details={"op": tag})
            refused = coord.keys.refusal(session)  # rights from the key table as it is now
            if refused is not None:
                raise refused
            perms = session.permissions
            if perms is not None:
                if (permission not in perms and permission != ANY_KEY
                        and "admin" not in perms and "operator" not in perms):
                    raise ForbiddenError(
                        f"this key lacks the permission {permission!r} needed for {op.__struct_config__.tag}",
                        details={"permission": permission},
                    )
            sharding = coord.sharding
            if sharding is not None:  # a sharded cluster: only this shard's slots (WRONG_SHARD)
                sharding.check_op(self._shards[type(op)], op, session.space)
                if type(op) in _REMOTE_RUN_OPS and self.remote_runs is not None:
                    run_id = op.scope_id
                    if (is_id(run_id, "scp") and run_id not in coord.runs.table
                            and not sharding.owned[slot_of(run_id) % sharding.slots]):
                        # a run of another shard, unknown here: link it first (its shard
                        # journals the link, this one the remote run), then run this op
                        self.remote_runs.link(session, body, sink, rid, run_id)
                        return
            actor_id = route(coord, session, op)
        except RallypointError as exc:
            sink.deliver(rid, exc, coord.journal.last_lsn)
            return
        except Exception as exc:  # a bug in a route: answer INTERNAL, keep serving
            coord.internal_error(exc)
            coord.reply(sink, rid, exc)
            return
        coord.runtime.actor(actor_id).send((handler, session, op, sink, rid))

    async def call(self, session: Session, op: msgspec.Struct) -> bytes:
        """One request in-process (the embedded client, the offline CLI): the encoded
        reply once durable, or the RallypointError it answered."""
        reply, lsn = await self.call_applied(session, op)
        await self.wait_durable(lsn)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    async def call_applied(self, session: Session, op: msgspec.Struct) -> tuple[Any, int]:
        """:meth:`call` without its wait for durability: ``(reply, lsn)``, the encoded
        reply or the exception it answered (returned, not raised), and the LSN the
        answer depends on. Nothing may be shown to anyone before :meth:`wait_durable`
        of that LSN (or of a later one) returned: the HTTP layer runs the steps of a
        keyed request so, and waits once, for its last commit (``http/app.py``)."""
        sink = CallSink()
        self.submit(session, encode_op(op), sink, 1)
        try:
            await sink._event.wait()
        except BaseException:
            sink.abandon()
            raise
        return sink.replies[1], sink.lsn

    async def subscribe(self, session: Session, op: msgspec.Struct, max_bytes: int = 1 << 20) -> StreamSink:
        """Open a subscription in-process (the embedded client's ``events.watch``):
        the sink, once its WatchView arrived; raises the error that refused it."""
        if self.coordinator.runtime.stopping:
            raise UnavailableError("this coordinator is shutting down", retry_after=1.0)
        sink = StreamSink(self.coordinator.watchers, max_bytes)
        self.submit(session, encode_op(op), sink, 1)
        try:
            await sink.wait_started()
        except BaseException:
            sink.close()
            raise
        return sink

    def session_error(self, session: Session) -> UnauthenticatedError | None:
        """Why ``session`` may no longer act (its key revoked, open mode over), from the
        key table as it is now; None while it may (``Keys.refusal``)."""
        return self.coordinator.keys.refusal(session)

    def add_session_listener(self, fn) -> None:
        """``fn(lsn)`` whenever a grant ends (a key revoked, open mode over) in the
        commit of LSN ``lsn``: once that is durable, sessions may ask
        :meth:`session_error` again (the TCP server closes the connections it refuses)."""
        self.coordinator.grant_listeners.append(fn)

    def remove_session_listener(self, fn) -> None:
        """Undo :meth:`add_session_listener`."""
        try:
            self.coordinator.grant_listeners.remove(fn)
        except ValueError:
            pass

    def watch_wake(self) -> None:
        """A connection's output drained: watchers waiting for room may go on."""
        self.coordinator.watchers.wake()

    def durable_lsn(self) -> int:
        return self.coordinator.journal.durable_lsn

    def add_durable_listener(self, fn) -> None:
        """``fn(durable_lsn, error)`` as the journal's durable LSN advances (error None),
        and once with the error (UNAVAILABLE: the journal failed or closed) when it will
        not any more: :meth:`rallypoint.persistence.Journal.add_durable_listener`."""
        self.coordinator.journal.add_durable_listener(fn)

    def remove_durable_listener(self, fn) -> None:
        """Undo :meth:`add_durable_listener`."""
        self.coordinator.journal.remove_durable_listener(fn)

    async def wait_durable(self, lsn: int) -> None:
        """Return once the journal is durable past ``lsn``. Raises UNAVAILABLE (with
        ``details["maybe_applied"] = True``) when the journal failed or closed first: the
        node is stopping (fail-stop), and a change the answer depends on may or may not
        survive the restart -- never the journal's own error, which is not a
        RallypointError (found by the simulator, seed 2: a failed journal write reached
        the embedded client as ``JournalWriteError``)."""
        try:
            await self.coordinator.journal.wait_durable(lsn)
        except (RallypointError, ValueError):
            raise
        except Exception as exc:
            raise UnavailableError(
                "the server's journal stopped before this answer was durable (the server is stopping); "
                "the change may or may not have been applied: check once the server restarted",
                retry_after=1.0, details={"maybe_applied": True},
            ) from exc

    def connection_count(self, source) -> None:
        """Let the server status report live connections: ``source`` has
        ``connection_count() -> int`` (a :class:`~rallypoint.actors.coordinator.ConnectionSource`)."""
        self.coordinator.connections = source


def encode_op(op: msgspec.Struct) -> bytes:
    """An in-process request (HTTP, embedded) as the bytes a TCP frame would carry.
    VALIDATION_FAILED, naming the field, for an integer the wire cannot carry (outside
    -2**63..2**64-1: msgpack's range, what a TCP client could send at all)."""
    try:
        return encoder.encode(op)
    except OverflowError:
        field = _oversize_int_field(op) or "a field"
        raise ValidationError(f"invalid request: {field} is an integer outside the 64-bit range; send a smaller "
                              "number", details={"field": field}) from None


def _oversize_int_field(op: msgspec.Struct) -> str | None:
    """The first field of ``op`` (``items[2].units``) holding an int msgpack cannot
    encode; structs, lists, tuples and dicts are searched a few levels deep."""
    todo: list[tuple[str, Any, int]] = [(f, getattr(op, f), 0) for f in op.__struct_fields__]
    while todo:
        path, v, depth = todo.pop(0)
        if isinstance(v, int):
            if not -(1 << 63) <= v < (1 << 64):
                return path
        elif depth < 8:
            if isinstance(v, msgspec.Struct):
                todo += [(f"{path}.{f}", getattr(v, f), depth + 1) for f in v.__struct_fields__]
            elif isinstance(v, (list, tuple)):
                todo += [(f"{path}[{i}]", x, depth + 1) for i, x in enumerate(v)]
            elif isinstance(v, dict):
                todo += [(f"{path}.{k}", x, depth + 1) for k, x in v.items()]
    return None


def _path_of(msg: str) -> str | None:
    i = msg.rfind("`$")
    if i < 0:
        return None
    j = msg.find("`", i + 1)
    return msg[i + 1 : j] if j > 0 else None
