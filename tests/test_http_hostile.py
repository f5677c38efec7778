"""The HTTP listener under hostile input (issue 34, items 9-11; issue 31, item 2): what
the TCP listener already passes (tests/test_hostile*.py), over HTTP.

- Connections (item 9): a peer that closes frees its connection and descriptor at once
  (hypercorn kept it half-open for its 75 s idle timer); a connection that sends no
  request is dropped after ``--handshake-timeout``, an idle keep-alive one after the
  keep-alive timeout; ``--max-connections`` holds for HTTP (503 UNAVAILABLE); running
  out of descriptors (a real daemon under a lowered RLIMIT_NOFILE) stops neither
  listener, and logs no ERROR.
- Bodies (item 10): JSON nested deeper than ``MAX_JSON_DEPTH`` (even in an ignored
  field) and integers beyond 64 bits (in a field, a payload, a money string, a query)
  are 400 VALIDATION_FAILED naming the place, never 500 INTERNAL; a body over 1 MiB is
  refused before it is all sent.
- Disconnects (item 11): a client gone mid-body is one rate-limited DEBUG line, no ERROR.
- Metrics (issue 31, item 2): every HTTP request's operation is counted and can be
  logged as slow, as over TCP.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import resource
import socket
import subprocess
import sys
import threading
import time
import types

import httpx
import msgspec
import pytest
import trio
import trio.testing

import rallypoint
from rallypoint import protocol as p
from rallypoint import wire
from rallypoint.errors import ValidationError
from rallypoint.http import serve_http
from rallypoint.http.app import INT_MAX, INT_MIN, MAX_BODY, MAX_JSON_DEPTH, HttpApi
from rallypoint.http.server import HttpListener, _Connection
from rallypoint.metrics import Metrics
from rallypoint.service import Session
from rallypoint.transport.framing import encode_frame

pytestmark = pytest.mark.timeout(300)

#: What the listener's rate-limited log writes per kind of event and window (its default).
BURST = 5
HELLO = encode_frame(msgspec.msgpack.encode(wire.Hello(wire.PROTOCOL_VERSION)))
#: what the runstate SDK sends in open mode (any bearer): a POST without a JSON body is
#: then not a cross-site form (rallypoint.http.app.json_content_type)
OPEN_KEY = {"authorization": "Bearer open-mode"}


# ============================================================== a real daemon with --http


class HttpProc:
    """``rallypoint serve --listen 127.0.0.1:0 --http 127.0.0.1:0 --durability memory``
    with these extra flags, optionally under an RLIMIT_NOFILE of ``nofile`` descriptors
    (soft and hard); ``lines`` grows as the daemon logs (a thread drains its stderr)."""

    def __init__(self, *extra: str, nofile: int | None = None) -> None:
        self.extra = list(extra)
        self.nofile = nofile
        self.lines: list[str] = []

    def start(self) -> "HttpProc":
        def limit() -> None:
            if self.nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rallypoint", "serve", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
             "--durability", "memory", *self.extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=limit)
        self._drain = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self._drain.start()
        for line in self.proc.stdout:
            if line.startswith("READY "):
                self.tcp_port = int(line.split()[1].rsplit(":", 1)[1])
            elif line.startswith("HTTP "):
                self.http_url = line.split()[1]
                self.http_port = int(self.http_url.rsplit(":", 1)[1])
                return self
        raise RuntimeError(f"the daemon did not start: {''.join(self.lines)}")

    def fds(self) -> int:
        """Descriptors the daemon holds now."""
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(60)
        finally:
            self._drain.join(5)


@contextlib.contextmanager
def http_daemon(*extra: str, nofile: int | None = None):
    d = HttpProc(*extra, nofile=nofile).start()
    try:
        yield d
        assert d.proc.poll() is None, "the daemon died:\n" + "".join(d.lines)
    finally:
        rc = d.stop()
    assert rc == 0, "".join(d.lines)


def wait_for(cond, timeout: float, what: str) -> None:
    """Poll ``cond()`` until it is true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)


