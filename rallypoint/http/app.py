"""The HTTP API (runstate's ``/v1/spaces/{spaceId}/...``) as an ASGI application.

Every request goes through :meth:`rallypoint.service.Service.call` with a
:class:`~rallypoint.service.Session` for its bearer key: decoding, permissions, routing
to an actor, and "answered only once durable" are the TCP listener's, unchanged. This
module only maps HTTP onto operations and back:

- **Routing** is on the raw path (names may hold ``%2F``): the part after the first
  ``/v1/spaces/`` is split on ``/`` and each segment percent-decoded once, so a base URL
  with a path prefix works. The endpoint table is :data:`rallypoint.http.endpoints.ROUTES`.
- **Auth**: ``authorization: Bearer <key>`` is an API key of this server; the path's
  ``{spaceId}`` must be the key's space (another is NOT_FOUND, as on TCP). In open mode
  (no key ever created) any bearer, or none, is accepted and the path's space is used.
  A request that may change state (any method but GET, HEAD, OPTIONS) needs
  ``content-type: application/json`` or an ``authorization`` header: else 415 (what a
  page of another site can send without a CORS preflight: a form, ``text/plain``, a
  no-cors fetch). A known path with another method is 405 with ``Allow``; a path
  segment that is not UTF-8 once decoded is 400. (What every listener refuses before
  this app sees a request: :mod:`rallypoint.http.guard`.)
- **Bodies**: JSON objects (camelCase); an empty body is ``{}``. Read up to
  :data:`MAX_BODY` (refused as soon as more is declared or arrives) and decoded by
  :func:`decode_body` (nesting and 64-bit integers checked everywhere in the body).
  Answers are JSON, or 204 where the report says "nothing" (an empty receive or admit).
- **Metrics**: every operation a request runs goes through :meth:`HttpApi.call_op`,
  observed by :attr:`HttpApi.metrics` as a TCP request is. A client gone mid-body is one
  rate-limited DEBUG line (``http-disconnect``), never an ERROR.
- **Errors**: ``{"error": {"code", "message", "requestId"}}`` with the status of
  :data:`STATUS`, and ``Retry-After`` (seconds) when the error has a ``retry_after``.
- **Idempotency-Key** on a non-GET: the stored answer of an earlier request with that key
  is replayed (``idempotency.lookup``); otherwise the request runs and its answer is
  journaled (``idempotency.record``) before it is sent. Both are the node's own steps
  (ops marked ``LOCAL``, run under ``Session.as_local``): no client can make them, so
  no client can forge, squat or read a stored answer. Each operation of a keyed
  request runs as a *step* (``Session.for_step``): its answer is journaled in the same
  entry as its effect, and a retry is answered from it instead of running it again, so
  a crash before the final answer never applies the request twice. A keyed request
  waits for durability once, not per operation: the lookup and the steps go on as
  soon as they are applied (``Service.call_applied``), and the request waits for the
  final record (a later LSN than every step's) or, when nothing is stored, for the
  last LSN its operations depended on, before anything is sent; a stored answer or an
  error of the lookup waits for the lookup's LSN first. (The journal is one sequence:
  one fsync instead of up to three.) Concurrent requests
  with one key wait for the first. Answers that may change on a retry (contention,
  UNAVAILABLE, "nothing yet" 204) are not stored.
- **Long polls** (receive, admit, task result, once, watch): the wait is parked on the
  server (at most 60 s a request); a client that disconnects ends it at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import secrets
import time
from random import getrandbits
from typing import Any, Awaitable, Callable
from urllib.parse import parse_qsl, unquote

import msgspec
import trio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from ..errors import (
    RallypointError,
    UnauthenticatedError,
    ValidationError,
)
from ..actors.api import REPLY_TYPES
from ..logutil import RateLimitedLogger, printable
from ..protocol import IdempotencyLookup, IdempotencyRecord
from ..service import Session

log = logging.getLogger("rallypoint.http")

__all__ = ["HttpApi", "lifespan", "Ctx", "STATUS", "MAX_BODY", "MAX_JSON_DEPTH", "decode_body", "check_json", "reject_body"]

#: The HTTP status of each error code (the wire report's, §2.2 and §4).
STATUS: dict[str, int] = {
    "VALIDATION_FAILED": 400,
    "UNAUTHENTICATED": 401,
    "FORBIDDEN": 403,
    "NOT_FOUND": 404,
    "CURSOR_EXPIRED": 410,
    "RATE_LIMITED": 429,
    "SERVICE_RATE_LIMITED": 429,
    "CONCURRENCY_LIMITED": 429,
    "ALLOWANCE_EXHAUSTED": 429,
    "ALLOWANCE_COOLDOWN": 429,
    "LIMIT_EXCEEDED": 429,
    "UNAVAILABLE": 503,
    "NOT_LEADER": 503,
    "WRONG_SHARD": 421,
    "INTERNAL": 500,
}
# every other code (CONFLICT, SCOPE_CANCELLED, DEADLINE_EXCEEDED, STALE_CLAIM, CLAIM_HELD,
# CAPACITY_UNAVAILABLE, INSUFFICIENT_BUDGET, BARRIER_*, BACKLOG_FULL, ...) is 409

#: Codes whose answer may change when the same request is retried: never stored.
_TRANSIENT = frozenset({
    "RATE_LIMITED", "SERVICE_RATE_LIMITED", "CONCURRENCY_LIMITED", "BACKLOG_FULL", "LIMIT_EXCEEDED",
    "CAPACITY_UNAVAILABLE", "CLAIM_HELD", "ALLOWANCE_EXHAUSTED", "ALLOWANCE_COOLDOWN", "UNAVAILABLE",
    "INTERNAL", "UNAUTHENTICATED", "FORBIDDEN", "IDEMPOTENCY_CONFLICT", "NOT_LEADER",
})

#: Largest request body (the TCP frame limit), bytes.
MAX_BODY = 1 << 20
#: Deepest nesting of arrays/objects a request body may have: well under what the
#: recursive msgpack/JSON coders manage (about 900 levels, ``wire.NESTING_MESSAGE``), so
#: an accepted value can also be stored, answered and read by every client.
MAX_JSON_DEPTH = 512
#: The integers a request may carry: what msgpack (the wire, the journal) can hold.
INT_MIN, INT_MAX = -(1 << 63), (1 << 64) - 1

_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode
#: 19 digits in a row: the shortest text that may be an integer outside INT_MIN..INT_MAX
_LONG_DIGITS = re.compile(rb"[0-9]{19}")


def decode_body(data: bytes) -> dict:
    """A request body (JSON text, bytes) as a dict, or VALIDATION_FAILED saying what is
    wrong: not JSON, not an object, nested deeper than :data:`MAX_JSON_DEPTH`, or an
    integer outside the 64-bit range (:data:`INT_MIN`..:data:`INT_MAX`), naming where
    (``input[3].n``). Every endpoint's body goes through this; fields an endpoint ignores
    are checked too (they would be stored or re-encoded elsewhere)."""
    try:
        body = _json_decode(data)
    except msgspec.DecodeError as e:
        raise ValidationError(f"the body is not JSON: {e}") from None
    except RecursionError:  # msgspec's decoder recurses
        raise ValidationError(f"the body is nested more than {MAX_JSON_DEPTH} levels deep; send flatter "
                              "JSON") from None
    if not isinstance(body, dict):
        raise ValidationError("the body must be a JSON object")
    # the walk only when the text could hold a problem: enough brackets, or a long number
    if data.count(b"[") + data.count(b"{") > MAX_JSON_DEPTH or _LONG_DIGITS.search(data) is not None:
        check_json(body)
    return body


def check_json(value: Any) -> None:
    """Raise VALIDATION_FAILED if the decoded JSON ``value`` nests deeper than
    :data:`MAX_JSON_DEPTH` or holds an integer outside :data:`INT_MIN`..:data:`INT_MAX`;
    the message names the place. Iterative (no recursion, whatever the depth)."""
    # (value, depth, parent entry, key): the path is rebuilt only for the message
    stack: list[tuple[Any, int, Any, Any]] = [(value, 1, None, None)]
    while stack:
        entry = stack.pop()
        v, depth = entry[0], entry[1]
        if type(v) is dict:
            if depth > MAX_JSON_DEPTH:
                raise ValidationError(f"the body is nested more than {MAX_JSON_DEPTH} levels deep (at "
                                      f"{_where(entry)}); send flatter JSON", details={"field": _where(entry)})
            for k, x in v.items():
                if type(x) in (dict, list, int):
                    stack.append((x, depth + 1, entry, k))
        elif type(v) is list:
            if depth > MAX_JSON_DEPTH:
                raise ValidationError(f"the body is nested more than {MAX_JSON_DEPTH} levels deep (at "
                                      f"{_where(entry)}); send flatter JSON", details={"field": _where(entry)})
            for i, x in enumerate(v):
                if type(x) in (dict, list, int):
                    stack.append((x, depth + 1, entry, i))
        elif type(v) is int and not INT_MIN <= v <= INT_MAX:
            where = _where(entry)
            raise ValidationError(f"{where} is an integer outside the 64-bit range ({INT_MIN}..{INT_MAX}); "
                                  "send a smaller number (or a string, where the field takes one)",
                                  details={"field": where})


def _where(entry) -> str:
    """``input[3].n`` for a :func:`check_json` stack entry (``body`` for the top)."""
    keys = []
    while entry is not None and entry[2] is not None:
        keys.append(entry[3])
        entry = entry[2]
    out = ""
    for k in reversed(keys):
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out or "body"


def reject_body(message: str, code: str = "UNAVAILABLE") -> bytes:
    """The error envelope (JSON bytes) of an answer made before any request was read (a
    connection over the limit)."""
    return _json_encode({"error": {"code": code, "message": message, "requestId": secrets.token_hex(8)}})


class HttpError(Exception):
    """An answer made by the HTTP layer itself (bad route, body)."""


class HttpRefusal(RallypointError):
    """VALIDATION_FAILED answered with its own HTTP ``status`` (405, 415...) and extra
    ``headers`` (``{"allow": "GET, POST"}``) instead of 400."""

    code = "VALIDATION_FAILED"

    def __init__(self, message: str, status: int, headers: dict[str, str] | None = None, **kw) -> None:
        super().__init__(message, **kw)
        self.http_status = status
        self.http_headers = headers or {}


#: Methods that change nothing (RFC 9110 §9.2.1): the only ones a browser may send
#: cross-site without the JSON content type or key the others need.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def json_content_type(value: bytes | None) -> bool:
    """Whether a ``content-type`` header value (raw, or None) is JSON: media type
    ``application/json`` or ``application/*+json``, parameters (``; charset=utf-8``)
    allowed. A browser can send no such type to another origin without asking it first
    (a CORS preflight, which this server never grants)."""
    if value is None:
        return False
    media = value.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


def _unquote(segment: str, what: str) -> str:
    """One path segment percent-decoded (UTF-8); VALIDATION_FAILED naming ``what`` when
    the bytes it encodes are not UTF-8 (``%ff``)."""
    try:
        return unquote(segment, errors="strict")
    except UnicodeDecodeError:
        raise ValidationError(f"the path's {what} is not UTF-8 once percent-decoded; encode names as UTF-8",
                              details={"field": what}) from None


class Ctx:
    """One request: its session, path parameters, JSON body and query, and
    :meth:`call` to run operations through the service."""

    __slots__ = ("api", "request", "session", "params", "body", "query", "long_poll", "idempotency", "steps",
                 "calls", "secret", "routed", "lsn")

    def __init__(self, api: "HttpApi", request: Request, session: Session, params: dict, body: dict, query: dict,
                 secret: str | None = None):
        self.api = api
        self.request = request
        self.session = session
        self.params = params
        self.body = body
        self.query = query
        self.long_poll = False
        #: (Idempotency-Key, fingerprint) of a keyed request; its operations are its steps
        self.idempotency: tuple[str, str] | None = None
        self.steps = 0
        #: a keyed request: the newest LSN an answer of its local operations depended on
        #: (not waited for yet: the request waits once, before it answers)
        self.lsn = 0
        #: operations run so far (a sharded cluster forwards a request whose first one
        #: is another shard's)
        self.calls = 0
        #: the bearer key's secret (None in open mode): a call routed to another shard
        #: is made under it
        self.secret = secret
        #: forwarded here by another node of a sharded cluster (never forwarded again)
        self.routed = False

    async def call(self, op: msgspec.Struct):
        """Run ``op`` as this request's session; the decoded reply Struct (raises the
        RallypointError it answered). A long poll (``wait_ms`` > 0) ends when the client
        disconnects. In a request with an Idempotency-Key, each call is the request's
        next step: its answer is stored with its effect and answered from the store when
        the request is retried (``actors/idempotency.py``).

        On a sharded cluster (``api.router``) an op of another shard is routed
        (:mod:`rallypoint.cluster.httproute`): the request's first op raises
        :class:`~rallypoint.cluster.httproute.Elsewhere` (the whole request is
        forwarded to its shard), a later one -- or one every shard answers -- is sent
        over the native protocol under the caller's key."""
        api = self.api
        session = self.session
        first = self.calls == 0
        self.calls += 1
        router = api.router
        where = None
        if router is not None:
            where = router.decide(op, session.space, self.idempotency[0] if self.idempotency else None,
                                  routed=self.routed)
            if where[0] == "local":
                where = None
            elif where[0] == "shard" and first and not self.routed:
                from ..cluster.httproute import Elsewhere

                raise Elsewhere(where[1])
        if self.idempotency is not None:
            session = session.for_step(*self.idempotency, self.steps)
            self.steps += 1
        wait = getattr(op, "wait_ms", 0) or 0
        if where is None and self.idempotency is not None:  # a local step: applied now, durable before the answer
            call = api.call_op_applied(session, op)
            reply, lsn = await (api.until_disconnect(self.request, call) if wait > 0 else call)
            if lsn > self.lsn:
                self.lsn = lsn
            if isinstance(reply, BaseException):
                raise reply
            raw = reply
        else:
            if where is not None:
                call = router.call(self.secret, session.space, op)
            else:
                call = api.call_op(session, op)
            if wait > 0:
                raw = await api.until_disconnect(self.request, call)
            else:
                raw = await call
        rtype = REPLY_TYPES.get(type(op))
        return msgspec.msgpack.decode(raw, type=rtype) if rtype is not None else None


Handler = Callable[[Ctx], Awaitable[Any]]


class NoContent:
    """A handler's "nothing" (204)."""


NO_CONTENT = NoContent()

_JSON = b"application/json"


class Answer:
    """An HTTP answer: ``status_code``, ``body`` (bytes) and ``raw_headers`` (the ASGI
    list), sent by calling it as an ASGI app. The headers are what starlette's
    ``Response(body, status_code, headers=headers, media_type=...)`` makes, in the same
    order (``headers``' own, then ``content-length`` unless the status has no body, then
    ``content-type``), without its per-answer machinery."""

    __slots__ = ("status_code", "body", "raw_headers")

    def __init__(self, body: bytes, status_code: int, headers: dict[str, str], json: bool = True) -> None:
        self.status_code = status_code
        self.body = body
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        if not (status_code < 200 or status_code in (204, 304)):
            raw.append((b"content-length", b"%d" % len(body)))
        if json:
            raw.append((b"content-type", _JSON))
        self.raw_headers = raw

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body})


def _request_id() -> str:
    """A request's id: 16 random hex digits (not secret: no system call for it)."""
    return "%016x" % getrandbits(64)


async def lifespan(receive, send) -> None:
    """ASGI lifespan: nothing to start or stop (the app lives on its coordinator)."""
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


#: the ASGI scope's key of a callable that stops a request counting as in progress
UNCOUNT_KEY = "rallypoint.uncount"


class HttpApi:
    """The ASGI application. ``service``: the coordinator's
    :class:`~rallypoint.service.Service`; ``max_requests``: requests in progress at once
    (more are answered 429 CONCURRENCY_LIMITED with ``Retry-After``)."""

    def __init__(self, service, *, max_requests: int = 1024) -> None:
        from .endpoints import ROUTES

        self.service = service
        self.coordinator = service.coordinator
        self.routes: dict[str, list[tuple[tuple[str, ...], Handler]]] = {}
        for method, path, handler in ROUTES:
            segs = tuple(path.strip("/").split("/"))
            self.routes.setdefault(method, []).append((segs, handler))
        self.max_requests = max_requests
        self.in_progress = 0
        self.requests = 0
        #: requests whose client went away before their body was read
        self.disconnects = 0
        #: a rallypoint.metrics.Metrics: every operation is observed as on TCP (or None)
        self.metrics: Any = None
        #: the :class:`~rallypoint.http.server.HttpListener` serving this app, if any
        self.listener: Any = None
        #: repeated log events of the HTTP listener (disconnects, accept failures)
        self.log_limiter = RateLimitedLogger(log, window_s=10.0, burst=5)
        #: malformed requests (a path that is not UTF-8, a cross-site form, a forged
        #: routed header): one line per kind and 10 s, then a count
        self.refusals = RateLimitedLogger(log, window_s=10.0, burst=1)
        #: a sharded cluster's :class:`~rallypoint.cluster.httproute.HttpRouter` (None:
        #: every op is this node's)
        self.router: Any = None
        self._inflight_keys: dict[tuple[str, str], trio.Event] = {}

    def flush_logs(self) -> None:
        """Report what the rate-limited log suppressed (call on stop)."""
        self.log_limiter.flush()
        self.refusals.flush()

    async def call_op(self, session: Session, op: msgspec.Struct) -> bytes:
        """``Service.call(session, op)``, observed by :attr:`metrics` (operation,
        code, seconds; the slow-request log, which never counts a wait the op's ``@op``
        mark says its client asked for) like a TCP request. A call cancelled (its client
        went away) is not counted: no answer left."""
        metrics = self.metrics
        if metrics is None:
            return await self.service.call(session, op)
        t0 = time.perf_counter()
        try:
            raw = await self.service.call(session, op)
        except RallypointError as e:
            metrics.observe(type(op).__struct_config__.tag, e.code, time.perf_counter() - t0, session.peer, op)
            raise
        except Exception:
            metrics.observe(type(op).__struct_config__.tag, "INTERNAL", time.perf_counter() - t0, session.peer, op)
            raise
        metrics.observe(type(op).__struct_config__.tag, "OK", time.perf_counter() - t0, session.peer, op)
        return raw

    async def call_op_applied(self, session: Session, op: msgspec.Struct) -> tuple[Any, int]:
        """:meth:`call_op` without the wait for durability (``Service.call_applied``):
        ``(encoded reply or the exception it answered, LSN)``; observed by
        :attr:`metrics` until applied."""
        metrics = self.metrics
        if metrics is None:
            return await self.service.call_applied(session, op)
        t0 = time.perf_counter()
        try:
            reply, lsn = await self.service.call_applied(session, op)
        except Exception:
            metrics.observe(type(op).__struct_config__.tag, "INTERNAL", time.perf_counter() - t0, session.peer, op)
            raise
        code = "OK" if not isinstance(reply, BaseException) else getattr(reply, "code", "INTERNAL")
        metrics.observe(type(op).__struct_config__.tag, code, time.perf_counter() - t0, session.peer, op)
        return reply, lsn

    # ------------------------------------------------------------------ ASGI
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        response = await self.handle(request)
        await response(scope, receive, send)

    async def handle(self, request: Request) -> Answer | Response:
        rid = _request_id()
        self.requests += 1
        if self.in_progress >= self.max_requests:
            return self._error(RallypointError(
                f"more than {self.max_requests} HTTP requests in progress; retry shortly",
                retry_after=0.2, code="CONCURRENCY_LIMITED"), rid)
        self.in_progress += 1
        counted = [True]
        # (a request closed to make room while its body was coming stops counting as it
        # is closed: rallypoint.http.server._BodyDeadline, before its handler unwinds)
        request.scope[UNCOUNT_KEY] = lambda: self._uncount(counted)
        try:
            return await self._handle(request, rid)
        except RallypointError as e:
            return self._error(e, rid)
        except HttpError as e:
            return self._error(ValidationError(str(e)), rid)
        except ClientDisconnect:  # gone mid-body: routine (as a TCP reset), nobody to answer
            self.disconnects += 1
            self.log_limiter.log(logging.DEBUG, "http-disconnect",
                                 "HTTP client %s disconnected before its request body was read (%s %s)",
                                 _peer(request), printable(request.method, 20), _logged_path(request))
            return self._error(RallypointError("the client disconnected", code="UNAVAILABLE"), rid)
        except Exception as e:  # a bug: INTERNAL, keep serving (a traceback a window, then a count)
            self.log_limiter.log(logging.ERROR, "http-internal", "internal error on %s %s",
                                 printable(request.method, 20), _logged_path(request), exc_info=e)
            return self._error(RallypointError(f"internal error: {type(e).__name__}", code="INTERNAL"), rid)
        finally:
            self._uncount(counted)

    def _uncount(self, counted: list) -> None:
        if counted[0]:
            counted[0] = False
            self.in_progress -= 1

    async def _handle(self, request: Request, rid: str) -> Answer | Response:
        scope = request.scope
        method = scope["method"]
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        raw = raw_path.decode("latin-1").split("?", 1)[0]
        i = raw.find("/v1/spaces/")
        if i < 0:
            raise_not_found(f"no endpoint {method} {raw} (paths start with /v1/spaces/{{spaceId}})")
        parts = raw[i + len("/v1/spaces/"):].split("/")
        try:
            space = _unquote(parts[0], "spaceId") if "%" in parts[0] else parts[0]
            rest = tuple(parts[1:])
            handler, params = self._match(method, rest)
        except ValidationError as e:  # (a segment that is not UTF-8: _unquote)
            self.refusals.log(logging.INFO, "http-bad-path", "HTTP: refused %s %s from %s: %s",
                              printable(method, 20), _logged_path(request), _peer(request), e.message)
            raise
        # the headers this layer reads, in one pass (the first of each, as starlette's Headers.get)
        auth = agent = key = length = ctype = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                if auth is None:
                    auth = value
            elif name == b"user-agent":
                if agent is None:
                    agent = value
            elif name == b"idempotency-key":
                if key is None:
                    key = value
            elif name == b"content-length":
                if length is None:
                    length = value
            elif name == b"content-type":
                if ctype is None:
                    ctype = value
        session, secret = self._session(request, space, auth, agent)
        if method not in SAFE_METHODS and auth is None and not json_content_type(ctype):
            # a form or text/plain POST (or a no-cors fetch) from a page of another site:
            # a browser sends it without asking; JSON or a key it cannot send so
            self.refusals.log(logging.INFO, "http-not-json", "HTTP: refused %s %s from %s: content-type %s "
                              "and no key", printable(method, 20), _logged_path(request), _peer(request),
                              printable(ctype or b"(none)", 80))
            raise HttpRefusal(f"a {method} needs content-type: application/json or an authorization header "
                              f"(got {printable(ctype, 80) if ctype is not None else 'no content-type'}); "
                              "a browser page of another site can send neither", 415)
        qs = scope.get("query_string", b"")
        query = {k: v for k, v in parse_qsl(qs.decode("latin-1"), keep_blank_values=True)} if qs else {}
        body: dict = {}
        data = b""
        if method != "GET":
            data = await _read_body(request, length.decode("latin-1") if length is not None else None)
            if data.strip():
                body = decode_body(data)
        ctx = Ctx(self, request, session, params, body, query, secret)
        ikey = key.decode("latin-1") if key is not None and method != "GET" else None
        if self.router is not None:
            from ..cluster.httproute import ROUTED_HEADER, Elsewhere

            token = request.headers.get(ROUTED_HEADER)
            if token is not None:
                # honoured only when another node of the cluster signed this very request
                ctx.routed = self.router.routed_by_peer(token, method, scope, data)
                if not ctx.routed:
                    self.refusals.log(logging.WARNING, "http-routed-forged",
                                      "HTTP: ignored a %s header that no node of the cluster signed (%s %s from "
                                      "%s); the request is served as a client's", ROUTED_HEADER,
                                      printable(method, 20), _logged_path(request), _peer(request))
            try:
                return await self._dispatch(ctx, handler, ikey, method, raw, data, rid)
            except Elsewhere as e:  # the request's first op is another shard's: run it there
                status, headers, content = await self.until_disconnect(
                    request, self.router.forward(request, data, e.shard))
                return Response(content, status_code=status, headers=dict(headers))
        return await self._dispatch(ctx, handler, ikey, method, raw, data, rid)

    async def _dispatch(self, ctx: Ctx, handler: Handler, key: str | None, method: str, raw: str, data: bytes,
                        rid: str) -> Answer:
        if key:
            return await self._idempotent(ctx, handler, key, method, raw, data, rid)
        return self._respond(await self._run(handler, ctx, rid), rid)

    def _match(self, method: str, rest: tuple[str, ...]) -> tuple[Handler, dict]:
        for segs, handler in self.routes.get(method, ()):
            if len(segs) != len(rest):
                continue
            params = {}
            for pat, got in zip(segs, rest):
                if pat.startswith("{"):
                    if not got:
                        break
                    params[pat[1:-1]] = _unquote(got, pat[1:-1]) if "%" in got else got
                elif pat != got:
                    break
            else:
                return handler, params
        other = [m for m, rs in self.routes.items() if m != method and any(
            len(s) == len(rest) and all(p.startswith("{") or p == g for p, g in zip(s, rest)) for s, _ in rs)]
        if other:
            allowed = sorted(other)
            raise HttpRefusal(f"{method} is not allowed here (use {', '.join(allowed)})", 405,
                              {"allow": ", ".join(allowed)}, details={"allowed": allowed})
        raise_not_found(f"no endpoint {method} /{'/'.join(rest)}")

    def _session(self, request: Request, space: str, authorization: bytes | None = None,
                 user_agent: bytes | None = None) -> tuple[Session, str | None]:
        """The request's session and its bearer secret (None in open mode): the key its
        ``authorization`` header (raw bytes) names for ``space``; ``user_agent`` (raw) is
        the session's client name."""
        coord = self.coordinator
        auth = authorization.decode("latin-1") if authorization is not None else ""
        secret = auth[7:].strip() if auth[:7].lower() == "bearer " else None
        c = request.scope.get("client")
        peer = f"{c[0]}:{c[1]}" if c else ""
        client = user_agent.decode("latin-1") if user_agent is not None else ""  # Session.holder's client name
        if coord.keys.open_mode:  # (refused, its long polls ended, once the first key exists)
            return Session(space=space, peer=peer, client=client, open=True), None
        if not secret:
            raise UnauthenticatedError("this server requires an API key: send authorization: Bearer <key>")
        key = coord.keys.authenticate(secret)
        if key.space != space:
            raise_not_found(f"no space {space!r} for this key")
        return Session(space=key.space, permissions=frozenset(key.permissions), peer=peer, key_id=key.id,
                       client=client), secret

    async def _run(self, handler: Handler, ctx: Ctx, rid: str):
        try:
            return 200, await handler(ctx)
        except RallypointError as e:
            return e

    # ------------------------------------------------------------------ idempotency
    async def _idempotent(self, ctx: Ctx, handler: Handler, key: str, method: str, path: str, data: bytes,
                          rid: str) -> Answer:
        space = ctx.session.space
        fp = hashlib.sha256(b"%s %s\n" % (method.encode(), path.encode()) + data).hexdigest()[:32]
        slot = (space, key)
        while (ev := self._inflight_keys.get(slot)) is not None:  # the same key in flight: wait for it
            await self.until_disconnect(ctx.request, ev.wait())
        ev = self._inflight_keys[slot] = trio.Event()
        service = self.service
        try:
            # the node's own steps (LOCAL ops: no client may make them), under the request's grant
            node = ctx.session.as_local()
            reply, ctx.lsn = await self.call_op_applied(node, IdempotencyLookup(key=key, fingerprint=fp))
            if isinstance(reply, BaseException):
                await service.wait_durable(ctx.lsn)
                raise reply
            stored = msgspec.msgpack.decode(reply, type=REPLY_TYPES[IdempotencyLookup])
            if stored.found:
                await service.wait_durable(ctx.lsn)
                return self._replay(stored.status, stored.body, rid)
            ctx.idempotency = (key, fp)  # each step's answer is stored with its effect
            try:
                result = await self._run(handler, ctx, rid)
                response = self._respond(result, rid)
                status, body = self._storable(result, response)
                if status is not None:  # durable: so is every local step before it (one journal)
                    await self.service_call(node, IdempotencyRecord(key=key, fingerprint=fp, status=status,
                                                                    body=body))
                    return response
            except Exception:  # a bug (INTERNAL) or the record's error: answered once durable, as before
                with contextlib.suppress(Exception):
                    await service.wait_durable(ctx.lsn)
                raise
            await service.wait_durable(ctx.lsn)
            return response
        finally:
            del self._inflight_keys[slot]
            ev.set()

    async def service_call(self, session: Session, op):
        raw = await self.call_op(session, op)
        return msgspec.msgpack.decode(raw, type=REPLY_TYPES[type(op)])

    def _storable(self, result, response: Answer) -> tuple[int | None, bytes]:
        if isinstance(result, RallypointError):
            if result.code in _TRANSIENT:
                return None, b""
            return response.status_code, bytes(response.body)
        if response.status_code == 204:
            return None, b""
        return response.status_code, bytes(response.body)

    def _replay(self, status: int, body: bytes, rid: str) -> Answer:
        return Answer(body, status, {"x-request-id": rid, "idempotent-replayed": "true"})

    # ------------------------------------------------------------------ answers
    def _respond(self, result, rid: str) -> Answer:
        if isinstance(result, RallypointError):
            return self._error(result, rid)
        _, value = result
        if value is NO_CONTENT:
            return Answer(b"", 204, {"x-request-id": rid}, json=False)
        return Answer(_json_encode(value), 200, {"x-request-id": rid})

    def _error(self, e: RallypointError, rid: str) -> Answer:
        code = e.code
        status = getattr(e, "http_status", None) or STATUS.get(code, 409)
        err: dict[str, Any] = {"code": code, "message": e.message or str(e), "requestId": rid}
        if e.details:
            err["details"] = _jsonable(e.details)
        headers = {"x-request-id": rid, **getattr(e, "http_headers", {})}
        if e.retry_after is not None:
            headers["retry-after"] = f"{max(0.0, float(e.retry_after)):.3g}"
        return Answer(_json_encode({"error": err}), status, headers)

    # ------------------------------------------------------------------ long polls
    async def until_disconnect(self, request: Request, awaitable):
        """Await ``awaitable``; if the client disconnects first, cancel it (a parked wait
        ends at once: a delivery is not leased to a caller that has gone) and answer
        nothing."""
        result: list = []
        failure: list = []

        async with trio.open_nursery() as nursery:
            async def run():
                try:
                    result.append(await awaitable)
                except RallypointError as e:  # the answer (kept out of the nursery's exception group)
                    failure.append(e)
                nursery.cancel_scope.cancel()

            async def watch():
                receive = request.receive
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        nursery.cancel_scope.cancel()
                        return

            nursery.start_soon(run)
            nursery.start_soon(watch)
        if failure:
            raise failure[0]
        if not result:
            raise RallypointError("the client disconnected", code="UNAVAILABLE")
        return result[0]


async def _read_body(request: Request, declared: str | None) -> bytes:
    """The request's body, at most :data:`MAX_BODY` bytes: VALIDATION_FAILED as soon as
    ``declared`` (its ``content-length`` header, or None) or what arrived says more (the
    rest is never buffered). Raises starlette's ClientDisconnect if the client goes away
    first. Reads the ASGI messages itself (``request.stream()``'s generator cost more
    than the rest of a small request's reading)."""
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY:
        raise ValidationError(f"request body exceeds {MAX_BODY} bytes ({declared} declared)")
    receive = request.receive
    first = b""
    chunks: list[bytes] | None = None
    size = 0
    while True:
        msg = await receive()
        kind = msg["type"]
        if kind == "http.request":
            chunk = msg.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > MAX_BODY:
                    raise ValidationError(f"request body exceeds {MAX_BODY} bytes")
                if chunks is not None:
                    chunks.append(chunk)
                elif first:
                    chunks = [first, chunk]
                else:
                    first = chunk
            if not msg.get("more_body", False):
                break
        elif kind == "http.disconnect":
            raise ClientDisconnect()
    return b"".join(chunks) if chunks is not None else bytes(first)


def _peer(request: Request) -> str:
    c = request.scope.get("client")
    return f"{c[0]}:{c[1]}" if c else "?"


def _logged_path(request: Request) -> str:
    """The request's raw path as a log line may hold it (escaped, cut)."""
    scope = request.scope
    return printable(scope.get("raw_path") or scope.get("path", ""), 200)


def raise_not_found(message: str):
    raise RallypointError(message, code="NOT_FOUND")


def _jsonable(v):
    try:
        _json_encode(v)
        return v
    except (TypeError, msgspec.EncodeError):
        return {k: repr(x) for k, x in v.items()} if isinstance(v, dict) else repr(v)
