"""The web console for operators (``rallypoint serve --console HOST:PORT``), an ASGI app.

Read-only HTML pages rendered on the server from the coordinator's read operations, a
little plain JavaScript (``static/console.js``: lazy tree expansion, live refresh, the
event table and the chart) and server-sent events for what changes.

- **Every read is an operation**: a page calls :meth:`ConsoleApp.call` with the login's
  :class:`~rallypoint.service.Session`, which goes through ``Service.call`` -- decoding,
  permission, routing to an actor, the session's space on every lookup, "answered once
  durable" -- exactly as a TCP or HTTP request. Nothing reads the coordinator's tables.
  :meth:`ConsoleApp.call` runs only operations whose permission is
  ``coordination_read`` (else INTERNAL: a bug in a page), and a login's session holds
  only that permission: a page cannot change anything, in open mode neither.
- **Actions** (:mod:`rallypoint.console.actions`): ``/actions/<name>``, a confirmation
  page and a POST with the session's CSRF token, run the wire's operation under the
  login's key and its own permissions (checked by ``Service.call``), then journal
  ``console.acted`` (the event ``console.action`` with the key id).
- **Trends** (:mod:`rallypoint.console.trends`): :attr:`ConsoleApp.trends`, a ring of
  queue samples (depth, in flight, completions/s, p50/p99 lifecycle latency) that
  ``serve_console`` samples every 10 s.
- **Login** (:mod:`rallypoint.console.auth`): the API key is typed once into a form and
  POSTed (never in a URL, never logged); the server keeps ``sha256(token) -> login``
  and the browser an opaque random token in an ``HttpOnly``, ``SameSite=Strict`` cookie
  (``Secure`` and ``__Host-`` prefixed under TLS). A login sees its key's space only;
  revoking the key ends its console sessions at their next request, and its open
  ``/stream`` at once (``gone`` with ``signedOut``: the page goes to the sign-in form). In open mode (no key
  ever created) no login is needed: the ``default`` space.
- **Live**: ``GET /stream`` is an ``text/event-stream`` fed by an in-process
  subscription (``Service.subscribe``, the path ``GET /watch`` of the HTTP API uses) from
  now on, filtered by event types and a run's subtree; a page gets either the events or a
  coalesced "changed" signal (then it fetches the HTML of its live parts again, at most
  once a second), and with ``stats=1`` a sample each second (tasks done per second,
  server requests per second and latency from :class:`rallypoint.metrics.Metrics`, the
  queues). No polling loop in the browser.
- **Hardening**: every answer carries a Content-Security-Policy that allows only this
  origin's script and style (no inline script: every value is HTML-escaped, event data
  is inserted as text), ``frame-ancestors 'none'``, ``no-referrer`` and ``no-store``; a
  POST (login, logout, an action) from another origin is refused (FORBIDDEN).
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import time
from collections import deque
from dataclasses import dataclass
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import msgspec
import trio
from starlette.requests import Request
from starlette.responses import Response

from .. import protocol as p
from ..actors.api import OPS, REPLY_TYPES
from ..errors import ForbiddenError, RallypointError, UnauthenticatedError, ValidationError
from ..logutil import RateLimitedLogger, printable
from ..service import Session
from . import actions, pages
from .trends import Trends

log = logging.getLogger("rallypoint.console")

__all__ = ["ConsoleApp", "Login", "READ", "READ_ONLY", "CSP", "serve_console"]

READ = "coordination_read"
#: The only permission a console session holds (and the only one its reads may need).
READ_ONLY = frozenset({READ})

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cross-origin-opener-policy": "same-origin",
    "cache-control": "no-store",
}

#: Largest login form body, bytes.
MAX_FORM = 4096
#: Operations that may wait on the server by design (their ``@op`` mark says so; a
#: receive or a result asked to wait): not in the chart's latency.
WAIT_OPS = frozenset(d.tag for d in OPS.values() if d.waits.waits is not False) | {"events.watch"}
#: Events one ``events`` message of the stream carries at most (the rest are counted).
MAX_EVENTS_MESSAGE = 500
#: An ``events`` message is sent at most this often (seconds): under load a stream costs
#: at most 1/EVENTS_EVERY_S messages of MAX_EVENTS_MESSAGE events a second (issue 46).
EVENTS_EVERY_S = 0.2

_json = msgspec.json.Encoder().encode
_event_decode = msgspec.msgpack.Decoder(p.EventView).decode


@dataclass
class Login:
    """A signed-in browser: its space, key and permissions, and when it was last seen
    (seconds, ``time.monotonic``)."""

    space: str
    key_id: str | None
    key_name: str | None
    last_seen: float
    #: the key's permissions (fixed when a key is made), what the console's actions run
    #: under (:mod:`rallypoint.console.actions`); None in open mode
    permissions: frozenset[str] | None = None


class Ctx:
    """One console request: the app, the request, the login's session, the query."""

    __slots__ = ("app", "request", "session", "query", "params", "login")

    def __init__(self, app: "ConsoleApp", request: Request, session: Session, login: Login, query: dict,
                 params: dict) -> None:
        self.app = app
        self.request = request
        self.session = session
        self.login = login
        self.query = query
        self.params = params

    async def call(self, op: msgspec.Struct):
        """Run the read ``op`` as this login (see :meth:`ConsoleApp.call`)."""
        return await self.app.call(self.session, op)