def errors_in(lines: list[str]) -> list[str]:
    return [ln for ln in lines if " ERROR " in ln or "Traceback" in ln]


def http_get(port: int, path: str = "/v1/spaces/default/scopes/sc_nope") -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n\r\n".encode()


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, f"closed after {len(buf)} of {n} bytes"
        buf += chunk
    return buf


def read_response(s: socket.socket) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response with a content-length from a blocking socket."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        assert chunk, f"closed before a response: {buf!r}"
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    n = int(headers.get("content-length", "0"))
    while len(body) < n:
        chunk = s.recv(65536)
        assert chunk
        body += chunk
    return int(lines[0].split()[1]), headers, body


# ------------------------------------------------------------------ item 9: descriptors


def test_connections_closed_by_the_peer_free_their_descriptors_at_once():
    """The reported case: connections opened and closed without a request (and, the same
    bug, keep-alive connections closed after one) held a descriptor each for hypercorn's
    75 s idle timer. They are freed as soon as the peer's FIN is read."""
    with http_daemon() as d:
        base = d.fds()
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", d.http_port))
            s.close()
        for _ in range(50):
            with socket.create_connection(("127.0.0.1", d.http_port)) as s:
                s.sendall(http_get(d.http_port))
                assert read_response(s)[0] == 404
        wait_for(lambda: d.fds() <= base, 10, f"descriptors back to {base} (now {d.fds()})")
        assert not errors_in(d.lines), "".join(d.lines)


def test_a_connection_that_sends_no_request_is_dropped_after_the_handshake_timeout():
    """``--handshake-timeout`` is also the time an HTTP connection has for its first
    request (hypercorn gave it the 75 s keep-alive timeout)."""
    with http_daemon("--handshake-timeout", "0.5") as d:
        for sent in (b"", b"GET /v1/spaces/default/scopes/sc_x HTTP/1.1\r\nhost: localhost\r\n"):  # nothing; half a head
            s = socket.create_connection(("127.0.0.1", d.http_port))
            s.sendall(sent)
            s.settimeout(15)
            t0 = time.monotonic()
            got = s.recv(65536)
            assert got == b"", got  # closed by the server, no answer
            assert 0.4 < time.monotonic() - t0 < 10
            s.close()


def test_max_connections_holds_for_http():
    """``--max-connections 3``: three connections are served and each has begun its next
    request (not idle: none can be closed to make room), a fourth is answered 503
    UNAVAILABLE (the error envelope, Retry-After: 1) and closed; once one of the three
    closes, a new connection is served again."""
    with http_daemon("--max-connections", "3") as d:
        held = []
        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", d.http_port))
            s.sendall(http_get(d.http_port))
            assert read_response(s)[0] == 404  # accepted and served: it counts
            s.sendall(b"GET /v1/spaces/default/scopes/sc_next HTTP/1.1\r\n")  # the next head, begun
            held.append(s)
        with socket.create_connection(("127.0.0.1", d.http_port)) as s:
            s.sendall(http_get(d.http_port))
            status, headers, body = read_response(s)
            assert status == 503 and headers["retry-after"] == "1", (status, headers, body)
            err = msgspec.json.decode(body)["error"]
            assert err["code"] == "UNAVAILABLE" and "--max-connections" in err["message"], err
            s.settimeout(10)
            assert s.recv(1) == b""  # and closed
        held.pop().close()

        def served() -> bool:
            with socket.create_connection(("127.0.0.1", d.http_port)) as s:
                s.sendall(http_get(d.http_port))
                return read_response(s)[0] == 404

        wait_for(served, 10, "a fourth connection served once one of three closed")
        for s in held:
            s.close()
        assert not errors_in(d.lines), "".join(d.lines)


def _exhaust(d: HttpProc, port: int, nofile: int) -> list[socket.socket]:
    """Open connections to ``port`` (never closed, never sending) until the daemon holds
    every descriptor it may."""
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(nofile)]
    wait_for(lambda: d.fds() >= nofile, 20, f"the daemon at its {nofile}-descriptor limit (holds {d.fds()})")
    return held


