"""What every HTTP listener refuses before its application sees a request.

:class:`HttpGuard` is the ASGI application :class:`~rallypoint.http.server.HttpListener`
runs in front of the one it serves -- the HTTP API of a single node or a leader
(:class:`~rallypoint.http.app.HttpApi`), a cluster node's forwarder
(:class:`~rallypoint.cluster.forward.ClusterHttpApp`) and the web console
(:class:`~rallypoint.console.app.ConsoleApp`) -- so none of them can forget a rule
(docs/http.md, "What the HTTP port refuses"). hypercorn and h11 parse the request; what
they let through and this refuses:

- **A request-target that is not an origin-form path** (RFC 9112 §3.2.1): it must start
  with exactly one ``/``. The absolute form (``GET http://host/x``), the authority form
  (``CONNECT host:443``), the asterisk form (``OPTIONS *``), ``@host:port/x``,
  ``//host/x``, a backslash anywhere in the path and their percent-encoded spellings
  (``/%2F...``, ``/%5C...``) are 400 VALIDATION_FAILED, before any routing: a forwarder
  builds its URL from its peer's address and this path, so no request can name another
  host (:func:`target_problem`).
- **Ambiguous framing** (request smuggling, RFC 9112 §6.1): a request carrying both
  ``Content-Length`` and ``Transfer-Encoding`` is 400 and its connection closed after the
  answer (h11 itself refuses conflicting ``Content-Length`` values, a
  ``Transfer-Encoding`` other than ``chunked`` and malformed heads with 400, and closes).
- **A Host this server was not named by** (DNS rebinding): the ``Host`` (HTTP/2:
  ``:authority``) name must be ``localhost``, the name the listener was given
  (``--http myhost:8080``) or one of ``--http-host`` (``names``); an IP literal must be a
  loopback address, the address the connection reached, or one of ``names``. The port is
  not compared. Refused with 421 Misdirected Request. An IP literal is never a rebinding:
  a browser sends the name of the page's own origin, so a page that sends one is this
  server's own. A request without Host (HTTP/1.0) is no browser's and passes.
- **A WebSocket upgrade** (hypercorn answered 500 when the application declined it):
  400, the connection closed; the same request without ``Upgrade`` is served.

Every refusal is counted per kind (:attr:`HttpGuard.refused`: ``target``, ``framing``,
``host``, ``websocket``) and logged at INFO at most once per ``window_s`` seconds per
kind, with the count of the rest (:class:`~rallypoint.logutil.RateLimitedLogger`,
``burst=1``); every value a client sent is escaped (:func:`~rallypoint.logutil.printable`)
before it is logged.
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
from collections import Counter
from typing import Any, Iterable

import msgspec
import trio

from ..logutil import RateLimitedLogger, printable

log = logging.getLogger("rallypoint.http")

__all__ = ["HttpGuard", "HostCheck", "target_problem", "LOOPBACK_NAMES", "WINDOW_S"]

#: Names that always reach this host (RFC 6761 §6.3: browsers resolve ``localhost``
#: themselves, never through a DNS server an attacker controls).
LOOPBACK_NAMES = frozenset({"localhost"})
#: Seconds of a refusal log window: at most one line per kind of refusal and window.
WINDOW_S = 10.0
#: What a refusal reads of a request's body at most before it answers (bytes), so the
#: close that follows sends no RST over the answer; the rest is never read.
DRAIN_BYTES = 64 * 1024
#: ... and for at most this long (seconds).
DRAIN_S = 1.0

_encode = msgspec.json.Encoder().encode
#: Host answers a HostCheck remembers
_CACHE = 1024


def target_problem(raw_path: bytes) -> str | None:
    """Why ``raw_path`` (a request-target without its query, bytes as sent) is not an
    origin-form path starting with exactly one ``/``, or None when it is. Percent-encoded
    slashes and backslashes at the start count as what they decode to; ``%2F`` inside a
    segment (a name holding a slash) is fine."""
    second = raw_path[1:2]
    if raw_path[:1] == b"/" and second != b"/" and second != b"%" and b"\\" not in raw_path:
        return None  # (the common case, in one test)
    if not raw_path.startswith(b"/"):
        if raw_path == b"*":
            return "the asterisk form (OPTIONS *) is not served; send a path starting with /"
        return "the request-target must be a path starting with / (not an absolute URL or host:port)"
    if raw_path.startswith(b"//"):
        return "the request-target starts with //"
    if b"\\" in raw_path:
        return "the request-target holds a backslash"
    head = raw_path[:4].lower()
    if head in (b"/%2f", b"/%5c"):
        return "the request-target starts with an encoded / or \\"
    return None


def _host_name(value: str) -> str | None:
    """The host part of a ``Host`` value (``name``, ``name:port``, ``1.2.3.4:80``,
    ``[::1]:80``), lower-case, without a trailing dot; None when it is not one."""
    v = value.strip()
    if v.startswith("["):
        end = v.find("]")
        if end < 0 or (v[end + 1:] and not (v[end + 1] == ":" and v[end + 2:].isdigit())):
            return None
        return v[1:end].lower()
    host, sep, port = v.rpartition(":")
    if not sep:
        host = v
    elif not (port.isascii() and port.isdigit()):
        return None
    if not host or any(c in host for c in "@/\\ \t?#[]:"):
        return None
    return host.lower().rstrip(".")


def _ip(text: str):
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped if mapped is not None else ip


class HostCheck:
    """Which ``Host`` values a listener answers (see the module docstring).

    Args:
        names: extra names or IP addresses the server is reached by (``--http-host``).
        listen_host: the host the listener was given (``--http HOST:PORT``); a name or
            a specific address is accepted too (a wildcard address is not a name).

    Raises:
        ValueError: a name that is not a host name or IP address (``"a/b"``).
    """

    def __init__(self, names: Iterable[str] = (), listen_host: str | None = None) -> None:
        self.names: set[str] = set()
        self.ips: set[Any] = set()
        self._seen: dict[tuple, bool] = {}
        given = list(names)
        for n in given:
            self._add(n, strict=True)
        if listen_host:
            ip = _ip(listen_host.strip("[]"))
            if ip is None or not ip.is_unspecified:
                self._add(listen_host, strict=False)

    def _add(self, name: str, *, strict: bool) -> None:
        n = name.strip()
        ip = _ip(n.strip("[]"))
        if ip is not None:
            self.ips.add(ip)
            return
        host = _host_name(n)
        if host is None or ":" in n:
            if strict:
                raise ValueError(f"not a host name or IP address: {name!r} (give it without scheme, port or path)")
            return
        self.names.add(host)

    def allows(self, value: str | None, server: tuple | None = None) -> bool:
        """Whether the ``Host`` header ``value`` (None or empty: none sent) names this
        server, for a connection that reached the local address ``server``
        (``(host, port)``, ASGI's ``scope["server"]``). Answers are remembered (at most
        :data:`_CACHE` of them; then forgotten all at once)."""
        if not value:
            return True
        key = (value, server[0] if server else None)
        got = self._seen.get(key)
        if got is None:
            if len(self._seen) >= _CACHE:
                self._seen.clear()
            got = self._seen[key] = self._allows(value, server)
        return got

    def _allows(self, value: str, server: tuple | None) -> bool:
        host = _host_name(value)
        if host is None:
            return False
        if host in LOOPBACK_NAMES or host in self.names:
            return True
        ip = _ip(host)
        if ip is None:
            return False
        if ip.is_loopback or ip in self.ips:
            return True
        if server:
            local = _ip(str(server[0]))
            if local is not None and local == ip:
                return True
        return False


def _first_header(headers, name: bytes) -> bytes | None:
    for k, v in headers:
        if k == name:
            return v
    return None


class HttpGuard:
    """The ASGI application in front of ``app`` (see the module docstring).

    Args:
        app: the ASGI application served (its ``log_limiter``, ``flush_logs`` and
            other attributes stay the app's).
        hosts: a :class:`HostCheck` (default: loopback names only, plus the address a
            connection reached).
        window_s: seconds of a refusal log window (> 0).

    Attributes:
        refused: a Counter of refusals by kind.
    """

    def __init__(self, app, *, hosts: HostCheck | None = None, window_s: float = WINDOW_S) -> None:
        self.app = app
        self.hosts = hosts if hosts is not None else HostCheck()
        self.refused: Counter[str] = Counter()
        self.log_limiter = RateLimitedLogger(log, window_s=window_s, burst=1)

    def flush_logs(self) -> None:
        """Report the refusals the log suppressed (call on stop)."""
        self.log_limiter.flush()

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind == "http":
            refusal = self.check(scope)
            if refusal is None:
                await self.app(scope, receive, send)
                return
            what, status, message = refusal
            self._note(what, scope, message)
            await _drain(receive)
            body = _envelope(message)
            await send({"type": "http.response.start", "status": status, "headers": _headers(body)})
            await send({"type": "http.response.body", "body": body, "more_body": False})
        elif kind == "websocket":
            message = "this server speaks no WebSocket; send the request without Upgrade"
            self._note("websocket", scope, message)
            body = _envelope(message)
            await send({"type": "websocket.http.response.start", "status": 400, "headers": _headers(body)})
            await send({"type": "websocket.http.response.body", "body": body, "more_body": False})
        else:  # lifespan
            await self.app(scope, receive, send)

    def check(self, scope) -> tuple[str, int, str] | None:
        """``(kind, status, message)`` of the refusal of the HTTP request ``scope``, or
        None when it passes."""
        raw = scope.get("raw_path") or scope.get("path", "").encode("latin-1", "replace")
        problem = target_problem(raw)
        if problem is not None:
            return "target", 400, problem
        headers = scope.get("headers") or ()
        length = coding = False
        host = None
        for k, v in headers:
            if k == b"content-length":
                length = True
            elif k == b"transfer-encoding":
                coding = True
            elif k == b"host" and host is None:
                host = v
        if length and coding:
            return "framing", 400, "a request may not carry both Content-Length and Transfer-Encoding"
        if not self.hosts.allows(host.decode("latin-1") if host is not None else None, scope.get("server")):
            return "host", 421, (f"this server is not {printable(host, 100)}: it answers to localhost, its "
                                 "listen address and the names given with --http-host")
        return None

    def _note(self, what: str, scope, message: str) -> None:
        self.refused[what] += 1
        client = scope.get("client")
        peer = f"{client[0]}:{client[1]}" if client else "?"
        raw = scope.get("raw_path") or b""
        self.log_limiter.log(logging.INFO, f"http-refused-{what}", "HTTP: refused %s %s from %s (Host %s): %s",
                             printable(scope.get("method", "GET"), 20), printable(raw, 120), peer,
                             printable(_first_header(scope.get("headers") or (), b"host") or b"-", 100), message)


def _envelope(message: str) -> bytes:
    return _encode({"error": {"code": "VALIDATION_FAILED", "message": message, "requestId": secrets.token_hex(8)}})


def _headers(body: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
            (b"connection", b"close")]


async def _drain(receive) -> None:
    """Read what the request's body has ready, up to :data:`DRAIN_BYTES` and
    :data:`DRAIN_S`, so closing the connection after the answer does not reset it
    before the client read the answer."""
    n = 0
    with trio.move_on_after(DRAIN_S):
        while n <= DRAIN_BYTES:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            n += len(msg.get("body", b""))
            if not msg.get("more_body"):
                return