class _QueueRates:
    """Tasks done per second per work queue, from the ``done`` counters read at
    different times (kept per (space, queue): the last 32 reads of the last minute)."""

    WINDOW_S = 10.0

    def __init__(self) -> None:
        self.samples: dict[tuple[str, str], deque] = {}

    def note(self, space: str, qid: str, done: int, now: float) -> float | None:
        """Record ``done`` at ``now`` (seconds); the rate over the last ~10 s (None until
        two reads at least 0.5 s apart)."""
        d = self.samples.get((space, qid))
        if d is None:
            d = self.samples[(space, qid)] = deque(maxlen=32)
        if not d or now - d[-1][0] >= 0.2:
            d.append((now, done))
        while len(d) > 2 and now - d[1][0] >= self.WINDOW_S:
            d.popleft()
        t0, n0 = d[0]
        if now - t0 < 0.5:
            return None
        return max(0.0, (done - n0) / (now - t0))


class ConsoleApp:
    """The console's ASGI application over ``service`` (a
    :class:`~rallypoint.service.Service`).

    Args:
        service: the coordinator's service.
        secure_cookie: the listener is TLS: the login cookie is ``Secure`` and
            ``__Host-`` prefixed.
        session_idle_s: a login not used for this long (seconds) is forgotten.
        max_sessions: logins kept at once (the oldest is forgotten first).
        max_streams: ``/stream`` connections at once (one more is 503 UNAVAILABLE).
        max_streams_per_client: ``/stream`` connections one peer address, and one API
            key, may hold at once (one more is 503): one client cannot take them all.
    """

    def __init__(self, service, *, secure_cookie: bool = False, session_idle_s: float = 8 * 3600,
                 max_sessions: int = 10_000, max_streams: int = 100, max_streams_per_client: int = 20) -> None:
        self.service = service
        self.coordinator = service.coordinator
        #: a rallypoint.metrics.Metrics: the console's reads are observed like any request,
        #: and the chart reads it (None: no request figures in the chart)
        self.metrics: Any = None
        #: the HttpListener serving this app, if any (set by serve_http)
        self.listener: Any = None
        self.log_limiter = RateLimitedLogger(log, window_s=10.0, burst=5)
        self.secure_cookie = secure_cookie
        self.cookie_name = "__Host-rp_console" if secure_cookie else "rp_console"
        self.session_idle_s = session_idle_s
        self.max_sessions = max_sessions
        self.max_streams = max_streams
        self.max_streams_per_client = max_streams_per_client
        #: open streams per peer address ("peer:HOST") and per API key ("key:ID")
        self.client_streams: dict[str, int] = {}
        self.logins: dict[str, Login] = {}  # sha256(token) hex -> login (insertion order: oldest first)
        self.streams = 0
        self.requests = 0
        self.rates = _QueueRates()
        #: set on shutdown: open streams end at once
        self.stopping = trio.Event()
        #: the key of the actions' CSRF tokens (actions.csrf_token): new each process
        self.csrf_secret = secrets.token_bytes(32)
        #: the queue trends' ring (rallypoint.console.trends), sampled by serve_console
        self.trends = Trends(self.call, self._trend_spaces)
        self._static: dict[str, tuple[bytes, str, str]] = {}  # name -> (bytes, type, etag)
        #: the single node's pages, and those the service adds (a cluster's: /cluster)
        self.routes = pages.routes() + list(getattr(service, "routes", ()))

    def _trend_spaces(self) -> list[str]:
        """The spaces the trends sample: ``default`` and every live key's."""
        keys = self.coordinator.keys
        return ["default"] + sorted({k.space for k in keys.table.values() if k.revoked_at_ms is None} - {"default"})

    def flush_logs(self) -> None:
        self.log_limiter.flush()

    def stop(self) -> None:
        """End every open stream (the daemon is stopping)."""
        self.stopping.set()

    # ------------------------------------------------------------------ reads
    async def call(self, session: Session, op: msgspec.Struct):
        """``Service.call(session, op)`` for a *read* operation, decoded; observed by
        :attr:`metrics` as any request. Raises the operation's RallypointError;
        INTERNAL for an operation that is not a read (a page must never write)."""
        spec = OPS.get(type(op))
        if spec is None or spec.permission != READ:
            raise RallypointError(f"the console only reads; {type(op).__name__} is not a read", code="INTERNAL")
        tag = type(op).__struct_config__.tag
        metrics = self.metrics
        t0 = time.perf_counter()
        try:
            raw = await self.service.call(session, op)
        except RallypointError as e:
            if metrics is not None:
                metrics.observe(tag, e.code, time.perf_counter() - t0, session.peer)
            raise
        if metrics is not None:
            metrics.observe(tag, "OK", time.perf_counter() - t0, session.peer)
        return msgspec.msgpack.decode(raw, type=REPLY_TYPES[type(op)])

    # ------------------------------------------------------------------ ASGI
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        self.requests += 1
        path = scope["path"]
        if path == "/stream" and request.method == "GET":
            try:
                ctx = self._ctx(request, {})
            except UnauthenticatedError as e:
                await self._finish(Response(str(e.message), status_code=401, media_type="text/plain"), scope, receive,
                                   send)
                return
            await self.stream(ctx, scope, receive, send)
            return
        response = await self.handle(request)
        await self._finish(response, scope, receive, send)

    async def _finish(self, response: Response, scope, receive, send) -> None:
        for k, v in _HEADERS.items():
            response.headers.setdefault(k, v)
        await response(scope, receive, send)

    async def handle(self, request: Request) -> Response:
        """Answer one request that is not a stream."""
        path = request.scope["path"]
        # routed on the raw path, each segment decoded once (a queue "a/b" is /queues/a%2Fb)
        raw = request.scope.get("raw_path")
        raw_path = raw.decode("latin-1") if raw else quote(path)
        method = request.method
        try:
            if raw_path.startswith("/static/"):
                return self._static_file(raw_path[len("/static/"):], request.headers.get("if-none-match"))
            if path == "/login":
                return await self._login_post(request) if method == "POST" else self._login_form(request)
            if path == "/logout" and method == "POST":
                return self._logout(request)
            if raw_path.startswith("/actions/"):  # the only writes: forms with a CSRF token (actions.py)
                return await actions.handle(self, request, raw_path)
            if method not in ("GET", "HEAD"):
                return self._plain(405, "the console is read-only: GET only")
            if path == "/":
                return _redirect("/runs")
            if path == "/favicon.ico":
                return Response(b"", status_code=204)
            handler, params = self._match(raw_path)
            if handler is None:
                raise RallypointError(f"no console page {path}", code="NOT_FOUND")
            ctx = self._ctx(request, params)
            page = await handler(ctx)
            part = ctx.query.get("part")
            if part:
                for pt in page.parts:
                    if pt.name == part:
                        return _html(await pt.render())
                raise RallypointError(f"no part {part!r} on this page", code="NOT_FOUND")
            return _html(pages.layout(page, ctx, await _render_all(page.parts)))
        except UnauthenticatedError:
            if request.query_params.get("part") or request.headers.get("x-console-fragment"):
                return self._plain(401, "sign in again")
            return _redirect("/login?next=" + quote(_local_next(request), safe=""))
        except RallypointError as e:
            status = {"NOT_FOUND": 404, "VALIDATION_FAILED": 400, "FORBIDDEN": 403, "UNAVAILABLE": 503,
                      "INTERNAL": 500}.get(e.code, 409)
            return _html(pages.error_page(e, self._maybe_login(request)), status)
        except Exception as e:  # a bug: INTERNAL, keep serving (a traceback a window, then a count)
            self.log_limiter.log(logging.ERROR, "console-internal", "console: internal error on %s %s",
                                 printable(method, 20), printable(request.scope.get("raw_path") or path, 200),
                                 exc_info=e)
            return _html(pages.error_page(RallypointError(f"internal error: {type(e).__name__}", code="INTERNAL"),
                                          None), 500)

    def _match(self, path: str):
        """The page handler and its parameters for ``path`` (raw: each segment is
        percent-decoded here, once); VALIDATION_FAILED for a segment that is not UTF-8."""
        try:
            segs = tuple(unquote(s, errors="strict") for s in path.strip("/").split("/"))
        except UnicodeDecodeError:
            raise ValidationError("the path is not UTF-8 once percent-decoded") from None
        for pattern, handler in self.routes:
            if len(pattern) != len(segs):
                continue
            params = {}
            for pat, got in zip(pattern, segs):
                if pat.startswith("{"):
                    if not got:
                        break
                    params[pat[1:-1]] = got
                elif pat != got:
                    break
            else:
                return handler, params
        return None, {}

    # ------------------------------------------------------------------ logins
    def _ctx(self, request: Request, params: dict) -> Ctx:
        login = self._login_of(request)
        if login is None:
            raise UnauthenticatedError("sign in with an API key")
        client = request.client
        session = Session(space=login.space, permissions=READ_ONLY if login.key_id is not None else None,
                          peer=f"{client.host}:{client.port}" if client else "", key_id=login.key_id,
                          open=login.key_id is None)  # (open mode's: refused once the first key exists)
        query = dict(parse_qsl(request.url.query, keep_blank_values=True))
        return Ctx(self, request, session, login, query, params)

    def _maybe_login(self, request: Request) -> Login | None:
        try:
            return self._login_of(request)
        except RallypointError:
            return None

    def _login_of(self, request: Request) -> Login | None:
        """The request's login: open mode's (space ``default``), or the one its cookie
        names, while its key is live and it was used within ``session_idle_s``."""
        keys = self.coordinator.keys
        if keys.open_mode:
            return Login(space="default", key_id=None, key_name=None, last_seen=time.monotonic())
        token = request.cookies.get(self.cookie_name)
        if not token:
            return None
        h = _digest(token)
        login = self.logins.get(h)
        if login is None:
            return None
        now = time.monotonic()
        if now - login.last_seen > self.session_idle_s or login.key_id is None or keys.is_revoked(login.key_id):
            del self.logins[h]
            return None
        login.last_seen = now
        return login

    def _login_form(self, request: Request, error: str | None = None, status: int = 200) -> Response:
        if self.coordinator.keys.open_mode:
            return _redirect("/runs")
        nxt = _safe_next(request.query_params.get("next"))
        return _html(pages.login_page(nxt, error), status)

    async def _login_post(self, request: Request) -> Response:
        self._check_origin(request)
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_FORM:
                return self._plain(400, f"the login form is larger than {MAX_FORM} bytes")
        form = dict(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))
        nxt = _safe_next(form.get("next"))
        keys = self.coordinator.keys
        if keys.open_mode:
            return _redirect(nxt)
        secret = (form.get("key") or "").strip()
        try:
            key = keys.authenticate(secret)
        except RallypointError:
            client = request.client
            self.log_limiter.log(logging.WARNING, "console-login",
                                 "console: a sign-in with an unknown or revoked API key from %s",
                                 client.host if client else "?")
            return _html(pages.login_page(nxt, "Unknown or revoked API key."), 401)
        perms = set(key.permissions)
        if not perms & {READ, "admin", "operator"}:
            return _html(pages.login_page(nxt, "This key lacks the coordination_read permission the console needs."),
                         403)
        token = secrets.token_urlsafe(32)
        while len(self.logins) >= self.max_sessions:
            self.logins.pop(next(iter(self.logins)))
        self.logins[_digest(token)] = Login(space=key.space, key_id=key.id, key_name=key.name,
                                            last_seen=time.monotonic(), permissions=frozenset(key.permissions))
        log.info("console: key %s signed in (space %s)", key.id, key.space,
                 extra={"event": "console_login", "key_id": key.id, "space": key.space})
        resp = _redirect(nxt)
        resp.set_cookie(self.cookie_name, token, path="/", httponly=True, samesite="strict", secure=self.secure_cookie)
        return resp

    def _logout(self, request: Request) -> Response:
        self._check_origin(request)
        token = request.cookies.get(self.cookie_name)
        if token:
            self.logins.pop(_digest(token), None)
        resp = _redirect("/login")
        resp.delete_cookie(self.cookie_name, path="/", httponly=True, samesite="strict", secure=self.secure_cookie)
        return resp

    def _check_origin(self, request: Request) -> None:
        """A POST must come from a page of this console: FORBIDDEN when the browser says
        it comes from another site (``Sec-Fetch-Site``) or another origin (``Origin``)."""
        site = request.headers.get("sec-fetch-site")
        if site is not None and site not in ("same-origin", "none"):
            raise ForbiddenError("the console accepts forms from its own pages only")
        origin = request.headers.get("origin")
        if origin is not None and origin != "null":
            host = request.headers.get("host", "")
            if origin.split("://", 1)[-1] != host:
                raise ForbiddenError("the console accepts forms from its own pages only")

    # ------------------------------------------------------------------ answers
    def _plain(self, status: int, text: str) -> Response:
        return Response(text, status_code=status, media_type="text/plain; charset=utf-8")

    def _static_file(self, name: str, if_none_match: str | None = None) -> Response:
        """``static/<name>`` (js, css), with an ETag: a browser revalidates it (304)."""
        got = self._static.get(name)
        if got is None:
            types = {"js": "text/javascript; charset=utf-8", "css": "text/css; charset=utf-8"}
            ext = name.rsplit(".", 1)[-1]
            if _STATIC_NAME.fullmatch(name) is None or ext not in types:  # (a NUL, a "..", a slash: no file)
                return self._plain(404, "no such file")
            try:
                data = resources.files(__package__).joinpath("static", *name.split("/")).read_bytes()
            except (FileNotFoundError, OSError):
                return self._plain(404, "no such file")
            got = self._static[name] = (data, types[ext], '"%s"' % hashlib.sha256(data).hexdigest()[:16])
        headers = {"cache-control": "no-cache", "etag": got[2]}
        if if_none_match == got[2]:
            return Response(b"", status_code=304, headers=headers)
        return Response(got[0], media_type=got[1], headers=headers)

    # ------------------------------------------------------------------ the stream
    async def stream(self, ctx: Ctx, scope, receive, send) -> None:
        """``GET /stream?types=&run=&aggregate=&mode=events|notify&stats=1``: server-sent events.
        ``ready`` once subscribed; ``events`` (a JSON list of events, mode ``events``) or
        ``changed`` (mode ``notify``: something matching happened; at most every 0.5 s);
        ``stats`` each second with ``stats=1``; ``gone`` when the subscription ends
        (SLOW_CONSUMER, the server stopping): the browser reconnects from now -- or, with
        ``signedOut`` true, when the login's key was revoked (or open mode ended): the
        stream ends at once, nothing after the revocation sent, and the page reloads
        (to the sign-in form)."""
        q = ctx.query
        types = [t.strip() for t in (q.get("types") or "").split(",") if t.strip()] or None
        run = q.get("run") or None
        aggregate = q.get("aggregate") or None
        mode = q.get("mode") or "notify"
        want_stats = q.get("stats") == "1"
        if self.streams >= self.max_streams:
            await self._finish(self._plain(503, f"more than {self.max_streams} console streams are open"), scope,
                               receive, send)
            return
        owners = [f"peer:{(scope.get('client') or ('?',))[0]}"]
        if ctx.login.key_id is not None:
            owners.append(f"key:{ctx.login.key_id}")
        counts = self.client_streams
        if any(counts.get(o, 0) >= self.max_streams_per_client for o in owners):
            await self._finish(self._plain(503, f"this client (its address or its key) has {self.max_streams_per_client} "
                                                "console streams open already; close a page"), scope, receive, send)
            return
        # a cluster's merged stream goes on after the vector cursor it gave (the SSE id a
        # reconnecting browser sends back as Last-Event-ID)
        resume = {"resume": q.get("cursor") or ctx.request.headers.get("last-event-id") or None} \
            if getattr(self.service, "merged", False) else {}
        try:
            sink = await self.service.subscribe(ctx.session, p.EventsWatch(start="now", types=types, scope_id=run,
                                                                            aggregate=aggregate),
                                                max_bytes=1 << 20, **resume)
        except RallypointError as e:
            status = {"NOT_FOUND": 404, "VALIDATION_FAILED": 400}.get(e.code, 503)
            await self._finish(self._plain(status, e.message or str(e)), scope, receive, send)
            return
        self.streams += 1
        for o in owners:
            counts[o] = counts.get(o, 0) + 1
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"x-accel-buffering", b"no")]
        headers += [(k.encode(), v.encode()) for k, v in _HEADERS.items()]
        lock = trio.Lock()

        async def emit(event: str, data: Any, event_id: str | None = None) -> None:
            head = b"id: %s\n" % event_id.encode() if event_id else b""
            async with lock:
                await send({"type": "http.response.body", "body": head + b"event: %s\ndata: %s\n\n" % (
                    event.encode(), _json(data)), "more_body": True})

        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b"retry: 2000\n\n", "more_body": True})
            await emit("ready", {"space": ctx.session.space})
            async with trio.open_nursery() as nursery:
                async def until_gone():
                    while True:
                        msg = await receive()
                        if msg["type"] == "http.disconnect":
                            nursery.cancel_scope.cancel()
                            return

                async def until_stopping():
                    await self.stopping.wait()
                    await emit("gone", {"reason": "the server is stopping"})
                    nursery.cancel_scope.cancel()

                nursery.start_soon(until_gone)
                nursery.start_soon(until_stopping)
                counter = [0]
                if want_stats:
                    nursery.start_soon(self._stats_loop, ctx, emit, counter)
                if hasattr(sink, "watch_cluster"):  # a cluster's: failovers and resumes
                    nursery.start_soon(sink.watch_cluster, emit)
                ended = await self._events_loop(sink, mode, emit, counter)
                if ended is not None and ended.code == "UNAUTHENTICATED":  # its key revoked
                    await emit("gone", {"reason": ended.message, "signedOut": True})
                else:
                    await emit("gone", {"reason": "the subscription ended"})
                nursery.cancel_scope.cancel()
        except OSError:  # the client went away mid-send
            pass
        finally:
            self.streams -= 1
            for o in owners:
                if counts.get(o, 0) <= 1:
                    counts.pop(o, None)
                else:
                    counts[o] -= 1
            sink.close()
        with trio.CancelScope(shield=True):
            try:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                pass

    async def _events_loop(self, sink, mode: str, emit, counter: list) -> RallypointError:
        """Forward the subscription's batches until it ends; returns its error."""
        last_notify = 0.0
        while True:
            try:
                batch = await sink.next_batch()
            except RallypointError as e:
                return e
            counter[0] += len(batch)
            if mode == "events":
                wait = last_notify + EVENTS_EVERY_S - trio.current_time()
                if wait > 0:  # paced: what arrives meanwhile joins this message (its oldest counted, not sent)
                    await trio.sleep(wait)
                    more = None
                    try:
                        with trio.move_on_after(0):  # what is buffered now, without waiting for more
                            more = await sink.next_batch()
                    except RallypointError as e:
                        return e
                    if more:
                        counter[0] += len(more)
                        batch = batch + more
                last_notify = trio.current_time()
                evs = [_event_decode(bytes(b)) for b in batch[-MAX_EVENTS_MESSAGE:]]
                msg = {"events": evs, "skipped": max(0, len(batch) - MAX_EVENTS_MESSAGE)}
                cursor = getattr(sink, "cursor", None)  # a cluster's vector cursor: also the SSE id
                if cursor is not None:
                    msg["cursor"] = cursor
                await emit("events", msg, cursor)
            else:
                wait = last_notify + 0.5 - trio.current_time()
                if wait > 0:  # coalesce: what arrives meanwhile is part of this signal
                    await trio.sleep(wait)
                last_notify = trio.current_time()
                await emit("changed", {"n": len(batch)})

    async def _stats_loop(self, ctx: Ctx, emit, counter: list) -> None:
        """Each second: tasks done per second (the space's queues), events per second
        (this stream's), and, from the metrics, requests per second and the p50/p99
        latency of requests that do not wait (server-wide, ms). A read refused (the key
        revoked: the events loop ends the stream too) stops the samples."""
        prev = self._request_totals()
        prev_t = trio.current_time()
        prev_events = counter[0]
        while True:
            await trio.sleep(1.0)
            now = trio.current_time()
            try:
                queues = await pages.queue_rows(ctx)
            except RallypointError:
                return
            totals = self._request_totals()
            dt = max(1e-3, now - prev_t)
            sample: dict[str, Any] = {
                "t": time.time(),
                "done_per_s": round(sum(r for _, r in queues if r is not None), 2),
                "events_per_s": round((counter[0] - prev_events) / dt, 2),
                "queues": [{"name": q.name, "queued": q.queued, "running": q.running,
                            "done_per_s": None if r is None else round(r, 2)} for q, r in queues],
            }
            if totals is not None and prev is not None:
                n = totals[0] - prev[0]
                sample["rps"] = round(n / dt, 1)
                delta = [a - b for a, b in zip(totals[1], prev[1])]
                sample["p50_ms"] = _quantile_ms(delta, 0.5)
                sample["p99_ms"] = _quantile_ms(delta, 0.99)
            prev, prev_t, prev_events = totals, now, counter[0]
            await emit("stats", sample)

    def _request_totals(self) -> tuple[int, list[int]] | None:
        """(requests answered, latency bucket counts of the requests that do not wait),
        server-wide, from the metrics; None without metrics."""
        m = self.metrics
        if m is None:
            return None
        from ..metrics import LATENCY_BOUNDS

        n = 0
        buckets = [0] * (len(LATENCY_BOUNDS) + 1)
        for op, h in list(m.latency.items()):
            counts = h.counts
            n += sum(counts)
            if op not in WAIT_OPS:
                for i, c in enumerate(counts):
                    buckets[i] += c
        return n, buckets