def test_running_out_of_descriptors_stops_neither_listener():
    """A daemon limited to 80 descriptors. HTTP connections take every one; a TCP client
    that connects meanwhile is answered once they close (the TCP listener went on), and
    so is a new HTTP request. Then the other way round: TCP connections take them all,
    an HTTP request waits and is answered once they close. No ERROR line; the failed
    accepts are rate-limited WARNING lines."""
    nofile = 80
    with http_daemon("--handshake-timeout", "120", "--idle-ping", "0", nofile=nofile) as d:
        t0 = time.monotonic()
        held = _exhaust(d, d.http_port, nofile)
        tcp = socket.create_connection(("127.0.0.1", d.tcp_port))
        tcp.sendall(HELLO)  # waits in the listen queue: no descriptor to accept it with
        for s in held:
            s.close()
        tcp.settimeout(20)
        head = recv_exact(tcp, 4)  # the TCP listener answers once descriptors are free
        reply = msgspec.msgpack.decode(recv_exact(tcp, int.from_bytes(head, "big")))
        assert reply.get("t") == "hello_ok", reply
        tcp.close()
        r = httpx.get(f"{d.http_url}/v1/spaces/default/scopes/sc_nope", timeout=20)
        assert r.status_code == 404, r.text

        held = _exhaust(d, d.tcp_port, nofile)
        web = socket.create_connection(("127.0.0.1", d.http_port))
        web.sendall(http_get(d.http_port))  # waits in the listen queue
        for s in held:
            s.close()
        web.settimeout(20)
        assert read_response(web)[0] == 404  # the HTTP listener answers once descriptors are free
        web.close()
        took = time.monotonic() - t0
    assert not errors_in(d.lines), "".join(d.lines)
    failed = [ln for ln in d.lines if "accept failed" in ln]
    assert failed and all(" WARNING " in ln for ln in failed), "".join(d.lines)
    windows = int(took // 10) + 2
    http_failed = [ln for ln in failed if "HTTP listener" in ln]
    assert len(http_failed) <= BURST * windows, "".join(http_failed)  # ~10 retries a second, rate-limited


# ---------------------------------------------- item 9, in process: the connection's timers


class _Sock:
    """What hypercorn reads from a connection's socket (the addresses)."""

    family = socket.AF_INET

    def getpeername(self):
        return ("127.0.0.1", 40000)

    def getsockname(self):
        return ("127.0.0.1", 8080)


FIRST_S = 10.0
KEEP_ALIVE_S = 75.0


@contextlib.asynccontextmanager
async def connection(rs, writes: list | None = None):
    """One :class:`_Connection` of a listener over ``rs``'s coordinator, on an in-memory
    stream; yields the client's end (time is the test's MockClock). ``writes``: gets
    the bytes of each ``send_all`` the server makes."""
    from hypercorn.config import Config

    cfg = Config()
    cfg.keep_alive_timeout = KEEP_ALIVE_S
    cfg.errorlog = logging.getLogger("rallypoint.http.hypercorn")
    listener = HttpListener(HttpApi(rs.node.service), cfg, first_request_s=FIRST_S)
    client, server = trio.testing.memory_stream_pair()
    server.socket = _Sock()
    if writes is not None:
        send_all = server.send_all

        async def recorded(data):
            writes.append(bytes(data))
            await send_all(data)

        server.send_all = recorded
    async with trio.open_nursery() as nursery:
        conn = _Connection(listener.app, cfg, listener.context, {}, server, first_request_s=FIRST_S)
        nursery.start_soon(conn.run)
        yield client


async def request(client, path: str = "/v1/spaces/default/scopes/sc_nope") -> int:
    await client.send_all(f"GET {path} HTTP/1.1\r\nhost: localhost\r\n\r\n".encode())
    buf = b""
    while b"\r\n\r\n" not in buf or not buf.endswith(b"}"):
        chunk = await client.receive_some()
        assert chunk, buf
        buf += chunk
    return int(buf.split()[1])


async def test_silent_connection_closed_after_first_request_s(autojump_clock, ers):
    async with connection(ers) as client:
        t0 = trio.current_time()
        assert await client.receive_some() == b""
        assert trio.current_time() - t0 == pytest.approx(FIRST_S)


async def test_idle_keep_alive_connection_kept_for_the_keep_alive_timeout(autojump_clock, ers):
    async with connection(ers) as client:
        assert await request(client) == 404
        t1 = trio.current_time()
        assert await client.receive_some() == b""
        assert trio.current_time() - t1 == pytest.approx(KEEP_ALIVE_S)


@pytest.mark.parametrize("requests", [0, 2])
async def test_peer_eof_ends_the_connection_at_once(autojump_clock, ers, requests):
    async with connection(ers) as client:
        for _ in range(requests):
            assert await request(client) == 404
        await trio.testing.wait_all_tasks_blocked()  # the server is idle (keep-alive), not still answering
        t1 = trio.current_time()
        await client.send_eof()
        assert await client.receive_some() == b""
        assert trio.current_time() - t1 < 0.5  # was: the 75 s keep-alive timer


@pytest.mark.parametrize("path", ["/v1/spaces/default/scopes/sc_nope", "/v1/spaces/default/scopes"])
async def test_an_answer_is_one_write(autojump_clock, ers, path):
    """hypercorn sends a response's head, body and end separately; the connection sends
    a fixed-length answer (an error, a JSON view) in one write, request after request."""
    writes: list[bytes] = []
    async with connection(ers, writes) as client:
        for status in (404, 404) if path.endswith("nope") else (200, 200):
            del writes[:]
            if status == 200:
                await client.send_all(f"POST {path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{{}}".encode())
                buf = b""
                while not buf.endswith(b"}"):
                    buf += await client.receive_some()
                got = int(buf.split()[1])
            else:
                got = await request(client, path)
            assert got == status
            await trio.testing.wait_all_tasks_blocked()
            assert len(writes) == 1, writes
            head, body = writes[0].split(b"\r\n\r\n", 1)
            assert head.startswith(b"HTTP/1.1 %d " % status) and body.startswith(b"{") and body.endswith(b"}")
            assert b"content-length: %d" % len(body) in head.lower()


async def test_a_head_without_content_length_goes_out_at_once_and_a_held_one_before_any_other_event():
    """A streamed (chunked) head is not held; a fixed-length head waits for the next
    bytes, or goes out alone before an event that is no bytes (the connection idle)."""
    from hypercorn.config import Config
    from hypercorn.events import RawData, Updated

    sent: list[bytes] = []

    class Stream:
        async def send_all(self, data):
            sent.append(bytes(data))

    from hypercorn.trio.worker_context import WorkerContext

    conn = _Connection(None, Config(), WorkerContext(None), {}, Stream(), first_request_s=FIRST_S)
    chunked = b"HTTP/1.1 200 \r\ntransfer-encoding: chunked\r\n\r\n"
    await conn.protocol_send(RawData(data=chunked))
    assert sent == [chunked]
    fixed = b"HTTP/1.1 200 \r\nContent-Length: 5\r\n\r\n"
    await conn.protocol_send(RawData(data=fixed))
    assert sent == [chunked]  # held
    await conn.protocol_send(RawData(data=b"hello"))
    assert sent == [chunked, fixed + b"hello"]
    await conn.protocol_send(RawData(data=b""))  # the end of a content-length response: nothing to send
    assert len(sent) == 2
    await conn.protocol_send(RawData(data=fixed))
    await conn.protocol_send(Updated(idle=False))
    assert sent == [chunked, fixed + b"hello", fixed]
    cont = b"HTTP/1.1 100 \r\ncontent-length: 0\r\n\r\n"  # informational: never held
    await conn.protocol_send(RawData(data=cont))
    assert sent[-1] == cont


async def test_stop_closes_connections_that_sent_nothing_at_once():
    """On SIGTERM (``shutdown``) a connection that has sent nothing yet is closed at once,
    not after its first-request timeout or the graceful period."""
    async with rallypoint.open_embedded() as rs:
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            api, urls = await nursery.start(functools.partial(
                serve_http, rs.node.service, "127.0.0.1", 0, first_request_s=60, graceful_s=60, shutdown=stop))
            silent = await trio.open_tcp_stream("127.0.0.1", int(urls[0].rsplit(":", 1)[1]))
            with trio.fail_after(10):
                while api.listener.connections < 1:
                    await trio.sleep(0.01)
            stop.set()
            with trio.fail_after(10):
                assert await silent.receive_some() == b""
        await silent.aclose()


# ============================================================== an in-process listener


@pytest.fixture
async def http(request):
    """``serve_http`` on 127.0.0.1:0 over an embedded (memory) coordinator, with
    metrics (every request slow: ``slow_s`` 1 ns); yields a namespace: ``api``,
    ``base`` (…/v1/spaces/default), ``port``, ``metrics``, ``rs``."""
    async with rallypoint.open_embedded() as rs:
        metrics = Metrics(rs.node.coordinator, slow_s=1e-9)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            api, urls = await nursery.start(functools.partial(
                serve_http, rs.node.service, "127.0.0.1", 0, metrics=metrics, shutdown=stop))
            port = int(urls[0].rsplit(":", 1)[1])
            yield types.SimpleNamespace(api=api, base=f"{urls[0]}/v1/spaces/default", port=port,
                                        metrics=metrics, rs=rs)
            stop.set()


def _errors(caplog) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _validation(r: httpx.Response, *words: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "VALIDATION_FAILED", err
    for w in words:
        assert w in err["message"], err
    return err


# ------------------------------------------------------------------ item 10: bodies


async def test_deep_json_is_validation_failed_even_in_an_ignored_field(http, caplog):
    async with httpx.AsyncClient(base_url=http.base, headers=OPEN_KEY) as c:
        for depth in (1_000, 5_000, 100_000, MAX_JSON_DEPTH):  # the body's depth is one more
            body = b'{"name": "x", "ignored": ' + _nested(depth) + b"}"
            r = await c.post("/scopes", content=body, headers={"content-type": "application/json"})
            _validation(r, f"nested more than {MAX_JSON_DEPTH} levels")
        _validation(await c.post("/scopes", content=_nested(2_000)), "nested")
        # as deep as allowed: stored, and read back the same
        mbx = (await c.post("/mailboxes", json={"name": "deep", "mode": "INBOX"})).json()["id"]
        run = (await c.post("/scopes", json={"name": "r"})).json()["id"]
        deepest = b'{"scopeId": "%s", "payload": ' % run.encode() + _nested(MAX_JSON_DEPTH - 1) + b"}"
        r = await c.post(f"/mailboxes/{mbx}/messages", content=deepest)
        assert r.status_code == 200, r.text
        got = (await c.get(f"/mailboxes/{mbx}/messages")).json()["messages"][0]["payload"]
        assert msgspec.json.encode(got) == _nested(MAX_JSON_DEPTH - 1)
    assert not _errors(caplog), _errors(caplog)


async def test_integers_beyond_64_bits_are_validation_failed_naming_the_field(http, caplog):
    big = 10**26
    async with httpx.AsyncClient(base_url=http.base, headers=OPEN_KEY) as c:
        err = _validation(await c.put("/budgets/by-name/b", json={"limitMinor": big}), "limitMinor", "64-bit")
        assert err["details"]["field"] == "limitMinor"
        _validation(await c.put("/budgets/by-name/b", json={"limitMinor": str(big)}), "limitMinor")
        run = (await c.post("/scopes", json={"name": "r"})).json()["id"]
        mbx = (await c.post("/mailboxes", json={"name": "ints", "mode": "INBOX"})).json()["id"]
        digits30 = 123456789012345678901234567890
        err = _validation(await c.post(f"/mailboxes/{mbx}/messages",
                                       json={"scopeId": run, "payload": {"rows": [1, {"n": digits30}]}}), "64-bit")
        assert err["details"]["field"] == "payload.rows[1].n", err
        _validation(await c.post("/scopes", json={"name": "x", "ignored": -(2**64)}), "ignored")
        # the edges of the range are values like any other
        edges = {"scopeId": run, "payload": [INT_MIN, INT_MAX, 10**18]}
        assert (await c.post(f"/mailboxes/{mbx}/messages", json=edges)).status_code == 200
        got = (await c.get(f"/mailboxes/{mbx}/messages")).json()["messages"][0]["payload"]
        assert got == [INT_MIN, INT_MAX, 10**18]
        # numbers in the query and tokens: the same kind
        _validation(await c.get("/watch", params={"waitSeconds": "1e400"}), "waitSeconds")
        _validation(await c.get(f"/mailboxes/{mbx}/messages", params={"limit": "lots"}), "limit")
        _validation(await c.get(f"/mailboxes/{mbx}/messages", params={"limit": str(big)}), "limit")
        _validation(await c.post(f"/mailboxes/{mbx}/recv", json={"scopeId": run, "waitMs": "1e400"}), "waitMs")
        r = await c.post("/claims/k/renew", json={"token": "9" * 30})
        assert r.status_code == 409 and r.json()["error"]["code"] == "STALE_CLAIM", r.text
        r = await c.get("/events", params={"cursor": "9" * 30})
        assert r.status_code == 410, r.text
    assert not _errors(caplog), _errors(caplog)


async def test_an_operation_with_an_int_the_wire_cannot_carry_is_validation_failed(autojump_clock, ers):
    """The layer under every in-process caller (HTTP, embedded): an op whose int msgpack
    cannot encode is VALIDATION_FAILED naming the field (was: OverflowError)."""
    op = p.BudgetEnsure(name="b", limit_minor=10**26)
    with pytest.raises(ValidationError) as e:
        await ers.node.service.call(Session(), op)
    assert e.value.details["field"] == "limit_minor" and "64-bit" in e.value.message


async def test_a_body_over_the_limit_is_refused_before_it_is_all_sent(http):
    """A declared 100 MiB body, and a chunked one past 1 MiB: 400 while the client is
    still sending (the body was read whole first)."""
    async def refused(head: bytes, chunk: bytes) -> bytes:
        s = await trio.open_tcp_stream("127.0.0.1", http.port)
        await s.send_all(head)
        got = b""

        async def push():
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                for _ in range(200):  # at most ~13 MiB: far less than declared
                    await s.send_all(chunk)
                    await trio.sleep(0)

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(push)
                while b"\r\n\r\n" not in got:
                    data = await s.receive_some()
                    assert data, got
                    got += data
                nursery.cancel_scope.cancel()
        await s.aclose()
        return got

    head = (b"POST /v1/spaces/default/scopes HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % (100 * MAX_BODY))
    got = await refused(head, b" " * 65536)
    assert got.startswith(b"HTTP/1.1 400"), got[:200]
    chunked = b"POST /v1/spaces/default/scopes HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    got = await refused(chunked, b"10000\r\n" + b" " * 65536 + b"\r\n")
    assert got.startswith(b"HTTP/1.1 400"), got[:200]


# ------------------------------------------------------------------ item 11: disconnects


async def test_clients_gone_mid_body_are_one_rate_limited_debug_line(http, caplog):
    caplog.set_level(logging.DEBUG, logger="rallypoint.http")
    n = 30
    for _ in range(n):
        s = await trio.open_tcp_stream("127.0.0.1", http.port)
        await s.send_all(b"POST /v1/spaces/default/scopes HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n"
                         b'{"name": "cut')
        await s.aclose()
    with trio.fail_after(20):
        while http.api.disconnects < n:
            await trio.sleep(0.01)
    http.api.flush_logs()
    assert not _errors(caplog), _errors(caplog)
    lines = [r for r in caplog.records if r.getMessage().startswith("HTTP client ")]
    assert 1 <= len(lines) <= BURST and all(r.levelno == logging.DEBUG for r in lines), lines
    assert not any(r.exc_info for r in lines)
    summary = [r.getMessage() for r in caplog.records if "similar events suppressed" in r.getMessage()]
    assert summary and summary[0].startswith(f"http-disconnect: {n - len(lines)} similar"), summary


# ------------------------------------------------------------------ issue 31 item 2: metrics


async def test_every_http_request_is_counted_and_can_be_slow(http, caplog):
    caplog.set_level(logging.WARNING, logger="rallypoint.metrics")
    reg = http.metrics.registry()

    def sample(name: str, **labels) -> float:
        return reg.get_sample_value(name, labels) or 0.0

    before = sample("rallypoint_requests_total", op="scope.create", code="OK")
    async with httpx.AsyncClient(base_url=http.base, headers=OPEN_KEY) as c:
        for i in range(4):
            assert (await c.post("/scopes", json={"name": f"m{i}"})).status_code == 200
        assert (await c.get("/scopes/sc_nope")).status_code == 404
    assert sample("rallypoint_requests_total", op="scope.create", code="OK") - before == 4
    assert sample("rallypoint_request_duration_seconds_count", op="scope.create") == 4
    assert sample("rallypoint_requests_total", op="scope.status", code="NOT_FOUND") == 1
    slow = [r for r in caplog.records if getattr(r, "event", None) == "slow_request"]
    assert any(r.op == "scope.create" and r.peer.startswith("127.0.0.1:") for r in slow), slow


async def test_http_listener_statistics_reach_the_metrics(http):
    http.metrics.http = http.api.listener
    reg = http.metrics.registry()
    async with httpx.AsyncClient(base_url=http.base, headers=OPEN_KEY) as c:
        assert (await c.get("/scopes/sc_nope")).status_code == 404
        assert reg.get_sample_value("rallypoint_http_connections") == 1
    assert reg.get_sample_value("rallypoint_http_accept_errors_total") == 0


# ------------------------------------------------------------------ the same over TLS


async def test_tls_serves_http11_and_h2_and_holds_the_limits(tmp_path):
    """``--tls-cert/--tls-key``: HTTP/1.1 and h2 (ALPN) are served; a connection over
    ``max_connections`` gets the 503 after its handshake; a TLS connection that never
    handshakes is dropped after ``first_request_s``."""
    import ssl

    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert_pem, key_pem = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(cert_pem))
    cert.private_key_pem.write_to_path(str(key_pem))
    trust = ssl.create_default_context()
    ca.configure_trust(trust)
    async with rallypoint.open_embedded() as rs:
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            api, urls = await nursery.start(functools.partial(
                serve_http, rs.node.service, "127.0.0.1", 0, certfile=str(cert_pem), keyfile=str(key_pem),
                max_connections=1, first_request_s=0.5, shutdown=stop))
            assert urls[0].startswith("https://127.0.0.1:")
            base = f"{urls[0]}/v1/spaces/default"
            for h2 in (False, True):
                with trio.fail_after(10):  # the last client's connection has ended
                    while api.listener.connections:
                        await trio.sleep(0.01)
                async with httpx.AsyncClient(verify=trust, http2=h2) as c:
                    r = await c.post(f"{base}/scopes", json={"name": "tls"})
                    assert r.status_code == 200 and r.http_version == ("HTTP/2" if h2 else "HTTP/1.1"), r
                    async with httpx.AsyncClient(verify=trust) as other:  # a second connection: over the limit
                        r = await other.get(f"{base}/scopes/sc_nope")
                        assert r.status_code == 503 and r.json()["error"]["code"] == "UNAVAILABLE", r.text
            port = int(urls[0].rsplit(":", 1)[1])
            silent = await trio.open_tcp_stream("127.0.0.1", port)
            t0 = trio.current_time()
            with trio.fail_after(10):
                assert await silent.receive_some() == b""
            assert trio.current_time() - t0 >= 0.4
            await silent.aclose()
            stop.set()
