"""The HTTP port of a node of a replicated shard: the runstate SDK's one base URL.

Every node of the shard serves ``--http``, whatever its role, so a runstate client
pointed at any node (say, a standby, or a load balancer over all of them) keeps
working through a failover:

- while this node **leads**, requests go to its own :class:`~rallypoint.http.app.HttpApi`
  (the same code as a single node);
- while it **stands by**, each request is forwarded to the leader's HTTP address (as
  etcd advertises it) and the answer streamed back unchanged (status, headers, body;
  long polls included);
- while **no leader is known** (a failover: about the leader lease's TTL), a request
  waits for one up to ``wait_s`` (5 s) instead of failing at once, then is forwarded --
  or served here, if this node won;
- a request whose connection to the leader failed *before it was sent* is tried again
  on the next leader; one that failed *after* (the leader died mid-request) may or may
  not have been applied, so it is answered 503 UNAVAILABLE saying so -- the runstate
  SDK re-sends it, and with an ``Idempotency-Key`` that is safe.

**What is forwarded** (:func:`peer_url`, :func:`forward_headers`; the same for
:meth:`rallypoint.cluster.httproute.HttpRouter.forward`): the URL is built from the
peer's address as etcd advertises it and the request's origin-form path and query
alone, as ``httpx.URL`` components (never by joining strings), so no request-target
(``@host:port/x``, ``http://host/x``, ``//host/x``) can name another host -- the
listener's guard refused those already (:mod:`rallypoint.http.guard`), and this refuses
them again. Hop-by-hop headers (RFC 9110 §7.6.1, and those the ``Connection`` header
names), ``Host``, ``Content-Length`` and every internal ``x-rallypoint-*`` header a
client sent are dropped; redirects are never followed (the answer is returned as it is).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import httpx
import trio

from ..errors import RallypointError, UnavailableError, ValidationError
from ..http.app import lifespan
from ..logutil import RateLimitedLogger
from ..replication.link import unwrapped

log = logging.getLogger("rallypoint.cluster")

__all__ = ["ClusterHttpApp", "peer_url", "forward_headers", "response_headers", "INTERNAL_PREFIX"]

#: request headers never forwarded: hop-by-hop (RFC 9110 §7.6.1) and what the next hop
#: is given anew (host, length, framing), besides :data:`INTERNAL_PREFIX` ones
_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"proxy-connection",
                  b"te", b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length", b"expect",
                  b"http2-settings", b"x-forwarded-by"})
#: response headers never passed back
_RESP_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "trailer",
                       "date", "server"})
#: headers only the nodes of a cluster set (``x-rallypoint-routed``): a client's are dropped
INTERNAL_PREFIX = b"x-rallypoint-"


def forward_headers(headers) -> list[tuple[bytes, bytes]]:
    """The request ``headers`` (ASGI's ``[(name, value)]``, bytes or str, names lower
    case) a forwarder sends on: without hop-by-hop headers (:data:`_HOP` and every name
    the ``Connection`` header lists) and without internal ``x-rallypoint-*`` ones."""
    items = [(k.encode("latin-1") if isinstance(k, str) else k, v.encode("latin-1") if isinstance(v, str) else v)
             for k, v in headers]
    named = {t.strip().lower() for k, v in items if k.lower() == b"connection" for t in v.split(b",")}
    return [(k, v) for k, v in items
            if (n := k.lower()) not in _HOP and n not in named and not n.startswith(INTERNAL_PREFIX)]


def response_headers(headers, drop=_RESP_HOP) -> list[tuple[str, str]]:
    """An answer's headers (httpx's ``multi_items()``) without ``drop`` and the names its
    ``Connection`` header lists."""
    items = list(headers)
    named = {t.strip().lower() for k, v in items if k.lower() == "connection" for t in v.split(",")}
    return [(k, v) for k, v in items if (n := k.lower()) not in drop and n not in named]


def peer_url(address: str, scope) -> httpx.URL:
    """``http://<address><path>?<query>`` for the ASGI request ``scope``: ``address`` is
    a peer's ``host:port`` (``[v6]:port``) as etcd advertises it; the path is the
    request's raw path, which must be origin-form. Raises ValueError for an address that
    is not ``host:port`` or a request-target that is not a path starting with one ``/``
    (:func:`rallypoint.http.guard.target_problem`)."""
    from ..http.guard import target_problem

    raw = scope.get("raw_path") or scope["path"].encode("latin-1")
    problem = target_problem(raw)
    if problem is not None:
        raise ValueError(problem)
    host, sep, port = address.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()):
        raise ValueError(f"not a host:port address: {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if any(c in host for c in "@/\\?#[] "):
        raise ValueError(f"not a host:port address: {address!r}")
    qs = scope.get("query_string") or b""
    return httpx.URL(scheme="http", host=host, port=int(port), raw_path=raw + (b"?" + qs if qs else b""))


class ClusterHttpApp:
    """The ASGI application of a cluster node's HTTP port (see the module docstring).

    ``member``: the :class:`~rallypoint.cluster.member.ShardMember`; ``make_local(node)``
    builds the :class:`~rallypoint.http.app.HttpApi` for a term this node leads (called
    once per term); ``wait_s``: how long a request waits for a leader (seconds);
    ``max_body``: largest request body forwarded (bytes). Attributes ``forwarded`` and
    ``failed`` count requests."""

    def __init__(self, member, make_local: Callable[[Any], Any], *, wait_s: float = 5.0,
                 max_body: int = 1 << 20) -> None:
        self.member = member
        self.make_local = make_local
        self.wait_s = wait_s
        self.max_body = max_body
        self._local: Any = None
        self._local_node: Any = None
        #: routing counts of the terms that ended (see :meth:`routed`)
        self._routed_before = {"forwarded": 0, "native": 0, "connections": 0}
        self.forwarded = 0
        self.failed = 0
        self.metrics: Any = None
        self.listener: Any = None
        self.log_limiter = RateLimitedLogger(log, window_s=10.0, burst=5)
        #: the node's checkers of routed requests' tokens, by cluster secret (one for
        #: every term: a token seen in one is not taken again in the next)
        self._verifiers: dict = {}
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(connect=2.0, read=120.0, write=10.0, pool=10.0),
                                         follow_redirects=False)

    def flush_logs(self) -> None:
        self.log_limiter.flush()

    async def aclose(self) -> None:
        self._drop_router()
        await self._client.aclose()

    def _leading(self):
        m = self.member
        node = m.node
        if m.role == "leader" and node is not None:
            if self._local_node is not node:
                self._drop_router()
                self._local = self.make_local(node)
                self._local.listener = self.listener
                self._local_node = node
            sharding = node.coordinator.sharding
            if sharding is not None and getattr(self._local, "router", None) is None:
                # a sharded cluster: any node serves every shard's requests (routing inside)
                from .httproute import HttpRouter

                self._local.router = HttpRouter(m, sharding, verifiers=self._verifiers)
            return self._local
        self._drop_router()
        return None

    def _drop_router(self) -> None:
        """Close the routing pool of a term that ended (its connections are system tasks)."""
        router = getattr(self._local, "router", None)
        if router is not None:
            self._local.router = None
            for k in self._routed_before:
                self._routed_before[k] += getattr(router, k)

            async def close():
                try:
                    await router.aclose()
                except Exception:
                    log.debug("closing an HTTP router failed", exc_info=True)

            trio.lowlevel.spawn_system_task(close)

    def routed(self) -> dict[str, int]:
        """Since start, on a sharded cluster: HTTP requests this node forwarded to
        another shard's leader (``forwarded``), operations it sent there over the native
        protocol (``native``) and native connections it opened for that
        (``connections``); :mod:`rallypoint.cluster.httproute`."""
        out = dict(self._routed_before)
        router = getattr(self._local, "router", None)
        if router is not None:
            for k in out:
                out[k] += getattr(router, k)
        return out

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        local = self._leading()
        if local is not None:
            lead = self.member.leadership
            if lead is not None:  # (the self-fence before each answer, not only here)
                send = fenced_send(send, lead.is_leader_now, scope.get("method", "GET"))
            await local(scope, receive, send)
            return
        body = await self._read_body(receive)
        if body is None:
            return  # the client went away
        if len(body) > self.max_body:
            await self._answer(send, UnavailableError(f"request body over {self.max_body} bytes"), 413)
            return
        await self._forward(scope, receive, send, body)

    async def _read_body(self, receive) -> bytes | None:
        parts = []
        n = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            n += len(chunk)
            if n > self.max_body:
                return b"x" * (self.max_body + 1)
            parts.append(chunk)
            if not msg.get("more_body"):
                return b"".join(parts)

    async def _leader_address(self, deadline: float) -> str | None:
        """The leader's HTTP address, waiting (until ``deadline``, Trio time) while
        none is known; None if this node became the leader meanwhile or none came."""
        m = self.member
        while True:
            if self._leading() is not None:
                return None
            rec = m.leader
            if rec is not None and rec.info.node != m.config.node and rec.info.http_address:
                return rec.info.http_address
            if trio.current_time() >= deadline:
                return None
            with trio.move_on_at(deadline):
                await m.wait_leader_change()

    async def _forward(self, scope, receive, send, body: bytes) -> None:
        deadline = trio.current_time() + self.wait_s
        tried: set[str] = set()
        while True:
            address = await self._leader_address(deadline)
            local = self._leading()
            if local is not None:  # this node won meanwhile: serve it here
                await local(scope, _replay(body), send)
                return
            if address is None or (address in tried and trio.current_time() >= deadline):
                self.failed += 1
                await self._answer(send, self.member.not_leader_error(), 503)
                return
            tried.add(address)
            try:
                url = peer_url(address, scope)
            except ValueError as e:  # (the listener's guard refused such targets already)
                await self._answer(send, ValidationError(f"not forwarded: {e}"), 400)
                return
            headers = forward_headers(scope["headers"])
            headers.append((b"x-forwarded-by", self.member.config.node.encode()))
            request = self._client.build_request(scope["method"], url, headers=headers, content=body)
            started = False
            try:
                # unwrapped: the client's error leaves the nursery as itself (not in an
                # ExceptionGroup), so the handlers below see it
                async with unwrapped(), trio.open_nursery() as nursery:
                    nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
                    resp = await self._client.send(request, stream=True)
                    try:
                        out_headers = [(k.encode("latin-1"), v.encode("latin-1"))
                                       for k, v in response_headers(resp.headers.multi_items())]
                        await send({"type": "http.response.start", "status": resp.status_code,
                                    "headers": out_headers})
                        started = True
                        async for chunk in resp.aiter_raw():
                            await send({"type": "http.response.body", "body": chunk, "more_body": True})
                        self.forwarded += 1
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                    finally:
                        await resp.aclose()
                    nursery.cancel_scope.cancel()
                return
            except httpx.ConnectError as e:
                # not sent: the leader is gone; wait for the next one and try there
                self.log_limiter.log(logging.INFO, "forward-connect", "HTTP forward to %s failed to connect (%s); "
                                     "waiting for the next leader", address, e)
                if trio.current_time() >= deadline:
                    self.failed += 1
                    await self._answer(send, self.member.not_leader_error(), 503)
                    return
                await trio.sleep(0.05)
                continue
            except (httpx.HTTPError, OSError) as e:
                self.failed += 1
                if started:
                    return  # the client sees a cut response: nothing better to say
                await self._answer(send, UnavailableError(
                    f"the shard's leader at {address} went away while handling this request ({type(e).__name__}); "
                    "it may or may not have been applied: retry it (with an Idempotency-Key that is safe)",
                    retry_after=0.5, details={"maybe_applied": True}), 503)
                return

    async def _answer(self, send, e: RallypointError, status: int) -> None:
        import json

        err: dict[str, Any] = {"code": e.code, "message": e.message}
        if e.details:
            err["details"] = e.details
        body = json.dumps({"error": err}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if e.retry_after is not None:
            headers.append((b"retry-after", f"{max(0.0, float(e.retry_after)):.3g}".encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


def fenced_send(send, leading: Callable[[], bool], method: str):
    """An ASGI ``send`` that asks ``leading()`` (the leader's self-fence,
    :meth:`~rallypoint.cluster.leader.Leadership.is_leader_now`) before the answer
    starts and before each chunk of an answer without ``content-length`` (an event
    stream, a long poll): SCALE-OUT §4.4 layer 2, "re-checks before each reply batch".
    A request admitted while the node led and answered after its leadership lapsed (a
    SIGSTOP past the lease, then resumed) gets 503 instead -- NOT_LEADER for a GET or
    HEAD (a read: nothing applied), UNAVAILABLE with ``maybe_applied`` for anything
    else (a standby that has not seen the lapse may still commit the change) -- and a
    stream past it ends (its client resumes from its cursor elsewhere). What the
    application sends after that is dropped."""
    state = {"refused": False, "sized": True}

    async def gated(msg) -> None:
        if state["refused"]:
            return
        kind = msg.get("type")
        if kind == "http.response.start":
            if not leading():
                state["refused"] = True
                if method in ("GET", "HEAD"):
                    code, text, details = "NOT_LEADER", ("this node's leadership lapsed before it answered; retry "
                                                         "on the shard's leader"), {"leader": None}
                else:
                    code, text, details = "UNAVAILABLE", (
                        "this node's leadership lapsed before it answered; the change may or may not have been "
                        "applied: check on the shard's leader"), {"maybe_applied": True}
                import json

                body = json.dumps({"error": {"code": code, "message": text, "details": details}}).encode()
                await send({"type": "http.response.start", "status": 503, "headers": [
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"retry-after", b"0.5")]})
                await send({"type": "http.response.body", "body": body, "more_body": False})
                return
            state["sized"] = any(k.lower() == b"content-length" for k, _ in msg.get("headers") or ())
        elif kind == "http.response.body" and not state["sized"] and not leading():
            state["refused"] = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        await send(msg)

    return gated


def _replay(body: bytes):
    """An ASGI ``receive`` that gives ``body`` once, then waits (a disconnect never
    comes: the real receive was consumed)."""
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await trio.sleep_forever()

    return receive


async def _cancel_on_disconnect(receive, scope: trio.CancelScope) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            scope.cancel()
            return