async def _render_all(parts) -> list[str]:
    """Render every part of a page at once (each waits for its reads' answers, which
    are held until the journal is durable: concurrent, a page costs about one such wait,
    not one per read); the first error a part raised is raised."""
    out: list = [None] * len(parts)
    errors: list[BaseException] = []

    async def one(i, part):
        try:
            out[i] = await part.render()
        except Exception as e:  # (kept out of the nursery's exception group)
            errors.append(e)

    async with trio.open_nursery() as nursery:
        for i, part in enumerate(parts):
            nursery.start_soon(one, i, part)
    if errors:
        raise errors[0]
    return out


def _quantile_ms(buckets: list[int], q: float) -> float | None:
    """The upper bound (ms) of the latency bucket holding quantile ``q`` of ``buckets``
    (None when empty; the last bucket is reported as its lower bound)."""
    from ..metrics import LATENCY_BOUNDS

    total = sum(buckets)
    if total <= 0:
        return None
    target = q * total
    acc = 0
    for i, c in enumerate(buckets):
        acc += c
        if acc >= target:
            bound = LATENCY_BOUNDS[i] if i < len(LATENCY_BOUNDS) else LATENCY_BOUNDS[-1]
            return round(bound * 1000, 3)
    return round(LATENCY_BOUNDS[-1] * 1000, 3)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _safe_next(nxt: str | None) -> str:
    """A path of this console to return to after signing in, or ``/runs``: only
    printable ASCII without a backslash (a browser drops tabs and newlines from a
    ``Location``, so ``/\\t/evil.example`` would be ``//evil.example``, another site),
    starting with one ``/``, with neither scheme nor host once parsed, not the login."""
    if not nxt or _SAFE_NEXT.fullmatch(nxt) is None or nxt.startswith(("//", "/login")):
        return "/runs"
    parts = urlsplit(nxt)
    if parts.scheme or parts.netloc:
        return "/runs"
    return nxt


#: a ``next`` path: printable ASCII but the backslash, from a single "/"
_SAFE_NEXT = re.compile(r"/[\x21-\x5b\x5d-\x7e]*")
#: a static file's name: no dot first, no slash (but the vendored files' ``vendor/``), NUL
#: or other control
_STATIC_NAME = re.compile(r"(?:vendor/)?[A-Za-z0-9_-][A-Za-z0-9_.-]*")


def _local_next(request: Request) -> str:
    """The request's own path and query, as sent (percent-encoded: what
    :func:`_safe_next` takes back)."""
    raw = request.scope.get("raw_path")
    path = raw.decode("latin-1") if raw else quote(request.scope["path"])
    return path + ("?" + request.url.query if request.url.query else "")


def _html(text: str, status: int = 200) -> Response:
    return Response(text, status_code=status, media_type="text/html; charset=utf-8")


def _redirect(location: str) -> Response:
    return Response(b"", status_code=303, headers={"location": location})


async def serve_console(service, host: str, port: int, *, shutdown: trio.Event | None = None, certfile=None,
                        keyfile=None, max_connections: int = 1024, first_request_s: float = 10.0,
                        graceful_s: float = 5.0, metrics: Any = None, hosts=(),
                        listener_options: dict | None = None, trend_period_s: float | None = None,
                        task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the console on ``host:port`` (0: a free port) until ``shutdown`` is set: the
    HTTP listener of the API (:func:`rallypoint.http.serve_http`: its accept loop,
    connection limit, timeouts, TLS with ``certfile``/``keyfile``) over a
    :class:`ConsoleApp`. ``task_status.started`` gets ``(app, urls)``. ``metrics``: the
    daemon's :class:`rallypoint.metrics.Metrics` (the console's reads are counted there,
    and the Live page's chart reads it); ``hosts``: the names it is reached by besides
    ``localhost`` and its address (``--http-host``: :mod:`rallypoint.http.guard`).
    ``listener_options``: more keyword arguments of ``serve_http``
    (``max_connections_per_peer``, ``header_s``, ``body_s``, ``keep_alive_s``).
    ``trend_period_s``: seconds between two samples of the queue trends
    (:mod:`rallypoint.console.trends`; default ``$RALLYPOINT_CONSOLE_TREND_S``, else 10).
    Raises OSError if the address cannot be bound."""
    import functools

    from ..http.server import serve_http

    import os

    from .trends import PERIOD_S

    app = ConsoleApp(service, secure_cookie=certfile is not None)
    if trend_period_s is None:
        trend_period_s = float(os.environ.get("RALLYPOINT_CONSOLE_TREND_S") or PERIOD_S)
    app.trends.period_s = trend_period_s
    stop = shutdown if shutdown is not None else trio.Event()
    async with trio.open_nursery() as nursery:
        _api, urls = await nursery.start(functools.partial(
            serve_http, None, host, port, certfile=certfile, keyfile=keyfile, max_connections=max_connections,
            first_request_s=first_request_s, graceful_s=graceful_s, metrics=metrics, shutdown=stop, api=app,
            hosts=hosts, **(listener_options or {})))

        trends_scope = trio.CancelScope()

        async def end_streams():
            await stop.wait()
            app.stop()
            trends_scope.cancel()

        async def sample_trends():
            with trends_scope:
                await app.trends.run()

        nursery.start_soon(end_streams)
        nursery.start_soon(sample_trends)
        task_status.started((app, urls))
